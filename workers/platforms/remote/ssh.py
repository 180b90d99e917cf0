"""A small, thread-safe SSH layer over paramiko, for the remote platform that runs trials on other machines.

Every thread of a worker process shares one SSH transport per host: opening a channel on a live transport is a
few milliseconds, a new connection (TCP, key exchange, authentication) is tens of them, so ``run`` never connects
per call. A transport that dropped is reconnected by the next call, never behind the caller's back in the middle
of a command: a command may or may not have run when its connection dropped, and only the caller knows whether
it is safe to run it again. Every failure is an ``SshError`` whose ``kind`` says what to do about it (fix the
credentials, fix known_hosts, wait for the host) and whose message names the host, so the lead's platform can
show it to a user as it is.

Behaviour is deterministic on purpose: only the key file or password of the target is tried (no agent, no
``~/.ssh/id_*``), and only the target's known_hosts file is trusted, so a test machine and a production machine
authenticate the same way.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import shlex
import socket
import stat
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import paramiko
from paramiko.channel import Channel
from paramiko.common import cMSG_CHANNEL_DATA
from paramiko.message import Message
from paramiko.ssh_exception import ChannelException, NoValidConnectionsError

log = logging.getLogger(__name__)

Kind = Literal[
    "auth",
    "unknown-host-key",
    "changed-host-key",
    "refused",
    "unreachable",
    "timeout",
    "not-ssh",
    "disconnected",
    "error",
]

KEEPALIVE_S = 5.0  # an SSH keepalive this often (at most): traffic TCP must get acknowledged, even when idle
MAX_SESSIONS = 6  # channels open at once on one connection, SFTP included: OpenSSH allows 10 (MaxSessions), but
# counts a closed channel until it has processed our close: a margin keeps opens within its count instead of refused
# and retried. (A refusal costs only the retry: the connection drops once blamed on it, "packet referred to
# nonexistent channel", were EOFs sent after our CLOSE, see _send_in_order)
_CHUNK = 1 << 16
_RETRY_FIRST_S = 0.005  # first pause after the host refused a session (then doubled)
_RETRY_MAX_S = 0.1
_LOSS_GRACE_S = 0.25  # paramiko closes a dying transport's channels a moment before it marks itself inactive


@dataclass(frozen=True)
class SshTarget:
    """Where and how to log in; the secrets stay out of ``repr`` and of every message."""

    host: str
    port: int
    user: str
    password: str | None = field(default=None, repr=False)
    key_file: str | None = None  # path, ~ expanded; when given, the password is not tried
    passphrase: str | None = field(default=None, repr=False)
    check_host_key: bool = True  # False: accept any host key (never saved anywhere)
    known_hosts: Path = Path("~/.ssh/known_hosts")  # ~ expanded; a missing file means no host is known
    timeout_s: float = 10.0  # TCP connect, banner, authentication, channel open: each
    dead_after_s: float = 30.0  # TCP_USER_TIMEOUT: unacknowledged data this long kills the connection (a silent host)

    @property
    def label(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"

    @property
    def keepalive_s(self) -> int:
        """A keepalive at least three times within `dead_after_s`, so a silent host is noticed in time."""
        return max(1, int(min(KEEPALIVE_S, self.dead_after_s / 3)))

    @property
    def known_hosts_path(self) -> Path:
        return Path(os.path.expanduser(self.known_hosts))


class SshError(Exception):
    """One line naming the host and the cause; ``kind`` tells the caller what kind of fix it needs."""

    def __init__(self, message: str, kind: Kind = "error") -> None:
        super().__init__(message)
        self.kind: Kind = kind

    def __repr__(self) -> str:
        return f"SshError({str(self)!r}, kind={self.kind!r})"

    def __reduce__(self) -> tuple[type[SshError], tuple[str, Kind]]:
        return SshError, (str(self), self.kind)  # keeps `kind` across pickling (rq jobs, process pools)


@dataclass(frozen=True)
class RunResult:
    """A finished command; ``exit_code`` is -1 when the command died of a signal (SSH sends no exit status then)."""

    exit_code: int
    stdout: bytes
    stderr: bytes


def _seconds(value: float) -> str:
    return f"{value:g}s"


def _socket_kind(error: OSError) -> Kind | None:
    if isinstance(error, ConnectionRefusedError) or error.errno == errno.ECONNREFUSED:
        return "refused"
    if error.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN):
        return "unreachable"
    if isinstance(error, TimeoutError):
        return "timeout"
    return None


def classify(error: BaseException, target: SshTarget) -> SshError:
    """Turns whatever paramiko or the socket raised into an ``SshError`` a user can act on.

    The order matters: paramiko's host-key and authentication errors are ``SSHException``s, which are not
    ``OSError``s, while ``NoValidConnectionsError`` (what ``SSHClient.connect`` raises when every address refused)
    is an ``OSError`` without an errno of its own, so its per-address errors are looked at instead.
    """
    label = target.label
    if isinstance(error, SshError):
        return error
    if isinstance(error, paramiko.BadHostKeyException):
        return SshError(
            f"{label}: host key does not match the one in {target.known_hosts_path} "
            "(the host was reinstalled, or it is an impostor)",
            "changed-host-key",
        )
    if isinstance(error, paramiko.PasswordRequiredException):
        return SshError(f"{label}: the key file {target.key_file} is encrypted and no passphrase was given", "auth")
    if isinstance(error, paramiko.AuthenticationException):
        if "timeout" in str(error).lower():
            return SshError(f"{label}: authentication timed out after {_seconds(target.timeout_s)}", "timeout")
        return SshError(f"{label}: authentication failed (wrong password, or the key is not authorized)", "auth")
    if isinstance(error, NoValidConnectionsError):
        kinds = [_socket_kind(each) for each in error.errors.values()]
        kind: Kind = "refused" if "refused" in kinds else "unreachable"
        return SshError(f"{label}: connection refused" if kind == "refused" else f"{label}: host unreachable", kind)
    if isinstance(error, socket.gaierror):
        return SshError(f"{label}: host unreachable (cannot resolve {target.host}: {error.strerror})", "unreachable")
    if isinstance(error, OSError):
        return _socket_error(error, target)
    if isinstance(error, paramiko.SSHException):
        return _protocol_error(error, target)
    if isinstance(error, EOFError):
        return SshError(f"{label}: connection closed by the host", "disconnected")
    return SshError(f"{label}: {type(error).__name__}: {error}", "error")


def _open_socket(target: SshTarget) -> socket.socket:
    """TCP without Nagle, and with a deadline on unacknowledged data so the keepalive exposes a silent host.

    paramiko leaves Nagle's algorithm on: a channel open or exec then waits out the peer's delayed ACK, and a
    ``run`` on loopback takes ~50 ms instead of ~5 ms (connect: ~70 ms instead of ~30 ms), measured here.
    paramiko's keepalive only sends (it never waits for an answer); without TCP_USER_TIMEOUT the kernel would
    retransmit for ~15 minutes before giving up on a host that vanished without closing the connection.
    """
    sock = socket.create_connection((target.host, target.port), timeout=target.timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(target.dead_after_s * 1000))
        if hasattr(socket, "TCP_KEEPIDLE"):
            probes = max(1, int(target.dead_after_s // target.keepalive_s))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, target.keepalive_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, target.keepalive_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, probes)
    except BaseException:
        sock.close()
        raise
    return sock


def _load_key(target: SshTarget) -> paramiko.PKey:
    """Loads the key up front, so an unreadable or encrypted key says so instead of 'authentication failed'."""
    assert target.key_file is not None
    path = os.path.expanduser(target.key_file)
    passphrase = None if target.passphrase is None else target.passphrase.encode()  # `cryptography` takes bytes
    try:
        return paramiko.PKey.from_path(path, password=passphrase)
    except paramiko.PasswordRequiredException as error:
        raise classify(error, target) from error
    except TypeError as error:  # `cryptography`'s word, through paramiko 5, for an encrypted key and no passphrase
        if passphrase is not None:
            raise
        raise classify(paramiko.PasswordRequiredException(str(error)), target) from error
    except OSError as error:
        raise SshError(f"{target.label}: cannot read key file {path}: {error.strerror or error}", "auth") from error
    except paramiko.SSHException as error:  # a wrong passphrase, or not a private key
        raise SshError(f"{target.label}: cannot use key file {path}: {error}", "auth") from error
    except ValueError as error:  # the `cryptography` package's word for a file that is no key it can read
        what = "not a private key (OpenSSH or PEM) that paramiko reads"
        wrong = " or its sshPassphrase is wrong" if passphrase is not None else ""
        raise SshError(f"{target.label}: cannot use key file {path}: {what}{wrong}", "auth") from error


def _client(target: SshTarget) -> paramiko.SSHClient:
    client = paramiko.SSHClient()
    if target.check_host_key:
        known_hosts = target.known_hosts_path
        if known_hosts.exists():
            # HostKeys.load, not client.load_host_keys: the latter would remember the file as one to save into
            client.get_host_keys().load(str(known_hosts))
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
    else:
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy())  # kept in this client's memory only
    return client


def _handshake(target: SshTarget) -> paramiko.SSHClient:
    """A new, authenticated client, or an SshError; nothing is left open on failure."""
    pkey = _load_key(target) if target.key_file is not None else None
    client = _client(target)
    sock: socket.socket | None = None
    try:
        sock = _open_socket(target)
        client.connect(
            target.host,
            port=target.port,
            username=target.user,
            password=None if pkey is not None else target.password,
            pkey=pkey,
            sock=sock,
            # with `sock` given, `timeout` only bounds the handshake as a whole: were it no longer than the banner
            # timeout it could expire first, and paramiko would then fail with a bare "No existing session"
            timeout=2 * target.timeout_s,
            banner_timeout=target.timeout_s,
            auth_timeout=target.timeout_s,
            channel_timeout=target.timeout_s,
            look_for_keys=False,
            allow_agent=False,
        )
    except Exception as error:
        client.close()
        if sock is not None:
            sock.close()
        raise classify(error, target) from error
    return client


def _pump(read: Callable[[int], bytes], sink: list[bytes]) -> None:
    while chunk := read(_CHUNK):
        sink.append(chunk)


def _drain(read: Callable[[int], bytes]) -> None:
    while read(_CHUNK):
        pass


def _send_in_order(
    channel: Channel, message: Callable[[], Message | None], ready: Callable[[], bool] | None = None
) -> bool:
    """Sends the message `message()` builds on `channel` before any CLOSE of ours; False if the channel closed first.

    paramiko builds a channel's message under the channel's lock but sends it after letting go of the lock, and its
    transport thread answers the host's CHANNEL_CLOSE with ours as soon as it gets that lock. A thread descheduled in
    between (20 threads on 2 cores, a quick command: its host closes the channel within milliseconds) then sends its
    EOF, or stdin data, after our CLOSE, when sshd has already freed the channel, and sshd drops the whole connection,
    every command in flight on it included ("ieof packet referred to nonexistent channel"); had the channel's number
    gone to a new channel meanwhile, the EOF would have ended another command's stdin. So the message is built and
    sent while the lock is held: our CLOSE, whichever thread sends it, comes after it. `ready` (if given) is waited for
    first, with the lock let go meanwhile as paramiko does (a window adjust or the close wakes it). Nor is the lock held
    while a key exchange holds sends back, as paramiko's own sends wait then: the transport thread may need the lock
    to get through the exchange, so the send waits without it and is tried again.
    """
    transport = channel.transport
    give_up = time.monotonic() + transport.clear_to_send_timeout
    while transport.is_active():
        with channel.lock:
            if ready is not None:
                channel.out_buffer_cv.wait_for(lambda: channel.closed or ready())
            if channel.closed:
                return False
            with transport.clear_to_send_lock:
                if transport.clear_to_send.is_set():
                    built = message()
                    if built is not None:
                        transport._send_message(built)
                    return True
        if time.monotonic() > give_up:
            raise paramiko.SSHException("Key-exchange timed out waiting for key negotiation")
        transport.clear_to_send.wait(0.1)
    return False  # as paramiko: a message for a dead transport is dropped


def _send_eof(channel: Channel) -> None:
    """``channel.shutdown_write()``, sent before any CLOSE of ours (see _send_in_order)."""
    _send_in_order(channel, channel._send_eof)


def _send_stdin(channel: Channel, data: bytes) -> bool:
    """``channel.sendall(data)``, each packet sent before any CLOSE of ours (see _send_in_order); False if the
    channel closed (or its EOF went) first."""
    rest = memoryview(data)

    def room() -> bool:
        return bool(channel.eof_sent or channel.out_window_size > 0)

    def packet() -> Message | None:  # called with the channel's lock held, after room()
        nonlocal rest
        size = min(len(rest), channel.out_window_size, channel.out_max_packet_size - 64)
        if channel.eof_sent or size <= 0:
            return None
        channel.out_window_size -= size
        built = Message()
        built.add_byte(cMSG_CHANNEL_DATA)
        built.add_int(channel.remote_chanid)
        built.add_string(rest[:size].tobytes())
        rest = rest[size:]
        return built

    while rest:
        if not _send_in_order(channel, packet, room) or channel.eof_sent:
            return False
    return True


def _feed(channel: Channel, data: bytes) -> None:
    """Writes stdin, then EOF; a command that exits without reading all of it is not an error (as with ssh)."""
    with contextlib.suppress(OSError, EOFError, paramiko.SSHException):  # the channel or the connection went
        if _send_stdin(channel, data):
            _send_eof(channel)


def _thread(target: Callable[..., None], *args: object) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, name="ssh-io", daemon=True)
    thread.start()
    return thread


def _open_timed_out(error: BaseException) -> bool:
    return isinstance(error, paramiko.SSHException) and "Timeout opening channel" in str(error)


def _packets_received(transport: paramiko.Transport) -> int | None:
    """paramiko's count of packets read (private; reset by a rekey, so compare for change only).

    Tells a host that went silent (nothing at all arrived while we waited) from one too busy to answer a channel
    open in time while the other threads' channels still get data: dropping the shared transport in the busy
    case would kill every command in flight on it.
    """
    count = getattr(transport.packetizer, "_Packetizer__received_packets", None)
    return count if isinstance(count, int) else None


def _open_refused(error: BaseException) -> bool:
    # paramiko keeps the host's refusal in one slot per transport: a thread whose refusal another thread took
    # gets the generic "Unable to open channel." instead of the ChannelException
    return isinstance(error, ChannelException) or (
        isinstance(error, paramiko.SSHException) and "Unable to open channel" in str(error)
    )


def _command(script: str) -> str:
    return "sh -c " + shlex.quote(script)


@dataclass
class _Link:
    """One generation of the connection: its transport and the session slots it has left."""

    client: paramiko.SSHClient
    transport: paramiko.Transport
    generation: int
    sessions: threading.BoundedSemaphore


class SshConnection:
    """One SSH transport to one host, shared by every thread of a worker process; reconnects when used after it dropped.

    At most ``max_sessions`` channels are open at once (run, lines and the SFTP session each hold one while
    they last): sshd refuses more than its MaxSessions (10 by default), so more callers wait for a free one
    instead of failing. Long-lived ``lines`` generators hold theirs until closed.
    """

    def __init__(self, target: SshTarget, *, max_sessions: int = MAX_SESSIONS) -> None:
        self.target = target
        self.max_sessions = max_sessions
        self._lock = threading.Lock()  # connecting and dropping: one at a time
        self._link: _Link | None = None
        self._generation = 0
        self._sftp_lock = threading.Lock()  # paramiko's SFTPClient takes one request at a time
        self._sftp: paramiko.SFTPClient | None = None
        self._sftp_link: _Link | None = None

    def __repr__(self) -> str:
        return f"SshConnection({self.target.label}, generation={self._generation}, connected={self.connected})"

    @property
    def connected(self) -> bool:
        link = self._link
        return link is not None and link.transport.is_active()

    @property
    def generation(self) -> int:
        return self._generation

    def connect(self) -> None:
        """(Re)connects unless connected; raises SshError. Callers racing here wait for one connect and share it."""
        self._current()

    def _current(self) -> _Link:
        with self._lock:
            link = self._link
            if link is not None and link.transport.is_active():
                return link
            if link is not None:
                log.warning("ssh %s: connection %d dropped, reconnecting", self.target.label, link.generation)
                link.client.close()
                self._link = None
            client = _handshake(self.target)
            transport = client.get_transport()
            assert transport is not None
            transport.set_keepalive(self.target.keepalive_s)
            self._generation += 1
            self._link = _Link(client, transport, self._generation, threading.BoundedSemaphore(self.max_sessions))
            log.info("ssh %s: connected (generation %d)", self.target.label, self._generation)
            return self._link

    def _drop(self, link: _Link) -> None:
        """Closes `link` unless a newer connection replaced it already, so the next call reconnects."""
        with self._lock:
            if self._link is link:
                self._link = None
        link.client.close()

    def _lost(self, link: _Link) -> bool:
        """Whether `link`'s transport died (as opposed to one channel failing on a live connection)."""
        transport = link.transport
        if not transport.is_active():
            return True
        saved = transport.saved_exception
        if isinstance(saved, (EOFError, OSError)) or (
            isinstance(saved, paramiko.SSHException) and not isinstance(saved, ChannelException)
        ):
            return True
        transport.join(_LOSS_GRACE_S)  # returns at once unless the transport thread is still running
        return not transport.is_active()

    def _failure(self, error: BaseException, link: _Link) -> SshError:
        """The SshError for `error` raised while using `link`; a dead or hung connection is dropped first."""
        if isinstance(error, SshError):
            return error
        if self._lost(link):
            self._drop(link)
            return SshError(f"{self.target.label}: connection lost", "disconnected")
        return classify(error, self.target)

    def _open_channel(self, deadline: float) -> tuple[Channel, _Link]:
        """A session channel holding one of the link's slots (release it with `_close_channel`).

        A transport found dead, or silent for a whole channel-open timeout, is replaced once and the open
        retried: nothing ran on that channel yet. So a host that went away silently (no FIN, no RST)
        costs one timeout_s before the caller learns whether it is reachable at all. An open the host refuses on
        a live connection is retried until `deadline`: sshd frees a session only after it has processed our
        close, so right after a channel closes it can still count it against MaxSessions.
        """
        replaced = False
        pause = _RETRY_FIRST_S
        while True:
            link = self._current()
            if not link.sessions.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise SshError(
                    f"{self.target.label}: no free session within the deadline ({self.max_sessions} in use)", "timeout"
                )
            heard = _packets_received(link.transport)
            try:
                return link.transport.open_session(timeout=self.target.timeout_s), link
            except Exception as error:
                link.sessions.release()
                silent = _open_timed_out(error) and (heard is None or heard == _packets_received(link.transport))
                if not replaced and (silent or self._lost(link)):
                    self._drop(link)  # dead, or hung: a host that vanished without closing the connection
                    replaced = True
                    continue
                if _open_refused(error) and link.transport.is_active() and time.monotonic() + pause < deadline:
                    log.debug("ssh %s: session refused (%s), retrying", self.target.label, error)
                    time.sleep(pause)
                    pause = min(2 * pause, _RETRY_MAX_S)
                    continue
                raise self._failure(error, link) from error

    @staticmethod
    def _close_channel(channel: Channel, link: _Link) -> None:
        channel.close()
        link.sessions.release()

    def run(self, script: str, stdin: bytes | None = None, timeout_s: float = 60.0) -> RunResult:
        """Runs ``sh -c script`` in the user's login shell and waits for it, reading stdout and stderr fully.

        The command's output must end for it to finish: a background process that keeps stdout open (``cmd &``
        without redirection) holds the channel until the timeout, as with ssh. On timeout the channel is closed
        (the remote command is not killed) and SshError(kind="timeout") is raised.
        """
        deadline = time.monotonic() + timeout_s
        channel, link = self._open_channel(deadline)
        try:
            return self._run_on(channel, link, script, stdin, deadline, timeout_s)
        finally:
            self._close_channel(channel, link)

    def _run_on(
        self, channel: Channel, link: _Link, script: str, stdin: bytes | None, deadline: float, timeout_s: float
    ) -> RunResult:
        try:
            channel.exec_command(_command(script))
            if not stdin:
                _send_eof(channel)
        except Exception as error:
            raise self._failure(error, link) from error
        stdout: list[bytes] = []
        stderr: list[bytes] = []
        # one thread per stream: a command filling stderr while we wait on stdout (or not reading its stdin while
        # we write it) would otherwise stall on a full SSH window
        threads = [_thread(_pump, channel.recv, stdout), _thread(_pump, channel.recv_stderr, stderr)]
        if stdin:
            threads.append(_thread(_feed, channel, stdin))
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        finished = not any(thread.is_alive() for thread in threads[:2])
        if finished:
            finished = channel.status_event.wait(max(0.0, deadline - time.monotonic()))
        if not finished:
            channel.close()  # wakes the reader and writer threads
            if self._lost(link):
                self._drop(link)
                raise SshError(f"{self.target.label}: connection lost", "disconnected")
            raise SshError(f"{self.target.label}: command timed out after {_seconds(timeout_s)}", "timeout")
        if channel.exit_status == -1 and self._lost(link):  # closed by the dying transport, not by an exit
            self._drop(link)
            raise SshError(f"{self.target.label}: connection lost while the command ran", "disconnected")
        return RunResult(channel.exit_status, b"".join(stdout), b"".join(stderr))

    def lines(self, script: str) -> Generator[str, None, None]:
        """Runs ``sh -c script`` on a channel of its own and yields its stdout line by line as it arrives.

        Returns once the command exits. Its stdin stays open as long as the stream does: closing the generator
        closes the channel, and a dropped connection closes it on the host, so the command then sees EOF on
        stdin (a command that reads it to its end learns that nobody reads its output any more) and SIGPIPE on
        its next write. stderr is read and dropped, so it cannot stall the command.
        """
        channel, link = self._open_channel(time.monotonic() + self.target.timeout_s)
        try:
            try:
                channel.exec_command(_command(script))
            except Exception as error:
                raise self._failure(error, link) from error
            _thread(_drain, channel.recv_stderr)
            pending = b""
            while chunk := channel.recv(_CHUNK):
                *complete, pending = (pending + chunk).split(b"\n")
                for line in complete:
                    yield line.decode(errors="replace")
            if pending:
                yield pending.decode(errors="replace")
            channel.status_event.wait()  # the exit status, or the close of a dying transport
            if channel.exit_status == -1 and self._lost(link):
                self._drop(link)
                raise SshError(f"{self.target.label}: connection lost while streaming", "disconnected")
        finally:
            self._close_channel(channel, link)

    @contextmanager
    def _sftp_session(self) -> Iterator[paramiko.SFTPClient]:
        """The connection's SFTP client, (re)opened on the current transport; one request at a time."""
        with self._sftp_lock:
            sftp, link = self._sftp_client()
            try:
                yield sftp
            except OSError as error:
                if error.errno is not None:
                    raise  # the host answered with the file's own error (FileNotFoundError, PermissionError, ...)
                raise self._failure(error, link) from error
            except (paramiko.SSHException, EOFError) as error:
                raise self._failure(error, link) from error

    def _sftp_client(self) -> tuple[paramiko.SFTPClient, _Link]:
        """The open SFTP client, or a new one on the current transport (called with the SFTP lock held)."""
        link = self._current()
        sftp, sftp_link = self._sftp, self._sftp_link
        if sftp is not None and sftp_link is link and not sftp.sock.closed:
            return sftp, link
        if sftp is not None:
            sftp.close()
            if sftp_link is link:  # its channel died on a live transport: give its slot back
                link.sessions.release()
        self._sftp = self._sftp_link = None
        channel, link = self._open_channel(time.monotonic() + self.target.timeout_s)
        try:
            channel.invoke_subsystem("sftp")
            sftp = paramiko.SFTPClient(channel)
        except Exception as error:
            self._close_channel(channel, link)
            raise self._failure(error, link) from error
        self._sftp, self._sftp_link = sftp, link
        return sftp, link

    def read(self, path: str, offset: int, limit: int = 1 << 20) -> bytes:
        """Up to `limit` bytes from `offset`; b"" at or past the end; FileNotFoundError if the file is missing."""
        with self._sftp_session() as sftp, sftp.open(path, "rb") as remote:
            remote.seek(offset)
            data: bytes = remote.read(limit)
            return data

    def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Replaces the remote file atomically: readers see the old content or the new, never a part."""
        with self._sftp_session() as sftp:
            partial = _partial_name(path)
            try:
                with sftp.open(partial, "wb") as remote:
                    remote.set_pipelined(True)
                    remote.write(data)
                sftp.chmod(partial, mode)
                sftp.posix_rename(partial, path)
            except BaseException:
                _remove_quietly(sftp, partial)
                raise

    def put(self, local: Path, remote: str) -> None:
        """Uploads a local file atomically the same way, keeping its permission bits (an executable stays one)."""
        mode = stat.S_IMODE(os.stat(local).st_mode)
        with self._sftp_session() as sftp:
            partial = _partial_name(remote)
            try:
                sftp.put(str(local), partial, confirm=True)
                sftp.chmod(partial, mode)
                sftp.posix_rename(partial, remote)
            except BaseException:
                _remove_quietly(sftp, partial)
                raise

    def close(self) -> None:
        """Closes the transport (and every channel on it); a later call connects again."""
        with self._lock:  # not the SFTP lock: a long upload must not hold up closing
            link, self._link = self._link, None
            self._sftp = self._sftp_link = None
        if link is not None:
            link.client.close()


def _partial_name(path: str) -> str:
    return f"{path}.partial-{secrets.token_hex(6)}"


def _remove_quietly(sftp: paramiko.SFTPClient, path: str) -> None:
    with contextlib.suppress(OSError, paramiko.SSHException, EOFError):  # never written, or the connection is gone
        sftp.remove(path)


class SshPool:
    """One SshConnection per target per process, so every thread shares one transport per host. Targets
    that differ (another key, a password: two experiments on one machine) get a connection each, and
    neither disturbs the other's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._connections: dict[SshTarget, SshConnection] = {}

    def connection(self, target: SshTarget) -> SshConnection:
        """The same object for the same target."""
        with self._lock:
            existing = self._connections.get(target)
            if existing is None:
                existing = self._connections[target] = SshConnection(target)
            return existing

    def close(self) -> None:
        with self._lock:
            connections = list(self._connections.values())
            self._connections.clear()
        for connection in connections:
            connection.close()


def _socket_error(error: OSError, target: SshTarget) -> SshError:
    label = target.label
    kind = _socket_kind(error)
    if kind == "refused":
        return SshError(f"{label}: connection refused", "refused")
    if kind == "unreachable":
        return SshError(f"{label}: host unreachable", "unreachable")
    if kind == "timeout":
        return SshError(f"{label}: timed out after {_seconds(target.timeout_s)}", "timeout")
    return SshError(f"{label}: {error.strerror or error}", "error")


def _protocol_error(error: paramiko.SSHException, target: SshTarget) -> SshError:
    """paramiko says what went wrong in the SSH exchange only in its message."""
    label, message = target.label, str(error)
    if "not found in known_hosts" in message:
        return SshError(
            f"{label}: host key is not in {target.known_hosts_path} "
            "(add it with ssh-keyscan, or set checkHostKey: false)",
            "unknown-host-key",
        )
    if "Error reading SSH protocol banner" in message or "Indecipherable protocol version" in message:
        return SshError(
            f"{label}: it accepts connections but does not speak SSH (no banner within {_seconds(target.timeout_s)})",
            "not-ssh",
        )
    if "No existing session" in message:  # the handshake did not finish in time
        return SshError(f"{label}: key exchange timed out after {_seconds(2 * target.timeout_s)}", "timeout")
    if "Timeout opening channel" in message:
        return SshError(f"{label}: opening a channel timed out after {_seconds(target.timeout_s)}", "timeout")
    return SshError(f"{label}: {message or type(error).__name__}", "error")
