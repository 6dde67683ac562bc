"""What the torch engine and the vLLM front share: the follower of forge.policy (follower.py), the probe a policy
version passes before either serves it (probe.py), the Hermes tool-call format (tool_calls.py, which the gateway also
reads the engines' answers with), and either engine started as a server process for tests and benchmarks
(process.py). Nothing here imports either engine."""
