"""Compact forms of metrics: in the log (most of its entries) and in the views' metric lists, JSON arrays of values.

    [2, <time>, "<source>", <attempt>, "<parameterId>", "P", <sequence>, "<data>"]

in that order (the first item is the event's version, P/F/R its metricType); the trial is the entry's `trial`
field and the experiment the log's own (its reader passes it). About 50 bytes where the JSON object took ~200.
Entries written before it (objects) read as they always did; `expanded` gives the object a reader of the JSON expects.

A trial's metric list in the views holds each record as

    [<timestamp>, "<parameterId>", "P", <sequence>, "<data>", <attempt>]     (and a 1 after it when late)

(~40 bytes where MetricRecord's JSON took ~120); `metric_record` gives MetricRecord's JSON object back.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from json.encoder import encode_basestring
from typing import Any, Protocol

from schemas.events import TrialMetricReported

METRIC = "TrialMetricReported"
METRIC_VERSION = TrialMetricReported.model_fields["v"].default  # the current one: older ones are upcast
_CODES = {"PERIODICAL": "P", "FINAL": "F", "REQUEST_PARAMETER": "R"}
_TYPES = {code: name for name, code in _CODES.items()}
_STRING: Callable[[str], str] = encode_basestring  # a JSON string as json.dumps writes it with ensure_ascii=False


def compact_metric(event: TrialMetricReported) -> str:
    # What json.dumps(values, separators=(",", ":"), ensure_ascii=False) writes, spelled out as in compact_record:
    # the encoder was a tenth of a worker's CPU when its trials report fast (tests/core/test_compact.py checks both).
    source, parameter_id, data = _STRING(event.source), _STRING(event.parameter_id), _STRING(event.data)
    head = f"[{event.v:d},{event.time:d},{source},{event.attempt:d},{parameter_id}"
    return f'{head},"{_CODES[event.metric_type]}",{event.sequence:d},{data}]'


def compact_metrics(time: int, source: str, attempt: int, metrics: Iterable[tuple[str, str, int, str]]) -> list[str]:
    """compact_metric's text for each (parameterId, metricType, sequence, data) an attempt reported, at `time`, from
    values of the event's types already checked (core.platform.ParsedMetric): a worker builds no event model per
    metric, which was a quarter of its CPU per metric (tests/core/test_compact.py checks the two agree)."""
    head = f"[{METRIC_VERSION:d},{time:d},{_STRING(source)},{attempt:d},"
    codes, string = _CODES, _STRING
    return [
        f'{head}{string(parameter)},"{codes[kind]}",{sequence:d},{string(data)}]'
        for parameter, kind, sequence, data in metrics
    ]


def expanded(values: list[Any], trial_id: str, experiment_id: str | None) -> dict[str, Any]:
    """The event's JSON object from its compact form ({} when `values` is not one); without the experiment (a
    reader that does not know whose log it reads), the object has no experimentId."""
    if len(values) != 8:
        return {}
    version, time, source, attempt, parameter_id, code, sequence, data = values
    payload = {
        "type": METRIC,
        "v": version,
        "experimentId": experiment_id,
        "time": time,
        "source": source,
        "trialId": trial_id,
        "attempt": attempt,
        "parameterId": parameter_id,
        "metricType": _TYPES.get(code, code),
        "sequence": sequence,
        "data": data,
    }
    if experiment_id is None:  # (one literal, then a del: once per metric read, the cheaper way)
        del payload["experimentId"]
    return payload


def periodical_attempt(values: list[Any]) -> int | None:
    """The attempt of an intermediate (PERIODICAL) metric in compact form; None for any other."""
    if len(values) == 8 and values[5] == "P" and isinstance(values[3], int):
        return values[3]
    return None


class Metric(Protocol):
    """What a metric record is made of: a TrialMetricReported, or an entry read without building it
    (core.event_store.PeriodicalMetric)."""

    @property
    def time(self) -> int: ...
    @property
    def attempt(self) -> int: ...
    @property
    def parameter_id(self) -> str: ...
    @property
    def metric_type(self) -> str: ...
    @property
    def sequence(self) -> int: ...
    @property
    def data(self) -> str: ...


def compact_record(event: Metric, late: bool = False) -> str:
    """A metric as the views list it (MetricRecord's fields but the trial, the list's own); `late`: reported after
    its trial ended (listed, never its result)."""
    # What json.dumps writes for the list (as compact_metric), spelled out: a JSON encoding per metric is much of the
    # projector's CPU (tests/core/test_compact.py checks the two agree).
    parameter_id, data = _STRING(event.parameter_id), _STRING(event.data)
    code, tail = _CODES[event.metric_type], ",1]" if late else "]"
    return f'[{event.time:d},{parameter_id},"{code}",{event.sequence:d},{data},{event.attempt:d}{tail}'


def periodical_record(time: int, parameter_id: str, sequence: int, data: str, attempt: int, late: bool) -> str:
    """compact_record of an intermediate metric from its values, each exactly of its type (so no format spec: an int
    prints as `:d` prints it, at a fraction of the cost): a projector lists thousands a second, read without their
    events (tests/core/test_compact.py checks the two agree)."""
    tail = ",1]" if late else "]"
    return f'[{time},{_STRING(parameter_id)},"P",{sequence},{_STRING(data)},{attempt}{tail}'


def metric_record(stored: str, trial_id: str) -> dict[str, Any]:
    """MetricRecord's JSON object from a stored record: compact, or the object written before the compact form."""
    values = json.loads(stored)
    if isinstance(values, dict):
        return values
    timestamp, parameter_id, code, sequence, data, attempt, *late = values
    record = {
        "timestamp": timestamp,
        "trialJobId": trial_id,
        "parameterId": parameter_id,
        "type": _TYPES.get(code, code),
        "sequence": sequence,
        "data": data,
        "attempt": attempt,
    }
    if late:
        record["late"] = True
    return record
