"""The local torch engine (`forge-stream engine serve`): a HuggingFace causal LM served over the OpenAI protocol
with token ids, logprobs and policy versions, batching concurrent requests over KV caches (batcher.py), with
grammar-constrained tool calls and JSON (constraints.py). The router (api.py) is thin over the service (serving.py)
and its two endpoints (serving_chat.py, serving_completion.py)."""
