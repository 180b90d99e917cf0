"""NNI 3.0's REST answers (what its web UI, nnictl and `nni.experiment` read), and the pure conversions
from our views to them.

The models are built so that the shapes that blank or crash NNI's web UI (docs: nni-rest.md, section 5)
cannot be produced: validators refuse them, and the conversions never feed them one. Optional keys the UI
tests for presence (`endTime`, `finalMetricData`, `stderrPath`, `message`) are left out, never null;
`parameterId` and `prefixUrl` are always there (null allowed), as NNI sends them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.config import parse_duration
from schemas.nni_params import nni_params
from schemas.trial import ExperimentView, TrialJobDetail, TrialJobStatus

NNI_VERSION = "3.0.0"
NniMetricType = Literal["PERIODICAL", "FINAL", "CUSTOM"]
NniExperimentStatus = Literal["RUNNING", "NO_MORE_TRIAL", "TUNER_NO_MORE_TRIAL", "DONE", "STOPPED", "ERROR"]
_DURATION = re.compile(r"^\d+(\.\d+)?[smhd]$")
_COMPACT = {"separators": (",", ":"), "ensure_ascii": False}
_HYPER_PARAMETER_KEYS = ("placement_constraint", "version_info")  # the others TrialHyperParameters accepts


class NniModel(BaseModel):
    """Field names are NNI's own (camelCase); `wire()` is the JSON object sent."""

    model_config = ConfigDict(frozen=True, populate_by_name=True)
    omitted_when_none: ClassVar[frozenset[str]] = frozenset()

    def wire(self) -> dict[str, Any]:
        data = self.model_dump(mode="json", by_alias=True)
        return {key: value for key, value in data.items() if value is not None or key not in self.omitted_when_none}

    def wire_json(self) -> str:
        return json.dumps(self.wire(), **_COMPACT)  # type: ignore[arg-type]


class MetricDataRecord(NniModel):
    """One metric. `data` is double-encoded JSON text (the UI and nnictl decode it twice)."""

    timestamp: int
    trial_job_id: str = Field(alias="trialJobId")
    parameter_id: str | None = Field(alias="parameterId")  # null for customized trials
    type: NniMetricType
    sequence: int = Field(ge=0)
    data: str

    @field_validator("data")
    @classmethod
    def _double_encoded(cls, data: str) -> str:
        inner = json.loads(data)
        if not isinstance(inner, str):
            raise ValueError("metric data must be JSON text of JSON text (double-encoded)")
        json.loads(inner)
        return data


class TrialJobInfo(NniModel):
    omitted_when_none = frozenset({"endTime", "message", "stderrPath", "finalMetricData", "envId", "platform"})

    trial_job_id: str = Field(alias="trialJobId")
    status: TrialJobStatus
    sequence_id: int = Field(alias="sequenceId")
    start_time: int = Field(alias="startTime")
    end_time: int | None = Field(default=None, alias="endTime")
    hyper_parameters: list[str] = Field(alias="hyperParameters", min_length=1)
    log_path: str = Field(alias="logPath")
    stderr_path: str | None = Field(default=None, alias="stderrPath")
    message: str | None = None
    env_id: str | None = Field(default=None, alias="envId")
    final_metric_data: list[MetricDataRecord] | None = Field(default=None, alias="finalMetricData")
    platform: str | None = None  # trialstream: where the trial's current attempt runs (hybrid: one of the listed)

    @field_validator("hyper_parameters")
    @classmethod
    def _with_parameters(cls, values: list[str]) -> list[str]:
        for value in values:
            packed = json.loads(value)
            if not isinstance(packed, dict) or "parameters" not in packed:
                raise ValueError("each hyperParameters entry must be JSON of an object with `parameters`")
        return values

    @model_validator(mode="after")
    def _consistent(self) -> TrialJobInfo:
        if self.final_metric_data is not None and (
            self.status is not TrialJobStatus.SUCCEEDED
            or len(self.final_metric_data) != 1
            or self.final_metric_data[0].type != "FINAL"
        ):
            raise ValueError("finalMetricData holds exactly one FINAL record, and only for SUCCEEDED trials")
        if self.end_time is not None and not self.status.is_terminal:
            raise ValueError("endTime is only for trials that have ended")
        return self


class ExperimentProfile(NniModel):
    omitted_when_none = frozenset({"endTime"})

    params: dict[str, Any]
    id: str
    exec_duration: int = Field(alias="execDuration", ge=0)
    log_dir: str = Field(alias="logDir")
    start_time: int = Field(alias="startTime")
    end_time: int | None = Field(default=None, alias="endTime")
    next_sequence_id: int = Field(alias="nextSequenceId")
    revision: int

    @field_validator("params")
    @classmethod
    def _renderable(cls, params: dict[str, Any]) -> dict[str, Any]:
        duration = params.get("maxExperimentDuration")
        if duration is not None and not _is_duration(duration):
            raise ValueError("maxExperimentDuration must be seconds or '<n>[smhd]'")
        if not _is_search_space(params.get("searchSpace", {})):
            raise ValueError("searchSpace must map names to {_type, _value}")
        return params


class ExperimentMetadata(NniModel):
    """An entry of NNI's experiment registry, as `/experiments-info` and `/experiment-metadata` answer."""

    id: str
    port: int
    start_time: int = Field(alias="startTime")
    end_time: int | Literal["N/A"] = Field(alias="endTime")
    status: NniExperimentStatus
    platform: str
    experiment_name: str = Field(alias="experimentName")
    tag: list[str] = []
    pid: int | None  # None: no process of its own here (it runs elsewhere, or was stopped)
    webui_url: list[str] = Field(default=[], alias="webuiUrl")
    log_dir: str = Field(alias="logDir")
    prefix_url: str | None = Field(alias="prefixUrl")


class CheckStatus(NniModel):
    status: NniExperimentStatus
    errors: list[str] = []


class ExportDataEntry(NniModel):
    parameter: Any
    value: str  # the final metric's JSON text, decoded once from the record's data
    trial_job_id: str = Field(alias="trialJobId")


class JobStatistic(NniModel):
    trial_job_status: str = Field(alias="trialJobStatus")
    trial_job_number: int = Field(alias="trialJobNumber")


class SequenceId(NniModel):
    sequence_id: int | None = Field(alias="sequenceId")


TENSORBOARD_TASKS: list[dict[str, Any]] = []  # no TensorBoard: always an empty array, never another shape


# conversions


def hyper_parameters(trial: TrialJobDetail) -> list[str]:
    """The trial's parameter set as NNI lists it: one compact JSON text with exactly the keys
    `TrialHyperParameters` accepts, `parameters` always there."""
    packed = _json_or_none(trial.form.hyper_parameters.value)
    if not isinstance(packed, dict):
        packed = {"parameters": packed if packed is not None else {}}
    entry = {
        "parameter_id": packed.get("parameter_id"),
        "parameter_source": packed.get("parameter_source", "algorithm"),
        "parameters": packed.get("parameters", {}),
        "parameter_index": packed.get("parameter_index", trial.form.hyper_parameters.index),
    }
    entry.update({key: packed[key] for key in _HYPER_PARAMETER_KEYS if key in packed})
    return [json.dumps(entry, **_COMPACT)]  # type: ignore[arg-type]


def log_path(trial: TrialJobDetail) -> str:
    return trial.url or trial.working_directory


def trial_job_info(trial: TrialJobDetail) -> TrialJobInfo:
    final = _served_final(trial)
    path = log_path(trial)
    return TrialJobInfo(
        trialJobId=trial.id,
        status=trial.status,
        sequenceId=trial.sequence_id,
        startTime=trial.start_time if trial.start_time is not None else trial.submit_time,
        endTime=trial.end_time if trial.status.is_terminal else None,
        hyperParameters=hyper_parameters(trial),
        logPath=path,
        stderrPath=f"{path}/stderr" if trial.status is TrialJobStatus.FAILED else None,
        message=trial.message,
        finalMetricData=[final] if final is not None else None,
        platform=trial.platform,
    )


def _served_final(trial: TrialJobDetail) -> MetricDataRecord | None:
    if trial.status is not TrialJobStatus.SUCCEEDED or not trial.final_metric_data:
        return None
    record = trial.final_metric_data[-1]
    return _record(record.timestamp, record.trial_job_id, record.parameter_id, "FINAL", 0, record.data)


def metric_records(trial: TrialJobDetail, stored: Iterable[dict[str, Any]]) -> list[MetricDataRecord]:
    """The trial's metrics as NNI lists them, from the records the projector stored (MetricRecord's JSON
    objects, log order).

    Only the current attempt's are served (a retried trial starts its curve again, and its result is its
    current attempt's), late ones (reported after the trial ended) are left out, and PERIODICAL sequences
    are renumbered 0..n-1 in storage order, so the UI's intermediate chart has no holes."""
    records: list[MetricDataRecord] = []
    periodical = 0
    for record in stored:
        if (
            record.get("attempt", 1) != trial.attempt
            or record.get("late")
            or record["type"] not in ("PERIODICAL", "FINAL")
        ):
            continue
        sequence = 0
        if record["type"] == "PERIODICAL":
            sequence, periodical = periodical, periodical + 1
        records.append(
            _record(record["timestamp"], trial.id, record["parameterId"], record["type"], sequence, record["data"])
        )
    return records


def latest_metric_records(records: list[MetricDataRecord]) -> list[MetricDataRecord]:
    """`/metric-data-latest` of one trial: every non-PERIODICAL record and its highest PERIODICAL one."""
    periodical = [record for record in records if record.type == "PERIODICAL"]
    latest = max(periodical, key=lambda record: record.sequence, default=None)
    return [record for record in records if record.type != "PERIODICAL" or record is latest]


def _record(
    timestamp: int, trial_id: str, parameter_id: str | None, kind: str, sequence: int, data: str
) -> MetricDataRecord:
    return MetricDataRecord(
        timestamp=timestamp,
        trialJobId=trial_id,
        parameterId=None if parameter_id in (None, "None", "null") else parameter_id,
        type=kind,  # type: ignore[arg-type]
        sequence=sequence,
        data=data,
    )


def export_entries(trial: TrialJobDetail) -> list[ExportDataEntry]:
    """`/export-data`: a SUCCEEDED trial with a final metric, its parameters and that metric decoded once."""
    final = _served_final(trial)
    if final is None:
        return []
    packed = json.loads(hyper_parameters(trial)[0])
    return [ExportDataEntry(parameter=packed["parameters"], value=json.loads(final.data), trialJobId=trial.id)]


def experiment_status(view: ExperimentView, submitted: int, now_ms: int) -> NniExperimentStatus:
    """NNI's name for the experiment's status: a RUNNING experiment that has submitted its maxTrialNumber
    trials, or has run its maxExperimentDuration, only waits for its trials to end: NNI's NO_MORE_TRIAL. Else,
    while its tuner's last answer was that it has no more (an exhausted grid), TUNER_NO_MORE_TRIAL."""
    if view.status != "RUNNING":
        return view.status
    budget = view.config.get("maxTrialNumber")
    if (isinstance(budget, int) and submitted >= budget) or _out_of_time(view, now_ms):
        return "NO_MORE_TRIAL"
    return "TUNER_NO_MORE_TRIAL" if view.tuner_no_more_trials else "RUNNING"


def _out_of_time(view: ExperimentView, now_ms: int) -> bool:
    """Whether the experiment has run its maxExperimentDuration, counted as the runner counts it."""
    limit = view.config.get("maxExperimentDuration")
    if limit is None:
        return False
    try:
        seconds = float(parse_duration(limit))
    except (TypeError, ValueError):  # unreadable: as the profile shows it, no limit
        return False
    return view.run_seconds(now_ms) >= seconds


def experiment_profile(view: ExperimentView, submitted: int, revision: int, now_ms: int) -> ExperimentProfile:
    start = view.start_time or now_ms
    params = nni_params(view.config, view.working_directory)
    if not _is_search_space(params.get("searchSpace", {})):
        params["searchSpace"] = {}  # the UI reads `_type` of each entry (and its keys): shown as empty, not broken
    return ExperimentProfile(
        params=params,
        id=view.id,
        execDuration=int(view.run_seconds(now_ms)),
        logDir=view.working_directory,
        startTime=start,
        endTime=view.end_time if view.status != "RUNNING" else None,
        nextSequenceId=submitted,
        revision=revision,
    )


def experiment_metadata(
    view: ExperimentView, submitted: int, *, port: int, pid: int | None, prefix_url: str | None, now_ms: int
) -> ExperimentMetadata:
    platform = view.config.get("trainingService", {})
    platform_name = platform.get("platform", "local") if isinstance(platform, dict) else "hybrid"
    working_directory = view.working_directory.rstrip("/")
    return ExperimentMetadata(
        id=view.id,
        port=port,
        startTime=view.start_time or now_ms,
        endTime=view.end_time if view.end_time is not None and view.status != "RUNNING" else "N/A",
        status=experiment_status(view, submitted, now_ms),
        platform=str(platform_name),
        experimentName=str(view.config.get("experimentName") or view.id),
        pid=pid,
        logDir=working_directory.rsplit("/", 1)[0] if "/" in working_directory else working_directory,
        prefixUrl=prefix_url,
    )


def job_statistics(counts: Mapping[str, int]) -> list[JobStatistic]:
    return [
        JobStatistic(trialJobStatus=status, trialJobNumber=number)
        for status, number in counts.items()
        if status in TrialJobStatus.__members__ and number > 0
    ]


def _is_duration(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return value >= 0
    return isinstance(value, str) and bool(_DURATION.match(value))


def _is_search_space(space: Any) -> bool:
    return isinstance(space, dict) and all(isinstance(entry, dict) and "_type" in entry for entry in space.values())


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
