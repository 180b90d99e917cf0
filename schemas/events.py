"""Domain events: the append-only log is the single source of truth.

Every event is versioned (`v`) and discriminated by `type`. Events are facts in the past tense;
they are written by the manager (commands) and by workers (what happened on a platform).
"""

from __future__ import annotations

import json
import math
import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, TypeAdapter, field_validator

from schemas.trial import (
    CamelModel,
    JobApplicationForm,
    MetricType,
    TrialJobStatus,
    encodable,
    metric_dedup_key,
    metric_score,
)


def now_ms() -> int:
    return int(time.time() * 1000)


class BaseEvent(CamelModel):
    experiment_id: str
    time: int = Field(default_factory=now_ms)
    source: str = "manager"


class TrialEvent(BaseEvent):
    trial_id: str


class ExperimentCreated(BaseEvent):
    type: Literal["ExperimentCreated"] = "ExperimentCreated"
    v: Literal[1] = 1
    config: dict[str, Any]
    working_directory: str


class ExperimentFinished(BaseEvent):
    type: Literal["ExperimentFinished"] = "ExperimentFinished"
    v: Literal[1] = 1
    status: Literal["DONE", "ERROR", "STOPPED"]
    message: str | None = None


class ExperimentResumed(BaseEvent):
    """A runner took the experiment up again from its log (`trialstream resume`)."""

    type: Literal["ExperimentResumed"] = "ExperimentResumed"
    v: Literal[1] = 1


class ExperimentImported(BaseEvent):
    """The log above was imported from another Redis (`trialstream import`): the run that wrote it is not
    here, so its trials have no worker and no lease; resuming it needs `resume --imported`."""

    type: Literal["ExperimentImported"] = "ExperimentImported"
    v: Literal[1] = 1


class TrialsRequested(BaseEvent):
    """The runner asked the tuner for `count` parameter sets, having given it every event of the log up
    to `seen`. With the events it already holds, the log thus has every input of the tuner in order:
    `resume` rebuilds the tuner by replaying them."""

    type: Literal["TrialsRequested"] = "TrialsRequested"
    v: Literal[1] = 1
    count: int = Field(ge=1)
    seen: str


class TunerNoMoreTrials(BaseEvent):
    """The tuner answered a request with NO_MORE_TRIAL_JOBS (`no_more` true: an exhausted grid, PBT between
    generations), or gave parameters again after that (`no_more` false): NNI's TUNER_NO_MORE_TRIAL while
    trials still run. The runner logs it only when it changes; an ExperimentResumed clears it, as the
    tuner of the new run has not answered yet."""

    type: Literal["TunerNoMoreTrials"] = "TunerNoMoreTrials"
    v: Literal[1] = 1
    no_more: bool


class ExperimentChanges(CamelModel):
    """What NNI lets a user change while an experiment runs (`PUT /experiment?update_type=...`)."""

    trial_concurrency: int | None = Field(default=None, ge=1)
    max_trial_number: int | None = Field(default=None, ge=1)
    max_experiment_duration: float | None = Field(default=None, gt=0, description="seconds")
    search_space: Annotated[dict[str, Any] | None, AfterValidator(encodable)] = None

    @property
    def empty(self) -> bool:
        """Nothing is changed: every key absent (or null)."""
        return not self.model_dump(exclude_none=True)


class ExperimentUpdated(BaseEvent):
    """A change to a running experiment: its runner applies it, `resume` replays it, and the
    experiment's view shows it in its config."""

    type: Literal["ExperimentUpdated"] = "ExperimentUpdated"
    v: Literal[1] = 1
    changes: ExperimentChanges


class ExperimentStopRequested(BaseEvent):
    """Stop the experiment (the API, `nnictl`): whichever runner drives it cancels its trials and
    records it STOPPED. A runner that resumes the experiment later does not act on it again."""

    type: Literal["ExperimentStopRequested"] = "ExperimentStopRequested"
    v: Literal[1] = 1
    reason: str | None = None


class CustomizedTrialRequested(BaseEvent):
    """A trial with parameters the user chose (NNI's "customized trial"): the runner submits it in the
    next free slot, within maxTrialNumber, as NNI's manager does."""

    type: Literal["CustomizedTrialRequested"] = "CustomizedTrialRequested"
    v: Literal[1] = 1
    parameters: dict[str, Any]


class CustomizedTrialNumbered(BaseEvent):
    """The runner took the customized trial `request_id` (its CustomizedTrialRequested event) and gave it its
    sequence id at once, as NNI's manager does: the trial is submitted with it when a slot is free."""

    type: Literal["CustomizedTrialNumbered"] = "CustomizedTrialNumbered"
    v: Literal[1] = 1
    request_id: str
    sequence_id: int = Field(ge=0)


class CustomizedTrialRefused(BaseEvent):
    """The runner refused the customized trial `request_id`: maxTrialNumber was spoken for when it read it, or
    the experiment was stopping. It never runs."""

    type: Literal["CustomizedTrialRefused"] = "CustomizedTrialRefused"
    v: Literal[1] = 1
    request_id: str
    reason: str


class ImportedTrial(CamelModel):
    """A result of a trial run elsewhere, for the tuner (an entry of NNI's import-data: `nnictl experiment import`,
    another experiment's export-data). Other keys (an export's `trialJobId`) are ignored."""

    parameter: Annotated[dict[str, Any], AfterValidator(encodable)]
    value: Any = Field(description="a number, an object with a number `default`, or the JSON text of one")

    @field_validator("value")
    @classmethod
    def _a_result(cls, value: Any) -> Any:
        """Decoded as NNI's dispatcher decodes it (export-data writes the JSON text); what no tuner could read,
        refused: every built-in reads the number or its `default`."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                value = None
        score = metric_score(value)
        if score is None or not math.isfinite(score):
            raise ValueError(
                "expected a finite number, an object with a finite number `default`, or the JSON text of one"
            )
        return value


class TunerDataImported(BaseEvent):
    """Results given to the tuner's `import_data` (NNI's IMPORT_DATA): the runner hands them over as it reads this,
    and a resume's replay once more, to its new tuner, in log order."""

    type: Literal["TunerDataImported"] = "TunerDataImported"
    v: Literal[1] = 1
    data: list[ImportedTrial]


TRIAL_CONFIG = "trial_config"  # cluster metadata: the trial command, code directory, GPUs and limits
PLATFORM_CONFIG = "platform_config"  # cluster metadata: the trainingService section (secrets masked)


class ClusterMetadataSet(BaseEvent):
    type: Literal["ClusterMetadataSet"] = "ClusterMetadataSet"
    v: Literal[1] = 1
    key: str
    value: str


class TrialLaunchSpec(CamelModel):
    """Everything a platform needs to run the trial, so a worker reads one event and nothing else."""

    command: str
    code_directory: str
    platform_config: dict[str, Any]
    gpu_number: int | None = None
    max_duration_seconds: float | None = None
    max_retries: int = 0
    platform_configs: list[dict[str, Any]] | None = None
    """A hybrid experiment's every trainingService section (masked, in config order; `platform_config` is
    the one the first attempt was placed on): a retry placed on another listed platform takes its own."""


class TrialSubmitted(TrialEvent):
    """A new trial, placed on `platform` (in a hybrid experiment, the listed platform chosen for it)."""

    type: Literal["TrialSubmitted"] = "TrialSubmitted"
    v: Literal[2] = 2
    platform: str
    form: JobApplicationForm
    working_directory: str
    launch: TrialLaunchSpec
    requested_by: str | None = None  # a customized trial: the id of its CustomizedTrialRequested event


class TrialDeferred(TrialEvent):
    """The platform cannot start the trial yet (its GPUs are busy, its pod cannot be scheduled): it stays
    WAITING, with `reason` as its message."""

    type: Literal["TrialDeferred"] = "TrialDeferred"
    v: Literal[1] = 1
    reason: str


class TrialRequeued(TrialEvent):
    """The attempt's job was queued again: its delivery was lost with a worker, or it was parked
    (TrialDeferred) and what it waits for may be free now."""

    type: Literal["TrialRequeued"] = "TrialRequeued"
    v: Literal[1] = 1
    attempt: int
    reason: str


class TrialReattached(TrialEvent):
    """A worker took up an attempt whose worker was lost while its trial ran on (on a remote host, in a
    pod): the attempt goes on, followed by this worker (`source`)."""

    type: Literal["TrialReattached"] = "TrialReattached"
    v: Literal[1] = 1
    attempt: int


class TrialUnreachable(TrialEvent):
    """Where the attempt runs cannot be reached (its host dropped off the network): the trial is
    UNKNOWN until it is reached again (`reason` None) or given up as lost."""

    type: Literal["TrialUnreachable"] = "TrialUnreachable"
    v: Literal[1] = 1
    attempt: int
    reason: str | None = None


class TrialStarted(TrialEvent):
    type: Literal["TrialStarted"] = "TrialStarted"
    v: Literal[2] = 2
    attempt: int
    working_directory: str
    url: str | None = None
    gpu_indices: list[int] | None = None


class TrialMetricReported(TrialEvent):
    type: Literal["TrialMetricReported"] = "TrialMetricReported"
    v: Literal[2] = 2
    attempt: int
    parameter_id: str
    metric_type: MetricType
    sequence: int
    data: str

    @property
    def dedup_key(self) -> str:
        return metric_dedup_key(self.attempt, self.parameter_id, self.metric_type, self.sequence)


class TrialMetricRejected(TrialEvent):
    """A metric record the trial wrote that could not be read; the trial goes on."""

    type: Literal["TrialMetricRejected"] = "TrialMetricRejected"
    v: Literal[1] = 1
    reason: str


class TrialFormUpdated(TrialEvent):
    """A new parameter set for a multi-phase trial."""

    type: Literal["TrialFormUpdated"] = "TrialFormUpdated"
    v: Literal[1] = 1
    form: JobApplicationForm


StopStatus = Literal[TrialJobStatus.USER_CANCELED, TrialJobStatus.EARLY_STOPPED, TrialJobStatus.SYS_CANCELED]


class TrialCancelRequested(TrialEvent):
    type: Literal["TrialCancelRequested"] = "TrialCancelRequested"
    v: Literal[1] = 1
    status: StopStatus
    reason: str | None = None


TrialCommand = TrialCancelRequested | TrialFormUpdated  # addressed to the running trial: its worker must see them


class TrialEnded(TrialEvent):
    type: Literal["TrialEnded"] = "TrialEnded"
    v: Literal[2] = 2
    attempt: int
    status: TrialJobStatus
    exit_code: int | None = None
    message: str | None = None

    @field_validator("status")
    @classmethod
    def _terminal(cls, status: TrialJobStatus) -> TrialJobStatus:
        if not status.is_terminal:
            raise ValueError(f"a trial can only end in a terminal status, not {status}")
        return status


class TrialAttemptLost(TrialEvent):
    """The worker running an attempt stopped renewing its lease: that attempt is over.

    `status` WAITING means the trial is retried as attempt + 1 (maxTrialRetries allows it), on
    `retry_platform` (a hybrid experiment places each attempt anew; None: where the lost one ran);
    otherwise it is the terminal status the trial ends in.
    """

    type: Literal["TrialAttemptLost"] = "TrialAttemptLost"
    v: Literal[2] = 2
    attempt: int
    worker: str | None = None
    reason: str
    status: TrialJobStatus
    retry_platform: str | None = None

    @field_validator("status")
    @classmethod
    def _retried_or_ended(cls, status: TrialJobStatus) -> TrialJobStatus:
        if status is not TrialJobStatus.WAITING and not status.is_terminal:
            raise ValueError(f"a lost attempt is retried (WAITING) or ends the trial, not {status}")
        return status


Event = Annotated[
    ExperimentCreated
    | ExperimentFinished
    | ExperimentResumed
    | ExperimentImported
    | ExperimentUpdated
    | ExperimentStopRequested
    | CustomizedTrialRequested
    | CustomizedTrialNumbered
    | CustomizedTrialRefused
    | ClusterMetadataSet
    | TrialsRequested
    | TunerNoMoreTrials
    | TunerDataImported
    | TrialSubmitted
    | TrialDeferred
    | TrialRequeued
    | TrialReattached
    | TrialStarted
    | TrialUnreachable
    | TrialMetricReported
    | TrialMetricRejected
    | TrialFormUpdated
    | TrialCancelRequested
    | TrialEnded
    | TrialAttemptLost,
    Field(discriminator="type"),
]

EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)
