"""The conformance suite on the remote platform, against two real OpenSSH hosts (simulators/sshd.py): trials
run on the hosts as the hosts' user, and outlive their worker (a lost worker's attempt is re-attached)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from simulators.sshd import SshEnvironment, write_known_hosts
from tests.support.conformance import PlatformConformance, PlatformHarness
from tests.support.remote_setup import RemoteWorkers, remote_section
from tests.support.sshd_setup import running_hosts

pytestmark = pytest.mark.xdist_group("conformance-remote")  # its class's parts and worker start once


@pytest.fixture
def tmp_path(shared_tmp_path: Path) -> Path:
    """Trials on the hosts (another user) read and write the markers these tests create."""
    return shared_tmp_path


class TestRemoteConformance(PlatformConformance):
    @pytest.fixture(scope="class")
    def harness(
        self, ssh_environment: SshEnvironment, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[PlatformHarness]:
        with running_hosts(ssh_environment) as hosts:
            known_hosts = write_known_hosts(tmp_path_factory.mktemp("remote") / "known_hosts", hosts)
            yield PlatformHarness(
                platform_config=remote_section(hosts, ssh_environment.user),
                worker_env=RemoteWorkers.env_for(known_hosts),
                python=sys.executable,  # reachable by the hosts' user (simulators/sshd.py grants it)
            )
