"""An experiment's log as a timeline: where and when each attempt ran, what became of it, and the trial views
at every point of the log.

`Timeline` folds log entries, in order and incrementally (a live experiment's new entries are fed as they
come). The views at a point come from the projection's own fold (`apply_to_trial`), recorded each time a
trial's status, attempt or final metric changes, so a cursor on the page shows what `replay --until` shows.
Times are the entries' ids (the log's order; `replay --until TIME` reads them the same way), never the
clocks of the processes that wrote the events.

Intermediate metrics are most of a big log and change no view: they are counted and timed per attempt from
their JSON alone, without building the event. Everything here is data in memory; reading the log is the
caller's (manager.api.timeline, manager.cli.timeline), and so is keeping the fold as the log grows: the
projector writes `header`, each trial's `kept` state and packed entries, and a reader makes the fold `restored`
from them (manager.timeline_views).
"""

from __future__ import annotations

import json
import re
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any
from urllib.parse import urlsplit

from core.event_store import LogEntry, PeriodicalMetric, StoredEvent, decode_entry, stream_position
from manager.algorithms import optimize_mode_of
from manager.projection import apply_to_experiment, apply_to_trial
from schemas.compact import periodical_attempt
from schemas.config import ExperimentConfig
from schemas.events import (
    Event,
    ExperimentCreated,
    ExperimentFinished,
    ExperimentImported,
    ExperimentResumed,
    ExperimentStopRequested,
    ExperimentUpdated,
    TrialAttemptLost,
    TrialCancelRequested,
    TrialEnded,
    TrialEvent,
    TrialMetricReported,
    TrialReattached,
    TrialsRequested,
    TrialStarted,
    TrialSubmitted,
    TrialUnreachable,
    TunerDataImported,
    TunerNoMoreTrials,
)
from schemas.trial import ExperimentView, MetricRecord, TrialJobDetail, TrialJobStatus

MAX_ATTEMPTS = 2000  # a window with more attempts than this is sent as clusters
MAX_MARKERS = 5000  # trial markers (metrics, cancels) sent for one window at most
CLUSTER_GAP_PX = 3  # bars of one lane closer than this many pixels merge into one cluster
LOST = "LOST"
_PERIODICAL = '"metricType":"PERIODICAL"'
_ATTEMPT = re.compile(r'"attempt":(\d+)')


@dataclass(frozen=True)
class Lane:
    """Where attempts ran: a platform's worker (on a host or node, when the platform says which)."""

    id: int
    platform: str
    worker: str | None
    host: str | None

    @property
    def label(self) -> str:
        if self.worker is None:
            return f"{self.platform} · not started"
        return " · ".join(part for part in (self.platform, self.host, f"worker {self.worker}") if part)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "label": self.label, "platform": self.platform, "worker": self.worker, "host": self.host}


@dataclass
class Segment:
    lane: int
    start: int
    end: int | None = None


@dataclass
class Attempt:
    """One attempt of a trial: waiting from `submitted`, then running in one segment per worker that followed it."""

    trial: str
    number: int
    platform: str
    submitted: int
    order: int  # created as the experiment's order-th attempt: the order attempts are listed in
    retry_of: str | None = None
    started: int | None = None
    ended: int | None = None
    outcome: str | None = None  # how it ended: a terminal status or LOST
    message: str | None = None
    segments: list[Segment] = field(default_factory=list)
    unknown: list[list[int | None]] = field(default_factory=list)
    metric_times: array[int] = field(default_factory=lambda: array("q"))  # PERIODICAL reports
    marks: list[tuple[int, str]] = field(default_factory=list)  # FINAL metrics, cancels, early stops

    @property
    def key(self) -> str:
        return f"{self.trial}/{self.number}"

    @property
    def state(self) -> str:
        if self.outcome is not None:
            return self.outcome
        if self.unknown and self.unknown[-1][1] is None:
            return str(TrialJobStatus.UNKNOWN)
        return str(TrialJobStatus.RUNNING if self.started is not None else TrialJobStatus.WAITING)

    def span(self, head: int) -> tuple[int, int]:
        return self.submitted, self.ended if self.ended is not None else head

    def close(self, at: int, outcome: str, message: str | None) -> None:
        self.ended, self.outcome, self.message = at, outcome, message
        if self.segments and self.segments[-1].end is None:
            self.segments[-1].end = at
        if self.unknown and self.unknown[-1][1] is None:
            self.unknown[-1][1] = at

    def markers(self, start: int, end: int) -> list[list[Any]]:
        low, high = bisect_left(self.metric_times, start), bisect_right(self.metric_times, end)
        periodical = [[at, "PERIODICAL"] for at in self.metric_times[low:high]]
        return periodical + [[at, kind] for at, kind in self.marks if start <= at <= end]

    def marker_count(self, start: int, end: int) -> int:
        low, high = bisect_left(self.metric_times, start), bisect_right(self.metric_times, end)
        return high - low + sum(1 for at, _ in self.marks if start <= at <= end)

    def kept(self) -> dict[str, Any]:
        """All but its metric times (those are its trial's entries'): what the projector keeps of it."""
        return {
            "number": self.number,
            "platform": self.platform,
            "submitted": self.submitted,
            "order": self.order,
            "retryOf": self.retry_of,
            "started": self.started,
            "ended": self.ended,
            "outcome": self.outcome,
            "message": self.message,
            "segments": [[s.lane, s.start, s.end] for s in self.segments],
            "unknown": self.unknown,
            "marks": self.marks,
        }

    @classmethod
    def from_kept(cls, trial: str, state: dict[str, Any]) -> Attempt:
        attempt = cls(trial, state["number"], state["platform"], state["submitted"], state["order"])
        attempt.retry_of, attempt.started, attempt.ended = state["retryOf"], state["started"], state["ended"]
        attempt.outcome, attempt.message, attempt.unknown = state["outcome"], state["message"], state["unknown"]
        attempt.segments = [Segment(*segment) for segment in state["segments"]]
        attempt.marks = [(at, kind) for at, kind in state["marks"]]
        return attempt

    def to_json(self, markers: list[list[Any]]) -> dict[str, Any]:
        return {
            "key": self.key,
            "trial": self.trial,
            "attempt": self.number,
            "outcome": self.state,
            "submitted": self.submitted,
            "started": self.started,
            "ended": self.ended,
            "segments": [{"lane": s.lane, "from": s.start, "to": s.end} for s in self.segments],
            "unknown": self.unknown,
            "retryOf": self.retry_of,
            "message": self.message,
            "metrics": len(self.metric_times) + sum(1 for _, kind in self.marks if kind == "FINAL"),
            "events": markers,
        }


@dataclass
class _Trial:
    folded_view: TrialJobDetail | str  # the view, or its JSON as read back: parsed when first needed
    attempts: list[Attempt]
    changes: list[list[Any]]  # [entry id, status, attempt, final metric score]
    entry_ms: array[int] = field(default_factory=lambda: array("q"))  # its entries' ids, for its history
    entry_seq: array[int] = field(default_factory=lambda: array("q"))
    entry_metric: array[int] = field(default_factory=lambda: array("q"))  # the attempt of an intermediate metric; 0
    kept_entries: bytes = b""  # `packed_entries` read back (up to `kept_head`), unpacked when first asked for
    kept_head: tuple[int, int] = (0, 0)
    scored: tuple[list[MetricRecord], float | None] | None = None  # the final metrics scored last, and their score

    @property
    def view(self) -> TrialJobDetail:
        if isinstance(self.folded_view, str):
            self.folded_view = TrialJobDetail.model_validate_json(self.folded_view)
        return self.folded_view

    def score(self) -> float | None:
        """The view's final metric score, decoded once for each list of final metrics (a fold that adds one, or
        starts an attempt again, makes a new list; its other changes keep the list)."""
        finals = self.view.final_metric_data
        if self.scored is None or self.scored[0] is not finals:
            self.scored = (finals, self.view.final_score)
        return self.scored[1]

    def record(self, position: tuple[int, int], metric_attempt: int = 0) -> None:
        self.entry_ms.append(position[0])
        self.entry_seq.append(position[1])
        self.entry_metric.append(metric_attempt)

    def entry_ids(self) -> list[str]:
        self.unpacked()
        return [f"{ms}-{seq}" for ms, seq in zip(self.entry_ms, self.entry_seq, strict=True)]

    def kept(self) -> dict[str, Any]:
        return {"attempts": [attempt.kept() for attempt in self.attempts], "changes": self.changes}

    def packed_entries(self) -> bytes:
        """Its entries folded here, 16 bytes each (ms; seq << 16 | metric attempt): appended to as the log grows."""
        packed = array("q", bytes(16 * len(self.entry_ms)))
        packed[0::2] = self.entry_ms
        tags = [seq << 16 | metric for seq, metric in zip(self.entry_seq, self.entry_metric, strict=True)]
        packed[1::2] = array("q", tags)
        return packed.tobytes()

    def unpacked(self) -> None:
        """Unpack the entries read back (cut at `kept_head`: a reader may see appends past it) in front of those
        folded since, and its attempts' metric times likewise: a first look at a long log unpacks none."""
        if not self.kept_entries:
            return
        packed = array("q")
        packed.frombytes(self.kept_entries)
        self.kept_entries = b""
        ms, tags = packed[0::2], packed[1::2]
        keep = len(ms)
        while keep and (ms[keep - 1], tags[keep - 1] >> 16) > self.kept_head:
            keep -= 1
        ms, tags = ms[:keep], tags[:keep]
        metric = array("q", [tag & 0xFFFF for tag in tags])
        self.entry_ms = ms + self.entry_ms
        self.entry_seq = array("q", [tag >> 16 for tag in tags]) + self.entry_seq
        self.entry_metric = metric + self.entry_metric
        for attempt in self.attempts:
            number, times = attempt.number, zip(ms, metric, strict=True)
            attempt.metric_times = array("q", [at for at, n in times if n == number]) + attempt.metric_times


class Timeline:
    """The fold; feed it entries (id, fields) in log order, ask it for windows and views."""

    def __init__(self, experiment_id: str) -> None:
        self.experiment_id = experiment_id
        self.head = "0-0"
        self.start: int | None = None
        self.end = 0
        self.experiment: ExperimentView | None = None
        self.experiment_changes: list[list[str]] = []
        self.lanes: dict[tuple[str, str | None, str | None], Lane] = {}
        self._lane_list: list[Lane] = []  # by id
        self.trials: dict[str, _Trial] = {}
        self.attempts: list[Attempt] = []
        self.attempt_count = 0  # attempts created: more than `attempts` holds in a projector's partial fold
        self.markers: list[dict[str, Any]] = []

    # keeping it: what the projector writes as the log grows (manager.timeline_views), and reads back

    def header(self) -> dict[str, Any]:
        """The fold's own state but its trials and markers."""
        return {
            "head": self.head,
            "start": self.start,
            "end": self.end,
            "attempts": self.attempt_count,
            "lanes": [[lane.platform, lane.worker, lane.host] for lane in self._lane_list],
            "experimentChanges": self.experiment_changes,
        }

    @classmethod
    def restored(
        cls,
        experiment_id: str,
        header: dict[str, Any],
        experiment: ExperimentView | None,
        markers: list[dict[str, Any]],
        trials: Iterable[tuple[str, TrialJobDetail | str, dict[str, Any], bytes]],
    ) -> Timeline:
        """The fold as `header` and each trial's (id, view or its JSON, state, packed entries) say: every trial's, or
        (for the projector, which appends new entries and markers) only the ones a batch names, with no entries."""
        timeline = cls(experiment_id)
        timeline.head, timeline.start, timeline.end = header["head"], header["start"], header["end"]
        timeline.attempt_count, timeline.experiment_changes = header["attempts"], header["experimentChanges"]
        for platform, worker, host in header["lanes"]:
            timeline._lane(platform, host, worker)
        timeline.experiment, timeline.markers = experiment, markers
        head = stream_position(timeline.head)
        for trial_id, view, state, packed in trials:
            attempts = [Attempt.from_kept(trial_id, attempt) for attempt in state["attempts"]]
            trial = timeline.trials[trial_id] = _Trial(view, attempts, state["changes"])
            trial.kept_entries, trial.kept_head = packed, head
            timeline.attempts.extend(attempts)
        timeline.attempts.sort(key=lambda attempt: attempt.order)
        return timeline

    # folding

    def feed(
        self,
        entries: Iterable[tuple[str, dict[str, str]]],
        decoded: Iterable[LogEntry | PeriodicalMetric] | None = None,
        views_after: Mapping[str, TrialJobDetail | None] | None = None,
    ) -> int:
        """Fold entries that follow the head (others are skipped: a re-read overlap is harmless). When the caller
        has them: `decoded`, the same entries decoded, and `views_after`, the trial view after each trial event it
        folded onto the views this fold holds, by entry id (the projector's own fold, not done twice)."""
        count = 0
        head = stream_position(self.head)
        known: Iterable[LogEntry | PeriodicalMetric | None] = repeat(None) if decoded is None else decoded
        views_after = views_after or {}
        trials = self.trials
        for (entry_id, fields), entry in zip(entries, known, strict=False):
            ms, _, seq = entry_id.partition("-")
            position = (int(ms), int(seq))
            if position <= head:
                continue
            head = position
            self.head, self.end = entry_id, position[0]
            if self.start is None:
                self.start = position[0]
            count += 1
            if type(entry) is PeriodicalMetric and (trial := trials.get(entry.trial_id)) is not None:
                # most entries of a projector's batch: what _fold does with them, spelled out (_metric_time inline
                # for the latest attempt's)
                trial.entry_ms.append(position[0])
                trial.entry_seq.append(position[1])
                latest = trial.attempts[-1]
                if latest.number == entry.attempt:
                    latest.metric_times.append(position[0])
                    trial.entry_metric.append(latest.number)
                else:
                    trial.entry_metric.append(_metric_time(trial, entry.attempt, position[0]))
            else:
                self._fold(entry_id, position, fields, entry, views_after)
        return count

    def _fold(
        self,
        entry_id: str,
        position: tuple[int, int],
        fields: dict[str, str],
        entry: LogEntry | PeriodicalMetric | None,
        views_after: Mapping[str, TrialJobDetail | None],
    ) -> None:
        trial = self.trials.get(fields.get("trial", ""))
        if trial is not None:
            if isinstance(entry, PeriodicalMetric):
                periodical, number = True, entry.attempt
            elif entry is None:  # read off the JSON, without building the event
                raw = fields.get("json", "")
                if fields.get("type") != "TrialMetricReported":
                    periodical, number = False, None
                elif raw.startswith("["):  # the compact form
                    number = _compact_attempt(raw)
                    periodical = number is not None
                else:
                    periodical = _PERIODICAL in raw
                    found = _ATTEMPT.search(raw) if periodical else None
                    number = int(found.group(1)) if found else None
            else:
                event = entry.event if isinstance(entry, StoredEvent) else None
                periodical = isinstance(event, TrialMetricReported) and event.metric_type == "PERIODICAL"
                number = event.attempt if isinstance(event, TrialMetricReported) else None
            if periodical:  # changes no view (the projection's own rule)
                trial.entry_ms.append(position[0])
                trial.entry_seq.append(position[1])
                trial.entry_metric.append(_metric_time(trial, number, position[0]))
                return
            trial.record(position)
        entry = entry or decode_entry(entry_id, fields, self.experiment_id)
        if not isinstance(entry, StoredEvent):
            return  # unreadable: never applied, as the projector does
        event = entry.event
        try:
            if isinstance(event, TrialEvent):
                self._trial_event(entry_id, position, event, views_after)
            else:
                self._experiment_event(entry_id, position[0], event)
        except Exception:
            return

    def _experiment_event(self, entry_id: str, at: int, event: Event) -> None:
        before = self.experiment.status if self.experiment else None
        self.experiment = apply_to_experiment(self.experiment, event)
        if self.experiment is not None and self.experiment.status != before:
            self.experiment_changes.append([entry_id, self.experiment.status])
        text = _marker_text(event)
        if isinstance(event, ExperimentResumed) and before == "RUNNING":
            text = "taken over: its runner had stopped without ending it (crashed, or lost its claim)"
        if text is not None:
            self.markers.append({"id": entry_id, "time": at, "kind": event.type, "text": text})

    def _trial_event(
        self,
        entry_id: str,
        position: tuple[int, int],
        event: TrialEvent,
        views_after: Mapping[str, TrialJobDetail | None],
    ) -> None:
        trial = self.trials.get(event.trial_id)
        at = position[0]
        if trial is None:
            if not isinstance(event, TrialSubmitted):
                return  # before its submission: no view (projection's own rule)
            view = views_after[entry_id] if entry_id in views_after else apply_to_trial(None, event)
            assert view is not None
            trial = self.trials[event.trial_id] = _Trial(view, [], [])
            self._new_attempt(trial, Attempt(event.trial_id, 1, view.platform, at, self.attempt_count))
            trial.record(position)
            self._changed(trial, entry_id)
            return
        self._attempt_event(trial, at, event)
        view = views_after[entry_id] if entry_id in views_after else apply_to_trial(trial.view, event)  # type: ignore[arg-type]
        if view is not None and view is not trial.view:
            trial.folded_view = view
            self._changed(trial, entry_id)

    def _changed(self, trial: _Trial, entry_id: str) -> None:
        view = trial.view
        row = [entry_id, str(view.status), view.attempt, trial.score()]
        if not trial.changes or trial.changes[-1][1:] != row[1:]:
            trial.changes.append(row)

    def _attempt_event(self, trial: _Trial, at: int, event: TrialEvent) -> None:
        number = getattr(event, "attempt", None)
        attempt = next((a for a in reversed(trial.attempts) if a.number == number), trial.attempts[-1])
        match event:
            case TrialStarted() if attempt.started is None and attempt.ended is None:
                attempt.started = at
                attempt.segments.append(Segment(self._lane(trial.view.platform, _host(event.url), event.source), at))
            case TrialReattached() if attempt.ended is None and attempt.segments:
                self._reattached(attempt, at, event.source)
            case TrialUnreachable() if attempt.ended is None:
                _unreachable(attempt, at, event.reason)
            case TrialMetricReported() if event.metric_type == "FINAL":
                attempt.marks.append((at, "FINAL"))
            case TrialMetricReported():  # an intermediate one whose JSON the fast path missed
                trial.entry_metric[-1] = _metric_time(trial, event.attempt, at)
            case TrialCancelRequested() if trial.attempts[-1].ended is None:
                early = event.status is TrialJobStatus.EARLY_STOPPED
                trial.attempts[-1].marks.append((at, "early stop" if early else "cancel"))
            case TrialEnded() if attempt.ended is None:
                self._end(attempt, at, str(event.status), event.message)
            case TrialAttemptLost() if attempt.ended is None:
                self._end(attempt, at, LOST, event.reason)
                if event.status is TrialJobStatus.WAITING:
                    platform = event.retry_platform or attempt.platform
                    retry = Attempt(trial.view.id, attempt.number + 1, platform, at, self.attempt_count)
                    retry.retry_of = attempt.key
                    self._new_attempt(trial, retry)

    def _new_attempt(self, trial: _Trial, attempt: Attempt) -> None:
        trial.attempts.append(attempt)
        self.attempts.append(attempt)
        self.attempt_count += 1

    def _reattached(self, attempt: Attempt, at: int, worker: str) -> None:
        """Another worker follows the attempt now: a new segment in its lane (same host)."""
        current = attempt.segments[-1]
        lane = self._lane(attempt.platform, self._lane_list[current.lane].host, worker)
        if lane != current.lane:
            current.end = at
            attempt.segments.append(Segment(lane, at))

    def _end(self, attempt: Attempt, at: int, outcome: str, message: str | None) -> None:
        attempt.close(at, outcome, message)
        if not attempt.segments:  # never started: drawn in its platform's "not started" lane
            attempt.segments.append(Segment(self._lane(attempt.platform, None, None), attempt.submitted, at))

    def _lane(self, platform: str, host: str | None, worker: str | None) -> int:
        key = (platform, host, worker)
        lane = self.lanes.get(key)
        if lane is None:
            lane = self.lanes[key] = Lane(len(self._lane_list), platform, worker, host)
            self._lane_list.append(lane)
        return lane.id

    # answers

    @property
    def optimize_mode(self) -> str:
        try:
            config = ExperimentConfig.model_validate(self.experiment.config if self.experiment else {})
        except ValueError:
            return "maximize"
        return optimize_mode_of(config.tuner_section)

    @property
    def live(self) -> bool:
        return self.experiment is not None and self.experiment.status == "RUNNING"

    def window(
        self,
        start: int | None = None,
        end: int | None = None,
        px: int = 1200,
        cluster: bool = True,
        max_markers: int = MAX_MARKERS,
    ) -> Any:
        """The attempts and markers between `start` and `end` (the whole span by default), as clusters when
        more attempts overlap it than a page should draw one by one (unless not to `cluster`), and the trial
        markers unless there are more than `max_markers` of them."""
        first = self.start or 0
        start = first if start is None else start
        end = self.end if end is None else end
        overlapping = [a for a in self.attempts if _overlaps(a.span(self.end), start, end)]
        answer: dict[str, Any] = {
            "experimentId": self.experiment_id,
            "status": self.experiment.status if self.experiment else None,
            "optimizeMode": self.optimize_mode,
            "start": first,
            "end": self.end,
            "head": self.head,
            "live": self.live,
            "window": {"from": start, "to": end},
            "lanes": [lane.to_json() for lane in self._all_lanes()],
            "attempts": [],
            "clusters": [],
            "markers": [m for m in self.markers if start <= m["time"] <= end],
            "markersOmitted": 0,
        }
        if cluster and len(overlapping) > MAX_ATTEMPTS:
            answer["clusters"] = self._clusters(overlapping, max(1, (end - start) * CLUSTER_GAP_PX // max(px, 1)))
            return answer
        for attempt in overlapping:
            self.trials[attempt.trial].unpacked()
        marks = sum(a.marker_count(start, end) for a in overlapping)
        keep_marks = marks <= max_markers
        answer["markersOmitted"] = 0 if keep_marks else marks
        answer["attempts"] = [a.to_json(a.markers(start, end) if keep_marks else []) for a in overlapping]
        return answer

    def _all_lanes(self) -> list[Lane]:
        """Every lane, the "not started" ones too (an attempt that has not started is drawn in one)."""
        for attempt in self.attempts:
            if not attempt.segments:
                self._lane(attempt.platform, None, None)
        return self._lane_list

    def _clusters(self, attempts: list[Attempt], gap: int) -> list[dict[str, Any]]:
        by_lane: dict[int, list[tuple[int, int, str]]] = {}
        for attempt in attempts:
            lane = attempt.segments[-1].lane if attempt.segments else self._lane(attempt.platform, None, None)
            low, high = attempt.span(self.end)
            by_lane.setdefault(lane, []).append((low, high, attempt.state))
        clusters: list[dict[str, Any]] = []
        for lane, spans in sorted(by_lane.items()):
            spans.sort()
            current: dict[str, Any] | None = None
            for low, high, outcome in spans:
                if current is None or low > current["to"] + gap:
                    current = {"lane": lane, "from": low, "to": high, "count": 0, "outcomes": {}}
                    clusters.append(current)
                current["to"] = max(current["to"], high)
                current["count"] += 1
                current["outcomes"][outcome] = current["outcomes"].get(outcome, 0) + 1
        return clusters

    def views(self) -> dict[str, Any]:
        """Every trial's view changes: the table at any point is each trial's last change at or before it."""
        return {
            "head": self.head,
            "optimizeMode": self.optimize_mode,
            "experiment": self.experiment_changes,
            "trials": {trial_id: trial.changes for trial_id, trial in self.trials.items()},
        }

    def attempt(self, trial_id: str, number: int) -> Attempt:
        trial = self.trials.get(trial_id)
        found = next((a for a in trial.attempts if a.number == number), None) if trial else None
        if trial is None or found is None:
            raise LookupError(f"no attempt {number} of trial {trial_id!r} in experiment {self.experiment_id}")
        trial.unpacked()
        return found

    def entry_ids(self, trial_id: str) -> list[str]:
        """The ids of the trial's entries, its submission first: what its history is read from."""
        trial = self.trials.get(trial_id)
        if trial is None:
            raise LookupError(f"no trial {trial_id!r} in experiment {self.experiment_id}")
        return trial.entry_ids()


def _compact_attempt(raw: str) -> int | None:
    """The attempt of an intermediate metric in compact form (schemas.compact), None for another or a bad one."""
    try:
        values = json.loads(raw)
    except ValueError:
        return None
    return periodical_attempt(values) if isinstance(values, list) else None


def _metric_time(trial: _Trial, number: int | None, at: int) -> int:
    """An intermediate metric, timed on its attempt (read off the JSON by the fast path: no other field is an
    object or holds an unescaped quote, so the key is the event's own); the attempt's number, 0 if none."""
    latest = trial.attempts[-1]
    attempt = latest if latest.number == number else next((a for a in trial.attempts if a.number == number), None)
    if attempt is None:
        return 0
    attempt.metric_times.append(at)
    return attempt.number


def _unreachable(attempt: Attempt, at: int, reason: str | None) -> None:
    """An UNKNOWN period opens with a reason and closes when the attempt is reached again (no reason)."""
    open_period = bool(attempt.unknown) and attempt.unknown[-1][1] is None
    if reason is not None and not open_period:
        attempt.unknown.append([at, None])
    elif reason is None and open_period:
        attempt.unknown[-1][1] = at


def _overlaps(span: tuple[int, int], start: int, end: int) -> bool:
    return span[0] <= end and span[1] >= start


def _host(url: str | None) -> str | None:
    """The host (and port) of a trial's URL (`ssh://user@host:22/dir`, a web page), None for a path."""
    if not url or "://" not in url:
        return None
    parts = urlsplit(url)
    if not parts.hostname:
        return None
    return f"{parts.hostname}:{parts.port}" if parts.port else parts.hostname


def _marker_text(event: Event) -> str | None:
    """How an experiment event reads on the timeline; None for what is not worth a marker."""
    match event:
        case ExperimentCreated():
            return "created"
        case TrialsRequested():
            return f"tuner asked for {event.count}"
        case TunerDataImported():
            return f"{len(event.data)} results imported for the tuner"
        case TunerNoMoreTrials():
            return "tuner has no more trials" if event.no_more else "tuner has trials again"
        case ExperimentUpdated():
            changes = event.changes.model_dump(mode="json", by_alias=True, exclude_none=True)
            return "updated " + ", ".join(f"{name}={json.dumps(value)[:40]}" for name, value in changes.items())
        case ExperimentResumed():
            return "resumed"
        case ExperimentImported():
            return "imported"
        case ExperimentStopRequested():
            return "stop requested" + (f": {event.reason}" if event.reason else "")
        case ExperimentFinished():
            return event.status + (f": {event.message}" if event.message else "")
    return None
