"""Trainer pieces: policy losses on the per-sequence view and the pure tree-packed training step."""
