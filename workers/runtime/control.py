"""The TrialControl a platform reports through: every report becomes an event in the log.

The worker process's one commands reader (workers.runtime.trial_links) follows the trial's commands
(the log ids of its cancels and new parameter sets, indexed as they are appended) with every other
trial's, so a cancel or a new parameter set reaches the running trial within milliseconds, without
reading the other trials' events, and without a connection per trial.

The process's one lease renewer keeps the attempt's lease with the others', on a client whose commands
give up within a fraction of the lease, so no silent server can block it. The trial stops if the attempt
was declared lost, and so does a **local deadline**: a worker that could not renew for `LOCAL_DEADLINE_LEASES` leases
(cut off from Redis by a partition: the reapers may have declared the attempt lost and started its
retry) stops its trial itself. A Redis that refuses connections is down for every reaper too, and
reapers wait for workers after it comes back, so refusals do not count. A retry, in turn, starts
only once the attempt it replaces has surely stopped, so at most one copy of an attempt runs.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence

import redis
from redis.client import Pipeline

from core import keys
from core.connections import until_redis_answers
from core.event_store import CommandsIndex, EventStore, LogEntry, StoredEvent, commands_in_log
from core.leases import AttemptRef, Lease
from core.platform import ParsedMetric, StopRequest
from schemas.compact import compact_metrics
from schemas.events import (
    TrialAttemptLost,
    TrialCancelRequested,
    TrialDeferred,
    TrialFormUpdated,
    TrialMetricRejected,
    TrialStarted,
    TrialSubmitted,
    TrialUnreachable,
    now_ms,
)
from schemas.trial import JobApplicationForm, TrialJobStatus
from workers.runtime.group_commit import Fill
from workers.runtime.trial_links import links

log = logging.getLogger(__name__)

LOCAL_DEADLINE_LEASES = 2.0  # a Redis pause shorter than this many leases does not stop a trial
STOP_MARGIN_S = 6.0  # a trial stopped at its local deadline is gone within this (SIGTERM, 5 s, SIGKILL)


def _format_seconds(seconds: float) -> str:
    return f"{seconds:g}s"


class LogTrialControl:
    """`commands`: the trial's commands stream as its worker read it when claiming the attempt (workers.runtime.job):
    a cancel that came before the worker did is seen before launching."""

    def __init__(self, store: EventStore, submitted: StoredEvent, lease: Lease, commands: CommandsIndex) -> None:
        assert isinstance(submitted.event, TrialSubmitted)
        self._store = store
        self._links = links(store.client, lease.seconds)
        self._quick = self._links.writes
        self._appends = EventStore(self._quick, store.experiment_id)  # gives up on a lost lease
        self._submission = submitted.event
        self._trial_id = submitted.event.trial_id
        self._log = logging.LoggerAdapter(log, {"experiment": store.experiment_id, "trial": self._trial_id})
        self._lease = lease.on(self._quick)  # never blocks long
        self._worker = lease.worker
        self._attempt = lease.ref.attempt
        self._cursor = commands[-1][0] if commands else "0-0"  # of the trial's commands stream
        # The idempotency keys of the last metrics appended: they make a retry of that append (its answer lost)
        # append nothing twice, then go with the next append or the attempt's end. A follower never sends a metric
        # again (re-attached ones resume past the offsets written with it; local trials are never re-attached),
        # so a running trial holds a batch's keys, not one per metric it ever reported.
        self.metric_keys: list[str] = []
        self._reported: str | None = None  # the idempotency key of the last report (`_report`)
        self.offsets_key = keys.read_offsets(store.experiment_id, self._trial_id, lease.ref.attempt)
        self._cancel: TrialCancelRequested | None = None
        self._lease_lost = False
        self._renewed_at = time.monotonic()
        self._forms: list[JobApplicationForm] = []
        self._started_at: float | None = None
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._links.renewer.add(self, self._lease)
        try:
            if commands:
                self.deliver(commands_in_log(store.client, [(store.experiment_id, commands)])[0])
            if self._wait_for_predecessor():
                self._poll()  # and those that came meanwhile
            self._links.reader.follow(self, store.experiment_id, self._trial_id, self._cursor)
        except BaseException:
            self.close()  # no caller holds this control to close it
            raise

    # reports from the platform

    def started(self, working_directory: str, url: str | None = None, gpu_indices: list[int] | None = None) -> None:
        self._started_at = time.monotonic()
        self._append(
            TrialStarted(
                experiment_id=self._store.experiment_id,
                trial_id=self._trial_id,
                attempt=self._attempt,
                source=self._worker,
                working_directory=working_directory,
                url=url,
                gpu_indices=gpu_indices,
            ),
            f"started:{self._trial_id}:{self._attempt}",
        )

    def metrics(self, metrics: Sequence[ParsedMetric], offsets: Mapping[str, int] | None = None) -> None:
        """Appended as TrialMetricReported events at one time, encoded straight from the checked records (no model
        each: a worker handles thousands a second)."""
        reported = [metric for metric in metrics if metric.metric_type != "REQUEST_PARAMETER"]
        if not reported and not offsets:
            return
        prefix = f"metric:{self._trial_id}:{self._attempt}:"
        idempotency_keys = [
            f"{prefix}{metric.parameter_id}:{metric.metric_type}:{metric.sequence}" for metric in reported
        ]
        payloads = compact_metrics(now_ms(), self._worker, self._attempt, reported)
        entries = list(zip(idempotency_keys, payloads, strict=True))
        landed = self.metric_keys  # the last commit's: it returned, so no retry of it comes any more

        def fill(pipe: Pipeline) -> None:
            if entries:
                self._appends.append_metrics(self._trial_id, entries, pipe)
            if offsets:
                pipe.hset(self.offsets_key, mapping={name: str(value) for name, value in offsets.items()})
            if landed:
                pipe.hdel(keys.idempotency(self._store.experiment_id), *landed)

        self._commit(fill)  # safe to repeat: keyed appends
        self.metric_keys = idempotency_keys

    def offsets(self) -> dict[str, int]:
        raw = until_redis_answers(lambda: self._store.client.hgetall(self.offsets_key), f"trial {self._trial_id}")
        return {str(name): int(value) for name, value in raw.items()}

    def unreachable(self, reason: str | None) -> None:
        event = TrialUnreachable(
            experiment_id=self._store.experiment_id,
            trial_id=self._trial_id,
            attempt=self._attempt,
            source=self._worker,
            reason=reason,
        )
        self._report(event, "unreachable")

    def rejected(self, reason: str) -> None:
        self._log.warning("trial %s: %s", self._trial_id, reason)
        event = TrialMetricRejected(
            experiment_id=self._store.experiment_id, trial_id=self._trial_id, source=self._worker, reason=reason
        )
        self._report(event, "rejected")

    def waiting(self, reason: str) -> None:
        event = TrialDeferred(experiment_id=self._store.experiment_id, trial_id=self._trial_id, reason=reason)
        self._report(event, "deferred")

    # what the platform asks

    def stop_request(self) -> StopRequest | None:
        if self._lease_lost:
            return StopRequest(
                TrialJobStatus.FAILED, "this attempt was declared lost: its lease expired", lease_lost=True
            )
        if self._cut_off():
            return StopRequest(
                TrialJobStatus.FAILED,
                f"worker {self._worker} could not renew its lease for {_format_seconds(self._deadline_s)}; "
                "stopped so that it never runs beside a retry",
                lease_lost=True,
            )
        if self._cancel is not None:
            return StopRequest(self._cancel.status, self._cancel.reason or _default_reason(self._cancel.status))
        limit = self._submission.launch.max_duration_seconds
        if limit is not None and self._started_at is not None and time.monotonic() - self._started_at > limit:
            return StopRequest(
                TrialJobStatus.EARLY_STOPPED, f"stopped: exceeded maxTrialDuration of {_format_seconds(limit)}"
            )
        return None

    def new_forms(self) -> list[JobApplicationForm]:
        with self._lock:
            forms, self._forms = self._forms, []
        return forms

    def wait(self, seconds: float) -> None:
        limit = self._submission.launch.max_duration_seconds
        if limit is not None and self._started_at is not None:
            seconds = max(0.0, min(seconds, self._started_at + limit - time.monotonic() + 0.001))
        self._wake.wait(seconds)
        self._wake.clear()

    def wake(self) -> None:
        self._wake.set()

    def close(self) -> None:
        """Stop watching and renewing. Not waiting for the reader and renewer (they may be in a call): a
        renewal that still lands after the attempt ended fails harmlessly, as the claim is no longer this
        worker's, and answers to this control are ignored."""
        self._closed.set()
        self._links.reader.unfollow(self)
        self._links.renewer.remove(self)

    # from the worker's commands reader and lease renewer (workers.runtime.trial_links)

    def deliver(self, entries: list[LogEntry]) -> None:
        """New commands to this trial, in their order."""
        for entry in entries:
            if not isinstance(entry, StoredEvent):
                continue
            event = entry.event
            if isinstance(event, TrialCancelRequested) and self._cancel is None:
                self._cancel = event
                self._wake.set()
            elif isinstance(event, TrialFormUpdated):
                with self._lock:
                    self._forms.append(event.form)
                self._wake.set()

    def not_renewed(self, sent: float, error: redis.RedisError) -> None:
        """The local deadline counts from when the last successful renewal was sent (the server cannot
        have run it earlier), or from the last refusal: Redis is down, so no reaper can act, nor until we renew."""
        if isinstance(error, redis.ConnectionError) and _refused(error):
            self._renewed_at = sent

    def renewed(self, sent: float, renewed: bool) -> bool:
        """A renewal sent at `sent` answered; False once the lease is lost or this control closed."""
        if self._cut_off() and not self._lease_lost:
            self._wake.set()  # already stopping: a late renewal does not undo the local deadline
        if renewed and not self._cut_off():
            self._renewed_at = sent
        elif not renewed and not self._closed.is_set():  # after close the attempt has ended: not lost
            self._log.warning("trial %s: attempt %d was declared lost; stopping it", self._trial_id, self._attempt)
            self._lease_lost = True
            self._wake.set()
            return False
        return not self._closed.is_set()

    # plumbing

    def _commit(self, fill: Fill) -> None:
        """The commands `fill` queues, in one transaction with those other trials of the worker write meanwhile
        (workers.runtime.group_commit); sent again while Redis cannot be reached, up to the local deadline."""
        until_redis_answers(lambda: self._links.commits.write(fill), f"trial {self._trial_id}", self._cut_off)

    def _append(self, event: TrialStarted, key: str) -> None:
        self._commit(lambda pipe: self._appends.append(event, idempotency_key=key, pipeline=pipe))

    def _report(self, event: TrialUnreachable | TrialDeferred | TrialMetricRejected, kind: str) -> None:
        """Append a report the platform makes (unreachable, deferred, a metric rejected) under a key made for it:
        a commit sent again after its answer was lost appends it once, while the same report made later is new.
        The previous report's key goes in the same commit: that one returned, so nothing sends it again, and an
        attempt holds one such key however many reports it makes."""
        key, landed = f"{kind}:{self._trial_id}:{self._attempt}:{uuid.uuid4().hex}", self._reported

        def fill(pipe: Pipeline) -> None:
            self._appends.append(event, idempotency_key=key, pipeline=pipe)
            if landed is not None:
                pipe.hdel(keys.idempotency(self._store.experiment_id), landed)

        self._commit(fill)
        self._reported = key

    @property
    def _deadline_s(self) -> float:
        return LOCAL_DEADLINE_LEASES * self._lease.seconds

    def _cut_off(self) -> bool:
        """Past the local deadline: the reapers may have declared this attempt lost meanwhile."""
        return self._lease_lost or time.monotonic() - self._renewed_at > self._deadline_s

    def _wait_for_predecessor(self) -> bool:
        """A retry waits until the attempt it replaces has surely stopped: declared lost when its
        lease expired, that attempt's worker, if cut off rather than dead, stops it at its local
        deadline, up to `LOCAL_DEADLINE_LEASES - 1` leases later, then needs STOP_MARGIN_S to kill it.
        True if it waited."""
        if self._attempt <= 1:
            return False
        before = AttemptRef(self._store.experiment_id, self._trial_id, self._attempt - 1)
        ended = until_redis_answers(lambda: self._store.read_keyed(before.ended_key), f"trial {self._trial_id}")
        if not (isinstance(ended, StoredEvent) and isinstance(ended.event, TrialAttemptLost)):
            return False  # it ended on its own terms: nothing of it runs
        not_before_ms = int(ended.id.split("-")[0]) + (self._deadline_s - self._lease.seconds + STOP_MARGIN_S) * 1000
        while not self._closed.is_set():
            seconds, microseconds = until_redis_answers(self._store.client.time, f"trial {self._trial_id}")
            left_s = (not_before_ms - (seconds * 1000 + microseconds // 1000)) / 1000
            if left_s <= 0:
                break
            self._closed.wait(min(left_s, 1.0))
        return True

    def _poll(self) -> None:
        self._cursor, entries = self._store.trial_commands(self._trial_id, self._cursor)
        self.deliver(entries)


def _refused(error: redis.ConnectionError) -> bool:
    """Whether the server refused the connection (it is down), rather than not answering."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, (ConnectionRefusedError, FileNotFoundError)):
            return True
        cause = cause.__cause__ or cause.__context__
    return "Connection refused" in str(error)


def _default_reason(status: TrialJobStatus) -> str:
    return {
        TrialJobStatus.EARLY_STOPPED: "early stopped",
        TrialJobStatus.SYS_CANCELED: "canceled by the system",
    }.get(status, "canceled by the user")
