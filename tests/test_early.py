"""tests/early.py, the session's background starts: what the selected tests need starts at `begin`, in a thread,
in the order of their first users, and its fixture gets it (or the start's error) from `take`; what no test needs
is not started, what no fixture took is stopped at `end`, and a fixture whose start was not begun makes its own."""

import threading
import time
from types import SimpleNamespace

import pytest

from early import LEAD, Early
from helpers import until


def _declare(early: Early, name: str, made: list, stopped: list, fails: bool = False, lead: int = LEAD) -> None:
    def prepare(get):
        prepared_in = threading.current_thread().name  # the fixtures are read in the main thread

        def slow():
            made.append((name, get("where"), prepared_in, threading.current_thread().name))
            if fails:
                raise RuntimeError(f"{name} did not start")
            return name.upper()
        return slow
    early.declare(name, lambda item: name in item.fixturenames, prepare, stop=stopped.append, lead=lead)


def test_what_a_selected_test_needs_starts_in_a_thread_and_its_fixture_takes_it():
    early, made, stopped = Early(), [], []
    for name in ("used", "taken_late", "unused"):
        _declare(early, name, made, stopped)
    items = [SimpleNamespace(fixturenames=["tmp_path"]), SimpleNamespace(fixturenames=["taken_late"]),
             SimpleNamespace(fixturenames=["used", "taken_late"])]
    assert early.begin(items, {"where": "session"}.get) == ["taken_late", "used"]  # by first user
    assert early.take("used", {"where": "fixture"}.get) == "USED"
    main = threading.current_thread().name
    assert made == [("taken_late", "session", main, "early-starts"), ("used", "session", main, "early-starts")]
    early.end()
    assert stopped == ["TAKEN_LATE"]  # "used" is its fixture's to stop; "unused" never started
    assert early.take("unused", {"where": "fixture"}.get) == "UNUSED"  # not begun: made by the fixture, at once
    assert made[-1] == ("unused", "fixture", main, main)


def test_a_start_that_failed_fails_the_test_that_takes_it_and_nothing_is_stopped():
    early, made, stopped = Early(), [], []
    _declare(early, "broken", made, stopped, fails=True)
    early.begin([SimpleNamespace(fixturenames=["broken"])], {"where": "session"}.get)
    with pytest.raises(RuntimeError, match="broken did not start"):
        early.take("broken", {"where": "fixture"}.get)
    early.end()
    assert stopped == []


def test_a_start_begins_when_the_session_is_lead_tests_short_of_its_first_user():
    """Not with the session: an engine started then sits idle (holding its memory) through every test before it."""
    early, made, stopped = Early(), [], []
    _declare(early, "late", made, stopped)
    items = [SimpleNamespace(nodeid=f"t{i}", fixturenames=["late"] if i == LEAD + 30 else []) for i in range(LEAD + 31)]
    early.begin(items, {"where": "session"}.get)
    early.reached("t0")
    early.reached("t29")
    time.sleep(0.3)
    assert made == []  # 31 tests short of it
    early.reached("t30")
    assert early.take("late", {"where": "fixture"}.get) == "LATE" and made[0][0] == "late"
    early.end()


def test_a_start_with_a_lead_of_its_own_begins_that_many_tests_short_of_its_first_user():
    early, made, stopped = Early(), [], []
    _declare(early, "slower", made, stopped, lead=5)
    items = [SimpleNamespace(nodeid=f"t{i}", fixturenames=["slower"] if i == 20 else []) for i in range(21)]
    early.begin(items, {"where": "session"}.get)
    early.reached("t14")
    time.sleep(0.3)
    assert made == []  # 6 tests short of it
    early.reached("t15")
    until(lambda: made, 10, "5 tests short of its first user, it did not begin")  # not begun by a fixture's take
    assert early.take("slower", {"where": "fixture"}.get) == "SLOWER" and made[0][0] == "slower"
    early.end()


def test_a_fixture_taking_a_start_before_its_lead_begins_it_at_once():
    early, made, stopped = Early(), [], []
    _declare(early, "wanted", made, stopped)
    items = [SimpleNamespace(nodeid=f"t{i}", fixturenames=["wanted"] if i == LEAD * 2 else []) for i in range(LEAD * 3)]
    early.begin(items, {"where": "session"}.get)
    assert early.take("wanted", {"where": "fixture"}.get) == "WANTED"  # a test run alone with -k, say
    early.end()


def test_a_start_that_holds_processes_is_taken_before_the_next_begins():
    """With `-m slow` every start is within its lead of the first test: begun together, four vLLM engines and the KV
    tier's deployment held more memory than the host has. A start declared without a `stop` holds nothing (an
    import) and does not hold the next back."""
    early, made, stopped = Early(), [], []
    _declare(early, "engine_a", made, stopped)
    early.declare("import_b", lambda item: "import_b" in item.fixturenames,
                  lambda get: lambda: made.append(("import_b",)) or "B")  # no stop: holds no process
    _declare(early, "engine_c", made, stopped)
    items = [SimpleNamespace(nodeid=f"t{i}", fixturenames=[name]) for i, name in
             enumerate(["engine_a", "import_b", "engine_c"])]
    early.begin(items, {"where": "session"}.get)
    early.reached("t0")
    until(lambda: made, 10, "the first start did not begin")
    time.sleep(0.3)
    assert [m[0] for m in made] == ["engine_a"]  # held back: engine_a is started and no fixture took it
    assert early.take("engine_a", {"where": "fixture"}.get) == "ENGINE_A"
    until(lambda: len(made) == 3, 10, "once engine_a was taken, the import and then engine_c did not begin")
    assert [m[0] for m in made] == ["engine_a", "import_b", "engine_c"]
    early.end()
    assert stopped == ["ENGINE_C"]  # never taken


def test_a_fixture_taking_a_start_held_back_by_an_untaken_one_begins_it():
    early, made, stopped = Early(), [], []
    for name in ("skipped_engine", "wanted_engine"):
        _declare(early, name, made, stopped)
    items = [SimpleNamespace(nodeid=f"t{i}", fixturenames=[name]) for i, name in
             enumerate(["skipped_engine", "wanted_engine"])]
    early.begin(items, {"where": "session"}.get)
    early.reached("t1")  # t0 was skipped: its fixture never took its engine
    assert early.take("wanted_engine", {"where": "fixture"}.get) == "WANTED_ENGINE"
    early.end()
    assert stopped == ["SKIPPED_ENGINE"]
