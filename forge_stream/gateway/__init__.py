"""The ingress: an OpenAI-compatible gateway that forwards to rollout engines and records every completion."""
