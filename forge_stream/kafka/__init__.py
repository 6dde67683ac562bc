"""Kafka plumbing, and the package's only Kafka clients (faust keeps its own): the local broker, the producer, the
group consumers and their one watermark-commit path (consumer), group-less partition readers (reader), the asyncio
follower of a topic (follow), admin and history reads."""
