"""Moving an experiment's log between Redis servers as JSON lines.

The file holds the raw stream entries (so unreadable ones move too) with their original ids, and
the idempotency keys, so retried appends stay idempotent after the move. Views are not exported:
they follow from the log.

    {"format": "trialstream-log", "version": 1, "experimentId": ...}
    {"id": "<stream id>", "fields": {"type": ..., "trial": ..., "json": ...}}    one per entry
    {"idempotency": {"<key>": "<stream id>", ...}, "entries": N}
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, TextIO

import redis

from core import keys
from core.event_store import (
    EventStore,
    InvalidExperimentId,
    check_experiment_id,
    is_stream_id,
    stored_payload,
    stream_position,
)
from core.keys import ViewKeys
from manager.training_service import TrainingService
from schemas.events import Event, ExperimentImported, TrialEnded
from schemas.trial import TrialJobStatus

FORMAT = "trialstream-log"
VERSION = 1
_BATCH = 1000


class InvalidLogFile(ValueError):
    pass


class ExperimentExists(RuntimeError):
    pass


@dataclass(frozen=True)
class LogFile:
    experiment_id: str
    entries: list[tuple[str, dict[str, str]]]
    idempotency: dict[str, str]

    @property
    def created_ms(self) -> int:
        """When the experiment was created (its ExperimentCreated time), for the experiments index."""
        for entry_id, fields in self.entries:
            if fields.get("type") == "ExperimentCreated":
                payload = stored_payload(fields)
                if isinstance(payload.get("time"), int):
                    return int(payload["time"])
                return stream_position(entry_id)[0]
        return stream_position(self.entries[0][0])[0]


def export_log(client: redis.Redis, experiment_id: str, out: TextIO) -> int:
    """Write the experiment's log up to its current head; returns the number of entries.

    Appends that land during the export are left out, and so are their idempotency keys, which
    are written in the same script as their entries: the file is the log as it was at one id.
    """
    store = EventStore(client, experiment_id)
    until = store.head()
    out.write(json.dumps({"format": FORMAT, "version": VERSION, "experimentId": experiment_id}) + "\n")
    exported: set[str] = set()
    start = "-"
    while until != "0-0":
        batch = store.raw_range(start, until, _BATCH)  # bytes that are not UTF-8 move backslash-escaped
        for entry in batch:
            out.write(json.dumps({"id": entry.id, "fields": entry.fields}) + "\n")
            exported.add(entry.id)
        if len(batch) < _BATCH:
            break
        start = f"({batch[-1].id}"
    idempotency: Any = client.hgetall(keys.idempotency(experiment_id))
    kept = {key: entry_id for key, entry_id in idempotency.items() if entry_id in exported}
    out.write(json.dumps({"idempotency": kept, "entries": len(exported)}) + "\n")
    return len(exported)


def read_log_file(lines: Iterable[str], name: str = "<stdin>") -> LogFile:
    """Parse and validate a whole file before anything is written; errors name the line."""
    header: dict[str, Any] | None = None
    entries: list[tuple[str, dict[str, str]]] = []
    trailer: dict[str, Any] | None = None
    previous = (0, 0)
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{name}, line {number}"
        try:
            record = json.loads(line)
        except ValueError as error:
            raise InvalidLogFile(f"{where}: not JSON ({error})") from None
        if not isinstance(record, dict):
            raise InvalidLogFile(f"{where}: not a JSON object")
        if header is None:
            header = _check_header(record, where)
        elif trailer is not None:
            raise InvalidLogFile(f"{where}: a line after the trailer")
        elif "idempotency" in record:
            trailer = record
            _check_trailer(trailer, {entry_id for entry_id, _ in entries}, where)
        else:
            entry_id, fields = _check_entry(record, str(header["experimentId"]), previous, where)
            previous = stream_position(entry_id)
            entries.append((entry_id, fields))
    if header is None:
        raise InvalidLogFile(f"{name}: empty, not a trialstream log")
    if trailer is None:
        raise InvalidLogFile(f"{name}: truncated: no trailer line after {len(entries)} entries")
    if trailer["entries"] != len(entries):
        raise InvalidLogFile(f"{name}: the trailer says {trailer['entries']} entries, the file holds {len(entries)}")
    if not entries:
        raise InvalidLogFile(f"{name}: the log has no entries")
    return LogFile(str(header["experimentId"]), entries, dict(trailer["idempotency"]))


def _check_header(record: dict[str, Any], where: str) -> dict[str, Any]:
    if record.get("format") != FORMAT:
        raise InvalidLogFile(f"{where}: not a trialstream log (format {record.get('format')!r}, want {FORMAT!r})")
    if record.get("version") != VERSION:
        raise InvalidLogFile(f"{where}: log format version {record.get('version')!r}; this version reads {VERSION}")
    try:
        check_experiment_id(record.get("experimentId"))  # type: ignore[arg-type]
    except InvalidExperimentId as error:
        raise InvalidLogFile(f"{where}: {error}") from None
    return record


def _check_entry(
    record: dict[str, Any], experiment_id: str, previous: tuple[int, int], where: str
) -> tuple[str, dict[str, str]]:
    entry_id, fields = record.get("id"), record.get("fields")
    if not isinstance(entry_id, str) or not is_stream_id(entry_id):
        raise InvalidLogFile(f"{where}: invalid stream id {entry_id!r}: want MS-SEQ, each an unsigned 64-bit integer")
    if stream_position(entry_id) <= previous:
        raise InvalidLogFile(f"{where}: stream id {entry_id} does not come after the one before it")
    if not isinstance(fields, dict) or not fields or not all(isinstance(v, str) for v in fields.values()):
        raise InvalidLogFile(f"{where}: `fields` must be a non-empty object of strings")
    owner = stored_payload(fields).get("experimentId", experiment_id)
    if owner != experiment_id:
        raise InvalidLogFile(f"{where}: an event of experiment {owner!r} in the log of {experiment_id!r}")
    return entry_id, fields


def _check_trailer(record: dict[str, Any], entry_ids: set[str], where: str) -> None:
    idempotency, count = record.get("idempotency"), record.get("entries")
    if not isinstance(idempotency, dict) or not isinstance(count, int):
        raise InvalidLogFile(f"{where}: the trailer needs an `idempotency` object and an `entries` count")
    for key, entry_id in idempotency.items():
        if entry_id not in entry_ids:
            raise InvalidLogFile(f"{where}: idempotency key {key!r} points at {entry_id!r}, which is not in the log")


def renamed(log: LogFile, experiment_id: str) -> LogFile:
    """The same log under another experiment id: each event's `experimentId` rewritten, nothing else.

    Paths (working directories) keep the old id: they name where the files are.
    """
    try:
        check_experiment_id(experiment_id)
    except InvalidExperimentId as error:
        raise InvalidLogFile(str(error)) from None
    entries = []
    for entry_id, fields in log.entries:
        payload = stored_payload(fields)
        if "experimentId" in payload:
            payload["experimentId"] = experiment_id
            fields = {**fields, "json": json.dumps(payload, separators=(",", ":"), ensure_ascii=False)}
        entries.append((entry_id, fields))
    return replace(log, experiment_id=experiment_id, entries=entries)


def import_log(client: redis.Redis, log: LogFile) -> None:
    """Store the log with its original ids and idempotency keys, mark it imported, and register the
    experiment, all in one MULTI/EXEC, through the event store's append path (so commands are indexed
    for the trials' workers and the projector hears of it).

    Refuses an experiment id that has a log or an index entry already. Stale views of that id are
    dropped in the same transaction: views follow from the log, and this log starts them afresh.
    A write Redis still refuses (the file's checks passed) is undone: nothing is left behind, and
    the import can be tried again.
    """
    store = EventStore(client, log.experiment_id)
    stream, idempotency = keys.events(log.experiment_id), keys.idempotency(log.experiment_id)
    view_pattern = ViewKeys(log.experiment_id).pattern
    with client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(keys.EXPERIMENTS, stream, idempotency)
                if pipe.zscore(keys.EXPERIMENTS, log.experiment_id) is not None or pipe.exists(stream, idempotency):
                    raise ExperimentExists(
                        f"experiment {log.experiment_id!r} already exists in this Redis; "
                        "import it under another id with --experiment-id NEW_ID"
                    )
                stale = list(client.scan_iter(match=view_pattern, count=_BATCH))
                pipe.multi()
                if stale:
                    pipe.delete(*stale)
                store.append_entries(log.entries, pipe)
                store.append(ExperimentImported(experiment_id=log.experiment_id), pipeline=pipe)
                if log.idempotency:
                    pipe.hset(idempotency, mapping=log.idempotency)  # type: ignore[arg-type]
                pipe.zadd(keys.EXPERIMENTS, {log.experiment_id: log.created_ms})
                try:
                    pipe.execute()
                except redis.ResponseError:
                    _undo_import(client, log)
                    raise
                return
            except redis.WatchError:
                continue


def _undo_import(client: redis.Redis, log: LogFile) -> None:
    """Remove what a failed import wrote: every key was new (the import checked), so all of it goes."""
    trials = {fields["trial"] for _, fields in log.entries if fields.get("trial")}
    written = [keys.events(log.experiment_id), keys.idempotency(log.experiment_id)]
    written += [keys.trial_commands(log.experiment_id, trial) for trial in sorted(trials)]
    with client.pipeline(transaction=True) as pipe:
        pipe.delete(*written)
        pipe.zrem(keys.EXPERIMENTS, log.experiment_id)
        pipe.zrem(keys.ACTIVITY, log.experiment_id)
        pipe.execute()


IMPORTED_RUN_GONE = "the run that wrote this log is not here"


def end_imported_trials(service: TrainingService) -> int:
    """End as SYS_CANCELED every trial an imported log left unfinished: no worker here runs it and no
    lease covers it, so it would be waited on forever. Returns how many were ended."""
    unfinished = [trial for trial in service.list_trial_jobs() if not trial.status.is_terminal]
    endings: list[Event] = [
        TrialEnded(
            experiment_id=service.experiment_id,
            trial_id=trial.id,
            attempt=trial.attempt,
            status=TrialJobStatus.SYS_CANCELED,
            message=IMPORTED_RUN_GONE,
        )
        for trial in unfinished
    ]
    if endings:
        service.store.append_all(endings)
    return len(endings)
