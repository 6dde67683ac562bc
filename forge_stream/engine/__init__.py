"""The local rollout engine: serves a HuggingFace causal LM over the OpenAI protocol with token ids,
logprobs and policy versions, batching concurrent requests over KV caches (see scheduler.py)."""
