"""A stand-in agent server for the pool tests (a real process speaking the JSON-lines protocol, no model).

Per request: task {"sleep": s} sleeps s seconds first; {"meet": [folder, n, wait_s]} then waits up to wait_s
seconds until n episodes, of any worker, are in `folder` at once, and answers an error if they never are;
{"crash": true} exits the process with status 3 at once; {"fail": "why"} answers an error; otherwise it answers the
task's "answer". Requests run in threads, so several are in flight at once. It prints its pid on stderr when it
starts.
"""

import json
import os
import sys
import threading
import time

lock = threading.Lock()
print(f"worker {os.getpid()} up", file=sys.stderr, flush=True)


def meet(episode_id: str, folder: str, n: int, wait_s: float) -> bool:
    """Whether `n` episodes were in `folder` at once while this one was (the first to see them leaves word)."""
    mark, met = os.path.join(folder, f"episode-{episode_id}"), os.path.join(folder, "met")
    open(mark, "w").close()
    try:
        deadline = time.monotonic() + wait_s
        while not os.path.exists(met):
            if sum(name.startswith("episode-") for name in os.listdir(folder)) >= n:
                open(met, "w").close()
            elif time.monotonic() > deadline:
                return False
            else:
                time.sleep(0.01)
        return True
    finally:
        os.remove(mark)


def episode(request: dict) -> None:
    task = request["task"]
    time.sleep(float(task.get("sleep", 0)))
    if "meet" in task and not meet(str(request["id"]), *task["meet"]):
        task = {"fail": f"fewer than {task['meet'][1]} episodes in flight at once"}
    if task.get("crash"):
        print("crashing on purpose", file=sys.stderr, flush=True)
        os._exit(3)
    reply = {"id": request["id"], **({"error": task["fail"]} if "fail" in task else {"output": str(task["answer"])})}
    with lock:
        print(json.dumps(reply), flush=True)


for line in sys.stdin:
    threading.Thread(target=episode, args=(json.loads(line),), daemon=True).start()
