"""Windowed FIFO between the sample stream and the trainer (DESIGN section 6).

`window` is the pure scheduler core; `consumer` adapts it to Kafka (forge.tasks + forge.samples).
"""
