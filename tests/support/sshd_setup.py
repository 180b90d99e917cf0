"""The sshd hosts as pytest fixtures (simulators/sshd.py makes the hosts): the session's environment, its user,
two fresh hosts a test, and a host that takes connections but never speaks SSH."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator

import pytest

from simulators.sshd import MuteHost, SshEnvironment, SshHost, SshUser, make_environment


def _announce(request: pytest.FixtureRequest, line: str) -> None:
    """Prints past pytest's output capture, so every run shows which kind of hosts it used."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(f"\n{line}")


@pytest.fixture(scope="session")
def ssh_environment(request: pytest.FixtureRequest) -> Iterator[SshEnvironment]:
    """Once per run: the test user (key pair + password), the mode (netns or loopback), a temp dir."""
    environment = make_environment()
    how = "network namespaces (veth, 10.234.k.2:22)" if environment.mode == "netns" else "loopback addresses"
    _announce(request, f"[sshd] hosts run in {how}; user {environment.user.name}, files in {environment.base_dir}")
    yield environment
    shutil.rmtree(environment.base_dir, ignore_errors=True)


@pytest.fixture
def ssh_user(ssh_environment: SshEnvironment) -> SshUser:
    """The account to log in as: `.name`, `.password`, `.private_key` (path), `.public_key`."""
    return ssh_environment.user


@contextlib.contextmanager
def running_hosts(environment: SshEnvironment) -> Iterator[list[SshHost]]:
    """Two running, distinct hosts; torn down (processes, namespaces, files) even when a test fails."""
    hosts: list[SshHost] = []
    try:
        for index in range(2):
            hosts.append(SshHost(environment, index))
            hosts[-1].start()
        yield hosts
    finally:
        for host in hosts:
            host.destroy()


@pytest.fixture
def ssh_hosts(ssh_environment: SshEnvironment) -> Iterator[list[SshHost]]:
    """Two fresh hosts of the test's own."""
    with running_hosts(ssh_environment) as hosts:
        yield hosts


@pytest.fixture
def mute_host() -> Iterator[MuteHost]:
    """An address and port that take TCP connections but never speak SSH."""
    host = MuteHost()
    yield host
    host.close()
