"""NNI's two metric wire formats: `ME%06d` records in the metrics file, and `NNISDK_MEb'...'` stdout lines."""

from __future__ import annotations

import io
import itertools
import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from core.platform import ParsedMetric
from schemas.trial import MetricRecord
from workers.platforms.shared import metric_framing
from workers.platforms.shared.metric_framing import MAX_RECORD_BYTES
from workers.platforms.shared.metrics import MetricFileReader, MetricRejected, parse_record, parse_stdout_line
from workers.platforms.shared.trial_contract import StdoutMetricPump

# The verified hexdump of a record written by NNI's SDK (the length counts the closing newline).
NNI_RECORD = b'ME000091{"parameter_id": 3, "trial_job_id": "abc", "type": "FINAL", "sequence": 0, "value": "0.5"}\n'


def payload(parameter_id: Any = 3, type_: str = "FINAL", sequence: int = 0, value: Any = "0.5", **extra: Any) -> bytes:
    """A metric JSON as NNI's SDK writes it: `value` is itself a JSON string."""
    fields = {"parameter_id": parameter_id, "trial_job_id": "abc", "type": type_, "sequence": sequence, "value": value}
    return json.dumps({**fields, **extra}).encode()


def record(body: bytes) -> bytes:
    """A metrics-file record as NNI's SDK frames it: ME + %06d length of (json + newline) + json + newline."""
    data = body + b"\n"
    return b"ME%06d" % len(data) + data


def periodical(sequence: int, value: float) -> bytes:
    return record(payload(parameter_id=7, type_="PERIODICAL", sequence=sequence, value=json.dumps(value)))


def expected(sequence: int, value: float) -> ParsedMetric:
    return ParsedMetric("7", "PERIODICAL", sequence, json.dumps(json.dumps(value)))


class Trial:
    """A trial appending to its metrics file, and the reader tailing it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = MetricFileReader(path)
        self.metrics: list[ParsedMetric] = []
        self.problems: list[str] = []

    def write(self, data: bytes) -> None:
        with self.path.open("ab") as file:
            file.write(data)

    def read(self, final: bool = False) -> tuple[list[ParsedMetric], list[str]]:
        metrics, problems = self.reader.read_new(final=final)
        self.metrics += metrics
        self.problems += problems
        return metrics, problems

    def feed(self, chunks: Iterable[bytes]) -> None:
        for chunk in chunks:
            self.write(chunk)
            self.read()


@pytest.fixture
def trial(tmp_path: Path) -> Trial:
    return Trial(tmp_path / "metrics")


def split_at(data: bytes, cuts: Iterable[int]) -> list[bytes]:
    points = [0, *sorted(set(cuts)), len(data)]
    return [data[start:end] for start, end in itertools.pairwise(points) if end > start]


# ---------------------------------------------------------------- the file format


def test_verified_nni_record_parses(trial: Trial) -> None:
    trial.write(NNI_RECORD)

    metrics, problems = trial.read()

    assert problems == []
    assert metrics == [ParsedMetric(parameter_id="3", metric_type="FINAL", sequence=0, data='"0.5"')]
    assert metrics[0].data == json.dumps("0.5")  # NNI's metric-data `data`: the JSON string "\"0.5\""


def test_record_helper_frames_records_like_nni() -> None:
    assert record(payload()) == NNI_RECORD


def test_parsed_data_decodes_to_the_reported_value() -> None:
    value = {"default": 0.25, "loss": 1.5}
    parsed = parse_record(payload(type_="PERIODICAL", sequence=4, value=json.dumps(value)))

    shown = MetricRecord(
        timestamp=1,
        trial_job_id="abc",
        parameter_id=parsed.parameter_id,
        type="PERIODICAL",
        sequence=4,
        data=parsed.data,
    )
    assert shown.value == value


RECORDS = [periodical(0, 0.1), periodical(1, 0.25), record(payload(value=json.dumps({"default": 0.9, "acc": 0.8})))]
EXPECTED = [
    expected(0, 0.1),
    expected(1, 0.25),
    ParsedMetric("3", "FINAL", 0, json.dumps(json.dumps({"default": 0.9, "acc": 0.8}))),
]
STREAM = b"".join(RECORDS)
_rng = random.Random(20240601)


@pytest.mark.parametrize(
    "chunks",
    [
        pytest.param([STREAM], id="all-at-once"),
        pytest.param(list(RECORDS), id="record-by-record"),
        pytest.param([STREAM[i : i + 1] for i in range(len(STREAM))], id="byte-by-byte"),
        pytest.param(split_at(STREAM, [1, 2, 5, len(RECORDS[0]) + 3, len(RECORDS[0]) + 7]), id="header-split"),
        pytest.param(split_at(STREAM, [8, 40, len(RECORDS[0]) + 9, len(RECORDS[0]) + 60]), id="payload-split"),
        pytest.param(split_at(STREAM, [len(RECORDS[0]) - 1, len(STREAM) - 1]), id="newline-split"),
        *(pytest.param(split_at(STREAM, _rng.sample(range(1, len(STREAM)), 12)), id=f"random-{n}") for n in range(5)),
    ],
)
def test_records_split_across_reads_are_each_read_exactly_once(trial: Trial, chunks: list[bytes]) -> None:
    assert b"".join(chunks) == STREAM
    trial.feed(chunks)

    assert trial.metrics == EXPECTED
    assert trial.problems == []
    assert trial.read(final=True) == ([], [])


def test_a_read_returns_only_records_completed_since_the_last_one(trial: Trial) -> None:
    trial.write(RECORDS[0] + RECORDS[1][:20])
    assert trial.read() == ([EXPECTED[0]], [])

    assert trial.read() == ([], [])

    trial.write(RECORDS[1][20:] + RECORDS[2])
    assert trial.read() == (EXPECTED[1:], [])


def test_missing_file_gives_no_records_and_no_problems(trial: Trial) -> None:
    assert trial.read() == ([], [])
    assert trial.read(final=True) == ([], [])


def test_file_created_after_the_reader_is_read(trial: Trial) -> None:
    assert trial.read() == ([], [])

    trial.write(NNI_RECORD)

    assert [m.parameter_id for m in trial.read()[0]] == ["3"]


# ---------------------------------------------------------------- damaged files


@pytest.mark.parametrize("garbage", [b"XX000091not a record at all\n", b"MEabcdefgh", b"hello", b"\n", b"M"])
def test_malformed_header_is_reported_and_the_next_record_still_read(trial: Trial, garbage: bytes) -> None:
    trial.write(garbage + RECORDS[0] + RECORDS[1])

    metrics, problems = trial.read()

    assert metrics == EXPECTED[:2]
    assert len(problems) == 1
    assert problems[0].startswith("malformed metric record header")


def test_malformed_header_between_records_costs_nothing_else(trial: Trial) -> None:
    trial.write(RECORDS[0] + b"#junk#" + RECORDS[1] + RECORDS[2])

    metrics, problems = trial.read()

    assert metrics == EXPECTED
    assert len(problems) == 1


@pytest.mark.parametrize("garbage", [b"junk", b"M"], ids=["junk", "stray-M"])
def test_malformed_bytes_followed_by_a_record_still_being_written(trial: Trial, garbage: bytes) -> None:
    trial.feed([garbage + RECORDS[0][:4], RECORDS[0][4:]])

    assert trial.metrics == EXPECTED[:1]
    assert len(trial.problems) == 1


def test_length_prefix_too_short_is_reported_and_later_records_read(trial: Trial) -> None:
    body = payload(parameter_id=1)
    bad = b"ME%06d" % (len(body) - 10) + body + b"\n"
    trial.write(bad + RECORDS[0] + RECORDS[1])

    metrics, problems = trial.read()

    assert metrics == EXPECTED[:2]
    assert problems == ["metric record length does not match its content; skipped"]


def test_length_prefix_too_long_is_reported_and_later_records_read(trial: Trial) -> None:
    body = payload(parameter_id=1)
    bad = b"ME%06d" % (len(body) + 10) + body + b"\n"
    trial.write(bad + RECORDS[0] + RECORDS[1] + RECORDS[2])

    metrics, problems = trial.read()

    assert metrics == EXPECTED
    assert problems == ["metric record length does not match its content; skipped"]


def test_length_prefix_past_the_end_of_the_file_does_not_cost_later_records(trial: Trial) -> None:
    body = payload(parameter_id=1)
    bad = b"ME%06d" % 5000 + body + b"\n"
    trial.write(bad + RECORDS[0] + RECORDS[1])

    trial.read()
    trial.read(final=True)

    assert trial.metrics == EXPECTED[:2]
    assert len(trial.problems) == 1


def test_a_bogus_header_does_not_hold_back_the_records_that_follow_it_while_the_trial_runs(trial: Trial) -> None:
    """Regression (A14): `ME999999` waited for a million more bytes, so every later metric came only at the end."""
    trial.write(b"ME999999 oops\n" + RECORDS[0])

    assert trial.read() == ([EXPECTED[0]], ["metric record length does not match its content; skipped"])
    trial.write(RECORDS[1])
    assert trial.read() == ([EXPECTED[1]], [])


def test_a_header_longer_than_the_record_limit_is_rejected_at_once(trial: Trial, monkeypatch) -> None:
    monkeypatch.setattr(metric_framing, "MAX_RECORD_BYTES", 1000)
    trial.write(b"ME999999" + b"x" * 100 + RECORDS[0])  # no newline yet: only the length can tell it is bogus

    metrics, problems = trial.read()

    assert problems == ["metric record of 999998 bytes exceeds the 1000-byte limit; skipped"]
    assert metrics == [EXPECTED[0]]


def test_one_read_reads_at_most_its_limit_and_says_more_is_there(trial: Trial) -> None:
    """Regression (A14): read() had no size cap, so a trial could make the worker read gigabytes at once."""
    stream = b"".join(periodical(sequence, sequence / 10) for sequence in range(1000))
    trial.write(stream)
    reader = MetricFileReader(trial.path, read_limit=10_000)

    metrics, problems = reader.read_new(final=True)

    assert reader.behind and problems == []  # a record torn by the limit is not "truncated" yet
    assert 0 < len(metrics) < 1000
    while reader.behind:
        more, problems = reader.read_new(final=True)
        assert problems == []
        metrics += more
    assert metrics == [expected(sequence, sequence / 10) for sequence in range(1000)]


@pytest.mark.parametrize(
    "body",
    [
        b'{"parameter_id": "\\ud800", "type": "FINAL", "sequence": 0, "value": "0.5"}',
        b'{"parameter_id": 1, "type": "FINAL", "sequence": 0, "value": "{\\"default\\": 1, \\"x\\": \\"\\\\ud800\\"}"}',
        b'{"parameter_id": 1, "type": "FINAL", "sequence": 0, "value": 0.5, "note": "\\udfff"}',
    ],
    ids=["parameter_id", "inside-the-value", "another-field"],
)
def test_a_lone_surrogate_is_rejected_and_later_records_read(trial: Trial, body: bytes) -> None:
    """Regression (A5): such a record parsed, then failed to encode when stored, killing its trial."""
    trial.write(record(body) + RECORDS[0])

    metrics, problems = trial.read()

    assert metrics == [EXPECTED[0]]
    assert len(problems) == 1 and "lone surrogate" in problems[0]
    with pytest.raises(MetricRejected, match="lone surrogate"):
        parse_stdout_line(stdout_line(body))


@pytest.mark.parametrize(
    "cut", [3, 8, 50, len(RECORDS[1]) - 1], ids=["in-header", "after-header", "payload", "newline"]
)
def test_truncated_final_record_is_reported_only_when_final(trial: Trial, cut: int) -> None:
    trial.write(RECORDS[0] + RECORDS[1][:cut])

    assert trial.read() == ([EXPECTED[0]], [])
    assert trial.read() == ([], [])

    metrics, problems = trial.read(final=True)

    assert metrics == []
    assert len(problems) == 1
    assert "truncated" in problems[0] or "malformed" in problems[0]
    assert trial.read(final=True) == ([], [])  # reported once


def test_final_read_still_returns_complete_records(trial: Trial) -> None:
    trial.write(STREAM)

    assert trial.read(final=True) == (EXPECTED, [])


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"this is not json", "metric record is not JSON"),
        (b"\xff\xfe{}", "metric record is not JSON"),
        (b"[1, 2]", "metric record is not a JSON object"),
        (payload(value='"abc"'), "metric value must be a number or a dict with a numeric 'default'"),
        (payload(value="abc"), "metric value is not JSON"),
        (payload(value=json.dumps({"loss": 0.1})), "metric value must be a number or a dict with a numeric 'default'"),
        (payload(value=json.dumps({"default": "0.1"})), "numeric 'default'"),
        (payload(value="true"), "metric value must be a number"),
        (payload(value=None), "metric value must be a number"),
        (payload(type_="BOGUS"), "metric record has type 'BOGUS'"),
        (payload(sequence="1"), "non-integer sequence"),  # type: ignore[arg-type]
        (payload(sequence=True), "non-integer sequence"),
        (payload(sequence=2**63), "sequence past a 64-bit integer's range"),
        (payload(value="1" + "0" * 400), "integer of 1329 bits, too large for a float"),
        (payload(value=json.dumps({"default": -(10**400)})), "integer of 1329 bits, too large for a float"),
        (payload(value=10**400), "integer of 1329 bits, too large for a float"),
        (payload(value="1" * 5000), "metric value is not JSON: Exceeds the limit"),
        (payload().replace(b'"sequence": 0', b'"sequence": ' + b"1" * 5000), "metric record is not JSON: Exceeds the"),
    ],
    ids=[
        "not-json",
        "not-utf8",
        "not-object",
        "string-value",
        "value-not-json",
        "dict-without-default",
        "string-default",
        "bool-value",
        "no-value",
        "unknown-type",
        "string-sequence",
        "bool-sequence",
        "int64-sequence",
        "value-past-float",
        "default-past-float",
        "number-value-past-float",
        "value-past-python-int-digits",
        "sequence-past-python-int-digits",
    ],
)
def test_bad_record_is_rejected_with_a_reason(trial: Trial, body: bytes, reason: str) -> None:
    with pytest.raises(MetricRejected, match=reason):
        parse_record(body)

    trial.write(RECORDS[0] + record(body) + RECORDS[1])
    metrics, problems = trial.read()
    assert metrics == EXPECTED[:2]  # the reader goes on past it
    assert len(problems) == 1
    assert reason in problems[0]


DEEP = json.loads("[" * 300 + "]" * 300)  # deeper than pydantic's parser goes


@pytest.mark.parametrize(
    "body",
    [
        b"\xef\xbb\xbf" + payload(),  # a BOM
        payload().decode().encode("utf-16"),
        payload(deep=DEEP),
        payload(value=json.dumps({"default": 0.5, "deep": DEEP})),
    ],
    ids=["bom", "utf-16", "deep-record", "deep-value"],
)
def test_a_record_that_only_json_reads_is_read_as_before(body: bytes) -> None:
    # pydantic's parser reads records faster; what it refuses and json reads is read by json, as before
    value = json.loads(json.loads(body)["value"])
    assert parse_record(body) == ParsedMetric("3", "FINAL", 0, json.dumps(json.dumps(value)))


@pytest.mark.parametrize(
    ("value", "data"),
    [
        ("0.5", '"0.5"'),
        ("3", '"3"'),
        ("-1e-3", '"-1e-3"'),
        ('{"default": 0.2, "loss": 1.5}', '"{\\"default\\": 0.2, \\"loss\\": 1.5}"'),
        (0.5, '"0.5"'),  # a value that is not double-encoded is encoded once more, as NNI would have
        ({"default": 2}, '"{\\"default\\": 2}"'),
    ],
)
def test_numbers_and_dicts_with_numeric_default_are_accepted(value: Any, data: str) -> None:
    parsed = parse_record(payload(type_="PERIODICAL", sequence=2, value=value))

    assert parsed == ParsedMetric("3", "PERIODICAL", 2, data)


def test_missing_sequence_means_zero() -> None:
    body = json.dumps({"parameter_id": 0, "type": "FINAL", "value": "1"}).encode()

    assert parse_record(body).sequence == 0


def test_request_parameter_record_is_parsed(trial: Trial) -> None:
    # what NNI's SDK writes when parameter.cfg is missing: no parameter_id and no value
    body = json.dumps({"trial_job_id": "abc", "type": "REQUEST_PARAMETER", "sequence": 0, "parameter_index": 1})
    trial.write(record(body.encode()) + RECORDS[0])

    metrics, problems = trial.read()

    assert problems == []
    assert [m.metric_type for m in metrics] == ["REQUEST_PARAMETER", "PERIODICAL"]
    assert metrics[0].sequence == 0


RECURSION_BOMBS = [
    pytest.param(b"[" * 100_000, id="record"),
    pytest.param(payload(value="[" * 100_000), id="value"),
]


@pytest.mark.parametrize("body", RECURSION_BOMBS)
def test_deeply_nested_json_is_rejected(body: bytes) -> None:
    with pytest.raises(MetricRejected):
        parse_record(body)


@pytest.mark.parametrize("body", RECURSION_BOMBS)
def test_deeply_nested_record_does_not_cost_later_records(trial: Trial, body: bytes) -> None:
    trial.write(record(body) + RECORDS[0])

    metrics, problems = trial.read()

    assert metrics == EXPECTED[:1]
    assert len(problems) == 1


# ---------------------------------------------------------------- stdout lines


def stdout_line(body: bytes) -> bytes:
    """As NNI's SDK prints a record: its JSON as it is, between b' and '."""
    return b"NNISDK_MEb'" + body + b"'\n"


def test_stdout_metric_line_parses() -> None:
    line = b"NNISDK_MEb'" + NNI_RECORD[8:-1] + b"'\n"

    assert parse_stdout_line(line) == ParsedMetric("3", "FINAL", 0, '"0.5"')


@pytest.mark.parametrize("ending", [b"", b"\n", b"\r\n"])
def test_stdout_line_endings_do_not_matter(ending: bytes) -> None:
    line = stdout_line(payload(type_="PERIODICAL", sequence=5, value="1.25")).rstrip(b"\n") + ending

    assert parse_stdout_line(line) == ParsedMetric("3", "PERIODICAL", 5, '"1.25"')


def test_stdout_line_with_escapes_in_the_literal_parses() -> None:
    body = payload(value=json.dumps({"default": 1, "note": "it's"}))  # repr() escapes or switches quotes

    parsed = parse_stdout_line(stdout_line(body))

    assert parsed is not None
    assert json.loads(json.loads(parsed.data)) == {"default": 1, "note": "it's"}


@pytest.mark.parametrize(
    "line",
    [b"", b"\n", b"epoch 1 loss 0.3\n", b"NNISDK_MD{}\n", b" NNISDK_MEb'{}'\n", b"nnisdk_meb'{}'\n", b"NNISDK"],
)
def test_other_stdout_lines_are_not_metrics(line: bytes) -> None:
    assert parse_stdout_line(line) is None


def test_stdout_line_over_the_limit_is_rejected_with_the_limit() -> None:
    body = payload(value=json.dumps({"default": 1, "pad": "x" * MAX_RECORD_BYTES}))
    line = stdout_line(body)
    assert len(line) > 1_000_000

    with pytest.raises(MetricRejected, match="exceeds the 1000000-byte limit"):
        parse_stdout_line(line)


@pytest.mark.parametrize(
    "line",
    [
        b'NNISDK_MEb\'{"parameter_id": 3\n',  # unterminated literal
        b"NNISDK_ME'{}'\n",  # a str, not bytes
        b'NNISDK_ME{"parameter_id": 3}\n',  # no literal at all
        b"NNISDK_MEb'{}'.decode()\n",  # code, not a literal
        b"NNISDK_MEb'\xff'\n",  # not UTF-8
        b"NNISDK_MEb'{}' b\n",
    ],
)
def test_garbled_stdout_literal_is_rejected(line: bytes) -> None:
    with pytest.raises(MetricRejected, match="metric line is not a bytes literal"):
        parse_stdout_line(line)


def test_stdout_literal_with_a_bad_record_is_rejected_with_the_record_reason() -> None:
    with pytest.raises(MetricRejected, match="metric value must be a number"):
        parse_stdout_line(stdout_line(payload(value='"abc"')))


def test_deeply_nested_stdout_metric_is_rejected() -> None:
    with pytest.raises(MetricRejected):
        parse_stdout_line(stdout_line(b"[" * 100_000))


# ---------------------------------------------------------------- the stdout pump


class RecordingControl:
    """What a pump reports (it uses no other TrialControl method)."""

    def __init__(self) -> None:
        self.reported: list[ParsedMetric] = []
        self.rejections: list[str] = []

    def metrics(self, metrics: list[ParsedMetric]) -> None:
        self.reported += metrics

    def rejected(self, reason: str) -> None:
        self.rejections.append(reason)


def pump_output(chunks: Iterable[bytes]) -> tuple[RecordingControl, bytes]:
    control = RecordingControl()
    copy = io.BytesIO()
    pump = StdoutMetricPump(control, copy)  # type: ignore[arg-type]
    for chunk in chunks:
        pump.feed(chunk)
    pump.close()
    return control, copy.getvalue()


GOOD_LINE = stdout_line(payload(type_="PERIODICAL", sequence=5, value="1.25"))
GOOD_METRIC = ParsedMetric("3", "PERIODICAL", 5, '"1.25"')


@pytest.mark.parametrize("chunk_size", [1, 7, 4096, 10_000_000])
def test_the_pump_finds_metric_lines_in_chunks_of_any_size_and_copies_every_byte(chunk_size: int) -> None:
    output = b"epoch 1\n" + GOOD_LINE + b"noise without a newline " + GOOD_LINE + b"last" + GOOD_LINE.rstrip(b"\n")
    chunks = [output[start : start + chunk_size] for start in range(0, len(output), chunk_size)]

    control, copy = pump_output(chunks)

    assert copy == output
    assert control.reported == [GOOD_METRIC]  # the other two are not at a line's start
    assert control.rejections == []


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b""])
@pytest.mark.parametrize("chunk_size", [65536, 1_000_003])
def test_an_oversized_metric_line_is_rejected_with_its_exact_size(ending: bytes, chunk_size: int) -> None:
    """Regression: the size reported counted only the line's first and last pieces."""
    line = b"NNISDK_MEb'" + b"x" * 2_500_000 + b"'"
    output = line + ending + GOOD_LINE
    chunks = [output[start : start + chunk_size] for start in range(0, len(output), chunk_size)]

    control, _ = pump_output(chunks)

    expected_reports = [GOOD_METRIC] if ending else []  # without a newline, the good line is part of it
    size = len(line) if ending else len(output) - 1
    assert control.rejections == [f"metric line of {size} bytes exceeds the 1000000-byte limit"]
    assert control.reported == expected_reports


def test_an_oversized_line_that_is_no_metric_is_only_copied() -> None:
    control, copy = pump_output([b"y" * 3_000_000 + b"\n" + GOOD_LINE])

    assert control.rejections == [] and control.reported == [GOOD_METRIC]
    assert len(copy) == 3_000_001 + len(GOOD_LINE)


def test_the_pump_rejects_a_line_with_a_lone_surrogate_and_goes_on() -> None:
    bad = stdout_line(b'{"parameter_id": "\\ud800", "type": "FINAL", "sequence": 0, "value": "0.5"}')

    control, _ = pump_output([bad + GOOD_LINE])

    assert control.reported == [GOOD_METRIC]
    assert len(control.rejections) == 1 and "lone surrogate" in control.rejections[0]
