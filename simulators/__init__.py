"""Simulated platforms for the tests and benchmarks: Kubernetes, OpenPAI, DLTS, Azure ML and real sshd hosts."""
