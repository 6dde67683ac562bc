"""Sinks and sources at the edge of forge-stream (analytics, offline storage)."""
