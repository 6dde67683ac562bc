"""Benchmarks behind `forge-stream bench`; each module exposes `run(...) -> dict`."""
