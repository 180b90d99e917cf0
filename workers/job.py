"""The RQ job that runs one trial: the only entry point workers execute.

The job's arguments are ids only; what to run is read from the trial's TrialSubmitted event, so
the log stays the single source of truth and a job can be re-delivered safely.
"""

from __future__ import annotations

import logging
import os
import socket

import redis
from rq import Queue, get_current_job

from manager.connections import same_server, until_redis_answers
from manager.event_store import EventStore, StoredEvent
from schemas.events import TrialDeferred, TrialEnded, TrialSubmitted
from schemas.trial import TrialJobStatus
from workers.control import LogTrialControl
from workers.leases import AttemptRef, Lease, lease_seconds
from workers.platform import Deferred, TrialAssignment
from workers.registry import RUN_TRIAL, platform_class, queue_name

log = logging.getLogger(__name__)

DEFER_POLL_S = 0.5


def enqueue_trial(
    rq_connection: redis.Redis,
    platform: str,
    args: tuple[str, str, int],
    *,
    deferrals: int = 0,
    last_deferral: str = "",
    delivery: str = "",
    pipeline: redis.client.Pipeline | None = None,
) -> None:
    """Queue (or re-queue) the RQ job of a trial; RQ's job timeout is off, trials end on their own terms.

    The job id is `<attempt_job_prefix>-<deferrals><delivery>`: unique per delivery, and a queued
    attempt is recognised by its prefix.
    """
    experiment_id, trial_id, attempt = args
    Queue(queue_name(platform), connection=rq_connection).enqueue_call(
        RUN_TRIAL,
        args=args,
        kwargs={"deferrals": deferrals, "last_deferral": last_deferral},
        job_id=f"{attempt_job_prefix(experiment_id, trial_id, attempt)}-{deferrals}{delivery}",
        timeout=-1,
        result_ttl=600,
        failure_ttl=7 * 24 * 3600,
        description=f"trial {trial_id} of experiment {experiment_id}",
        pipeline=pipeline,
    )


def attempt_job_prefix(experiment_id: str, trial_id: str, attempt: int) -> str:
    return f"{experiment_id}-{trial_id}-{attempt}"


def submission_key(trial_id: str) -> str:
    """Idempotency key of a trial's TrialSubmitted event: it also finds that event in the log."""
    return f"submit:{trial_id}"


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def load_submission(store: EventStore, trial_id: str) -> StoredEvent:
    """The trial's TrialSubmitted entry, found through its idempotency key."""
    submitted_id = store.id_for_key(submission_key(trial_id))
    submitted = store.read_one(submitted_id) if submitted_id else None
    if not (
        isinstance(submitted, StoredEvent)
        and isinstance(submitted.event, TrialSubmitted)
        and submitted.event.trial_id == trial_id
    ):
        raise LookupError(f"trial {trial_id} of experiment {store.experiment_id} has no submission in the log")
    return submitted


def run_trial(experiment_id: str, trial_id: str, attempt: int = 1, deferrals: int = 0, last_deferral: str = "") -> str:
    """Run one attempt of a trial on this worker's platform and append how it ended."""
    job = get_current_job()
    assert job is not None, "run_trial runs inside an RQ job"
    client = same_server(job.connection, decode=True)
    store = EventStore(client, experiment_id)
    submitted = load_submission(store, trial_id)
    submission = submitted.event
    assert isinstance(submission, TrialSubmitted)

    lease = Lease(client, AttemptRef(experiment_id, trial_id, attempt), worker_name(), lease_seconds())
    if not lease.acquire():
        return "already claimed by another delivery"

    control = LogTrialControl(store, submitted, lease)
    try:
        stop = control.stop_request()
        if stop is not None:  # ends the trial even if the cancel came while an earlier attempt ran
            control.close()
            _end_attempt(store, lease, _ended(lease, stop.status, None, stop.reason))
            return "canceled before it started"
        platform = platform_class(submission.platform)(client)
        assignment = TrialAssignment(
            experiment_id=experiment_id,
            trial_id=trial_id,
            form=submission.form,
            launch=submission.launch,
            working_directory=submission.working_directory,
            platform_config=platform.config_model.model_validate(submission.launch.platform_config),
            attempt=attempt,
        )
        try:
            outcome = platform.run_trial(assignment, control)
        except Exception as error:
            log.exception("trial %s: platform %s failed", trial_id, submission.platform)
            control.close()
            _end_attempt(store, lease, _ended(lease, TrialJobStatus.FAILED, None, f"internal error: {error}"))
            raise
        if isinstance(outcome, Deferred):
            if outcome.reason != last_deferral:
                store.append(TrialDeferred(experiment_id=experiment_id, trial_id=trial_id, reason=outcome.reason))
            control.wait(DEFER_POLL_S)
            args = (experiment_id, trial_id, attempt)
            requeued = lease.give_up(
                lambda pipe: enqueue_trial(
                    job.connection,
                    submission.platform,
                    args,
                    deferrals=deferrals + 1,
                    last_deferral=outcome.reason,
                    pipeline=pipe,
                )
            )
            return f"deferred: {outcome.reason}" if requeued else "deferred, then declared lost meanwhile"
        control.close()  # no lease renewal may race the end of the attempt
        _end_attempt(store, lease, _ended(lease, outcome.status, outcome.exit_code, outcome.message))
        return str(outcome.status)
    finally:
        control.close()


def _end_attempt(store: EventStore, lease: Lease, ended: TrialEnded | None) -> None:
    """Append how the attempt ended and release its lease, atomically: a reaper never sees one without the other.

    If the attempt was already declared lost, the shared idempotency key keeps that verdict.
    """

    def commit() -> None:
        with store.client.pipeline(transaction=True) as pipe:
            pipe.multi()
            if ended is not None:
                store.append(ended, idempotency_key=lease.ref.ended_key, pipeline=pipe)
            lease.end(pipe)
            pipe.execute()

    until_redis_answers(commit, f"trial {lease.ref.trial_id}")  # safe to repeat: keyed append, absolute writes


def _ended(lease: Lease, status: TrialJobStatus, exit_code: int | None, message: str | None) -> TrialEnded:
    return TrialEnded(
        experiment_id=lease.ref.experiment_id,
        trial_id=lease.ref.trial_id,
        attempt=lease.ref.attempt,
        source=lease.worker,
        status=status,
        exit_code=exit_code,
        message=message,
    )
