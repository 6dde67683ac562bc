"""sync_s and sync_bytes of `bench learning`, computed from PolicyVersion and Completion events."""

from forge_stream.bench.policy_sync import sync_summary


def test_sync_s_runs_from_a_versions_last_publish_to_its_first_token_served():
    versions = [{"version": 1, "event_time": 10_000, "size_bytes": 1_200_000},
                {"version": 1, "event_time": 14_000, "size_bytes": 1_200_000},  # re-published after a restart
                {"version": 2, "event_time": 20_000, "size_bytes": 1_200_000}]
    answers = [{"policy_version": 1, "first_token_ms": 15_000}, {"policy_version": 1, "first_token_ms": 14_500},
               {"policy_version": 2, "first_token_ms": 23_500, "done_ms": 23_900},
               {"policy_version": 7, "first_token_ms": 1}]
    summary = sync_summary(versions, answers)
    assert summary["sync_s"] == {"median": 2.0, "max": 3.5}  # v1: 0.5 s after its last publish; v2: 3.5 s
    assert summary["sync_bytes"] == 1_200_000
    assert (summary["sync_versions"], summary["sync_versions_unserved"]) == (2, 0)


def test_versions_never_served_are_counted_not_timed():
    summary = sync_summary([{"version": 1, "event_time": 5, "size_bytes": 0}], [{"policy_version": 0,
                                                                                   "first_token_ms": 9}])
    assert summary == {"sync_bytes": 0, "sync_s": None, "sync_versions": 0, "sync_versions_unserved": 1}


def test_an_answer_sent_whole_shows_its_version_served_when_it_ended():
    """A call that is not streamed records no first token (the gateway sees the answer only whole): its end is the
    moment its version was seen served, and the earliest of a version's answers, streamed or not, counts."""
    versions = [{"version": 1, "event_time": 10_000, "size_bytes": 9_800_000},
                {"version": 2, "event_time": 20_000, "size_bytes": 9_800_000}]
    answers = [{"policy_version": 1, "first_token_ms": None, "done_ms": 11_200},
               {"policy_version": 2, "first_token_ms": None, "done_ms": 21_000},
               {"policy_version": 2, "first_token_ms": 22_000, "done_ms": 22_400}]
    summary = sync_summary(versions, answers)
    assert summary["sync_s"] == {"median": 1.1, "max": 1.2}
    assert (summary["sync_versions"], summary["sync_versions_unserved"]) == (2, 0)
