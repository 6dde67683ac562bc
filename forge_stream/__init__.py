"""forge-stream: agent RL as an event-sourced stream (ingress -> Kafka -> processors -> trainer)."""

__version__ = "0.1.0"
