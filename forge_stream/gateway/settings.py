"""Settings of one gateway process, built once at the entry point (CLI or test) and passed down."""

from __future__ import annotations

from dataclasses import dataclass

from forge_stream.credentials import GATEWAY_ENV, refuse_open_bind


@dataclass(frozen=True)
class GatewaySettings:
    """`engines` are OpenAI base URLs without `/v1` (e.g. http://127.0.0.1:8100); `bootstrap` is Kafka's.

    With `admin_token` set, auth is on: session, reward and finish routes need the admin token, and an agent's
    calls need its session token (returned when the session is created), which reaches only that session. Bound
    beyond loopback, the gateway refuses to start without it (ValueError). `engine_token` is sent to the engines.
    """

    engines: tuple[str, ...]
    bootstrap: str
    host: str = "127.0.0.1"
    port: int = 8000
    public_url: str | None = None  # base of the URLs handed to agents; default: the URL the caller used
    admin_token: str | None = None
    engine_token: str | None = None  # the engines' bearer token (FORGE_ENGINE_TOKEN), sent with every engine call
    # Limits, checked before a request reaches an engine or Kafka (past one: 4xx saying what to change)
    max_request_bytes: int = 8 * 1024 * 1024  # a body's size (413), checked while it is read
    max_json_depth: int = 64  # nesting of a body's JSON objects/arrays (e.g. tool parameter schemas)
    max_choices: int = 128  # choices one request asks for: n times the number of prompts
    max_tokens: int = 131_072  # max_tokens / max_completion_tokens (the engine checks its model's context)
    min_temperature: float = 0.01  # a positive temperature below it is refused (use 0 for greedy decoding)
    max_temperature: float = 2.0
    max_id_length: int = 256  # session, group and task ids, agent names, metadata keys
    engine_timeout_s: float = 600.0
    engine_connections: int = 512
    max_queue: int = 32  # in-flight requests on a group's engine before its requests go elsewhere
    ack_timeout_ms: int = 10_000  # Kafka delivery timeout; past it the caller gets 503 and nothing is recorded
    # producer batching: librdkafka sends one partition's batch per request (#1700), so at 2 ms nearly every
    # Completion is a request of its own; 10 ms halves the broker's requests under load and costs up to ~8 ms per
    # call at low load (docs/benchmarks/exploratory.md)
    linger_ms: float = 10.0
    retry_after_s: int = 2
    # Admission (forge_stream.gateway.admission): OpenAI calls served at once (engine call through Kafka's ack),
    # and calls waiting for a slot; past both the call is shed with 429, after max_wait_s waiting with 503
    max_in_flight: int = 256
    max_waiting: int = 1024
    max_wait_s: float = 30.0
    shed_retry_after_s: float = 1.0  # Retry-After of a shed call (also sent as retry-after-ms, which the SDK reads)
    # Sessions kept in memory: past max_open_sessions, POST /v1/sessions is 429; finished sessions are kept (a
    # later call gets 409) up to finished_sessions_kept, the oldest forgotten first (a later call gets 404)
    max_open_sessions: int = 100_000
    finished_sessions_kept: int = 10_000
    default_policy_version: int = 0  # for engines (vLLM) whose responses carry no policy_version
    # what the engines' logprobs are (recorded on each Completion): "processed" = of the distribution sampled
    # from (the local engine's default; vLLM with --logprobs-mode processed_logprobs), "raw" = temperature 1
    engine_logprobs_mode: str = "processed"
    # record a chat prompt that extends an earlier completion of its session by reference (forge_stream.events.
    # prompts): only the appended ids and messages, so a session's bytes grow linearly with its turns
    prompt_refs: bool = True
    # the largest Completion event; a request whose messages alone (those not recorded by reference) and tools
    # exceed it is refused (413) before the engine runs. None: forge.completions' max_message_bytes
    max_event_bytes: int | None = None
    # Sessions this process does not hold (opened by another replica, or before a restart) are rebuilt from their
    # events on Kafka (forge_stream.gateway.restore): a session is found if it started within session_lookback_s
    # of the gateway's first lookup, and its events are read from its start less clock_skew_ms (the replicas' clocks)
    session_lookback_s: float = 7 * 24 * 3600.0
    clock_skew_ms: int = 60_000
    # replicas serve one session's calls alternately (any replica, any call): a held session is brought up to date
    # with what other replicas recorded before each call (a read of its partition). Off: a session's calls go to
    # the replica that holds it (sticky routing), and another one rebuilds it only when it does not hold it
    shared_sessions: bool = False
    # `gateway serve --workers N`: the host's ledger file (forge_stream.gateway.ledger) through which its workers
    # tell each other which sessions they recorded for, so a held session is brought up to date only when another
    # worker recorded for it (and without asking Kafka otherwise). With shared_sessions too (replicas on other
    # hosts), Kafka's tail is followed instead
    worker_ledger: str | None = None
    workers: int = 1
    # how long a worker waits for another one's lock of a session's turns in that ledger (held while it catches the
    # session up and Kafka acknowledges a turn: seconds at most) before it gives up with 503 and Retry-After: the
    # holder hangs. A call with an Idempotency-Key waits for another worker's try of it up to engine_timeout_s more
    turn_lock_wait_s: float = 30.0

    def __post_init__(self):
        refuse_open_bind("The gateway", self.host, self.admin_token, GATEWAY_ENV)

    @property
    def replicated(self) -> bool:
        """Whether other processes (replicas, or workers of this one) serve this gateway's sessions too."""
        return self.shared_sessions or self.worker_ledger is not None

    @property
    def auth(self) -> bool:
        return self.admin_token is not None
