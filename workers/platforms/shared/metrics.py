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
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import Any

from pydantic_core import from_json

from core.platform import ParsedMetric
from workers.platforms.shared.metric_framing import (
    MAX_RECORD_BYTES,
    READ_LIMIT_BYTES,
    REJECTED_NOTICE,
    Frame,
    FramingProblem,
    RecordTail,
    split_records,
)

STDOUT_PREFIX = b"NNISDK_ME"
_METRIC_TYPES = {"PERIODICAL", "FINAL", "REQUEST_PARAMETER"}
_INT64 = 1 << 63  # a sequence is stored and compared as one


class MetricRejected(ValueError):
    """A record that is malformed or too large; the message says which and why."""


def _check_value(value: Any) -> None:
    """NNI metric values are numbers, or dicts whose `default` is a number; tuners compare them as floats, so an
    integer past a float's range (JSON allows `1e400` as an integer's digits) is no metric."""
    number = value.get("default") if isinstance(value, dict) else value
    if isinstance(number, bool) or not isinstance(number, int | float):
        raise MetricRejected(f"metric value must be a number or a dict with a numeric 'default', got {value!r:.80}")
    try:
        float(number)
    except OverflowError:
        bits = int(number).bit_length()
        raise MetricRejected(f"metric value is an integer of {bits} bits, too large for a float") from None


def _check_unicode(value: Any, what: str) -> None:
    """JSON's escapes can spell a lone surrogate ("\\ud800"), which no UTF-8 encoder (Redis's client,
    the views) accepts: such a record is malformed, never stored."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise MetricRejected(f"metric {what} holds a lone surrogate, which is not valid Unicode") from None
    except RecursionError:
        raise MetricRejected(f"metric {what} is nested too deeply") from None


def _loads(text: bytes | str) -> tuple[Any, bool]:
    """What json.loads returns, and whether it may hold a lone surrogate. Parsed by pydantic's parser where it can
    (~3x faster: the record and its value were half of a worker's CPU per metric), which refuses lone surrogates and
    a few more texts json reads (a BOM, UTF-16, nesting past 200): json reads those, and fails with its own error, as
    it did before. It never accepts a text json refuses nor reads one otherwise (compared on edge cases, every
    sequence of up to three surrogate escapes, and 600,000 random texts)."""
    try:
        return from_json(text), False
    except (ValueError, TypeError):  # TypeError: a str holding a lone surrogate, which is no UTF-8
        return json.loads(text), True


def parse_record(payload: bytes) -> ParsedMetric:
    """Decode one record's JSON payload."""
    if len(payload) > MAX_RECORD_BYTES:
        raise MetricRejected(f"metric record of {len(payload)} bytes exceeds the {MAX_RECORD_BYTES}-byte limit")
    try:
        record, unchecked = _loads(payload)
    except ValueError as error:  # not UTF-8, not JSON, or an integer past Python's 4,300 digits
        raise MetricRejected(f"metric record is not JSON: {error}") from error
    except RecursionError:
        raise MetricRejected("metric record is nested too deeply") from None
    if not isinstance(record, dict):
        raise MetricRejected("metric record is not a JSON object")
    if unchecked and b"\\u" in payload:  # only json reads a lone surrogate, and only an escape spells one
        _check_unicode(record, "record")
    metric_type = record.get("type")
    if metric_type not in _METRIC_TYPES:
        raise MetricRejected(f"metric record has type {metric_type!r}; expected PERIODICAL, FINAL or REQUEST_PARAMETER")
    sequence = _sequence(record.get("sequence", 0))
    value = record.get("value")
    if metric_type != "REQUEST_PARAMETER":
        _check_value(_decoded_value(value))
    encoded = value if isinstance(value, str) else json.dumps(value)
    return ParsedMetric(str(record.get("parameter_id")), metric_type, sequence, encode_basestring_ascii(encoded))


def _sequence(sequence: Any) -> int:
    if isinstance(sequence, bool) or not isinstance(sequence, int):
        raise MetricRejected(f"metric record has a non-integer sequence {sequence!r}")
    if not -_INT64 <= sequence < _INT64:
        raise MetricRejected("metric record has a sequence past a 64-bit integer's range")
    return sequence


def _decoded_value(value: Any) -> Any:
    """The metric's value: NNI's SDK sends it JSON-encoded in the record's JSON."""
    if not isinstance(value, str):
        return value
    try:
        decoded, unchecked = _loads(value)
    except ValueError as error:  # not JSON, or an integer past Python's 4,300 digits
        raise MetricRejected(f"metric value is not JSON: {error}") from error
    except RecursionError:
        raise MetricRejected("metric value is nested too deeply") from None
    if unchecked and "\\u" in value:
        _check_unicode(decoded, "value")
    return decoded


def parse_stdout_line(line: bytes) -> ParsedMetric | None:
    """The metric in a `NNISDK_MEb'...'` stdout line, or None for any other line.

    NNI's SDK prints the record's JSON as it is between `b'` and `'` (its manager takes what the
    quotes enclose and parses it as JSON), so that is read first; a Python bytes literal (`repr` of
    the encoded record, as some trial code prints it) is the fallback when the raw text is not JSON.
    """
    line = line.rstrip(b"\r\n")
    if not line.startswith(STDOUT_PREFIX):
        return None
    if line.startswith(REJECTED_NOTICE):  # the pod keeper met bytes of the metrics file that are no record
        raise MetricRejected(line[len(REJECTED_NOTICE) : len(REJECTED_NOTICE) + 200].decode(errors="replace"))
    if len(line) > MAX_RECORD_BYTES:
        raise MetricRejected(f"metric line of {len(line)} bytes exceeds the {MAX_RECORD_BYTES}-byte limit")
    literal = line[len(STDOUT_PREFIX) :]
    if literal.startswith(b"b'") and literal.endswith(b"'") and len(literal) >= 3:
        raw = literal[2:-1]
        try:
            json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            pass
        else:
            return parse_record(raw)
    try:
        payload = ast.literal_eval(literal.decode())
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError) as error:
        raise MetricRejected(f"metric line is not a bytes literal: {line[:80]!r}") from error
    if not isinstance(payload, bytes):
        raise MetricRejected(f"metric line is not a bytes literal: {line[:80]!r}")
    return parse_record(payload)


class MetricFileReader:
    """Tails a metrics file, returning whole records as they complete (framed by `metric_framing`)."""

    def __init__(self, path: Path, read_limit: int = READ_LIMIT_BYTES) -> None:
        self._tail = RecordTail(path, read_limit)

    @property
    def path(self) -> Path:
        return self._tail.path

    @property
    def behind(self) -> bool:
        """The last read stopped at its limit: more is there already."""
        return self._tail.behind

    def read_new(self, final: bool = False) -> tuple[list[ParsedMetric], list[str]]:
        """Records completed since the last call, and the problems met; see `RecordTail.read_new`."""
        return parse_frames(self._tail.read_new(final))


def parse_records(buffer: bytes, final: bool) -> tuple[int, list[ParsedMetric], list[str]]:
    """Parse whole records from `buffer`: (where the unparsed rest starts, metrics, problems). For
    readers of a metrics file held elsewhere (over SSH): they keep the rest and their offset."""
    position, frames = split_records(buffer, final)
    return (position, *parse_frames(frames))


def parse_frames(frames: list[Frame]) -> tuple[list[ParsedMetric], list[str]]:
    """The metrics in framed records, and every problem met (framing or content), in file order."""
    metrics: list[ParsedMetric] = []
    problems: list[str] = []
    for frame in frames:
        if isinstance(frame, FramingProblem):
            problems.append(str(frame))
            continue
        try:
            metrics.append(parse_record(frame))
        except MetricRejected as error:
            problems.append(str(error))
    return metrics, problems
