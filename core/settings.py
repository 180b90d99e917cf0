"""trialstream's own settings, in one object.

They are read once, where a process starts (`Settings.from_environment`, from `TRIALSTREAM_*`
variables and the CLI's flags), and passed down explicitly: no module reads the environment for a
setting of its own, and none of them reaches a trial (`trial_environment` strips them).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, ValidationError

from core.variables import PREFIX

_MACHINE_ID_FILES = (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id"))


def default_machine_id() -> str:
    """The machine, not the process or the container: GPU workers in several containers on one
    machine must share one ledger. /etc/machine-id where it is set, else the host name."""
    for path in _MACHINE_ID_FILES:
        try:
            machine_id = path.read_text().strip()
        except OSError:
            continue
        if machine_id:
            return machine_id
    return socket.gethostname()


def _platform_targets(value: object) -> object:
    """`TRIALSTREAM_PLATFORMS` reads `name=module:Class,other=module:Class`."""
    if not isinstance(value, str):
        return value
    targets = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, equals, target = item.partition("=")
        if not equals or ":" not in target:
            raise ValueError(f"{item!r}: write each platform as name=module:Class")
        targets[name.strip()] = target.strip()
    return targets


class SettingError(ValueError):
    """A setting that is not valid; the message names its variable (TRIALSTREAM_...)."""


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    redis_url: str | None = Field(default=None, repr=False)  # may hold a password
    trial_lease_s: float = Field(default=10.0, gt=0, description="a silent worker loses its attempts after this")
    redis_retry_s: float = Field(default=60.0, ge=0, description="how long a command retries while Redis is away")
    kill_grace_s: float = Field(default=5.0, ge=0, description="SIGTERM to SIGKILL, when a trial is stopped")
    machine_id: str = Field(default_factory=default_machine_id, min_length=1, description="the GPU ledger's host")
    fake_gpus: Path | None = Field(default=None, description="a JSON file of GPUs, for tests on machines without any")
    experiments_dir: Path = Path("~/trialstream-experiments")
    known_hosts: Path = Field(
        default=Path("~/.ssh/known_hosts"), description="host keys the remote platform trusts (OpenSSH format)"
    )
    ssh_timeout_s: float = Field(default=10.0, gt=0, description="connecting to a remote host, and each SSH step")
    kubernetes_service_account_dir: Path = Field(
        default=Path("/var/run/secrets/kubernetes.io/serviceaccount"),
        description="the in-cluster account the Kubernetes platforms use when no kubeconfig is found",
    )
    manager_token: SecretStr | None = Field(
        default=None, description="the bearer token `trialstream manager` requires, and the CLI sends to it"
    )
    manager_url: str | None = Field(default=None, description="talk to this `trialstream manager` instead of Redis")
    platforms: Annotated[dict[str, str], BeforeValidator(_platform_targets)] = Field(
        default_factory=dict, description="extra platform adapters: name=module:Class, comma-separated"
    )

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Settings:
        """`TRIALSTREAM_<NAME>` for each field (TRIALSTREAM_LEASE_S, ...), then `overrides` (CLI flags)."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for name in cls.model_fields:
            raw = environ.get(PREFIX + name.upper())
            if raw:
                values[name] = raw
        values.update({name: value for name, value in overrides.items() if value is not None})
        try:
            return cls.model_validate(values)
        except ValidationError as invalid:
            first = invalid.errors()[0]
            name = PREFIX + "_".join(str(part) for part in first["loc"][:1]).upper()
            raise SettingError(f"{name}: {first['msg']}") from None

    def as_environment(self) -> dict[str, str]:
        """The variables that give a child process these settings (the processes of the embedded stack)."""
        values = self.model_dump(exclude_defaults=True, exclude={"manager_token", "manager_url"})  # not a service's
        if "platforms" in values:
            values["platforms"] = ",".join(f"{name}={target}" for name, target in self.platforms.items())
        return {PREFIX + name.upper(): str(value) for name, value in values.items() if value is not None}


def trial_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The user's environment as a trial gets it: without any of trialstream's settings or secrets."""
    return {name: value for name, value in environ.items() if not name.startswith(PREFIX)}
