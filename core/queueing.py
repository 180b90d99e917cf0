"""Dispatch: the one path by which a job reaches a platform's queue, always recorded in the log.

`enqueue` appends the event that says why (TrialSubmitted, TrialAttemptLost, TrialRequeued) and
queues the job on the same transaction: a job is never queued without its record, nor recorded
without being queued. A record the log refuses is not written, yet the transaction queues its jobs:
`execute_enqueued` withdraws them, and a worker drops a job whose trial has no submission. A job's
arguments are ids only; what to run is read from the trial's TrialSubmitted event, so the log stays
the single source of truth and a re-delivery is safe.

A trial that cannot start yet (its GPUs are busy) is parked, not re-queued in a loop: it waits in
the platform's parked set until something is freed there (`wake_parked`), or until its re-check
time, which backs off while it keeps waiting.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.client import Pipeline
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from core import keys
from core.event_store import AppendRefused, EventStore, LogEntry, StoredEvent, append_refusal
from schemas.events import Event, ExperimentFinished, TrialAttemptLost, TrialRequeued, TrialSubmitted

RUN_TRIAL = "workers.runtime.job.run_trial"  # by name: the core never imports the workers that execute it
RELEASE_ATTEMPT = "workers.runtime.job.release_attempt"
CLEAN_UP_EXPERIMENT = "workers.runtime.job.clean_up_experiment"
SERIALIZER = JSONSerializer  # never pickle: whoever can write a job must not run code on the workers
RECHECK_FIRST_S = 1.0
RECHECK_CAP_S = 30.0

log = logging.getLogger(__name__)


def queue_name(platform: str) -> str:
    return f"trialstream.{platform}"


def trial_queue(platform: str, rq_connection: redis.Redis) -> Queue:
    return Queue(queue_name(platform), connection=rq_connection, serializer=SERIALIZER)


@dataclass(frozen=True)
class TrialJob:
    """A job for one attempt of a trial: run it, or release what it held after it was lost."""

    platform: str
    experiment_id: str
    trial_id: str
    attempt: int
    function: str = RUN_TRIAL
    deferrals: int = 0
    last_deferral: str = ""
    reattach: bool = False  # take up an attempt whose trial outlived its lost worker

    @property
    def prefix(self) -> str:
        return attempt_job_prefix(self.experiment_id, self.trial_id, self.attempt)


@dataclass(frozen=True)
class ExperimentJob:
    """A job about a whole experiment on one platform: clean up after it once it has ended."""

    platform: str
    experiment_id: str
    function: str = CLEAN_UP_EXPERIMENT


def enqueue(
    pipe: Pipeline,
    rq_connection: redis.Redis,
    store: EventStore,
    record: TrialSubmitted | TrialAttemptLost | TrialRequeued | ExperimentFinished,
    jobs: Sequence[TrialJob | ExperimentJob],
    idempotency_key: str | None = None,
    preceded_by: Event | None = None,
) -> list[Job]:
    """Append `record` (after `preceded_by`, in the same script) and queue `jobs` on `pipe` (a transaction the
    caller executes, with `execute_enqueued` where the append may be refused); the RQ jobs queued."""
    if preceded_by is None:
        store.append(record, idempotency_key=idempotency_key, pipeline=pipe)
    else:
        store.append_all([preceded_by, record], [None, idempotency_key], pipeline=pipe)
    return [_enqueue_job(pipe, rq_connection, job) for job in jobs]


def _enqueue_job(pipe: Pipeline, rq_connection: redis.Redis, job: TrialJob | ExperimentJob) -> Job:
    if isinstance(job, ExperimentJob):
        return trial_queue(job.platform, rq_connection).enqueue_call(
            job.function,
            args=(job.experiment_id,),
            job_id=f"{job.experiment_id}--clean-up-{time.time_ns()}",
            timeout=600,
            result_ttl=600,
            failure_ttl=7 * 24 * 3600,
            description=f"clean-up of experiment {job.experiment_id}",
            pipeline=pipe,
        )
    run = job.function == RUN_TRIAL
    return trial_queue(job.platform, rq_connection).enqueue_call(
        job.function,
        args=(job.experiment_id, job.trial_id, job.attempt),
        kwargs={"deferrals": job.deferrals, "last_deferral": job.last_deferral, "reattach": job.reattach}
        if run
        else {},
        # unique per delivery; a queued attempt is recognised by its prefix
        job_id=f"{job.prefix}-{'run' if run else 'release'}-{time.time_ns()}",
        timeout=-1,  # trials end on their own terms
        result_ttl=600,
        failure_ttl=7 * 24 * 3600,
        description=f"{'trial' if run else 'release of'} {job.trial_id} of experiment {job.experiment_id}",
        pipeline=pipe,
    )


def execute_enqueued(pipe: Pipeline, queued: Sequence[Job]) -> None:
    """Execute the transaction `enqueue` queued `queued` on; a refused append (an archived experiment, a fence that
    no longer holds: core.event_store.AppendRefused) is raised as such, its jobs withdrawn.

    Redis runs every command of a MULTI even when one fails, and a script's error is such a failure: the refused
    append wrote nothing, but its jobs were queued all the same. Nothing in RQ's API makes the enqueue conditional
    on the append (its writes are its own: re-doing them in the append script would re-implement RQ), and checking
    first would cost every submission a round trip, each waiting for an fsync under `appendfsync always`. So the
    refusing side deletes the jobs again, a round trip that only a refusal pays, and best effort: a worker that
    took such a job first finds no submission for its trial and drops it (workers.runtime.job.run_trial); a
    re-queued attempt's is one delivery more of an attempt that had lost its job (only one delivery claims it); a
    clean-up job finds the experiment not finished and cleans nothing (workers.runtime.job.clean_up_experiment)."""
    try:
        pipe.execute()  # raising what EXEC answered: a master demoted meanwhile is sent it again (core.replication)
    except redis.ResponseError as error:
        refusal = append_refusal(error)
        if refusal is None:
            raise
        for job in queued:
            with contextlib.suppress(redis.RedisError):  # left queued, it runs nothing (see above)
                job.delete()
        raise refusal from None


def attempt_job_prefix(experiment_id: str, trial_id: str, attempt: int) -> str:
    return f"{experiment_id}-{trial_id}-{attempt}"


def queued_attempts(rq_connection: redis.Redis, platforms: set[str]) -> set[str]:
    """The `attempt_job_prefix` of every job waiting in these platforms' queues."""
    return {
        job_id.split("-run-")[0].split("-release-")[0]
        for platform in platforms
        for job_id in trial_queue(platform, rq_connection).get_job_ids()
    }


def submission_key(trial_id: str) -> str:
    """Idempotency key of a trial's TrialSubmitted event: it also finds that event in the log."""
    return f"submit:{trial_id}"


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def load_submission(store: EventStore, trial_id: str) -> StoredEvent:
    """The trial's TrialSubmitted entry, found through its idempotency key."""
    return checked_submission(store.read_keyed(submission_key(trial_id)), store.experiment_id, trial_id)


def checked_submission(submitted: LogEntry | None, experiment_id: str, trial_id: str) -> StoredEvent:
    """`submitted`, read under the trial's submission key, if it is the trial's TrialSubmitted; else LookupError."""
    if not (
        isinstance(submitted, StoredEvent)
        and isinstance(submitted.event, TrialSubmitted)
        and submitted.event.trial_id == trial_id
    ):
        raise LookupError(f"trial {trial_id} of experiment {experiment_id} has no submission in the log")
    return submitted


# parking


def recheck_delay_s(deferrals: int) -> float:
    return float(min(RECHECK_CAP_S, RECHECK_FIRST_S * 2 ** min(deferrals, 16)))


def park(pipe: Pipeline, job: TrialJob, now_ms: int) -> None:
    """Queue on `pipe` the parking of an attempt that cannot start yet, until woken or its re-check time."""
    member = json.dumps([job.experiment_id, job.trial_id, job.attempt, job.deferrals, job.last_deferral])
    pipe.zadd(keys.parked(job.platform), {member: now_ms + int(recheck_delay_s(job.deferrals) * 1000)})


def wake_parked(client: redis.Redis, rq_connection: redis.Redis, platform: str, reason: str, due_only: bool) -> int:
    """Queue again the parked attempts of `platform` (only those whose re-check time has come, with
    `due_only`), each with a TrialRequeued record; returns how many. Safe to run anywhere, any time:
    an attempt is taken out of the set by one ZREM, so only one waker queues it. One whose experiment was
    archived meanwhile is dropped, its job withdrawn, and the others are woken all the same."""
    key = keys.parked(platform)
    high: int | str = "+inf"  # every trial end wakes the parked: no clock read on that path
    if due_only:
        seconds, microseconds = client.time()
        high = seconds * 1000 + microseconds // 1000
    members: Any = client.zrangebyscore(key, "-inf", high)
    woken = 0
    for member in members:
        if not client.zrem(key, member):
            continue  # another waker took it
        experiment_id, trial_id, attempt, deferrals, last_deferral = json.loads(member)
        job = TrialJob(platform, experiment_id, trial_id, attempt, deferrals=deferrals, last_deferral=last_deferral)
        store = EventStore(client, experiment_id)
        record = TrialRequeued(experiment_id=experiment_id, trial_id=trial_id, attempt=attempt, reason=reason)
        with client.pipeline(transaction=True) as pipe:
            pipe.multi()
            try:
                execute_enqueued(pipe, enqueue(pipe, rq_connection, store, record, [job]))
            except AppendRefused as refused:  # archived since it was parked: nothing of it runs any more
                log.info("parked trial %s not woken: %s", trial_id, refused, extra={"experiment": experiment_id})
                continue
        woken += 1
    return woken


def parked_attempts(client: redis.Redis, platforms: set[str]) -> set[str]:
    """The `attempt_job_prefix` of every attempt parked on these platforms."""
    found = set()
    for platform in platforms:
        members: Any = client.zrange(keys.parked(platform), 0, -1)
        for member in members:
            experiment_id, trial_id, attempt, *_ = json.loads(member)
            found.add(attempt_job_prefix(experiment_id, trial_id, attempt))
    return found
