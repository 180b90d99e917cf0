"""The archive's format: an experiment's Redis keys as Redis serialized them (DUMP), in compressed segments.

    <experiment>/<archive id>/segment-00000.zz ...   zlib streams of records: u32 name length, name, u64
                                                     payload length, payload (DUMP's, with its own CRC64)
    <experiment>/<archive id>/manifest.json          the Manifest below, written last: its segments' SHA-256

DUMP keeps every key exactly (a stream's ids, its last id, encodings) and RESTORE is Redis's own inverse; a
payload restores on the Redis version that wrote it or a newer one (the manifest says which). For a copy any
tool reads, `trialstream export` writes the log as JSON lines.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Iterable, Iterator
from typing import Literal

from pydantic import BaseModel

FORMAT: Literal["trialstream-archive"] = "trialstream-archive"
SEGMENT_BYTES = 16 * 2**20  # a segment closes once its records pass this (uncompressed)
_NAME = struct.Struct(">I")
_PAYLOAD = struct.Struct(">Q")


class CorruptArchive(RuntimeError):
    pass


class Segment(BaseModel):
    name: str
    sha256: str
    size: int  # bytes, compressed
    keys: int


class Manifest(BaseModel):
    format: Literal["trialstream-archive"] = FORMAT
    version: Literal[1] = 1
    experiment_id: str
    archive_id: str
    created_ms: int
    redis_version: str
    log_head: str
    log_entries: int
    keys: list[str]
    segments: list[Segment]


def segment_name(experiment_id: str, archive_id: str, index: int) -> str:
    return f"{experiment_id}/{archive_id}/segment-{index:05d}.zz"


def manifest_name(experiment_id: str, archive_id: str) -> str:
    return f"{experiment_id}/{archive_id}/manifest.json"


def packed(records: Iterable[tuple[str, bytes]], segment_bytes: int = SEGMENT_BYTES) -> Iterator[tuple[bytes, int]]:
    """(compressed segment, keys in it) for the (key, DUMP payload) records, in order."""
    parts: list[bytes] = []
    size = count = 0
    for key, payload in records:
        name = key.encode()
        parts += [_NAME.pack(len(name)), name, _PAYLOAD.pack(len(payload)), payload]
        size += _NAME.size + len(name) + _PAYLOAD.size + len(payload)
        count += 1
        if size >= segment_bytes:
            yield zlib.compress(b"".join(parts), 6), count
            parts, size, count = [], 0, 0
    if count:
        yield zlib.compress(b"".join(parts), 6), count


def unpacked(segment: Segment, data: bytes) -> Iterator[tuple[str, bytes]]:
    """The records of a segment, once its checksum is the manifest's."""
    if digest(data) != segment.sha256:
        raise CorruptArchive(f"{segment.name}: its SHA-256 is not the manifest's; the archive is damaged")
    raw = zlib.decompress(data)
    offset = 0
    while offset < len(raw):
        (length,) = _NAME.unpack_from(raw, offset)
        offset += _NAME.size
        key = raw[offset : offset + length].decode()
        offset += length
        (length,) = _PAYLOAD.unpack_from(raw, offset)
        offset += _PAYLOAD.size
        yield key, raw[offset : offset + length]
        offset += length


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
