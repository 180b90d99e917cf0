"""The worker keeps the jobs of its running trials alive, all of them in one round trip, on a real redis-server."""

from __future__ import annotations

from typing import Any

import redis

from core.queueing import SERIALIZER, trial_queue
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
