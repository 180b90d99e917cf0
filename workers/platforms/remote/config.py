"""NNI v2's `remote` trainingService section: the SSH machines trials run on, and how to reach them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, model_validator

from schemas.config import Duration, ExperimentConfig, IndexList, NniConfigModel, PlatformConfig


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
