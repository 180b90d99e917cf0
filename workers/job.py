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

from manager import keys
from manager.event_store import EventStore, StoredEvent
from schemas.events import TrialDeferred, TrialEnded, TrialSubmitted
from schemas.trial import TrialJobStatus
from workers.control import LogTrialControl
from workers.platform import Deferred, TrialAssignment
from workers.registry import RUN_TRIAL, platform_class, queue_name

log = logging.getLogger(__name__)

DEFER_POLL_S = 0.5
CLAIM_TTL_S = 7 * 24 * 3600


def decoded_client(raw: redis.Redis) -> redis.Redis:
    """A string-decoding client on the same server as RQ's raw connection."""
    kwargs = dict(raw.connection_pool.connection_kwargs)
    kwargs["decode_responses"] = True
    pool = redis.ConnectionPool(connection_class=raw.connection_pool.connection_class, **kwargs)
    return redis.Redis(connection_pool=pool)


def enqueue_trial(
    rq_connection: redis.Redis,
    platform: str,
    args: tuple[str, str, int],
    *,
    deferrals: int = 0,
    last_deferral: str = "",
    pipeline: redis.client.Pipeline | None = None,
) -> None:
    """Queue (or re-queue) the RQ job of a trial; RQ's job timeout is off, trials end on their own terms."""
    experiment_id, trial_id, attempt = args
    Queue(queue_name(platform), connection=rq_connection).enqueue_call(
        RUN_TRIAL,
        args=args,
        kwargs={"deferrals": deferrals, "last_deferral": last_deferral},
        job_id=f"{experiment_id}-{trial_id}-{attempt}-{deferrals}",
        timeout=-1,
        result_ttl=600,
        failure_ttl=7 * 24 * 3600,
        description=f"trial {trial_id} of experiment {experiment_id}",
        pipeline=pipeline,
    )


def submission_key(trial_id: str) -> str:
    """Idempotency key of a trial's TrialSubmitted event: it also finds that event in the log."""
    return f"submit:{trial_id}"


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def run_trial(experiment_id: str, trial_id: str, attempt: int = 1, deferrals: int = 0, last_deferral: str = "") -> str:
    """Run one trial on this worker's platform and append how it ended."""
    job = get_current_job()
    assert job is not None, "run_trial runs inside an RQ job"
    client = decoded_client(job.connection)
    store = EventStore(client, experiment_id)
    submitted_id = store.id_for_key(submission_key(trial_id))
    submitted = store.read_one(submitted_id) if submitted_id else None
    if not (
        isinstance(submitted, StoredEvent)
        and isinstance(submitted.event, TrialSubmitted)
        and submitted.event.trial_id == trial_id
    ):
        raise LookupError(f"trial {trial_id} of experiment {experiment_id} has no submission in the log")
    submission = submitted.event

    claim = keys.trial_claim(experiment_id, f"{trial_id}:{attempt}")
    if not client.set(claim, worker_name(), nx=True, ex=CLAIM_TTL_S):
        return "already claimed by another delivery"

    control = LogTrialControl(store, submitted, worker_name(), attempt)
    try:
        if control.stop_request() is not None:
            return "canceled before it started"
        platform = platform_class(submission.platform)(client)
        assignment = TrialAssignment(
            experiment_id=experiment_id,
            trial_id=trial_id,
            form=submission.form,
            launch=submission.launch,
            working_directory=submission.working_directory,
            platform_config=platform.config_model.model_validate(submission.launch.platform_config),
        )
        try:
            outcome = platform.run_trial(assignment, control)
        except Exception as error:
            log.exception("trial %s: platform %s failed", trial_id, submission.platform)
            store.append(_ended(submission, TrialJobStatus.FAILED, None, f"internal error: {error}"))
            raise
        if isinstance(outcome, Deferred):
            if outcome.reason != last_deferral:
                store.append(TrialDeferred(experiment_id=experiment_id, trial_id=trial_id, reason=outcome.reason))
            client.delete(claim)
            control.wait(DEFER_POLL_S)
            enqueue_trial(
                job.connection,
                submission.platform,
                (experiment_id, trial_id, attempt),
                deferrals=deferrals + 1,
                last_deferral=outcome.reason,
            )
            return f"deferred: {outcome.reason}"
        store.append(
            _ended(submission, outcome.status, outcome.exit_code, outcome.message),
            idempotency_key=f"ended:{trial_id}:{attempt}",
        )
        return str(outcome.status)
    finally:
        control.close()


def _ended(
    submission: TrialSubmitted, status: TrialJobStatus, exit_code: int | None, message: str | None
) -> TrialEnded:
    return TrialEnded(
        experiment_id=submission.experiment_id,
        trial_id=submission.trial_id,
        source=worker_name(),
        status=status,
        exit_code=exit_code,
        message=message,
    )
