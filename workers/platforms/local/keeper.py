"""A local trial's keeper, its parent, and the zygote that forks keepers. docs/platforms.md, Local.

The keeper: a child subreaper that forwards SIGTERM, kills what the trial leaves behind, and SIGKILLs everything
when its lifeline (a socket whose other end the worker alone holds) reaches its end. It forks its trial's process
as it starts, while it waits as a spare, so that no fork is between a trial's command and its exec; then it reads
what to run from that lifeline (a 4-byte length, then marshal's `TrialLaunch`; an end before it, a spare the
worker no longer needs, just exits) and hands it on to that process, which enters the trial's directory and execs
its command. It answers on the lifeline with tagged messages, a byte and a signed 4-byte int: `P` and the trial's
pid as it starts, or `E` and the errno of a fork that failed (a limit on processes or memory: the worker launches
the trial again later); then `S` and the trial's exit status (negative for a signal, as `subprocess` has it) when
the trial and every process it left are gone. A keeper that ends before its fork sends only its `S`.

Keepers are forked by a zygote, one per worker process: `python -I -S` with an empty environment, holding
nothing of the worker's, that forks a keeper per request. Starting a keeper's own interpreter cost ~11 ms of
CPU per trial, a seventh of a short trial's CPU with all of the service's; a fork of the zygote costs well
under one. The keeper's parent is then the zygote, which reaps it as it exits (SIGCHLD ignored), so the worker
learns the trial's status from the lifeline rather than from waitpid.
"""

from __future__ import annotations

import contextlib
import logging
import marshal
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, NamedTuple

log = logging.getLogger(__name__)

# Run in a child of the zygote, fd 0 its lifeline, 1 the trial's stdout pipe, 2 /dev/null until it opens the
# trial's stderr; the zygote has imported its modules, and reports `exit_code` (or a SystemExit's) on fd 0.
_KEEPER = r"""
import _ctypes, marshal, os, select, time
import _signal as signal
if _ctypes.call_function(_ctypes.dlsym(_ctypes.dlopen(None), "prctl"), (36, 1, 0, 0, 0)):  # PR_SET_CHILD_SUBREAPER
    raise SystemExit("the keeper cannot become its trial's subreaper")
lifeline = 0

def read_exactly(fd, count):
    data = b""
    while len(data) < count:
        chunk = os.read(fd, count - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data

def read_launch(fd):
    return marshal.loads(read_exactly(fd, int.from_bytes(read_exactly(fd, 4), "big")))

devnull = os.open(os.devnull, os.O_RDWR)
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)  # before the handlers: a SIGTERM between the two would be lost
for number in (signal.SIGTERM, signal.SIGCHLD):
    signal.signal(number, lambda *_: None)
for number in (signal.SIGINT, signal.SIGHUP):
    signal.signal(number, signal.SIG_IGN)
# The trial's process is forked while the keeper waits as a spare, so that no fork is between a trial's command and
# its exec: it waits for its command on a pipe, and the keeper's P goes out before the command comes.
launch_r, launch_w = os.pipe()
try:
    trial = os.fork()
except OSError as error:  # EAGAIN, ENOMEM: the machine's limit, not a trial's fault
    os.write(lifeline, b"E" + error.errno.to_bytes(4, "big", signed=True))
    raise SystemExit(1)
if trial == 0:
    try:
        os.dup2(devnull, 0)  # first: its keeper's death must end the lifeline, whatever this process holds
        os.close(launch_w)  # and the pipe: a spare's end leaves this process an end of file, not a wait for good
        signal.set_wakeup_fd(-1)
        command, cwd, environment, stderr_path = read_launch(launch_r)
        stderr = os.open(stderr_path, os.O_WRONLY | os.O_APPEND)  # made and emptied by the keeper
        os.dup2(stderr, 2)
        try:
            os.chdir(cwd)
        except OSError as error:
            os.write(2, f"trialCodeDirectory {cwd}: {error.strerror}\n".encode(errors="replace"))
            os._exit(1)
        # Python ignores SIGPIPE and SIGXFSZ; a trial gets every signal's default, as a shell would give it.
        for number in (signal.SIGTERM, signal.SIGCHLD, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(number, signal.SIG_DFL)
        os.closerange(3, 1 << 16)
        os.execve("/bin/sh", ["/bin/sh", "-c", command], environment)
    except EOFError:  # a spare its worker no longer needs
        os._exit(0)
    except BaseException as error:
        os.write(2, f"trialstream: cannot start the trial: {error!r}\n".encode(errors="replace"))
    os._exit(127)
os.close(launch_r)
os.write(lifeline, b"P" + trial.to_bytes(4, "big", signed=True))
try:
    command, cwd, environment, stderr_path, kill_wait_s = read_launch(lifeline)
except EOFError:  # a spare its worker no longer needs: its trial's process ends with the pipe
    raise SystemExit(0)
stderr = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o666)
os.dup2(stderr, 2)
os.close(stderr)
forwarded = marshal.dumps((command, cwd, environment, stderr_path))
forwarded = len(forwarded).to_bytes(4, "big") + forwarded
while forwarded:
    forwarded = forwarded[os.write(launch_w, forwarded) :]
os.close(launch_w)
os.dup2(devnull, 1)
status = None

def descendants():
    parents = {}
    try:
        entries = os.listdir("/proc")
    except OSError:  # no /proc to read: only the trial itself is known (signal_all)
        entries = []
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as stat:
                    parents.setdefault(int(stat.read().rpartition(b")")[2].split()[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    found, todo = [], [os.getpid()]
    while todo:
        for child in parents.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found

# What is left of the trial: the processes it left, and itself until its status is known (even where /proc shows
# nothing).
def remaining():
    return set(descendants()) | ({trial} if status is None else set())

# Signals the trial and every process it left; how many took it (not one that became root, as `sudo cmd &` does,
# which the keeper may not signal).
def signal_all(number):
    taken = 0
    for pid in remaining():
        try:
            os.kill(pid, number)
            taken += 1
        except OSError:  # gone, or not the keeper's to signal
            pass
    return taken

def reap():
    global status
    while True:
        pid, code = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        if pid == trial:
            status = code

try:
    while status is None:
        ready, _, _ = select.select([lifeline, wake_r], [], [])
        if lifeline in ready:
            break
        if signal.SIGTERM in os.read(wake_r, 1024):
            signal_all(signal.SIGTERM)
        reap()
    # Until nothing the keeper may end is left (every orphan re-parents here) and the trial's status is known, or
    # for `kill_wait_s` at most: what SIGKILL has not ended by then is stuck (in a driver or a dead NFS mount) and
    # would hold its worker for good.
    given_up_at = time.monotonic() + kill_wait_s
    while True:
        reap()
        if not signal_all(signal.SIGKILL) and status is not None or time.monotonic() > given_up_at:
            break
        time.sleep(0.01)
    left = sorted(remaining())
    if left:
        os.write(2, f"trialstream: left running, beyond the keeper's SIGKILL: pids {left}\n".encode())
    if status is None:  # the trial itself is among them: it counts as killed
        status = signal.SIGKILL
except ChildProcessError:
    pass
exit_code = os.waitstatus_to_exitcode(status)
"""

# The zygote: argv[1] is the keeper's source. Each request on fd 0 (a byte, with the keeper's lifeline and
# stdout pipe as SCM_RIGHTS) is answered with the forked keeper's pid, or minus the errno of a failed fork; an end
# of file (its worker is gone) ends it, and the keepers it forked go on with their own lifelines.
_ZYGOTE = r"""
import _ctypes, _socket, marshal, os, select, sys, time
import _signal as signal
keeper = compile(sys.argv[1], "<keeper>", "exec")
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
requests = _socket.socket(fileno=0)

def run_keeper(lifeline, stdout):
    requests.detach()
    os.dup2(lifeline, 0)
    os.dup2(stdout, 1)
    os.close(lifeline)
    os.close(stdout)
    code = 1
    try:
        os.setsid()
        namespace = {"__name__": "__keeper__"}
        exec(keeper, namespace)
        code = namespace["exit_code"]
    except SystemExit as stop:
        if isinstance(stop.code, str):
            os.write(2, stop.code.encode(errors="replace") + b"\n")
        else:
            code = stop.code or 0
    except BaseException as error:
        os.write(2, f"the keeper failed: {error!r}\n".encode(errors="replace"))
    finally:
        try:
            os.write(0, b"S" + code.to_bytes(4, "big", signed=True))
        finally:
            os._exit(code & 0xFF if code >= 0 else 128 - code)

while True:
    message, ancillary, _, _ = requests.recvmsg(1, _socket.CMSG_SPACE(8))
    if not message:
        break
    fds = [int.from_bytes(data[at : at + 4], sys.byteorder) for _, _, data in ancillary for at in (0, 4)]
    try:
        pid = os.fork()
    except OSError as error:
        pid = -error.errno
    if pid == 0:
        run_keeper(*fds)
    for fd in fds:
        os.close(fd)
    requests.sendall(pid.to_bytes(4, "big", signed=True))
"""


class TrialLaunch(NamedTuple):
    """What a keeper runs, as it goes down its lifeline (marshal's tuple)."""

    command: str
    cwd: str
    environment: dict[str, str]
    stderr: str  # the file the trial's stderr goes to, the keeper's own notes too
    kill_wait_s: float  # what SIGKILL has not ended by then is left, named on that stderr


_INT_BYTES = 4  # a pid, an errno or an exit status on the wire: a signed big-endian int
_MESSAGE_BYTES = 1 + _INT_BYTES  # a keeper's message on its lifeline: a tag (P, E, S), then its int


class Keeper:
    """A trial's keeper as its worker sees it: its pid (its process group's too), the trial's stdout, and its
    lifeline, on which it gets its trial and gives back the trial's exit status (`returncode`)."""

    def __init__(self, zygote: Zygote) -> None:
        self.lifeline, keeper_end = socket.socketpair()
        stdout, stdout_end = os.pipe()
        try:
            self.pid = zygote.fork(keeper_end.fileno(), stdout_end)
        except BaseException:
            self.lifeline.close()
            os.close(stdout)
            raise
        finally:
            keeper_end.close()
            os.close(stdout_end)
        self.stdout: IO[bytes] = open(stdout, "rb", buffering=0)  # noqa: SIM115 (the trial's reader closes it)
        self.returncode: int | None = None
        self.died_without_a_word = False  # killed: what it kept may be left, in its process group

    def run(self, launch: TrialLaunch) -> bool:
        """Send the keeper its trial, and read its first answer (a spare sent it as it started): False if the keeper
        was gone before it got the trial. Raises OSError (EAGAIN, ENOMEM) when its fork of the trial's process
        failed: the trial never ran, the keeper ends."""
        packed = marshal.dumps(tuple(launch))
        try:
            self.lifeline.sendall(len(packed).to_bytes(4, "big") + packed)
            sent = True
        except OSError:  # EPIPE, ECONNRESET: it ended while it waited, maybe after saying why
            sent = False
        match self._receive():
            case (b"E", error):  # whether or not it was still there to take the trial
                raise OSError(error, os.strerror(error))
            case (b"S", status) if sent:  # it ended before its fork
                self.returncode = status
            case None if sent:  # killed, maybe by the trial: `wait` tells it as such
                self._died()
        return sent

    def exit_signal(self) -> int:
        """A descriptor that becomes readable once the keeper is done (its status came, or it died); the caller
        closes it."""
        return os.dup(self.lifeline.fileno())

    def poll(self) -> int | None:
        return self.wait(0)

    def wait(self, timeout: float | None) -> int | None:
        """The trial's exit status once the keeper is done, waiting up to `timeout` (None: for good)."""
        if self.returncode is None and select.select([self.lifeline], [], [], timeout)[0]:
            message = self._receive()
            if message is None:
                self._died()
            else:
                self.returncode = message[1]
        return self.returncode

    def _receive(self) -> tuple[bytes, int] | None:
        """The keeper's next message on its lifeline, or None if it died before it was whole."""
        message = b""
        with contextlib.suppress(OSError):  # reset: it died without a word
            while len(message) < _MESSAGE_BYTES:
                chunk = self.lifeline.recv(_MESSAGE_BYTES - len(message))
                if not chunk:
                    break
                message += chunk
        if len(message) != _MESSAGE_BYTES:
            return None
        return message[:1], int.from_bytes(message[1:], "big", signed=True)

    def _died(self) -> None:
        """A keeper dies without a word only by a signal nobody can catch: the trial killed it, or the OOM killer."""
        self.died_without_a_word = True
        self.returncode = -signal.SIGKILL

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def close(self) -> int:
        """End the lifeline: the keeper kills whatever is left of its trial, if anything; wait until it is done.
        Returns the trial's exit status."""
        with contextlib.suppress(OSError):  # a shutdown, not a close: the exit signal's copy must not keep it open
            self.lifeline.shutdown(socket.SHUT_WR)
        returncode = self.wait(None)
        self.lifeline.close()
        assert returncode is not None  # waited for good
        return returncode

    def discard(self) -> None:
        """Close a keeper that runs no trial, its stdout pipe too (a trial's is its reader's to close)."""
        self.close()
        self.stdout.close()


class ZygoteGone(RuntimeError):
    """The zygote died (killed, or it could not start): the next request starts another."""


class Zygote:
    """The worker's keeper zygote, started at its first request and started again if it died."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._requests: socket.socket | None = None
        self._lock = threading.Lock()
        self._closed = False

    def fork(self, lifeline: int, stdout: int) -> int:
        """A new keeper's pid, `lifeline` and `stdout` its fds 0 and 1."""
        with self._lock:
            if self._closed:  # a spare still being forked as its worker ends must not start another zygote
                raise ZygoteGone("the worker is ending: no more keepers")
            if self._requests is None:
                self._start()
            assert self._requests is not None
            try:
                socket.send_fds(self._requests, [b"k"], [lifeline, stdout])
                reply = self._requests.recv(_INT_BYTES, socket.MSG_WAITALL)
            except OSError:
                reply = b""
            if len(reply) != _INT_BYTES:
                self._stop()
                raise ZygoteGone("the keeper zygote is gone")
        pid = int.from_bytes(reply, "big", signed=True)
        if pid < 0:
            raise OSError(-pid, os.strerror(-pid))
        return pid

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._stop()

    def _start(self) -> None:
        self._requests, zygote_end = socket.socketpair()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _ZYGOTE, _KEEPER],
                env={},  # nothing of the worker's: a trial's environment comes with its command
                stdin=zygote_end.fileno(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,  # until a keeper opens its trial's stderr file
                start_new_session=True,  # no terminal's signals
            )
        except BaseException:
            self._requests.close()
            self._requests = None
            raise
        finally:
            zygote_end.close()

    def _stop(self) -> None:
        """Close the zygote's requests (it exits at their end) and reap it."""
        if self._requests is not None:
            self._requests.close()
            self._requests = None
        if self._process is not None:
            self._process.wait()
            self._process = None


class Keepers:
    """Keepers forked ahead of their trials, so that even the fork is not paid between a trial's pick-up and its
    start: one spare per worker process, the first forked as the worker starts (`replenish`, from the platform's
    `warm_up`: with the zygote, ~14 ms its first trial would otherwise wait); a trial launched while there is none
    forks its own."""

    def __init__(self, kill_wait_s: float) -> None:
        self._kill_wait_s = kill_wait_s
        self._zygote = Zygote()
        self._spare: Keeper | None = None
        self._lock = threading.Lock()
        self._closed = False

    def launch(self, command: str, cwd: Path, env: dict[str, str], stderr: Path) -> Keeper:
        """A keeper running `command`: the spare if there is one (`replenish` forks the next). Raises OSError
        (EAGAIN, ENOMEM) when no process could be forked for it."""
        launch = TrialLaunch(command, str(cwd), env, str(stderr), self._kill_wait_s)
        with self._lock:
            keeper, self._spare = self._spare, None
        if keeper is not None and _started(keeper, launch):
            return keeper
        keeper = self._fork()  # none was spare, or it was killed while it waited
        if not _started(keeper, launch):
            raise RuntimeError("the trial's keeper exited before it got its trial")
        return keeper

    def replenish(self) -> None:
        """Fork a spare for the next trial, on a thread of its own: called as the worker starts serving and once
        each trial's start is recorded."""
        threading.Thread(target=self._replenish, name="spare-keeper", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            keeper, self._spare = self._spare, None
        if keeper is not None:
            keeper.discard()
        self._zygote.close()

    def _fork(self) -> Keeper:
        try:
            return Keeper(self._zygote)
        except ZygoteGone:  # once: a new one that dies at once too is not worth another
            if self._closed:
                raise
            log.warning("the keeper zygote was gone: starting another")
            return Keeper(self._zygote)

    def _replenish(self) -> None:
        try:
            keeper: Keeper | None = self._fork()
        except (OSError, RuntimeError) as error:  # the next launch forks its own
            if not self._closed:
                log.warning("cannot fork a spare keeper: %s", error)
            return
        with self._lock:
            if self._spare is None and not self._closed:
                self._spare, keeper = keeper, None
        if keeper is not None:
            keeper.discard()


def _started(keeper: Keeper, launch: TrialLaunch) -> bool:
    """Hand `keeper` its trial; a keeper that is not running it (gone, or its fork failed) is discarded."""
    try:
        if keeper.run(launch):
            return True
    except OSError:
        keeper.discard()
        raise
    keeper.discard()
    return False
