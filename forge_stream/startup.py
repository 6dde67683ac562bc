"""What a service process does as it starts, for the command line and the engine's own entry point alike
(`python -m forge_stream.engine`, which imports no command line): a user's mistake as one line and exit status 2,
Kafka reached (exit status 1 where it does not answer) and its topics checked against the catalog (exit status 3),
and for a rollout run the gateway and its engine reached (exit status 1 where either does not answer).
"""

from __future__ import annotations

import time

import httpx
import typer

from forge_stream.settings import ForgeSettings


def user_error(message: str) -> typer.Exit:
    """A user's mistake: one line on stderr saying what is wrong and what to do, exit status 2 (a traceback is
    for bugs). Raise what it returns."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


KAFKA_ANSWER_S = 10.0  # how long a command run by hand gives the deployment's Kafka to answer

WaitForKafkaOption = typer.Option(
    False, "--wait-for-kafka",
    help="Wait at start however long Kafka is away (what a service that `up` supervises does); without it, a Kafka "
         f"that does not answer within {KAFKA_ANSWER_S:.0f} s ends the command with exit status 1.")


def kafka_unreachable(cfg: ForgeSettings) -> str:
    """The one line saying that the deployment's Kafka does not answer, and what to do (`status` says it too)."""
    if cfg.embedded:
        return f"Kafka at {cfg.bootstrap} is not reachable: start it with `forge-stream up`."
    return (f"Kafka at {cfg.bootstrap} is not reachable: start that cluster, or name one that runs with "
            "--bootstrap-servers.")


def reach_kafka(cfg: ForgeSettings) -> None:
    """What a command run against the deployment does first: Kafka must answer within KAFKA_ANSWER_S, else one line
    on stderr (`kafka_unreachable`) and exit status 1, instead of waiting with nothing said."""
    from forge_stream.kafka.admin import wait_for_kafka

    try:
        wait_for_kafka(cfg.bootstrap, echo=lambda _line: None, timeout=KAFKA_ANSWER_S)
    except TimeoutError:
        typer.echo(f"error: {kafka_unreachable(cfg)}", err=True)
        raise typer.Exit(1) from None


def ready_kafka(cfg: ForgeSettings, wait: bool = False) -> None:
    """What a service does before it starts: with `wait` (--wait-for-kafka, as `up` starts it) wait for Kafka however
    long it is away, without it `reach_kafka`; then refuse to run, with the fixing command, on topics unlike the
    catalog or replicated otherwise than the deployment says (exit status 3)."""
    from forge_stream.kafka.admin import TopicMismatch, ready_topics

    if not wait:
        reach_kafka(cfg)
    try:
        ready_topics(cfg.bootstrap, echo=lambda line: typer.echo(line, err=True), replication=cfg.replication)
    except TopicMismatch as exc:
        typer.echo(f"refusing to start: {exc}", err=True)
        raise typer.Exit(3)


GATEWAY_ANSWER_S = 5.0  # how long a rollout run by hand gives the gateway and its engine to answer
GATEWAY_REPEAT_S = 60.0  # how often a service waiting for them says so again


def gateway_unreachable(url: str, why: str) -> str:
    """The one line saying that the gateway at `url` does not answer, and what to do (`status` says it too)."""
    return (f"the gateway at {url} is not reachable ({why}): start it with `forge-stream up`, or name the one that "
            "runs with --gateway-url (`forge-stream status` shows the services)")


def engine_unreachable(url: str, why: str) -> str:
    """The one line saying that the gateway at `url` answers and its engine does not, and what to do."""
    return (f"the gateway at {url} answers, but its engine does not ({why}): `forge-stream status` shows the "
            "engine's state, `forge-stream logs engine` its log")


def gateway_problem(url: str, admin_token: str | None, timeout_s: float = GATEWAY_ANSWER_S) -> str | None:
    """None when the gateway at `url` answers GET /v1/models, which it asks its engine: both are up. Otherwise the
    one line saying which of them does not answer (or that the admin token was refused) and what to do, once they
    did not for `timeout_s`."""
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            response = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=GATEWAY_ANSWER_S)
        except httpx.HTTPError as exc:
            problem = gateway_unreachable(url, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        else:
            if response.status_code == 200:
                return None
            said = f"HTTP {response.status_code}: {' '.join(response.text.split())[:200]}"
            if response.status_code in (401, 403):
                return (f"the gateway at {url} refused the admin token ({said}): pass the deployment's with "
                        "--admin-token or FORGE_GATEWAY_ADMIN_TOKEN")
            if response.status_code < 500:
                return f"the gateway at {url} answered GET /v1/models with {said}: is it a forge-stream gateway?"
            problem = engine_unreachable(url, said)
        if time.monotonic() >= deadline:
            return problem
        time.sleep(0.5)


def reach_gateway(url: str, admin_token: str | None, wait: bool = False) -> None:
    """What a rollout run does before it publishes any task: the gateway and its engine must answer within
    GATEWAY_ANSWER_S, else one line on stderr (`gateway_problem`) and exit status 1. With `wait` (a service that `up`
    supervises, started while the engine may still be loading) it waits however long, saying why every minute."""
    while (problem := gateway_problem(url, admin_token, GATEWAY_REPEAT_S if wait else GATEWAY_ANSWER_S)) is not None:
        if not wait:
            typer.echo(f"error: {problem}", err=True)
            raise typer.Exit(1)
        typer.echo(f"waiting: {problem}", err=True)
