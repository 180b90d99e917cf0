"""The timeline kept as a view: the projector folds each batch onto what it kept of the fold (manager.timeline),
so a page's first look at a long experiment reads the fold, not the whole log.

Kept with the other views of an experiment (core.keys.ViewKeys), written in the MULTI that moves their position:
- `timeline` (hash): the fold's header (head, span, lanes, the experiment's status changes); its head is the views'
  position, or the timeline is not kept for that experiment and its reader folds the log itself;
- `timeline:trials` (hash): each trial's attempts and view changes, rewritten when they change;
- `timeline:markers` (list): the experiment's markers, appended to;
- `timeline:entries:<trial>` (string): the ids of the trial's entries (16 bytes each), appended to.
The trials' and the experiment's views are the projector's own, read at the same position. Like every view, it
is disposable: a rebuild or a replay folds it again from the log, the same whatever the batches.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from operator import attrgetter
from typing import Any

import redis

from core import keys
from core.connections import same_server
from core.event_store import EventStore, LogEntry, PeriodicalMetric, RawEntry
from core.keys import ViewKeys
from manager.timeline import Timeline
from schemas.trial import ExperimentView, TrialJobDetail

READ_BATCH = 10_000
# KEYS: trials' entry strings; ARGV: for each, 1 (its trial ended: the string and what is appended to it SET again, at
# its size, where APPEND leaves room to grow) or 0 (APPEND), then what is appended. One call for a batch's trials:
# a command each cost the projector more than their folds.
_APPEND_ENTRIES = """
for i, key in ipairs(KEYS) do
  if ARGV[2 * i - 1] == '1' then
    redis.call('SET', key, (redis.call('GET', key) or '') .. ARGV[2 * i])
  else
    redis.call('APPEND', key, ARGV[2 * i])
  end
end
"""
_COMPACT = {"separators": (",", ":"), "ensure_ascii": False}
_ID_AND_FIELDS = attrgetter("id", "fields")  # an entry as Timeline.feed takes it (no Python frame per entry)


class TimelineBatch:
    """One projector batch on the timeline: `read` before the batch's MULTI, `fold`, then `queue` in it."""

    def __init__(
        self,
        view_keys: ViewKeys,
        timeline: Timeline,
        states: dict[str, str],
        ended: frozenset[str] = frozenset(),
        met_not_utf8: bool = False,
    ) -> None:
        self.view_keys = view_keys
        self.timeline = timeline
        self.met_not_utf8 = met_not_utf8  # the log it read held an entry that is not UTF-8 (read again as bytes)
        self._states = states  # the trials' states as read: rewritten only when they change
        # The trials that end in this batch: their entry ids are written again whole, at their size, by Redis
        # itself in the MULTI (an APPEND leaves a string up to twice the room it holds, ~8 bytes an entry; a trial
        # that ended grows no more).
        self._ended = ended

    @classmethod
    def read(
        cls,
        pipe: redis.client.Pipeline,
        view_keys: ViewKeys,
        position: str,
        entries: list[RawEntry],
        views: Mapping[str, TrialJobDetail | None],
        experiment: ExperimentView | None,
    ) -> TimelineBatch:
        """What the batch folds onto: the kept header, and the trials its entries name (their states, their views
        as the projector read them, or read here for a trial named only by an entry that does not decode; no
        entries: those are appended). Where nothing was kept past the log's start (views projected before the
        timeline was), the log up to `position` is folded first, so the batch writes the whole timeline."""
        header: Any = pipe.hget(view_keys.timeline, "header")
        if header is None and position != "0-0":
            timeline, met_not_utf8 = _folded(EventStore(pipe, view_keys.experiment_id), position)
            return cls(view_keys, timeline, {}, met_not_utf8=met_not_utf8)
        named = {entry.fields.get("trial") for entry in entries}
        trial_ids = sorted(trial_id for trial_id in named if trial_id)
        states: dict[str, str] = {}
        if header is None:
            return cls(view_keys, Timeline(view_keys.experiment_id), states)
        trials: list[tuple[str, TrialJobDetail | str, dict[str, Any], bytes]] = []
        if trial_ids:
            raw_states: Any = pipe.hmget(view_keys.timeline_trials, trial_ids)
            unread = [trial_id for trial_id in trial_ids if trial_id not in views]
            raw_views: Any = dict(zip(unread, pipe.hmget(view_keys.trials, unread), strict=True)) if unread else {}
            for trial_id, state in zip(trial_ids, raw_states, strict=True):
                view = views[trial_id] if trial_id in views else raw_views[trial_id]
                if state is not None and view is not None:
                    states[trial_id] = state
                    trials.append((trial_id, view, json.loads(state), b""))
        timeline = Timeline.restored(view_keys.experiment_id, json.loads(header), experiment, [], trials)
        ended = frozenset(  # an entry without a trial field (written by hand, imported) ends none: it stops nothing
            entry.fields["trial"]
            for entry in entries
            if entry.fields.get("type") == "TrialEnded" and "trial" in entry.fields
        )
        return cls(view_keys, timeline, states, ended)

    def fold(
        self,
        entries: list[RawEntry],
        decoded: list[LogEntry | PeriodicalMetric],
        views_after: Mapping[str, TrialJobDetail | None],
    ) -> None:
        """The batch's entries, as the projector decoded them and folded its trial views (by entry id)."""
        self.timeline.feed(map(_ID_AND_FIELDS, entries), decoded, views_after)

    def queue(self, pipe: redis.client.Pipeline) -> None:
        """The batch's writes, in its MULTI: the header, the trials that changed, what was appended."""
        view_keys, timeline = self.view_keys, self.timeline
        pipe.hset(view_keys.timeline, "header", json.dumps(timeline.header(), **_COMPACT))  # type: ignore[arg-type]
        changed: Any = {}
        names: list[str] = []
        appended: list[bytes | str] = []
        for trial_id, trial in timeline.trials.items():
            state = json.dumps(trial.kept(), **_COMPACT)  # type: ignore[arg-type]
            if state != self._states.get(trial_id):
                changed[trial_id] = state
            packed = trial.packed_entries()
            if trial_id in self._ended or packed:
                names.append(view_keys.timeline_entries(trial_id))
                appended += ("1" if trial_id in self._ended else "0", packed)
        if names:
            pipe.eval(_APPEND_ENTRIES, len(names), *names, *appended)
        if changed:
            pipe.hset(view_keys.timeline_trials, mapping=changed)
        if timeline.markers:  # the batch's own: a batch folds onto none of the kept ones
            pipe.rpush(view_keys.timeline_markers, *(json.dumps(m, **_COMPACT) for m in timeline.markers))  # type: ignore[arg-type]


def restore(client: redis.Redis, experiment_id: str, namespace: str = keys.LOG_PREFIX) -> Timeline | None:
    """The timeline as the projector kept it, at the views' position; None where it is not kept."""
    view_keys = ViewKeys(experiment_id, namespace)
    with client.pipeline() as pipe:  # MULTI: all at one position
        pipe.hget(view_keys.position, "position")
        pipe.hget(view_keys.timeline, "header")
        pipe.hgetall(view_keys.timeline_trials)
        pipe.lrange(view_keys.timeline_markers, 0, -1)
        pipe.hgetall(view_keys.trials)
        pipe.hget(view_keys.experiment, "view")
        position, raw_header, states, markers, views, experiment = pipe.execute()
    if raw_header is None:
        return None
    header = json.loads(raw_header)
    if header["head"] != (position or "0-0"):
        return None  # another version's views: not the fold at their position
    trial_ids = [trial_id for trial_id in states if trial_id in views]
    packed = _entries(same_server(client, decode=False), view_keys, trial_ids)  # later appends are cut at the head
    return Timeline.restored(
        experiment_id,
        header,
        ExperimentView.model_validate_json(experiment) if experiment else None,
        [json.loads(marker) for marker in markers],
        (
            (trial_id, views[trial_id], json.loads(states[trial_id]), entries)
            for trial_id, entries in zip(trial_ids, packed, strict=True)
        ),
    )


def _entries(raw: redis.Redis, view_keys: ViewKeys, trial_ids: list[str]) -> list[bytes]:
    found: list[bytes] = []
    for first in range(0, len(trial_ids), 1000):
        names = [view_keys.timeline_entries(trial_id) for trial_id in trial_ids[first : first + 1000]]
        values: Any = raw.mget(names)
        found += [value or b"" for value in values]
    return found


def _folded(store: EventStore, until: str) -> tuple[Timeline, bool]:
    """The log up to `until`, folded in memory; and whether it held an entry that is not UTF-8."""
    timeline = Timeline(store.experiment_id)
    met_not_utf8 = False
    while batch := store.raw_range(f"({timeline.head}", until, READ_BATCH):
        met_not_utf8 = met_not_utf8 or any(entry.not_utf8 for entry in batch)
        timeline.feed((entry.id, entry.fields) for entry in batch)
        if len(batch) < READ_BATCH:
            break
    return timeline, met_not_utf8
