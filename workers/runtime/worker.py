"""The RQ worker that serves one platform's queue."""

from __future__ import annotations

import logging
import socket
import threading
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import redis
from redis.client import Pipeline
from rq import SimpleWorker
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.rate_limit import release_slot
from rq.registry import StartedJobRegistry
from rq.suspension import WORKERS_SUSPENDED
from rq.timeouts import BaseDeathPenalty
from rq.utils import now
from rq.worker import WorkerStatus

from core.connections import connect, same_server
from core.logging_setup import configure_logging
from core.placement import WORKER_SLOTS_FIELD
from core.queueing import RUN_TRIAL, SERIALIZER, trial_queue, wake_parked
from core.reaper import REAP_INTERVAL_S, reap_lost_attempts
from core.registry import add_platforms, platform_class
from core.settings import Settings
from workers.runtime.job import WorkerRuntime, hand_over, install, taken_preparation

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 15
HEARTBEAT_SPACING_S = 1.0  # RQ's own heartbeats between jobs: at most one a second
HEARTBEAT_BATCH = 500  # running jobs kept alive per round trip
HEALTHY_WITHIN = timedelta(seconds=3 * HEARTBEAT_INTERVAL_S)  # a health check's patience


class _NoDeathPenalty(BaseDeathPenalty):
    """Trials end on their own terms (their jobs have no RQ timeout), and may run off the main thread,
    where RQ's SIGALRM-based penalty cannot be set up."""

    def setup_death_penalty(self) -> None:
        pass

    def cancel_death_penalty(self) -> None:
        pass


class TrialWorker(SimpleWorker):
    """Runs jobs in-process (no fork per job: ~3x the throughput), up to `concurrency` at once, and
    keeps heartbeating meanwhile.

    RQ's SimpleWorker sends no heartbeat while a job runs, so a trial longer than the worker TTL
    would look abandoned: a background thread keeps the worker, executions and jobs alive. With
    `concurrency` > 1 each job runs in a thread of its own, and the worker takes the next job while
    a slot is free (for platforms whose trials run elsewhere: a worker only follows them).
    """

    death_penalty_class = _NoDeathPenalty

    def __init__(
        self, *args: Any, concurrency: int = 1, trial_client: redis.Redis | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.concurrency = concurrency
        self.trial_client = trial_client  # the runtime's: a trial's pick-up sends RQ's records of its job on it
        self._slots = threading.BoundedSemaphore(concurrency)
        self._running: dict[str, tuple[Job, Any]] = {}
        self._running_lock = threading.Lock()
        self._threads: set[threading.Thread] = set()  # the trials' threads still running; each leaves at its end
        self._checked_at_end = False  # the last job's success wrote the idle state and found no suspension

    def heartbeat(self, timeout: int | None = None, pipeline: Pipeline | None = None) -> None:
        """RQ sends a worker's heartbeat (three writes, one round trip each) after every job, before and
        after every dequeue (the last on the path from a trial's enqueue to its start): here the three go in
        one round trip, and a default one within HEARTBEAT_SPACING_S of the last is skipped (the key's TTL,
        minutes, was just renewed; `_beat` renews it meanwhile). Those RQ adds to its own pipelines go on."""
        if pipeline is not None:
            super().heartbeat(timeout, pipeline)
            return
        last = self.last_heartbeat
        recent = last is not None and last.tzinfo is not None and (now() - last).total_seconds() < HEARTBEAT_SPACING_S
        if timeout is None and recent:
            return
        with self.connection.pipeline() as batch:
            super().heartbeat(timeout, batch)
            batch.execute()

    def prepare_execution(self, job: Job) -> Execution:
        """RQ's two preparations of a job, each a MULTI in a row on the way to a trial's start (its execution's
        records, then the job's start: `prepare_job_execution`, which `perform_job` calls next), in one: a round
        trip less, and one fsync less under `appendfsync always`. The same writes, in RQ 3.0's order.

        A trial's job (with `trial_client`) is not sent here: its MULTI is handed over to the trial's pick-up, which
        sends its claim and reads in it (workers.runtime.job.hand_over), one round trip and fsync fewer again."""
        ttl = self.get_heartbeat_ttl(job)
        trial_client = self.trial_client if job.func_name == RUN_TRIAL else None
        pipeline = (self.connection if trial_client is None else trial_client).pipeline()
        execution = Execution.create(job, ttl, pipeline=pipeline, worker_name=self.name)
        self.executions[execution.id] = execution
        self.set_state(WorkerStatus.BUSY, pipeline=pipeline)
        self.heartbeat(ttl, pipeline=pipeline)
        job.heartbeat(now(), ttl, pipeline=pipeline)
        job.prepare_for_execution(self.name, pipeline=pipeline)
        pipeline.persist(job.key)
        if len(self.queues) == 1:  # RQ's condition: the job came off this queue's intermediate list
            pipeline.lrem(self.queues[0].intermediate_queue_key, 1, job.id)
        if trial_client is None:
            _send(pipeline)
        else:
            hand_over(pipeline)
        return execution

    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        """Done by `prepare_execution`, in its transaction."""

    def handle_execution_ended(self, job: Job, queue: Queue, heartbeat_ttl: int) -> None:
        """RQ's, less its write: the job's last heartbeat goes with the record of how it ended."""
        job.ended_at = now()

    def handle_job_failure(self, job: Job, queue: Queue, *args: Any, **kwargs: Any) -> None:
        _send_unsent_preparation()
        job.heartbeat(now(), job.failure_callback_timeout)  # RQ's `handle_execution_ended` write, as RQ makes it
        super().handle_job_failure(job, queue, *args, **kwargs)

    def handle_job_success(
        self, job: Job, queue: Queue, started_job_registry: StartedJobRegistry, execution: Execution
    ) -> None:
        """RQ's record of a job's success in one MULTI, on the way from a trial's end to the worker's next dequeue
        where RQ makes six round trips, three of them writes waiting for an fsync under `appendfsync always`: the
        job's last heartbeat (`handle_execution_ended`), a WATCH and a read of the job's dependents, RQ's MULTI, and,
        running one job at a time, RQ's loop's suspension check (with the worker's heartbeat) and its idle state
        before the dequeue. Here: the job's heartbeat, then RQ 3.0's writes in its order, then (one job at a time)
        the worker's heartbeat, its idle state and the suspension check, which the loop then takes as made. No
        dependents are read: trialstream queues no job that has any (core.queueing)."""
        assert job.started_at is not None and job.ended_at is not None
        _send_unsent_preparation()
        result_ttl = job.get_result_ttl(self.default_result_ttl)
        alone = self.concurrency == 1
        with self.connection.pipeline() as pipeline:
            job.heartbeat(now(), job.success_callback_timeout, pipeline=pipeline)
            self.increment_successful_job_count(pipeline=pipeline)
            self.increment_total_working_time(job.ended_at - job.started_at, pipeline)
            if result_ttl != 0:
                job._handle_success(
                    result_ttl,
                    pipeline=pipeline,
                    worker_name=self.name,
                    execution_id=execution.id,
                    execution_started_at=execution.created_at,
                    execution_ended_at=job.ended_at,
                )
            job.cleanup(result_ttl, pipeline=pipeline, remove_from_queue=False)
            job._status = JobStatus.FINISHED
            self.cleanup_execution(job, pipeline=pipeline, execution=execution)
            if alone:
                self.heartbeat(pipeline=pipeline)
                self.set_state(WorkerStatus.IDLE, pipeline=pipeline)
                pipeline.exists(WORKERS_SUSPENDED)
            answers = pipeline.execute()
        self._checked_at_end = alone and not answers[-1]
        release_slot(job)
        named, taken = job.description if self.log_job_description else job.id, job.ended_at - job.started_at
        self.log.info("Successfully completed %s job in %ss on worker %s", named, taken, self.name)  # as RQ says it

    def check_for_suspension(self, burst: bool) -> None:
        """RQ's, unless the last job's success found no suspension, just before: then its idle state is written too
        (`set_state` leaves out the loop's)."""
        if self._checked_at_end:
            return
        super().check_for_suspension(burst)

    def set_state(self, state: str, pipeline: Pipeline | None = None) -> None:
        if pipeline is None and state == WorkerStatus.IDLE and self._checked_at_end:
            self._checked_at_end = False  # written by the last job's success: the dequeue follows
            return
        self._checked_at_end = False
        super().set_state(state, pipeline)

    def _shutdown(self) -> None:
        """A warm shutdown of an idle worker is RQ's StopRequested, raised by the signal handler wherever the main
        thread is. Raised inside code that catches exceptions, it is lost (ci86: a SIGTERM during RQ's cleaning of
        its registries at start), and the worker waited in its dequeue (minutes) for a second signal. The flag RQ's
        loop checks before each dequeue is set first."""
        self._stop_requested = True
        super()._shutdown()  # type: ignore[no-untyped-call]  # RQ's, untyped

    def register_birth(self) -> None:
        super().register_birth()  # type: ignore[no-untyped-call]  # RQ's, untyped; untyped_calls_exclude misses super()
        self.connection.hset(self.key, WORKER_SLOTS_FIELD, self.concurrency)  # a hybrid placement counts them

    def work(self, *args: Any, **kwargs: Any) -> bool:
        stop = threading.Event()
        threading.Thread(target=self._beat, args=(stop,), name="heartbeat", daemon=True).start()
        try:
            return bool(super().work(*args, **kwargs))
        finally:
            with self._running_lock:
                threads = list(self._threads)
            for thread in threads:  # a warm shutdown lets every trial in flight end
                thread.join()
            stop.set()

    def execute_job(self, job: Job, queue: Queue) -> None:
        self._slots.acquire()  # blocks taking the next job while every slot is busy
        if self.concurrency == 1:
            self._perform(job, queue)
            return
        thread = threading.Thread(target=self._perform, args=(job, queue), name=f"job-{job.id}", daemon=True)
        with self._running_lock:
            self._threads.add(thread)
        thread.start()

    def _perform(self, job: Job, queue: Queue) -> None:
        try:
            execution = self.prepare_execution(job)
            with self._running_lock:
                self._running[job.id] = (job, execution)
            self.perform_job(job, queue, execution)
        finally:
            with self._running_lock:
                self._running.pop(job.id, None)
                self._threads.discard(threading.current_thread())
                idle = not self._running
            self._slots.release()
            if idle and self.concurrency > 1:  # at 1, RQ's loop says so itself before its next dequeue: a write less
                self.set_state(WorkerStatus.IDLE)

    def _beat(self, stop: threading.Event) -> None:
        """The worker's own heartbeat too, which RQ sends only between jobs and at most every ~7 minutes
        while idle: `alive_here` (a container's health check) reads how recent it is."""
        while not stop.wait(HEARTBEAT_INTERVAL_S):
            with self._running_lock:
                running = list(self._running.values())
            try:
                self._keep_alive(running)
            except redis.RedisError as error:
                self.log.warning("heartbeat failed: %s", error)

    def _keep_alive(self, running: list[tuple[Job, Any]]) -> None:
        """RQ's `maintain_heartbeats` for the worker and every job it runs, HEARTBEAT_BATCH jobs a round trip
        (RQ's own sends one per job: a tenth of the CPU of a worker following a thousand trials), with its
        two repairs: a hash that had expired (the worker's, or a job's deleted meanwhile) is not left behind."""
        worker_ttl = self.job_monitoring_interval + 60
        for start in range(0, max(len(running), 1), HEARTBEAT_BATCH):
            batch = running[start : start + HEARTBEAT_BATCH]
            with self.connection.pipeline() as pipe:
                self.heartbeat(worker_ttl, pipeline=pipe)  # its HSET first: 1 if it created the hash anew
                job_hsets = []
                for job, execution in batch:
                    working_s = (now() - job.started_at).total_seconds() if job.started_at else 0.0
                    ttl = int(self.get_heartbeat_ttl(job, working_time=working_s))
                    execution.heartbeat(job.started_job_registry, ttl, pipeline=pipe)
                    job_hsets.append(len(pipe))
                    job.heartbeat(now(), ttl, pipeline=pipe, xx=True)
                results = pipe.execute()
                gone = [job.key for (job, _), index in zip(batch, job_hsets, strict=True) if results[index] == 1]
                if gone:
                    pipe.delete(*gone)
                if results[0] == 1:
                    pipe.hset(self.key, mapping=self.serialize())
                    pipe.expire(self.key, worker_ttl)
                pipe.execute()


def _send(pipeline: Pipeline) -> None:
    with pipeline:
        pipeline.execute()


def _send_unsent_preparation() -> None:
    """RQ's records of a job that ended before its pick-up sent them (it raised first), sent before those of its end."""
    preparation = taken_preparation()
    if preparation is not None:
        _send(preparation)


def _housekeeping(runtime: WorkerRuntime, stop: threading.Event) -> None:
    """Every REAP_INTERVAL_S: declare lost the attempts of dead workers, queue again the parked trials
    of this platform whose re-check time has come, and let the platform say its machine still serves
    (`keep_alive`). Redis outages are waited out."""
    keep_alive = getattr(runtime.platform, "keep_alive", None)  # optional for third-party platforms
    while not stop.wait(REAP_INTERVAL_S):
        try:
            reap_lost_attempts(runtime.client, runtime.rq_connection, runtime.name, runtime.settings.trial_lease_s)
            wake_parked(runtime.client, runtime.rq_connection, runtime.platform.name, "re-check", True)
            if keep_alive is not None:
                keep_alive()
        except redis.RedisError as error:
            log.warning("housekeeping: %s; retrying", error)
        except Exception:  # a platform's keep_alive, say: the next round must still come
            log.exception("housekeeping failed; retrying")


def alive_here(settings: Settings) -> bool:
    """Whether a worker of this host has sent its heartbeat to Redis lately: a container's health check
    (Redis reachable, the worker's process alive)."""
    assert settings.redis_url is not None
    connection = connect(settings.redis_url, options=settings.redis_options(), decode=False, retry_s=0)
    host, now = socket.gethostname(), datetime.now(UTC)
    beats = [
        worker.last_heartbeat if worker.last_heartbeat.tzinfo else worker.last_heartbeat.replace(tzinfo=UTC)
        for worker in TrialWorker.all(connection=connection, serializer=SERIALIZER)
        if worker.hostname == host and worker.last_heartbeat is not None
    ]
    return any(now - beat < HEALTHY_WITHIN for beat in beats)


def serve(
    settings: Settings,
    platform: str,
    *,
    concurrency: int = 1,
    burst: bool = False,
    name: str | None = None,
    log_format: Literal["text", "json"] = "text",
) -> None:
    """Serve `platform`'s queue until stopped (SIGTERM/SIGINT), or until it is empty with `burst`."""
    add_platforms(settings.platforms)
    adapter = platform_class(platform)  # an unknown platform fails here, before listening
    if not 1 <= concurrency <= adapter.trials_per_process:
        raise ValueError(
            f"--concurrency {concurrency}: platform {platform} supervises 1 to {adapter.trials_per_process} "
            "trials per worker process; run more workers to run more trials"
        )
    assert settings.redis_url is not None
    configure_logging(log_format)
    rq_connection = connect(
        settings.redis_url, options=settings.redis_options(), decode=False, retry_s=settings.redis_retry_s
    )
    client = same_server(rq_connection, decode=True)
    runtime = WorkerRuntime(settings, client, rq_connection, adapter(settings, client))
    install(runtime)
    warm_up = getattr(runtime.platform, "warm_up", None)  # optional for third-party platforms
    if warm_up is not None:
        warm_up()
    stop = threading.Event()
    threading.Thread(target=_housekeeping, args=(runtime, stop), name="housekeeping", daemon=True).start()
    try:
        worker = TrialWorker(
            [trial_queue(platform, rq_connection)],
            connection=rq_connection,
            name=name,
            serializer=SERIALIZER,
            concurrency=concurrency,
            trial_client=client,
        )
        worker.work(burst=burst, with_scheduler=False)
    finally:
        stop.set()
        runtime.platform.close()
        install(None)
