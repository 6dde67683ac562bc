"""The rollout controller on the real broker with a real gateway (scripted engine): slots, timing, failures, and
groups in which no session ran (closed at once, rolled out again by the next run)."""

import asyncio
import time

import httpx
from helpers import read_events, serving

from forge_stream.kafka.broker import free_port
from forge_stream.kafka.producer import EventProducer
from forge_stream.rollout.agents import AgentResult
from forge_stream.rollout.client import GatewayCallError, GatewayClient, RetryPolicy
from forge_stream.rollout.controller import RolloutController, RolloutSettings
from forge_stream.tasks.spec import TaskSpec
from forge_stream.topics import TOPICS

FAST = RetryPolicy(attempts=3, backoff_s=0.01)


def tasks(run_id, n, g, **prompt):
    return [TaskSpec(f"{run_id}-t{i}", {"answer": "42", **prompt}, "agent", "numeric", g) for i in range(n)]


def run_controller(settings, agent, source, stop=None):
    producer = EventProducer(settings.bootstrap)
    try:
        return asyncio.run(RolloutController(settings, agent, producer).run(source, stop))
    finally:
        producer.close()


def session_events(bootstrap, groups):
    return read_events(bootstrap, TOPICS.sessions, lambda r: r["group_id"] in groups)


def test_groups_wait_for_free_slots_and_sessions_time_only_the_agent(kafka_bootstrap, gateway, run_id):
    running, peak = 0, 0

    async def agent(ctx):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.3)
        running -= 1
        return AgentResult("42", True)

    settings = RolloutSettings(gateway, kafka_bootstrap, name=run_id, concurrency=4, retry=FAST)
    result = run_controller(settings, agent, tasks(run_id, 6, 2))
    assert result == {**result, "groups": 6, "sessions": 12, "failed_sessions": 0, "mean_reward": 1.0}
    assert peak == 4

    published = read_events(kafka_bootstrap, TOPICS.tasks, lambda r: r["metadata"].get("controller") == run_id)
    assert len(published) == 6
    events = session_events(kafka_bootstrap, {t["group_id"] for t in published})
    started = {e["session_id"]: e["event_time"] for e in events if "base_url" in e}
    finished = {e["session_id"]: e["event_time"] for e in events if "status" in e}
    assert started.keys() == finished.keys() and len(started) == 12
    # SessionStarted -> SessionFinished spans the agent's 0.3 s, not the wait for a slot (2 waves of 0.3 s)
    assert all(finished[s] - started[s] < 550 for s in started)
    # the Tasks of the last groups were published only once the first groups' sessions had finished
    by_seq = sorted(published, key=lambda t: t["seq"])
    first_done = min(finished[s] for s in finished)
    assert by_seq[-1]["event_time"] >= first_done
    assert by_seq[0]["event_time"] < first_done


def test_a_failing_agent_fails_only_its_session(kafka_bootstrap, gateway, run_id):
    async def agent(ctx):
        if ctx.task.get("explode"):
            raise RuntimeError("agent blew up")
        return AgentResult("42", True)

    source = [*tasks(run_id, 2, 2), TaskSpec(f"{run_id}-bad", {"answer": "42", "explode": True}, "agent",
                                             "numeric", 2)]
    settings = RolloutSettings(gateway, kafka_bootstrap, name=run_id, concurrency=6, retry=FAST)
    result = run_controller(settings, agent, source)
    assert result == {**result, "groups": 3, "sessions": 6, "failed_sessions": 2}
    finished = [e for e in read_events(kafka_bootstrap, TOPICS.sessions, lambda r: "status" in r
                                       and r["task_id"].startswith(run_id))]
    assert sorted((e["task_id"], e["status"]) for e in finished) == sorted(
        [(f"{run_id}-t0", "ok")] * 2 + [(f"{run_id}-t1", "ok")] * 2 + [(f"{run_id}-bad", "error")] * 2)
    assert all("agent blew up" in e["reason"] for e in finished if e["status"] == "error")


class Flaky:
    """A proxy in front of the gateway that loses the answer to the first open of every session (the gateway opens
    it; the controller gets 503), answers 503 to the first reward post of every session, and always 500 to the
    reward posts of sessions whose task id contains "doomed"."""

    def __init__(self, target: str, task_of: dict):
        self.target, self.task_of, self.seen, self.opened = target, task_of, set(), set()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        path = scope["path"]
        status, content = None, b""
        if path.endswith("/reward"):
            session = path.split("/")[3]
            if session not in self.seen:
                self.seen.add(session)
                status = 503
            elif "doomed" in self.task_of.get(session, ""):
                status = 500
        if status is None:
            async with httpx.AsyncClient(base_url=self.target) as http:
                response = await http.request(scope["method"], path, content=body,
                                              headers={"content-type": "application/json"})
            status, content = response.status_code, response.content
            if path == "/v1/sessions" and response.status_code in (200, 201):
                created = response.json()
                self.task_of[created["session_id"]] = created["task_id"]
                if created["session_id"] not in self.opened:  # recorded, and its answer lost on the way back
                    self.opened.add(created["session_id"])
                    status, content = 503, b'{"error": {"message": "lost", "code": 503}}'
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": content})


def test_http_failures_are_retried_and_isolated(kafka_bootstrap, gateway, run_id):
    async def agent(ctx):
        return AgentResult("42", True)

    source = [*tasks(run_id, 2, 2), TaskSpec(f"{run_id}-doomed", {"answer": "42"}, "agent", "numeric", 2)]
    with serving(Flaky(gateway, {})) as proxy:
        settings = RolloutSettings(proxy, kafka_bootstrap, name=run_id, concurrency=6, retry=FAST)
        result = run_controller(settings, agent, source)
    assert result == {**result, "groups": 3, "sessions": 6, "failed_sessions": 2}
    finished = read_events(kafka_bootstrap, TOPICS.sessions, lambda r: "status" in r
                           and r["task_id"].startswith(run_id))
    assert len(finished) == 6
    started = read_events(kafka_bootstrap, TOPICS.sessions, lambda r: "base_url" in r
                          and r["task_id"].startswith(run_id))
    assert len(started) == 6  # each lost open was retried and answered with its session, not opened twice
    assert {(e["task_id"], e["status"]) for e in finished} == {
        (f"{run_id}-t0", "ok"), (f"{run_id}-t1", "ok"), (f"{run_id}-doomed", "error")}
    assert all("posting the reward failed" in e["reason"] for e in finished if e["status"] == "error")


def test_client_gives_up_after_its_tries_on_transport_errors():
    async def main():
        client = GatewayClient(f"http://127.0.0.1:{free_port()}", retry=RetryPolicy(attempts=3, backoff_s=0.05))
        try:
            start = time.monotonic()
            try:
                await client.finish("nope", "ok", None)
            except GatewayCallError as exc:
                return str(exc), time.monotonic() - start
        finally:
            await client.aclose()

    message, elapsed = asyncio.run(main())
    assert "failed 3 times" in message and "ConnectError" in message and "http://127.0.0.1:" in message
    assert elapsed >= 0.15  # backoff 0.05 + 0.1 between the tries


def test_stop_takes_no_new_group_and_lets_sessions_finish(kafka_bootstrap, gateway, run_id):
    async def main():
        stop = asyncio.Event()

        async def agent(ctx):
            stop.set()
            await asyncio.sleep(0.3)
            return AgentResult("42", True)

        producer = EventProducer(kafka_bootstrap)
        try:
            settings = RolloutSettings(gateway, kafka_bootstrap, name=run_id, concurrency=2, loop=True,
                                       retry=FAST)
            return await RolloutController(settings, agent, producer).run(
                tasks(run_id, 5, 2), stop)
        finally:
            producer.close()

    result = asyncio.run(main())
    assert result == {**result, "groups": 1, "sessions": 2, "failed_sessions": 0}


def test_loop_starts_the_source_over_with_new_group_ids(kafka_bootstrap, gateway, run_id):
    async def agent(ctx):
        return AgentResult("42", True)

    settings = RolloutSettings(gateway, kafka_bootstrap, name=run_id, concurrency=4, loop=True, max_groups=5,
                               attempt=7, retry=FAST)
    result = run_controller(settings, agent, tasks(run_id, 2, 2))
    assert result == {**result, "groups": 5, "cycles": 3}
    published = read_events(kafka_bootstrap, TOPICS.tasks, lambda r: r["metadata"].get("controller") == run_id)
    assert len({t["group_id"] for t in published}) == 5
    assert sorted(t["metadata"]["cycle"] for t in published) == ["7", "7", "8", "8", "9"]
    seqs = [t["seq"] for t in sorted(published, key=lambda t: (t["metadata"]["cycle"], t["metadata"]["position"]))]
    assert seqs == sorted(seqs) and len(set(seqs)) == 5


def test_progress_log_lines():
    import doctest

    from forge_stream.rollout import controller

    result = doctest.testmod(controller)
    assert result.attempted >= 3 and result.failed == 0


def test_replay_edge_reruns_tasks_whose_groups_had_a_signal(kafka_bootstrap, gateway, run_id):
    """Tasks t0, t2, ... are at the edge (their agents answer right every other time), the others always solved:
    with replay_edge, edge tasks come back as new groups tagged with the group they follow; solved ones never do."""
    calls: dict[str, int] = {}

    async def agent(ctx):
        await asyncio.sleep(0.05)
        task = ctx.task["name"]
        calls[task] = calls.get(task, 0) + 1
        return AgentResult("42" if int(task[1:]) % 2 or calls[task] % 2 else "7", True)

    source = [TaskSpec(f"{run_id}-t{i}", {"answer": "42", "name": f"t{i}"}, "agent", "numeric", 2)
              for i in range(16)]
    settings = RolloutSettings(gateway, kafka_bootstrap, name=run_id, concurrency=4, retry=FAST, replay_edge=0.5)
    result = run_controller(settings, agent, source)
    published = read_events(kafka_bootstrap, TOPICS.tasks, lambda r: r["metadata"].get("controller") == run_id)
    replays = [t for t in published if "replay_of" in t["metadata"]]
    assert result["groups"] == len(published) == 16 + len(replays) and result["replayed_groups"] == len(replays) > 0
    assert result["edge_groups"] >= 8  # every group of an edge task had a signal
    by_group = {t["group_id"]: t for t in published}
    for t in replays:
        origin = by_group[t["metadata"]["replay_of"]]  # a group published before it, of the same task
        assert origin["task_id"] == t["task_id"] and origin["seq"] < t["seq"]
        assert int(t["task_id"].rsplit("-t", 1)[1]) % 2 == 0  # only edge tasks come back
        assert t["metadata"]["position"] == f"edge:{origin['group_id']}"
    assert len(by_group) == len(published)  # new group ids


def test_replay_edge_must_be_a_share():
    for bad in (-0.1, 1.0):
        try:
            RolloutSettings("http://gateway", "kafka:9092", replay_edge=bad)
        except ValueError as exc:
            assert "replay_edge" in str(exc)
        else:
            raise AssertionError(f"replay_edge={bad} was accepted")


def published_by(bootstrap, name):
    return read_events(bootstrap, TOPICS.tasks, lambda r: r["metadata"].get("controller") == name)


def test_a_group_none_of_whose_sessions_opened_is_closed_at_once_and_rolled_out_again(kafka_bootstrap, gateway,
                                                                                        run_id):
    """A gateway gone away: each group is closed with a GroupSkipped naming the URL (the windowed FIFO retires it
    at once), the run reports the one reason once; the next run of the same name rolls the same tasks out as new
    groups, and the one after that finds them done."""
    async def agent(ctx):
        return AgentResult("42", True)

    nowhere = f"http://127.0.0.1:{free_port()}"
    down = run_controller(RolloutSettings(nowhere, kafka_bootstrap, name=run_id, concurrency=4, retry=FAST), agent,
                          tasks(run_id, 2, 2))
    assert down == {**down, "groups": 2, "sessions": 4, "failed_sessions": 4, "unopened_groups": 2}
    [(reason, count)] = down["failures"].items()
    assert count == 4 and reason.startswith(f"POST {nowhere}/v1/sessions failed 3 times; last: ConnectError")
    first = {t["group_id"]: t for t in published_by(kafka_bootstrap, run_id)}
    skips = read_events(kafka_bootstrap, TOPICS.samples, lambda r: r["group_id"] in first)
    assert sorted(s["group_id"] for s in skips) == sorted(first)
    for s in skips:
        assert s["task_seq"] == first[s["group_id"]]["seq"]
        assert s["reason"] == f"none of its 2 sessions opened: {reason}"

    settings = RolloutSettings(gateway, kafka_bootstrap, name=run_id, concurrency=4, retry=FAST)
    again = run_controller(settings, agent, tasks(run_id, 2, 2))
    assert again == {**again, "groups": 2, "sessions": 4, "failed_sessions": 0, "skipped_groups": 0,
                     "rerun_groups": 2, "mean_reward": 1.0, "failures": {}}
    second = [t for t in published_by(kafka_bootstrap, run_id) if t["group_id"] not in first]
    assert sorted(t["task_id"] for t in second) == sorted(t["task_id"] for t in first.values())
    assert {t["metadata"]["again"] for t in second} == {"1"}

    done = run_controller(settings, agent, tasks(run_id, 2, 2))
    assert done == {**done, "groups": 0, "skipped_groups": 2, "rerun_groups": 0}
    assert len(published_by(kafka_bootstrap, run_id)) == 4


def test_tasks_whose_sessions_all_failed_are_rolled_out_again_by_the_next_run(kafka_bootstrap, gateway, run_id):
    async def broken(ctx):
        return AgentResult("", False, f"no key for the tool (session {ctx.session_id})")

    async def fixed(ctx):
        return AgentResult("42", True)

    settings = RolloutSettings(gateway, kafka_bootstrap, name=run_id, concurrency=4, retry=FAST)
    failed = run_controller(settings, broken, tasks(run_id, 2, 2))
    assert failed == {**failed, "groups": 2, "failed_sessions": 4, "unopened_groups": 0,
                      "failures": {"no key for the tool (session <session>)": 4}}
    rerun = run_controller(settings, fixed, tasks(run_id, 2, 2))
    assert rerun == {**rerun, "groups": 2, "sessions": 4, "failed_sessions": 0, "skipped_groups": 0,
                     "rerun_groups": 2}
