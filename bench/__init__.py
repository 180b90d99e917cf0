"""Benchmarks: not part of the test run. `python -m bench` runs them all and writes docs/benchmarks.md."""
