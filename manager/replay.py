"""Reading an experiment's log back: listing its entries, and replaying it into scratch views.

The views are disposable: anything they hold must follow from the log. `check` proves it for a
live experiment by folding the log again, up to the live views' own position, into a scratch
namespace and comparing every key the projector wrote, so it works while the experiment runs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import zip_longest
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import redis
from pydantic import BaseModel
from redis.client import Pipeline

from core import keys
from core.connections import same_server
from core.event_store import (
    STREAM_ID,
    EventStore,
    LogEntry,
    StoredEvent,
    is_stream_id,
    stored_payload,
    stream_position,
)
from core.keys import ViewKeys
from manager.projector import SCRATCH_PREFIX as SCRATCH_PREFIX  # where replays and rebuilds leave their keys
from manager.projector import Projector, scratch_namespace
from schemas.events import Event

_BATCH = 1000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# Fields every event has: shown in their own columns, so left out of the summary.
_COMMON_FIELDS = {"experiment_id", "time", "source", "trial_id", "type", "v", "attempt"}


class InvalidPosition(ValueError):
    pass


class UnknownEventType(ValueError):
    pass


# positions and filters


def parse_position(text: str, *, end: bool = False) -> str:
    """A stream id for XRANGE from a stream id, epoch milliseconds, or an ISO-8601 datetime (naive = local).

    Stream ids are millisecond timestamps, so a time needs no lookup: as an `end` it covers its
    whole millisecond (XRANGE reads a bare `ms` there as `ms-<max>`).
    """
    text = text.strip()
    as_id = text if "-" in text else f"{text}-0"  # epoch ms: an id's first part
    if STREAM_ID.fullmatch(as_id):
        if not is_stream_id(as_id):  # Redis refuses it; through a manager it would match every entry
            raise InvalidPosition(
                f"{text!r} is not an event id or epoch milliseconds: each part of an id (ms-seq) is below 2**64"
            )
        return text
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidPosition(
            f"{text!r} is not an event id (like 1795319625061-0), epoch milliseconds, or an ISO-8601 time"
        ) from None
    if moment.tzinfo is None:
        try:
            moment = moment.astimezone()  # a naive time is local time
        except (ValueError, OverflowError):  # year 1 or 9999, moved by the local offset out of datetime's range
            where = "before 1970" if moment.year < 1970 else "too late: give a time before 9999-12-31"
            raise InvalidPosition(f"{text!r} is {where}") from None
    ms = (moment - _EPOCH) // timedelta(milliseconds=1)
    if ms < 0:
        raise InvalidPosition(f"{text!r} is before 1970")
    return str(ms) if end else f"{ms}-0"


def event_types() -> list[str]:
    """The `type` names of the Event union, so a new event type needs no change here."""
    names: set[str] = set()
    pending: list[Any] = [Event]  # Annotated[Union[...], Field(discriminator="type")]
    while pending:
        candidate = pending.pop()
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            field = candidate.model_fields.get("type")
            if field is not None:
                names.update(str(name) for name in get_args(field.annotation))
        elif get_origin(candidate) in (Union, UnionType, Annotated):
            pending.extend(get_args(candidate))
    return sorted(names)


def parse_types(values: list[str] | None) -> set[str] | None:
    """Type names from repeated and/or comma-separated options; None means every type."""
    if not values:
        return None
    wanted = {name.strip() for value in values for name in value.split(",") if name.strip()}
    known = event_types()
    unknown = sorted(wanted - set(known))
    if unknown:
        raise UnknownEventType(f"unknown event type {', '.join(unknown)}; known types: {', '.join(known)}")
    return wanted


# reading the log


def _matches(fields: dict[str, str], trial: str | None, types: set[str] | None) -> bool:
    """Filter on the stream's own `trial` and `type` fields: no decoding, and unreadable entries pass too."""
    return (trial is None or fields.get("trial") == trial) and (types is None or fields.get("type") in types)


def read_log(
    client: redis.Redis,
    experiment_id: str,
    *,
    since: str = "-",
    until: str = "+",
    trial: str | None = None,
    types: set[str] | None = None,
) -> Iterator[LogEntry]:
    """The experiment's entries from `since` to `until` (both inclusive), in log order, in batches."""
    store = EventStore(client, experiment_id)
    start = since
    while True:
        batch = store.raw_range(start, until, _BATCH)
        yield from (entry.decode() for entry in batch if _matches(entry.fields, trial, types))
        if len(batch) < _BATCH:
            return
        start = f"({batch[-1].id}"


def follow_log(
    client: redis.Redis,
    experiment_id: str,
    after: str,
    *,
    trial: str | None = None,
    types: set[str] | None = None,
    block_ms: int = 1000,
) -> Iterator[LogEntry]:
    """Entries appended after `after`, as they arrive (XREAD BLOCK), forever."""
    store = EventStore(client, experiment_id)
    while True:
        for entry in store.raw_wait(after, block_ms, _BATCH):
            after = entry.id
            if _matches(entry.fields, trial, types):
                yield entry.decode()


# describing entries


@dataclass(frozen=True)
class EntryLine:
    """One log entry as the CLI shows it: the same for `events` and a trial's history."""

    id: str
    time_ms: int
    type: str
    trial: str
    source: str
    attempt: int | None
    summary: str
    json: dict[str, Any]

    @property
    def time(self) -> str:
        """ISO-8601 in local time, to the millisecond."""
        return datetime.fromtimestamp(self.time_ms / 1000).astimezone().isoformat(timespec="milliseconds")


def describe(entry: LogEntry) -> EntryLine:
    """The summary is built from the event's own fields, so a new event type or field needs no change here."""
    if isinstance(entry, StoredEvent):
        event = entry.event
        fields = event.model_dump(mode="json", by_alias=True, exclude_none=True, exclude=_COMMON_FIELDS)
        return EntryLine(
            id=entry.id,
            time_ms=event.time,
            type=event.type,
            trial=getattr(event, "trial_id", ""),
            source=event.source,
            attempt=getattr(event, "attempt", None),
            summary=" ".join(f"{name}={_short(value)}" for name, value in fields.items()),
            json={"id": entry.id, "event": json.loads(event.model_dump_json(by_alias=True, exclude_none=True))},
        )
    raw = stored_payload(entry.fields)
    attempt = raw.get("attempt")
    raw_time = raw.get("time")
    return EntryLine(
        id=entry.id,
        time_ms=raw_time if isinstance(raw_time, int) else stream_position(entry.id)[0],
        type=entry.fields.get("type", "?"),
        trial=entry.fields.get("trial", ""),
        source=str(raw.get("source", "?")),
        attempt=attempt if isinstance(attempt, int) else None,
        summary=f"unreadable: {entry.error}",
        json={"id": entry.id, "unreadable": entry.error, "fields": entry.fields},
    )


def _short(value: Any, limit: int = 80) -> str:
    """One field's value on one line, cut short (the JSON output has it whole)."""
    text = value if isinstance(value, str) and value and not any(c.isspace() for c in value) else None
    text = text if text is not None else json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 1] + "…"


# replaying into scratch views


@dataclass(frozen=True)
class Replay:
    """Views rebuilt from the log up to `position`, under a scratch `namespace`."""

    namespace: str
    position: str


@contextmanager
def replayed(client: redis.Redis, experiment_id: str, until: str = "+") -> Iterator[Replay]:
    """The views as they were at `until`, built in a scratch namespace that is deleted on exit, error or not."""
    namespace = scratch_namespace()
    try:
        position = Projector(client, namespace=namespace).catch_up(
            experiment_id, until
        )  # a fresh namespace: nothing to swap
        yield Replay(namespace, position)
    finally:
        drop_views(client, experiment_id, namespace)


def drop_views(client: redis.Redis, experiment_id: str, namespace: str) -> None:
    """Delete a scratch namespace's views of the experiment; refuses the live namespace."""
    if namespace == keys.LOG_PREFIX:
        raise ValueError("refusing to delete the live views")
    stale = list(client.scan_iter(match=_pattern(ViewKeys(experiment_id, namespace)), count=_BATCH))
    if stale:
        client.delete(*stale)


# comparing views

KeyValue = tuple[str, Any]  # (Redis type, value)


@dataclass(frozen=True)
class ViewSnapshot:
    """Every view key of one experiment in one namespace, by name relative to the namespace (`trials`, ...)."""

    keys: dict[str, KeyValue]

    @property
    def position(self) -> str:
        return str(self._position().get("position", "0-0"))

    @property
    def applied(self) -> int:
        return int(self._position().get("applied", 0))

    def _position(self) -> dict[str, str]:
        kind, value = self.keys.get("position", ("hash", {}))
        return value if kind == "hash" else {}


def snapshot_views(client: redis.Redis, experiment_id: str, namespace: str = keys.LOG_PREFIX) -> ViewSnapshot:
    """Every view key, read at one position even while the projector commits.

    The values are read in one MULTI/EXEC, so atomically. Which keys to read comes from a SCAN
    (too slow to repeat under a busy projector) plus the per-trial keys named by the trials view,
    re-listed under a WATCH of the position: the projector writes its position in the same
    MULTI/EXEC as any key it creates, so a commit between listing and reading forces a retry.
    """
    view_keys = ViewKeys(experiment_id, namespace)
    prefix = view_keys.pattern[:-1]
    known = {str(name) for name in client.scan_iter(match=_pattern(view_keys), count=_BATCH)}
    known |= view_keys.fixed  # a commit may create them after the SCAN
    kinds: dict[str, str] = {}
    with client.pipeline() as pipe:
        while True:
            try:
                pipe.watch(view_keys.position)
                trial_ids: Any = pipe.hkeys(view_keys.trials)
                names = sorted(known | {name for trial_id in trial_ids for name in view_keys.per_trial(trial_id)})
                kinds.update(_types(client, [name for name in names if kinds.get(name, "none") == "none"]))
                present = [(name, kinds[name]) for name in names if kinds[name] != "none"]
                pipe.multi()
                for name, kind in present:
                    _READERS[kind](pipe, name)
                values: list[Any] = pipe.execute()
                values = [
                    _appended(client, name, value) if kind == "string" else value
                    for (name, kind), value in zip(present, values, strict=True)
                ]
                return ViewSnapshot(
                    {
                        name[len(prefix) :]: (kind, dict(value) if kind == "zset" else value)
                        for (name, kind), value in zip(present, values, strict=True)
                    }
                )
            except redis.WatchError:
                continue


def _pattern(view_keys: ViewKeys) -> str:
    """The SCAN pattern of the namespace's keys, with glob characters in the ids escaped."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", view_keys.pattern[:-1]) + "*"


def _appended(client: redis.Redis, name: str, length: int) -> str:
    """The first `length` bytes of an append-only string (binary: shown in hex), as they were when it had them."""
    value: Any = same_server(client, decode=False).getrange(name, 0, length - 1) if length else b""
    return bytes(value).hex()


def _types(client: redis.Redis, names: list[str]) -> dict[str, str]:
    with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.type(name)
        return {name: str(kind) for name, kind in zip(names, pipe.execute(), strict=True)}


_READERS: dict[str, Callable[[Pipeline, str], Any]] = {
    "hash": lambda pipe, name: pipe.hgetall(name),
    "list": lambda pipe, name: pipe.lrange(name, 0, -1),
    "set": lambda pipe, name: pipe.smembers(name),
    "string": lambda pipe, name: pipe.strlen(name),  # bytes only ever appended: read up to it after (_appended)
    "zset": lambda pipe, name: pipe.zrange(name, 0, -1, withscores=True),
}


def diff_snapshots(
    left: ViewSnapshot, right: ViewSnapshot, labels: tuple[str, str] = ("live", "replayed")
) -> list[str]:
    """Every difference, one line each: key, field (a trial id, list index...), JSON field, both values."""
    differences: list[str] = []
    for name in sorted(left.keys.keys() | right.keys.keys()):
        if name not in right.keys or name not in left.keys:
            differences.append(f"{name}: only {labels[0] if name in left.keys else labels[1]} has it")
            continue
        (left_kind, left_value), (right_kind, right_value) = left.keys[name], right.keys[name]
        if left_kind != right_kind:
            differences.append(f"{name}: a {left_kind} in {labels[0]}, a {right_kind} in {labels[1]}")
        elif left_kind == "set":
            for member in sorted(left_value ^ right_value):
                differences.append(f"{name}: {member!r} only in {labels[0] if member in left_value else labels[1]}")
        elif left_kind == "list":
            for index, (one, other) in enumerate(zip_longest(left_value, right_value)):
                differences += _diff_value(f"{name}[{index}]", one, other, labels)
        elif left_kind in ("hash", "zset"):
            for field in sorted(left_value.keys() | right_value.keys(), key=str):
                differences += _diff_value(f"{name}[{field}]", left_value.get(field), right_value.get(field), labels)
        else:
            differences += _diff_value(name, left_value, right_value, labels)
    return differences


def _diff_value(where: str, left: Any, right: Any, labels: tuple[str, str]) -> list[str]:
    """Compare two stored values; JSON objects field by field, so a line names the field that differs."""
    left, right = _parsed(left), _parsed(right)
    if left == right:
        return []
    if isinstance(left, dict) and isinstance(right, dict):
        return [
            f"{where}.{field}: {labels[0]} {_shown(left.get(field))} vs {labels[1]} {_shown(right.get(field))}"
            for field in sorted(left.keys() | right.keys())
            if left.get(field) != right.get(field)
        ]
    return [f"{where}: {labels[0]} {_shown(left)} vs {labels[1]} {_shown(right)}"]


def _parsed(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _shown(value: Any) -> str:
    return "(missing)" if value is None else json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def diff_views(
    client: redis.Redis,
    experiment_id: str,
    live_namespace: str = keys.LOG_PREFIX,
    other_namespace: str = keys.LOG_PREFIX,
    *,
    other_client: redis.Redis | None = None,
    labels: tuple[str, str] = ("live", "replayed"),
) -> list[str]:
    """Differences between the experiment's views in two namespaces (of one Redis, or of `other_client`'s)."""
    live = snapshot_views(client, experiment_id, live_namespace)
    other = snapshot_views(other_client or client, experiment_id, other_namespace)
    return diff_snapshots(live, other, labels)


@dataclass(frozen=True)
class ReplayCheck:
    """The live views compared with a replay of the log up to `position` (`applied` entries)."""

    position: str
    applied: int
    differences: list[str]


def replay_check(client: redis.Redis, experiment_id: str, namespace: str = keys.LOG_PREFIX) -> ReplayCheck:
    """Fold the log again up to the live views' position, and compare: nothing may differ."""
    live = snapshot_views(client, experiment_id, namespace)
    with replayed(client, experiment_id, until=live.position) as replay:
        rebuilt = snapshot_views(client, experiment_id, replay.namespace)
    return ReplayCheck(live.position, live.applied, diff_snapshots(live, rebuilt))


def check(client: redis.Redis, experiment_id: str, namespace: str = keys.LOG_PREFIX) -> list[str]:
    """The differences between the live views and a replay of the log (empty when they agree)."""
    return replay_check(client, experiment_id, namespace).differences
