"""Which metrics the views hold already, without a Redis key per metric.

A trial reports each of its streams (attempt, parameter, type) with sequences 0, 1, 2, ...: per stream the
projector keeps the range [low, high) of sequences that are all projected (`"low high"` in the `metric-marks`
hash, ~30 bytes a stream), and only a sequence outside it (out of order, after a gap) as a member of the
`metric-keys` set, as every metric was before (~64 bytes each). Exact either way: a metric is new iff it was
never projected. A range grows by one at either end as the next sequence comes, taking in an out-of-order
one when it is delivered again. Views written before the ranges hold every metric in the set: still exact.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from core.keys import ViewKeys

Stream = tuple[str, int, str, str]
"""A trial's metric stream: (trial, attempt, parameter, type)."""
Candidates = dict[tuple[Stream, int], tuple[str, str]]
"""(stream, sequence) -> (trial id, metric record), in log order: no metric's key is built as text (nor split
again) unless it is kept outside its stream's range, and each stream's name once a batch."""


def stream_name(stream: Stream) -> str:
    """The stream as the `metric-marks` hash names it, `trial|attempt|parameter|type`; a metric's member of
    `metric-keys` is `name|sequence`: its trial and its dedup key (schemas.trial.metric_dedup_key)."""
    trial_id, attempt, parameter_id, metric_type = stream
    return f"{trial_id}|{attempt}|{parameter_id}|{metric_type}"


@dataclass
class NewMetrics:
    """A batch's metrics not projected before, and what to write so that the next batch knows them."""

    records: Candidates = field(default_factory=dict)
    ranges: dict[Stream, list[int]] = field(default_factory=dict)  # stream -> [low, high], those changed
    added: set[tuple[Stream, int]] = field(default_factory=set)  # set members: metrics outside their stream's range
    removed: set[tuple[Stream, int]] = field(default_factory=set)  # set members a range took in

    def write(self, pipe: Any, view_keys: ViewKeys) -> None:
        """In the batch's MULTI."""
        if self.ranges:
            marks = {stream_name(stream): f"{low} {high}" for stream, (low, high) in self.ranges.items()}
            pipe.hset(view_keys.metric_marks, mapping=marks)
        if self.added:
            pipe.sadd(view_keys.metric_keys, *_members(self.added))
        if self.removed:
            pipe.srem(view_keys.metric_keys, *_members(self.removed))


def new_metrics(pipe: Any, view_keys: ViewKeys, candidates: Candidates) -> NewMetrics:
    """Read (under the batch's WATCH) what is known of the candidates' streams; the candidates not projected.

    Once per metric of a log, so written for speed: ranges tested inline, no text per metric (a log delivered in
    order keeps none outside the ranges)."""
    found = NewMetrics()
    if not candidates:
        return found
    streams = list(dict.fromkeys(stream for stream, _ in candidates))
    ranges: dict[Stream, list[int]] = {}
    names = [stream_name(stream) for stream in streams]
    for stream, mark in zip(streams, pipe.hmget(view_keys.metric_marks, names), strict=True):
        if mark:
            low, high = mark.split()
            ranges[stream] = [int(low), int(high)]
    outside: list[tuple[Stream, int]] = []
    # None kept outside a range (a log delivered in order): no look-up, nor a pass over the candidates to find them.
    if any(not _within(ranges.get(stream), sequence) for stream, sequence in candidates) and pipe.scard(
        view_keys.metric_keys
    ):
        outside = [key for key in candidates if not _within(ranges.get(key[0]), key[1])]
    members = {
        key
        for key, known in zip(
            outside, pipe.smismember(view_keys.metric_keys, _members(outside)) if outside else [], strict=True
        )
        if known
    }
    records, changed, added, removed = found.records, found.ranges, found.added, found.removed
    for key, candidate in candidates.items():
        stream, sequence = key
        marks = ranges.get(stream)
        if marks is not None and marks[0] <= sequence < marks[1]:
            continue
        known = bool(members or added) and ((key in members and key not in removed) or key in added)
        if marks is not None and sequence == marks[1] and not known:  # most: the next of its stream
            marks[1] = sequence + 1
            changed[stream] = marks
            records[key] = candidate
            continue
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


def _members(keys: Iterable[tuple[Stream, int]]) -> list[str]:
    """The `metric-keys` members of (stream, sequence) keys."""
    return [f"{stream_name(stream)}|{sequence}" for stream, sequence in keys]


def _within(marks: list[int] | None, sequence: int) -> bool:
    return marks is not None and marks[0] <= sequence < marks[1]
