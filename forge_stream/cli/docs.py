"""`forge-stream docs`: the generated parts of the documentation, and benchmark results kept as data.

The pages under docs/ (and README.md) are hand-written Markdown with generated regions, each between
`<!-- generated: NAME [ARG] -->` and `<!-- end generated -->`. `docs generate` rewrites every region from what it
documents: `cli` from the Typer app itself, `topics` from the topic catalog (`forge_stream.topics.TOPICS`) and the
topologies' replication, `events` from `schemas/*.avsc` and `schemas/registry.json`, `settings` from `ForgeSettings`
and the CLI's environment variables, `results BENCHMARK [exploratory]` (every run, newest first),
`current BENCHMARK` (what a benchmark's page leads with: its current result), `headlines [LINK_BASE]` and
`fifo-chart WORKLOAD` (the window's trade-off, drawn by Mermaid) from the result files under `benchmarks/results/`.
`docs generate --check` writes nothing and fails, naming the pages, when a region is out of date (tests/docs runs
it). `docs record` turns one benchmark run's JSON output into a result file, with the command, the commit and the
machine, so a re-run updates the tables instead of adding a paragraph.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Callable, Optional

import typer

from forge_stream.startup import user_error

app = typer.Typer(no_args_is_help=True, help="The documentation site's generated pages and benchmark results.")

REGION = re.compile(r"(<!-- generated: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)
RESULTS = Path("benchmarks") / "results"


@app.callback()
def group() -> None:
    """The documentation site (docs/, mkdocs.yml) and benchmarks/results/."""


def cli_reference(root: Path, _arg: str) -> str:
    """Every command and option, as Typer documents the app."""
    import typer.main
    from typer.cli import get_docs_for_click

    from forge_stream.cli import app as forge

    command = typer.main.get_command(forge)
    text = get_docs_for_click(obj=command, ctx=typer.Context(command), name="forge-stream",
                              title="Command line reference")
    return text.strip() + "\n"


def cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def topic_reference(root: Path, _arg: str) -> str:
    """The topic catalog: one row per topic, then its settings."""
    from forge_stream.topics import TOPICS

    def days(ms: int) -> str:
        return "forever" if ms < 0 else f"{ms / 86_400_000:g} days"

    lines = ["| topic | key | events | partitions | retention | max record | producers | consumers |",
             "|---|---|---|---|---|---|---|---|"]
    for t in TOPICS.all():
        events = ", ".join(f"[{name}](events.md#{name.lower()})" for name in t.value_schemas)
        lines.append(f"| `{t.name}` | {cell(t.key)} | {events} | {t.partitions} | {days(t.retention_ms)} | "
                     f"{t.max_message_bytes // 1024 ** 2} MiB | {cell(', '.join(t.producers))} | "
                     f"{cell(', '.join(t.consumers))} |")
    lines += ["", *replication_table(root)]
    for t in TOPICS.all():
        config = ", ".join(f"`{k}={v}`" for k, v in t.config().items())
        lines += ["", f"### `{t.name}`", "", t.doc, "", f"Topic configs (embedded default): {config}."]
    return "\n".join(lines) + "\n"


def replication_table(root: Path) -> list[str]:
    """Each shipped topology's replication of every catalog topic (its `kafka:` section), and what it survives: writes
    go on while `min.insync.replicas` brokers of a partition's replicas are up; an acknowledged record is on at least
    `min.insync.replicas` brokers, so it outlives the loss of one fewer."""
    from forge_stream.deploy import load_topology

    lines = ["### Replication", "",
             "Every catalog topic of a deployment is replicated as its topology states (`kafka.replication_factor`, "
             "`kafka.min_insync_replicas`; 1 and 1 without them). Producers send with acks=all, so a record is "
             "acknowledged once `min.insync.replicas` brokers have it. `forge-stream up` creates the topics so and "
             "checks them; it hands the replication to every service (`FORGE_REPLICATION_FACTOR`, "
             "`FORGE_MIN_INSYNC_REPLICAS`), whose start-up check refuses topics replicated otherwise.", "",
             "| topology | replication factor | min.insync.replicas | brokers that can be lost with writes going on | "
             "brokers that can be lost with no acknowledged record lost |",
             "|---|---|---|---|---|"]
    for path in sorted((root / "topologies").glob("*.yaml")):
        r = load_topology(str(path)).replication
        lines.append(f"| `{path.stem}` | {r.factor} | {r.min_insync} | {r.factor - r.min_insync} | "
                     f"{r.min_insync - 1} |")
    return lines


def avro_type(schema) -> str:
    if isinstance(schema, str):
        return schema
    if isinstance(schema, list):
        return " \\| ".join(avro_type(s) for s in schema)
    kind = schema["type"]
    if kind == "array":
        return f"array of {avro_type(schema['items'])}"
    if kind == "map":
        return f"map of {avro_type(schema['values'])}"
    if kind in ("record", "enum", "fixed"):
        return f"{kind} {schema['name']}"
    if "logicalType" in schema:
        return f"{kind} ({schema['logicalType']})"
    return avro_type(kind)


def record_fields(schema: dict, prefix: str = "") -> list[str]:
    """Table rows of a record's fields, a nested record's (or an array's record items') fields after it."""
    rows, nested = [], []
    for field in schema["fields"]:
        default = f"`{json.dumps(field['default'])}`" if "default" in field else ""
        rows.append(f"| `{prefix}{field['name']}` | {avro_type(field['type'])} | {cell(default)} | "
                    f"{cell(field.get('doc', ''))} |")
        inner = field["type"]
        for candidate in inner if isinstance(inner, list) else [inner]:
            if isinstance(candidate, dict) and candidate.get("type") == "array":
                candidate = candidate["items"]
            if isinstance(candidate, dict) and candidate.get("type") == "record":
                nested.append(record_fields(candidate, f"{prefix}{field['name']}."))
    return rows + [row for rows_ in nested for row in rows_]


def event_reference(root: Path, _arg: str) -> str:
    """Every event of schemas/*.avsc: its topics, registered versions and fields."""
    from forge_stream.topics import TOPICS

    registry = json.loads((root / "schemas" / "registry.json").read_text())["schemas"]
    parts = []
    for path in sorted((root / "schemas").glob("*.avsc")):
        schema = json.loads(path.read_text())
        name = schema["name"]
        full = f"{schema.get('namespace', '')}.{name}".lstrip(".")
        topics = ", ".join(f"[`{t.name}`](topics.md#{t.name.replace('.', '')})" for t in TOPICS.all()
                           if name in t.value_schemas) or "none"
        versions = ", ".join(f"v{s['version']} (id {s['id']}{', current' if s['file'] == path.name else ''})"
                             for s in registry if s["name"] == full)
        parts += [f"## {name}", "", schema.get("doc", ""), "",
                  f"File `schemas/{path.name}`; topics: {topics}; registered versions: {versions or 'none'}.", "",
                  "| field | type | default | meaning |", "|---|---|---|---|", *record_fields(schema), ""]
    return "\n".join(parts)


def settings_reference(root: Path, _arg: str) -> str:
    """ForgeSettings' fields with their FORGE_* variables, then every CLI option that reads a variable."""
    import typer.main

    from forge_stream.cli import app as forge
    from forge_stream.settings import ForgeSettings

    home = str(Path.home())
    lines = ["| variable | setting | default | meaning |", "|---|---|---|---|"]
    source = (root / "forge_stream" / "settings.py").read_text()
    for name, field in ForgeSettings.model_fields.items():
        comment = re.search(rf"^\s+{name}: .*?#\s*(.*)$", source, re.M)
        default = str(field.default).replace(home, "~") if field.default is not None else "none"
        meaning = cell(comment.group(1)) if comment else ""
        lines.append(f"| `FORGE_{name.upper()}` | `{name}` | `{default}` | {meaning} |")
    seen: dict[str, list[str]] = {}

    def walk(command, path: str) -> None:
        for param in command.params:
            for var in [param.envvar] if isinstance(param.envvar, str) else param.envvar or []:
                seen.setdefault(var, []).append(f"`{path} {param.opts[0]}`")
        for name, sub in sorted(getattr(command, "commands", {}).items()):
            walk(sub, f"{path} {name}")

    walk(typer.main.get_command(forge), "forge-stream")
    lines += ["", "Command options that read a variable when the flag is not given:", "",
              "| variable | options |", "|---|---|"]
    lines += [f"| `{var}` | {', '.join(options)} |" for var, options in sorted(seen.items())]
    return "\n".join(lines) + "\n"


def load_results(root: Path) -> list[dict]:
    results = []
    for path in sorted((root / RESULTS).glob("*.json")):
        result = json.loads(path.read_text())
        results.append(result | {"file": path.name})
    return results


def machine_text(machine: dict) -> str:
    cores = f"{machine['cores']} cores" if machine.get("cores") else "cores unknown"
    return cell(", ".join(filter(None, [cores, machine.get("cpu_model") or "CPU model unknown", machine.get("note")])))


def provenance(r: dict) -> tuple[str, str]:
    """A result's date and commit as the pages show them (a run recorded by hand says where it was stated)."""
    stated = r.get("recorded") or {}
    date = r.get("date") or (f"stated {stated['on']}" if stated.get("on") else "date unknown")
    commit = f"`{r['commit'][:10]}`" if r.get("commit") else (
        f"commit unknown (stated in {stated['in']})" if stated.get("in") else "commit unknown")
    return date, commit


def _newest_first(r: dict) -> tuple:
    date = r.get("date") or (r.get("recorded") or {}).get("on") or ""
    return (date, r["file"])


def results_table(root: Path, spec: str) -> str:
    """The result files of one benchmark (`results NAME`), or its exploratory runs (`results NAME exploratory`),
    newest first, the current one (a file with `headline`) marked."""
    benchmark, _, kind = spec.partition(" ")
    rows = [r for r in load_results(root)
            if r["benchmark"] == benchmark and r["exploratory"] == (kind == "exploratory")]
    if not rows:
        raise ValueError(f"no result file of benchmark {spec!r} under {RESULTS}")
    lines = ["| run | what ran | result | target |", "|---|---|---|---|"]
    for r in sorted(rows, key=_newest_first, reverse=True):
        date, commit = provenance(r)
        current = "**current**: " if r.get("headline") else ""
        lines.append(f"| {date}<br>{commit}<br>[raw run](results/{r['file']}) | "
                     f"{current}{cell(r.get('variant') or '')} ({machine_text(r['machine'])}) | {cell(r['summary'])} | "
                     f"{cell(r.get('target') or 'none set')} |")
    return "\n".join(lines) + "\n"


def current_results(root: Path, benchmark: str) -> str:
    """What a benchmark's page leads with (`current NAME`): its current result(s), the files with `headline`."""
    rows = [r for r in load_results(root) if r["benchmark"] == benchmark and r.get("headline")]
    if not rows:
        raise ValueError(f"no result file of benchmark {benchmark!r} under {RESULTS} has a headline")
    lines = [f"**Current result{'s' if len(rows) > 1 else ''}** (every run, newest first, in the table below):", ""]
    for r in rows:
        date, commit = provenance(r)
        lines.append(f"- {r['headline']}. Target: {r.get('target') or 'none set'}. Run {date}, {commit}, "
                     f"{machine_text(r['machine'])} ([raw run](results/{r['file']})).")
    return "\n".join(lines) + "\n"


def headlines(root: Path, base: str) -> str:
    """One line per headline result (a file with `headline`), linking to its benchmark's page."""
    lines = ["| benchmark | current result | target |", "|---|---|---|"]
    for r in load_results(root):
        if r.get("headline"):
            lines.append(f"| [{r['benchmark']}]({base}{r['benchmark']}.md) | {cell(r['headline'])} | "
                         f"{cell(r.get('target') or 'none set')} |")
    return "\n".join(lines) + "\n"


def fifo_chart(root: Path, workload: str) -> str:
    """The window's trade-off as two bar charts (throughput and drift against W) from the scheduler's result."""
    result = json.loads((root / RESULTS / "scheduler-unbounded.json").read_text())
    rows = [r for r in result["result"]["rows"] if r["workload"] == workload and not r["policy"].startswith("greedy_")]
    labels = ", ".join(f'"{r["policy"]} (W={r["W"]})"' for r in rows)

    def chart(title: str, column: str, top: float) -> str:
        values = ", ".join(str(r[column]) for r in rows)
        return (f'```mermaid\nxychart-beta\n    title "{title}"\n    x-axis [{labels}]\n'
                f'    y-axis "{column}" 0 --> {top}\n    bar [{values}]\n```\n')

    return (chart(f"{workload} workload: throughput vs greedy", "throughput_vs_greedy", 1) + "\n"
            + chart(f"{workload} workload: drift", "drift", max(r["drift"] for r in rows)))


GENERATORS: dict[str, Callable[[Path, str], str]] = {
    "cli": cli_reference, "topics": topic_reference, "events": event_reference, "settings": settings_reference,
    "results": results_table, "current": current_results, "headlines": headlines, "fifo-chart": fifo_chart,
}


def render(root: Path, text: str) -> str:
    def region(match: re.Match) -> str:
        name, _, arg = match["spec"].strip().partition(" ")
        return match[1] + GENERATORS[name](root, arg.strip()) + match[4]

    return REGION.sub(region, text)


def pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


@app.command("generate")
def generate(
    root: Path = typer.Option(Path("."), help="The repository checkout (holds docs/, schemas/, benchmarks/)."),
    check: bool = typer.Option(False, "--check", help="Write nothing; exit 1 if a generated region is out of date."),
) -> None:
    """Rewrite every generated region of README.md and docs/ (CLI, topics, events, settings, benchmark tables)."""
    stale = []
    for page in pages(root):
        text = page.read_text()
        fresh = render(root, text)
        if fresh != text:
            stale.append(page.relative_to(root))
            if not check:
                page.write_text(fresh)
    if check and stale:
        typer.echo(f"out of date: {', '.join(map(str, stale))}; run `forge-stream docs generate`", err=True)
        raise typer.Exit(1)
    typer.echo(f"{'checked' if check else 'generated'} {len(pages(root))} pages, {len(stale)} "
               f"{'stale' if check else 'rewritten'}", err=True)


def this_machine() -> dict:
    cpu = re.search(r"^model name\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.M) \
        if Path("/proc/cpuinfo").exists() else None
    return {"cores": os.cpu_count(), "cpu_model": cpu.group(1) if cpu else platform.processor() or None,
            "gpu": None, "note": None}


@app.command("record")
def record(
    result: Path = typer.Argument(..., help="The JSON object the benchmark printed (`forge-stream bench ... --json`)."),
    benchmark: str = typer.Option(..., help="Its page under docs/benchmarks/ (gateway, learning, ...)."),
    command: str = typer.Option(..., help="The command line that produced it."),
    summary: str = typer.Option(..., help="The result in one line, as the benchmark's table shows it."),
    variant: Optional[str] = typer.Option(None, help="What sets this run apart from the benchmark's others."),
    target: Optional[str] = typer.Option(None, help="The target and whether it is met."),
    commit: Optional[str] = typer.Option(None, help="The commit the run was made at, if not the checkout's HEAD "
                                                    "(a later commit may only have added its documentation)."),
    root: Path = typer.Option(Path("."), help="The repository checkout."),
) -> None:
    """Keep one benchmark run as benchmarks/results/BENCHMARK-DATE-COMMIT[-N].json (command, commit, machine, date,
    the run's own JSON; -2, -3, ... for further runs recorded at the same commit), then regenerate the tables."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

    if commit is None:
        commit = git("rev-parse", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    else:
        try:
            commit = git("rev-parse", "--verify", f"{commit}^{{commit}}")
        except subprocess.CalledProcessError:
            raise user_error(f"--commit {commit} is not a commit of {root}") from None
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    entry = {"benchmark": benchmark, "variant": variant, "command": command, "commit": commit, "date": date,
             "machine": this_machine(), "summary": summary, "target": target, "headline": None, "exploratory": False,
             "recorded": None, "result": json.loads(result.read_text()), "notes": None}
    stem = f"{benchmark}-{date}-{commit[:10]}"
    out, n = root / RESULTS / f"{stem}.json", 1
    while out.exists():  # another run recorded at the same commit that day: keep both
        n += 1
        out = root / RESULTS / f"{stem}-{n}.json"
    out.write_text(json.dumps(entry, indent=2) + "\n")
    typer.echo(f"wrote {out}", err=True)
    generate(root, check=False)
