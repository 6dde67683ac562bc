"""The trainer on torch.distributed: data parallelism over the trees of a batch (gloo on CPU, NCCL on GPU), and
FSDP (`fully_shard`) on GPU for models that do not fit one device.

`forge-stream train --nproc N` re-launches itself under torchrun (`launch`); each worker calls `from_env`. Rank 0
alone runs the windowed FIFO consumer, publishes PolicyVersion/TrainStep, commits and writes checkpoints
(forge_stream.trainer.service); it hands every batch to all ranks (`DataParallel.broadcast`). Each rank then
trains its share of the batch's trees (`balance`: greedy by unique tokens, the same answer on every rank) with
the loss normalised by the completion tokens of the WHOLE batch, so the sum of the ranks' gradients is the
single-process gradient. Plain data parallelism sums the gradients with one all_reduce over a flat buffer; FSDP
reduce-scatters them with its divide factor set to 1 (a sum), and pads every rank to the same number of forward
passes, whose collectives must pair up. Every rank then clips the same reduced gradients and takes the same
optimizer step; whether a step is skipped as non-finite is agreed by an all_reduce.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from forge_stream.trainer.step import (
    StepConfig, accumulate_gradients, completion_tokens, has_signal, micro_batch_plan,
)


def balance(sizes: Sequence[int], world_size: int) -> list[list[int]]:
    """Indices of the items per rank: largest first onto the least-loaded rank (ties: the lower index and the
    lower rank), each rank's share in the original order.

    >>> balance([5, 1, 9, 4, 4], 2)
    [[2, 4], [0, 1, 3]]
    >>> balance([3], 3)
    [[0], [], []]
    """
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(i)
        loads[rank] += sizes[i]
    return [sorted(share) for share in shares]


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the ranks (the `Ranks` of forge_stream.trainer.step.train_step)."""

    rank: int
    world_size: int
    device: torch.device
    fsdp: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, samples: Sequence[dict]) -> list[dict]:
        """This rank's samples, balanced by unique tokens (tree rows)."""
        return [samples[i] for i in balance([len(s["token_ids"]) for s in samples], self.world_size)[self.rank]]

    def accumulate(self, model: torch.nn.Module, samples: Sequence[dict], config: StepConfig) -> dict:
        mine = self.share([s for s in samples if has_signal(s)])  # the others count in the normalizer only
        pad_to = 0
        if self.fsdp:
            passes = len(micro_batch_plan(mine, config.token_budget))
            pad_to = int(self._reduce(torch.tensor([passes]), dist.ReduceOp.MAX)[0])
        acc = accumulate_gradients(model, mine, config, completion_tokens(samples), pad_to)
        if not self.fsdp:
            self._sum_gradients(model)
        return self._batch_stats(acc)

    def agree(self, ok: bool) -> bool:
        return bool(self._reduce(torch.tensor([int(ok)]), dist.ReduceOp.MIN)[0])

    def broadcast(self, obj=None):
        """Rank 0's `obj` on every rank (any picklable object: a Batch, a policy version, None to stop)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

    def sync_parameters(self, model: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers on every rank (plain data parallelism)."""
        for tensor in (*model.parameters(), *model.buffers()):
            dist.broadcast(tensor.data, src=0)

    def _reduce(self, values: torch.Tensor, op) -> torch.Tensor:
        values = values.to(self.device)
        dist.all_reduce(values, op=op)
        return values.cpu()

    def _sum_gradients(self, model: torch.nn.Module) -> None:
        """Sum .grad over the ranks; a parameter keeps grad None only if it has none on every rank."""
        params = [p for p in model.parameters() if p.requires_grad]
        has = self._reduce(torch.tensor([p.grad is not None for p in params], dtype=torch.int32), dist.ReduceOp.MAX)
        params = [p for p, h in zip(params, has.tolist()) if h]
        if not params:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for p, part in zip(params, flat.split([p.numel() for p in params])):
            p.grad = part.view_as(p).to(p.dtype)

    def _batch_stats(self, acc: dict) -> dict:
        """The whole batch's `accumulate_gradients` stats from every rank's (token-weighted means, maxima)."""
        t = acc["tokens"]
        sums = self._reduce(torch.tensor([acc["loss"], acc["clip_fraction"] * t, acc["ratio_mean"] * t,
                                          acc["mismatch_mean"] * t, t, acc["micro_batches"]], dtype=torch.float64),
                            dist.ReduceOp.SUM).tolist()
        none = float("-inf")
        maxes = self._reduce(torch.tensor([acc["ratio_max"] if t else none, acc["mismatch_max"] if t else none],
                                          dtype=torch.float64), dist.ReduceOp.MAX).tolist()
        loss, clipped, ratio, mismatch, tokens, passes = sums
        n = max(tokens, 1.0)
        return {
            "loss": loss, "loss_tokens": acc["loss_tokens"], "tokens": int(tokens), "micro_batches": int(passes),
            "clip_fraction": clipped / n, "ratio_mean": ratio / n if tokens else 1.0, "mismatch_mean": mismatch / n,
            "ratio_max": maxes[0] if tokens else 1.0, "mismatch_max": maxes[1] if tokens else 0.0,
        }


def from_env(fsdp: bool = False) -> DataParallel:
    """Join the process group torchrun describes in the environment: NCCL with one GPU per rank where CUDA is
    available, gloo on CPU otherwise."""
    if fsdp and not torch.cuda.is_available():
        raise RuntimeError("--fsdp needs CUDA GPUs (one per rank)")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return DataParallel(dist.get_rank(), dist.get_world_size(), device, fsdp)


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_command(nproc: int, argv: Sequence[str], nnodes: int = 1, node_rank: int = 0,
                     master_addr: str | None = None) -> list[str]:
    """torchrun running `python -m forge_stream ARGV` as `nproc` ranks here, one node of `nnodes`.

    >>> torchrun_command(2, ["train"])[3:7]
    ['--standalone', '--nproc-per-node', '2', '-m']
    >>> torchrun_command(4, ["train"], 2, 1, "trainer-0:29500")[3:13]
    ['--nnodes', '2', '--node-rank', '1', '--master-addr', 'trainer-0', '--master-port', '29500', '--nproc-per-node', '4']
    """
    if nnodes > 1:
        addr, _, port = (master_addr or "").rpartition(":")
        if not addr or not port.isdigit():
            raise ValueError(f"master_addr must be HOST:PORT, not {master_addr!r}")
        where = ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr", addr, "--master-port", port]
    else:
        where = ["--standalone"]
    return [sys.executable, "-m", "torch.distributed.run", *where, "--nproc-per-node", str(nproc),
            "-m", "forge_stream", "--", *argv]  # "--": torchrun's parser would take --nproc, --run for its own


def launch(nproc: int, argv: Sequence[str], nnodes: int = 1, node_rank: int = 0, master_addr: str | None = None
           ) -> int:
    """Run `python -m forge_stream ARGV` under torchrun (this node of `nnodes`); its exit status."""
    return subprocess.run(torchrun_command(nproc, argv, nnodes, node_rank, master_addr)).returncode


def shard_model(model: torch.nn.Module) -> None:
    """FSDP2 over a HuggingFace decoder (GPU only): each decoder layer is a unit, the decoder (embeddings, final
    norm, a tied LM head) one more and an untied LM head its own; gradients are summed, not averaged.

    The tree forward calls the decoder and the LM head separately (forge_stream.tree.logprobs), never the top
    model, so the decoder unit keeps its parameters gathered after forward (a tied head still reads them)."""
    from torch.distributed.fsdp import fully_shard

    decoder = model.base_model
    units = [fully_shard(layer) for layer in decoder.layers]
    head = model.get_output_embeddings()
    if head.weight is not model.get_input_embeddings().weight:
        units.append(fully_shard(head, reshard_after_forward=False))
    units.append(fully_shard(decoder, reshard_after_forward=False))
    for unit in units:
        unit.set_gradient_divide_factor(1.0)

