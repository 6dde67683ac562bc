"""Gateway test helpers: the admin token of the auth tests and opening a session over HTTP."""

import http.client
import json

import httpx

ADMIN = "admin-secret"


def open_session(gateway: str, group_id: str, task_id: str = "task", token: str | None = None, **extra) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.post(f"{gateway}/v1/sessions", json={"group_id": group_id, "task_id": task_id, **extra},
                          headers=headers)
    assert response.status_code == 201, response.text
    return response.json()


def on_one_connection(base_url: str, calls: list[tuple[str, str, bytes | None, dict]]) -> list[tuple[int, dict]]:
    """Send the calls (method, path, body, headers) one after another on one keep-alive HTTP/1.1 connection;
    the status and JSON body of each answer. Fails if the server drops or closes the connection in between."""
    host, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    out, local = [], None
    try:
        for method, path, body, headers in calls:
            conn.request(method, path, body=body, headers={"content-type": "application/json", **headers})
            if local is None:
                local = conn.sock.getsockname()
            assert conn.sock.getsockname() == local, "the server closed the keep-alive connection"
            response = conn.getresponse()
            data = response.read()
            assert response.getheader("connection") != "close", f"{path} answered {response.status} and closed"
            out.append((response.status, json.loads(data) if data else {}))
    finally:
        conn.close()
    return out
