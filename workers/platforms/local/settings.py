"""The local platform's own settings (`TRIALSTREAM_MACHINE_ID`, `TRIALSTREAM_FAKE_GPUS`,
`TRIALSTREAM_KILL_WAIT_S`, `TRIALSTREAM_GPU_RECORD_TTL_S`)."""

from __future__ import annotations

import socket
from pathlib import Path

from pydantic import Field

from core.settings import EnvironmentSettings

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


class LocalSettings(EnvironmentSettings):
    machine_id: str = Field(default_factory=default_machine_id, min_length=1, description="the GPU ledger's host")
    fake_gpus: Path | None = Field(default=None, description="a JSON file of GPUs, for tests on machines without any")
    kill_wait_s: float = Field(
        default=10.0, gt=0, description="what a trial left that SIGKILL has not ended by then is stuck: left, named"
    )
    gpu_record_ttl_s: float = Field(
        default=60.0,
        ge=3,  # renewed on the worker's housekeeping rounds, a second apart: a shorter one would lapse in between
        description="how long a machine's recorded GPUs count in an experiment's check after a worker of it renewed"
        " them (its live workers do every third of this): a machine whose workers are gone stops counting then",
    )
