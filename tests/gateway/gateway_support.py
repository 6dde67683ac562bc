"""Gateway test helpers: the admin token of the auth tests and opening a session over HTTP."""

import httpx

ADMIN = "admin-secret"


def open_session(gateway: str, group_id: str, task_id: str = "task", token: str | None = None, **extra) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.post(f"{gateway}/v1/sessions", json={"group_id": group_id, "task_id": task_id, **extra},
                          headers=headers)
    assert response.status_code == 201, response.text
    return response.json()
