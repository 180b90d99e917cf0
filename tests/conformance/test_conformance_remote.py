"""The conformance suite on the remote platform, against two real OpenSSH hosts (simulators/sshd.py): trials
run on the hosts as the hosts' user, and outlive their worker (a lost worker's attempt is re-attached)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from simulators.sshd import SshHost, SshUser
from tests.support.conformance import PlatformConformance, PlatformHarness
from tests.support.remote_setup import RemoteWorkers, remote_section


@pytest.fixture
def tmp_path(shared_tmp_path: Path) -> Path:
    """Trials on the hosts (another user) read and write the markers these tests create."""
    return shared_tmp_path


class TestRemoteConformance(PlatformConformance):
    @pytest.fixture
    def harness(self, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost], ssh_user: SshUser) -> PlatformHarness:
        return PlatformHarness(
            platform_config=remote_section(ssh_hosts, ssh_user),
            start_worker=remote_workers.start,
            python=sys.executable,  # reachable by the hosts' user (simulators/sshd.py grants it)
        )
