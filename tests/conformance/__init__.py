"""The platform conformance suite, run on each platform (the suite itself: tests/support/conformance.py)."""
