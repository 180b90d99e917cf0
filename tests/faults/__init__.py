"""Faults: Redis, projector and workers killed, paused or cut off, and poison input."""
