"""NNI v2's `openpai` trainingService section: an OpenPAI cluster's REST server, the user and token it
knows, the resources of each trial's job, and the shared storage that carries code and output (mounted
on the manager's host at `localStorageMountPoint`, in the jobs' containers at
`containerStorageMountPoint`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, SecretStr, field_validator, model_validator

from schemas.config import ExperimentConfig, MemoryMib, PlatformConfig


class OpenpaiConfig(PlatformConfig):
    """The token is a secret: it serializes masked (events, views, answers) and reaches the workers
    outside the log, as RemoteMachine.password does."""

    platform: Literal["openpai"] = "openpai"
    host: str = Field(min_length=1)
    username: str = Field(min_length=1)
    token: SecretStr
    trial_cpu_number: int = Field(ge=1)
    trial_memory_size: MemoryMib
    trial_gpu_number: int | None = Field(default=None, ge=0)  # NNI: required here or at the experiment's top level
    storage_config_name: str = Field(min_length=1)
    docker_image: str = Field(default="msranni/nni:latest", min_length=1)
    virtual_cluster: str | None = Field(default=None, min_length=1)  # OpenPAI's own default: 'default'
    local_storage_mount_point: str = Field(min_length=1)
    container_storage_mount_point: str = Field(min_length=1, pattern=r"^/")
    reuse_mode: bool | None = None  # accepted as NNI has it; every trial is its own job here
    openpai_config: dict[str, Any] | None = None
    openpai_config_file: str | None = None

    @field_validator("host")
    @classmethod
    def _with_scheme(cls, value: str) -> str:
        """NNI's rule: a host without a scheme is https."""
        value = value.strip().rstrip("/")
        return value if "://" in value else f"https://{value}"

    @field_validator("container_storage_mount_point")
    @classmethod
    def _no_trailing_slash(cls, value: str) -> str:
        return value.rstrip("/") or "/"

    @model_validator(mode="after")
    def _one_job_template(self) -> OpenpaiConfig:
        if self.openpai_config is not None and self.openpai_config_file is not None:
            raise ValueError("give either 'openpaiConfig' or 'openpaiConfigFile', not both")
        if self.openpai_config_file is not None:  # read once, here, and kept as openpaiConfig: workers need no file
            template = _read_template(self.openpai_config_file)
            return self.model_copy(update={"openpai_config": template, "openpai_config_file": None})
        if self.openpai_config is not None:
            _check_template(self.openpai_config, "openpaiConfig")
        return self

    def problems_with(self, experiment: ExperimentConfig) -> dict[str, str]:
        top = experiment.trial_gpu_number
        if self.trial_gpu_number is None and top is None:
            return {"trialGpuNumber": "required by the openpai platform (0 for a job without GPUs)"}
        if self.trial_gpu_number is not None and top is not None and self.trial_gpu_number != top:
            return {"trialGpuNumber": f"{self.trial_gpu_number} here but {top} at the top level: give it once"}
        return {}


def _read_template(file: str) -> dict[str, Any]:
    path = Path(file).expanduser()
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"cannot read {path}: {error}".splitlines()[0]) from None
    _check_template(loaded, str(path))
    return dict(loaded)


def _check_template(template: Any, where: str) -> None:
    """What the job's command wrapper needs of a user's job: task roles with commands (OpenPAI checks the rest)."""
    roles = template.get("taskRoles") if isinstance(template, dict) else None
    if not isinstance(roles, dict) or not roles:
        raise ValueError(f"{where}: give a job protocol (protocolVersion 2) with at least one entry in 'taskRoles'")
    for name, role in roles.items():
        commands = role.get("commands") if isinstance(role, dict) else None
        if not isinstance(commands, list) or not commands or not all(isinstance(c, str) for c in commands):
            raise ValueError(f"{where}: taskRoles.{name}.commands: give a list of command lines")
