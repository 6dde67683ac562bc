"""Text-protocol agents get tool spans: a rule per agent (forge_stream.gateway.textspans) reads the tool calls of an
assistant turn and their results from the user message that answers it. Driven through a real gateway in front of
a scripted engine: a mini-swe-agent-shaped loop running real bash commands, smolagents' CodeAgent unmodified, and a
user rule named by dotted path; the ToolSpans are read back from the broker."""

import doctest
import subprocess

import httpx
import orjson
import pytest
from openai import OpenAI
from smolagents import CodeAgent, OpenAIServerModel, tool

from forge_stream.gateway import textspans
from forge_stream.gateway.spans import PendingCall, SessionKeys, span_id
from forge_stream.gateway.textspans import TextTurn, text_spans
from forge_stream.kafka.history import read_completions
from forge_stream.topics import TOPICS

from gateway_support import open_session
from helpers import read_events, since_this_test

KEYS = SessionKeys("s1", "g1", "t1")


def test_rules_doctests_hold():
    assert doctest.testmod(textspans).failed == 0


def test_an_issued_call_answered_in_text_is_the_span_a_tool_message_would_give():
    """smolagents' ToolCallingAgent: the engine issued call c9; its result comes back as a user message."""
    pending = {"c9": PendingCall("c9", "calculator", '{"expression":"6*7"}', 100, "comp-0", "smolagents")}
    messages = [{"role": "user", "content": "6*7?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Calling tools:\n[{'id': 'c9', 'type': "
                                                  "'function', 'function': {'name': 'calculator', 'arguments': "
                                                  "{'expression': '6*7'}}}]"}]},
                {"role": "user", "content": [{"type": "text", "text": "Observation:\n42"}]}]
    turn = TextTurn(100, (("comp-0", ""),))
    spans, taken = text_spans(textspans.smolagents, KEYS, messages, "smolagents", turn, pending, set(), 150)
    [span] = spans
    assert taken == [pending["c9"]] and span["span_id"] == span_id("s1", "c9")
    assert (span["tool_call_id"], span["name"], span["status"], span["completion_id"]) == (
        "c9", "calculator", "ok", "comp-0")
    assert (span["start_ms"], span["end_ms"], orjson.loads(span["arguments_json"])) == (100, 150, {"expression": "6*7"})
    # the same pair again (a retried request, or a planning call on the same history) records nothing
    assert text_spans(textspans.smolagents, KEYS, messages, "smolagents", turn, {}, {span["span_id"]}, 160) == ([], [])


def test_text_calls_get_ids_from_their_pair_and_need_a_completion():
    turn = TextTurn(5, (("comp-a", "```bash\nls\n```"), ("comp-b", "```bash\npwd\n```")))
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "```bash\npwd\n```"},
                {"role": "user", "content": "<returncode>0</returncode>\n/root"}]
    [span], _ = text_spans(textspans.mini_swe_agent, KEYS, messages, "a", turn, {}, set(), 9)
    assert span["completion_id"] == "comp-b" and span["status"] == "ok"  # the choice the history continues
    [other], _ = text_spans(textspans.mini_swe_agent, KEYS, messages, "b", turn, {}, set(), 9)
    assert other["span_id"] != span["span_id"]  # another agent's identical turn is another call
    assert text_spans(textspans.mini_swe_agent, KEYS, messages, "a", None, {}, set(), 9) == ([], [])
    assert text_spans(textspans.mini_swe_agent, KEYS, messages[:2], "a", turn, {}, set(), 9) == ([], [])


MINI_SYSTEM = "You are a helpful assistant that can interact with a computer. Reply with one ```bash block."
MINI_REPLIES = (
    "THOUGHT: Look for the input first.\n```bash\nls /no/such/dir\n```",
    "THOUGHT: Two actions at once.\n```bash\npwd\n```\n```bash\nls\n```",
    "THOUGHT: Compute it.\n```bash\necho $((6*7))\n```",
    "THOUGHT: Done.\n```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```",
    "THOUGHT: Done.\n```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```",  # the retried request's answer
)
FORMAT_ERROR = "Please always provide EXACTLY ONE action in triple backticks, found 2 actions."


def _spans(bootstrap, session_id):
    return sorted(read_events(bootstrap, TOPICS.tool_spans, lambda r: r["session_id"] == session_id),
                  key=lambda r: r["end_ms"])


def _completions(bootstrap, session_id):
    return sorted(read_completions(bootstrap, since_this_test(), keep=lambda r: r["session_id"] == session_id),
                  key=lambda r: r["turn"])


def _mini_swe_agent(client: OpenAI, stream: bool, retry_at: int | None = None) -> list[str]:
    """mini-swe-agent's text protocol: one bash block per turn, run for real, its return code and output sent back
    as the next user message (a format error when there is not exactly one block); ends on the submit marker.
    `retry_at`: that step's request is sent twice (a client retry). Returns the commands run."""
    import re

    messages = [{"role": "system", "content": MINI_SYSTEM}, {"role": "user", "content": "Compute 6*7."}]
    ran = []
    for step in range(10):
        for _ in range(2 if step == retry_at else 1):
            if stream:
                text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                    model="scripted", messages=messages, stream=True) if c.choices)
            else:
                text = client.chat.completions.create(model="scripted", messages=messages).choices[0].message.content
        messages.append({"role": "assistant", "content": text})
        actions = re.findall(r"```bash\s*\n(.*?)\n```", text, re.DOTALL)
        if len(actions) != 1:
            messages.append({"role": "user", "content": FORMAT_ERROR})
            continue
        done = subprocess.run(["bash", "-c", actions[0]], capture_output=True, text=True, timeout=30)
        ran.append(actions[0])
        output = done.stdout + done.stderr
        if output.lstrip().startswith("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"):
            return ran
        messages.append({"role": "user", "content": f"<returncode>{done.returncode}</returncode>\n<output>\n"
                                                    f"{output}</output>"})
    raise AssertionError("the agent did not submit")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_mini_swe_agent_text_mode_records_a_span_per_command(kafka_bootstrap, scripted_gateway, run_id, stream):
    with scripted_gateway(MINI_REPLIES) as gateway:
        session = open_session(gateway, run_id)
        client = OpenAI(base_url=session["base_url"], api_key="unused", max_retries=0,
                        default_headers={"X-Forge-Agent": "mini-swe-agent"})
        ran = _mini_swe_agent(client, stream, retry_at=3)
        finished = httpx.post(f"{gateway}/v1/sessions/{session['session_id']}/finish", json={})
        assert finished.status_code == 200, finished.text
    assert ran == ["ls /no/such/dir", "echo $((6*7))", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"]

    sid = session["session_id"]
    completions = _completions(kafka_bootstrap, sid)
    assert len(completions) == 5  # four turns, the last one sent twice
    failed, computed = _spans(kafka_bootstrap, sid)  # the format error ran nothing; the submit got no answer
    assert (failed["name"], orjson.loads(failed["arguments_json"])) == ("bash", {"command": "ls /no/such/dir"})
    assert failed["status"] == "error" and failed["error"].startswith("<returncode>2</returncode>")
    assert failed["completion_id"] == completions[0]["completion_id"]
    assert (computed["status"], computed["error"]) == ("ok", None)
    assert orjson.loads(computed["arguments_json"]) == {"command": "echo $((6*7))"}
    assert computed["completion_id"] == completions[2]["completion_id"]  # recorded once though sent twice
    for span, completion in ((failed, completions[0]), (computed, completions[2])):
        assert span["source"] == "inferred" and span["agent"] == "mini-swe-agent"
        assert completion["done_ms"] <= span["end_ms"] and span["start_ms"] <= span["end_ms"]
    [finish] = [e for e in read_events(kafka_bootstrap, TOPICS.sessions, lambda r: r["session_id"] == sid)
                if "num_tool_spans" in e]
    assert finish["num_tool_spans"] == 2


@tool
def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression.

    Args:
        expression: The expression, e.g. "6*7".
    """
    return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - digits and operators from the test script


CODE_REPLIES = (
    'Thought: Use the calculator.\n<code>\nprint(calculator(expression="6*7"))\n</code>',
    "Thought: Check division.\n<code>\nprint(1 / 0)\n</code>",
    'Thought: Done.\n<code>\nfinal_answer("42")\n</code>',
)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_smolagents_code_agent_text_mode_records_its_steps(kafka_bootstrap, scripted_gateway, run_id, stream):
    """smolagents' CodeAgent, unmodified: its code runs in smolagents' interpreter and comes back as `Observation:`
    (or `Call id: ...\\nError:`); the `smolagents` rule, chosen by the X-Forge-Agent name, records each step."""
    with scripted_gateway(CODE_REPLIES) as gateway:
        session = open_session(gateway, run_id)
        model = OpenAIServerModel(model_id="scripted", api_base=session["base_url"], api_key="unused",
                                  client_kwargs={"max_retries": 0,
                                                 "default_headers": {"X-Forge-Agent": "smolagents/coder"}})
        agent = CodeAgent(tools=[calculator], model=model, max_steps=5, verbosity_level=0, stream_outputs=stream)
        assert agent.run("What is 6*7?") == "42"

    sid = session["session_id"]
    completions = _completions(kafka_bootstrap, sid)
    assert [c["output_text"] for c in completions] == [r.removesuffix("</code>") for r in CODE_REPLIES]  # stop
    ok, error = _spans(kafka_bootstrap, sid)
    for span, completion in ((ok, completions[0]), (error, completions[1])):
        assert span["name"] == "python_interpreter" and span["agent"] == "smolagents/coder"
        assert span["completion_id"] == completion["completion_id"] and span["source"] == "inferred"
    assert orjson.loads(ok["arguments_json"]) == 'print(calculator(expression="6*7"))'
    assert ok["status"] == "ok"
    assert orjson.loads(error["arguments_json"]) == "print(1 / 0)"
    assert error["status"] == "error" and "division by zero" in error["error"]
    assert ok["tool_call_id"].startswith("call_") and ok["span_id"] != error["span_id"]


def calc_rule(assistant: str, user: str):
    """A user rule: `CALC: <expr>` answered by `RESULT: <value>` or `FAILED: <why>` (dicts are taken too)."""
    if assistant.startswith("CALC: ") and user.startswith(("RESULT: ", "FAILED: ")):
        yield {"name": "calc", "arguments": {"expression": assistant[6:]}, "result": user[8:],
               "is_error": user.startswith("FAILED")}
    if assistant == "CALC: crash":
        raise RuntimeError("a broken rule")


def test_user_rule_by_dotted_path_from_session_metadata(kafka_bootstrap, scripted_gateway, run_id):
    replies = ("CALC: 6*7", "CALC: 1/0", "CALC: crash", "The answer is 42.")
    with scripted_gateway(replies) as gateway:
        session = open_session(gateway, run_id, metadata={"span_rule": "test_gateway_text_spans:calc_rule"})
        client = OpenAI(base_url=session["base_url"], api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Compute."}]
        for answer in ("RESULT: 42", "FAILED: division by zero", "RESULT: ?", None):
            text = client.chat.completions.create(model="scripted", messages=messages).choices[0].message.content
            messages += [{"role": "assistant", "content": text}] + ([{"role": "user", "content": answer}]
                                                                    if answer else [])
        # a plain agent's session gets no text spans; unknown rules are refused when the session is opened
        plain = open_session(gateway, run_id + "-plain")
        OpenAI(base_url=plain["base_url"], api_key="unused", max_retries=0).chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "CALC: 1"},
                                        {"role": "user", "content": "RESULT: 1"}])
        for bad in ("nosuchrule", "no_such_module:rule", "test_gateway_text_spans:missing"):
            refused = httpx.post(f"{gateway}/v1/sessions", json={"group_id": run_id, "task_id": "t",
                                                                 "metadata": {"span_rule": bad}})
            assert refused.status_code == 422 and "span_rule" in refused.json()["error"]["param"], refused.text

    ok, failed = _spans(kafka_bootstrap, session["session_id"])  # the crashing rule cost its span, not the call
    assert (ok["name"], orjson.loads(ok["arguments_json"]), ok["status"]) == ("calc", {"expression": "6*7"}, "ok")
    assert (failed["status"], failed["error"]) == ("error", "division by zero")
    assert len(_completions(kafka_bootstrap, session["session_id"])) == 4
    assert _spans(kafka_bootstrap, plain["session_id"]) == []
