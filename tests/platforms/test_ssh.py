"""workers/ssh against real OpenSSH hosts (simulators/sshd.py): authentication, host keys, failures, exec, SFTP,
streams."""

from __future__ import annotations

import os
import pickle
import secrets
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from paramiko.common import MSG_CHANNEL_CLOSE, MSG_CHANNEL_DATA, MSG_CHANNEL_EOF
from paramiko.message import Message

from simulators.sshd import MuteHost, SshHost, SshUser, write_known_hosts
from simulators.waiting import wait_until
from workers.platforms.remote.ssh import SshConnection, SshError, SshPool, SshTarget

pytest.importorskip("paramiko")


@pytest.fixture
def known_hosts(tmp_path: Path, ssh_hosts: list[SshHost]) -> Path:
    return write_known_hosts(tmp_path / "known_hosts", ssh_hosts)


@pytest.fixture
def connections() -> Iterator[list[SshConnection]]:
    opened: list[SshConnection] = []
    yield opened
    for connection in opened:
        connection.close()


def target_of(host: SshHost, user: SshUser, known_hosts: Path, **changes: object) -> SshTarget:
    options: dict[str, object] = {"key_file": str(user.private_key), "known_hosts": known_hosts, "timeout_s": 5.0}
    options.update(changes)
    return SshTarget(host.address, host.port, user.name, **options)  # type: ignore[arg-type]


def open_connection(connections: list[SshConnection], target: SshTarget) -> SshConnection:
    connection = SshConnection(target)
    connections.append(connection)
    return connection


def failure(target: SshTarget) -> SshError:
    connection = SshConnection(target)
    try:
        with pytest.raises(SshError) as raised:
            connection.connect()
    finally:
        connection.close()
    assert str(raised.value).startswith(f"{target.label}: ")
    assert "\n" not in str(raised.value)
    return raised.value


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# --- logging in -------------------------------------------------------------------------------------------------


def test_key_auth(ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, connections: list) -> None:
    connection = open_connection(connections, target_of(ssh_hosts[0], ssh_user, known_hosts))
    assert not connection.connected and connection.generation == 0  # the constructor does not connect
    result = connection.run("id -un; hostname")
    assert result.exit_code == 0
    assert result.stdout.decode() == f"{ssh_user.name}\n{ssh_hosts[0].hostname}\n"
    assert connection.connected and connection.generation == 1


def test_password_auth(ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, connections: list) -> None:
    target = target_of(ssh_hosts[1], ssh_user, known_hosts, key_file=None, password=ssh_user.password)
    connection = open_connection(connections, target)
    assert connection.run("id -un").stdout == f"{ssh_user.name}\n".encode()


def test_wrong_password_is_an_auth_error_naming_the_host(
    ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path
) -> None:
    wrong = ssh_user.password + "x"
    target = target_of(ssh_hosts[0], ssh_user, known_hosts, key_file=None, password=wrong)
    error = failure(target)
    assert error.kind == "auth"
    assert "authentication failed" in str(error)
    assert ssh_hosts[0].address in str(error)
    for text in (str(error), repr(error), str(target), repr(target), repr(SshConnection(target))):
        assert wrong not in text and ssh_user.password not in text


def test_ssh_error_keeps_its_kind_when_pickled() -> None:
    error = SshError("u@h:22: connection refused", "refused")
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.kind) == (str(error), "refused")


def test_secrets_stay_out_of_reprs_and_messages(ssh_user: SshUser, tmp_path: Path) -> None:
    target = SshTarget("127.0.0.1", free_port(), "someone", password="hunter2-secret", passphrase="pass-phrase-9")
    error = failure(target)
    for text in (str(target), repr(target), str(error), repr(error), repr(SshConnection(target)), target.label):
        assert "hunter2-secret" not in text and "pass-phrase-9" not in text


def test_a_missing_key_file_is_an_auth_error(ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path) -> None:
    error = failure(target_of(ssh_hosts[0], ssh_user, known_hosts, key_file="~/no-such-key"))
    assert error.kind == "auth"
    assert "no-such-key" in str(error)


@pytest.mark.parametrize(
    "content",
    [b"not a key at all\n", b"-----BEGIN OPENSSH PRIVATE KEY-----\ngarbage\n-----END OPENSSH PRIVATE KEY-----\n"],
)
def test_a_file_that_is_no_private_key_is_one_auth_error(
    ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, tmp_path: Path, content: bytes
) -> None:
    """paramiko hands on the `cryptography` package's ValueError (with a URL in it): it must not escape."""
    key_file = tmp_path / "id_broken"
    key_file.write_bytes(content)
    error = failure(target_of(ssh_hosts[0], ssh_user, known_hosts, key_file=str(key_file)))
    assert error.kind == "auth"
    assert str(error).endswith(
        f"cannot use key file {key_file}: not a private key (OpenSSH or PEM) that paramiko reads"
    )


def test_an_encrypted_key_logs_in_with_its_passphrase_and_says_so_without_it(
    ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, tmp_path: Path, connections: list
) -> None:
    """The test user's own key, encrypted with a passphrase (sshPassphrase): paramiko 5 takes it as bytes (a str
    raised TypeError, a 500 over the API), and says an encrypted key without one with a TypeError too."""
    key_file = tmp_path / "id_encrypted"
    key_file.write_bytes(ssh_user.private_key.read_bytes())
    key_file.chmod(0o600)
    subprocess.run(["ssh-keygen", "-q", "-p", "-N", "pass-phrase-9", "-f", str(key_file)], check=True, timeout=30)
    target = target_of(ssh_hosts[0], ssh_user, known_hosts, key_file=str(key_file), passphrase="pass-phrase-9")
    assert open_connection(connections, target).run("id -un").stdout == f"{ssh_user.name}\n".encode()

    missing = failure(target_of(ssh_hosts[0], ssh_user, known_hosts, key_file=str(key_file)))
    assert missing.kind == "auth" and str(missing).endswith("is encrypted and no passphrase was given")
    wrong = failure(target_of(ssh_hosts[0], ssh_user, known_hosts, key_file=str(key_file), passphrase="wrong"))
    assert wrong.kind == "auth" and str(wrong).endswith("or its sshPassphrase is wrong")
    assert "pass-phrase-9" not in str(wrong) + str(missing)


# --- host keys --------------------------------------------------------------------------------------------------


def test_unknown_host_key(ssh_hosts: list[SshHost], ssh_user: SshUser, tmp_path: Path) -> None:
    only_other = ssh_hosts[1].write_known_hosts(tmp_path / "only_other")
    error = failure(target_of(ssh_hosts[0], ssh_user, only_other))
    assert error.kind == "unknown-host-key"
    assert str(only_other) in str(error) and "ssh-keyscan" in str(error)


def test_a_missing_known_hosts_file_knows_no_host(ssh_hosts: list[SshHost], ssh_user: SshUser, tmp_path: Path) -> None:
    error = failure(target_of(ssh_hosts[0], ssh_user, tmp_path / "absent"))
    assert error.kind == "unknown-host-key"


def test_changed_host_key(ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, connections: list) -> None:
    host = ssh_hosts[0]
    connection = open_connection(connections, target_of(host, ssh_user, known_hosts))
    connection.connect()
    host.new_host_key()
    host.stop()
    host.start()
    wait_until(lambda: not connection.connected, what="the connection to drop with the host")
    with pytest.raises(SshError) as raised:
        connection.run("true")
    assert raised.value.kind == "changed-host-key"
    assert str(known_hosts) in str(raised.value)
    assert failure(target_of(host, ssh_user, known_hosts)).kind == "changed-host-key"


def test_check_host_key_false_accepts_an_unknown_host_and_saves_nothing(
    ssh_hosts: list[SshHost], ssh_user: SshUser, tmp_path: Path, connections: list
) -> None:
    absent = tmp_path / "absent"
    empty = tmp_path / "empty"
    empty.write_text("")
    for known_hosts in (absent, empty):
        target = target_of(ssh_hosts[0], ssh_user, known_hosts, check_host_key=False)
        assert open_connection(connections, target).run("echo ok").stdout == b"ok\n"
    assert not absent.exists() and empty.read_text() == ""


def test_non_standard_port_uses_bracketed_known_hosts_lines(
    ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, connections: list
) -> None:
    host = ssh_hosts[0]
    assert (host.port == 22) == (not host.known_hosts_line.startswith("["))
    assert open_connection(connections, target_of(host, ssh_user, known_hosts)).run("true").exit_code == 0


# --- hosts that are not there -----------------------------------------------------------------------------------


def test_refused(ssh_user: SshUser, tmp_path: Path) -> None:
    error = failure(SshTarget("127.0.0.1", free_port(), ssh_user.name, key_file=str(ssh_user.private_key)))
    assert error.kind == "refused"
    assert str(error).endswith(": connection refused")


def test_a_host_that_does_not_speak_ssh(mute_host: MuteHost, ssh_user: SshUser) -> None:
    target = SshTarget(mute_host.address, mute_host.port, ssh_user.name, password="x", timeout_s=0.5)
    started = time.monotonic()
    error = failure(target)
    assert error.kind == "not-ssh"
    assert "does not speak SSH (no banner within 0.5s)" in str(error)
    assert 0.5 <= time.monotonic() - started < 5


def test_a_stopped_host_fails_then_comes_back(
    ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, connections: list
) -> None:
    host = ssh_hosts[1]
    connection = open_connection(connections, target_of(host, ssh_user, known_hosts, timeout_s=2.0))
    connection.connect()
    host.stop()
    # netns: the link goes down with the host, so its FIN may never arrive and the transport looks alive; the
    # channel open then times out (timeout_s), and the reconnect meets the `unreachable` route at once
    started = time.monotonic()
    with pytest.raises(SshError) as raised:
        connection.run("true")
    assert raised.value.kind in ("refused", "unreachable", "timeout")
    if host.netns is not None:
        assert raised.value.kind == "unreachable"
    assert time.monotonic() - started < 2 * 2.0 + 1
    assert not connection.connected
    host.start()
    assert connection.run("hostname").stdout == f"{host.hostname}\n".encode()
    assert connection.generation == 2


# --- run --------------------------------------------------------------------------------------------------------


@pytest.fixture
def connection(ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, connections: list) -> SshConnection:
    return open_connection(connections, target_of(ssh_hosts[0], ssh_user, known_hosts))


def test_run_exit_code_stdout_stderr_stdin(connection: SshConnection) -> None:
    result = connection.run("echo out; echo err >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr) == (3, b"out\n", b"err\n")
    assert connection.run("tr a-z A-Z", stdin=b"hello\n").stdout == b"HELLO\n"
    assert connection.run("cat", stdin=None).stdout == b""  # EOF at once, no hang
    quoted = connection.run("""printf '%s|' 'single '"'"'quote' "$USER" `echo tick` "a  b"; echo""")
    assert quoted.stdout.decode() == "single 'quote|tstrial|tick|a  b|\n"


def test_run_reads_large_output_on_both_streams(connection: SshConnection) -> None:
    size = 4 << 20
    # stderr first and then stdout: a reader waiting on stdout alone would stall on a full stderr window
    script = f"head -c {size} /dev/zero | tr '\\0' e >&2; head -c {size} /dev/zero | tr '\\0' o"
    result = connection.run(script, timeout_s=30)
    assert result.exit_code == 0
    assert result.stdout == b"o" * size and result.stderr == b"e" * size
    data = secrets.token_bytes(size)
    echoed = connection.run("cat; echo done >&2", stdin=data, timeout_s=30)  # writes back while we still send
    assert echoed.stdout == data and echoed.stderr == b"done\n"


def test_run_that_does_not_read_its_stdin(connection: SshConnection) -> None:
    assert connection.run("echo skipped", stdin=secrets.token_bytes(8 << 20), timeout_s=20).stdout == b"skipped\n"


def test_run_times_out_and_the_connection_stays_usable(connection: SshConnection) -> None:
    started = time.monotonic()
    with pytest.raises(SshError) as raised:
        connection.run("sleep 30", timeout_s=0.5)
    assert raised.value.kind == "timeout" and "timed out after 0.5s" in str(raised.value)
    assert time.monotonic() - started < 3
    assert connection.run("echo still").stdout == b"still\n"
    assert connection.generation == 1


def test_many_threads_share_one_connection(connection: SshConnection, ssh_hosts: list[SshHost]) -> None:
    ssh_hosts[0].run("echo shared > file")

    def job(index: int) -> None:
        for round_ in range(3):
            result = connection.run(f"echo {index}-{round_}; cat file", stdin=None)
            assert result.stdout == f"{index}-{round_}\nshared\n".encode()
            assert connection.read("file", 0) == b"shared\n"

    with ThreadPoolExecutor(20) as pool:
        list(pool.map(job, range(20)))
    assert connection.generation == 1  # every thread used the same transport


def test_runs_reuse_the_connection_over_a_socket_without_nagle(connection: SshConnection) -> None:
    """Every run is a channel on the one open transport, whose socket has Nagle's algorithm off (TCP_NODELAY): with it
    on, each channel open and exec waits out the host's delayed ACK (~50 ms a run on loopback instead of ~5 ms). How
    fast a run is belongs to the benchmarks, not here: this checks the two things that make it fast."""
    connection.connect()
    link = connection._link
    assert link is not None
    assert link.transport.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    for index in range(20):
        assert connection.run(f"echo {index}").stdout == f"{index}\n".encode()
    assert connection._link is link and link.transport.is_active()
    assert connection.generation == 1


def test_an_eof_held_up_until_the_host_closed_the_channel_keeps_the_connection(
    connection: SshConnection, ssh_hosts: list[SshHost]
) -> None:
    """paramiko builds a channel's EOF (or stdin data) under the channel's lock but sends it after letting go, and its
    transport thread answers the host's CHANNEL_CLOSE with ours at once. A thread descheduled in between (a quick
    command; 20 threads on 2 cores) sent its EOF after our CLOSE, to a channel sshd had freed, and sshd dropped the
    whole connection ("ieof packet referred to nonexistent channel"), test_many_threads_share_one_connection's flake.
    Here every EOF and data packet paramiko sends for a caller's thread waits until our CLOSE of its channel went out
    (1 s at most), as such a thread would, so the drop was certain."""
    connection.connect()
    link = connection._link
    assert link is not None
    transport = link.transport
    send = transport._send_user_message
    closed: dict[int, threading.Event] = {}  # by the host's number of the channel

    def descheduled(message: Message) -> None:
        raw = message.asbytes()
        kind, number = raw[0], int.from_bytes(raw[1:5], "big")
        if kind in (MSG_CHANNEL_EOF, MSG_CHANNEL_DATA) and threading.current_thread() is not transport:
            closed.setdefault(number, threading.Event()).wait(1.0)
        send(message)
        if kind == MSG_CHANNEL_CLOSE and (event := closed.pop(number, None)) is not None:
            event.set()

    transport._send_user_message = descheduled
    assert connection.run("true").exit_code == 0  # EOF at once
    assert connection.run("echo skipped", stdin=b"x" * 1000).stdout == b"skipped\n"  # stdin, then EOF
    assert list(connection.lines("echo streamed")) == ["streamed"]
    assert connection.run("true").exit_code == 0  # the host has read all we sent before it
    drops = [line for line in ssh_hosts[0].log_path.read_text().splitlines() if "nonexistent channel" in line]
    assert connection.generation == 1 and connection.connected and not drops, drops


# --- SFTP -------------------------------------------------------------------------------------------------------


def test_write_and_read_with_offsets(connection: SshConnection, ssh_hosts: list[SshHost]) -> None:
    host = ssh_hosts[0]
    data = secrets.token_bytes(3 << 20)
    connection.write("data.bin", data, mode=0o600)
    assert (host.home / "data.bin").read_bytes() == data
    assert stat.S_IMODE((host.home / "data.bin").stat().st_mode) == 0o600
    assert connection.read("data.bin", 0) == data[: 1 << 20]
    assert connection.read("data.bin", 100, 10) == data[100:110]
    assert connection.read("data.bin", len(data) - 5) == data[-5:]
    assert connection.read("data.bin", len(data)) == b""
    assert connection.read("data.bin", len(data) + 100) == b""
    connection.write("data.bin", b"replaced")
    assert connection.read("data.bin", 0) == b"replaced"
    assert not [name for name in os.listdir(host.home) if ".partial-" in name]


def test_read_of_a_missing_file(connection: SshConnection) -> None:
    connection.connect()
    started = time.monotonic()
    with pytest.raises(FileNotFoundError):
        connection.read("no-such-file", 0)
    assert time.monotonic() - started < 0.2  # an answer from the host, not a suspected drop to wait out
    connection.write("now-there", b"x")
    assert connection.read("now-there", 0) == b"x"


def test_write_into_a_missing_directory(connection: SshConnection, ssh_hosts: list[SshHost]) -> None:
    with pytest.raises(FileNotFoundError):
        connection.write("no-dir/file", b"x")
    assert connection.run("mkdir sub").exit_code == 0
    connection.write("sub/file", b"y")
    assert (ssh_hosts[0].home / "sub" / "file").read_bytes() == b"y"


def test_put_uploads_atomically_and_keeps_the_mode(
    connection: SshConnection, ssh_hosts: list[SshHost], tmp_path: Path
) -> None:
    local = tmp_path / "run.sh"
    local.write_bytes(b"#!/bin/sh\necho uploaded\n" + b"#" * (2 << 20) + b"\n")
    local.chmod(0o755)
    connection.put(local, "run.sh")
    assert (ssh_hosts[0].home / "run.sh").read_bytes() == local.read_bytes()
    assert connection.run("./run.sh").stdout == b"uploaded\n"
    assert connection.read("run.sh", 10, 8) == local.read_bytes()[10:18]
    assert not [name for name in os.listdir(ssh_hosts[0].home) if ".partial-" in name]


# --- lines ------------------------------------------------------------------------------------------------------


def test_lines_arrive_while_the_command_runs(connection: SshConnection, ssh_hosts: list[SshHost]) -> None:
    script = "echo first; echo noise >&2; while [ ! -e go ]; do sleep 0.02; done; echo second; printf tail"
    stream = connection.lines(script)
    assert next(stream) == "first"  # before `go` exists: the command is still waiting
    assert ssh_hosts[0].run("test -e go", check=False).returncode != 0
    ssh_hosts[0].run("touch go")
    assert list(stream) == ["second", "tail"]


def test_closing_lines_stops_the_remote_command(connection: SshConnection, ssh_hosts: list[SshHost]) -> None:
    stream = connection.lines("echo $$ > loop.pid; while :; do echo tick; sleep 0.02; done")
    assert next(stream) == "tick"
    pid = ssh_hosts[0].run("cat loop.pid").stdout.strip()
    stream.close()
    wait_until(
        lambda: ssh_hosts[0].run(f"kill -0 {pid}", check=False).returncode != 0,
        what="the remote loop to die of SIGPIPE",
    )
    assert connection.run("echo fine").stdout == b"fine\n"


def test_many_open_streams_do_not_block_runs(connection: SshConnection, ssh_hosts: list[SshHost]) -> None:
    streams = [connection.lines(f"echo {index}; while [ ! -e go ]; do sleep 0.05; done") for index in range(5)]
    assert [next(stream) for stream in streams] == [str(index) for index in range(5)]
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda index: connection.run(f"echo {index}").stdout, range(30)))
    assert results == [f"{index}\n".encode() for index in range(30)]
    ssh_hosts[0].run("touch go")
    assert all(list(stream) == [] for stream in streams)


# --- dropped connections ----------------------------------------------------------------------------------------


def test_run_reconnects_after_the_connection_dropped(connection: SshConnection, ssh_hosts: list[SshHost]) -> None:
    assert connection.run("true").exit_code == 0
    assert connection.generation == 1
    assert ssh_hosts[0].kill_sessions() >= 2
    wait_until(lambda: not connection.connected, what="the drop to be noticed")
    assert connection.run("echo again").stdout == b"again\n"
    assert connection.generation == 2
    assert connection.read(".ssh/authorized_keys", 0).startswith(b"ssh-")  # SFTP reopened on the new transport


def test_sftp_reopens_after_a_drop(connection: SshConnection, ssh_hosts: list[SshHost]) -> None:
    connection.write("before", b"1")
    ssh_hosts[0].kill_sessions()
    wait_until(lambda: not connection.connected, what="the drop to be noticed")
    assert connection.read("before", 0) == b"1"
    assert connection.generation == 2


def test_lines_raises_disconnected_when_the_connection_drops(
    connection: SshConnection, ssh_hosts: list[SshHost]
) -> None:
    stream = connection.lines("echo start; exec sleep 300")
    assert next(stream) == "start"
    ssh_hosts[0].kill_sessions()
    with pytest.raises(SshError) as raised:
        next(stream)
    assert raised.value.kind == "disconnected"
    assert connection.run("echo back").stdout == b"back\n"


def test_run_in_flight_raises_disconnected(connection: SshConnection, ssh_hosts: list[SshHost]) -> None:
    connection.connect()
    errors: list[BaseException] = []

    def sleeper() -> None:
        try:
            connection.run("echo started > started; exec sleep 300", timeout_s=30)
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=sleeper)
    thread.start()
    wait_until(lambda: (ssh_hosts[0].home / "started").exists(), what="the command to start")
    ssh_hosts[0].kill_sessions()
    thread.join(10)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], SshError) and errors[0].kind == "disconnected"


# --- pool -------------------------------------------------------------------------------------------------------


def test_pool_shares_by_target_and_keeps_a_connection_per_credentials(
    ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path
) -> None:
    pool = SshPool()
    try:
        target = target_of(ssh_hosts[0], ssh_user, known_hosts)
        first = pool.connection(target)
        assert pool.connection(target_of(ssh_hosts[0], ssh_user, known_hosts)) is first
        assert pool.connection(target_of(ssh_hosts[1], ssh_user, known_hosts)) is not first
        assert first.run("true").exit_code == 0
        by_password = target_of(ssh_hosts[0], ssh_user, known_hosts, key_file=None, password=ssh_user.password)
        second = pool.connection(by_password)
        assert second is not first and first.connected  # another experiment's connection is left alone
        assert second.run("id -un").stdout == f"{ssh_user.name}\n".encode()
        assert pool.connection(by_password) is second and pool.connection(target) is first
    finally:
        pool.close()
    assert not second.connected
