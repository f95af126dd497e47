"""Benchmark scripts and the small measuring pieces they share (importable by the unit tests)."""
