"""Benchmark scripts (run as ``python -m benchmarks.NAME``); tests import the suite's ``ci`` tier."""
