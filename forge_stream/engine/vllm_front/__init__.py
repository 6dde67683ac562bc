"""Real vLLM as a forge-stream rollout engine (`forge-stream engine vllm`): the front that serves the engine protocol
in front of a vLLM server it starts (app.py); how it moves vLLM to each policy version and proves it (load.py, with
the load plan of vLLM's control routes in load_plan.py, the probe against transformers in reference_probe.py, LoRA
versions in adapters.py, held checkpoints in holds.py); what these share (state.py); the pinned vLLM runtime, installed
in an environment of its own (runtime.py); and the code that runs inside vLLM's own processes (vllm_ext/)."""
