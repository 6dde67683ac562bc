"""The answer stays with the grader: an agent, even one that prints its whole task, never gets it (no broker: the
gateway is a stand-in recording the calls an episode makes, the agent a real process where it matters)."""

import asyncio
import json
import sys

import pytest

from forge_stream.rollout.agents import AgentResult, CommandAgent
from forge_stream.rollout.controller import RolloutController, RolloutSettings
from forge_stream.rollout.episode import run_episode
from forge_stream.tasks.spec import TaskSpec
from forge_stream.tasks.suite import DOMAINS, make_tasks, to_jsonl


class Gateway:
    """The gateway calls of one episode, recorded."""

    def __init__(self):
        self.rewards: list[float] = []

    async def open(self, session_id, task_id, group_id, metadata):
        return {"base_url": f"http://gateway/s/{session_id}/v1", "token": "t"}

    async def reward(self, session_id, body, key):
        self.rewards.append(body["value"])

    async def finish(self, session_id, status, reason):
        pass


def episode(agent, task):
    gateway = Gateway()
    outcome = asyncio.run(run_episode(gateway, agent, task, "g", "s", {}))
    assert outcome.ok, outcome.reason
    return gateway.rewards


@pytest.mark.parametrize("domain", DOMAINS)
def test_the_agent_gets_the_question_and_the_grader_the_answer(domain):
    for task in make_tasks("train", 20, seed=4, mix={domain: 1.0}):
        assert "answer" not in task.prompt and set(task.reference) == {"answer"}
        seen = []

        async def agent(ctx, answer=task.reference["answer"]):
            seen.append(ctx.task)
            return AgentResult(answer, True)  # an agent that solved it

        assert episode(agent, task) == [1.0]
        assert seen == [task.prompt]
    again = [TaskSpec.from_json(json.loads(line)) for line in to_jsonl([task]).splitlines()]
    assert again == [task]  # a task file keeps the reference apart too


def test_an_agent_that_prints_its_task_cannot_print_the_answer():
    """The black-box agent gets its task in FORGE_TASK_JSON and on stdin; this one prints whatever answer it was
    handed. On the suite's tasks it has none to print; on a task that puts the answer in the prompt it would."""
    cheat = CommandAgent(f"{sys.executable} -c \"import json, os; "
                         f"print(json.loads(os.environ['FORGE_TASK_JSON']).get('answer', 'none'))\"")
    for task in make_tasks("train", 3, seed=1):
        assert episode(cheat, task) == [0.0]
    leaky = TaskSpec("leaky", {"question": "?", "answer": "7"}, grader="numeric")
    assert episode(cheat, leaky) == [1.0]


def test_the_published_task_keeps_the_reference_out_of_the_prompt():
    """Task.prompt_json is what the agent got; the answer travels in Task.reference_json (the processors' subgoal
    rule reads it there)."""
    class Producer:
        records = []

        async def send(self, topic, key, record):
            self.records.append(record)

    task = make_tasks("train", 1, seed=2, mix={"agent": 1.0})[0]
    controller = RolloutController(RolloutSettings("http://gateway", "unused:9092"), None, Producer())
    asyncio.run(controller._submit(task, 0, 0, controller.ids(0, 0, task), again=0))
    [record] = Producer.records
    assert json.loads(record["prompt_json"]) == task.prompt and "answer" not in task.prompt
    assert json.loads(record["reference_json"]) == {"answer": task.reference["answer"]}
