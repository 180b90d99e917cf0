"""The worker keeps the jobs of its running trials alive, all of them in one round trip, on a real redis-server."""

from __future__ import annotations

import signal
from typing import Any

import pytest
import redis
from rq import SimpleWorker
from rq.exceptions import StopRequested
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.results import Result
from rq.suspension import resume, suspend
from rq.worker import WorkerStatus

from core.queueing import RUN_TRIAL, SERIALIZER, trial_queue
from workers.runtime.job import taken_preparation
from workers.runtime.worker import TrialWorker


def test_running_jobs_are_kept_alive_in_one_round_trip_and_none_is_recreated(rq_connection: redis.Redis) -> None:
    queue = trial_queue("heartbeat", rq_connection)
    worker = TrialWorker([queue], connection=rq_connection, concurrency=8, serializer=SERIALIZER)
    worker.register_birth()
    jobs = [queue.enqueue_call("os.getpid", job_id=f"job{index}") for index in range(4)]
    running = [(job, worker.prepare_execution(job)) for job in jobs]
    for _, execution in running:
        rq_connection.expire(execution.key, 5)
    rq_connection.config_resetstat()

    worker._keep_alive(running)

    calls: Any = rq_connection.info("commandstats")
    assert calls["cmdstat_exec"]["calls"] == 1  # RQ's maintain_heartbeats: one transaction per job
    assert all(rq_connection.ttl(execution.key) > 60 for _, execution in running)

    rq_connection.delete(jobs[3].key)  # ended and deleted (result_ttl 0) while its heartbeat was on its way
    rq_connection.delete(worker.key)  # the worker's own hash expired meanwhile
    worker._keep_alive(running)
    for job, execution in running[:3]:
        assert rq_connection.hget(job.key, "last_heartbeat")
        assert rq_connection.ttl(execution.key) > 60
    assert not rq_connection.exists(jobs[3].key)  # not brought back as a hash holding only a heartbeat
    assert rq_connection.hget(worker.key, "queues") == queue.name.encode()  # recreated whole, with a TTL
    assert rq_connection.ttl(worker.key) > 0


def _prepared_records(connection: redis.Redis, queue: Queue, worker: SimpleWorker, job: Job) -> dict[str, Any]:
    return {
        "job fields": sorted(connection.hkeys(job.key)),
        "job status": connection.hget(job.key, "status"),
        "job worker": connection.hget(job.key, "worker_name"),
        "job ttl": connection.ttl(job.key),
        "started": job.id in queue.started_job_registry.get_job_ids(),
        "executions": len(connection.smembers(f"{worker.key}:executions")),
        "worker state": connection.hget(worker.key, "state"),
        "worker ttl": connection.ttl(worker.key) > 0,
    }


def _dequeued(queue: Queue, worker: SimpleWorker, function: str = "os.getpid") -> Job:
    worker.register_birth()
    job = queue.enqueue_call(function, job_id=f"job-{worker.name}")
    worker.connection.lmove(queue.key, queue.intermediate_queue_key)  # as RQ's dequeue does
    return job


def _prepared_by_rq(queue: Queue, function: str = "os.getpid") -> dict[str, Any]:
    """The records RQ's own worker leaves once it has prepared a job (its two MULTIs), its name left out."""
    theirs = SimpleWorker([queue], connection=queue.connection, serializer=SERIALIZER, name="theirs")
    job = _dequeued(queue, theirs, function)
    SimpleWorker.prepare_execution(theirs, job)
    SimpleWorker.prepare_job_execution(theirs, job, remove_from_intermediate_queue=True)
    return {**_prepared_records(queue.connection, queue, theirs, job), "job worker": None}


def test_a_job_is_prepared_in_one_transaction_leaving_what_rqs_two_leave(rq_connection: redis.Redis) -> None:
    """TrialWorker.prepare_execution does RQ's prepare_execution and prepare_job_execution (one MULTI each, in a
    row on the way to a trial's start) in one: the records it leaves are RQ's own, checked against RQ's worker."""
    queue = trial_queue("prepare", rq_connection)
    ours = TrialWorker([queue], connection=rq_connection, serializer=SERIALIZER, name="ours")
    job = _dequeued(queue, ours)
    rq_connection.config_resetstat()
    ours.prepare_execution(job)
    ours.prepare_job_execution(job, remove_from_intermediate_queue=True)  # as perform_job calls it
    calls: Any = rq_connection.info("commandstats")
    assert calls["cmdstat_exec"]["calls"] == 1
    records = _prepared_records(rq_connection, queue, ours, job)
    assert {**records, "job worker": None} == _prepared_by_rq(queue)
    assert records["job worker"] == b"ours" and records["job status"] == b"started" and records["executions"] == 1
    assert rq_connection.llen(queue.intermediate_queue_key) == 0


def test_a_trial_jobs_records_go_with_its_pick_up_and_are_rqs_own(
    client: redis.Redis, rq_connection: redis.Redis
) -> None:
    """A trial's job: its records are not sent by prepare_execution but handed to the trial's pick-up, which sends
    them in its own MULTI (workers.runtime.job.hand_over), one round trip and fsync fewer on the way to the start.
    Sent, they are RQ's own records; a job that ends before its pick-up gets them before those of its end; any other
    job's are sent at once."""
    queue = trial_queue("handed", rq_connection)
    ours = TrialWorker([queue], connection=rq_connection, serializer=SERIALIZER, name="ours", trial_client=client)
    job = _dequeued(queue, ours, RUN_TRIAL)
    rq_connection.config_resetstat()
    ours.prepare_execution(job)
    calls: Any = rq_connection.info("commandstats")
    assert "cmdstat_exec" not in calls and rq_connection.hget(job.key, "status") == b"queued"
    preparation = taken_preparation()
    assert preparation is not None and taken_preparation() is None
    with preparation:
        preparation.execute()  # what the pick-up does, its own commands after these
    calls = rq_connection.info("commandstats")
    assert calls["cmdstat_exec"]["calls"] == 1  # one MULTI: RQ's records land together (with the claim, in a pick-up)
    records = _prepared_records(rq_connection, queue, ours, job)
    assert {**records, "job worker": None} == _prepared_by_rq(queue, RUN_TRIAL)
    assert records["job status"] == b"started" and rq_connection.llen(queue.intermediate_queue_key) == 0

    failing = TrialWorker([queue], connection=rq_connection, serializer=SERIALIZER, name="failing", trial_client=client)
    job = _dequeued(queue, failing, RUN_TRIAL)
    failing.perform_job(job, queue, failing.prepare_execution(job))  # run_trial() without its arguments: a TypeError
    assert job.get_status() == JobStatus.FAILED and taken_preparation() is None
    assert job.id in queue.failed_job_registry.get_job_ids() and job.id not in queue.started_job_registry.get_job_ids()

    other = TrialWorker([queue], connection=rq_connection, serializer=SERIALIZER, name="other", trial_client=client)
    job = _dequeued(queue, other)
    other.prepare_execution(job)
    assert rq_connection.hget(job.key, "status") == b"started" and taken_preparation() is None


def _performed(worker: SimpleWorker, queue: Queue) -> Job:
    """A job enqueued, dequeued as RQ does, then prepared and performed by `worker` as its class does."""
    worker.register_birth()
    job = queue.enqueue_call("os.getpid", job_id=f"job-{worker.name}")
    worker.connection.lmove(queue.key, queue.intermediate_queue_key)
    execution = type(worker).prepare_execution(worker, job)
    type(worker).perform_job(worker, job, queue, execution)
    return job


def test_a_jobs_success_is_one_transaction_leaving_what_rqs_leaves(rq_connection: redis.Redis) -> None:
    """From a trial's end to the worker's next dequeue RQ makes six round trips, three of them writes (each waiting for
    an fsync under `appendfsync always`); TrialWorker makes one transaction, and its loop nothing more before the
    dequeue. The records it leaves are RQ's own, checked against RQ's worker."""
    queue = trial_queue("success", rq_connection)
    ours = TrialWorker([queue], connection=rq_connection, serializer=SERIALIZER, name="ours")
    theirs = SimpleWorker([queue], connection=rq_connection, serializer=SERIALIZER, name="theirs")
    jobs = {"theirs": _performed(theirs, queue)}
    theirs.check_for_suspension(burst=False)  # RQ's loop, between the job and the dequeue
    theirs.set_state(WorkerStatus.IDLE)

    ours.register_birth()
    job = queue.enqueue_call("os.getpid", job_id="job-ours")
    rq_connection.lmove(queue.key, queue.intermediate_queue_key)
    execution = ours.prepare_execution(job)
    rq_connection.config_resetstat()
    ours.perform_job(job, queue, execution)
    ours.check_for_suspension(burst=False)
    ours.set_state(WorkerStatus.IDLE)
    calls: Any = rq_connection.info("commandstats")
    assert calls["cmdstat_exec"]["calls"] == 1
    assert "cmdstat_watch" not in calls and "cmdstat_smembers" not in calls and "cmdstat_exists" in calls
    jobs["ours"] = job

    def records(worker: SimpleWorker) -> dict[str, Any]:
        job, stats = jobs[worker.name], rq_connection.hgetall(worker.key)
        return {
            "job fields": sorted(rq_connection.hkeys(job.key)),
            "job status": rq_connection.hget(job.key, "status"),
            "job ttl": 0 < rq_connection.ttl(job.key) <= 500,
            "result": Result.fetch_latest(job, serializer=SERIALIZER).return_value == job.return_value(),  # type: ignore[union-attr]
            "finished": job.id in queue.finished_job_registry.get_job_ids(),
            "started": job.id in queue.started_job_registry.get_job_ids(),
            "executions": rq_connection.smembers(f"{worker.key}:executions"),
            "worker counts": (stats[b"successful_job_count"], b"total_working_time" in stats),
            "worker state": stats[b"state"],
            "worker ttl": rq_connection.ttl(worker.key) > 0,
        }

    assert records(ours) == records(theirs)
    assert records(ours)["job status"] == b"finished" and records(ours)["worker state"] == b"idle"
    assert records(ours)["finished"] and not records(ours)["started"]


def test_a_suspension_found_at_a_jobs_end_is_honoured(rq_connection: redis.Redis) -> None:
    """The success's transaction asks whether workers are suspended (`rq suspend`) for the loop: when they are, the
    loop waits as RQ's does (in burst mode RQ stops instead: what this test can see)."""
    queue = trial_queue("suspended", rq_connection)
    worker = TrialWorker([queue], connection=rq_connection, serializer=SERIALIZER, name="suspended")
    suspend(rq_connection)
    try:
        _performed(worker, queue)
        with pytest.raises(StopRequested):
            worker.check_for_suspension(burst=True)
    finally:
        resume(rq_connection)


def test_a_stop_requested_while_idle_holds_when_its_exception_is_lost(
    rq_connection: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RQ stops an idle worker by raising StopRequested from the signal handler; raised inside code that catches
    exceptions (RQ's cleaning of its registries at start, in ci86), it is lost. The loop must still stop before it
    dequeues (a dequeue waits minutes for a job)."""
    handlers = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    worker = TrialWorker([trial_queue("stopping", rq_connection)], connection=rq_connection, serializer=SERIALIZER)
    dequeues: list[object] = []
    monkeypatch.setattr(worker, "dequeue_job_and_maintain_ttl", lambda *args: dequeues.append(args))  # then None
    try:
        with pytest.raises(StopRequested):
            worker.request_stop(signal.SIGTERM, None)  # as the handler does when idle; the exception then lost
        worker.work(burst=False)
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
    assert dequeues == []  # stopped on its request, before any dequeue
