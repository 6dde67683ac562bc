"""`status` tells a service that says it is starting (a vLLM engine's two-minute start-up) from an unhealthy one."""

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from helpers import serving

from forge_stream.kafka.broker import free_port
from forge_stream.services import _health_state


def test_a_503_that_says_starting_is_starting_and_other_failures_are_unhealthy():
    app = FastAPI()
    answers = {"starting": (503, {"status": "starting", "model": "m"}), "broken": (503, {"detail": "x"}),
               "fine": (200, {"status": "ok"}), "error": (500, {"status": "starting"})}

    @app.get("/{name}")
    async def health(name: str):
        code, body = answers[name]
        return JSONResponse(body, status_code=code)

    with serving(app) as url:
        assert _health_state(f"{url}/starting") == "starting"
        assert _health_state(f"{url}/broken") == "unhealthy"
        assert _health_state(f"{url}/fine") == "running"
        assert _health_state(f"{url}/error") == "unhealthy"
    assert _health_state(f"http://127.0.0.1:{free_port()}/health") == "unhealthy"  # nothing listens
