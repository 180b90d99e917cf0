"""A worker's pick-up of a trial: the claim and the reads its start needs go in one round trip
(workers.runtime.job._pick_up); what they read must decide the start as separate reads did."""

from __future__ import annotations

import redis
from rq.job import Job, JobStatus

from core import keys
from core.event_store import StoredEvent
from core.queueing import SERIALIZER, submission_key, trial_queue
from schemas.events import TrialEnded, TrialStarted
from schemas.trial import TrialJobStatus
from tests.conftest import Processes, ServiceFactory, form, wait_until


def _finished(rq_connection: redis.Redis, job_id: str) -> Job | None:
    job = Job.fetch(job_id, connection=rq_connection, serializer=SERIALIZER)
    return job if job.get_status() in (JobStatus.FINISHED, JobStatus.FAILED) else None


def test_a_trial_canceled_before_a_worker_came_ends_without_starting(
    rq_connection: redis.Redis, make_service: ServiceFactory, processes: Processes
) -> None:
    service = make_service()
    trial_id = service.submit_trial_job(form(0)).id
    [job_id] = trial_queue("local", rq_connection).job_ids
    service.cancel_trial_job(trial_id)  # no worker yet: the cancel waits in the trial's commands stream

    processes.worker()

    job = wait_until(lambda: _finished(rq_connection, job_id), 20, what="the worker to take the job")
    assert (job.get_status(), job.return_value()) == (JobStatus.FINISHED, "canceled before it started")
    events = [entry.event for entry in service.store.read() if isinstance(entry, StoredEvent)]
    assert not [event for event in events if isinstance(event, TrialStarted)]
    [ended] = [event for event in events if isinstance(event, TrialEnded)]
    assert ended.status == TrialJobStatus.USER_CANCELED


def test_a_submission_that_is_not_utf8_drops_the_job_as_having_none(
    client: redis.Redis, rq_connection: redis.Redis, make_service: ServiceFactory, processes: Processes
) -> None:
    """The pick-up reads it again as bytes: an entry of an imported log that is not UTF-8 reads as unreadable, not
    as an error that would fail the job and leave its claim behind."""
    service = make_service()
    trial_id = service.submit_trial_job(form(0)).id
    [job_id] = trial_queue("local", rq_connection).job_ids
    odd = client.xadd(keys.events(service.experiment_id), {"type": "TrialSubmitted", "json": b"\xff not UTF-8"})
    client.hset(keys.idempotency(service.experiment_id), submission_key(trial_id), odd)

    processes.worker()

    job = wait_until(lambda: _finished(rq_connection, job_id), 20, what="the worker to take the job")
    missing = f"trial {trial_id} of experiment {service.experiment_id} has no submission in the log"
    assert (job.get_status(), job.return_value()) == (JobStatus.FINISHED, f"dropped: {missing}")
    assert not client.exists(keys.trial_claim(service.experiment_id, trial_id, 1))
    assert "Traceback" not in processes.logs()
