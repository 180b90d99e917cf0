"""Trial statuses and their state machine, NNI's camelCase JSON, metric values and the versioned events."""

from __future__ import annotations

import itertools
import json
import math
from typing import Any, get_args

import pytest
from pydantic import ValidationError

from schemas.events import (
    EVENT_ADAPTER,
    ClusterMetadataSet,
    CustomizedTrialNumbered,
    CustomizedTrialRefused,
    CustomizedTrialRequested,
    Event,
    ExperimentChanges,
    ExperimentCreated,
    ExperimentFinished,
    ExperimentImported,
    ExperimentResumed,
    ExperimentStopRequested,
    ExperimentUpdated,
    ImportedTrial,
    TrialAttemptLost,
    TrialCancelRequested,
    TrialDeferred,
    TrialEnded,
    TrialFormUpdated,
    TrialLaunchSpec,
    TrialMetricRejected,
    TrialMetricReported,
    TrialReattached,
    TrialRequeued,
    TrialsRequested,
    TrialStarted,
    TrialSubmitted,
    TrialUnreachable,
    TunerDataImported,
    TunerNoMoreTrials,
)
from schemas.trial import (
    TERMINAL_STATUSES,
    HyperParameters,
    JobApplicationForm,
    MetricRecord,
    TrialJobDetail,
    TrialJobStatus,
    can_transition,
    metric_score,
)

S = TrialJobStatus
TERMINAL = [S.SUCCEEDED, S.FAILED, S.USER_CANCELED, S.SYS_CANCELED, S.EARLY_STOPPED]
LIVE = [S.WAITING, S.RUNNING, S.UNKNOWN]

# The whole state machine, from NNI's statuses: every allowed move; everything else is forbidden.
ALLOWED = {
    (S.WAITING, S.RUNNING),
    (S.WAITING, S.UNKNOWN),
    *((S.WAITING, end) for end in TERMINAL),  # e.g. cancelled before launch, or failed to start
    (S.RUNNING, S.UNKNOWN),  # platform unreachable
    *((S.RUNNING, end) for end in TERMINAL),
    (S.UNKNOWN, S.RUNNING),  # reachable again
    *((S.UNKNOWN, end) for end in TERMINAL),
}


# ---------------------------------------------------------------- statuses


def test_terminal_statuses_are_nnis() -> None:
    assert set(TERMINAL_STATUSES) == set(TERMINAL)
    assert {status for status in S if status.is_terminal} == set(TERMINAL)
    assert [status.value for status in S] == [
        "UNKNOWN",
        "WAITING",
        "RUNNING",
        "SUCCEEDED",
        "FAILED",
        "USER_CANCELED",
        "SYS_CANCELED",
        "EARLY_STOPPED",
    ]


@pytest.mark.parametrize(("current", "new"), list(itertools.product(S, S)), ids=lambda s: s.value)
def test_every_status_transition(current: TrialJobStatus, new: TrialJobStatus) -> None:
    assert can_transition(current, new) is ((current, new) in ALLOWED)


@pytest.mark.parametrize("terminal", TERMINAL, ids=str)
def test_nothing_leaves_a_terminal_status(terminal: TrialJobStatus) -> None:
    assert [new for new in S if can_transition(terminal, new)] == []


def test_typical_lifecycles_are_allowed() -> None:
    for path in (
        [S.WAITING, S.RUNNING, S.SUCCEEDED],
        [S.WAITING, S.RUNNING, S.UNKNOWN, S.RUNNING, S.EARLY_STOPPED],
        [S.WAITING, S.RUNNING, S.UNKNOWN, S.FAILED],
        [S.WAITING, S.USER_CANCELED],
    ):
        assert all(can_transition(a, b) for a, b in itertools.pairwise(path)), path


@pytest.mark.parametrize("status", LIVE, ids=str)
def test_no_status_moves_to_itself_or_back_to_waiting(status: TrialJobStatus) -> None:
    assert not can_transition(status, status)
    assert not can_transition(status, S.WAITING)


# ---------------------------------------------------------------- NNI JSON


def metric(sequence: int = 0, value: Any = 0.5, type_: str = "FINAL") -> MetricRecord:
    return MetricRecord(
        timestamp=1795317339590,
        trial_job_id="jl7ty",
        parameter_id="7",
        type=type_,  # type: ignore[arg-type]
        sequence=sequence,
        data=json.dumps(json.dumps(value)),
    )


def form(sequence_id: int = 5, parameters: dict[str, Any] | None = None) -> JobApplicationForm:
    value = {"parameter_id": sequence_id, "parameter_source": "algorithm", "parameters": parameters or {"x": 0.67}}
    return JobApplicationForm(
        sequence_id=sequence_id,
        hyper_parameters=HyperParameters(value=json.dumps({**value, "parameter_index": 0}), index=0),
    )


def detail(**overrides: Any) -> TrialJobDetail:
    fields: dict[str, Any] = {
        "id": "jl7ty",
        "status": S.SUCCEEDED,
        "submit_time": 1795317335000,
        "start_time": 1795317335901,
        "end_time": 1795317339922,
        "working_directory": "/exp/trials/jl7ty",
        "form": form(),
        "sequence_id": 5,
        "experiment_id": "exp1",
        "platform": "local",
        "exit_code": 0,
        "final_metric_data": [metric()],
    }
    return TrialJobDetail(**{**fields, **overrides})


def all_keys(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {key for item in value.values() for key in all_keys(item)}
    if isinstance(value, list):
        return {key for item in value for key in all_keys(item)}
    return set()


def test_trial_job_detail_json_uses_nni_camel_case_names() -> None:
    data = json.loads(detail().to_json())

    assert data["id"] == "jl7ty"
    assert data["status"] == "SUCCEEDED"
    assert data["submitTime"] == 1795317335000
    assert data["startTime"] == 1795317335901
    assert data["endTime"] == 1795317339922
    assert data["workingDirectory"] == "/exp/trials/jl7ty"
    assert data["sequenceId"] == 5
    assert data["experimentId"] == "exp1"
    assert data["exitCode"] == 0
    assert data["form"]["sequenceId"] == 5
    assert set(data["form"]["hyperParameters"]) == {"value", "index"}
    assert json.loads(data["form"]["hyperParameters"]["value"])["parameters"] == {"x": 0.67}
    assert data["finalMetricData"] == [
        {
            "timestamp": 1795317339590,
            "trialJobId": "jl7ty",
            "parameterId": "7",
            "type": "FINAL",
            "sequence": 0,
            "data": '"0.5"',
            "attempt": 1,
        }
    ]
    assert [key for key in all_keys(data) if "_" in key] == []


def test_trial_job_detail_json_omits_unset_fields() -> None:
    data = json.loads(detail(start_time=None, end_time=None, exit_code=None, status=S.WAITING).to_json())

    assert not {"startTime", "endTime", "exitCode", "url", "tags", "message", "isEarlyStopped"} & set(data)


@pytest.mark.parametrize(
    "trial",
    [detail(), detail(status=S.EARLY_STOPPED, is_early_stopped=True, message="too slow", tags=["a"], worker="w1")],
    ids=["succeeded", "early-stopped"],
)
def test_trial_job_detail_round_trips_through_json(trial: TrialJobDetail) -> None:
    again = TrialJobDetail.model_validate_json(trial.to_json())

    assert again == trial
    assert again.to_json() == trial.to_json()


def test_trial_job_detail_reads_nni_camel_case_json() -> None:
    data = json.loads(detail().to_json())
    data["status"] = "RUNNING"

    trial = TrialJobDetail.model_validate(data)

    assert trial.status is S.RUNNING
    assert trial.form.hyper_parameters.parameters == {"x": 0.67}
    assert trial.submit_time == 1795317335000


def test_final_metric_is_the_latest_final_value() -> None:
    assert detail(final_metric_data=[]).final_metric is None
    assert detail(final_metric_data=[metric(value=0.1), metric(value={"default": 0.9})]).final_metric == {
        "default": 0.9
    }


def test_metric_dedup_key_identifies_attempt_parameter_type_and_sequence() -> None:
    assert metric(sequence=3, type_="PERIODICAL").dedup_key == "1|7|PERIODICAL|3"
    assert metric(sequence=3, type_="PERIODICAL").dedup_key != metric(sequence=3).dedup_key
    retried = metric(sequence=3, type_="PERIODICAL").model_copy(update={"attempt": 2})
    assert retried.dedup_key == "2|7|PERIODICAL|3"  # a retry's metrics are its own, not duplicates


# ---------------------------------------------------------------- metric values


@pytest.mark.parametrize(
    ("data", "value"),
    [
        ('"0.5"', 0.5),  # NNI's double encoding: a JSON string holding JSON
        ('"\\"0.5\\""', "0.5"),  # a string that was itself a JSON string decodes one level at a time
        ('"3"', 3),
        ('"-1e-3"', -0.001),
        ('"{\\"default\\": 0.2, \\"loss\\": 1.5}"', {"default": 0.2, "loss": 1.5}),
        ("0.5", 0.5),  # single-encoded data still reads
        ('{"default": 1}', {"default": 1}),
    ],
)
def test_metric_record_value_decodes_nni_double_encoding(data: str, value: Any) -> None:
    record = metric().model_copy(update={"data": data})

    assert record.value == value


def test_metric_record_value_round_trips_with_how_workers_encode() -> None:
    for value in (0.718, 2, {"default": 0.2, "loss": 1.5}, -0.0):
        assert metric(value=value).value == value


@pytest.mark.parametrize(
    ("value", "score"),
    [
        (0.5, 0.5),
        (3, 3.0),
        (-2, -2.0),
        ({"default": 0.2, "loss": 1.5}, 0.2),
        ({"default": 4}, 4.0),
        ({"loss": 1.5}, None),
        ({"default": "0.2"}, None),
        ({"default": True}, None),
        (True, None),
        (False, None),
        (None, None),
        ("0.5", None),
        ([0.5], None),
        # past a float's range: in a log written before workers rejected it
        pytest.param(10**400, math.inf, id="int-past-float"),
        pytest.param({"default": -(10**400)}, -math.inf, id="default-past-float"),
    ],
)
def test_metric_score(value: Any, score: float | None) -> None:
    result = metric_score(value)

    assert result == score
    if score is not None:
        assert type(result) is float


def test_metric_score_keeps_nan_as_a_float() -> None:
    result = metric_score(float("nan"))

    assert result is not None
    assert math.isnan(result)


def test_hyper_parameters_exposes_the_parameters() -> None:
    assert form(parameters={"lr": 0.1, "layers": 3}).hyper_parameters.parameters == {"lr": 0.1, "layers": 3}


@pytest.mark.parametrize("value", ["not json", "[" * 5000 + "]" * 5000], ids=["not-json", "too-deep-to-parse"])
def test_a_form_value_that_does_not_parse_is_shown_as_its_text(value: str) -> None:
    """A form a PUT stored before the API checked them: `trials list` and `run --json` show it, not a traceback."""
    assert HyperParameters(value=value).parameters == value


# ---------------------------------------------------------------- events


def launch() -> TrialLaunchSpec:
    return TrialLaunchSpec(
        command="python3 trial.py",
        code_directory="/code",
        platform_config={"platform": "local", "useActiveGpu": False},
        gpu_number=1,
        max_duration_seconds=1800.0,
    )


COMMON: dict[str, Any] = {"experiment_id": "exp1", "time": 1795317335000, "source": "worker-1"}
TRIAL: dict[str, Any] = {**COMMON, "trial_id": "jl7ty"}

EVENTS: list[Any] = [
    ExperimentCreated(
        **COMMON, config={"trialCommand": "python3 trial.py", "trialConcurrency": 2}, working_directory="/e"
    ),
    ExperimentFinished(**COMMON, status="DONE", message="max trial number reached"),
    ExperimentResumed(**COMMON),
    ExperimentImported(**COMMON),
    ExperimentUpdated(
        **COMMON, changes=ExperimentChanges(trial_concurrency=4, search_space={"x": {"_type": "choice"}})
    ),
    ExperimentStopRequested(**COMMON, reason="stopped by the user"),
    CustomizedTrialRequested(**COMMON, parameters={"x": 0.5}),
    CustomizedTrialNumbered(**COMMON, request_id="1-0", sequence_id=3),
    CustomizedTrialRefused(**COMMON, request_id="1-0", reason="maxTrialNumber (4) spoken for"),
    ClusterMetadataSet(**COMMON, key="trial_config", value='{"command": "x"}'),
    TrialsRequested(**COMMON, count=2, seen="1700000000000-0"),
    TunerNoMoreTrials(**COMMON, no_more=True),
    TunerDataImported(**COMMON, data=[ImportedTrial(parameter={"x": 0.5}, value={"default": 0.25, "loss": 1})]),
    TrialSubmitted(**TRIAL, platform="local", form=form(), working_directory="/e/trials/jl7ty", launch=launch()),
    TrialSubmitted(**TRIAL, platform="local", form=form(), working_directory="/e", launch=launch(), requested_by="1-0"),
    TrialDeferred(**TRIAL, reason="GPUs busy"),
    TrialRequeued(**TRIAL, attempt=1, reason="its job was lost"),
    TrialReattached(**TRIAL, attempt=1),
    TrialUnreachable(**TRIAL, attempt=1, reason="host unreachable"),
    TrialStarted(**TRIAL, attempt=1, working_directory="/e/trials/jl7ty", url="file:///e", gpu_indices=[0, 1]),
    TrialMetricReported(**TRIAL, attempt=1, parameter_id="5", metric_type="PERIODICAL", sequence=2, data='"0.5"'),
    TrialMetricRejected(**TRIAL, reason="metric record is not JSON"),
    TrialFormUpdated(**TRIAL, form=form(sequence_id=6)),
    TrialCancelRequested(**TRIAL, status=S.USER_CANCELED, reason="user"),
    TrialAttemptLost(**TRIAL, attempt=1, worker="host:12", reason="lease expired", status=S.WAITING),
    TrialEnded(**TRIAL, attempt=2, status=S.FAILED, exit_code=2, message="exit code 2"),
]


def test_every_event_type_is_covered_here() -> None:
    members = get_args(get_args(Event)[0])

    assert {type(event) for event in EVENTS} == set(members)


@pytest.mark.parametrize("event", EVENTS, ids=lambda event: type(event).__name__)
def test_event_round_trips_through_the_adapter_json(event: Any) -> None:
    stored = event.model_dump_json(by_alias=True, exclude_none=True)  # as the event store writes it

    again = EVENT_ADAPTER.validate_json(stored)

    assert type(again) is type(event)
    assert again == event
    data = json.loads(stored)
    assert data["type"] == type(event).__name__
    assert data["v"] == type(event).model_fields["v"].default  # every event names its schema version
    assert data["experimentId"] == "exp1"
    assert "experiment_id" not in data
    assert EVENT_ADAPTER.validate_json(EVENT_ADAPTER.dump_json(again, by_alias=True)) == event


def _stored(event: Any) -> dict[str, Any]:
    return json.loads(event.model_dump_json(by_alias=True, exclude_none=True))


@pytest.mark.parametrize("event", EVENTS, ids=lambda event: type(event).__name__)
def test_a_future_event_version_fails_validation(event: Any) -> None:
    with pytest.raises(ValidationError):
        EVENT_ADAPTER.validate_json(json.dumps({**_stored(event), "v": _stored(event)["v"] + 1}))


@pytest.mark.parametrize("type_", ["TrialExploded", "trialEnded", "", None])
def test_an_unknown_event_type_fails_validation(type_: Any) -> None:
    data = {**_stored(EVENTS[-1]), "type": type_}

    with pytest.raises(ValidationError):
        EVENT_ADAPTER.validate_json(json.dumps(data))


def test_an_event_without_a_type_fails_validation() -> None:
    data = _stored(EVENTS[-1])
    del data["type"]

    with pytest.raises(ValidationError):
        EVENT_ADAPTER.validate_python(data)


@pytest.mark.parametrize("status", LIVE, ids=str)
def test_trial_ended_refuses_a_non_terminal_status(status: TrialJobStatus) -> None:
    with pytest.raises(ValidationError, match="a trial can only end in a terminal status"):
        TrialEnded(**TRIAL, attempt=1, status=status)
    with pytest.raises(ValidationError, match="a trial can only end in a terminal status"):
        EVENT_ADAPTER.validate_json(json.dumps({**_stored(EVENTS[-1]), "status": status.value}))


@pytest.mark.parametrize("status", TERMINAL, ids=str)
def test_trial_ended_accepts_every_terminal_status(status: TrialJobStatus) -> None:
    event = EVENT_ADAPTER.validate_json(json.dumps({**_stored(EVENTS[-1]), "status": status.value}))

    assert isinstance(event, TrialEnded)
    assert event.status is status


@pytest.mark.parametrize("status", [S.FAILED, S.SUCCEEDED, S.RUNNING, S.WAITING, S.UNKNOWN], ids=str)
def test_cancel_request_only_names_a_cancel_status(status: TrialJobStatus) -> None:
    with pytest.raises(ValidationError):
        TrialCancelRequested(**TRIAL, status=status)  # type: ignore[arg-type]  # not a cancel status: the point


def test_experiment_finished_status_is_checked() -> None:
    with pytest.raises(ValidationError):
        ExperimentFinished(**COMMON, status="SUCCEEDED")  # type: ignore[arg-type]


def test_metric_reported_refuses_an_unknown_metric_type() -> None:
    with pytest.raises(ValidationError):
        TrialMetricReported(**TRIAL, attempt=1, parameter_id="5", metric_type="BEST", sequence=0, data='"1"')  # type: ignore[arg-type]


def test_events_are_immutable() -> None:
    with pytest.raises(ValidationError):
        EVENTS[-1].status = S.SUCCEEDED


def test_event_time_defaults_to_now_in_milliseconds() -> None:
    event = TrialDeferred(experiment_id="e", trial_id="t", reason="busy")

    assert event.time > 1_600_000_000_000  # milliseconds, not seconds
    assert event.source == "manager"
