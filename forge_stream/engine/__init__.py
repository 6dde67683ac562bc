"""The rollout engines: what serves the policy to agents over the OpenAI protocol, with token ids, logprobs and the
policy version of every answer, following the trainer's versions on forge.policy.

- `torch_engine/`: the local torch engine, a HuggingFace causal LM served by forge-stream's own batching loop.
- `vllm_front/`: real vLLM, run in its own environment behind a front that speaks the same protocol.
- `shared/`: what both engines use: the policy follower, the probe a version passes before it is served, the
  Hermes tool-call format, and starting either one as a process.

`command.py` is the `forge-stream engine` command group and, through `__main__.py`, the engine process's own entry
point (`python -m forge_stream.engine serve|vllm`).
"""
