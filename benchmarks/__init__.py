"""Benchmarks: run as modules (python -m benchmarks.NAME); not part of the test suite."""
