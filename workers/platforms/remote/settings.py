"""The remote platform's own settings (`TRIALSTREAM_KNOWN_HOSTS`, `TRIALSTREAM_SSH_TIMEOUT_S`,
`TRIALSTREAM_SSH_DEAD_AFTER_S`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from core.settings import EnvironmentSettings


class RemoteSettings(EnvironmentSettings):
    known_hosts: Path = Field(
        default=Path("~/.ssh/known_hosts"), description="host keys the remote platform trusts (OpenSSH format)"
    )
    ssh_timeout_s: float = Field(default=10.0, gt=0, description="connecting to a remote host, and each SSH step")
    ssh_dead_after_s: float = Field(
        default=30.0, ge=2, description="a host that acknowledges nothing this long is cut off (its trials UNKNOWN)"
    )
