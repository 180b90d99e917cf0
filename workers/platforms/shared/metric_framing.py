"""The framing of NNI's metrics file: `ME` + a six-digit length + JSON + newline records (the length counts
the newline), split into whole records and framing problems, in bounded reads by offset.

Standard library only, Python >= 3.8: besides serving `workers/metrics.py`, this file is shipped next to
`workers/pod_keeper.py` into trial pods and jobs, so the keeper frames records exactly as a worker does.

A record is checked against the framing NNI always writes (JSON never holds a raw newline, so a record's
only newline is its last byte): a header whose length is wrong is reported as soon as the next newline
shows it, not after the trial has written that many bytes more, and reading resumes at the next header.
One bad record never costs later ones.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Union

MAX_RECORD_BYTES = 1_000_000
READ_LIMIT_BYTES = 4 * MAX_RECORD_BYTES  # what one `RecordTail.read_new()` reads at most
HEADER_LEN = 8
# A line the keeper prints for bytes of the file that are no record; a worker reads it as a rejected metric
REJECTED_NOTICE = b"NNISDK_ME_REJECTED: "
_HEADER = re.compile(rb"ME(\d{6})")
_PARTIAL_HEADER = re.compile(rb"M(?:E\d{0,5})?\Z")


class FramingProblem(str):
    """Why some bytes of the file are no record (they are skipped): a message for the trial's owner."""


# a record's JSON payload (without its newline), or a problem; `Union`: evaluated at run time, on Python 3.8 too
Frame = Union[bytes, FramingProblem]  # noqa: UP007


def split_records(buffer: bytes, final: bool) -> tuple[int, list[Frame]]:
    """Whole records and framing problems in `buffer`, in file order, and where its unread rest starts.
    `final`: nothing more will be written, so a torn tail is a problem rather than a record to wait for."""
    frames: list[Frame] = []
    position = 0
    size = len(buffer)
    while position < size:
        header = _HEADER.match(buffer, position)
        if header is None:
            rest = buffer[position : position + HEADER_LEN]
            if len(rest) < HEADER_LEN and b"ME".startswith(rest[:2]) and not final:
                break  # the start of a header; wait for the rest
            frames.append(FramingProblem(f"malformed metric record header {rest!r}; skipped"))
            position = _resync(buffer, position)
            continue
        length = int(header.group(1))  # counts the record's closing newline
        end = position + HEADER_LEN + length
        newline = buffer.find(b"\n", position + HEADER_LEN, min(end, size))
        if length > MAX_RECORD_BYTES + 1:
            problem = f"metric record of {length - 1} bytes exceeds the {MAX_RECORD_BYTES}-byte limit; skipped"
            frames.append(FramingProblem(problem))
        elif newline != end - 1 and (newline != -1 or size >= end):  # its one newline is not its last byte
            frames.append(FramingProblem("metric record length does not match its content; skipped"))
        elif newline == -1:
            if not final:
                break
            frames.append(FramingProblem("metric record truncated at the end of the file; skipped"))
        else:
            frames.append(buffer[position + HEADER_LEN : end - 1])
            position = end
            continue
        position = _resync(buffer, position)
    return position, frames


def _resync(buffer: bytes, position: int) -> int:
    """Where the next plausible record header starts after a bad one at `position`, keeping a header
    still being written; the end of the buffer if there is none."""
    following = _HEADER.search(buffer, position + 1)
    if following:
        return following.start()
    partial = _PARTIAL_HEADER.search(buffer, max(position + 1, len(buffer) - HEADER_LEN))
    return partial.start() if partial else len(buffer)


class RecordTail:
    """Tails a metrics file on this machine, returning whole records as they complete."""

    def __init__(self, path: Path, read_limit: int = READ_LIMIT_BYTES) -> None:
        self.path = path
        self.read_limit = read_limit
        self.behind = False  # the last read stopped at read_limit: more is there already
        self._offset = 0
        self._buffer = b""

    def read_new(self, final: bool = False) -> list[Frame]:
        """What was completed since the last call; at most `read_limit` bytes are read (`behind` then
        says to call again). `final`: the writer is gone, so a torn tail is reported, once the file has
        been read to its end."""
        try:
            with self.path.open("rb") as file:
                file.seek(self._offset)
                chunk = file.read(self.read_limit)
        except FileNotFoundError:
            chunk = b""
        self.behind = len(chunk) == self.read_limit
        self._offset += len(chunk)
        buffer = self._buffer + chunk if self._buffer else chunk
        position, frames = split_records(buffer, final and not self.behind)
        self._buffer = buffer[position:]
        return frames
