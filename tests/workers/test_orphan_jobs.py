"""A job left queued by a submission the log refused: a worker that takes it drops it, running and recording nothing.

Redis runs the rest of a MULTI past a script's error, so a refused submission (a superseded runner's, an archived
experiment's) queues its job all the same; the refusing side withdraws it (core.queueing.execute_enqueued), and this
is what happens when a worker took it first, or the withdrawal never reached Redis."""

from __future__ import annotations

import pytest
import redis
from rq.job import Job, JobStatus

from core import keys
from core.event_store import AppendFenced, Fence
from core.queueing import SERIALIZER, trial_queue
from tests.conftest import Processes, ServiceFactory, form, wait_until


def test_a_worker_drops_the_job_of_a_refused_submission(
    client: redis.Redis,
    rq_connection: redis.Redis,
    make_service: ServiceFactory,
    processes: Processes,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service = make_service()
    submission = service.submission(form(0))
    epoch = keys.runner_epoch(service.experiment_id)
    client.set(epoch, 2)
    service.store.fence = Fence(epoch, "1")  # a runner's epoch, another runner's since

    def unreachable(job: Job, *args: object, **kwargs: object) -> None:
        raise redis.ConnectionError("Redis went away right after the refusal")

    monkeypatch.setattr(Job, "delete", unreachable)
    with pytest.raises(AppendFenced):
        service.submit(submission)
    [job_id] = trial_queue("local", rq_connection).job_ids
    log_before = service.store.read()

    processes.worker()

    def ended() -> Job | None:
        job = Job.fetch(job_id, connection=rq_connection, serializer=SERIALIZER)
        return job if job.get_status() in (JobStatus.FINISHED, JobStatus.FAILED) else None

    job = wait_until(ended, 20, what="the worker to take the job")
    missing = f"trial {submission.trial_id} of experiment {service.experiment_id} has no submission in the log"
    assert (job.get_status(), job.return_value()) == (JobStatus.FINISHED, f"dropped: {missing}")
    assert service.store.read() == log_before  # nothing recorded
    assert not client.exists(keys.trial_claim(service.experiment_id, submission.trial_id, 1))  # nor claimed
    assert client.zcard(keys.LEASES) == 0
    assert processes.logs().count(f"{missing}: its job is dropped") == 1  # one line, no traceback
    assert "Traceback" not in processes.logs()
