"""Trial statuses, application forms, views and metrics, with NNI's camelCase JSON names."""

from __future__ import annotations

import functools
import json
import math
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


def encodable(value: Any) -> Any:
    """JSON may carry lone surrogates (`"\\ud800"`), which no UTF-8 store can hold: refused here, as the
    client's mistake (a 4xx), rather than failing as Redis encodes them (a 500, or half a write) or as a JSON dump
    replaces them (text changed behind the client's back). Iterative: a value nested as deep as JSON's parser
    takes (a search space of 950 levels) must not run out of Python's stack here (a 500)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"text {item[:40]!r} holds a lone surrogate: not valid UTF-8") from None
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return value


class CamelModel(BaseModel):
    """Python names in snake_case, JSON names in NNI's camelCase."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True)

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, exclude_none=True)


class TrialJobStatus(StrEnum):
    UNKNOWN = "UNKNOWN"
    WAITING = "WAITING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    USER_CANCELED = "USER_CANCELED"
    SYS_CANCELED = "SYS_CANCELED"
    EARLY_STOPPED = "EARLY_STOPPED"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset(
    {
        TrialJobStatus.SUCCEEDED,
        TrialJobStatus.FAILED,
        TrialJobStatus.USER_CANCELED,
        TrialJobStatus.SYS_CANCELED,
        TrialJobStatus.EARLY_STOPPED,
    }
)

_ALLOWED_TRANSITIONS: dict[TrialJobStatus, frozenset[TrialJobStatus]] = {
    TrialJobStatus.WAITING: frozenset({TrialJobStatus.RUNNING, TrialJobStatus.UNKNOWN} | TERMINAL_STATUSES),
    TrialJobStatus.RUNNING: frozenset({TrialJobStatus.UNKNOWN} | TERMINAL_STATUSES),
    TrialJobStatus.UNKNOWN: frozenset({TrialJobStatus.RUNNING} | TERMINAL_STATUSES),
}


def can_transition(current: TrialJobStatus, new: TrialJobStatus) -> bool:
    """The status state machine: nothing ever leaves a terminal status."""
    return new in _ALLOWED_TRANSITIONS.get(current, frozenset())


class HyperParameters(CamelModel):
    """NNI's form: `value` is the JSON string handed to the trial as parameter.cfg."""

    value: str
    index: int = 0

    @property
    def parameters(self) -> Any:
        """Usually a mapping of names to values; NetworkMorphism hands out a model as a JSON string. A value that
        does not parse (a form updated before the API checked them) is shown as the text it is."""
        try:
            packed = json.loads(self.value)
        except (ValueError, RecursionError):
            return self.value
        return packed.get("parameters", {}) if isinstance(packed, dict) else {}


class JobApplicationForm(CamelModel):
    sequence_id: int
    hyper_parameters: HyperParameters
    placement_constraint: dict[str, Any] | None = None


MetricType = Literal["PERIODICAL", "FINAL", "REQUEST_PARAMETER"]


def metric_dedup_key(attempt: int, parameter_id: str, metric_type: str, sequence: int) -> str:
    """What makes a metric the same metric: delivered twice, it is counted once."""
    return f"{attempt}|{parameter_id}|{metric_type}|{sequence}"


class MetricRecord(CamelModel):
    """One metric as the REST API and the CLI show it; `data` is NNI's double-encoded JSON string."""

    timestamp: int
    trial_job_id: str
    parameter_id: str
    type: MetricType
    sequence: int
    data: str
    attempt: int = 1  # a retried trial reports its metrics again, under its new attempt
    late: bool | None = None  # True: reported after its trial had ended (listed, never its result)

    @property
    def dedup_key(self) -> str:
        return metric_dedup_key(self.attempt, self.parameter_id, self.type, self.sequence)

    @property
    def value(self) -> Any:
        """The reported value: a number, or a dict with a `default` key (NNI's convention)."""
        return _value(self.data)


class TrialJobMetric(CamelModel):
    """What metric listeners receive, as NNI's TrainingService emits it."""

    id: str
    data: str


class TrialJobDetail(CamelModel):
    id: str
    status: TrialJobStatus
    submit_time: int
    start_time: int | None = None
    end_time: int | None = None
    tags: list[str] | None = None
    url: str | None = None
    working_directory: str
    form: JobApplicationForm
    sequence_id: int
    is_early_stopped: bool | None = None
    message: str | None = None
    # trialstream additions
    experiment_id: str
    platform: str
    exit_code: int | None = None
    worker: str | None = None
    attempt: int = 1
    final_metric_data: list[MetricRecord] = []  # of the current attempt

    @property
    def final_metric(self) -> Any:
        """The latest FINAL metric's value, or None."""
        return self.final_metric_data[-1].value if self.final_metric_data else None

    @property
    def final_score(self) -> float | None:
        """metric_score of the final metric: the projector ranks each view it changes, and its timeline scores
        each view change, so a final metric is decoded once for both (by its data)."""
        return _data_score(self.final_metric_data[-1].data) if self.final_metric_data else None


def metric_score(value: Any) -> float | None:
    """The number tuners and 'best so far' compare: the value itself or its `default` entry."""
    if isinstance(value, dict):
        value = value.get("default")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer past a float's range, in a log written before workers rejected it
        return math.inf if value > 0 else -math.inf


def _value(data: str) -> Any:
    decoded = json.loads(data)
    return json.loads(decoded) if isinstance(decoded, str) else decoded


@functools.lru_cache(maxsize=1024)
def _data_score(data: str) -> float | None:
    return metric_score(_value(data))


class TrialConfig(CamelModel):
    """The `trial_config` cluster metadata: how every trial of the experiment is launched."""

    command: str
    code_directory: str
    gpu_number: int | None = None
    max_trial_duration: float | None = None
    max_retries: int = 0


class ExperimentView(CamelModel):
    """An experiment as the projection folds it: status, config (secrets masked), times, cluster metadata."""

    id: str
    status: Literal["RUNNING", "DONE", "ERROR", "STOPPED"] = "RUNNING"
    config: dict[str, Any] = {}
    working_directory: str = ""
    start_time: int | None = None
    end_time: int | None = None
    message: str | None = None
    metadata: dict[str, str] = {}
    imported: bool = False  # its log came from another Redis, and no runner here has taken it up yet
    # True: the tuner said NO_MORE_TRIAL_JOBS since it last gave parameters. None otherwise, never False: the stored
    # view leaves it out then, so a view projected before it was kept reads as one folded again (replay --check)
    tuner_no_more_trials: bool | None = None
    # Its time RUNNING, as NNI's execDuration counts it: ms run before `running_since`, and when the current run
    # began. None in a view projected before they were kept (until it is rebuilt): start to end, as then.
    run_ms: int | None = None
    running_since: int | None = None

    def run_seconds(self, now_ms: int) -> float:
        """How long it has run, as NNI counts it against maxExperimentDuration: not the time it rested DONE or
        STOPPED before an update or a resume took it up again (a runner down while it was RUNNING counts)."""
        running = self.status == "RUNNING"
        if self.run_ms is None:
            return max(0, ((None if running else self.end_time) or now_ms) - (self.start_time or now_ms)) / 1000
        current = now_ms - self.running_since if running and self.running_since is not None else 0
        return max(0, self.run_ms + current) / 1000
