"""The OpenAI-style error body is built in one place, forge_stream.openai_error: no other module of the package
writes a dict (or a JSON text) of the shape {"error": {"message", "type", ...}}, so the gateway, both engines and
the bearer-token check answer errors alike. The Anthropic shape ({"type": "error", "error": ...}) is another one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOME = "forge_stream/openai_error.py"
TEXT = re.compile(r'\{\s*"error"\s*:\s*\{\s*"message"')  # the body spelled as JSON text


def _builds_body(node: ast.AST) -> bool:
    if isinstance(node, ast.Dict):
        keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
        inner = dict(zip((k.value if isinstance(k, ast.Constant) else None for k in node.keys), node.values))
        error = inner.get("error")
        return "type" not in keys and isinstance(error, ast.Dict) and {"message", "type"} <= {
            k.value for k in error.keys if isinstance(k, ast.Constant)}
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
        text = node.value.decode("latin-1") if isinstance(node.value, bytes) else node.value
        return TEXT.search(text) is not None
    return False


def problems(path: str, source: str) -> list[str]:
    tree = ast.parse(source)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)  # they may describe the body
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [f"{path}:{node.lineno}: builds an OpenAI error body (use forge_stream.openai_error.error_body)"
            for node in ast.walk(tree) if id(node) not in docstrings and _builds_body(node)]


def test_the_rule_sees_each_spelling():
    assert problems("x.py", 'b = {"error": {"message": m, "type": k, "param": None, "code": 400}}')
    assert problems("x.py", "b = b'{\"error\": {\"message\": \"not found\", \"type\": \"t\"}}'")
    assert not problems("x.py", 'b = {"type": "error", "error": {"type": k, "message": m}}')  # Anthropic's
    assert not problems("x.py", 'reply = {"error": reason}')


def test_only_openai_error_builds_the_body():
    found = []
    for path in sorted((REPO / "forge_stream").rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        if relative != HOME:
            found += problems(relative, path.read_text())
    assert found == []
