"""The workers' ledger of `gateway serve --workers N`: each worker sees what the others recorded, never its own
writes; slots are taken once and a dead worker's slot goes to its replacement."""

import os
import subprocess
import sys
import time

import pytest

from forge_stream.gateway.ledger import WorkerLedger


def test_a_worker_sees_the_others_writes_for_a_session_and_not_its_own(tmp_path):
    with WorkerLedger.hosted(3, str(tmp_path)) as path:
        _sees_the_others_writes(path)


def _sees_the_others_writes(path: str) -> None:
    a, b, c = (WorkerLedger(path, 3) for _ in range(3))
    assert {a.slot, b.slot, c.slot} == {0, 1, 2}
    seen = b.others("s1"), c.others("s1")
    a.wrote("s1")
    assert a.others("s1") == (0, 0)  # its own write is not news to it
    assert b.others("s1") != seen[0] and c.others("s1") != seen[1]
    before = a.others("s1")
    c.wrote("s1")
    c.wrote("s1")
    assert a.others("s1") != before
    assert b.others("s2") == c.others("s2") == (0, 0)  # another session (another bucket) is untouched
    for ledger in (a, b, c):
        ledger.close()


def test_slots_are_held_until_their_worker_is_gone(tmp_path):
    with WorkerLedger.hosted(2, str(tmp_path)) as path:
        _slots_are_held_until_their_worker_is_gone(path)


def _slots_are_held_until_their_worker_is_gone(path: str) -> None:
    a = WorkerLedger(path, 2)
    # a worker in another process takes the other slot and dies without letting it go (SIGKILL)
    subprocess.run([sys.executable, "-c", f"from forge_stream.gateway.ledger import WorkerLedger; "
                    f"import os; WorkerLedger({path!r}, 2); os._exit(0)"], check=True)
    replacement = WorkerLedger(path, 2)  # uvicorn's new worker takes the dead one's slot
    assert replacement.slot == 1 - a.slot
    with pytest.raises(RuntimeError, match="held by running workers"):
        WorkerLedger(path, 2)
    with pytest.raises(ValueError, match="not a ledger for 3 workers"):
        WorkerLedger(path, 3)
    a.close()
    assert WorkerLedger(path, 2).slot == a.slot  # closed: free again


def test_a_killed_serve_leaves_a_file_the_next_serve_removes_and_a_running_ones_is_kept(tmp_path):
    # a `serve` that runs (another process, holding its file) and one that was SIGKILLed (its file left unlocked)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from forge_stream.gateway.ledger import WorkerLedger\n"
                               f"with WorkerLedger.hosted(2, {str(tmp_path)!r}) as path:\n"
                               "    print(path, flush=True); time.sleep(60)\n"],
                              stdout=subprocess.PIPE, text=True)
    try:
        running = holder.stdout.readline().strip()
        killed = _left_by_a_killed_serve(tmp_path)
        young = _left_by_a_killed_serve(tmp_path)  # just made: its `serve` may be about to lock it
        for path in (running, killed):
            os.utime(path, (time.time() - 60, time.time() - 60))
        with WorkerLedger.hosted(2, str(tmp_path)) as mine:
            assert os.path.exists(mine) and WorkerLedger(mine, 2).slot == 0
            assert not os.path.exists(killed)
            assert os.path.exists(running) and os.path.exists(young)
        assert not os.path.exists(mine)  # removed when `serve` ends
    finally:
        holder.kill()
        holder.wait()


def _left_by_a_killed_serve(directory) -> str:
    """The ledger file of a `serve` that died without removing it (SIGKILLed: here it exits at once)."""
    done = subprocess.run([sys.executable, "-c", "import os\nfrom forge_stream.gateway.ledger import WorkerLedger\n"
                           f"with WorkerLedger.hosted(2, {str(directory)!r}) as path:\n"
                           "    print(path, flush=True)\n    os._exit(0)\n"],
                          capture_output=True, text=True, check=True)
    return done.stdout.strip()
