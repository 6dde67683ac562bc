"""Stream processors as pure functions: group assembly, composite rewards, reward-to-go, prefix-tree samples.

`fold(state, schema, record, settings)` and `expire(state, now_ms, settings)` are the whole logic; the faust
topology in `topologies/processors.py` wires them to Kafka.
"""

from forge_stream.processors.fold import Emit, close, expire, fold
from forge_stream.processors.groups import InvalidEvent
from forge_stream.processors.settings import ProcessorSettings, RuleSpec

__all__ = ["Emit", "InvalidEvent", "ProcessorSettings", "RuleSpec", "close", "expire", "fold"]
