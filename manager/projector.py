"""The projector: folds each experiment's event log into its views.

How far it has read is written in the same MULTI/EXEC as the views it updates, under a WATCH of
that position: a restart resumes exactly where the last commit left off, and two projectors can
never apply the same event twice.

Nothing in the log stops it. An entry that cannot be decoded, or whose fold raises, is recorded in
the `unreadable` view (id -> why) in the same transaction as the position that passes it, and
skipped; a rebuild after a fix folds it again. Redis going away is waited out: the client retries
each command for a while (core.connections), and `run` then backs off and tries again.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
from collections import Counter
from collections.abc import Iterable
from typing import Any

import redis

from core import keys
from core.connections import same_server
from core.event_store import (
    EventStore,
    LogEntry,
    PeriodicalMetric,
    RawEntry,
    StoredEvent,
    UnreadableEvent,
    stream_position,
)
from core.keys import ViewKeys
from manager import metric_marks
from manager.projection import apply_to_experiment, apply_to_trial
from manager.timeline_views import TimelineBatch
from manager.views import ViewStore
from schemas.compact import compact_record, periodical_record
from schemas.events import TrialAttemptLost, TrialEvent, TrialMetricReported
from schemas.trial import ExperimentView, TrialJobDetail, TrialJobStatus

log = logging.getLogger(__name__)

HEARTBEAT_TTL_S = 5
BACKOFF_BASE_S = 0.1
BACKOFF_CAP_S = 2.0
SCRATCH_PREFIX = "ts-replay-"
_ERROR_CHARS = 500
# Records from which a trial's list is pushed by an RPUSH of its own, not through _PUSH_RECORDS: a record passed through
# Lua costs Redis about twice a record of an RPUSH (copied into Lua and back), and this many outweigh a command's cost.
_OWN_PUSH = 64
# KEYS: trials' metric lists; ARGV: for each, how many records, then those records (RPUSHed up to 1000 at a time: Lua's
# unpack has a limit). One call for a batch's trials: a command each cost the projector more than their folds.
_PUSH_RECORDS = """
local at = 1
for _, key in ipairs(KEYS) do
  local last = at + tonumber(ARGV[at])
  for first = at + 1, last, 1000 do
    redis.call('RPUSH', key, unpack(ARGV, first, math.min(first + 999, last)))
  end
  at = last + 1
end
"""


def _why(error: BaseException) -> str:
    """One line saying what went wrong, short enough for a hash field."""
    text = str(error).strip()
    first_line = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {first_line}"[:_ERROR_CHARS]


def _connection_lost(error: redis.WatchError) -> bool:
    """redis-py turns a connection error while WATCHing into a WatchError (it cannot resend the watch)."""
    return isinstance(error.__context__, redis.ConnectionError | redis.TimeoutError)


def _watch_again(pipe: redis.client.Pipeline, view_keys: ViewKeys, position: str) -> bool:
    """After a batch's reads met an entry that is not UTF-8 (its entries, or the log the timeline folds): redis-py
    drops a connection whose reply fails to decode, and reconnects for the next command without a word, so the WATCH
    is gone. Watched again, the batch goes on only from the position it read (any batch written meanwhile moved it);
    False when it moved, to read the batch again."""
    pipe.watch(view_keys.position)
    return _position(pipe, view_keys) == position


def scratch_namespace() -> str:
    """A namespace of its own for each replay or rebuild: never the live `ts`, never another one's."""
    return f"{SCRATCH_PREFIX}{secrets.token_hex(6)}"


def _position(client: redis.Redis | redis.client.Pipeline, view_keys: ViewKeys) -> str:
    return str(client.hget(view_keys.position, "position") or "0-0")


def _names(view_keys: ViewKeys, trial_ids: Iterable[str]) -> set[str]:
    """The keys the views may have: one of each kind, and a metric list and timeline entries per trial."""
    return set(view_keys.fixed) | {name for trial_id in trial_ids for name in view_keys.per_trial(trial_id)}


def _rank_score(trial: TrialJobDetail) -> float | None:
    """The trial's place in the ranking: its final metric's score, if finite (Redis refuses a NaN score,
    and a diverged trial's NaN or inf is no result to rank by)."""
    score = trial.final_score
    return score if score is not None and math.isfinite(score) else None


def _view_names(client: redis.Redis, view_keys: ViewKeys) -> set[str]:
    """The views' keys now (a SCAN: too slow to repeat while a projector commits), and the fixed ones."""
    return _names(view_keys, ()) | _scanned(client, view_keys)


def _scanned(client: redis.Redis, view_keys: ViewKeys) -> set[str]:
    """The views' keys that exist now: SCAN returns every key that exists from its start to its end."""
    return {str(name) for name in client.scan_iter(match=view_keys.pattern, count=1000)}


def _existing(client: redis.Redis, names: set[str]) -> set[str]:
    with client.pipeline(transaction=False) as pipe:
        for name in sorted(names):
            pipe.exists(name)
        return {name for name, found in zip(sorted(names), pipe.execute(), strict=True) if found}


def _trials_between(store: EventStore, after: str, until: str) -> set[str]:
    """Trials named by the log entries after `after` up to `until`: those whose metric lists folding them may create."""
    trials: set[str] = set()
    while True:
        entries = store.raw_range(f"({after}", until, count=1000)
        if not entries:
            return trials
        trials |= {entry.fields["trial"] for entry in entries if entry.fields.get("trial")}
        after = entries[-1].id


def _moved(name: str, source: ViewKeys, target: ViewKeys) -> str:
    """`name` of the source views, in the target's namespace."""
    return target.pattern[:-1] + name[len(source.pattern) - 1 :]


def _drop(client: redis.Redis, view_keys: ViewKeys) -> None:
    stale = list(client.scan_iter(match=view_keys.pattern, count=1000))
    if stale:
        client.delete(*stale)


def _listed(ended: set[str], event: TrialMetricReported) -> tuple[tuple[metric_marks.Stream, int], tuple[str, str]]:
    """A metric as a candidate for its trial's list: (its stream, sequence) -> (trial, its record), late when the trial
    had ended before it (`ended`: as the views stand before the event is folded)."""
    trial_id = event.trial_id
    key = ((trial_id, event.attempt, event.parameter_id, event.metric_type), event.sequence)
    return key, (trial_id, compact_record(event, late=trial_id in ended))


class _BatchFold:
    """A batch's events folded onto the views it read: the trials' and the experiment's, the metrics to list."""

    def __init__(self, trials: dict[str, TrialJobDetail | None], experiment: ExperimentView | None) -> None:
        self.trials = trials  # folded in place
        self.experiment = experiment
        self.experiment_changed = False
        self.unreadable: dict[str, str] = {}  # entry id -> why: the entries that do not decode, then failed folds
        self.candidates: metric_marks.Candidates = {}  # (stream, sequence) -> (trial, record JSON), in log order
        self.views_after: dict[str, TrialJobDetail | None] = {}  # entry id -> its trial's view after it (the timeline)
        self.attempts = Counter[str]()  # attempts `lost`, and of those `retried`
        # The trials ended as the fold stands: a metric after the end is listed late (a set: checked for each metric).
        self.ended = {trial_id for trial_id, view in trials.items() if view is not None and view.status.is_terminal}

    def fold(self, entries: list[PeriodicalMetric | LogEntry]) -> None:
        """An event whose fold raises changes nothing (nor do its metrics): recorded as unreadable with the error."""
        self.unreadable.update((entry.id, entry.error) for entry in entries if isinstance(entry, UnreadableEvent))
        candidates, ended, record = self.candidates, self.ended, periodical_record
        for entry in entries:
            if type(entry) is PeriodicalMetric:  # most entries: listed only, what _listed does spelled out
                _, trial_id, time, attempt, parameter_id, sequence, data = entry
                key = ((trial_id, attempt, parameter_id, "PERIODICAL"), sequence)
                if key not in candidates:
                    candidates[key] = (trial_id, record(time, parameter_id, sequence, data, attempt, trial_id in ended))
            elif isinstance(entry, StoredEvent):
                self._event(entry)

    def _event(self, entry: StoredEvent) -> None:
        event = entry.event
        if type(event) is TrialMetricReported and event.metric_type != "FINAL":
            self.candidates.setdefault(*_listed(self.ended, event))  # (apply_to_trial returns the view unchanged)
            return
        trials = self.trials
        try:
            listed = _listed(self.ended, event) if isinstance(event, TrialMetricReported) else None
            if isinstance(event, TrialEvent):
                trial = apply_to_trial(trials.get(event.trial_id), event)
            else:
                folded = apply_to_experiment(self.experiment, event)
        except Exception as error:  # a poison event: skipped, never retried in a loop
            self.unreadable[entry.id] = f"fold failed: {_why(error)}"
            return
        if isinstance(event, TrialEvent):
            if isinstance(event, TrialAttemptLost) and trial is not trials.get(event.trial_id):
                self.attempts["lost"] += 1
                self.attempts["retried"] += event.status is TrialJobStatus.WAITING
            trials[event.trial_id] = self.views_after[entry.id] = trial
            if trial is not None and trial.status.is_terminal:
                self.ended.add(event.trial_id)
            else:
                self.ended.discard(event.trial_id)
        else:
            self.experiment, self.experiment_changed = folded, True
        if listed is not None:
            self.candidates.setdefault(*listed)


def _trial_ids(entries: list[PeriodicalMetric | LogEntry]) -> list[str]:
    """The trials the entries' events are of, sorted: the views a batch folds onto."""
    found: set[str] = set()
    for entry in entries:
        if type(entry) is PeriodicalMetric:  # most entries: checked the cheaper way
            found.add(entry.trial_id)
        elif isinstance(entry, StoredEvent) and isinstance(entry.event, TrialEvent):
            found.add(entry.event.trial_id)
    return sorted(found)


class Projector:
    def __init__(self, client: redis.Redis, namespace: str = keys.LOG_PREFIX, batch_size: int = 2000) -> None:
        self.client = client
        self.namespace = namespace
        self.batch_size = batch_size
        self._raw_client: redis.Redis | None = None
        # what serve_round keeps between rounds
        self._clock: int | None = None  # the activity tick read last
        self._active: set[str] = set()  # experiments polled each round
        self._positions: dict[str, str] = {}  # active ones' positions, to wake on their growth
        self._failing: dict[str, str] = {}  # experiment -> the error last logged for it
        self._finished: dict[str, bool] = {}  # experiment -> its view has ended, as last written or read

    def catch_up(self, experiment_id: str, until: str = "+") -> str:
        """Apply every event up to `until`; returns the position reached."""
        while True:
            position, applied = self._apply_batch(experiment_id, until)
            if not applied:
                return position

    def rebuild(self, experiment_id: str, until: str = "+") -> str:
        """Fold the log again into a scratch namespace, then swap it in for this namespace's views.

        A projector may fold the same experiment meanwhile. The swap (delete these views, rename the
        scratch ones) is one MULTI/EXEC under a WATCH of this namespace's position; when that position
        moved, the scratch views catch up past it (up to `until`) and the swap is tried again. So a
        reader sees the old views or the complete new ones, and projecting continues from the swapped
        position. Returns that position.
        """
        scratch = Projector(self.client, namespace=scratch_namespace(), batch_size=self.batch_size)
        try:
            return self._swap_in(scratch, experiment_id, until)  # renames every scratch key: nothing is left
        except BaseException:
            _drop(self.client, ViewKeys(experiment_id, scratch.namespace))  # a SCAN of the whole keyspace
            raise
        finally:
            self._finished.pop(experiment_id, None)

    def _swap_in(self, scratch: Projector, experiment_id: str, until: str) -> str:
        live, rebuilt = ViewKeys(experiment_id, self.namespace), ViewKeys(experiment_id, scratch.namespace)
        store = EventStore(self.client, experiment_id)
        position = scratch.catch_up(experiment_id, until)
        # The scratch keys found by a SCAN exist until the swap (nothing else writes them): only the fixed ones checked.
        new_names = _existing(self.client, set(rebuilt.fixed)) | _scanned(self.client, rebuilt)
        # The live keys: listed once, then kept current from the log (see _trials_between).
        listed_at = _position(self.client, live)
        old_names = _view_names(self.client, live)
        with self.client.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(live.position)
                    live_position = _position(pipe, live)
                    if stream_position(live_position) < stream_position(listed_at):  # another rebuild went back
                        old_names, listed_at = _view_names(pipe, live), live_position
                    elif live_position != listed_at:
                        old_names |= _names(live, _trials_between(store, listed_at, live_position))
                        listed_at = live_position
                    if until == "+" and stream_position(live_position) > stream_position(position):
                        pipe.unwatch()  # the projector moved on: never swap in views older than the live ones
                        caught_up = scratch.catch_up(experiment_id, until)
                        trials = _trials_between(store, position, caught_up)
                        new_names |= _existing(self.client, _names(rebuilt, trials))
                        position = caught_up
                        continue
                    pipe.multi()
                    pipe.delete(*old_names)
                    for name in sorted(new_names):
                        pipe.rename(name, _moved(name, rebuilt, live))
                    pipe.execute()
                    return position
                except redis.WatchError as error:
                    if _connection_lost(error) and new_names and not self.client.exists(*new_names):
                        return position  # the EXEC landed before the connection went
                    log.debug(
                        "views of %s moved during a rebuild; swapping again",
                        experiment_id,
                        extra={"experiment": experiment_id},
                    )

    def run(self, stop: threading.Event, block_ms: int = 500) -> None:
        """Serve every experiment until `stop` is set, waking as soon as an event is appended.

        Redis errors (after the client's own retries) are logged once, then retried with backoff
        until Redis answers again; so is any other error of a round. An experiment whose views
        cannot be updated (other than by a Redis error) is logged and retried each round, without
        holding up the others.
        """
        outage = 0  # consecutive rounds that ended in a Redis error
        while not stop.is_set():
            try:
                self.client.set(keys.PROJECTOR_HEARTBEAT, "1", ex=HEARTBEAT_TTL_S)
                if outage:
                    log.warning("serving again after %d failed round%s", outage, "s" if outage > 1 else "")
                    outage = 0
                self.serve_round(block_ms, stop)
            except Exception as error:
                outage += 1
                if outage == 1 and isinstance(error, redis.RedisError):
                    log.warning("Redis error: %s; retrying with backoff (up to %gs)", _why(error), BACKOFF_CAP_S)
                elif outage == 1:
                    log.exception("unexpected error; retrying with backoff (up to %gs)", BACKOFF_CAP_S)
                stop.wait(min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (outage - 1)))

    def serve_round(self, block_ms: int, stop: threading.Event | None = None) -> None:
        """Catch every active experiment up, then wait up to `block_ms` for one of their logs to grow.

        A finished experiment (DONE/STOPPED/ERROR) whose views have caught up with its log rests: it
        costs nothing per round, so thousands of old experiments do not slow the live ones. The append
        path files each experiment under a clock tick when its log grows (keys.ACTIVITY); one
        read of the ticks since the last round wakes those that grew (a resume, an import, a new one).
        """
        for experiment_id in self._grown_experiments():
            self._finished.pop(experiment_id, None)  # another projector may have folded its resume
        for experiment_id in sorted(self._active):
            try:
                position = self.catch_up(experiment_id)
            except redis.RedisError:
                raise
            except Exception as error:  # not one event (those are skipped): the views themselves
                self._positions.pop(experiment_id, None)  # no wake-up from a log it cannot follow: retried
                if self._failing.get(experiment_id) != _why(error):
                    log.exception(
                        "experiment %s: cannot update its views; retrying each round",
                        experiment_id,
                        extra={"experiment": experiment_id},
                    )
                    self._failing[experiment_id] = _why(error)
                continue
            if self._failing.pop(experiment_id, None) is not None:
                log.warning("experiment %s: views updated again", experiment_id, extra={"experiment": experiment_id})
            if self._has_finished(experiment_id):
                self._active.discard(experiment_id)
                self._positions.pop(experiment_id, None)
            else:
                self._positions[experiment_id] = position
        if not self._positions:
            if stop is not None:
                stop.wait(block_ms / 1000)
            return
        streams: Any = {keys.events(experiment_id): position for experiment_id, position in self._positions.items()}
        # A wake-up only (catch_up reads), so undecoded: an entry that is not UTF-8 is catch_up's to record.
        self._raw().xread(streams, count=1, block=block_ms)

    def _grown_experiments(self) -> list[str]:
        """Experiments whose logs grew since the last look (every one, the first time), now active."""
        if self._clock is None:
            self._clock = int(self.client.get(keys.ACTIVITY_CLOCK) or 0)  # read first: later growth is seen next
            grown: list[str] = list(self.client.zrange(keys.EXPERIMENTS, 0, -1))  # type: ignore[arg-type]
        else:
            ticks: Any = self.client.zrangebyscore(keys.ACTIVITY, f"({self._clock}", "+inf", withscores=True)
            grown = [experiment_id for experiment_id, _ in ticks]
            self._clock = max([self._clock, *(int(tick) for _, tick in ticks)])
        self._active.update(grown)
        return grown

    def _has_finished(self, experiment_id: str) -> bool:
        """Whether the experiment's view is DONE/STOPPED/ERROR: read once, then kept by the batches written."""
        if experiment_id not in self._finished:
            view = ViewStore(self.client, experiment_id, self.namespace).experiment()
            self._finished[experiment_id] = view is not None and view.status != "RUNNING"
        return self._finished[experiment_id]

    def _apply_batch(self, experiment_id: str, until: str) -> tuple[str, int]:
        view_keys = ViewKeys(experiment_id, self.namespace)
        with self.client.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(view_keys.position)
                    position = str(pipe.hget(view_keys.position, "position") or "0-0")
                    # Read on the watched connection, as the views are: across a failover, a batch is folded
                    # and written on one server, never folded from an old master's log into the new one's views.
                    store = EventStore(pipe, experiment_id)
                    raw = store.raw_range(f"({position}", until, self.batch_size)
                    if not raw:
                        pipe.unwatch()
                        return position, 0
                    self._write_batch(pipe, view_keys, position, raw)
                    pipe.execute()
                    return raw[-1].id, len(raw)
                except redis.WatchError as error:
                    if _connection_lost(error):  # the EXEC may or may not have landed: the position says
                        log.warning(
                            "experiment %s: connection lost mid-batch (%s); re-reading",
                            experiment_id,
                            error,
                            extra={"experiment": experiment_id},
                        )
                    else:
                        log.debug("another projector advanced %s; re-reading", experiment_id)

    def _raw(self) -> redis.Redis:
        if self._raw_client is None:
            self._raw_client = same_server(self.client, decode=False)
        return self._raw_client

    def _write_batch(
        self, pipe: redis.client.Pipeline, view_keys: ViewKeys, position: str, raw: list[RawEntry]
    ) -> None:
        """Fold the entries after `position` in memory, the timeline's too, then queue every write and the new
        position in one MULTI.

        An event whose fold raises changes nothing (nor do its metrics): it is recorded as
        unreadable with the error, like an entry that does not decode.
        """
        entries = [entry.listed() for entry in raw]
        trials = self._load_trials(pipe, view_keys, _trial_ids(entries))
        loaded = dict(trials)
        raw_experiment = pipe.hget(view_keys.experiment, "view")
        experiment = ExperimentView.model_validate_json(raw_experiment) if raw_experiment else None
        timeline = TimelineBatch.read(pipe, view_keys, position, raw, loaded, experiment)  # the views read once
        fold = _BatchFold(trials, experiment)
        fold.fold(entries)
        experiment, unreadable, views_after = fold.experiment, fold.unreadable, fold.views_after
        timeline.fold(raw, entries, views_after)
        new_metrics = metric_marks.new_metrics(pipe, view_keys, fold.candidates)
        counts: Any = pipe.hgetall(view_keys.counts)
        met_not_utf8 = timeline.met_not_utf8 or any(entry.not_utf8 for entry in raw)
        if met_not_utf8 and not _watch_again(pipe, view_keys, position):
            raise redis.WatchError(f"{view_keys.experiment_id}: the position moved while the batch was read")

        pipe.multi()
        changed: Any = {
            trial_id: view.to_json()
            for trial_id, view in trials.items()
            if view is not None and view is not loaded[trial_id]  # folds return the same view when nothing changed
        }
        if changed:
            pipe.hset(view_keys.trials, mapping=changed)
        changes = {trial_id: (loaded[trial_id], trials[trial_id]) for trial_id in changed}
        self._write_indexes(pipe, view_keys, changes, fold.attempts, counts)
        if experiment is not None and fold.experiment_changed:
            pipe.hset(view_keys.experiment, "view", experiment.to_json())
            self._finished[view_keys.experiment_id] = experiment.status != "RUNNING"
        new_metrics.write(pipe, view_keys)
        if new_metrics.records:
            self._write_metrics(pipe, view_keys, new_metrics.records)
        if unreadable:
            self._write_unreadable(pipe, view_keys, unreadable)
        timeline.queue(pipe)
        pipe.hset(view_keys.position, "position", entries[-1].id)
        pipe.hincrby(view_keys.position, "applied", len(entries))

    @staticmethod
    def _write_indexes(
        pipe: redis.client.Pipeline,
        view_keys: ViewKeys,
        changes: dict[str, tuple[TrialJobDetail | None, TrialJobDetail | None]],
        counts: Counter[str],
        stored_counts: dict[str, str],
    ) -> None:
        """Keep the order, the ranking by final metric and the counts by status with the views they index.
        Counts are written whole and zeros dropped, so they do not depend on how the log was batched."""
        order: Any = {}
        ranking: Any = {}
        unranked: list[str] = []
        for trial_id, (before, after) in changes.items():
            assert after is not None
            if before is None:
                order[trial_id] = after.sequence_id
            elif before.status is not after.status:
                counts[str(before.status)] -= 1
            if before is None or before.status is not after.status:
                counts[str(after.status)] += 1
            score = _rank_score(after)
            if score is None:
                if before is not None and _rank_score(before) is not None:
                    unranked.append(trial_id)  # a retry started again without a result
            elif before is None or score != _rank_score(before):
                ranking[trial_id] = score
        if order:
            pipe.zadd(view_keys.order, order)
        if ranking:
            pipe.zadd(view_keys.ranking, ranking)
        if unranked:
            pipe.zrem(view_keys.ranking, *unranked)
        for name, delta in counts.items():
            Projector._write_count(pipe, view_keys, name, int(stored_counts.get(name, 0)) + delta, delta)

    @staticmethod
    def _write_count(pipe: redis.client.Pipeline, view_keys: ViewKeys, name: str, total: int, delta: int) -> None:
        if total:
            pipe.hset(view_keys.counts, name, total)
        elif delta:
            pipe.hdel(view_keys.counts, name)

    @staticmethod
    def _write_metrics(pipe: redis.client.Pipeline, view_keys: ViewKeys, new_metrics: metric_marks.Candidates) -> None:
        """Each new record appended to its trial's list: in the batch's MULTI."""
        by_trial: dict[str, list[str]] = {}
        for trial_id, record in new_metrics.values():
            by_trial.setdefault(trial_id, []).append(record)
        names: list[str] = []
        counted: list[int | str] = []
        for trial_id, records in by_trial.items():
            if len(records) >= _OWN_PUSH:
                pipe.rpush(view_keys.metrics(trial_id), *records)
            else:
                names.append(view_keys.metrics(trial_id))
                counted += (len(records), *records)
        if names:
            pipe.eval(_PUSH_RECORDS, len(names), *names, *counted)

    @staticmethod
    def _write_unreadable(pipe: redis.client.Pipeline, view_keys: ViewKeys, unreadable: dict[str, str]) -> None:
        for entry_id, why in unreadable.items():
            log.warning(
                "skipping unreadable event %s: %s", entry_id, why, extra={"experiment": view_keys.experiment_id}
            )
        mapping: Any = unreadable
        pipe.hset(view_keys.unreadable, mapping=mapping)

    @staticmethod
    def _load_trials(
        pipe: redis.client.Pipeline, view_keys: ViewKeys, trial_ids: list[str]
    ) -> dict[str, TrialJobDetail | None]:
        if not trial_ids:
            return {}
        raws = pipe.hmget(view_keys.trials, trial_ids)
        return {
            trial_id: TrialJobDetail.model_validate_json(raw) if raw else None
            for trial_id, raw in zip(trial_ids, raws, strict=True)
        }
