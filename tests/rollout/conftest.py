"""Fixtures: the scripted engine and a gateway in front of it (tests/scripted_gateway.py)."""

from scripted_gateway import engine_url, gateway  # noqa: F401 - pytest fixtures
