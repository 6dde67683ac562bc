"""forge-stream's worker extension for vLLM 0.32 (`--worker-extension-cls forge_worker.ForgeWorkerExtension`).

Its methods join every vLLM worker and are called through `POST /collective_rpc {"method": NAME, ...}`.

`forge_reload_weights(weights_path)` is vLLM's `reload_weights(weights_path=...)` made whole on CPU hosts. There,
vLLM's CPU GEMM dispatch packs each linear layer's weights into a oneDNN handle once they are loaded
(`dispatch_cpu_unquantized_gemm`). An in-place reload re-packs every layer it loads, but an LM head tied to the
input embedding loads nothing of its own, so it keeps the handle packed from the old embedding: the model then
reads new input embeddings and scores tokens with old output ones (on the tiny model, prompt log-probs are off by
1.6 nats after a reload that changes only the embedding, and exact for every other group of weights). After the
reload this method packs the handles of such layers again from the weights they hold.
"""

from __future__ import annotations


class ForgeWorkerExtension:
    def forge_reload_weights(self, weights_path: str) -> dict:
        """Reload every weight from the HF directory `weights_path`; returns which layers were re-packed."""
        self.reload_weights(weights_path=weights_path)
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return {"repacked": []}
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        repacked = []
        for name, module in self.model_runner.get_model().named_modules():
            if isinstance(module, ParallelLMHead) and hasattr(module, "cpu_linear"):
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
                repacked.append(name)
        return {"repacked": repacked}

    def forge_mq_poll(self) -> dict:
        """{"poll_s": seconds between this worker's polls of its step queue as forge-stream set them
        (sitecustomize.py), or None where it spins as vLLM has it} (a dict: vLLM's route would stringify a number)."""
        from vllm.distributed.device_communicators import shm_broadcast

        return {"poll_s": getattr(shm_broadcast, "forge_poll_s", None)}
