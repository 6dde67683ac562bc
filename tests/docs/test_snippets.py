"""What the pages tell a newcomer is what runs: the README's (and Getting started's) Avro reader, run as a reader
runs it against a real deployment (`forge-stream up` of the broker and the schema registry) on ports other than the
defaults, from a shell that knows only the home; the setup page's warm start, as `up` runs it."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from forge_stream.kafka.broker import free_port
from forge_stream.kafka.producer import EventProducer
from forge_stream.processors.synthetic import group_events
from forge_stream.topics import TOPICS

REPO = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/getting-started.md")


def avro_reader(page: str) -> str:
    """The page's Python block that reads an event with confluent-kafka's deserializer."""
    blocks = re.findall(r"^```python\n(.*?)^```", (REPO / page).read_text(), re.S | re.M)
    [block] = [b for b in blocks if "AvroDeserializer" in b]
    return block


def test_the_avro_reader_of_the_readme_reads_a_reward_of_a_deployment_on_other_ports(tmp_path):
    assert avro_reader(PAGES[0]) == avro_reader(PAGES[1])  # one snippet, shown twice
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env.update(FORGE_HOME=str(tmp_path / "home"), FORGE_KAFKA_PORT=str(free_port()),
               FORGE_KAFKA_CONTROLLER_PORT=str(free_port()), FORGE_REGISTRY_PORT=str(free_port()))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # where `forge-stream` is installed
    reader = {k: v for k, v in env.items() if not k.endswith("_PORT")}  # a new shell: the home, no ports
    try:
        up = subprocess.run([sys.executable, "-m", "forge_stream", "up", "infra"], env=env, capture_output=True,
                            text=True, timeout=180)
        assert up.returncode == 0, up.stderr[-3000:]
        bootstrap = f"127.0.0.1:{env['FORGE_KAFKA_PORT']}"
        group = f"snippet-{time.monotonic_ns()}"
        producer = EventProducer(bootstrap)
        for schema, record in group_events(group, group_size=1, turns=1, start_ms=int(time.time() * 1000)):
            if schema == "Reward":
                producer.send_sync(TOPICS.rewards, group, record, schema)
        producer.close()

        done = subprocess.run([sys.executable, "-c", avro_reader(PAGES[0])], env=reader, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.startswith("{") and f"'group_id': '{group}'" in done.stdout, done.stdout[-2000:]
        assert done.stderr == ""  # no line of librdkafka's connection errors
    finally:
        subprocess.run([sys.executable, "-m", "forge_stream", "down"], env=env, capture_output=True, timeout=120)


def test_the_setup_page_states_the_warm_start_the_demo_model_gets():
    """`up` warm-starts the demo model with SftSettings' defaults (deploy.demo_model): the page says when it stops."""
    from forge_stream.trainer.sft import SftSettings

    defaults = SftSettings(base_model=Path("."), out=Path("."))
    page = " ".join((REPO / "docs" / "benchmarks" / "setup.md").read_text().split())
    assert (f"SFT on {defaults.examples} of the suite's demonstrations until the held-out criterion reaches "
            f"{defaults.target} (measured every {defaults.check_every} steps, at most {defaults.max_steps:,} steps"
            in page)
