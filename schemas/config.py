"""NNI v2 experiment config: keys matched case- and underscore-insensitively, unknown keys rejected."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, ValidationError, model_validator
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
        parts = [part.strip() for part in value.split(",") if part.strip()]
        if not all(part.isascii() and part.isdigit() for part in parts):
            raise ValueError(f"{value!r} is not a list of GPU indices: write them as '0,1' or [0, 1]")
        return [int(part) for part in parts]
    return value


def _platform_sections(value: Any) -> Any:
    """trainingService: one platform's section, or NNI's hybrid list of them; said so, rather than as the union's
    two failed branches."""
    sections = value if isinstance(value, list) else [value]
    if not all(isinstance(section, dict) for section in sections):
        raise ValueError(
            f"expected a platform's section (a mapping such as {{platform: local}}) or a list of them, got {value!r}"
        )
    return value


IndexList = Annotated[list[Annotated[int, Field(ge=0)]], BeforeValidator(_int_list)]


_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|kb|mb|gb|tb|ki|mi|gi|ti|k|m|g|t)?\s*$", re.IGNORECASE)
_MIB_PER_UNIT = {
    "b": 1 / 2**20, "k": 1 / 1024, "kb": 1 / 1024, "ki": 1 / 1024, "m": 1, "mb": 1, "mi": 1,
    "g": 1024, "gb": 1024, "gi": 1024, "t": 2**20, "tb": 2**20, "ti": 2**20,
}  # fmt: skip


def parse_memory_mib(value: Any) -> Any:
    """NNI's memorySize: a number of MiB, or '8gb', '512mb', '2Gi' (NNI's units are binary)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a memory size: use a number of MiB or a size such as '8gb'")
    if isinstance(value, str):
        match = _MEMORY.match(value)
        if not match:
            raise ValueError(f"{value!r} is not a memory size: use a number of MiB or a size such as '8gb'")
        return max(1, round(float(match.group(1)) * _MIB_PER_UNIT[(match.group(2) or "m").lower()]))
    return value


MemoryMib = Annotated[int, BeforeValidator(parse_memory_mib), Field(ge=1)]


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


class ExperimentConfig(NniConfigModel):
    experiment_name: str | None = None
    search_space: dict[str, Any] | None = None
    search_space_file: str | None = None
    trial_command: str = Field(min_length=1)
    trial_code_directory: str = "."
    trial_concurrency: StrictInt = Field(ge=1)  # strict: YAML's `true` is no number of trials
    trial_gpu_number: int | None = Field(default=None, ge=0)
    max_experiment_duration: Duration | None = None
    max_trial_number: StrictInt | None = Field(default=None, ge=1)
    max_trial_duration: Duration | None = None
    max_trial_retries: int = Field(default=0, ge=0)  # trialstream: new attempts of a trial whose worker was lost
    tuner: AlgorithmConfig | None = None
    assessor: AlgorithmConfig | None = None
    advisor: AlgorithmConfig | None = None  # NNI's older key for Hyperband and BOHB; same as `tuner`
    training_service: Annotated[dict[str, Any] | list[dict[str, Any]], BeforeValidator(_platform_sections)]
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
