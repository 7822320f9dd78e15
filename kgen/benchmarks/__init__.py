"""Benchmark cases per family, used by `kgen bench` (kgen/bench.py)."""
