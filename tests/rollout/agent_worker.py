"""A stand-in agent server for the pool tests (a real process speaking the JSON-lines protocol, no model).

Per request: task {"sleep": s} sleeps s seconds first; {"crash": true} exits the process with status 3 at once;
{"fail": "why"} answers an error; otherwise it answers the task's "answer". Requests run in threads, so several
are in flight at once. It prints its pid on stderr when it starts.
"""

import json
import os
import sys
import threading
import time

lock = threading.Lock()
print(f"worker {os.getpid()} up", file=sys.stderr, flush=True)


def episode(request: dict) -> None:
    task = request["task"]
    time.sleep(float(task.get("sleep", 0)))
    if task.get("crash"):
        print("crashing on purpose", file=sys.stderr, flush=True)
        os._exit(3)
    reply = {"id": request["id"], **({"error": task["fail"]} if "fail" in task else {"output": str(task["answer"])})}
    with lock:
        print(json.dumps(reply), flush=True)


for line in sys.stdin:
    threading.Thread(target=episode, args=(json.loads(line),), daemon=True).start()
