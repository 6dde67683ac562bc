"""What the security tests share: the deployment's admin token and the calls an admin or an agent makes."""

from __future__ import annotations

import secrets

import httpx

ADMIN = secrets.token_urlsafe(32)


def as_admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def open_session(gateway: str, group_id: str) -> dict:
    response = httpx.post(f"{gateway}/v1/sessions", json={"group_id": group_id, "task_id": "t"}, headers=as_admin())
    assert response.status_code == 201, response.text
    return response.json()
