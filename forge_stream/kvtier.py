"""The shared KV tier: LMCache's multiprocess server beside the vLLM engines, and what each side needs of it.

One `lmcache server` per host holds KV chunks in its L1 (CPU memory) and hands them to every vLLM engine attached
through vLLM's `LMCacheMPConnector`: through POSIX shared memory on a CPU host, CUDA IPC on a GPU host. A turn that
lands on another engine than its group's home (the gateway spilled it, or its engine was lost) reads its prefix's
KV from the tier instead of computing it again. A second level (`l2_adapters`: LMCache's adapters, e.g. `resp` on a
Redis-protocol server) reaches across hosts.

What this module owns:
- `TierSettings`, the topology's `kv_tier:` keys, and the server's command line (`server_argv`);
- `connector_args`, the vLLM arguments that attach an engine to a tier, with a lost tier recomputed, never failed
  (`kv_load_failure_policy: recompute`);
- `cache_salt`, the key prefix of a run's policy version: vLLM's prefix cache and LMCache both key KV by it, so KV
  computed under one version is never served to a request of another (LMCache's keys carry the salt:
  `IPCCacheServerKey.cache_salt`);
- `tier_status`, what `forge-stream status` shows of a running tier (its address, L1 use, lookups and hits).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import httpx

SALT_UNSAFE = re.compile(r"[@/\\\x00]")  # characters LMCache refuses in a salt (IPCCacheServerKey)
SALT_MAX = 128
HEARTBEAT_S = 2.0  # how often each engine checks the tier is there (then skips it, then takes it back)


@dataclass(frozen=True)
class TierSettings:
    """An LMCache server: where it listens, how much KV its L1 holds, how it evicts, and its second level."""

    port: int = 6555  # LMCache's own default is 5555 (ForgeSettings.kv_tier_port sets it for a deployment)
    http_port: int = 6580  # its admin API (health, status, metrics): bound to loopback, it has no authentication
    host: str = "127.0.0.1"
    l1_size_gb: float = 1.0
    chunk_size: int = 256  # tokens per stored chunk: a prefix is stored and found in whole chunks
    eviction_policy: str = "LRU"
    # None: by the host. CPU hosts: lmcache_driven, the server copies KV from and to the engines' shared memory
    # itself (~1.5 GB/s stored on a 2-core host, against ~70 MB/s for the engine-driven path `auto` picks there);
    # GPU hosts: auto, LMCache's own choice (CUDA IPC)
    transfer_mode: str | None = None
    l2_adapters: tuple[str, ...] = ()  # JSON specs of LMCache's L2 adapters, e.g. '{"type":"resp",...}'
    max_workers: int | None = None

    @classmethod
    def from_options(cls, opts: dict) -> "TierSettings":
        """The topology's `kv_tier:` keys (unknown ones refused, with the known ones named)."""
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(opts) - known - {"kind", "bind", "start_timeout_s"}  # `up`'s, not the server's
        if unknown:
            raise ValueError(f"kv_tier: unknown keys {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
        if opts.get("kind", "lmcache") != "lmcache":
            raise ValueError(f"kv_tier: unknown kind {opts['kind']!r}; known: lmcache")
        values = {k: v for k, v in opts.items() if k in known}
        if "bind" in opts:
            values["host"] = opts["bind"]
        if "l2_adapters" in values:
            values["l2_adapters"] = tuple(a if isinstance(a, str) else json.dumps(a) for a in values["l2_adapters"])
        return cls(**values)

    @property
    def url(self) -> str:
        """Where the engines reach it (`--kv-tier` of `engine vllm`)."""
        return f"{self.host}:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


def transfer_mode(tier: TierSettings, target: str) -> str:
    """The server's transfer mode on a `target` (cpu, gpu) host: the topology's, else the host's best."""
    return tier.transfer_mode or ("lmcache_driven" if target == "cpu" else "auto")


def server_argv(runtime_python: Path, tier: TierSettings, target: str) -> list[str]:
    """The LMCache server's command line on a `target` host, run with the vLLM runtime's Python (LMCache lives in
    that environment)."""
    argv = [str(runtime_python), "-m", "lmcache.cli.main", "server", "--host", tier.host, "--port", str(tier.port),
            "--http-port", str(tier.http_port), "--l1-size-gb", str(tier.l1_size_gb),
            "--eviction-policy", tier.eviction_policy, "--chunk-size", str(tier.chunk_size),
            "--supported-transfer-mode", transfer_mode(tier, target)]
    if tier.max_workers is not None:
        argv += ["--max-workers", str(tier.max_workers)]
    for adapter in tier.l2_adapters:
        argv += ["--l2-adapter", adapter]
    return argv


def connector_config(tier_url: str, target: str) -> dict:
    """vLLM's `--kv-transfer-config` that attaches an engine to the tier at HOST:PORT. A KV load that fails (the
    tier lost) is recomputed, never failed: the request is served all the same."""
    host, _, port = tier_url.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"the KV tier's address must be HOST:PORT, not {tier_url!r}")
    # a heartbeat every 2 s (LMCache's default 10): a lost tier is noticed, and skipped, that much sooner; until
    # then a lookup waits for it (measured: the first request after a SIGKILL of the server waited 8.9 s at 10 s)
    extra: dict = {"lmcache.mp.host": f"tcp://{host}", "lmcache.mp.port": int(port),
                   "lmcache.mp.heartbeat_interval": HEARTBEAT_S}
    if target == "cpu":  # the server copies through shared memory itself; GPUs keep LMCache's own choice (CUDA IPC)
        extra["lmcache.mp.mp_transfer_mode"] = "lmcache_driven"
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}


def connector_args(tier_url: str, target: str) -> list[str]:
    """vLLM's arguments for an engine on the tier: the connector, one KV cache manager for every layer (the MP
    connector takes no hybrid one), and cached prompt tokens reported per request."""
    return [f"--kv-transfer-config={json.dumps(connector_config(tier_url, target), separators=(',', ':'))}",
            "--disable-hybrid-kv-cache-manager"]


def cache_salt(run: str, version: int, adapter: str | None = None) -> str:
    """The salt of a request served at `version` of `run` (under `adapter`, for LoRA versions): KV is stored and
    found under it only, in vLLM's prefix cache and in the tier alike. A run name LMCache would refuse in a salt
    (`@`, `/`, `\\`, NUL, or too long) is hashed.

    >>> cache_salt("main", 3)
    'main.v3'
    >>> cache_salt("a/b", 3) == cache_salt("a/b", 3) != cache_salt("a_b", 3)
    True
    >>> cache_salt("main", 3, "forge-v3")
    'main.v3.forge-v3'
    """
    name = run if not SALT_UNSAFE.search(run) and len(run) <= 64 else hashlib.blake2b(run.encode(),
                                                                                       digest_size=8).hexdigest()
    salt = f"{name}.v{version}" + (f".{adapter}" if adapter else "")
    if SALT_UNSAFE.search(salt) or len(salt) > SALT_MAX:
        salt = hashlib.blake2b(salt.encode(), digest_size=16).hexdigest()
    return salt


def tier_status(http_url: str, timeout: float = 3.0) -> dict:
    """The running tier's health, L1 use and lookup counters (its admin API); `{"reachable": False, ...}` when it
    does not answer."""
    try:
        status = httpx.get(f"{http_url}/status", timeout=timeout).json()
        metrics = httpx.get(f"{http_url}/metrics", timeout=timeout).text
    except (httpx.HTTPError, ValueError) as exc:
        return {"reachable": False, "error": f"{type(exc).__name__}: {exc}"}
    used, total = (status.get("storage_manager") or {}).get("l1_usage") or (0, 0)
    return {"reachable": True, "healthy": bool(status.get("is_healthy")), "chunk_size": status.get("chunk_size"),
            "l1_used_bytes": used, "l1_total_bytes": total, "active_sessions": status.get("active_sessions"),
            **lookup_counters(metrics)}


SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "lmcache_kv_"  # + the pid of the vLLM process that registered its KV cache with the tier, + "_N"


def remove_orphaned_kv(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the shared-memory KV caches of vLLM processes that are gone; returns their names.

    On CPU hosts LMCache's connector puts each engine's whole KV cache in POSIX shared memory (`lmcache_kv_PID_N`,
    VLLM_CPU_KVCACHE_SPACE large) and leaves it there when the engine ends, killed or not: RAM that nothing frees
    until the host restarts (measured: 10 GiB after eight engine stops, and the next start was OOM-killed). The
    engine front calls this when it starts and after its vLLM has stopped. A tier that still maps one keeps its
    memory until it lets go; only the name goes.
    """
    from forge_stream.proc import alive

    removed = []
    for path in shm_dir.glob(f"{SHM_PREFIX}*"):
        pid = path.name.removeprefix(SHM_PREFIX).split("_", 1)[0]
        if pid.isdigit() and not alive(int(pid)):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+)$")
COUNTERS = {  # LMCache 0.5.6's Prometheus counters (labelled by cache salt and model): what `status` shows
    "lmcache_mp_lookups_requests_total": "lookups",
    "lmcache_mp_lookup_requested_tokens_total": "lookup_tokens",
    "lmcache_mp_lookup_hit_tokens_total": "hit_tokens",
    "lmcache_mp_l1_write_chunks_total": "stored_chunks",
}


def lookup_counters(metrics: str) -> dict:
    """The tier's lookups, tokens looked up, tokens found and chunks stored since it started, from its Prometheus
    text (summed over salts and models).

    >>> lookup_counters('lmcache_mp_lookups_requests_total{cache_salt="a.v1"} 2.0\\n'
    ...                 'lmcache_mp_lookup_hit_tokens_total{cache_salt="a.v1"} 512.0\\n'
    ...                 'lmcache_mp_lookup_hit_tokens_total{cache_salt="a.v2"} 256.0')
    {'lookups': 2, 'lookup_tokens': 0, 'hit_tokens': 768, 'stored_chunks': 0}
    """
    out = dict.fromkeys(COUNTERS.values(), 0)
    for line in metrics.splitlines():
        match = METRIC.match(line.strip())
        if match and match.group(1) in COUNTERS:
            out[COUNTERS[match.group(1)]] += int(float(match.group(3)))
    return out
