"""NNI v2 experiment config: keys matched case- and underscore-insensitively, unknown keys rejected."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, ValidationError, model_validator
from pydantic.alias_generators import to_camel


def _canonical(key: str) -> str:
    return key.replace("_", "").lower()


class NniConfigModel(BaseModel):
    """Base of every config section: NNI treats `ssh_key_file`, `sshKeyFile` and `SSHKeyFile` alike."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _normalise_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = {_canonical(field.alias or name): field.alias or name for name, field in cls.model_fields.items()}
        normalised: dict[str, Any] = {}
        for key, value in data.items():
            target = known.get(_canonical(str(key)), str(key))
            if target in normalised:
                raise ValueError(f"key {key!r} is given twice (keys are case- and underscore-insensitive)")
            normalised[target] = value
        return normalised


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: Any) -> Any:
    """'1h', '30m', '45s', '2d' or a number of seconds, as NNI accepts them."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration: use a number with a unit s, m, h or d, e.g. '30m'")
    if isinstance(value, str):
        match = _DURATION.match(value.lower())
        if not match:
            raise ValueError(f"{value!r} is not a duration: use a number with a unit s, m, h or d, e.g. '30m'")
        return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    return value


Duration = Annotated[float, BeforeValidator(parse_duration), Field(gt=0)]


def _int_list(value: Any) -> Any:
    """gpuIndices may be written 1, '0,1' or [0, 1]."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, str):
        return [int(part) for part in value.split(",") if part.strip()]
    return value


IndexList = Annotated[list[Annotated[int, Field(ge=0)]], BeforeValidator(_int_list)]


class AlgorithmConfig(NniConfigModel):
    """A tuner, assessor or advisor: a built-in `name`, or NNI v2's customized algorithm, a
    `className` (module.Class) found in `codeDirectory`."""

    name: str | None = None
    class_name: str | None = None
    code_directory: str | None = None
    class_args: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _named_once(self) -> AlgorithmConfig:
        if self.name is None and self.class_name is None:
            raise ValueError(
                "give 'name' (a built-in such as TPE) or 'className' with 'codeDirectory' (a custom algorithm)"
            )
        if self.name is not None and (self.class_name or self.code_directory):
            raise ValueError("give either 'name' (built-in) or 'className' and 'codeDirectory' (custom), not both")
        return self


class PlatformConfig(NniConfigModel):
    """Common part of every `trainingService` section; each platform extends it."""

    platform: str

    def problems_with(self, experiment: ExperimentConfig) -> dict[str, str]:
        """What is wrong with this section given the rest of the config: key -> what to change."""
        return {}


class LocalConfig(PlatformConfig):
    platform: Literal["local"] = "local"
    use_active_gpu: bool | None = None
    max_trial_number_per_gpu: int = Field(default=1, ge=1)
    gpu_indices: IndexList | None = None

    def problems_with(self, experiment: ExperimentConfig) -> dict[str, str]:
        if (experiment.trial_gpu_number or 0) > 0 and self.use_active_gpu is None:
            return {
                "useActiveGpu": "required when trialGpuNumber > 0; set true to share GPUs with other processes, "
                "false to use only idle GPUs"
            }
        return {}


class RemoteMachine(NniConfigModel):
    """One machine of NNI's remote `machineList`. `password` and `sshPassphrase` are secrets: they
    serialize as '**********' (events, views, answers) and reach the workers outside the log."""

    host: str = Field(min_length=1)
    port: int = Field(default=22, ge=1, le=65535)
    user: str = Field(min_length=1)
    password: SecretStr | None = None
    ssh_key_file: str | None = None
    ssh_passphrase: SecretStr | None = None
    use_active_gpu: bool | None = None
    max_trial_number_per_gpu: int = Field(default=1, ge=1)
    gpu_indices: IndexList | None = None
    python_path: str | None = None
    check_host_key: bool = True  # trialstream: false trusts whatever key the host shows (not recommended)

    @model_validator(mode="after")
    def _one_way_in(self) -> RemoteMachine:
        if self.password is not None and self.ssh_key_file is not None:
            raise ValueError("give either 'password' or 'sshKeyFile', not both")
        if self.password is None and self.ssh_key_file is None:
            raise ValueError("give 'password' or 'sshKeyFile' (a private key; add 'sshPassphrase' if it has one)")
        if self.ssh_passphrase is not None and self.ssh_key_file is None:
            raise ValueError("sshPassphrase: only used with 'sshKeyFile'")
        return self

    @property
    def label(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"


class RemoteConfig(PlatformConfig):
    platform: Literal["remote"] = "remote"
    machine_list: list[RemoteMachine] = Field(min_length=1)
    reuse_mode: bool | None = None  # accepted as NNI has it; trialstream keeps one connection per host anyway
    unreachable_timeout: Duration = 300.0  # trialstream: a trial whose host is unreachable this long is lost
    keep_trial_files: bool = False  # trialstream: leave the trials' directories on the hosts after clean-up

    def problems_with(self, experiment: ExperimentConfig) -> dict[str, str]:
        if (experiment.trial_gpu_number or 0) > 0:
            unset = [str(index) for index, machine in enumerate(self.machine_list) if machine.use_active_gpu is None]
            if unset:
                return {
                    f"machineList.{unset[0]}.useActiveGpu": "required when trialGpuNumber > 0; set true to share "
                    "GPUs with other processes, false to use only idle GPUs"
                }
        labels = [machine.label for machine in self.machine_list]
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            return {"machineList": f"{twice[0]} is listed twice"}
        return {}


class ExperimentConfig(NniConfigModel):
    experiment_name: str | None = None
    search_space: dict[str, Any] | None = None
    search_space_file: str | None = None
    trial_command: str = Field(min_length=1)
    trial_code_directory: str = "."
    trial_concurrency: int = Field(ge=1)
    trial_gpu_number: int | None = Field(default=None, ge=0)
    max_experiment_duration: Duration | None = None
    max_trial_number: int | None = Field(default=None, ge=1)
    max_trial_duration: Duration | None = None
    max_trial_retries: int = Field(default=0, ge=0)  # trialstream: new attempts of a trial whose worker was lost
    tuner: AlgorithmConfig | None = None
    assessor: AlgorithmConfig | None = None
    advisor: AlgorithmConfig | None = None  # NNI's older key for Hyperband and BOHB; same as `tuner`
    training_service: dict[str, Any] | list[dict[str, Any]]
    experiment_working_directory: str | None = None
    nni_manager_ip: str | None = None
    debug: bool = False
    log_level: Literal["trace", "debug", "info", "warning", "error", "fatal"] | None = None
    use_annotation: bool = False
    experiment_type: Literal["hpo"] | None = None

    @model_validator(mode="after")
    def _supported(self) -> ExperimentConfig:
        if self.advisor is not None and (self.tuner is not None or self.assessor is not None):
            raise ValueError("advisor: an advisor is both tuner and assessor; remove 'tuner' and 'assessor'")
        if self.use_annotation:
            raise ValueError(
                "useAnnotation: NNI 3.0 no longer ships its annotation tool, so annotated trial code cannot "
                "run; call nni.get_next_parameter() and nni.report_final_result() in the trial instead"
            )
        if self.search_space is not None and self.search_space_file is not None:
            raise ValueError("give either searchSpace or searchSpaceFile, not both")
        return self

    @property
    def tuner_section(self) -> AlgorithmConfig:
        """The tuner (or advisor) that proposes trials: Random when the config names none."""
        return self.advisor or self.tuner or AlgorithmConfig(name="Random")


def platform_names(training_service: Any) -> list[str]:
    """The platforms of a stored trainingService: one section, or a hybrid list of them."""
    sections = training_service if isinstance(training_service, list) else [training_service]
    return [str(section.get("platform", "local")) for section in sections if isinstance(section, dict)]


class ConfigError(ValueError):
    """An invalid experiment config; the message names each key and what is expected."""


def describe_validation_error(error: ValidationError, prefix: str = "") -> str:
    """One line per problem: `key.path: what is wrong (how to fix it)`."""
    lines = []
    for problem in error.errors():
        path = ".".join(str(part) for part in (prefix, *problem["loc"]) if part != "")
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "extra_forbidden":
            message = "unknown key; check its spelling against the NNI v2 config reference"
        elif problem["type"] == "missing":
            message = "required key is missing"
        lines.append(f"{path or 'config'}: {message}")
    return "\n".join(lines)
