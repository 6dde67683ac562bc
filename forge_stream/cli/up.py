"""`forge-stream up [TOPOLOGY]`, `down` and `status`: deploy, stop and inspect a topology."""

from __future__ import annotations

import json
import time
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from forge_stream import deploy
from forge_stream.cli.options import BootstrapOption, JsonOption, settings
from forge_stream.engine.vllm_front.runtime import VllmInstallError
from forge_stream.kafka.admin import TopicMismatch, describe
from forge_stream.kvtier import tier_status
from forge_stream.scheduler import report
from forge_stream.services import ServiceError, Supervisor
from forge_stream.startup import engine_unreachable, gateway_unreachable, kafka_unreachable

console = Console(stderr=True, soft_wrap=True)  # long paths stay whole on their line (copyable) when not on a terminal


def up(topology: str = typer.Argument("local", help="A name under topologies/ or a YAML path."),
       bootstrap_servers: Optional[str] = BootstrapOption,
       host: Optional[str] = typer.Option(None, help="Start the services the topology places on this host."),
       dry_run: bool = typer.Option(False, "--dry-run", help="Print what would run where; start nothing."),
       engine: Optional[str] = typer.Option(None, help="Run the topology's engine as this kind: vllm (real vLLM, "
                                                       "installed on first use) or torch (the local torch engine)."),
       engines: Optional[int] = typer.Option(None, help="Run this many engine replicas (ports from the engine's "
                                                        "on); the gateway keeps each group on one and spills to "
                                                        "the least loaded past its queue limit."),
       kv_tier: Optional[str] = typer.Option(None, help="Start the shared KV tier: lmcache (LMCache's server; every "
                                                        "vLLM engine stores and reads prompt KV there)."),
       as_json: bool = JsonOption) -> None:
    """Start the broker (embedded unless --bootstrap-servers), create topics, start the topology's services."""
    cfg = settings(bootstrap_servers)
    try:
        chosen = deploy.load_topology(topology)
        if engine is not None:
            chosen = chosen.with_engine(engine)
        if engines is not None:
            chosen = chosen.with_engines(engines)
        if kv_tier is not None:
            chosen = chosen.with_kv_tier(kv_tier)
        deploy.plan(cfg, chosen)  # a topology that cannot run (a tier beside a torch engine) is refused now
    except (FileNotFoundError, ValueError) as exc:
        typer.echo(f"forge-stream up: {exc}", err=True)
        raise typer.Exit(2)
    if dry_run:
        _print_plan(deploy.describe_plan(cfg, chosen, host), as_json)
        return
    try:
        result = deploy.up(cfg, chosen, echo=lambda m: console.print(f"[dim]{m}[/dim]"), host=host)
    except (TopicMismatch, ServiceError, ValueError, VllmInstallError) as exc:
        typer.echo(f"forge-stream up failed: {exc}", err=True)
        raise typer.Exit(1)
    if as_json:
        typer.echo(json.dumps(result))
        return
    console.print(f"[bold green]forge-stream is up[/bold green]: Kafka at {result['bootstrap_servers']}")
    for name, svc in result["services"].items():
        console.print(f"  {name:<12} {svc['url'] or '(no port)'}  pid {svc['pid']}  log {svc['log']}")
    console.print(f"A supervisor (pid {result['supervisor']}) restarts a service that dies. "
                  "Stop with `forge-stream down`; inspect with `forge-stream status` and `forge-stream logs`.")


def _print_plan(result: dict, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(result))
        return
    replication = result["replication"]
    typer.echo(f"topology {result['topology']}: Kafka {result['kafka']} (topics: replication factor "
               f"{replication['factor']}, min.insync.replicas {replication['min_insync_replicas']})")
    for host, services in result["hosts"].items():
        typer.echo(f"\n{host}:" + ("" if host == "(this machine)" else f"  forge-stream up {result['topology']} "
                                                                        f"--host {host}"))
        for s in services:
            env = " ".join(f"{k}={v}" for k, v in s["env"].items())
            typer.echo(f"  {s['service']:<11} {env + ' ' if env else ''}{s['command']}")


def down(bootstrap_servers: Optional[str] = BootstrapOption, as_json: bool = JsonOption) -> None:
    """Stop the services and the embedded broker (data is kept for the next `up`)."""
    result = deploy.down(settings(bootstrap_servers))
    typer.echo(json.dumps(result) if as_json else
               f"stopped services: {', '.join(result['stopped_services']) or 'none'}; "
               f"embedded broker {'stopped' if result['stopped_broker'] else 'was not running'}")


def _print_whole(out: Console, *tables: Table) -> None:
    """Print tables without cutting a cell short (a URL ending in "…") when the output is not a terminal (a pipe, a
    file): rich lays them out to 80 columns there unless COLUMNS says otherwise."""
    if not out.is_terminal:
        wide = out.options.update_width(1 << 16)
        out.width = max([out.width, *(out.measure(t, options=wide).maximum for t in tables)])
    out.print(*tables)


def _tier_line(tier: dict) -> str:
    """One line on the shared KV tier: its L1 use and how much of what the engines looked up it held."""
    if not tier["reachable"]:
        return f"KV tier (LMCache) at {tier['address']}: not answering ({tier.get('error', 'not running')})"
    share = f" ({tier['hit_tokens'] / tier['lookup_tokens']:.0%})" if tier["lookup_tokens"] else ""
    return (f"KV tier (LMCache) at {tier['address']}: L1 {tier['l1_used_bytes'] / 2**20:.0f} of "
            f"{tier['l1_total_bytes'] / 2**20:.0f} MiB used, {tier['lookups']} lookups, {tier['hit_tokens']} of "
            f"{tier['lookup_tokens']} prompt tokens found{share}, {tier['stored_chunks']} chunks stored")


def _rollout_hint(services: dict) -> str | None:
    """The line a rollout run would fail with (`startup.reach_gateway`) when the gateway or its engine is not
    running; None when both run (or the deployment has no gateway)."""
    gateway, engine = services.get("gateway"), services.get("engine")
    if gateway and gateway["state"] != "running":
        return gateway_unreachable(gateway["url"], f"its service is {gateway['state']}")
    if gateway and engine and engine["state"] != "running":
        return engine_unreachable(gateway["url"], f"its service is {engine['state']}")
    return None


def status(bootstrap_servers: Optional[str] = BootstrapOption, as_json: bool = JsonOption) -> None:
    """Broker reachability, topics with partitions and end offsets, consumer-group lag, per service its state
    (running, starting, unhealthy, restarting, crash-looping, dead), pid, restarts and last exit with its log's tail,
    and per trainer run what its windowed FIFO waits for (`window`)."""
    cfg = settings(bootstrap_servers)
    result = describe(cfg.bootstrap)
    result["services"] = Supervisor(cfg.run_dir).status()
    tier = result["services"].get("kv_tier")
    if tier is not None:
        result["kv_tier"] = {"address": tier["url"], **(tier_status(tier["health_url"].removesuffix("/healthcheck"))
                                                        if tier["running"] else {"reachable": False})}
    result["window"] = report.read_views(cfg.run_dir)
    if as_json:
        typer.echo(json.dumps(result))
        raise typer.Exit(0 if result["reachable"] else 1)
    out = Console(soft_wrap=True)
    if result["reachable"]:
        topics = Table("topic", "partitions", "messages", title=f"Kafka at {cfg.bootstrap}")
        for name, t in result["topics"].items():
            topics.add_row(name, str(t["partitions"]), str(t["messages"]))
        groups = Table("consumer group", "members", "lag")
        for name, g in result["consumer_groups"].items():
            lag = "no commits" if g["lag"] is None else str(g["lag"])
            if g.get("uncommitted"):
                lag += f" ({len(g['uncommitted'])} partitions never committed)"
            members = "?" if g["members"] is None else str(g["members"])
            if g["members"] == 0:
                members = "[dim]0 (idle)[/dim]"
                lag += " (nothing reads it now)" if g["lag"] else ""
            groups.add_row(name, members, lag)
        _print_whole(out, topics, groups)
    else:
        console.print(f"[red]{kafka_unreachable(cfg)}[/red]")
    services = Table("service", "state", "pid", "restarts", "last exit", "url")
    for name, s in result["services"].items():
        style = {"running": "green", "crash-looping": "bold red", "dead": "red"}.get(s["state"], "yellow")
        last = s["last_exit"]
        services.add_row(name, f"[{style}]{s['state']}[/{style}]", str(s["pid"] or "-"), str(s["restarts"]),
                         f"{last['reason']} after {last['ran_s']:.0f}s" if last else "", s["url"] or "")
    if result["services"]:
        _print_whole(out, services)
    if "kv_tier" in result:
        out.print(_tier_line(result["kv_tier"]))
    for view in result["window"].values():
        age = "" if view["trainer_running"] else (f" (its trainer is not running; as of "
                                                  f"{time.time() - view['updated_ms'] / 1000:.0f} s ago)")
        out.print(f"windowed FIFO of {report.line(view)}{age}", markup=False, highlight=False)
    if hint := _rollout_hint(result["services"]):
        out.print(hint, style="red", markup=False, highlight=False)
    if result["services"] and not any(s["supervised"] for s in result["services"].values()):
        out.print("[red]The supervisor is not running[/red]: nothing restarts a service that dies. "
                  "`forge-stream up` starts it again.")
    for name, s in result["services"].items():
        if s["state"] != "running" and s["last_exit"] and s["last_exit"]["log_tail"]:
            tail = "\n".join(s["last_exit"]["log_tail"].splitlines()[-8:])
            out.print(f"[bold]{name}[/bold] {s['last_exit']['reason']}; its log {s['log']} ended "
                      f"(`forge-stream logs {name}`):")
            out.print(tail, markup=False, highlight=False)
    if not result["reachable"]:
        raise typer.Exit(1)
