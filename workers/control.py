"""The TrialControl a platform reports through: every report becomes an event in the log.

A watcher thread follows the trial's commands (the log ids of its cancels and new parameter sets,
indexed as they are appended), so a cancel or a new parameter set reaches the running trial within
milliseconds, without reading the other trials' events. The same thread renews the attempt's lease,
and stops the trial if the attempt was declared lost meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from core.connections import until_redis_answers
from core.event_store import EventStore, StoredEvent
from core.leases import Lease
from core.platform import ParsedMetric, StopRequest
from schemas.events import (
    Event,
    TrialCancelRequested,
    TrialFormUpdated,
    TrialMetricRejected,
    TrialMetricReported,
    TrialStarted,
    TrialSubmitted,
)
from schemas.trial import JobApplicationForm, TrialJobStatus

log = logging.getLogger(__name__)

_WATCH_BLOCK_MS = 250


def _format_seconds(seconds: float) -> str:
    return f"{seconds:g}s"


class LogTrialControl:
    def __init__(self, store: EventStore, submitted: StoredEvent, lease: Lease) -> None:
        assert isinstance(submitted.event, TrialSubmitted)
        self._store = store
        self._submission = submitted.event
        self._trial_id = submitted.event.trial_id
        self._lease = lease
        self._worker = lease.worker
        self._attempt = lease.ref.attempt
        self._cursor = "0-0"  # of the trial's commands stream: every command since its submission
        self._cancel: TrialCancelRequested | None = None
        self._lease_lost = False
        self._renewed_at = time.monotonic()
        self._forms: list[JobApplicationForm] = []
        self._started_at: float | None = None
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._poll()  # a cancel that came before the worker did is seen before launching
        self._watcher = threading.Thread(target=self._watch, name=f"watch-{self._trial_id}", daemon=True)
        self._watcher.start()

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

    def metrics(self, metrics: Sequence[ParsedMetric]) -> None:
        reported = [metric for metric in metrics if metric.metric_type != "REQUEST_PARAMETER"]
        if not reported:
            return
        events: list[Event] = [
            TrialMetricReported(
                experiment_id=self._store.experiment_id,
                trial_id=self._trial_id,
                attempt=self._attempt,
                source=self._worker,
                parameter_id=metric.parameter_id,
                metric_type=metric.metric_type,  # type: ignore[arg-type]
                sequence=metric.sequence,
                data=metric.data,
            )
            for metric in reported
        ]
        idempotency_keys: list[str | None] = [
            f"metric:{self._trial_id}:{self._attempt}:{metric.parameter_id}:{metric.metric_type}:{metric.sequence}"
            for metric in reported
        ]
        until_redis_answers(lambda: self._store.append_all(events, idempotency_keys), f"trial {self._trial_id}")

    def rejected(self, reason: str) -> None:
        log.warning("trial %s: %s", self._trial_id, reason)
        self._append(
            TrialMetricRejected(
                experiment_id=self._store.experiment_id, trial_id=self._trial_id, source=self._worker, reason=reason
            ),
            None,
        )

    # what the platform asks

    def stop_request(self) -> StopRequest | None:
        if self._lease_lost:
            return StopRequest(TrialJobStatus.FAILED, "this attempt was declared lost: its lease expired")
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
        """Stop watching. Not waiting for the watcher (it may be blocked in a read): a renewal that
        still lands after the attempt ended fails harmlessly, as the claim is no longer this worker's."""
        self._closed.set()

    # plumbing

    def _append(self, event: TrialStarted | TrialMetricRejected, key: str | None) -> None:
        until_redis_answers(lambda: self._store.append(event, idempotency_key=key), f"trial {self._trial_id}")

    def _watch(self) -> None:
        while not self._closed.is_set():
            try:
                self._renew_lease()
                self._poll(block_ms=_WATCH_BLOCK_MS)
            except Exception as error:  # the watcher must outlive anything: it renews the lease
                log.warning("trial %s: cannot read the log (%s); retrying", self._trial_id, error)
                self._closed.wait(0.5)

    def _renew_lease(self) -> None:
        """Renew at a third of the lease, so two missed renewals still leave it held."""
        if self._lease_lost or time.monotonic() - self._renewed_at < self._lease.seconds / 3:
            return
        if self._lease.renew():
            self._renewed_at = time.monotonic()
        elif not self._closed.is_set():  # after close the attempt has ended: not lost
            log.warning("trial %s: attempt %d was declared lost; stopping it", self._trial_id, self._attempt)
            self._lease_lost = True
            self._wake.set()

    def _poll(self, block_ms: int | None = None) -> None:
        self._cursor, entries = self._store.trial_commands(self._trial_id, self._cursor, block_ms)
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


def _default_reason(status: TrialJobStatus) -> str:
    return {
        TrialJobStatus.EARLY_STOPPED: "early stopped",
        TrialJobStatus.SYS_CANCELED: "canceled by the system",
    }.get(status, "canceled by the user")
