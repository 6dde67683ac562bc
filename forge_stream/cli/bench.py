"""`forge-stream bench ...`: benchmarks that print one JSON object (never timed asserts in tests)."""

import json
import signal
import sys
import traceback
from pathlib import Path
from typing import Optional, Tuple

import typer
from typer.core import TyperGroup

from forge_stream.cli.options import JsonOption
from forge_stream.gateway.settings import GatewaySettings
from forge_stream.startup import user_error
from forge_stream.tasks.suite import PRETRAINED_MIX


class _StopsOnSigterm(TyperGroup):
    """A benchmark starts its own broker and services and stops them in `finally`; SIGTERM (a `kill`, a CI
    timeout) ends Python without running it, leaving them behind. Made a SystemExit, it unwinds like Ctrl-C, and
    the exit status is 128 + SIGTERM even when stopping something fails on the way out (that error is printed)."""

    def invoke(self, ctx):
        terminated: list[int] = []

        def on_sigterm(signum, frame):
            terminated.append(signum)
            sys.exit(128 + signum)

        signal.signal(signal.SIGTERM, on_sigterm)
        try:
            return super().invoke(ctx)
        except BaseException as exc:
            code = 128 + terminated[0] if terminated else None
            if code is None or (isinstance(exc, SystemExit) and exc.code == code):
                raise
            print("stopped by SIGTERM; cleaning up then failed:", file=sys.stderr)
            traceback.print_exception(exc, file=sys.stderr)
            raise SystemExit(code) from None


app = typer.Typer(cls=_StopsOnSigterm, no_args_is_help=True, help="Benchmarks; each prints one JSON object.")


def emit(result: dict, as_json: bool) -> None:
    """Print a benchmark result: compact JSON for scripts, indented for people."""
    typer.echo(json.dumps(result) if as_json else json.dumps(result, indent=2))


@app.command("codec")
def codec(as_json: bool = typer.Option(False, "--json"), events: int = 200, seconds: float = 2.0) -> None:
    """Avro (Confluent framing) vs JSON on Completion events with 4,096 + 512 token ids."""
    from forge_stream.bench.codec import run

    emit(run(events=events, seconds=seconds), as_json)


def _model(spec: str):
    """A model directory, or a known model imported on first use (`forge-stream model import`)."""
    from forge_stream.model_import import ImportFailed, resolve_model
    from forge_stream.settings import ForgeSettings

    try:
        return resolve_model(spec, ForgeSettings().cache_dir, progress=lambda line: typer.echo(line, err=True))
    except ImportFailed as e:
        raise user_error(str(e)) from None


@app.command("engine")
def engine(
    requests: int = typer.Option(None, help="Requests of a batched run (default: 16; with --engine vllm, 256 agent "
                                            "requests per phase at 64 in flight)."),
    max_tokens: int = typer.Option(64, help="Tokens per request (the batcher's runs; agent requests take 32)."),
    model_dir: str = typer.Option(None, "--model-dir", "--model", help="Model directory or a known model "
                                                                      "(smollm2-135m; default: a fresh tiny model)."),
    engine_kind: str = typer.Option(None, "--engine", help="vllm: real vLLM and the torch engine side by side over "
                                                           "HTTP, alternating (default: the torch engine's "
                                                           "batcher alone, in this process)."),
    rounds: int = typer.Option(2, min=1, help="With --engine vllm: phases per engine and concurrency."),
    as_json: bool = typer.Option(False, "--json", help="Print compact JSON."),
) -> None:
    """Engine throughput: the torch engine's batcher (one request at a time vs batched), or with --engine vllm
    real vLLM beside the torch engine at 1 and 64 requests in flight."""
    if engine_kind not in (None, "torch", "vllm"):
        typer.echo(f"--engine takes vllm or torch, not {engine_kind!r}", err=True)
        raise typer.Exit(2)
    if model_dir is not None:
        model_dir = str(_model(model_dir))
    if engine_kind == "vllm":
        from forge_stream.bench.engines import run as side_by_side

        emit(side_by_side(model_dir, requests=requests or 256, rounds=rounds,
                          progress=lambda line: typer.echo(line, err=True)), as_json)
        return
    from forge_stream.bench.engine import run

    emit(run(requests=requests or 16, max_tokens=max_tokens, model_dir=model_dir), as_json)


@app.command("gateway")
def gateway(
    requests: int = typer.Option(20000, help="Requests per phase at the highest concurrency (the direct phase "
                                             "should last a second or more: its rate is the ratio's denominator)."),
    prompt_bytes: int = typer.Option(1000, help="User message size (the scripted engine: 1 token per byte)."),
    bootstrap_servers: str = typer.Option(None, "--bootstrap-servers", help="Kafka (default: a fresh local broker)."),
    workers: int = typer.Option(1, help="Gateway processes on its port (gateway serve --workers)."),
    linger_ms: float = typer.Option(GatewaySettings.linger_ms,
                                    help="The gateway's producer linger (gateway serve --linger-ms)."),
    shared_sessions: bool = typer.Option(False, help="Run the gateway with --shared-sessions (follow Kafka, as "
                                                     "replicas on several hosts do)."),
    floor: bool = typer.Option(False, help="Also measure a pass-through proxy on the same servers and client "
                                           "(recording nothing, then acknowledging a Kafka write per call): the "
                                           "floor under the gateway's cost."),
    rounds: int = typer.Option(3, min=1, help="Direct/gateway pairs at 64 callers; the median round's ratio is "
                                              "reported (each round's in `rounds`)."),
    reconnect: bool = typer.Option(False, help="Callers open new connections for every phase (with --workers, about "
                                               "half the sessions then move to another worker each phase)."),
    as_json: bool = typer.Option(False, "--json", help="Print compact JSON."),
) -> None:
    """Gateway overhead vs straight to a scripted engine (p50/p99 at concurrency 1 and 64), recorded/s."""
    from forge_stream.bench.gateway import run

    emit(run(requests=requests, prompt_bytes=prompt_bytes, bootstrap=bootstrap_servers, workers=workers,
             linger_ms=linger_ms, shared_sessions=shared_sessions, floor=floor, rounds=rounds,
             reconnect=reconnect), as_json)


@app.command("long-horizon")
def long_horizon(
    sessions: int = typer.Option(2, help="Sessions in the group (G)."),
    turns: int = typer.Option(220, help="Turns per session (calls, the context-management ones included)."),
    append_tokens: int = typer.Option(1000, help="Tokens each turn appends (a tool result or a user message)."),
    reset: list[int] = typer.Option([10, 20], help="Turns at which the agent summarizes and restarts its context."),
    half: bool = typer.Option(True, help="Also run at half the turns (bytes per unique token should not change)."),
    train: bool = typer.Option(True, help="Take one training step on the group's sample (tiny model)."),
    bootstrap_servers: str = typer.Option(None, "--bootstrap-servers", help="Kafka (default: a fresh local broker)."),
    as_json: bool = typer.Option(False, "--json", help="Print compact JSON."),
) -> None:
    """One group of long sessions (200K+ tokens, 200+ turns, resets) through gateway, Kafka, processors, trainer."""
    from forge_stream.bench.long_horizon import run

    progress = lambda line: typer.echo(line, err=True)  # noqa: E731
    emit(run(bootstrap=bootstrap_servers, sessions=sessions, turns=turns, append_tokens=append_tokens,
             resets=tuple(reset), half=half, train=train, progress=progress), as_json)


@app.command("load")
def load(
    agents: int = typer.Option(200, help="Concurrent agents (each: session, tool call, tool result, finish, again)."),
    seconds: float = typer.Option(60.0, help="How long the agents run."),
    max_in_flight: int = typer.Option(64, help="The gateway's --max-in-flight."),
    max_waiting: int = typer.Option(64, help="The gateway's --max-waiting."),
    retry_after_s: float = typer.Option(0.5, help="The gateway's --shed-retry-after-s."),
    engine_delay_ms: float = typer.Option(50.0, help="Time the scripted engine takes per completion."),
    workers: int = typer.Option(2, min=1, help="The gateway's --workers."),
    parallel_every: int = typer.Option(4, min=0, help="Every n-th agent asks its first turn as 2, 3 or 4 chat calls "
                                                      "at once in its session (0: none)."),
    hosts: int = typer.Option(1, min=1, help="Gateway hosts (each its own `serve --workers N` and ledger), behind "
                                             "HAProxy (`gateway balance`) when more than one."),
    kill_host_after_s: Optional[float] = typer.Option(
        None, help="With --hosts 2 or more: SIGKILL the last host this long into the run (its sessions move)."),
    bootstrap_servers: str = typer.Option(None, "--bootstrap-servers", help="Kafka (default: a fresh local broker)."),
    as_json: bool = typer.Option(False, "--json", help="Print compact JSON."),
) -> None:
    """Many agents against the gateway for a fixed time: shed answers, acknowledged vs recorded, one record per turn,
    processes left running, p99, peak RSS; with --hosts, across gateway hosts behind HAProxy."""
    if kill_host_after_s is not None and hosts < 2:
        raise user_error("bench load: --kill-host-after-s needs --hosts 2 or more (a host left to move to)")
    from forge_stream.bench.load import LoadSettings, run

    emit(run(LoadSettings(agents=agents, seconds=seconds, max_in_flight=max_in_flight, max_waiting=max_waiting,
                          retry_after_s=retry_after_s, engine_delay_ms=engine_delay_ms, workers=workers,
                          parallel_every=parallel_every, hosts=hosts, kill_host_after_s=kill_host_after_s,
                          bootstrap=bootstrap_servers)), as_json)


@app.command("scheduler")
def scheduler(
    as_json: bool = typer.Option(False, "--json", help="Print compact JSON."),
    seed: int = typer.Option(0, help="Seed of the rollout durations."),
    tasks: int = typer.Option(8192, help="Tasks (groups) in the run."),
    slots: int = typer.Option(256, help="Concurrent rollout slots C."),
    buffer: int = typer.Option(-1, help="Bound on finished groups waiting beyond the slots; -1 = unbounded."),
) -> None:
    """Windowed FIFO vs strict FIFO, greedy and an AReaL-style bound, in a seeded event simulation."""
    from forge_stream.bench import scheduler as bench

    settings = bench.SimSettings(seed=seed, tasks=tasks, slots=slots, buffer=None if buffer < 0 else buffer)
    emit(bench.run(settings), as_json)


@app.command("prefix-tree")
def prefix_tree(
    as_json: bool = typer.Option(False, "--json", help="Print one compact JSON object."),
    threads: int = typer.Option(2, help="torch CPU threads per measured step."),
    quick: bool = typer.Option(False, help="Tiny model and workloads (a smoke run, not representative)."),
    model: str = typer.Option(None, help="A model directory or a known model (smollm2-135m): its own weights and "
                                         "vocabulary on agent-shaped workloads, with the LM head whole beside "
                                         "chunked."),
    temperature: float = typer.Option(1.0, min=0.01,
                                      help="Score every token at this sampling temperature, as the trainer "
                                           "scores what was sampled at it."),
    top_p: float = typer.Option(1.0, min=0.01, max=1.0,
                                help="...and within this top-p nucleus (below 1: each scored row's whole "
                                     "vocabulary is sorted)."),
) -> None:
    """One training step tree-packed vs unshared on GRPO, multi-turn and long-horizon agent workloads."""
    from forge_stream.bench import prefix_tree as bench

    emit(bench.run(quick=quick, threads=threads, model_dir=str(_model(model)) if model else None,
                   temperature=temperature, top_p=top_p), as_json)


@app.command("kv-tier")
def kv_tier(
    model: str = typer.Option("smollm2-135m", help="A model directory, or a known model (imported on first use)."),
    sizes: str = typer.Option("1024,2048,4096,7168", help="Context sizes in tokens, comma-separated."),
    rounds: int = typer.Option(3, min=1, help="Sessions per size (medians reported, each round's kept)."),
    log_dir: Optional[Path] = typer.Option(None, help="Where the tier's and engines' logs go (default: a temporary "
                                                      "folder, named in the result)."),
    as_json: bool = JsonOption,
) -> None:
    """The shared KV tier (LMCache) between vLLM engines: time to first token of a turn that reads its prefix from
    the tier against one that recomputes it, per context size; stale hits across policy versions; calls failed
    when the tier is killed mid-run."""
    from forge_stream.bench.kv_tier import run

    try:
        parsed = tuple(int(s) for s in sizes.split(","))
    except ValueError:
        raise user_error(f"--sizes takes comma-separated token counts, not {sizes!r}") from None
    emit(run(str(_model(model)), parsed, rounds=rounds, log_dir=log_dir,
             progress=lambda line: typer.echo(line, err=True)), as_json)


@app.command("processors")
def processors(
    bootstrap_servers: Optional[str] = typer.Option(None, "--bootstrap-servers", "-b",
                                                    help="An external cluster (default: the bench's own broker)."),
    groups: int = typer.Option(200, help="How many groups to push through."),
    group_size: int = typer.Option(4, help="Rollouts per group (G)."),
    turns: int = typer.Option(3, help="Turns per rollout."),
    rate: Optional[float] = typer.Option(None, help="Groups per second (default: all at once)."),
    as_json: bool = JsonOption,
) -> None:
    """Groups per second and last-event-to-sample latency of a processors worker."""
    from forge_stream.bench.processors import run

    emit(run(bootstrap_servers, groups=groups, group_size=group_size, turns=turns,
             rate=rate), as_json)


@app.command("learning")
def learning(
    rl_minutes: Optional[float] = typer.Option(None, help="Wall-clock budget of each seed's RL phase (default: 15; "
                                               "with --model, 10, where SmolLM2-135M gained +0.425 on validation)."),
    engine_kind: Optional[str] = typer.Option(None, "--engine", help="Rollout engine: torch (the local torch "
                                              "engine; the default for the tiny model) or vllm (real vLLM, its runtime "
                                              "installed first; the default with --model)."),
    engine_load_interval: Optional[float] = typer.Option(
        None, min=0.0, help="vLLM only: seconds from the end of one weight load to the start of the next (engine "
                            "vllm --load-interval; default: 30 with --model, where a load holds requests for "
                            "seconds; otherwise, and with --lora-rank, whose loads hold none, 0: every version)."),
    lora_rank: int = typer.Option(0, min=0, help="Train a LoRA adapter of this rank (train --lora-rank) and serve each "
                                                 "adapter version (engine vllm --lora-rank; the torch engine merges "
                                                 "it); 0: full fine-tuning. LoRA wants about 10x the --lr."),
    engines: int = typer.Option(1, min=1, help="Engine replicas behind the gateway (up --engines)."),
    kv_tier: Optional[str] = typer.Option(None, help="lmcache: the shared KV tier under the vLLM engines (up "
                                                     "--kv-tier); each seed reports where its prompts' KV came "
                                                     "from."),
    loss: str = typer.Option("cispo", help="cispo or ppo."),
    lr: Optional[float] = typer.Option(None, help="Trainer learning rate (default: 1e-4; with --model, 1e-5: at "
                                                   "1e-4 one step moved SmolLM2-135M's log-probs by up to 14 nats; "
                                                   "10x either with --lora-rank)."),
    updates_per_batch: Optional[int] = typer.Option(None, help="Optimizer updates per batch (sample reuse; default: "
                                                               "4; with --model, 1)."),
    subgoal_reward: float = typer.Option(0.0, help="Weight of the process rule rewarding a tool call that returned "
                                                   "the task's answer (tool_result_answers; 0: off)."),
    partial_credit: float = typer.Option(0.0, help="Weight of the process rule giving an answer partial credit for "
                                                   "the share it gets right from the start (answer_prefix; 0: off)."),
    batch_size: Optional[int] = typer.Option(None, help="Groups per optimizer step (default: 16; with --model, 4: "
                                                        "a real model's rollouts are 40x slower, and steps of 16 "
                                                        "groups left 1 step in 4 minutes)."),
    advantage_scale: str = typer.Option("none", help="std (GRPO) or none (Dr. GRPO): the processors' advantages."),
    group_size: int = typer.Option(8, help="Rollouts per task (G)."),
    replay_edge: float = typer.Option(0.0, help="Share of the training groups that re-run a recent task whose "
                                                "group's rewards differed (rollout run --replay-edge); 0: off."),
    concurrency: int = typer.Option(64, help="Sessions in flight."),
    test_tasks: Optional[int] = typer.Option(None, help="Test-split tasks per evaluation, the same for every seed "
                                                        "(default: 600, a 95% interval of +-0.04 on one evaluation "
                                                        "at a mean of 0.5; with --model, 400, +-0.05)."),
    eval_split: str = typer.Option("test", help="Evaluate on test (to report) or validation (to choose settings: "
                                                "the test split stays untouched)."),
    mix: Optional[str] = typer.Option(None, help="Domain weights of the training tasks (default: "
                                                 f"reasoning=1,agent=1,lookup=1; with --model, {PRETRAINED_MIX}, "
                                                 "which the test evaluation then uses too)."),
    temperature: Optional[float] = typer.Option(None, min=0.0, help="Sampling temperature of the agent, in "
                                                "training and evaluation (default: 1; with --model, 0.7)."),
    sft_max_steps: int = typer.Option(3000, help="Warm-start SFT step budget."),
    sft_target: Optional[float] = typer.Option(None, help="Held-out predicted reward (at temperature 1) at which the "
                                                          "warm start's SFT stops (default: 0.2; with --model, "
                                                          "0.02: SmolLM2 stopped at 0.048 after 8 steps and scored "
                                                          "0.425 on validation at T = 0.7)."),
    sft_family_target: Optional[float] = typer.Option(None, help="The warm start's SFT also goes on until each task "
                                                                 "family's held-out predicted reward reaches this "
                                                                 "(default: 0.1; with --model, 0.01); negative: "
                                                                 "off."),
    sft_balanced: bool = typer.Option(True, help="The warm start draws half of each batch from the task families "
                                                 "still short of --sft-family-target, so an easy one keeps room to "
                                                 "improve."),
    sft_examples: int = typer.Option(600, help="Distinct training tasks the warm start is shown."),
    sft_lr: Optional[float] = typer.Option(None, help="Warm-start SFT learning rate (default: 3e-3; with --model, "
                                                      "1e-5)."),
    sft_batch_size: Optional[int] = typer.Option(None, help="Demonstrations per warm-start SFT step (default: 16; "
                                                            "with --model, 8)."),
    sft_check_every: Optional[int] = typer.Option(None, help="Warm-start SFT steps between two measurements of its "
                                                             "criterion (default: 25; with --model, 1: two steps "
                                                             "took SmolLM2 from 0.049 to 0.214)."),
    warm_start: Optional[str] = typer.Option(None, help="The warm start: sft (SFT on the mix's demonstrations of the "
                                                        "train split) or none; the tiny model always has one, a "
                                                        "pretrained --model none by default."),
    warm_from: Optional[Path] = typer.Option(None, help="Instead of a warm start of its own, each seed starts from "
                                                        "the one an earlier run made for it: that run's --json "
                                                        "output, its --home kept (two settings compared from one "
                                                        "start)."),
    hidden_size: int = typer.Option(128, help="The tiny model's width (model init --hidden-size)."),
    layers: int = typer.Option(2, min=1, help="The tiny model's decoder layers (model init --layers)."),
    band: Tuple[float, float] = typer.Option((0.1, 0.5), help="Held-out reward (SFT's criterion, then the test "
                                                              "evaluation) a warm start must land in before RL."),
    allow_outside_band: bool = typer.Option(False, help="Run RL from a warm start outside --band anyway."),
    seed: int = typer.Option(0, help="First seed (of the model init, the warm start and the training tasks)."),
    seeds: int = typer.Option(1, min=1, help="Independent runs, seeds --seed, --seed + 1, ..., one after another."),
    bootstrap_servers: Optional[str] = typer.Option(None, "--bootstrap-servers", "-b",
                                                    help="An external cluster (default: each seed's own broker)."),
    home: Optional[Path] = typer.Option(None, help="Keep the runs' homes here, one per seed (default: temporary)."),
    plot: Optional[Path] = typer.Option(None, help="Also draw the reward curve to this image file (with several "
                                                   "seeds, one file per seed: NAME-seedS.png)."),
    model: Optional[str] = typer.Option(None, help="Start from this pretrained model (a directory, or a known name: "
                                                   "smollm2-135m) instead of the tiny model's warm start."),
    as_json: bool = JsonOption,
) -> None:
    """Per seed: warm start, test eval, RL through the whole pipeline for a fixed budget, test eval again; the
    improvement's 95% interval over test tasks and seeds. Refuses (exit 3) a warm start outside --band."""
    engine_kind = engine_kind or ("vllm" if model else "torch")
    rl_minutes = rl_minutes if rl_minutes is not None else (10.0 if model else 15.0)
    batch_size = batch_size if batch_size is not None else (4 if model else 16)
    test_tasks = test_tasks if test_tasks is not None else (400 if model else 600)
    mix = mix or (PRETRAINED_MIX if model else "reasoning=1,agent=1,lookup=1")
    temperature = temperature if temperature is not None else (0.7 if model else None)
    warm_start = warm_start or ("none" if model else "sft")
    if warm_start not in ("sft", "none") or warm_start == "none" and not model:
        typer.echo("--warm-start takes sft, or none with a pretrained --model", err=True)
        raise typer.Exit(2)
    sft_lr = sft_lr if sft_lr is not None else (1e-5 if model else 3e-3)
    sft_target = sft_target if sft_target is not None else (0.02 if model else 0.2)
    sft_family_target = sft_family_target if sft_family_target is not None else (0.01 if model else 0.1)
    sft_batch_size = sft_batch_size if sft_batch_size is not None else (8 if model else 16)
    sft_check_every = sft_check_every if sft_check_every is not None else (1 if model else 25)
    lr = lr if lr is not None else (1e-5 if model else 1e-4) * (10 if lora_rank else 1)
    updates_per_batch = updates_per_batch if updates_per_batch is not None else (1 if model else 4)
    if engine_load_interval is None:
        engine_load_interval = 30.0 if model and engine_kind == "vllm" and not lora_rank else 0.0
    from forge_stream.bench.learning import EngineGone, NothingTrained, OutsideBand, reused_warm_start, run
    from forge_stream.bench.learning_settings import LearningSettings

    if engine_kind not in ("torch", "vllm"):
        typer.echo(f"--engine takes torch or vllm, not {engine_kind!r}", err=True)
        raise typer.Exit(2)
    if kv_tier not in (None, "lmcache") or kv_tier and engine_kind != "vllm":
        typer.echo("--kv-tier takes lmcache, with vLLM engines (--engine vllm or --model)", err=True)
        raise typer.Exit(2)
    if eval_split not in ("test", "validation"):
        typer.echo(f"--eval-split takes test or validation, not {eval_split!r}", err=True)
        raise typer.Exit(2)
    if not 0.0 <= replay_edge < 1.0:
        typer.echo(f"--replay-edge is a share of the groups, at least 0 and below 1, not {replay_edge}", err=True)
        raise typer.Exit(2)
    try:
        for each in range(seed, seed + seeds) if warm_from else ():
            reused_warm_start(warm_from, each)
    except ValueError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    try:
        from forge_stream.tiny.model import TinyModelSpec

        TinyModelSpec.sized(hidden_size, layers)
    except ValueError as exc:
        typer.echo(f"--hidden-size: {exc}", err=True)
        raise typer.Exit(2) from None
    settings = LearningSettings(rl_minutes=rl_minutes, engine=engine_kind, engine_load_interval=engine_load_interval,
                                lora_rank=lora_rank, engines=engines, kv_tier=kv_tier, loss=loss, lr=lr,
                                updates_per_batch=updates_per_batch, subgoal_reward=subgoal_reward,
                                partial_credit=partial_credit,
                                advantage_scale=advantage_scale, batch_size=batch_size, group_size=group_size,
                                replay_edge=replay_edge, eval_split=eval_split,
                                concurrency=concurrency, test_tasks=test_tasks, mix=mix, sft_max_steps=sft_max_steps,
                                sft_target=sft_target,
                                sft_family_target=None if sft_family_target < 0 else sft_family_target,
                                sft_balanced=sft_balanced,
                                sft_examples=sft_examples, sft_lr=sft_lr, sft_batch_size=sft_batch_size,
                                sft_check_every=sft_check_every, pretrained_sft=bool(model) and warm_start == "sft",
                                hidden_size=hidden_size, layers=layers,
                                band=tuple(band),
                                allow_outside_band=allow_outside_band, seed=seed, seeds=seeds,
                                bootstrap=bootstrap_servers, home=home, plot=plot, model=model,
                                temperature=temperature, warm_from=warm_from)
    try:
        result = run(settings, progress=lambda line: typer.echo(line, err=True))
    except OutsideBand as exc:
        typer.echo(f"refusing to start RL: {exc}", err=True)
        emit(exc.result, as_json)
        raise typer.Exit(3)
    except (NothingTrained, EngineGone) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    emit(result, as_json)
