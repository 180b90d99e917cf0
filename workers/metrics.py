"""Reading the metrics a trial reports, in NNI's two wire formats.

Local trials append `ME` + a six-digit length + JSON + newline records to `$NNI_SYS_DIR/.nni/metrics`
(the length counts the newline); trials on other platforms print `NNISDK_MEb'<json>'` lines. A record
that cannot be read is rejected with a reason and reading goes on: one bad record never costs the
trial or later metrics.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

from core.platform import ParsedMetric

MAX_RECORD_BYTES = 1_000_000
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
    metric_type = record.get("type")
    if metric_type not in _METRIC_TYPES:
        raise MetricRejected(f"metric record has type {metric_type!r}; expected PERIODICAL, FINAL or REQUEST_PARAMETER")
    sequence = record.get("sequence", 0)
    if isinstance(sequence, bool) or not isinstance(sequence, int):
        raise MetricRejected(f"metric record has a non-integer sequence {sequence!r}")
    value = record.get("value")
    if metric_type != "REQUEST_PARAMETER":
        try:
            _check_value(json.loads(value) if isinstance(value, str) else value)
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

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._buffer = b""

    def read_new(self, final: bool = False) -> tuple[list[ParsedMetric], list[str]]:
        """Records completed since the last call, and the problems met; `final` also reports a torn tail."""
        try:
            with self.path.open("rb") as file:
                file.seek(self._offset)
                chunk = file.read()
        except FileNotFoundError:
            chunk = b""
        self._offset += len(chunk)
        self._buffer += chunk
        metrics: list[ParsedMetric] = []
        problems: list[str] = []
        while self._buffer:
            header = _HEADER.match(self._buffer)
            if header is None:
                if len(self._buffer) < _HEADER_LEN and b"ME".startswith(self._buffer[:2]) and not final:
                    break  # the start of a header; wait for the rest
                problems.append(f"malformed metric record header {self._buffer[:_HEADER_LEN]!r}; skipped")
                self._resync()
                continue
            end = _HEADER_LEN + int(header.group(1))  # the length counts the record's closing newline
            if len(self._buffer) < end:
                if not final:
                    break
                problems.append("metric record truncated at the end of the file; skipped")
                self._resync()
                continue
            if self._buffer[end - 1 : end] != b"\n":
                problems.append("metric record length does not match its content; skipped")
                self._resync()
                continue
            try:
                metrics.append(parse_record(self._buffer[_HEADER_LEN : end - 1]))
            except MetricRejected as error:
                problems.append(str(error))
            self._buffer = self._buffer[end:]
        return metrics, problems

    def _resync(self) -> None:
        """Drop bytes up to the next plausible record header, keeping a header still being written."""
        following = _HEADER.search(self._buffer, 1)
        if following:
            self._buffer = self._buffer[following.start() :]
            return
        partial = _PARTIAL_HEADER.search(self._buffer, 1)
        self._buffer = self._buffer[partial.start() :] if partial else b""
