"""Placement: which of a hybrid experiment's platforms an attempt of a trial goes to.

NNI's hybrid mode lists several platforms in `trainingService`; each attempt runs on one of them. The
choice is made where the attempt is queued (a submission, a retry after a lost worker) and recorded in
the event that queues it (TrialSubmitted.platform, TrialAttemptLost.retry_platform), so the views and
a replay show where every attempt went without asking any platform again.

A platform has room when the trials its live workers can follow (each worker's slots) exceed the
attempts queued, running or parked on it. Among those with room the platforms take turns (round robin
in config order, one counter per experiment); when none has room, the least loaded one gets the trial.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
from rq import Worker
from rq.registry import StartedJobRegistry

from core import keys
from core.event_store import EventStore, StoredEvent
from core.leases import AttemptRef
from core.queueing import trial_queue
from schemas.events import TrialAttemptLost, TrialSubmitted

WORKER_SLOTS_FIELD = "trialstream_slots"  # in RQ's hash of a worker: how many trials it follows at once
LIVE_WITHIN = timedelta(seconds=45)  # workers beat every 15 s: three missed beats and it is not counted


@dataclass(frozen=True)
class PlatformLoad:
    platform: str
    capacity: int  # trials the platform's live workers can follow at once
    load: int  # its attempts queued, running or parked

    @property
    def free(self) -> int:
        return self.capacity - self.load

    @property
    def pressure(self) -> float:
        """How full it would be with one more trial: the least loaded platform has the lowest."""
        return (self.load + 1) / self.capacity if self.capacity else math.inf


def platform_load(client: redis.Redis, rq_connection: redis.Redis, platform: str) -> PlatformLoad:
    """The platform's capacity and load now, over every experiment sharing its queue."""
    queue = trial_queue(platform, rq_connection)
    now = datetime.now(UTC)
    capacity = 0
    for worker in Worker.all(queue=queue):
        beat = worker.last_heartbeat
        if beat is None or now - (beat if beat.tzinfo else beat.replace(tzinfo=UTC)) > LIVE_WITHIN:
            continue
        slots: Any = rq_connection.hget(worker.key, WORKER_SLOTS_FIELD)
        capacity += int(slots) if slots else 1
    running = StartedJobRegistry(queue=queue).get_job_count(cleanup=False)
    parked = int(client.zcard(keys.parked(platform)))
    return PlatformLoad(platform, capacity, queue.count + running + parked)


def place(client: redis.Redis, rq_connection: redis.Redis, experiment_id: str, platforms: Sequence[str]) -> str:
    """The platform of `platforms` (config order) the next attempt of the experiment goes to."""
    if len(platforms) == 1:
        return platforms[0]
    loads = [platform_load(client, rq_connection, platform) for platform in platforms]
    candidates = [index for index, load in enumerate(loads) if load.free > 0]
    if not candidates:
        least = min(load.pressure for load in loads)
        candidates = [index for index, load in enumerate(loads) if load.pressure == least]
    turn = int(client.incr(keys.placement_turn(experiment_id)))
    first = (turn - 1) % len(platforms)
    return platforms[min(candidates, key=lambda index: (index - first) % len(platforms))]


def listed_platforms(submission: TrialSubmitted) -> list[str]:
    """The platforms an attempt of the trial may be placed on: the listed ones, or its only one."""
    sections = submission.launch.platform_configs
    return [str(section["platform"]) for section in sections] if sections else [submission.platform]


def attempt_platform(store: EventStore, submitted: StoredEvent, attempt: int) -> str:
    """The platform attempt `attempt` of the trial was placed on: the submission's for the first (and for
    every attempt of a single-platform experiment), else the one the lost attempt before it chose."""
    submission = submitted.event
    assert isinstance(submission, TrialSubmitted)
    if attempt == 1 or not submission.launch.platform_configs:
        return submission.platform
    before = AttemptRef(submission.experiment_id, submission.trial_id, attempt - 1)
    lost = store.read_keyed(before.ended_key)
    if not (isinstance(lost, StoredEvent) and isinstance(lost.event, TrialAttemptLost)):
        raise LookupError(f"trial {submission.trial_id}: attempt {attempt} has no lost attempt before it in the log")
    return lost.event.retry_platform or attempt_platform(store, submitted, attempt - 1)
