"""NNI's TrainingService interface, over the event log and its views.

Commands append events; queries read the views and fold in any events the projector has not
applied yet, so a read always reflects every write before it (read your writes) even when the
projector lags or is down.
"""

from __future__ import annotations

import gc
import json
import logging
import secrets
import string
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any

import redis
from pydantic import TypeAdapter

from core.event_store import EventStore, StoredEvent
from core.keys import LOG_PREFIX
from core.placement import place
from core.queueing import TrialJob, enqueue, execute_enqueued, submission_key
from manager.projection import apply_to_experiment, apply_to_trial
from manager.views import ViewStore
from schemas.events import (
    PLATFORM_CONFIG,
    TRIAL_CONFIG,
    ClusterMetadataSet,
    Event,
    StopStatus,
    TrialCancelRequested,
    TrialEvent,
    TrialFormUpdated,
    TrialLaunchSpec,
    TrialMetricReported,
    TrialRequeued,
    TrialsRequested,
    TrialSubmitted,
)
from schemas.trial import (
    ExperimentView,
    JobApplicationForm,
    TrialConfig,
    TrialJobDetail,
    TrialJobMetric,
    TrialJobStatus,
)

log = logging.getLogger(__name__)

_TRIAL_ID_ALPHABET = string.ascii_letters + string.digits
CHECKED_IDS = 16  # trial ids drawn and checked against the log at a time

PARSED_VIEWS_KEPT = 20_000
_TRIAL_VIEWS = TypeAdapter(list[TrialJobDetail])
VIEWS_PER_PARSE = 500  # views validated per pydantic-core call (`_parse_trial_views`)
MetricListener = Callable[[TrialJobMetric], None]


@dataclass
class _Tail:
    """The log after the projection's position `base`, read up to `upto`, by trial: kept between reads."""

    base: str
    upto: str = ""
    trial_events: dict[str, list[Event]] = field(default_factory=dict)
    experiment_events: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.upto = self.upto or self.base


class TrialNotFound(LookupError):
    def __init__(self, experiment_id: str, trial_id: str) -> None:
        super().__init__(f"trial {trial_id!r} not found in experiment {experiment_id}")


class MissingClusterMetadata(LookupError):
    pass


class TrainingService:
    def __init__(
        self,
        client: redis.Redis,
        rq_connection: redis.Redis,
        experiment_id: str,
        namespace: str = LOG_PREFIX,
    ) -> None:
        self.experiment_id = experiment_id
        self.store = EventStore(client, experiment_id)
        self.views = ViewStore(client, experiment_id, namespace)
        self._client = client
        self._rq_connection = rq_connection
        self._listeners: list[MetricListener] = []
        self._stopped = threading.Event()
        self._parsed: dict[str, TrialJobDetail] = {}  # view JSON -> the view (frozen, so safe to hand out again)
        self._tail = _Tail("0-0")
        self._tail_lock = threading.Lock()
        self._free_ids: list[str] = []  # trial ids checked unused (`_new_trial_id`)
        self._ids_lock = threading.Lock()

    # queries

    def list_trial_jobs(self) -> list[TrialJobDetail]:
        position, trials = self._snapshot(None)
        self._fold_tail(trials, position, None)
        return sorted(trials.values(), key=attrgetter("sequence_id"))

    def get_trial_job(self, trial_id: str) -> TrialJobDetail:
        return self.get_trial_jobs([trial_id])[0]

    def get_trial_jobs(self, trial_ids: list[str]) -> list[TrialJobDetail]:
        """Several trials, in one read of the views and one of the log."""
        position, trials = self._snapshot(trial_ids)
        wanted = set(trial_ids)
        self._fold_tail(trials, position, wanted)
        missing = wanted.difference(trials)
        if missing:
            raise TrialNotFound(self.experiment_id, sorted(missing)[0])
        return [trials[trial_id] for trial_id in trial_ids]

    def get_cluster_metadata(self, key: str) -> str:
        return _metadata(self.experiment_view(), key)

    @property
    def is_multi_phase_job_supported(self) -> bool:
        return True

    # commands

    def set_cluster_metadata(self, key: str, value: str) -> None:
        self.store.append(ClusterMetadataSet(experiment_id=self.experiment_id, key=key, value=value))

    def submit_trial_job(self, form: JobApplicationForm, requested_by: str | None = None) -> TrialJobDetail:
        """A new trial: its submission made and written (see `submission` and `submit`)."""
        return self.submit(self.submission(form, requested_by))

    def submission(
        self, form: JobApplicationForm, requested_by: str | None = None, experiment: ExperimentView | None = None
    ) -> TrialSubmitted:
        """The TrialSubmitted of a new trial, not yet written: a new id, the experiment's trial config, and the
        platform it goes to (a hybrid experiment's trial to the listed one `core.placement` picks).
        `requested_by`: the CustomizedTrialRequested event a customized trial answers. `experiment`: its view as the
        caller folded it (a runner, from the log it follows), rather than read from Redis."""
        if experiment is None:
            experiment = self.experiment_view()
        trial_config = TrialConfig.model_validate_json(_metadata(experiment, TRIAL_CONFIG))
        training_service = json.loads(_metadata(experiment, PLATFORM_CONFIG))
        sections: list[dict[str, Any]] = training_service if isinstance(training_service, list) else [training_service]
        platform = place(self._client, self._rq_connection, self.experiment_id, [s["platform"] for s in sections])
        platform_section = next(section for section in sections if section["platform"] == platform)
        trial_id = self._new_trial_id()
        return TrialSubmitted(
            experiment_id=self.experiment_id,
            trial_id=trial_id,
            platform=platform,
            form=form,
            working_directory=str(Path(experiment.working_directory) / "trials" / trial_id),
            launch=TrialLaunchSpec(
                command=trial_config.command,
                code_directory=trial_config.code_directory,
                platform_config=platform_section,
                gpu_number=trial_config.gpu_number,
                max_duration_seconds=trial_config.max_trial_duration,
                max_retries=trial_config.max_retries,
                platform_configs=sections if len(sections) > 1 else None,
            ),
            requested_by=requested_by,
        )

    def submit(self, submission: TrialSubmitted, preceded_by: TrialsRequested | None = None) -> TrialJobDetail:
        """Append the submission and enqueue its job in one MULTI/EXEC: both happen or neither (a refused append,
        past the store's fence say, raises with its job withdrawn: core.queueing.execute_enqueued). Sent again, it
        is appended once (its idempotency key is its trial's), so a runner may send again one the log lost.
        `preceded_by`: a runner's request to its tuner, appended right before it in the same script."""
        job = TrialJob(submission.platform, self.experiment_id, submission.trial_id, 1)
        with self._client.pipeline(transaction=True) as pipe:
            pipe.multi()
            key = submission_key(submission.trial_id)
            queued = enqueue(
                pipe, self._rq_connection, self.store, submission, [job], idempotency_key=key, preceded_by=preceded_by
            )
            execute_enqueued(pipe, queued)
        view = apply_to_trial(None, submission)
        assert view is not None
        return view

    def update_trial_job(self, trial_id: str, form: JobApplicationForm) -> TrialJobDetail:
        self.get_trial_job(trial_id)
        self.store.append(TrialFormUpdated(experiment_id=self.experiment_id, trial_id=trial_id, form=form))
        return self.get_trial_job(trial_id)

    def cancel_trial_job(self, trial_id: str, is_early_stopped: bool = False) -> None:
        if is_early_stopped:
            self.request_stop(trial_id, TrialJobStatus.EARLY_STOPPED)
        else:
            self.request_stop(trial_id, TrialJobStatus.USER_CANCELED)

    def request_stop(self, trial_id: str, status: StopStatus, reason: str | None = None) -> None:
        """Ask the trial's worker to stop it; a trial that has already ended is left as it is."""
        if self.get_trial_job(trial_id).status.is_terminal:
            return
        self.store.append(
            TrialCancelRequested(experiment_id=self.experiment_id, trial_id=trial_id, status=status, reason=reason),
        )

    def requeue(self, trial: TrialJobDetail, reason: str) -> None:
        """Queue the trial's current attempt again (its job was lost); a needless re-queue is harmless,
        since only one delivery can claim the attempt."""
        job = TrialJob(trial.platform, self.experiment_id, trial.id, trial.attempt)
        record = TrialRequeued(
            experiment_id=self.experiment_id, trial_id=trial.id, attempt=trial.attempt, reason=reason
        )
        with self._client.pipeline(transaction=True) as pipe:
            pipe.multi()
            execute_enqueued(pipe, enqueue(pipe, self._rq_connection, self.store, record, [job]))

    # metric listeners and the main loop

    def add_trial_job_metric_listener(self, listener: MetricListener) -> None:
        self._listeners.append(listener)

    def remove_trial_job_metric_listener(self, listener: MetricListener) -> None:
        self._listeners.remove(listener)

    def run(self) -> None:
        """Deliver every metric of the experiment to the listeners, once each, until clean_up()."""
        cursor = "0-0"
        seen: set[tuple[str, int, str, str, int]] = set()
        while not self._stopped.is_set():
            for entry in self.store.wait(cursor, block_ms=200):
                cursor = entry.id
                if isinstance(entry, StoredEvent) and isinstance(entry.event, TrialMetricReported):
                    event = entry.event
                    key = (event.trial_id, event.attempt, event.parameter_id, event.metric_type, event.sequence)
                    if key in seen:
                        continue
                    seen.add(key)
                    metric = TrialJobMetric(id=event.trial_id, data=event.data)
                    for listener in list(self._listeners):
                        listener(metric)

    def clean_up(self) -> None:
        """Stop every trial that has not ended (SYS_CANCELED) and end run()."""
        for trial in self.list_trial_jobs():
            if not trial.status.is_terminal:
                self.request_stop(trial.id, TrialJobStatus.SYS_CANCELED, "experiment stopped")
        self._stopped.set()

    # helpers

    def _snapshot(self, trial_ids: list[str] | None) -> tuple[str, dict[str, TrialJobDetail]]:
        """Projection position and views (all trials', or those of `trial_ids`) read in one transaction,
        so they agree with each other."""
        with self._client.pipeline(transaction=True) as pipe:
            pipe.hget(self.views.keys.position, "position")
            if trial_ids is None:
                pipe.hvals(self.views.keys.trials)
            else:
                pipe.hmget(self.views.keys.trials, trial_ids)
            position, raws = pipe.execute()
        trials = self._parse_views([raw for raw in raws if raw], whole=trial_ids is None)
        return position or "0-0", {trial.id: trial for trial in trials}

    def _parse_views(self, raws: list[str], whole: bool) -> list[TrialJobDetail]:
        """Parse views, reusing those parsed before whose JSON has not changed since: parsing is most of the
        cost of listing 10k trials, and most views stop changing once their trial has ended. A whole list
        replaces the memo, so it holds what the views hold now; it never holds more than PARSED_VIEWS_KEPT
        views."""
        memo = self._parsed
        fresh = {raw: memo[raw] for raw in raws if raw in memo}
        unparsed = [raw for raw in raws if raw not in fresh]
        fresh.update(zip(unparsed, _parse_trial_views(unparsed), strict=True))
        trials = [fresh[raw] for raw in raws]
        if whole:
            self._parsed = fresh if len(fresh) <= PARSED_VIEWS_KEPT else {}
        elif len(memo) + len(fresh) <= PARSED_VIEWS_KEPT:
            memo.update(fresh)
        else:  # full of views that have changed since: start again from these
            self._parsed = fresh
        return trials

    def _fold_tail(self, trials: dict[str, TrialJobDetail], position: str, wanted: set[str] | None) -> None:
        """Fold into `trials` the events of the trials `wanted` (all, for None) after `position`."""
        with self._tail_lock:  # the manager's threads share this service: take the events under the lock
            tail = self._tail_after(position)
            if wanted is None:
                picked = [(trial_id, list(events)) for trial_id, events in tail.trial_events.items()]
            else:
                found = wanted.intersection(tail.trial_events)
                picked = [(trial_id, list(tail.trial_events[trial_id])) for trial_id in found]
        for trial_id, events in picked:
            view: TrialJobDetail | None = trials.get(trial_id)
            for event in events:
                view = apply_to_trial(view, event)
            if view is not None:
                trials[trial_id] = view

    def _tail_after(self, position: str) -> _Tail:
        """The events after the projection's `position`, read from the log once: while the projector lags or
        is down, each read fetches and decodes only what was appended since the last one. Called with
        `_tail_lock` held, since the next read appends to what it returns."""
        if self._tail.base != position:
            self._tail = _Tail(position)
        tail = self._tail
        for entry in self.store.read(after=tail.upto):
            tail.upto = entry.id
            if isinstance(entry, StoredEvent) and isinstance(entry.event, TrialEvent):
                tail.trial_events.setdefault(entry.event.trial_id, []).append(entry.event)
            elif isinstance(entry, StoredEvent):
                tail.experiment_events.append(entry.event)
        return tail

    def experiment_view(self) -> ExperimentView:
        with self._client.pipeline(transaction=True) as pipe:  # one round trip, and a consistent pair
            pipe.hget(self.views.keys.position, "position")
            pipe.hget(self.views.keys.experiment, "view")
            position, raw = pipe.execute()
        view = ExperimentView.model_validate_json(raw) if raw else None
        with self._tail_lock:
            events = list(self._tail_after(position or "0-0").experiment_events)
        for event in events:
            view = apply_to_experiment(view, event)
        if view is None:
            raise LookupError(f"experiment {self.experiment_id} has no ExperimentCreated event")
        return view

    def _new_trial_id(self) -> str:
        """Five letters and digits, as NNI's; checked against the log so ids never collide. Drawn and checked
        CHECKED_IDS at a time, in one round trip: a runner's submission, on the way from a freed slot to the next
        trial's start, does not wait for a check of its own."""
        with self._ids_lock:
            while not self._free_ids:
                drawn = list({_random_trial_id() for _ in range(CHECKED_IDS)})
                taken = self.store.has_keys([submission_key(trial_id) for trial_id in drawn])
                self._free_ids = [trial_id for trial_id, used in zip(drawn, taken, strict=True) if not used]
            return self._free_ids.pop()


def _random_trial_id() -> str:
    return "".join(secrets.choice(_TRIAL_ID_ALPHABET) for _ in range(5))


def _parse_trial_views(raws: list[str]) -> list[TrialJobDetail]:
    """Validate views as JSON arrays of VIEWS_PER_PARSE in pydantic-core: TrialJobDetail's validation, as view by
    view, without intermediate dicts or a call per view. Not all in one array: pydantic-core parses a whole array
    before validating it, and for 10k views that parse took ~50 MB of fresh memory, whose ~12k page faults were a
    third of a process's first list (117 ms against 75 ms in arrays of 500, each reusing the last one's memory).

    The cyclic garbage collector stays out of it. 10k views are ~110k container objects (models, their dicts
    and field sets, lists): allocating them set off ~170 young collections and a full one, half the time of a
    first list. They hold no cycles (refcounting frees them) and live as long as the memo, so they go straight
    to the oldest generation, as if they had survived the young ones (freeze then unfreeze moves every tracked
    object there in O(1); without it, the first collection after the parse would scan them all). A process
    that froze its heap on purpose keeps it frozen, and pays that one collection."""
    if not raws:
        return []
    enabled = gc.isenabled()
    gc.disable()
    try:
        views: list[TrialJobDetail] = []
        for start in range(0, len(raws), VIEWS_PER_PARSE):
            views += _TRIAL_VIEWS.validate_json("[" + ",".join(raws[start : start + VIEWS_PER_PARSE]) + "]")
        return views
    finally:
        if gc.get_freeze_count() == 0:
            gc.freeze()
            gc.unfreeze()
        if enabled:
            gc.enable()


def _metadata(experiment: ExperimentView, key: str) -> str:
    value = experiment.metadata.get(key)
    if value is None:
        raise MissingClusterMetadata(f"cluster metadata {key!r} has not been set for experiment {experiment.id}")
    return value
