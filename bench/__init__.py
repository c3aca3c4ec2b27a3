"""Benchmarks: `python -m bench.attention`, `python -m bench.cold_start`."""
