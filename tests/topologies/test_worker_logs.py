"""What a newcomer reads in the processors log: aiokafka's retried coordinator lookups are not errors."""

import logging

from topologies.processors import _RetriedCoordinatorLookups


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
