"""What the remote platform's tests share: a directory both the tests and the hosts' user can use, the
trainingService section for a list of real sshd hosts, and remote workers trusting those hosts."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from simulators.sshd import SshHost, SshUser, write_known_hosts
from tests.support.gated_trial import GATED_TRIAL
from tests.support.workers import PlatformWorkers

if TYPE_CHECKING:
    from manager.training_service import TrainingService
    from tests.conftest import Processes, ServiceFactory


@pytest.fixture
def shared_tmp_path() -> Iterator[Path]:
    """A temporary directory the hosts' user can reach too (pytest's tmp_path is under a root-only
    one): remote tests make it their tmp_path, so trials on the hosts see the markers tests create."""
    path = Path(tempfile.mkdtemp(prefix="trialstream-remote-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def machine(host: SshHost, user: SshUser, **extra: Any) -> dict[str, Any]:
    return {"host": host.address, "port": host.port, "user": user.name, "sshKeyFile": str(user.private_key), **extra}


def remote_section(hosts: list[SshHost], user: SshUser, **extra: Any) -> dict[str, Any]:
    return {"platform": "remote", "machineList": [machine(host, user) for host in hosts], **extra}


class RemoteWorkers(PlatformWorkers):
    """`trialstream worker --platform remote` processes that trust the hosts' keys (known_hosts setting), and give
    up on a silent host after 5 s instead of the default 30 (a partition's tests wait for it)."""

    def __init__(self, processes: Processes, known_hosts: Path) -> None:
        super().__init__(processes, "remote")
        self.known_hosts = known_hosts

    @property
    def env(self) -> dict[str, str]:
        return self.env_for(self.known_hosts)

    @staticmethod
    def env_for(known_hosts: Path) -> dict[str, str]:
        return {"TRIALSTREAM_KNOWN_HOSTS": str(known_hosts), "TRIALSTREAM_SSH_DEAD_AFTER_S": "5"}


@pytest.fixture
def remote_workers(processes: Processes, ssh_hosts: list[SshHost], tmp_path: Path) -> Iterator[RemoteWorkers]:
    """Starts remote workers trusting the two hosts (known_hosts in the test's tmp_path)."""
    known_hosts = write_known_hosts(tmp_path / "known_hosts", ssh_hosts)
    os.chmod(known_hosts, 0o644)
    yield RemoteWorkers(processes, known_hosts)
    processes.stop()  # before the hosts go: a worker following trials there would see them vanish


@pytest.fixture
def remote(
    make_service: ServiceFactory, code_dir: Path, ssh_hosts: list[SshHost], ssh_user: SshUser
) -> Callable[..., TrainingService]:
    """(service factory, hosts): experiments whose trials run TRIAL on the hosts given (both by default)."""
    (code_dir / "trial.py").write_text(GATED_TRIAL)

    def make(
        hosts: list[SshHost] | None = None,
        command: str = f"{sys.executable} trial.py",
        gpu_number: int | None = None,
        max_retries: int = 0,
        **section: Any,
    ) -> TrainingService:
        platform_config = remote_section(hosts or ssh_hosts, ssh_user, **section)
        return make_service(command, platform_config=platform_config, gpu_number=gpu_number, max_retries=max_retries)

    return make
