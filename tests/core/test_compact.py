"""The log's compact form of metric events (schemas.compact): read back as written by the reader of its log (the
experiment is the log's, not repeated), beside entries in the object form written before it, and a third of the
size."""

from __future__ import annotations

import json

import pytest

from core.event_store import (
    PeriodicalMetric,
    RawEntry,
    StoredEvent,
    UnreadableEvent,
    decode_entry,
    encode_event,
    stored_payload,
)
from schemas.compact import compact_metric, compact_metrics, compact_record, metric_record, periodical_record
from schemas.events import TrialMetricReported

METRICS = [
    TrialMetricReported(
        experiment_id="exp1",
        trial_id="t1",
        attempt=1,
        parameter_id="5",
        metric_type="PERIODICAL",
        sequence=2,
        data='"0.5"',
    ),
    TrialMetricReported(
        experiment_id="e-2_x",
        trial_id="Ab9_z",
        attempt=3,
        source="worker-7 h",
        parameter_id="",
        metric_type="FINAL",
        sequence=0,
        data=json.dumps(json.dumps({"default": 0.93, "loss": 'ünïcode "quoted" </script>'})),
        time=1_790_000_000_123,
    ),
    TrialMetricReported(
        experiment_id="exp1",
        trial_id="t1",
        attempt=1,
        parameter_id="0",
        metric_type="REQUEST_PARAMETER",
        sequence=9,
        data="",
    ),
]


@pytest.mark.parametrize("event", METRICS, ids=lambda event: event.metric_type)
def test_a_compact_metric_reads_back_as_written_and_as_the_object_it_replaces(event: TrialMetricReported) -> None:
    fields = encode_event(event)
    assert fields["json"].startswith("[") and fields["trial"] == event.trial_id

    assert event.experiment_id not in fields["json"]
    entry = decode_entry("1-0", fields, event.experiment_id)
    assert isinstance(entry, StoredEvent) and entry.event == event
    written_before = {**fields, "json": event.model_dump_json(by_alias=True, exclude_none=True)}
    assert stored_payload(fields, event.experiment_id) == json.loads(written_before["json"])  # what JSON readers see
    assert "experimentId" not in stored_payload(fields)  # a reader that does not know whose log it reads
    old = decode_entry("1-0", written_before, event.experiment_id)  # logs written before read as ever
    assert isinstance(old, StoredEvent) and old.event == event
    assert len(written_before["json"]) - len(fields["json"]) >= 100  # the names, the trial id, the long type


def test_the_compact_form_holds_every_field_of_a_metric_event() -> None:
    # a field added to the event needs its place in schemas.compact (compact_metric and expanded)
    assert set(TrialMetricReported.model_fields) == {
        *("experiment_id", "time", "source", "trial_id", "type", "v"),
        *("attempt", "parameter_id", "metric_type", "sequence", "data"),
    }


@pytest.mark.parametrize(
    "stored",
    ['[2,"exp1"]', '[2,1,"w",1,"0","P","not a sequence","1"]', "[", '["x"]'],
)
def test_a_damaged_compact_entry_is_unreadable_with_a_reason(stored: str) -> None:
    entry = decode_entry("1-0", {"type": "TrialMetricReported", "trial": "t1", "json": stored}, "exp1")
    assert isinstance(entry, UnreadableEvent) and entry.error
    ended = decode_entry("1-0", {"type": "TrialEnded", "trial": "t1", "json": "[]"}, "exp1")
    assert isinstance(ended, UnreadableEvent)


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("event", METRICS, ids=lambda event: event.metric_type)
def test_a_metric_record_is_the_json_array_the_encoder_writes(event: TrialMetricReported, late: bool) -> None:
    # compact_record spells the encoding out (it is much of the projector's CPU): byte for byte the encoder's
    odd = event.model_copy(update={"data": 'tab\t nul\x00 "q" \\ \u2028 ü 😀 \ud800', "parameter_id": "é\n"})
    for metric in (event, odd):
        values = [metric.time, metric.parameter_id, metric.metric_type[0], metric.sequence, metric.data, metric.attempt]
        expected = json.dumps([*values, 1] if late else values, separators=(",", ":"), ensure_ascii=False)
        assert compact_record(metric, late) == expected
        assert metric_record(compact_record(metric, late), metric.trial_id)["data"] == metric.data


@pytest.mark.parametrize("event", METRICS, ids=lambda event: event.metric_type)
def test_a_compact_metric_is_the_json_array_the_encoder_writes(event: TrialMetricReported) -> None:
    # compact_metric spells the encoding out (it is much of a worker's CPU): byte for byte the encoder's
    odd = event.model_copy(
        update={"data": 'tab\t nul\x00 "q" \\ \u2028 ü 😀 \ud800', "parameter_id": "é\n", "source": 'h"\x7f'}
    )
    for metric in (event, odd):
        values = [metric.v, metric.time, metric.source, metric.attempt, metric.parameter_id, metric.metric_type[0]]
        expected = json.dumps([*values, metric.sequence, metric.data], separators=(",", ":"), ensure_ascii=False)
        assert compact_metric(metric) == expected


@pytest.mark.parametrize("event", METRICS, ids=lambda event: event.metric_type)
def test_metrics_encoded_without_their_models_are_the_events_compact_form(event: TrialMetricReported) -> None:
    # a worker encodes the metrics it reads with compact_metrics, from their checked values: the same text
    odd = event.model_copy(
        update={"data": 'tab\t nul\x00 "q" \\ \u2028 ü 😀 \ud800', "parameter_id": "é\n", "source": 'h"\x7f'}
    )
    for metric in (event, odd):
        values = (metric.parameter_id, metric.metric_type, metric.sequence, metric.data)
        assert (
            compact_metrics(metric.time, metric.source, metric.attempt, [values, values])
            == [compact_metric(metric)] * 2
        )


@pytest.mark.parametrize(
    ("stored", "reason"),
    [
        ('[2,1,"w",1,"0","P","not a sequence","1"]', "TrialMetricReported.sequence: Input should be a valid integer"),
        ('[2,1,"w",1,"0","X",3,"1"]', "TrialMetricReported.metricType: Input should be 'PERIODICAL'"),
        ('[3,1,"w",1,"0","P",3,"1"]', "TrialMetricReported.v: Input should be 2"),
    ],
)
def test_a_compact_entry_that_does_not_validate_says_where_as_any_event(stored: str, reason: str) -> None:
    # the fast path for current compact metrics falls back to the general one: the same reasons in the views
    entry = decode_entry("1-0", {"type": "TrialMetricReported", "trial": "t1", "json": stored}, "exp1")
    assert isinstance(entry, UnreadableEvent) and entry.error.startswith(reason)


def test_a_compact_metric_of_an_older_version_is_upcast() -> None:
    entry = decode_entry(
        "1-0", {"type": "TrialMetricReported", "trial": "t1", "json": '[1,5,"w",7,"0","F",0,"1"]'}, "e"
    )
    assert isinstance(entry, StoredEvent) and isinstance(entry.event, TrialMetricReported)
    assert (entry.event.v, entry.event.attempt, entry.event.metric_type) == (2, 1, "FINAL")  # v1: attempt 1


def test_a_compact_metric_with_a_lone_surrogate_is_unreadable_saying_so() -> None:
    # Workers refuse one; a log written otherwise (imported, older) may hold it. Read, it stopped its projector: no
    # UTF-8 view can hold its text. An older version's event upcast is checked the same way.
    stored = '[2,5,"w",1,"0","P",0,"\\ud800"]'
    entry = decode_entry("1-0", {"type": "TrialMetricReported", "trial": "t1", "json": stored}, "e")
    assert isinstance(entry, UnreadableEvent) and "lone surrogate" in entry.error
    started = '{"type": "TrialStarted", "v": 1, "experimentId": "e", "trialId": "t1", "source": "\\ud800"}'
    entry = decode_entry("2-0", {"type": "TrialStarted", "trial": "t1", "json": started}, "e")
    assert isinstance(entry, UnreadableEvent) and "lone surrogate" in entry.error


@pytest.mark.parametrize(
    "stored",
    [
        '[2,5,"w",1,"0","P",3,"1"]',
        '[2,5,"w",1,"p/\\u00e9\\"","P",3,"{\\"default\\": 0.5}"]',
        '[2,1180591620717411303424,"w",-1,"","P",18446744073709551616,""]',
        *('[2,5,"w",1.0,"0","P",3,"1"]', '[2,5,"w",1.5,"0","P",3,"1"]', '[2,5,"w",true,"0","P",3,"1"]'),
        *('[2,5,"w","1","0","P",3,"1"]', '[2,5.0,"w",1,"0","P",3,"1"]', '[2,5,"w",1,"0","P","3","1"]'),
        *(
            '[2,5,"w",1,0,"P",3,"1"]',
            '[2,5,"w",1,"0","P",3,1]',
            '[2,5,"w",1,"0","P",3,null]',
            '[2,5,3,1,"0","P",3,"1"]',
        ),
        *('[2.0,5,"w",1,"0","P",3,"1"]', '[true,5,"w",1,"0","P",3,"1"]', '[1,5,"w",1,"0","P",3,"1"]'),
        *('[2,5,"w",1,"0","PERIODICAL",3,"1"]', '[2,5,"w",1,"0","F",3,"1"]', '[2,5,"w",1,"0","R",3,"1"]'),
        *(
            '[2,5,"w",1,"0","P",3]',
            '[2,5,"w",1,"0","P",3,"1",4]',
            '[2,5,"w",1,"0","P",3,"1"',
            '[2,5,"w",1,"0","P",3,"1"]x',
        ),
        *('[2,5,"w",1,"0","P",3,"\\ud800"]', '[2,5,"w",1,"0","P",3,[1]]', '[2,5,"w",1,"0","P",3,{"a":1}]'),
    ],
)
def test_an_intermediate_metric_listed_without_its_event_holds_what_its_event_would(stored: str) -> None:
    # the projector's path for most entries builds no event: it takes only what would validate as it is, and
    # leaves any other entry to the general path (read there as ever, or unreadable with the same reason)
    fields = {"type": "TrialMetricReported", "trial": "t1", "json": stored}
    listed, decoded = RawEntry("1-0", fields, "e").listed(), decode_entry("1-0", fields, "e")
    if not isinstance(listed, PeriodicalMetric):
        assert listed == decoded
        return
    assert isinstance(decoded, StoredEvent) and isinstance(decoded.event, TrialMetricReported)
    event = decoded.event
    assert (listed.id, listed.trial_id, listed.metric_type, listed.dedup_key) == (
        "1-0",
        "t1",
        "PERIODICAL",
        event.dedup_key,
    )
    assert (listed.time, listed.attempt, listed.parameter_id, listed.sequence, listed.data) == (
        event.time,
        event.attempt,
        event.parameter_id,
        event.sequence,
        event.data,
    )
    assert compact_record(listed, late=True) == compact_record(event, late=True)


def test_an_intermediate_metric_listed_from_its_values_is_its_compact_record() -> None:
    # the projector's path for most entries writes the record from the values it read, without an event
    event = METRICS[0]
    odd = event.model_copy(
        update={"data": 'tab\t nul\x00 "q" \\ \u2028 ü 😀', "parameter_id": "é\n|", "time": 2**70, "attempt": 2**40}
    )
    for metric in (event, odd, odd.model_copy(update={"sequence": 0, "attempt": 0, "time": 0})):
        for late in (False, True):
            values = (metric.time, metric.parameter_id, metric.sequence, metric.data, metric.attempt)
            assert periodical_record(*values, late) == compact_record(metric, late)


def test_an_entry_other_than_a_compact_metric_is_listed_as_it_decodes() -> None:
    for fields in (
        {"type": "TrialEnded", "trial": "t1", "json": '[2,5,"w",1,"0","P",3,"1"]'},
        {"type": "TrialMetricReported", "json": '[2,5,"w",1,"0","P",3,"1"]'},
        {"type": "TrialMetricReported", "trial": "t1"},
    ):
        assert RawEntry("1-0", fields, "e").listed() == decode_entry("1-0", fields, "e")
    not_utf8 = RawEntry(
        "1-0", {"type": "TrialMetricReported", "trial": "t1", "json": '[2,5,"w",1,"0","P",3,"1"]'}, "e", "bad"
    )
    assert not_utf8.listed() == UnreadableEvent("1-0", not_utf8.fields, "bad")
