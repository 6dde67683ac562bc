"""Kafka plumbing: the local broker, the producer, the DLQ-routing consumer, admin and history reads."""
