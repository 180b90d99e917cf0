"""The append-only event log of one experiment, on a Redis Stream.

Appends are validated, and idempotent when given a key: the check and the XADD run in one Lua
script, so a retried append is stored once, with no time window (XADD alone has no such guarantee).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, get_args

import redis
from pydantic import ValidationError
from pydantic_core import from_json
from redis.client import NEVER_DECODE, Pipeline
from redis.commands.core import Script

from core import keys
from core.replication import acknowledge_after
from schemas.compact import METRIC, METRIC_VERSION, compact_metric, expanded
from schemas.events import EVENT_ADAPTER, Event, TrialCommand, TrialEvent, TrialMetricReported
from schemas.trial import encodable, metric_dedup_key
from schemas.upcasters import upcast

COMMAND_TYPES = frozenset(command.model_fields["type"].default for command in get_args(TrialCommand))

# KEYS: stream, idempotency hash, activity zset, activity clock. ARGV: experiment id, fence key or '', the value it
# must hold, then per entry: idempotency key or '', stream id ('*': new), commands stream or '', n, n field/value
# pairs. A batch is appended atomically; a key seen before returns its first id; nothing is appended to an archived
# experiment (manager.archive), nor past a fence whose key holds another value (`Fence`). The archived hash and the
# fence key are read by name: a worker may only read them, and a script's KEYS need write access under ACLs.
# docs/architecture.md ("Keys in Redis") says what the commands and activity keys are for.
_REFUSALS_LUA = """
if redis.call('HEXISTS', '$ARCHIVED', ARGV[1]) == 1 then
  return redis.error_reply('ARCHIVED experiment ' .. ARGV[1] .. ' is archived: restore it before appending')
end
if ARGV[2] ~= '' then
  local holds = redis.call('GET', ARGV[2])
  if holds ~= ARGV[3] then
    return redis.error_reply('FENCED append to experiment ' .. ARGV[1] .. ' refused: ' .. ARGV[2] .. ' is ' ..
      (holds or 'unset') .. ', not ' .. ARGV[3] .. ' (its writer was superseded)')
  end
end
""".replace("$ARCHIVED", keys.ARCHIVED)
_APPEND = (
    _REFUSALS_LUA
    + """
local ids, grew, i = {}, false, 4
while i <= #ARGV do
  local key, id, commands, n = ARGV[i], false, ARGV[i + 2], tonumber(ARGV[i + 3])
  if key ~= '' then id = redis.call('HGET', KEYS[2], key) end
  if not id then
    id = redis.call('XADD', KEYS[1], ARGV[i + 1], unpack(ARGV, i + 4, i + 3 + 2 * n))
    if key ~= '' then redis.call('HSET', KEYS[2], key, id) end
    if commands ~= '' then redis.call('XADD', commands, '*', 'id', id) end
    grew = true
  end
  ids[#ids + 1] = id
  i = i + 4 + 2 * n
end
if grew then redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[4]), ARGV[1]) end
return ids
"""
)
# The same append for metrics of one trial (`EventStore.append_metrics`): past the fence, ARGV holds the trial, then
# per metric its idempotency key and its compact JSON (the fields encode_event writes); returns how many were new.
# Two arguments a metric where the general form takes ten, and no id each back: packing those arguments and reading
# the ids were a quarter of a worker's CPU per metric once it built no event per metric (py-spy during a burst).
_APPEND_METRICS = (
    _REFUSALS_LUA
    + """
local new = 0
for i = 5, #ARGV, 2 do
  if not redis.call('HGET', KEYS[2], ARGV[i]) then
    local id = redis.call('XADD', KEYS[1], '*', 'type', '$METRIC', 'trial', ARGV[4], 'json', ARGV[i + 1])
    redis.call('HSET', KEYS[2], ARGV[i], id)
    new = new + 1
  end
end
if new > 0 then redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[4]), ARGV[1]) end
return new
""".replace("$METRIC", METRIC)
)
# KEYS: the log, its idempotency keys. ARGV: one idempotency key. The entry appended under it, if any: one round trip
# where an HGET and an XRANGE took two (a worker reads a trial's submission this way in the round trip of its claim).
_READ_KEYED = """
local id = redis.call('HGET', KEYS[2], ARGV[1])
if not id then return {} end
return redis.call('XRANGE', KEYS[1], id, id)
"""
acknowledge_after(_APPEND)  # with replicas, an append returns once they have it (core.replication.ReplicaAcks)
acknowledge_after(_APPEND_METRICS)
_APPEND_BATCH = 1000  # events per script call: Redis serves nobody else while a script runs
READ_PAGE = 2000  # entries per XRANGE of a read


@dataclass(frozen=True)
class StoredEvent:
    id: str
    event: Event


@dataclass(frozen=True)
class UnreadableEvent:
    """An entry that does not decode (corrupt, or written by a newer version): kept, never applied."""

    id: str
    fields: dict[str, str]
    error: str


LogEntry = StoredEvent | UnreadableEvent


STREAM_ID = re.compile(r"[0-9]+-[0-9]+")  # ASCII only: \d takes full-width digits, which int() reads and Redis refuses
_U64 = 2**64
EXPERIMENT_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}")


class InvalidExperimentId(ValueError):
    pass


class AppendRefused(RuntimeError):
    """An append the script refused before writing anything of it."""


class ExperimentArchived(AppendRefused):
    """An append to an experiment whose log is in its archive: what reads it there is a copy that expires, so
    nothing is appended before the experiment is restored (manager.archive.restore; `resume` does it)."""


class AppendFenced(AppendRefused):
    """An append whose fence no longer holds: its writer was superseded (a runner whose claim another runner
    took, manager.runner_claim), so it must write nothing more."""


_REFUSALS: dict[str, type[AppendRefused]] = {"ARCHIVED": ExperimentArchived, "FENCED": AppendFenced}


def append_refusal(error: redis.ResponseError) -> AppendRefused | None:
    """The append script's refusal in `error` (as Redis answered it, or as a pipeline that raised it put it), as
    its exception; None for any other error."""
    _, _, answered = str(error).rpartition(" of pipeline caused error: ")  # redis-py's annotation, if any
    code, _, message = answered.partition(" ")
    refusal = _REFUSALS.get(code)
    return refusal(message) if refusal is not None else None


@dataclass(frozen=True)
class Fence:
    """Appends go through only while `key` holds `value`, checked in the append script before anything is
    written: a writer fenced by the epoch it was given (a runner's claim) cannot write once another took it."""

    key: str
    value: str


def check_experiment_id(experiment_id: str) -> str:
    """The one check of an experiment id from outside: it names Redis keys and a directory, so letters,
    digits, '_' and '-' only (never `.`, `..` or a `/` that would leave the experiments root)."""
    if not isinstance(experiment_id, str) or not EXPERIMENT_ID.fullmatch(experiment_id):
        raise InvalidExperimentId(
            f"invalid experiment id {experiment_id!r}: use 1 to 64 letters, digits, '_' or '-', not starting with '-'"
        )
    return experiment_id


def is_stream_id(text: str) -> bool:
    """`ms-seq` with both parts unsigned 64-bit integers, as XADD accepts them."""
    if not STREAM_ID.fullmatch(text):
        return False
    ms, seq = stream_position(text)
    return ms < _U64 and seq < _U64


def stored_payload(fields: dict[str, str], experiment_id: str | None = None) -> dict[str, Any]:
    """The entry's JSON object (a compact metric's expanded, with `experiment_id` when given), or {} when it has
    none that parses (unreadable entries too)."""
    try:
        payload = json.loads(fields.get("json", ""))
    except ValueError:
        return {}
    if isinstance(payload, list) and fields.get("type") == METRIC:
        return expanded(payload, fields.get("trial", ""), experiment_id)
    return payload if isinstance(payload, dict) else {}


def stream_position(entry_id: str) -> tuple[int, int]:
    """Stream ids compare as (milliseconds, sequence)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def decode_entry(entry_id: str, fields: dict[str, str], experiment_id: str) -> LogEntry:
    """The entry of `experiment_id`'s log as an event at the current schema version (older versions are upcast), or
    why it cannot be read."""
    if fields.get("json", "").startswith("["):  # a metric in compact form (schemas.compact)
        if (event := _current_metric(fields, experiment_id)) is not None:
            return StoredEvent(entry_id, event)
        try:  # json reads what pydantic's parser refuses, a lone surrogate too: no UTF-8 view or answer could hold it
            payload = encodable(stored_payload(fields, experiment_id))
            return StoredEvent(entry_id, EVENT_ADAPTER.validate_python(upcast(payload)))
        except (ValidationError, ValueError, RecursionError) as error:
            return UnreadableEvent(entry_id, fields, _reason(error))
    try:
        return _stored(entry_id, fields, EVENT_ADAPTER.validate_json(fields["json"]))
    except KeyError as error:
        return UnreadableEvent(entry_id, fields, f"no {error} field")
    except (ValidationError, ValueError, RecursionError) as error:
        first_error = error
    try:
        payload = encodable(json.loads(fields["json"]))
        if isinstance(payload, dict) and (upgraded := upcast(payload)) is not payload:
            return _stored(entry_id, fields, EVENT_ADAPTER.validate_python(upgraded))
    except (ValidationError, ValueError, RecursionError) as error:  # JSON nested too deep: RecursionError
        first_error = error
    return UnreadableEvent(entry_id, fields, _reason(first_error))


def _stored(entry_id: str, fields: dict[str, str], event: Event) -> LogEntry:
    """The entry of `event`; unreadable when it is a trial's whose `trial` field does not name that trial: what
    finds a trial's entries (`events --trial`, the timeline, the projector's reads) reads that field alone."""
    if isinstance(event, TrialEvent) and fields.get("trial") != event.trial_id:
        return UnreadableEvent(
            entry_id, fields, f"its trial field {fields.get('trial')!r} is not its trial {event.trial_id!r}"
        )
    return StoredEvent(entry_id, event)


_METRIC_VALIDATOR = TrialMetricReported.__pydantic_validator__


def _current_metric(fields: dict[str, str], experiment_id: str) -> TrialMetricReported | None:
    """The fast path for most of a log's entries, a compact metric at the current version: validated by its model's
    own validator, with no union dispatch nor upcast. None for any other (then decode_entry's general path reads
    it, the same reasons for an entry that does not read)."""
    if fields.get("type") != METRIC:
        return None
    try:  # pydantic's parser: a few times json's speed; what it does not parse (a lone surrogate) json still reads
        values = from_json(fields["json"])
    except (ValueError, TypeError):
        return None
    if not isinstance(values, list) or len(values) != 8 or values[0] != METRIC_VERSION:
        return None
    try:
        event: TrialMetricReported = _METRIC_VALIDATOR.validate_python(expanded(values, fields["trial"], experiment_id))
    except (ValidationError, KeyError):
        return None
    return event


class PeriodicalMetric(NamedTuple):
    """An intermediate metric in compact form at the current version, read without building its event: most of a
    log's entries, which a projector only lists. It holds what its TrialMetricReported would hold."""

    id: str
    trial_id: str
    time: int
    attempt: int
    parameter_id: str
    sequence: int
    data: str

    @property
    def metric_type(self) -> str:
        return "PERIODICAL"

    @property
    def dedup_key(self) -> str:
        return metric_dedup_key(self.attempt, self.parameter_id, "PERIODICAL", self.sequence)


# What PeriodicalMetric(...) does (namedtuple's own _make), without its Python-level __new__: half the cost of
# building one, once for most entries of a log.
_new_periodical: Callable[[type[PeriodicalMetric], tuple[Any, ...]], PeriodicalMetric] = tuple.__new__


def _periodical(entry_id: str, fields: dict[str, str]) -> PeriodicalMetric | None:
    """The entry as a PeriodicalMetric when each of its values has exactly its field's type, so that its event
    validates as it is (pydantic's lax mode only widens what is accepted); None for any other entry, which the
    general path reads, or rejects with its reason."""
    raw = fields.get("json", "")
    if fields.get("type") != METRIC or not raw.startswith("["):
        return None
    try:
        values = from_json(raw)
    except ValueError:
        return None
    trial_id = fields.get("trial")
    if type(values) is not list or len(values) != 8 or type(trial_id) is not str:
        return None
    version, time, source, attempt, parameter_id, code, sequence, data = values
    if (
        code == "P"
        and type(version) is type(time) is type(attempt) is type(sequence) is int
        and version == METRIC_VERSION
        and type(source) is type(parameter_id) is type(data) is str
    ):
        return _new_periodical(PeriodicalMetric, (entry_id, trial_id, time, attempt, parameter_id, sequence, data))
    return None


def _reason(error: Exception) -> str:
    """One line: for a validation error, its first error and where (`TrialStarted.v: Input should be 2`)."""
    if isinstance(error, ValidationError) and error.errors():
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return f"{where}: {first['msg']}" if where else str(first["msg"])
    return (str(error).splitlines() or [type(error).__name__])[0]


@dataclass(frozen=True)
class RawEntry:
    """A stream entry as stored, its fields as text; bytes that are not UTF-8 come backslash-escaped,
    with `not_utf8` saying why, so one such entry never breaks a reader."""

    id: str
    fields: dict[str, str]
    experiment_id: str  # whose log: a compact metric does not repeat it
    not_utf8: str | None = None

    def decode(self) -> LogEntry:
        if self.not_utf8 is not None:
            return UnreadableEvent(self.id, self.fields, self.not_utf8)
        return decode_entry(self.id, self.fields, self.experiment_id)

    def listed(self) -> PeriodicalMetric | LogEntry:
        """For a reader that only lists intermediate metrics (the projector): those read without their event."""
        if self.not_utf8 is None and (metric := _periodical(self.id, self.fields)) is not None:
            return metric
        return self.decode()


def _from_bytes(entry_id: bytes, fields: dict[bytes, bytes], experiment_id: str) -> RawEntry:
    try:
        text = {name.decode(): value.decode() for name, value in fields.items()}
        return RawEntry(entry_id.decode(), text, experiment_id)
    except UnicodeDecodeError as error:
        lenient = {k.decode(errors="backslashreplace"): v.decode(errors="backslashreplace") for k, v in fields.items()}
        return RawEntry(entry_id.decode(errors="backslashreplace"), lenient, experiment_id, f"not UTF-8: {error}")


def encode_event(event: Event) -> dict[str, str]:
    """Stream fields: `type` and `trial` let readers filter without decoding the JSON; a metric's JSON is its
    compact form (schemas.compact).

    Not validated again: pydantic checked the event when it was built (so never build one with
    `model_construct`), and tests check that every event type reads back as it was written.
    """
    if isinstance(event, TrialMetricReported):
        payload = compact_metric(event)
    else:
        payload = event.model_dump_json(by_alias=True, exclude_none=True)
    return {"type": event.type, "trial": getattr(event, "trial_id", ""), "json": payload}


class EventStore:
    """One experiment's log. With `fence`, every append through this store is refused (`AppendFenced`, nothing
    written) once the fence no longer holds."""

    def __init__(self, client: redis.Redis, experiment_id: str, fence: Fence | None = None) -> None:
        self.client = client
        self.experiment_id = check_experiment_id(experiment_id)
        self.fence = fence
        self.stream = keys.events(experiment_id)
        self._idempotency = keys.idempotency(experiment_id)
        self._append_script = client.register_script(_APPEND)
        self._append_metrics_script = client.register_script(_APPEND_METRICS)
        self._read_keyed_script = client.register_script(_READ_KEYED)

    def _bytes_reply(self, *command: Any) -> Any:
        """`command`'s reply as bytes, for a log holding an entry that is not UTF-8: sent through this store's own
        client (a pipeline's watched connection), on the server the text read met, never through another pool, which
        a failover can leave on a deposed master."""
        return self.client.execute_command(*command, **{NEVER_DECODE: []})

    def raw_range(self, low: str = "-", high: str = "+", count: int | None = None) -> list[RawEntry]:
        """XRANGE as stored; a reply holding bytes that are not UTF-8 is read again as bytes."""
        try:
            entries: Any = self.client.xrange(self.stream, min=low, max=high, count=count)
            return [RawEntry(entry_id, fields, self.experiment_id) for entry_id, fields in entries]
        except UnicodeDecodeError:
            raw: Any = self._bytes_reply("XRANGE", self.stream, low, high, *(() if count is None else ("COUNT", count)))
            return [_from_bytes(entry_id, fields, self.experiment_id) for entry_id, fields in raw]

    def raw_wait(self, after: str, block_ms: int, count: int | None = None) -> list[RawEntry]:
        """XREAD BLOCK as stored, like raw_range."""
        try:
            answer: Any = self.client.xread({self.stream: after}, count=count, block=block_ms)
            found = [entry for _, entries in answer or [] for entry in entries]
            return [RawEntry(entry_id, fields, self.experiment_id) for entry_id, fields in found]
        except UnicodeDecodeError:
            limit = () if count is None else ("COUNT", count)
            answer = self._bytes_reply("XREAD", *limit, "BLOCK", block_ms, "STREAMS", self.stream, after)
            found = [entry for _, entries in answer or [] for entry in entries]
            return [_from_bytes(entry_id, fields, self.experiment_id) for entry_id, fields in found]

    def append(self, event: Event, *, idempotency_key: str | None = None, pipeline: Pipeline | None = None) -> str:
        """Append one event and return its id (the first one's id for a repeated idempotency key).

        With `pipeline`, the append is queued there (to commit atomically with other writes) and
        the return value is empty: the id arrives with the pipeline's results (as a one-item list).
        """
        result = self._run_script(self._append_script, self._arguments([event], [idempotency_key]), pipeline)
        return "" if pipeline is not None else str(result[0])

    def append_all(
        self,
        events: Sequence[Event],
        idempotency_keys: list[str | None] | None = None,
        pipeline: Pipeline | None = None,
    ) -> list[str]:
        """Append several events in one round trip, in order (in batches of 1000, each one atomic).
        With `pipeline`, they are queued there and the ids come with its results."""
        keys_ = idempotency_keys or [None] * len(events)
        if len(keys_) != len(events):
            raise ValueError(f"{len(events)} events but {len(keys_)} idempotency keys")
        if pipeline is not None:
            for start in range(0, len(events), _APPEND_BATCH):
                batch = slice(start, start + _APPEND_BATCH)
                self._run_script(self._append_script, self._arguments(events[batch], keys_[batch]), pipeline)
            return []
        with self.client.pipeline(transaction=False) as pipe:
            for start in range(0, len(events), _APPEND_BATCH):
                batch = slice(start, start + _APPEND_BATCH)
                self._run_script(self._append_script, self._arguments(events[batch], keys_[batch]), pipe)
            try:
                replies = pipe.execute()
            except redis.ResponseError as error:
                raise append_refusal(error) or error from None
        return [str(entry_id) for ids in replies for entry_id in ids]

    def append_metrics(self, trial_id: str, metrics: Sequence[tuple[str, str]], pipeline: Pipeline) -> None:
        """Queue metrics of one trial, each (idempotency key, its compact JSON: schemas.compact.compact_metrics),
        stored as `append_all` stores their events, without an event model, a dict or ten arguments per metric.
        Their ids are not returned: the pipeline's result is how many were new."""
        for start in range(0, len(metrics), _APPEND_BATCH):
            arguments = [trial_id, *itertools.chain.from_iterable(metrics[start : start + _APPEND_BATCH])]
            self._run_script(self._append_metrics_script, arguments, pipeline)

    def append_entries(self, entries: list[tuple[str, dict[str, str]]], pipeline: Pipeline) -> None:
        """Queue entries as stored elsewhere (an imported log), under their own ids and fields, on the
        same path as any append: commands are indexed for the trials' workers, the projector is told.

        The ids must be valid and increasing (`is_stream_id`): a script that fails half-way keeps what
        it wrote, so the caller checks first and cleans up if the pipeline still fails.
        """
        for start in range(0, len(entries), _APPEND_BATCH):
            arguments = []
            for entry_id, fields in entries[start : start + _APPEND_BATCH]:
                arguments += self._entry_arguments("", entry_id, fields)
            self._run_script(self._append_script, arguments, pipeline)

    def _run_script(self, script: Script, arguments: list[str], pipeline: Pipeline | None) -> Any:
        script_keys = [self.stream, self._idempotency, keys.ACTIVITY, keys.ACTIVITY_CLOCK]
        fence = [self.fence.key, self.fence.value] if self.fence is not None else ["", ""]
        try:
            return script(keys=script_keys, args=[self.experiment_id, *fence, *arguments], client=pipeline)
        except redis.ResponseError as error:
            refusal = append_refusal(error)
            if refusal is None:
                raise
            raise refusal from None

    def _arguments(self, events: Sequence[Event], idempotency_keys: list[str | None]) -> list[str]:
        arguments = []
        for event, key in zip(events, idempotency_keys, strict=True):
            if event.experiment_id != self.experiment_id:
                raise ValueError(f"event of experiment {event.experiment_id} appended to {self.experiment_id}")
            arguments += self._entry_arguments(key or "", "*", encode_event(event))
        return arguments

    def _entry_arguments(self, key: str, entry_id: str, fields: dict[str, str]) -> list[str]:
        is_command = fields.get("type") in COMMAND_TYPES and fields.get("trial")
        commands = keys.trial_commands(self.experiment_id, fields["trial"]) if is_command else ""
        pairs = [part for field in fields.items() for part in field]
        return [key, entry_id, commands, str(len(fields)), *pairs]

    def has_key(self, idempotency_key: str) -> bool:
        return bool(self.client.hexists(self._idempotency, idempotency_key))

    def has_keys(self, idempotency_keys: list[str]) -> list[bool]:
        """`has_key` for each, in one round trip."""
        return [entry_id is not None for entry_id in self.client.hmget(self._idempotency, idempotency_keys)]

    def read_keyed(self, idempotency_key: str) -> LogEntry | None:
        """The entry appended under `idempotency_key`, if any, in one round trip; read again as bytes if not UTF-8."""
        try:
            return self.keyed_entry(self.keyed_read(idempotency_key, self.client))
        except UnicodeDecodeError:
            reply = self._bytes_reply("EVAL", _READ_KEYED, 2, self.stream, self._idempotency, idempotency_key)
            return self.keyed_entry(reply)

    def keyed_read(self, idempotency_key: str, client: redis.Redis | Pipeline) -> Any:
        """`read_keyed`'s read, sent through `client` (of this store's server; it may return bytes) or queued on a
        pipeline with other commands. `keyed_entry` decodes its reply."""
        return self._read_keyed_script(keys=[self.stream, self._idempotency], args=[idempotency_key], client=client)

    def keyed_entry(self, reply: Any) -> LogEntry | None:
        """The entry of a `keyed_read` reply, as text or as bytes (not UTF-8: unreadable), or None."""
        if not reply:
            return None
        [(entry_id, flat)] = reply
        fields = dict(zip(flat[::2], flat[1::2], strict=True))
        if isinstance(entry_id, bytes):
            return _from_bytes(entry_id, fields, self.experiment_id).decode()
        return RawEntry(entry_id, fields, self.experiment_id).decode()

    def read(
        self,
        after: str = "0-0",
        until: str = "+",
        count: int | None = None,
        where: Callable[[dict[str, str]], bool] | None = None,
    ) -> list[LogEntry]:
        """Entries strictly after `after`, up to and including `until` (at most `count`); with `where`, only those
        whose stream fields (`type`, `trial`) it accepts, the others skipped without decoding them. Read READ_PAGE
        entries a call: one XRANGE of a whole log (300,000 entries for 10,000 trials) would hold Redis and a
        reply of ~100 MB in memory for as long as it takes."""
        found: list[LogEntry] = []
        left = count
        while left is None or left > 0:
            page = READ_PAGE if left is None else min(left, READ_PAGE)
            entries = self.raw_range(f"({after}", until, page)
            found += [entry.decode() for entry in entries if where is None or where(entry.fields)]
            if len(entries) < page:
                break
            after = entries[-1].id
            left = None if left is None else left - len(entries)
        return found

    def last_id(self) -> str | None:
        """Id of the newest entry, None for an empty log."""
        newest: Any = self.client.xrevrange(self.stream, count=1)
        return str(newest[0][0]) if newest else None

    def read_one(self, entry_id: str) -> LogEntry | None:
        entries = self.raw_range(entry_id, entry_id)
        return entries[0].decode() if entries else None

    def wait(self, after: str, block_ms: int, count: int | None = None) -> list[LogEntry]:
        """Entries after `after`, blocking up to `block_ms` for the first one to arrive."""
        return [entry.decode() for entry in self.raw_wait(after, block_ms, count)]

    def trial_commands(
        self, trial_id: str, after: str = "0-0", block_ms: int | None = None
    ) -> tuple[str, list[LogEntry]]:
        """The commands to one trial (cancels, new parameter sets) appended after position `after` of its
        commands stream, and the position read up to; with `block_ms`, waits that long for the first."""
        stream = keys.trial_commands(self.experiment_id, trial_id)
        if block_ms is None:
            index: Any = self.client.xrange(stream, min=f"({after}")
        else:
            answer: Any = self.client.xread({stream: after}, block=block_ms)
            index = [entry for _, entries in answer or [] for entry in entries]
        if not index:
            return after, []
        return index[-1][0], commands_in_log(self.client, [(self.experiment_id, index)])[0]

    def head(self) -> str:
        """Id of the newest entry, or 0-0 for an empty log."""
        last: Any = self.client.xrevrange(self.stream, count=1)
        return str(last[0][0]) if last else "0-0"

    def length(self) -> int:
        return int(self.client.xlen(self.stream))


CommandsIndex = Sequence[tuple[str, Mapping[str, str]]]
"""Entries of a trial's commands stream (keys.trial_commands): each holds the log id of one command."""


def commands_in_log(client: redis.Redis, indexes: Sequence[tuple[str, CommandsIndex]]) -> list[list[LogEntry]]:
    """The log entries that commands streams' entries point at, for (experiment id, entries) pairs, in
    their order: one round trip for all, so that a worker's one commands reader serves every trial at once.
    Nothing in one trial's commands stops the others': an index entry without an id is skipped, a log
    entry that does not decode comes back unreadable (read again as bytes if it is not UTF-8)."""
    ids = [(experiment_id, [fields["id"] for _, fields in index if "id" in fields]) for experiment_id, index in indexes]
    try:
        with client.pipeline(transaction=False) as pipe:
            for experiment_id, entry_ids in ids:
                for entry_id in entry_ids:
                    pipe.xrange(keys.events(experiment_id), min=entry_id, max=entry_id)
            found: Any = pipe.execute() if any(entry_ids for _, entry_ids in ids) else []
    except UnicodeDecodeError:
        return [
            [entry for entry_id in entry_ids if (entry := EventStore(client, experiment_id).read_one(entry_id))]
            for experiment_id, entry_ids in ids
        ]
    entries, at = [], 0
    for experiment_id, entry_ids in ids:
        hits = found[at : at + len(entry_ids)]
        at += len(entry_ids)
        entries.append([decode_entry(entry_id, fields, experiment_id) for hit in hits for entry_id, fields in hit])
    return entries
