"""A local Apache Kafka (KRaft) run from jars that Maven fetches: fetch, format, start, wait, stop.

Used by `forge-stream up` when no external cluster is configured, and by the test suite's broker fixture.
The jars are fetched once into a cache shared by every data directory; each broker has its own data directory,
ports, log file and pid file, so several can run side by side.

`LocalCluster` runs N such nodes as one cluster (static controller quorum, replication factor N capped at 3,
`min.insync.replicas` one less): what the tests use to kill a broker under load, as a real deployment loses one.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from string import Template

from forge_stream.proc import ProcessError, alive, start_process, wait_healthy
from forge_stream.shipped import shipped
from forge_stream.topics import TOPICS

INFRA_DIR = shipped("infra/kafka")
KAFKA_VERSION = "4.1.1"
JARS_REVISION = 2  # bump when infra/kafka/pom.xml changes, so caches refetch


class BrokerError(RuntimeError):
    """The local broker could not be fetched, formatted or started; the message says what to do."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jar_dir(cache_dir: Path) -> Path:
    return cache_dir / f"kafka-{KAFKA_VERSION}-r{JARS_REVISION}" / "libs"


def fetch_jars(cache_dir: Path, echo=print) -> Path:
    """Fetch the broker jars with Maven into the cache (once); returns the folder of jars."""
    libs = jar_dir(cache_dir)
    if (libs / ".complete").exists():
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError("Maven (mvn) is not on PATH: install it (apt-get install maven) or pass --bootstrap-servers")
    libs.mkdir(parents=True, exist_ok=True)
    echo(f"Fetching Apache Kafka {KAFKA_VERSION} jars with Maven into {libs} (once; later runs use the cache)...")
    cmd = [mvn, "-B", "-ntp", "-f", str(INFRA_DIR / "pom.xml"), "dependency:copy-dependencies",
           f"-DoutputDirectory={libs}", "-DincludeScope=runtime"]
    proc = start_process(cmd, subprocess.PIPE, text=True)
    tail: list[str] = []
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-40:]
        if "Copying" in line or "Downloaded" in line or "BUILD" in line:
            echo("  " + line.strip()[:120])
    if proc.wait() != 0:
        raise BrokerError("Maven could not fetch the Kafka jars:\n" + "\n".join(tail))
    (libs / ".complete").write_text(KAFKA_VERSION)
    return libs


@dataclass(frozen=True)
class BrokerConfig:
    data_dir: Path
    cache_dir: Path
    port: int = 9092
    controller_port: int = 9093
    heap: str = "512m"
    offsets_partitions: int = 4
    rebalance_delay_ms: int = 0
    node_id: int = 1
    voters: tuple[tuple[int, int], ...] = ()  # (node id, controller port) of a static quorum; () = this node alone
    cluster_id: str | None = None  # the cluster's nodes share one; None: a fresh one at format
    replication: int = 1
    min_isr: int = 1

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def quorum(self) -> str:
        if not self.voters:
            return f"controller.quorum.bootstrap.servers=127.0.0.1:{self.controller_port}"
        return "controller.quorum.voters=" + ",".join(f"{i}@127.0.0.1:{port}" for i, port in self.voters)


class LocalBroker:
    """One local broker process, identified by its data directory."""

    def __init__(self, config: BrokerConfig):
        self.config = config
        self.dir = config.data_dir
        self.pid_file = self.dir / "broker.pid"
        self.log_file = self.dir / "broker.log"
        self.properties = self.dir / "server.properties"

    def _render(self) -> None:
        template = Template((INFRA_DIR / "server.properties.template").read_text())
        c = self.config
        self.properties.write_text(template.substitute(
            port=c.port, controller_port=c.controller_port, data_dir=self.dir / "data", node_id=c.node_id,
            quorum=c.quorum, replication=c.replication, min_isr=c.min_isr,
            offsets_partitions=c.offsets_partitions, rebalance_delay_ms=c.rebalance_delay_ms,
            message_max_bytes=TOPICS.largest_message_bytes(),
        ))

    def _java(self, libs: Path, main: str, *args: str) -> list[str]:
        java = shutil.which("java") or str(Path(os.environ.get("JAVA_HOME", "/usr")) / "bin" / "java")
        log4j = INFRA_DIR / "log4j2.yaml"
        return [java, f"-Xmx{self.config.heap}", f"-Xms{self.config.heap}", "-XX:+UseG1GC",
                "-XX:TieredStopAtLevel=1", "-Xshare:auto", f"-Dlog4j2.configurationFile={log4j}",
                "-Dkafka.logs.dir=" + str(self.dir / "logs"), "-cp", f"{libs}/*", main, *args]

    def format(self, libs: Path) -> None:
        """Format the KRaft storage on first run; later runs keep the data."""
        if (self.dir / "data" / "meta.properties").exists():
            return
        cid = self.config.cluster_id or new_cluster_id()
        # `--cluster-id=ID`, not `-t ID`: a random id may start with "-", which the parser takes for an option
        quorum = [] if self.config.voters else ["--standalone"]  # static voters are in the properties
        out = subprocess.run(self._java(libs, "kafka.tools.StorageTool", "format", f"--cluster-id={cid}",
                                        "-c", str(self.properties), *quorum),
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise BrokerError(f"formatting KRaft storage in {self.dir} failed:\n{out.stdout}\n{out.stderr}")

    def pid(self) -> int | None:
        """The pid in the pid file, if that process is this broker: a stale file's pid, reused since by an unrelated
        process, is never taken for it (so never signalled). Its command line must run kafka.Kafka on this broker's
        properties file."""
        try:
            pid = int(self.pid_file.read_text())
        except (FileNotFoundError, ValueError):
            return None
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:  # no such process (or not ours to read)
            return None
        if b"kafka.Kafka" not in argv or str(self.properties).encode() not in argv:
            return None
        return pid

    def command(self, echo=print) -> list[str]:
        """The broker's command line, ready to run: jars fetched, properties written, storage formatted."""
        libs = fetch_jars(self.config.cache_dir, echo)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._render()
        self.format(libs)
        return self._java(libs, "kafka.Kafka", str(self.properties))

    def start(self, echo=print, timeout: float = 90.0, wait: bool = True) -> str:
        """Start the broker in the background (fetching and formatting as needed); returns bootstrap servers.
        `wait=False` returns once the process runs (a cluster's first node cannot answer before a quorum)."""
        if self.pid() is not None:
            if wait:
                self.wait_ready(timeout)
            return self.config.bootstrap
        self._proc = start_process(self.command(echo), self.log_file, new_session=True)
        self.pid_file.write_text(str(self._proc.pid))
        if wait:
            self.wait_ready(timeout, self._proc)
        return self.config.bootstrap

    def kill(self) -> None:
        """SIGKILL the broker, as a crashed machine would stop it (no clean shutdown, no leader handover)."""
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while self.pid() is not None and time.monotonic() < deadline:
                _reap(pid)
                time.sleep(0.05)
            self.pid_file.unlink(missing_ok=True)

    def wait_ready(self, timeout: float, proc: subprocess.Popen | None = None) -> None:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.config.bootstrap, "log_level": 0})

        def answers() -> bool:
            try:
                return bool(admin.list_topics(timeout=2).brokers)
            except Exception:  # not up yet
                return False

        try:
            wait_healthy(f"the broker at {self.config.bootstrap}", proc, check=answers, log=self.log_file,
                         timeout=timeout, interval=0.3)
        except ProcessError as exc:
            raise BrokerError(str(exc)) from None

    def stop(self, timeout: float = 30.0) -> bool:
        """Stop cleanly (SIGTERM, then SIGKILL after `timeout`); returns whether one was running."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while alive(pid) and time.monotonic() < deadline:  # alive() reaps it if it is our child
            time.sleep(0.2)
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _reap(pid)
        self.pid_file.unlink(missing_ok=True)
        return True


def new_cluster_id() -> str:
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


class LocalCluster:
    """N local KRaft nodes (each broker and controller) forming one cluster with a static controller quorum."""

    def __init__(self, data_dir: Path, cache_dir: Path, nodes: int = 3, heap: str = "384m"):
        ports = [(free_port(), free_port()) for _ in range(nodes)]
        voters = tuple((i + 1, controller) for i, (_, controller) in enumerate(ports))
        replication = min(3, nodes)
        cid = new_cluster_id()
        self.nodes = [LocalBroker(BrokerConfig(
            data_dir / f"node-{i + 1}", cache_dir, port, controller, heap, node_id=i + 1, voters=voters,
            cluster_id=cid, replication=replication, min_isr=max(1, replication - 1)))
            for i, (port, controller) in enumerate(ports)]

    @property
    def bootstrap(self) -> str:
        return ",".join(node.config.bootstrap for node in self.nodes)

    def start(self, echo=print, timeout: float = 120.0) -> str:
        for node in self.nodes:
            node.start(echo, timeout, wait=False)
        for node in self.nodes:
            node.wait_ready(timeout, getattr(node, "_proc", None))
        self.wait_brokers(len(self.nodes), timeout)
        return self.bootstrap

    def wait_brokers(self, count: int, timeout: float = 120.0) -> None:
        """Wait until `count` brokers are registered in the cluster's metadata."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if len(admin.list_topics(timeout=2).brokers) >= count:
                    return
            except Exception:  # a node still starting
                pass
            time.sleep(0.3)
        raise BrokerError(f"the local cluster did not show {count} brokers within {timeout:.0f}s")

    def stop(self) -> None:
        """Stop every node at once. One at a time, the last node left has no controller quorum, and its controlled
        shutdown waits out the whole stop timeout before it is killed."""
        for node in self.nodes:
            pid = node.pid()
            if pid is not None:
                os.kill(pid, signal.SIGTERM)
        for node in self.nodes:
            node.stop()


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


if __name__ == "__main__":  # pragma: no cover - manual use: python -m forge_stream.kafka.broker DATA_DIR
    b = LocalBroker(BrokerConfig(Path(sys.argv[1]), Path.home() / ".cache" / "forge-stream"))
    print(b.start())
