"""Settings of one local rollout engine process, built once at the entry point and passed down."""

from dataclasses import dataclass
from pathlib import Path

from forge_stream.credentials import ENGINE_ENV, refuse_open_bind
from forge_stream.engine.torch_engine.sampling import LogprobsMode


@dataclass(frozen=True)
class EngineSettings:
    """`model` is a HuggingFace causal-LM directory; its name (never its path: answers go to agents, which are not
    told where the engine's files are) is the served model name unless one is given.

    With `token` set every route but /health needs it as a bearer token; bound beyond loopback the engine refuses
    to start without one (ValueError). Weights load, by `/v1/admin/load_weights` or from a forge.policy record,
    only from directories inside `checkpoint_dir`, the checkpoint store (none: nothing loads).
    """

    model: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8100
    policy_version: int = 0
    max_batch_size: int = 32
    max_model_len: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    logprobs_mode: LogprobsMode = "processed"  # see forge_stream.engine.torch_engine.sampling
    prefix_cache_tokens: int = 65536  # prompt KV kept for reuse by prompts sharing a prefix (0: off)
    # Limits of one request, checked before it is tokenized or scheduled (past one: 400 or 413)
    max_request_bytes: int = 8 * 1024 * 1024  # body size, checked while it is read
    max_json_depth: int = 64  # nesting of the body's JSON objects/arrays (e.g. tool parameter schemas)
    max_choices: int = 128  # n times the number of prompts
    token: str | None = None
    checkpoint_dir: str | None = None

    def __post_init__(self):
        refuse_open_bind("The engine", self.host, self.token, ENGINE_ENV)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name
