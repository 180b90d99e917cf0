"""`trialstream worker --platform <platform>` processes for a platform's tests, started through `Processes`."""

from __future__ import annotations

import subprocess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.conftest import Processes


class PlatformWorkers:
    """Workers of one platform, each started with `env` (what reaches the platform: a trusted known_hosts file,
    a simulated workspace's endpoints) under the variables a test adds."""

    def __init__(self, processes: Processes, platform: str) -> None:
        self.processes = processes
        self.platform = platform

    @property
    def env(self) -> dict[str, str]:
        return {}

    def start(self, env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
        return self.processes.worker(self.platform, env={**self.env, **(env or {})}, args=args)
