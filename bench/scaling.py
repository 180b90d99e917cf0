"""Workers: throughput of trivial trials with 1, 2 and 4 local worker processes on one queue.

All trials are submitted at once, so the queue is never empty and the workers alone set the pace.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

from bench.harness import BenchStack, Figure, Section, median_of, repeat
from bench.overhead import form, idle_service
from core.event_store import StoredEvent
from schemas.events import TrialEnded

WORKER_COUNTS = (1, 2, 4)
TRIALS = 40


def drain(stack: BenchStack, name: str) -> float:
    """Submit TRIALS trials at once; seconds until the last one has ended."""
    service = idle_service(stack, name)
    cursor = service.store.head()
    started = time.perf_counter()
    submitted = {service.submit_trial_job(form(index, {"x": index / TRIALS, "y": 1})).id for index in range(TRIALS)}
    ended: set[str] = set()
    deadline = time.monotonic() + 300
    while ended != submitted:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(ended)} of {TRIALS} trials ended within 300 s")
        for entry in service.store.wait(cursor, block_ms=1000):
            cursor = entry.id
            if isinstance(entry, StoredEvent) and isinstance(entry.event, TrialEnded):
                if entry.event.status != "SUCCEEDED":
                    raise RuntimeError(f"benchmark trial {entry.event.trial_id} ended {entry.event.status}")
                ended.add(entry.event.trial_id)
    return time.perf_counter() - started


def _drain_run(stack: BenchStack, index: int) -> float:
    return drain(stack, f"drain{index}")


def run(root: Path, runs: int) -> Section:
    section = Section("Workers", "python -m bench --only scaling")
    rates = {}
    for workers in WORKER_COUNTS:
        with BenchStack(root / f"workers-{workers}", workers=workers) as stack:
            seconds = repeat(runs, functools.partial(_drain_run, stack))
        rates[workers] = TRIALS / median_of(seconds) * 60
        section.add(Figure(f"{workers} worker process{'es' if workers > 1 else ''}", rates[workers], "trials/min"))
    section.notes.append(
        f"{TRIALS} trivial trials (the dependency-free trial) submitted at once to one queue, timed until the last "
        f"has ended. 4 workers run {rates[4] / rates[1]:.1f}x as many trials per minute as 1 on this "
        f"{os.cpu_count()}-core machine: every trial is a Python process, so past the core count the CPU, not the "
        "queue, sets the pace."
    )
    return section
