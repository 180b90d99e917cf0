"""The conformance suite on the remote platform, against two real OpenSSH hosts (tests/sshd.py): trials
run on the hosts as the hosts' user, and outlive their worker (a lost worker's attempt is re-attached)."""

from __future__ import annotations

import sys

import pytest

from tests.conformance import PlatformConformance, PlatformHarness
from tests.remote_setup import RemoteWorkers, remote_section, remote_workers, tmp_path  # noqa: F401
from tests.sshd import SshHost, SshUser


class TestRemoteConformance(PlatformConformance):
    @pytest.fixture
    def harness(self, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost], ssh_user: SshUser) -> PlatformHarness:  # noqa: F811
        return PlatformHarness(
            platform_config=remote_section(ssh_hosts, ssh_user),
            start_worker=remote_workers.start,
            python=sys.executable,  # reachable by the hosts' user (tests/sshd.py grants it)
        )
