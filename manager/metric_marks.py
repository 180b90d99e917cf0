"""Which metrics the views hold already, without a Redis key per metric.

A trial reports each of its streams (attempt, parameter, type) with sequences 0, 1, 2, ...: per stream the
projector keeps the range [low, high) of sequences that are all projected (`"low high"` in the `metric-marks`
hash, ~30 bytes a stream), and only a sequence outside it (out of order, after a gap) as a member of the
`metric-keys` set, as every metric was before (~64 bytes each). Exact either way: a metric is new iff it was
never projected. A range grows by one at either end as the next sequence comes, taking in an out-of-order
one when it is delivered again. Views written before the ranges hold every metric in the set: still exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from core.keys import ViewKeys

Candidates = dict[str, tuple[str, str]]
"""`trial|attempt|parameter|type|sequence` -> (trial id, metric record), in log order."""


@dataclass
class NewMetrics:
    """A batch's metrics not projected before, and what to write so that the next batch knows them."""

    records: Candidates = field(default_factory=dict)
    ranges: dict[str, list[int]] = field(default_factory=dict)  # stream -> [low, high], those changed
    added: set[str] = field(default_factory=set)  # set members: metrics outside their stream's range
    removed: set[str] = field(default_factory=set)  # set members a range took in

    def write(self, pipe: Any, view_keys: ViewKeys) -> None:
        """In the batch's MULTI."""
        if self.ranges:
            pipe.hset(view_keys.metric_marks, mapping={s: f"{low} {high}" for s, (low, high) in self.ranges.items()})
        if self.added:
            pipe.sadd(view_keys.metric_keys, *self.added)
        if self.removed:
            pipe.srem(view_keys.metric_keys, *self.removed)


def new_metrics(pipe: Any, view_keys: ViewKeys, candidates: Candidates) -> NewMetrics:
    """Read (under the batch's WATCH) what is known of the candidates' streams; the candidates not projected.

    Once per metric of a log, so written for speed: each key is split once, ranges tested inline."""
    found = NewMetrics()
    if not candidates:
        return found
    split: dict[str, tuple[str, int]] = {}
    for key in candidates:
        stream, _, text = key.rpartition("|")
        split[key] = (stream, int(text))
    streams = list(dict.fromkeys(stream for stream, _ in split.values()))
    ranges: dict[str, list[int]] = {}
    for stream, mark in zip(streams, pipe.hmget(view_keys.metric_marks, streams), strict=True):
        if mark:
            low, high = mark.split()
            ranges[stream] = [int(low), int(high)]
    outside = [key for key, (stream, sequence) in split.items() if not _within(ranges.get(stream), sequence)]
    if outside and not pipe.scard(view_keys.metric_keys):  # none outside a range (a log delivered in order): no look-up
        outside = []
    members = {
        key
        for key, known in zip(outside, pipe.smismember(view_keys.metric_keys, outside) if outside else [], strict=True)
        if known
    }
    records, changed, added, removed = found.records, found.ranges, found.added, found.removed
    for key, candidate in candidates.items():
        stream, sequence = split[key]
        marks = ranges.get(stream)
        if marks is not None and marks[0] <= sequence < marks[1]:
            continue
        known = (key in members and key not in removed) or key in added
        if marks is None or sequence == marks[1] or sequence == marks[0] - 1:  # the range grows by one at an end
            if marks is None:
                ranges[stream] = changed[stream] = [sequence, sequence + 1]
            else:
                marks[0], marks[1] = min(marks[0], sequence), max(marks[1], sequence + 1)
                changed[stream] = marks
            if known:
                removed.add(key)
                added.discard(key)
        elif not known:
            added.add(key)
        if not known:
            records[key] = candidate
    return found


def _within(marks: list[int] | None, sequence: int) -> bool:
    return marks is not None and marks[0] <= sequence < marks[1]
