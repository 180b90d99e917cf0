"""Upcasters: turn an event stored by an older schema version into the current one.

The log is never rewritten; old entries are upgraded as they are read. Each upcaster takes the
stored JSON object of one (type, version) and returns it at the next version, so a chain of
small, separately tested steps carries any old event up to the current schema.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Payload = dict[str, Any]
Upcaster = Callable[[Payload], Payload]


def _first_attempt(payload: Payload) -> Payload:
    """v1 -> v2 of TrialStarted, TrialMetricReported, TrialEnded: before retries, every run was attempt 1."""
    return {**payload, "v": 2, "attempt": 1}


def _placed_as_before(payload: Payload) -> Payload:
    """v1 -> v2 of TrialSubmitted (launch.platformConfigs) and TrialAttemptLost (retryPlatform): before
    hybrid experiments, a trial had one platform, so every attempt ran on the one it was submitted to."""
    return {**payload, "v": 2}


UPCASTERS: dict[tuple[str, int], Upcaster] = {
    ("TrialStarted", 1): _first_attempt,
    ("TrialMetricReported", 1): _first_attempt,
    ("TrialEnded", 1): _first_attempt,
    ("TrialSubmitted", 1): _placed_as_before,
    ("TrialAttemptLost", 1): _placed_as_before,
}


def upcast(payload: Payload) -> Payload:
    """`payload` at the current version of its type (unchanged when no upcaster applies)."""
    while (step := UPCASTERS.get((payload.get("type", ""), payload.get("v", 0)))) is not None:
        payload = step(payload)
    return payload
