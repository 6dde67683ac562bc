"""What a newcomer reads in the processors log: aiokafka's retried coordinator lookups are not errors, and faust's
load notices (its producer buffer's backpressure, a timer that ran late) are not warnings."""

import logging

from topologies.processors import _LoadNotices, _RetriedCoordinatorLookups, install_log_filters


def record(level: int, msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord("aiokafka.consumer.group_coordinator", level, __file__, 1, msg, args, None)


def test_a_retried_coordinator_lookup_is_a_warning_that_says_it_retries():
    seen = record(logging.ERROR, "Group Coordinator Request failed: %s",
                  "[Error 15] GroupCoordinatorNotAvailableError: ")
    assert _RetriedCoordinatorLookups().filter(seen)
    assert seen.levelno == logging.WARNING and seen.levelname == "WARNING"
    assert "retrying" in seen.getMessage() and "GroupCoordinatorNotAvailableError" in seen.getMessage()


def test_other_errors_stay_errors():
    seen = record(logging.ERROR, "Group Coordinator Request failed: %s", "[Error 30] GroupAuthorizationFailedError")
    assert _RetriedCoordinatorLookups().filter(seen)
    assert seen.levelno == logging.ERROR and seen.getMessage().endswith("GroupAuthorizationFailedError")


def test_faust_backpressure_and_a_late_commit_are_info_that_says_why():
    import faust.transport.producer
    import mode.timers

    install_log_filters()  # on the loggers faust's modules write to
    for module, notices in ((faust.transport.producer, _LoadNotices), (mode.timers, _LoadNotices)):
        assert any(isinstance(f, notices) for f in logging.getLogger(module.logger.name).filters), module

    full = logging.LogRecord("faust.transport.producer", logging.WARNING, __file__, 1,
                             "producer buffer full size 137", None, None)
    assert _LoadNotices().filter(full)
    assert full.levelno == logging.INFO and full.levelname == "INFO"
    assert full.getMessage().startswith("producer buffer full size 137 (") and "backpressure" in full.getMessage()

    late = logging.LogRecord("mode.timers", logging.WARNING, __file__, 1,
                             "Timer %s is overlapping (interval=%r runtime=%r)", ("commit", 2.8, 3.41), None)
    assert _LoadNotices().filter(late)
    assert late.levelno == logging.INFO
    assert "Timer commit is overlapping (interval=2.8 runtime=3.41)" in late.getMessage()


def test_a_commit_stalled_for_long_stays_a_warning():
    stalled = logging.LogRecord("mode.timers", logging.WARNING, __file__, 1,
                                "Timer %s is overlapping (interval=%r runtime=%r)", ("commit", 2.8, 95.0), None)
    assert _LoadNotices().filter(stalled)
    assert stalled.levelno == logging.WARNING and stalled.getMessage().endswith("runtime=95.0)")
    other = logging.LogRecord("mode.timers", logging.WARNING, __file__, 1, "something else %s", ("x",), None)
    assert _LoadNotices().filter(other)
    assert other.levelno == logging.WARNING and other.getMessage() == "something else x"
