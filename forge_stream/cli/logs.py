"""`forge-stream logs [SERVICE...]`: the tail of a deployment's logs, and `--follow` to watch them grow.

The logs are the files `up` gives its services under the home's run directory (`$FORGE_HOME/run/NAME.log`, kept
after `down` and across restarts: a restart appends), the supervisor's (`supervisor`) and the embedded Kafka broker's
(`broker`, the name `status` gives it; `$FORGE_HOME/kafka/broker.log` for a broker an older `up` ran unsupervised).
Without a name it shows every service's log (not the supervisor's or the broker's: name them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import typer

from forge_stream.cli.options import settings
from forge_stream.proc import tail_lines
from forge_stream.services import Supervisor
from forge_stream.settings import ForgeSettings

EXTRA = ("supervisor", "broker")  # logs shown only when named


def sources(cfg: ForgeSettings) -> dict[str, Path]:
    """Every log of the home, by name: the services in the order `up` started them (then any other log in the run
    directory, e.g. of a service a later `up` no longer runs), the supervisor's, the embedded broker's (where the
    supervisor runs it, else where an unsupervised one wrote it)."""
    run_dir = cfg.run_dir
    started = Supervisor(run_dir).names() if run_dir.is_dir() else []
    found = {p.stem: p for p in sorted(run_dir.glob("*.log"))} if run_dir.is_dir() else {}
    for name in EXTRA:
        found.pop(name, None)
    ordered = {name: found.pop(name) for name in started if name in found}
    ordered.update(found)
    for name, path in (("supervisor", run_dir / "supervisor.log"), ("broker", run_dir / "broker.log"),
                       ("broker", cfg.broker_dir / "broker.log")):
        if path.exists() and name not in ordered:
            ordered[name] = path
    return ordered


@dataclass
class _Followed:
    name: str
    path: Path
    at: int  # bytes of the file already shown
    partial: bytes = b""  # a last line not ended yet


def follow(followed: list[_Followed], interval: float = 0.25,
           stop: Callable[[], bool] = lambda: False) -> Iterator[tuple[str, str]]:
    """(name, line) for every line appended to the files, as they grow; a file that shrank (truncated, or replaced
    by a shorter one) is read again from its start, and one that does not exist yet is waited for."""
    while not stop():
        quiet = True
        for f in followed:
            try:
                size = f.path.stat().st_size
            except FileNotFoundError:
                continue
            if size < f.at:
                f.at, f.partial = 0, b""
            if size == f.at:
                continue
            with open(f.path, "rb") as fh:
                fh.seek(f.at)
                data = f.partial + fh.read(size - f.at)
            f.at = size
            *complete, f.partial = data.split(b"\n")
            for line in complete:
                quiet = False
                yield f.name, line.decode(errors="replace")
        if quiet:
            time.sleep(interval)


def logs(names: list[str] = typer.Argument(None, metavar="SERVICE",
                                           help="Services to show (default: all); also `supervisor`, `broker`."),
         lines: int = typer.Option(40, "--lines", "-n", min=0, help="Lines of each log to show first."),
         follow_: bool = typer.Option(False, "--follow", "-f", help="Keep printing lines as they are written "
                                                                     "(Ctrl-C stops)."),
         prefix: bool = typer.Option(None, "--prefix/--no-prefix",
                                     help="Start each line with its service's name (default: with several logs).")
         ) -> None:
    """The last lines of the deployment's logs (`$FORGE_HOME/run/*.log`), kept after `down`; `-f` follows them."""
    cfg = settings()
    known = sources(cfg)
    if not known:
        typer.echo(f"No logs under {cfg.run_dir}: nothing has run in this home (FORGE_HOME={cfg.home}). Start the "
                   "services with `forge-stream up`.", err=True)
        raise typer.Exit(1)
    unknown = [n for n in names or () if n not in known]
    if unknown:
        typer.echo(f"No log named {', '.join(unknown)} in this home; there are: {', '.join(known)}.", err=True)
        raise typer.Exit(2)
    chosen = list(dict.fromkeys(names)) if names else [n for n in known if n not in EXTRA] or list(known)
    prefixed = len(chosen) > 1 if prefix is None else prefix
    width = max(map(len, chosen))

    def show(name: str, line: str) -> None:
        typer.echo(f"{name:<{width}} | {line}" if prefixed else line)

    followed = []
    for name in chosen:
        shown, end = tail_lines(known[name], lines)
        for line in shown:
            show(name, line)
        followed.append(_Followed(name, known[name], end))
    if not follow_:
        return
    try:
        for name, line in follow(followed):
            show(name, line)
    except KeyboardInterrupt:
        pass
