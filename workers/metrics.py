"""Reading the metrics a trial reports, in NNI's two wire formats.

Local trials append `ME` + a six-digit length + JSON + newline records to `$NNI_SYS_DIR/.nni/metrics`
(the length counts the newline); trials on other platforms print `NNISDK_MEb'<json>'` lines. A record
that cannot be read is rejected with a reason and reading goes on: one bad record never costs the
trial or later metrics.

The file is read in bounded chunks and parsed by offsets into one buffer (linear in its size), and
a record is checked against the framing NNI always writes (JSON never holds a raw newline, so a
record's only newline is its last byte): a header whose length is wrong is rejected as soon as the
next newline shows it, not after the trial has written that many bytes more.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

from core.platform import ParsedMetric

MAX_RECORD_BYTES = 1_000_000
READ_LIMIT_BYTES = 4 * MAX_RECORD_BYTES  # what one read_new() reads at most
STDOUT_PREFIX = b"NNISDK_ME"
_HEADER = re.compile(rb"ME(\d{6})")
_PARTIAL_HEADER = re.compile(rb"M(?:E\d{0,5})?\Z")
_HEADER_LEN = 8
_METRIC_TYPES = {"PERIODICAL", "FINAL", "REQUEST_PARAMETER"}


class MetricRejected(ValueError):
    """A record that is malformed or too large; the message says which and why."""


def _check_value(value: Any) -> None:
    """NNI metric values are numbers, or dicts whose `default` is a number."""
    number = value.get("default") if isinstance(value, dict) else value
    if isinstance(number, bool) or not isinstance(number, int | float):
        raise MetricRejected(f"metric value must be a number or a dict with a numeric 'default', got {value!r:.80}")


def _check_unicode(value: Any, what: str) -> None:
    """JSON's escapes can spell a lone surrogate ("\\ud800"), which no UTF-8 encoder (Redis's client,
    the views) accepts: such a record is malformed, never stored."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise MetricRejected(f"metric {what} holds a lone surrogate, which is not valid Unicode") from None


def parse_record(payload: bytes) -> ParsedMetric:
    """Decode one record's JSON payload."""
    if len(payload) > MAX_RECORD_BYTES:
        raise MetricRejected(f"metric record of {len(payload)} bytes exceeds the {MAX_RECORD_BYTES}-byte limit")
    try:
        record = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise MetricRejected(f"metric record is not JSON: {error}") from error
    except RecursionError:
        raise MetricRejected("metric record is nested too deeply") from None
    if not isinstance(record, dict):
        raise MetricRejected("metric record is not a JSON object")
    if b"\\u" in payload:  # only an escape can spell a surrogate: most records skip the check
        _check_unicode(record, "record")
    metric_type = record.get("type")
    if metric_type not in _METRIC_TYPES:
        raise MetricRejected(f"metric record has type {metric_type!r}; expected PERIODICAL, FINAL or REQUEST_PARAMETER")
    sequence = record.get("sequence", 0)
    if isinstance(sequence, bool) or not isinstance(sequence, int):
        raise MetricRejected(f"metric record has a non-integer sequence {sequence!r}")
    value = record.get("value")
    if metric_type != "REQUEST_PARAMETER":
        try:
            decoded = json.loads(value) if isinstance(value, str) else value
            if isinstance(value, str) and "\\u" in value:
                _check_unicode(decoded, "value")
            _check_value(decoded)
        except json.JSONDecodeError as error:
            raise MetricRejected(f"metric value is not JSON: {error}") from error
        except RecursionError:
            raise MetricRejected("metric value is nested too deeply") from None
    encoded = value if isinstance(value, str) else json.dumps(value)
    return ParsedMetric(str(record.get("parameter_id")), metric_type, sequence, json.dumps(encoded))


def parse_stdout_line(line: bytes) -> ParsedMetric | None:
    """The metric in a `NNISDK_MEb'...'` stdout line, or None for any other line."""
    line = line.rstrip(b"\r\n")
    if not line.startswith(STDOUT_PREFIX):
        return None
    if len(line) > MAX_RECORD_BYTES:
        raise MetricRejected(f"metric line of {len(line)} bytes exceeds the {MAX_RECORD_BYTES}-byte limit")
    try:
        payload = ast.literal_eval(line[len(STDOUT_PREFIX) :].decode())
    except (ValueError, SyntaxError, UnicodeDecodeError) as error:
        raise MetricRejected(f"metric line is not a bytes literal: {line[:80]!r}") from error
    if not isinstance(payload, bytes):
        raise MetricRejected(f"metric line is not a bytes literal: {line[:80]!r}")
    return parse_record(payload)


class MetricFileReader:
    """Tails a metrics file, returning whole records as they complete."""

    def __init__(self, path: Path, read_limit: int = READ_LIMIT_BYTES) -> None:
        self.path = path
        self.read_limit = read_limit
        self.behind = False  # the last read stopped at read_limit: more is there already
        self._offset = 0
        self._buffer = b""

    def read_new(self, final: bool = False) -> tuple[list[ParsedMetric], list[str]]:
        """Records completed since the last call, and the problems met; at most `read_limit` bytes
        are read (`behind` then says to call again). `final`: the writer is gone, so a torn tail is
        reported, once the file has been read to its end."""
        try:
            with self.path.open("rb") as file:
                file.seek(self._offset)
                chunk = file.read(self.read_limit)
        except FileNotFoundError:
            chunk = b""
        self.behind = len(chunk) == self.read_limit
        self._offset += len(chunk)
        buffer = self._buffer + chunk if self._buffer else chunk
        position, metrics, problems = parse_records(buffer, final and not self.behind)
        self._buffer = buffer[position:]
        return metrics, problems


def parse_records(buffer: bytes, final: bool) -> tuple[int, list[ParsedMetric], list[str]]:
    """Parse whole records from `buffer`: (where the unparsed rest starts, metrics, problems). For
    readers of a metrics file held elsewhere (over SSH): they keep the rest and their offset."""
    metrics: list[ParsedMetric] = []
    problems: list[str] = []
    position = 0
    size = len(buffer)
    while position < size:
        header = _HEADER.match(buffer, position)
        if header is None:
            rest = buffer[position : position + _HEADER_LEN]
            if len(rest) < _HEADER_LEN and b"ME".startswith(rest[:2]) and not final:
                break  # the start of a header; wait for the rest
            problems.append(f"malformed metric record header {rest!r}; skipped")
            position = _resync(buffer, position)
            continue
        length = int(header.group(1))  # counts the record's closing newline
        end = position + _HEADER_LEN + length
        newline = buffer.find(b"\n", position + _HEADER_LEN, min(end, size))
        if length > MAX_RECORD_BYTES + 1:
            problems.append(f"metric record of {length - 1} bytes exceeds the {MAX_RECORD_BYTES}-byte limit; skipped")
        elif newline != end - 1 and (newline != -1 or size >= end):  # its one newline is not its last byte
            problems.append("metric record length does not match its content; skipped")
        elif newline == -1:
            if not final:
                break
            problems.append("metric record truncated at the end of the file; skipped")
        else:
            try:
                metrics.append(parse_record(buffer[position + _HEADER_LEN : end - 1]))
            except MetricRejected as error:
                problems.append(str(error))
            position = end
            continue
        position = _resync(buffer, position)
    return position, metrics, problems


def _resync(buffer: bytes, position: int) -> int:
    """Where the next plausible record header starts after a bad one at `position`, keeping a header
    still being written; the end of the buffer if there is none."""
    following = _HEADER.search(buffer, position + 1)
    if following:
        return following.start()
    partial = _PARTIAL_HEADER.search(buffer, max(position + 1, len(buffer) - _HEADER_LEN))
    return partial.start() if partial else len(buffer)
