"""Fault injection for tests and benchmarks: kill nodes and workers with real signals."""
