"""The RQ worker that serves one platform's queue."""

from __future__ import annotations

import logging
import threading
from typing import Any

import redis
from rq import Queue, SimpleWorker
from rq.job import Job
from rq.worker import WorkerStatus

from manager.connections import same_server
from workers.job import worker_name
from workers.reaper import reap_forever
from workers.registry import platform_class, queue_name

HEARTBEAT_INTERVAL_S = 15


class TrialWorker(SimpleWorker):
    """Runs trials in-process (no fork per job: ~3x the throughput) and keeps heartbeating meanwhile.

    RQ's SimpleWorker sends no heartbeat while a job runs, so a trial longer than the worker TTL
    would look abandoned; a background thread keeps the worker, execution and job alive. Another
    reaps the attempts of workers that died (see workers/reaper.py).
    """

    def work(self, *args: Any, **kwargs: Any) -> bool:
        stop = threading.Event()
        reaper = threading.Thread(
            target=reap_forever,
            args=(same_server(self.connection, decode=True), self.connection, worker_name(), stop),
            name="reaper",
            daemon=True,
        )
        reaper.start()
        try:
            return bool(super().work(*args, **kwargs))
        finally:
            stop.set()

    def execute_job(self, job: Job, queue: Queue) -> None:
        execution = self.prepare_execution(job)
        done = threading.Event()

        def beat() -> None:
            while not done.wait(HEARTBEAT_INTERVAL_S):
                try:
                    self.maintain_heartbeats(job, execution)
                except redis.RedisError as error:
                    self.log.warning("heartbeat failed: %s", error)

        beater = threading.Thread(target=beat, name="heartbeat", daemon=True)
        beater.start()
        try:
            self.perform_job(job, queue, execution)
        finally:
            done.set()
            beater.join()
        self.set_state(WorkerStatus.IDLE)


def serve(rq_connection: redis.Redis, platform: str, *, burst: bool = False, name: str | None = None) -> None:
    """Serve `platform`'s queue until stopped (SIGTERM/SIGINT), or until it is empty with `burst`."""
    platform_class(platform)  # an unknown platform fails here, before listening
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    queue = Queue(queue_name(platform), connection=rq_connection)
    TrialWorker([queue], connection=rq_connection, name=name).work(burst=burst, with_scheduler=False)
