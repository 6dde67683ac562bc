"""The text the tiny model's tokenizer is trained on: generated here, deterministically, nothing downloaded.

It mixes plain English, Python code, JSON, and ChatML conversations with Hermes-style tool calls, so the
byte-level BPE learns merges for all the shapes the engine, the gateway and the tests push through it.
"""

import json
import random

_SUBJECTS = ["the agent", "a user", "the trainer", "the gateway", "our model", "the engine", "a worker",
             "the scheduler", "the grader", "this policy", "the tokenizer", "a student", "the team"]
_VERBS = ["reads", "writes", "checks", "returns", "sends", "computes", "samples", "loads", "stores",
          "answers", "streams", "parses", "counts", "merges", "finds", "opens", "closes", "calls"]
_OBJECTS = ["the weather report", "a list of numbers", "the next token", "every event", "a short answer",
            "the file on disk", "the search results", "a new version", "the final reward", "two prompts",
            "the prefix tree", "a tool call", "the training batch", "its own history", "the logprobs"]
_TAILS = ["before noon.", "in order.", "without errors.", "as fast as it can.", "once per step.",
          "and then waits.", "for the whole group.", "when it is ready.", "again and again.", "today."]
_WORDS = ["hello", "world", "weather", "paris", "london", "tokyo", "sunny", "rain", "cloudy", "degrees",
          "answer", "question", "search", "result", "python", "function", "value", "number", "error",
          "success", "file", "path", "read", "write", "count", "total", "price", "order", "user", "assistant"]
_TOOLS = [
    {"name": "get_weather", "description": "Get the current weather for a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                    "required": ["city"]}},
    {"name": "search", "description": "Search the web and return the top results.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                    "required": ["query"]}},
    {"name": "calculator", "description": "Evaluate an arithmetic expression.",
     "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                    "required": ["expression"]}},
    {"name": "read_file", "description": "Read a text file from the workspace.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
]
_CODE = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "import json\n\ndata = json.loads(text)\nprint(data[\"name\"])\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def step(self):\n        self.count += 1\n",
    "if value is None:\n    raise ValueError(\"missing value\")\n",
    "with open(path) as f:\n    lines = f.read().splitlines()\n",
    "result = [x for x in numbers if x % 2 == 0]\n",
    "async def fetch(url):\n    async with client.get(url) as response:\n        return await response.json()\n",
]


def _sentence(rng: random.Random) -> str:
    return f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"


def _arguments(rng: random.Random, tool: dict) -> dict:
    args = {}
    for name, spec in tool["parameters"]["properties"].items():
        args[name] = rng.randint(1, 20) if spec["type"] == "integer" else rng.choice(_WORDS)
    return args


def _conversation(rng: random.Random) -> str:
    tool = rng.choice(_TOOLS)
    call = {"name": tool["name"], "arguments": _arguments(rng, tool)}
    tools = "\n".join(json.dumps({"type": "function", "function": t}) for t in _TOOLS)
    return (
        f"<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n<tools>\n{tools}\n</tools><|im_end|>\n"
        f"<|im_start|>user\n{_sentence(rng)} What about {rng.choice(_WORDS)}?<|im_end|>\n"
        f"<|im_start|>assistant\n<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>\n"
        f"<|im_start|>user\n<tool_response>\n{json.dumps({'result': rng.choice(_WORDS), 'ok': True})}\n"
        f"</tool_response><|im_end|>\n"
        f"<|im_start|>assistant\n{_sentence(rng)}<|im_end|>\n"
    )


def _suite_conversation(rng: random.Random) -> str:
    """A task of the shipped suite solved by the scripted teacher, as ChatML text with the suite's tools."""
    from forge_stream.tasks.suite import FAMILIES, TOOLS
    from forge_stream.tasks.teacher import demonstration

    domain = rng.choice(sorted(FAMILIES))
    messages = demonstration(FAMILIES[domain](rng, 1), domain)
    tools = "\n".join(json.dumps(t) for t in TOOLS)
    text = f"<|im_start|>system\n{messages[0]['content']}\n\n# Tools\n\n<tools>\n{tools}\n</tools><|im_end|>\n"
    for m in messages[1:]:
        if m.get("tool_calls"):
            fn = m["tool_calls"][0]["function"]
            body = f'<tool_call>\n{{"name": "{fn["name"]}", "arguments": {fn["arguments"]}}}\n</tool_call>'
            text += f"<|im_start|>assistant\n{body}<|im_end|>\n"
        elif m["role"] == "tool":
            text += f"<|im_start|>user\n<tool_response>\n{m['content']}\n</tool_response><|im_end|>\n"
        else:
            text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    return text


def corpus(seed: int = 0, paragraphs: int = 300) -> list[str]:
    """Deterministic training texts (about 100 KB for the default size)."""
    rng = random.Random(seed)
    texts = []
    for i in range(paragraphs):
        kind = i % 4
        if kind == 0:
            texts.append(" ".join(_sentence(rng) for _ in range(rng.randint(3, 7))))
        elif kind == 1:
            texts.append(rng.choice(_CODE) + f"\n# {_sentence(rng)}\n")
        elif kind == 2:
            record = {w: rng.randint(0, 1000) for w in rng.sample(_WORDS, 4)}
            record["items"] = rng.sample(_WORDS, 3)
            texts.append(json.dumps(record, indent=rng.choice([None, 2])))
        elif i % 8 == 3:
            texts.append(_conversation(rng))
        else:
            texts.append(_suite_conversation(rng))
    texts.append("".join(chr(c) for c in range(32, 127)))
    return texts
