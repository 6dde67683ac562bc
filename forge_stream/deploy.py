"""Deployments: what `forge-stream up` starts for a topology (`topologies/<name>.yaml`) and in which order.

A topology names the broker (embedded or external) and the services to run. Each service name maps to a
builder (forge_stream.builders) that turns the settings into a `ServiceSpec` (a real process). `up` is idempotent:
what already runs is left alone.

A topology may span hosts (topologies/cluster.yaml): `kafka.bootstrap_servers` names an external cluster, and a
service's `hosts:` lists where it runs (one instance per host; a trainer with `nnodes` > 1 is one torchrun node
per host, its node rank the host's index). `plan` says what runs where (`forge-stream up TOPOLOGY --dry-run`
prints it); `forge-stream up TOPOLOGY --host NAME` on each host starts that host's share. A service without
`hosts:` runs on every host that runs `up` without `--host`, i.e. this machine.

Every service `up` starts takes `--wait-for-kafka`: under the supervisor, a service (re)started while Kafka is away
(a broker restarting) waits for it, where the same command run by hand ends within seconds, saying Kafka is down.

A topology also states how the catalog's topics are replicated (`kafka.replication_factor` and
`kafka.min_insync_replicas`; 1 and 1 when it says nothing, the embedded broker's): `up` creates the topics so and
checks them, and hands it to every service (FORGE_REPLICATION_FACTOR, FORGE_MIN_INSYNC_REPLICAS), whose start-up
check refuses topics replicated otherwise.

Credentials (forge_stream.credentials): `up` generates the deployment's tokens once into the home's
`credentials.json` (0600) and hands them to the services in their environment: the gateway its admin token and the
engines' token, each engine the engines' token (a torch engine also loads weights over HTTP only from the home's
checkpoint directory), the controller the gateway's admin token. A topology across hosts needs the same file on
every host (copy it before `up --host`). `--dry-run` shows where a token goes, never the token.
"""

from __future__ import annotations

import shlex
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

import yaml

from forge_stream import credentials
from forge_stream.builders import BUILDERS, ENGINE_KINDS, engine_service, tier_settings
from forge_stream.credentials import ENGINE_ENV, GATEWAY_ENV, Credentials
from forge_stream.kafka.admin import check_topics, create_topics
from forge_stream.kafka.broker import BrokerConfig, LocalBroker
from forge_stream.kvtier import TierSettings
from forge_stream.services import ServiceSpec, Supervisor
from forge_stream.settings import ForgeSettings
from forge_stream.topics import EMBEDDED, Replication

TOPOLOGY_DIR = Path(resources.files("topologies"))  # the YAML ships in that package, in a checkout and in a wheel


@dataclass(frozen=True)
class Topology:
    name: str
    services: list[str]
    options: dict[str, dict] = field(default_factory=dict)
    hosts: dict[str, list[str]] = field(default_factory=dict)  # service -> the hosts it runs on (none: this one)
    bootstrap_servers: str | None = None  # kafka.bootstrap_servers: an external cluster
    replication: Replication = EMBEDDED  # kafka.replication_factor and kafka.min_insync_replicas

    def with_engine(self, kind: str) -> "Topology":
        """This topology with its engine run as `kind` (`up --engine`)."""
        if kind not in ENGINE_KINDS:
            raise ValueError(f"unknown engine kind {kind!r}; known: {', '.join(ENGINE_KINDS)}")
        if "engine" not in self.services:
            raise ValueError(f"topology {self.name} runs no engine")
        return replace(self, options={**self.options, "engine": {**self.options["engine"], "kind": kind}})

    def with_engines(self, count: int) -> "Topology":
        """This topology with `count` engine replicas (`up --engines`), each on the port after the previous one's;
        the gateway routes each group to one of them (forge_stream.gateway.engines)."""
        if count < 1:
            raise ValueError(f"--engines must be at least 1, not {count}")
        if "engine" not in self.services:
            raise ValueError(f"topology {self.name} runs no engine")
        return replace(self, options={**self.options, "engine": {**self.options["engine"], "replicas": count}})

    def with_kv_tier(self, kind: str) -> "Topology":
        """This topology with the shared KV tier (`up --kv-tier lmcache`), started before the engines."""
        TierSettings.from_options({"kind": kind})  # a known kind
        if "kv_tier" in self.services:
            return replace(self, options={**self.options, "kv_tier": {**self.options["kv_tier"], "kind": kind}})
        at = self.services.index("engine") if "engine" in self.services else len(self.services)
        return replace(self, services=[*self.services[:at], "kv_tier", *self.services[at:]],
                       options={**self.options, "kv_tier": {"kind": kind}})

    def settings_for(self, settings: ForgeSettings) -> ForgeSettings:
        """The settings with the topology's replication and its external cluster, unless --bootstrap-servers named
        one."""
        update = {"replication_factor": self.replication.factor, "min_insync_replicas": self.replication.min_insync}
        if self.bootstrap_servers and settings.embedded:
            update["bootstrap_servers"] = self.bootstrap_servers
        return settings.model_copy(update=update)


def load_topology(name_or_path: str) -> Topology:
    path = Path(name_or_path)
    if not path.is_file():
        path = TOPOLOGY_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in TOPOLOGY_DIR.glob("*.yaml")))
        raise FileNotFoundError(f"no topology {name_or_path!r}; known: {known}")
    raw = yaml.safe_load(path.read_text())
    services, options, hosts = [], {}, {}
    for item in raw.get("services", []):
        name, opts = (item, {}) if isinstance(item, str) else next(iter(item.items()))
        if name not in BUILDERS:
            raise ValueError(f"{path}: unknown service {name!r}; known: {', '.join(sorted(BUILDERS))}")
        opts = dict(opts or {})
        placed = opts.pop("hosts", None) or ([opts.pop("host")] if "host" in opts else [])
        if isinstance(placed, str) or not all(isinstance(h, str) and h for h in placed):
            raise ValueError(f"{path}: {name}.hosts must be a list of host names")
        services.append(name)
        options[name] = opts
        if placed:
            hosts[name] = list(placed)
    kafka = raw.get("kafka") or {}
    factor = int(kafka.get("replication_factor", 1))
    try:
        replication = Replication(factor, int(kafka.get("min_insync_replicas", max(1, factor - 1))))
    except ValueError as exc:
        raise ValueError(f"{path}: kafka: {exc}") from None
    return Topology(raw.get("name", path.stem), services, options, hosts, kafka.get("bootstrap_servers"), replication)


@dataclass(frozen=True)
class Placement:
    host: str  # "" for this machine
    spec: ServiceSpec


def plan(settings: ForgeSettings, topology: Topology, host: str | None = None,
         creds: Credentials | None = None) -> list[Placement]:
    """What runs where, in start order: every placement, or only `host`'s (None: the services placed on no host),
    each service given the tokens of `creds` it uses (credentials_env).

    A trainer placed on several hosts with `nnodes` is one torchrun node per host (`node_rank` = the host's index,
    the first host the rendezvous master unless `master_addr` says otherwise).
    """
    settings = topology.settings_for(settings)
    out = []
    for name in topology.services:
        placed = topology.hosts.get(name, [""])
        for rank, where in enumerate(placed):
            if host is not None and where != host or host is None and where:
                continue
            opts = topology.options[name]
            if name == "trainer" and int(opts.get("nnodes", 1)) > 1:
                if len(placed) != int(opts["nnodes"]):
                    raise ValueError(f"trainer: nnodes {opts['nnodes']} but {len(placed)} hosts")
                opts = {"master_addr": f"{placed[0]}:29500", **opts, "node_rank": rank}
            if name == "load_balancer":  # in front of the gateway's hosts, at the gateway's port
                gateway_port = topology.options.get("gateway", {}).get("port", settings.gateway_port)
                gateway_hosts = topology.hosts.get("gateway", [""])
                if where in gateway_hosts and int(opts.get("port", settings.gateway_port)) == int(gateway_port):
                    raise ValueError(f"load_balancer: the gateway listens on port {gateway_port} on its host too: "
                                     "give the load balancer another `port:`")
                opts = {"backends": [f"{h or '127.0.0.1'}:{gateway_port}" for h in gateway_hosts], **opts}
            if name == "gateway" and "engines" not in opts:  # every engine replica of this topology
                opts = {**opts, "engines": engine_urls(settings, topology)}
            if name == "engine":
                specs = engine_replicas(settings, topology, opts)
            else:
                specs = [BUILDERS[name](settings, opts)]
            for spec in specs:
                env = {**replication_env(settings.replication), **credentials_env(name, creds), **spec.env}
                out.append(Placement(where, replace(spec, env=env)))
    return out


def engine_urls(settings: ForgeSettings, topology: Topology) -> list[str]:
    """The engines a gateway on this machine calls: each replica of the topology's engine (one by default)."""
    opts = topology.options.get("engine", {})
    first = int(opts.get("port", settings.engine_port))
    return [f"http://127.0.0.1:{first + i}" for i in range(int(opts.get("replicas", 1)))]


def engine_replicas(settings: ForgeSettings, topology: Topology, opts: dict) -> list[ServiceSpec]:
    """The engine's services: `engine`, then `engine-1`, `engine-2`... for `replicas:`, each on the next port;
    with a KV tier in the topology, every one attached to it (vLLM engines only: the tier holds vLLM's KV)."""
    if "kv_tier" in topology.services:
        if opts.get("kind", "torch") != "vllm":
            raise ValueError("the KV tier serves vLLM engines: run the engine as `kind: vllm` (`up --engine vllm`)")
        opts = {**opts, "kv_tier": tier_settings(settings, topology.options["kv_tier"]).url}
    first = int(opts.get("port", settings.engine_port))
    specs = []
    for i in range(int(opts.get("replicas", 1))):
        spec = engine_service(settings, {**opts, "port": first + i})
        specs.append(spec if i == 0 else replace(spec, name=f"engine-{i}"))
    return specs


def credentials_env(service: str, creds: Credentials | None) -> dict[str, str]:
    """The tokens `service` is handed: the gateway's admin token to the gateway and the controller, the engines'
    token to the engines and the gateway (which calls them)."""
    if creds is None:
        return {}
    names = {"gateway": (GATEWAY_ENV, ENGINE_ENV), "controller": (GATEWAY_ENV,), "engine": (ENGINE_ENV,)}
    values = {GATEWAY_ENV: creds.gateway_admin_token, ENGINE_ENV: creds.engine_token}
    return {name: values[name] for name in names.get(service, ())}


def replication_env(replication: Replication) -> dict[str, str]:
    """What tells a service the deployment's replication (its start-up check verifies the topics against it)."""
    return {"FORGE_REPLICATION_FACTOR": str(replication.factor),
            "FORGE_MIN_INSYNC_REPLICAS": str(replication.min_insync)}


def ensure_model(settings: ForgeSettings, echo=print) -> None:
    """The embedded default trains a tiny model built here (nothing is downloaded), warm-started on the scripted
    teacher's demonstrations of the task suite so its rollouts earn rewards from the first step. The warm model is
    built once per machine (cached under the cache directory, keyed by the code that makes it) and copied."""
    if (settings.model_dir / "config.json").exists():
        return
    cached = demo_model(settings.cache_dir, echo)
    echo(f"Copying the tiny demo model to {settings.model_dir}...")
    shutil.copytree(cached, settings.model_dir, dirs_exist_ok=True)


def demo_model(cache_dir: Path, echo=print) -> Path:
    """The warm-started tiny demo model in the cache, built on first use."""
    import hashlib

    from forge_stream.tiny import corpus, model as tiny
    from forge_stream.tasks import suite, teacher
    from forge_stream.trainer import sft

    key = hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in (tiny, corpus, suite, teacher, sft)))
    path = cache_dir / f"demo-model-{key.hexdigest()[:12]}"
    if (path / "config.json").exists():
        return path
    work = Path(tempfile.mkdtemp(prefix="demo-model-", dir=cache_dir if cache_dir.is_dir() else None))
    echo(f"Writing the tiny demo model and warm-starting it on the task suite's demonstrations (forge-stream sft, "
         f"1.5 to 5 minutes on 2 cores depending on their load, once per machine) into {path}...")
    tiny.init_tiny_model(work / "init", tiny.TinyModelSpec(seed=0))
    sft.run_sft(sft.SftSettings(base_model=work / "init", out=work / "warm"), progress=echo)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        (work / "warm").rename(path)
    except OSError:  # another process built it first
        pass
    shutil.rmtree(work, ignore_errors=True)
    return path


def local_broker(settings: ForgeSettings) -> LocalBroker:
    return LocalBroker(BrokerConfig(settings.broker_dir, settings.cache_dir, settings.kafka_port,
                                    settings.kafka_controller_port, settings.kafka_heap, rebalance_delay_ms=0))


def describe_plan(settings: ForgeSettings, topology: Topology, host: str | None = None) -> dict:
    """What `up` would run where (`forge-stream up TOPOLOGY --dry-run`), without starting anything: the broker and
    per host each service's command line and environment (the paths are this machine's install)."""
    settings = topology.settings_for(settings)
    hidden = f"<in {credentials.path(settings.home)}>"
    placements = [p for h in ([host] if host is not None else [None, *_all_hosts(topology)])
                  for p in plan(settings, topology, h, Credentials(hidden, hidden))]
    hosts: dict[str, list[dict]] = {}
    for p in placements:
        hosts.setdefault(p.host or "(this machine)", []).append({
            "service": p.spec.name, "command": shlex.join(p.spec.argv), "env": p.spec.env,
            "health": p.spec.health_url})
    return {"topology": topology.name, "kafka": "embedded broker on this machine" if settings.embedded
            else settings.bootstrap, "replication": {"factor": settings.replication_factor,
                                                     "min_insync_replicas": settings.min_insync_replicas},
            "hosts": hosts}


def _all_hosts(topology: Topology) -> list[str]:
    return list(dict.fromkeys(h for name in topology.services for h in topology.hosts.get(name, [])))


def up(settings: ForgeSettings, topology: Topology, echo=print, host: str | None = None) -> dict:
    """Start the broker (if embedded), create missing topics and check every topic against the catalog (raising
    TopicMismatch, with the fix, before anything starts), start the supervisor and through it the services placed
    on `host` (None: those placed on no host), saying which already run (they are left as they are); returns where
    everything is."""
    settings = topology.settings_for(settings)
    placements = plan(settings, topology, host)
    if host is not None and not placements:
        raise ValueError(f"topology {topology.name} places nothing on host {host!r}; its hosts: "
                         f"{', '.join(_all_hosts(topology)) or 'none'}")
    if settings.embedded and topology.hosts:
        raise ValueError(f"topology {topology.name} spans hosts: it needs a Kafka cluster they all reach "
                         "(kafka.bootstrap_servers in the topology, or --bootstrap-servers)")
    creds, made = credentials.ensure(settings.home)
    if made:
        echo(f"Generated this deployment's tokens into {credentials.path(settings.home)} (mode 0600)"
             + (": copy it to the same path on every other host of the topology before `up --host` there."
                if topology.hosts else "."))
    placements = plan(settings, topology, host, creds)
    supervisor = Supervisor(settings.run_dir)
    running = {name: s["pid"] for name, s in supervisor.status().items() if s["running"]}
    if settings.embedded:
        echo(f"The embedded Kafka broker already runs (pid {running[BROKER]})." if BROKER in running else
             f"Starting the embedded Kafka broker (data in {settings.broker_dir})...")
        start_broker(settings, supervisor, echo)
    echo(f"Kafka at {settings.bootstrap}; checking the topics...")
    topics = create_topics(settings.bootstrap, replication=settings.replication)
    made = [name for name, done in topics.items() if done == "created"]
    if made:
        echo(f"Created {len(made)} topics.")
    check_topics(settings.bootstrap, replication=settings.replication)
    settings.record_deployment()  # `status`, `down`, `rollout`... from any shell find this Kafka
    names = [p.spec.name for p in placements]
    if "engine" in names and "model" not in topology.options["engine"]:
        ensure_model(settings, echo)
    if "kv_tier" in names or "engine" in names and topology.options["engine"].get("kind") == "vllm":
        from forge_stream.engine.vllm_front.runtime import ensure_runtime

        ensure_runtime(settings.cache_dir, echo=echo)
    started = {}
    for batch in _start_batches([p.spec for p in placements]):
        for spec in batch:
            echo(f"{spec.name} already runs (pid {running[spec.name]})." if spec.name in running
                 else f"Starting {spec.name}...")
        started.update(supervisor.start_together(batch))
    return {"bootstrap_servers": settings.bootstrap, "embedded_broker": settings.embedded,
            "topics": topics, "supervisor": supervisor.daemon_pid(),
            "services": {n: {"pid": e["pid"], "url": e["url"], "log": e["log"]} for n, e in started.items()}}


def _start_batches(specs: list[ServiceSpec]) -> list[list[ServiceSpec]]:
    """The services in start order, an engine's replicas in one batch (started together: each vLLM start takes
    minutes), every other service alone."""
    batches: list[list[ServiceSpec]] = []
    for spec in specs:
        if spec.name.startswith("engine-") and batches and batches[-1][0].name == "engine":
            batches[-1].append(spec)
        else:
            batches.append([spec])
    return batches


BROKER = "broker"  # the embedded broker's name among the supervisor's services


def start_broker(settings: ForgeSettings, supervisor: Supervisor, echo=print, timeout: float = 90.0) -> None:
    """Have the supervisor run the embedded broker like a service (restarted when it dies; its pid file kept for
    the broker's own tooling), and wait until it answers. One that already runs unsupervised (started by an older
    `up`) is left as it is."""
    broker = local_broker(settings)
    if broker.pid() is not None and BROKER not in supervisor.names():
        echo(f"The embedded broker (pid {broker.pid()}) runs without the supervisor: nothing restarts it if it dies "
             "until `forge-stream down` and `up`.")
    else:
        supervisor.start(ServiceSpec(BROKER, broker.command(echo), pid_file=str(broker.pid_file),
                                     url=settings.bootstrap), timeout)
    broker.wait_ready(timeout)


def down(settings: ForgeSettings) -> dict:
    """Stop the supervisor (so nothing is restarted), the services, then the embedded broker (a supervised one is
    the first service started, so the last stopped)."""
    stopped = Supervisor(settings.run_dir).stop_all()
    broker = settings.embedded and local_broker(settings).stop()  # one that ran unsupervised
    return {"stopped_services": [name for name in stopped if name != BROKER],
            "stopped_broker": BROKER in stopped or bool(broker)}
