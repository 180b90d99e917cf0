"""Moving a finished experiment's keys out of Redis into an archive, back, and serving reads from a copy.

Each move is atomic where it counts, in Redis: the archive is written first (segments, then its manifest),
then one MULTI under a WATCH of every key moved swaps the keys for a record of where they went (`ARCHIVED`);
a restore or a read stages the keys under temporary names that expire, then renames them into place in one
MULTI. A crash at any step leaves the experiment either in Redis or in its archive, never half in each; what
a dead move wrote elsewhere is an unnamed archive (deleted by the next move) or staged keys (they expire).

An archived experiment keeps its experiment, counts and position views in Redis, so that listings need not
bring it back. Anything that reads more (`resolve_experiment`) thaws it: the keys come back for a while
(`thaw_s`) and go again by themselves; the archive stays the truth. An append to it is refused (the log's
script checks `ARCHIVED`) until `restore` brings it back for good; `resume` does.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis
from pydantic import BaseModel

from core import keys
from core.connections import same_server
from core.event_store import EventStore
from core.keys import ViewKeys
from manager.archive.segments import (
    SEGMENT_BYTES,
    CorruptArchive,
    Manifest,
    Segment,
    digest,
    manifest_name,
    packed,
    segment_name,
    unpacked,
)
from manager.archive.stores import ArchiveStore, ArchiveStoreError, open_store
from manager.projector import Projector
from manager.views import ViewStore

log = logging.getLogger(__name__)

Checkpoint = Callable[[str], None]
"""Called after each step of a move, with its name: tests stop the process there."""

STAGING_TTL_MS = 3_600_000  # staged keys a dead move left behind go after this
_DUMP_BATCH = 256


class ArchiveError(RuntimeError):
    pass


class ArchiveRecord(BaseModel):
    """Where an archived experiment is: the value of its field in `keys.ARCHIVED`."""

    location: str
    endpoint_url: str | None = None
    archive_id: str
    manifest_sha256: str
    archived_ms: int
    size: int  # bytes in the archive
    keys: int
    thaw_s: float  # how long a read-through copy stays in Redis

    def store(self) -> ArchiveStore:
        return open_store(self.location, self.endpoint_url)


def archived(client: redis.Redis, experiment_id: str) -> ArchiveRecord | None:
    raw = client.hget(keys.ARCHIVED, experiment_id)
    return ArchiveRecord.model_validate_json(raw) if raw else None


def archive(
    client: redis.Redis,
    experiment_id: str,
    store: ArchiveStore,
    *,
    thaw_s: float = 3600.0,
    checkpoint: Checkpoint = lambda step: None,
    segment_bytes: int = SEGMENT_BYTES,
) -> ArchiveRecord:
    """Move a finished experiment (no runner holds it) into `store`; its views are brought up to its log first."""
    if archived(client, experiment_id) is not None:
        raise ArchiveError(f"experiment {experiment_id} is archived already")
    _refuse_running(client, experiment_id)
    Projector(client).catch_up(experiment_id)
    owned = sorted(_owned(client, experiment_id))
    kept = ViewKeys(experiment_id).kept_when_archived
    with client.pipeline() as watcher:
        watcher.watch(keys.ARCHIVED, keys.runner(experiment_id), *owned)  # any write to them voids the move
        _refuse_running(watcher, experiment_id)
        archive_id = f"{int(time.time() * 1000)}-{secrets.token_hex(4)}"
        written: list[str] = []
        try:
            record = _write(client, store, experiment_id, archive_id, owned, written, thaw_s, checkpoint, segment_bytes)
        except BaseException:  # nothing moved: what this move wrote goes now (a full disk gets its room back)
            _discard(store, experiment_id, written)
            raise
        watcher.multi()
        gone = [key for key in owned if key not in kept]
        for start in range(0, len(gone), 1000):
            watcher.unlink(*gone[start : start + 1000])
        watcher.hset(keys.ARCHIVED, experiment_id, record.model_dump_json())
        watcher.zrem(keys.ACTIVITY, experiment_id)
        try:
            watcher.execute()
        except redis.WatchError:
            _discard(store, experiment_id, written)
            raise ArchiveError(f"experiment {experiment_id} changed while it was archived; try again") from None
    checkpoint("switched")
    _clean_up(store, experiment_id, keep=archive_id)
    checkpoint("cleaned")
    return record


def _write(
    client: redis.Redis,
    store: ArchiveStore,
    experiment_id: str,
    archive_id: str,
    owned: list[str],
    written: list[str],
    thaw_s: float,
    checkpoint: Checkpoint,
    segment_bytes: int,
) -> ArchiveRecord:
    """Write the experiment's keys to the store as archive `archive_id`: its segments, then its manifest (each
    named in `written` once it is)."""
    log = EventStore(client, experiment_id)
    segments = []
    for index, (data, count) in enumerate(packed(_dumps(client, owned), segment_bytes)):
        name = segment_name(experiment_id, archive_id, index)
        store.put(name, data)
        written.append(name)
        segments.append(Segment(name=name, sha256=digest(data), size=len(data), keys=count))
        checkpoint("segment")
    info: Any = client.info("server")
    manifest = Manifest(
        experiment_id=experiment_id,
        archive_id=archive_id,
        created_ms=int(time.time() * 1000),
        redis_version=str(info["redis_version"]),
        log_head=log.head(),
        log_entries=log.length(),
        keys=owned,
        segments=segments,
    ).model_dump_json()
    store.put(manifest_name(experiment_id, archive_id), manifest.encode())
    written.append(manifest_name(experiment_id, archive_id))
    checkpoint("manifest")
    return ArchiveRecord(
        location=store.location,
        endpoint_url=store.endpoint_url,
        archive_id=archive_id,
        manifest_sha256=digest(manifest.encode()),
        archived_ms=int(time.time() * 1000),
        size=sum(segment.size for segment in segments) + len(manifest),
        keys=len(owned),
        thaw_s=thaw_s,
    )


def restore(client: redis.Redis, experiment_id: str, checkpoint: Checkpoint = lambda step: None) -> int:
    """Bring an archived experiment back into Redis for good, then delete its archive; how many keys came back.
    An experiment that is not archived is left as it is (0)."""
    record = archived(client, experiment_id)
    if record is None:
        return 0
    store = record.store()
    manifest, records = _fetched(store, experiment_id, record)
    checkpoint("fetched")
    staged = _stage(client, experiment_id, records, STAGING_TTL_MS)
    checkpoint("staged")
    with client.pipeline() as pipe:
        try:
            pipe.watch(keys.ARCHIVED)
            if pipe.hget(keys.ARCHIVED, experiment_id) != record.model_dump_json():
                pipe.unwatch()
                _drop(client, staged)
                return 0  # restored meanwhile, by another
            pipe.multi()
            for key, staged_key in staged.items():
                pipe.rename(staged_key, key)
                pipe.persist(key)
            pipe.delete(keys.thawed(experiment_id))
            pipe.hdel(keys.ARCHIVED, experiment_id)
            pipe.execute()
        except redis.WatchError:
            _drop(client, staged)
            return restore(client, experiment_id, checkpoint)  # another move came first: see what it left
    checkpoint("switched")
    _clean_up(store, experiment_id, keep=None)
    checkpoint("cleaned")
    return len(manifest.keys)


def thaw(client: redis.Redis, experiment_id: str) -> None:
    """Make an archived experiment readable for a while (its record's thaw_s; at least half of it from now).
    Nothing to do for one in Redis. A Redis user that may not write (`viewer`) reads a copy another user
    thawed, as long as it lasts, and is told what to do when there is none."""
    record = archived(client, experiment_id)
    if record is None:
        return
    try:
        _thaw(client, experiment_id, record)
    except redis.exceptions.NoPermissionError:
        if int(client.pttl(keys.thawed(experiment_id))) > 0:
            return
        raise ArchiveError(
            f"experiment {experiment_id} is archived and this Redis user may not bring it back to be read: read it "
            f"as a user that may (the manager's), or restore it first (`trialstream experiments restore "
            f"{experiment_id}`)"
        ) from None


def _thaw(client: redis.Redis, experiment_id: str, record: ArchiveRecord) -> None:
    ttl_ms = int(record.thaw_s * 1000)
    marker = keys.thawed(experiment_id)
    if int(client.pttl(marker)) > ttl_ms // 2:
        return
    kept = ViewKeys(experiment_id).kept_when_archived
    thawed: list[str] = list(client.smembers(marker))  # type: ignore[arg-type]
    staged: dict[str, str] = {}
    if not thawed:  # not (or no longer) in Redis: from the archive
        _, records = _fetched(record.store(), experiment_id, record)
        staged = _stage(client, experiment_id, ((key, payload) for key, payload in records if key not in kept), ttl_ms)
    with client.pipeline() as pipe:
        try:
            pipe.watch(keys.ARCHIVED, marker)
            if pipe.hget(keys.ARCHIVED, experiment_id) != record.model_dump_json():
                pipe.unwatch()
                _drop(client, staged)
                return  # restored (or archived again) meanwhile
            pipe.multi()
            for key, staged_key in staged.items():
                pipe.rename(staged_key, key)
            for key in [*staged, *thawed]:
                pipe.pexpire(key, ttl_ms)
            if staged:
                pipe.sadd(marker, *staged)
            pipe.pexpire(marker, ttl_ms)
            pipe.execute()
        except redis.WatchError:
            _drop(client, staged)
            thaw(client, experiment_id)  # another thaw or restore came first


def forget(record: ArchiveRecord, experiment_id: str) -> None:
    """Delete an experiment's archive (after the experiment was deleted from Redis)."""
    _clean_up(record.store(), experiment_id, keep=None)


def _refuse_running(client: Any, experiment_id: str) -> None:
    holder = client.get(keys.runner(experiment_id))
    if holder is not None:
        raise ArchiveError(f"experiment {experiment_id} is running ({holder}): stop it first")
    view = ViewStore(client, experiment_id).experiment()
    if view is None or view.status == "RUNNING":
        raise ArchiveError(f"experiment {experiment_id} has not finished: only an ended one is archived")


def experiment_keys(client: redis.Redis, experiment_id: str) -> set[str]:
    """Every key of the experiment's own: its log and what serves it, its views in every namespace (not its
    jobs, nor its entries in shared keys)."""
    pattern_id = glob_escaped(experiment_id)
    found = set(client.scan_iter(match=f"{keys.LOG_PREFIX}:exp:{pattern_id}:*", count=1000))
    found |= set(client.scan_iter(match=f"*:view:{pattern_id}:*", count=1000))
    return {str(key) for key in found}


def glob_escaped(text: str) -> str:
    """`text` matched literally in a SCAN pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _owned(client: redis.Redis, experiment_id: str) -> set[str]:
    """The experiment's keys but its secrets (they never leave Redis), its runner's claim (there is none) and
    what a dead move staged."""
    left_out = (keys.legacy_secrets(experiment_id), keys.staging(experiment_id, ""))  # secrets, a dead move's keys
    return {key for key in experiment_keys(client, experiment_id) if not key.startswith(left_out)} - {
        keys.runner(experiment_id),
        keys.thawed(experiment_id),
    }


def _dumps(client: redis.Redis, names: list[str]) -> Iterator[tuple[str, bytes]]:
    """Each key's DUMP (bytes, whatever `client` decodes), through the client whose transaction deletes the keys: a
    client of another pool could still read a master a failover deposed, and the move would drop what it missed."""
    for start in range(0, len(names), _DUMP_BATCH):
        batch = names[start : start + _DUMP_BATCH]
        with client.pipeline(transaction=False) as pipe:
            for name in batch:
                pipe.dump(name)
            payloads = pipe.execute()
        for name, payload in zip(batch, payloads, strict=True):
            if payload is None:
                raise ArchiveError(f"{name} went while it was archived; try again")
            yield name, payload


Records = list[tuple[str, bytes]]


def _fetched(store: ArchiveStore, experiment_id: str, record: ArchiveRecord) -> tuple[Manifest, Records]:
    name = manifest_name(experiment_id, record.archive_id)
    data = store.get(name)
    if digest(data) != record.manifest_sha256:
        raise CorruptArchive(f"{store.location}/{name}: its SHA-256 is not the one recorded; the archive is damaged")
    manifest = Manifest.model_validate_json(data)
    try:
        records = [record for segment in manifest.segments for record in unpacked(segment, store.get(segment.name))]
    except CorruptArchive as damaged:
        raise CorruptArchive(f"{store.location}/{damaged}") from None
    if [key for key, _ in records] != manifest.keys:
        raise ArchiveError(f"{store.location}: {experiment_id}'s archive holds other keys than its manifest says")
    return manifest, records


def _stage(client: redis.Redis, experiment_id: str, records: Any, ttl_ms: int) -> dict[str, str]:
    """RESTORE each record under a staging name that expires; key -> its staging name."""
    prefix = keys.staging(experiment_id, secrets.token_hex(4))
    staged = {}
    raw = same_server(client, decode=False)
    with raw.pipeline(transaction=False) as pipe:
        for index, (key, payload) in enumerate(records):
            staged[key] = prefix + key
            pipe.restore(prefix + key, ttl_ms, payload, replace=True)
            if index % _DUMP_BATCH == _DUMP_BATCH - 1:
                pipe.execute()
        pipe.execute()
    return staged


def _drop(client: redis.Redis, staged: dict[str, str]) -> None:
    names = list(staged.values())
    for start in range(0, len(names), 1000):
        client.unlink(*names[start : start + 1000])


def _delete_other_archives(store: ArchiveStore, experiment_id: str, keep: str | None) -> None:
    """Delete the experiment's archives but `keep`: those of earlier moves, and any a dead move left unnamed."""
    kept = f"{experiment_id}/{keep}/" if keep else None
    stale = [name for name in store.names(f"{experiment_id}/") if kept is None or not name.startswith(kept)]
    if stale:
        store.delete(stale)


def _clean_up(store: ArchiveStore, experiment_id: str, keep: str | None) -> None:
    """`_delete_other_archives` once a move took effect in Redis: a store that fails now (read-only, credentials
    that may not list or delete) leaves files that the next move deletes, and the move stands; said so."""
    try:
        _delete_other_archives(store, experiment_id, keep)
    except ArchiveStoreError as error:
        log.warning(
            "experiment %s: its archive in %s could not be deleted (%s); the next archive of it deletes it, or "
            "delete %s/%s/ by hand",
            experiment_id,
            store.location,
            error,
            store.location,
            experiment_id,
            extra={"experiment": experiment_id},
        )


def _discard(store: ArchiveStore, experiment_id: str, written: list[str]) -> None:
    """Delete what a move that failed before it took effect wrote, as far as the store lets it (the next move
    deletes the rest)."""
    if not written:
        return
    try:
        store.delete(written)
    except ArchiveStoreError as error:
        log.warning("experiment %s: what its failed archive wrote stays for now: %s", experiment_id, error)
