"""The sshd host fixtures, checked with paramiko (the client the remote platform will use) against real sshd."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from simulators.processes import process_gone
from simulators.sshd import BOOT_ID, MuteHost, SshEnvironment, SshHost, SshUser, write_known_hosts
from simulators.waiting import wait_until

if TYPE_CHECKING:
    from paramiko import SSHClient

paramiko = pytest.importorskip("paramiko")

CONNECT_TIMEOUT_S = 10.0


@pytest.fixture
def known_hosts(tmp_path: Path, ssh_hosts: list[SshHost]) -> Path:
    return write_known_hosts(tmp_path / "known_hosts", ssh_hosts)


@pytest.fixture
def clients() -> Iterator[list[SSHClient]]:
    opened: list[SSHClient] = []
    yield opened
    for client in opened:
        client.close()


def connect(
    clients: list[SSHClient],
    host: SshHost,
    user: SshUser,
    known_hosts: Path | None,
    password: str | None = None,
    **options: float,
) -> SSHClient:
    """A client that trusts only `known_hosts` (RejectPolicy), with the key pair unless a password is given."""
    client = paramiko.SSHClient()
    clients.append(client)
    if known_hosts is not None:
        client.load_host_keys(str(known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    credentials: dict[str, object] = {"password": password} if password else {"key_filename": str(user.private_key)}
    client.connect(
        host.address,
        port=host.port,
        username=user.name,
        look_for_keys=False,
        allow_agent=False,
        timeout=CONNECT_TIMEOUT_S,
        banner_timeout=CONNECT_TIMEOUT_S,
        auth_timeout=CONNECT_TIMEOUT_S,
        **credentials,
        **options,
    )
    return client


def execute(client: SSHClient, command: str) -> tuple[int, str]:
    _, stdout, _ = client.exec_command(command, timeout=CONNECT_TIMEOUT_S)
    output = stdout.read().decode()
    return stdout.channel.recv_exit_status(), output


def test_mode_is_netns_or_loopback(ssh_environment: SshEnvironment, ssh_hosts: list[SshHost]) -> None:
    assert ssh_environment.mode in ("netns", "loopback")
    if ssh_environment.mode == "netns":
        assert all(host.netns and host.port == 22 for host in ssh_hosts)


def test_key_auth(ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, clients: list) -> None:
    client = connect(clients, ssh_hosts[0], ssh_user, known_hosts)
    assert execute(client, "id -un; echo $HOME") == (0, f"{ssh_user.name}\n{ssh_user.home}\n")


def test_password_auth(ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, clients: list) -> None:
    client = connect(clients, ssh_hosts[1], ssh_user, known_hosts, password=ssh_user.password)
    assert execute(client, "id -un") == (0, f"{ssh_user.name}\n")


def test_wrong_password_is_refused(
    ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, clients: list
) -> None:
    with pytest.raises(paramiko.AuthenticationException):
        connect(clients, ssh_hosts[0], ssh_user, known_hosts, password=ssh_user.password + "x")


def test_unknown_host_key_is_refused_until_known_hosts_is_loaded(
    ssh_hosts: list[SshHost], ssh_user: SshUser, tmp_path: Path, clients: list
) -> None:
    host = ssh_hosts[0]
    other = ssh_hosts[1].write_known_hosts(tmp_path / "other_only")
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        connect(clients, host, ssh_user, other)
    trusted = host.write_known_hosts(tmp_path / "known_hosts")
    assert execute(connect(clients, host, ssh_user, trusted), "true") == (0, "")


def test_changed_host_key_is_detected(
    ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, clients: list
) -> None:
    host = ssh_hosts[0]
    old_key = host.host_key
    host.stop()
    assert host.new_host_key() != old_key
    host.start()
    with pytest.raises(paramiko.BadHostKeyException):
        connect(clients, host, ssh_user, known_hosts)


def test_sftp_put_and_get(
    ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, clients: list, tmp_path: Path
) -> None:
    host = ssh_hosts[0]
    data = secrets.token_bytes(256 * 1024)
    (tmp_path / "up.bin").write_bytes(data)
    sftp = connect(clients, host, ssh_user, known_hosts).open_sftp()
    sftp.put(str(tmp_path / "up.bin"), "code.bin")
    sftp.get("code.bin", str(tmp_path / "down.bin"))
    sftp.close()
    assert (tmp_path / "down.bin").read_bytes() == data
    assert (host.home / "code.bin").read_bytes() == data  # the host's own home, seen from the tests
    assert host.run("stat -c %U code.bin").stdout.strip() == ssh_user.name


def test_kill_sessions_drops_connections_but_host_accepts_new_ones(
    ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, clients: list
) -> None:
    host = ssh_hosts[0]
    client = connect(clients, host, ssh_user, known_hosts)
    client.exec_command("exec sleep 300")  # a trial still running when the connection drops
    wait_until(lambda: host.run("pgrep -x -u tstrial sleep", check=False).returncode == 0, what="sleep to start")
    transport = client.get_transport()
    assert transport is not None and transport.is_active()

    assert host.kill_sessions() >= 2  # the privileged monitor and the user's side, at least
    wait_until(lambda: not transport.is_active(), what="paramiko to see the connection drop")
    with pytest.raises((paramiko.SSHException, OSError)):
        client.exec_command("true")
    assert host.run("pgrep -x -u tstrial sleep").returncode == 0  # the command outlives its connection

    assert execute(connect(clients, host, ssh_user, known_hosts), "echo back") == (0, "back\n")
    host.stop()
    assert host.processes() == []  # host down: the orphaned command is gone too


def test_stop_refuses_connections_and_start_brings_the_host_back(
    ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, clients: list
) -> None:
    host = ssh_hosts[1]
    host.stop()
    with pytest.raises(OSError):  # refused (loopback) or network unreachable (netns, link down)
        connect(clients, host, ssh_user, known_hosts)
    host.start()
    assert execute(connect(clients, host, ssh_user, known_hosts), "hostname") == (0, f"{host.hostname}\n")


def test_the_two_hosts_are_distinct(
    ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, clients: list
) -> None:
    first, second = ssh_hosts
    assert (first.address, first.port) != (second.address, second.port)
    assert first.host_key != second.host_key
    first.run("echo one > marker")
    outputs = [execute(connect(clients, host, ssh_user, known_hosts), "hostname; cat marker") for host in ssh_hosts]
    assert outputs[0] == (0, f"{first.hostname}\none\n")
    assert outputs[1][1] == f"{second.hostname}\n" and outputs[1][0] != 0  # no marker on the second host


def test_fake_command_is_on_one_hosts_path_only(
    ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, clients: list
) -> None:
    ssh_hosts[0].add_command("nvidia-smi", "#!/bin/sh\necho 'GPU 0: Fake (UUID: GPU-fake-0)'\n")
    outputs = [execute(connect(clients, host, ssh_user, known_hosts), "nvidia-smi -L") for host in ssh_hosts]
    assert outputs[0] == (0, "GPU 0: Fake (UUID: GPU-fake-0)\n")
    assert outputs[1][0] == 127  # command not found
    assert ssh_hosts[0].run("nvidia-smi -L").stdout == outputs[0][1]


def test_exec_finds_the_tests_python(
    ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, clients: list
) -> None:
    client = connect(clients, ssh_hosts[0], ssh_user, known_hosts)
    status, output = execute(
        client, "python3 -c 'import os, sys; print(os.path.realpath(sys.executable)); print(sys.version)'"
    )
    assert status == 0
    assert output == f"{os.path.realpath(sys.executable)}\n{sys.version}\n"


def test_mute_host_times_out_within_banner_timeout(mute_host: MuteHost, clients: list) -> None:
    client = paramiko.SSHClient()
    clients.append(client)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    banner_timeout = 0.5
    started = time.monotonic()
    with pytest.raises(paramiko.SSHException, match="banner"):
        client.connect(
            mute_host.address, port=mute_host.port, username="x", password="x", banner_timeout=banner_timeout
        )
    assert time.monotonic() - started >= banner_timeout
    wait_until(lambda: mute_host.accepted, what="the mute host to have accepted the connection")


def test_destroy_leaves_nothing_behind(ssh_environment: SshEnvironment, ssh_user: SshUser, clients: list) -> None:
    host = SshHost(ssh_environment, 0)
    try:
        host.start()
        host.run("exec sleep 300 >/dev/null 2>&1 &")  # a stray process the teardown has to find
        pids = host.processes()
        assert len(pids) >= 2
    finally:
        host.destroy()
    assert all(map(process_gone, pids))
    assert not host.dir.exists()
    if host.netns is not None:
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        assert host.netns not in namespaces
        assert host.veth is not None  # named with the namespace
        assert subprocess.run(["ip", "link", "show", host.veth], capture_output=True).returncode != 0


def test_each_host_has_its_own_boot_id(
    ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, clients: list
) -> None:
    machine = Path(BOOT_ID).read_text().strip()
    ids = [execute(connect(clients, host, ssh_user, known_hosts), f"cat {BOOT_ID}") for host in ssh_hosts]
    assert ids == [(0, f"{host.boot_id}\n") for host in ssh_hosts]
    assert len({machine, *(host.boot_id for host in ssh_hosts)}) == 3
    assert ssh_hosts[0].run(f"cat {BOOT_ID}").stdout.strip() == ssh_hosts[0].boot_id


def test_reboot_changes_the_boot_id_and_kills_every_process(
    ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, clients: list
) -> None:
    host = ssh_hosts[0]
    client = connect(clients, host, ssh_user, known_hosts)
    client.exec_command("exec sleep 300")  # a trial running when the host goes down

    def sleeping() -> list[int]:  # this host's own: `pgrep` would also see other hosts' sleeps
        return [pid for pid in host.processes() if command_name(pid) == "sleep"]

    sleeper = wait_until(sleeping, what="sleep to start")[0]
    before_id, before_pids = host.boot_id, host.processes()

    host.reboot()

    assert host.boot_id != before_id
    assert process_gone(sleeper) and all(map(process_gone, before_pids))
    status, output = execute(connect(clients, host, ssh_user, known_hosts), f"cat {BOOT_ID}; hostname")
    assert (status, output) == (0, f"{host.boot_id}\n{host.hostname}\n")
    assert ssh_hosts[1].boot_id != host.boot_id


def command_name(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None  # exited meanwhile
