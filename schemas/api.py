"""Requests and answers of trialstream's own HTTP API (/api/v1). NNI's are in schemas/nni_rest.py."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from schemas.config import ConfigError
from schemas.events import ExperimentChanges
from schemas.trial import CamelModel, MetricRecord, TrialJobDetail, encodable


class ExperimentRequest(CamelModel):
    """An NNI v2 config (the YAML's mapping, search space inline), and the code it runs: an archive
    uploaded first (`PUT /api/v1/code`), or a directory on the manager's machine in the config."""

    model_config = ConfigDict(alias_generator=None, populate_by_name=True, frozen=True, extra="forbid")

    config: Annotated[dict[str, Any], AfterValidator(encodable)]
    code_id: str | None = Field(default=None, alias="codeId", pattern=r"^[0-9a-f]{64}$")


class ExperimentChangeRequest(ExperimentChanges):
    """The body of `PATCH /experiments/{id}`. Other keys are kept, not dropped as the event model drops them
    (it must read what old events hold), for `check_keys` to refuse: a misspelt key dropped silently left an
    empty change, answered 200 as if it were made."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})  # as answered

    def check_keys(self) -> None:
        """A ConfigError (422) naming the unknown keys and the keys that can be changed."""
        if self.model_extra:
            unknown = ", ".join(self.model_extra)
            changeable = ", ".join(str(field.alias) for field in ExperimentChanges.model_fields.values())
            raise ConfigError(f"{unknown}: unknown key; the keys that can be changed are {changeable}")


class ExperimentCreatedAnswer(CamelModel):
    id: str


class CodeUploaded(CamelModel):
    code_id: str
    size: int


class ExperimentState(CamelModel):
    """An experiment as the API shows it: the config's secrets masked."""

    id: str
    status: str
    start_time: int | None
    end_time: int | None
    message: str | None
    trial_counts: dict[str, int]
    hosted: bool = Field(description="this manager runs it")
    archived: bool = Field(default=False, description="its log is in its archive: reads go there, resume restores it")
    working_directory: str = Field(description="on the manager's machine")
    config: dict[str, Any]


class TrialPage(CamelModel):
    total: int = Field(description="trials in the experiment (before the status filter)")
    offset: int
    items: list[TrialJobDetail]


class CustomizedTrial(BaseModel):
    model_config = ConfigDict(extra="forbid")
    parameters: Annotated[dict[str, Any], AfterValidator(encodable)]


class CustomizedTrialAnswer(CamelModel):
    sequence_id: int | None = Field(
        description="given at once, as NNI does, free slot or not; None only if no runner read the request within "
        "the wait (its runner died, say): the next runner numbers or refuses it (see requestId)"
    )
    request_id: str = Field(
        description="the request's id in the experiment's log: its answer, a CustomizedTrialNumbered or "
        "CustomizedTrialRefused with this requestId, follows it there (`GET .../events?after=<requestId>`)"
    )


class CancelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    early_stopped: bool = Field(default=False, alias="earlyStopped")


class MetricList(CamelModel):
    items: list[MetricRecord]


class EventPage(CamelModel):
    items: list[dict[str, Any]] = Field(description="each {id, event} or {id, unreadable, fields}")
    next: str = Field(description="pass as `after` for the next page")
    head: str = Field(description="the newest entry of the log now (0-0 for none): following from it misses nothing")


class ClusterMetadataValue(CamelModel):
    value: Annotated[str, AfterValidator(encodable)]


class Health(CamelModel):
    status: Literal["ok", "not ready"]
    checks: dict[str, str] = {}
