"""The local platform: trials are processes on the worker's machine, with cwd = the code directory."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import marshal
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path
from typing import IO, ClassVar

import redis
from inotify_simple import INotify, flags

from core.connections import until_redis_answers
from core.leases import AttemptRef
from core.platform import (
    Deferred,
    OutputStream,
    OutputUnavailable,
    StopRequest,
    TrialAssignment,
    TrialControl,
    TrialOutcome,
)
from core.settings import Settings
from schemas.events import TrialLaunchSpec
from schemas.trial import TrialJobStatus
from workers.platforms.local.config import LocalConfig
from workers.platforms.local.settings import LocalSettings
from workers.platforms.shared.gpu import (
    FakeGpuSource,
    GpuLedger,
    GpuPolicy,
    GpuRequestImpossible,
    cuda_visible_devices,
    detect_gpu_source,
)
from workers.platforms.shared.trial_contract import (
    MetricFileReader,
    StdoutMetricPump,
    TrialPaths,
    failure_message,
    forward_file_metrics,
    nni_environment,
    read_tail,
    write_parameters,
)

log = logging.getLogger(__name__)

# The keeper, the trial's parent: a child subreaper that forwards SIGTERM, kills what the trial leaves
# behind, and SIGKILLs everything when its stdin (held by the worker alone) closes. docs/platforms.md, Local.
# It starts before its trial is known (`_Keeper`) and reads what to run from that stdin first: a 4-byte length,
# then marshal's (command, working directory, environment, stderr path); an end of file before it, a spare
# keeper the worker no longer needs, just exits. It imports C modules alone: `ctypes` and `signal` (enum) cost
# ~15 ms more.
_KEEPER = r"""
import _ctypes, marshal, os, resource, select, sys, time
import _signal as signal
if _ctypes.call_function(_ctypes.dlsym(_ctypes.dlopen(None), "prctl"), (36, 1, 0, 0, 0)):  # PR_SET_CHILD_SUBREAPER
    sys.exit("the keeper cannot become its trial's subreaper")
lifeline = os.dup(0)

def read_exactly(count):
    data = b""
    while len(data) < count:
        chunk = os.read(lifeline, count - len(data))
        if not chunk:
            sys.exit(0)
        data += chunk
    return data

command, cwd, environment, stderr_path = marshal.loads(read_exactly(int.from_bytes(read_exactly(4), "big")))
stderr = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
os.dup2(stderr, 2)
os.close(stderr)
try:
    os.chdir(cwd)
except OSError as error:
    sys.exit(f"trialCodeDirectory {cwd}: {error.strerror}")
devnull = os.open(os.devnull, os.O_RDWR)
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
for number in (signal.SIGTERM, signal.SIGCHLD):
    signal.signal(number, lambda *_: None)
for number in (signal.SIGINT, signal.SIGHUP):
    signal.signal(number, signal.SIG_IGN)
signal.set_wakeup_fd(wake_w)
trial = os.fork()
if trial == 0:
    signal.set_wakeup_fd(-1)
    for number in (signal.SIGTERM, signal.SIGCHLD, signal.SIGINT, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)
    os.dup2(devnull, 0)
    os.closerange(3, 1 << 16)
    os.execve("/bin/sh", ["/bin/sh", "-c", command], environment)
os.dup2(devnull, 1)
status = None

def descendants():
    parents = {}
    for entry in os.listdir("/proc"):
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

def signal_all(number):
    for pid in descendants():
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass

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
    while True:  # until no child is left: then nothing of the trial is (every orphan re-parents here)
        reap()
        signal_all(signal.SIGKILL)
        time.sleep(0.01)
except ChildProcessError:
    pass
if os.WIFSIGNALED(status):  # die of the same signal, so the worker sees what killed the trial
    number = os.WTERMSIG(status)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.set_wakeup_fd(-1)
    if number not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(number, signal.SIG_DFL)
    os.kill(os.getpid(), number)
    os._exit(128 + number)
os._exit(os.waitstatus_to_exitcode(status))  # nothing to flush or tear down: ~2 ms sooner than sys.exit
"""
IDLE_WAIT_S = 0.5  # a safety net: the watch loop is woken by the trial's exit, its metric writes and commands
POLL_S = 0.005  # how often the metrics file is read where inotify is not available
DRAIN_S = 1.0  # how long stdout is still read once the trial and its descendants are gone
READ_BYTES = 65536
OUTPUT_READ_BYTES = 1 << 20  # the most read_output returns at once: the caller loops for more


class LocalPlatform:
    """Trials are processes of the worker's own machine, and die with their worker (so a lost attempt
    is never re-attached: it is retried or failed)."""

    name: ClassVar[str] = "local"
    config_model: ClassVar[type[LocalConfig]] = LocalConfig
    trials_per_process: ClassVar[int] = 64
    trials_outlive_worker: ClassVar[bool] = False

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        own = settings.of(LocalSettings)
        source = FakeGpuSource(own.fake_gpus) if own.fake_gpus else detect_gpu_source()
        self.ledger = GpuLedger(client, own.machine_id, source)
        self.kill_grace_s = settings.kill_grace_s
        self.keepers = _Keepers()

    @classmethod
    def check(cls, config: LocalConfig, code_directory: Path, settings: Settings) -> list[str]:
        """Nothing to reach: trials run on the workers' own machines."""
        return []

    def stage(self, experiment_id: str, launch: TrialLaunchSpec, config: LocalConfig) -> None:
        """Nothing to copy: trials run in the code directory itself, on the machine that has it."""

    def reattach(self, trial: TrialAssignment[LocalConfig], control: TrialControl) -> TrialOutcome | None:
        return None  # the trial's processes died with the worker that launched them

    def release(self, trial: TrialAssignment[LocalConfig]) -> None:
        """The GPUs the lost attempt held, on whichever machine's ledger holds them."""
        self.ledger.release_everywhere(attempt_member(trial))

    def read_output(self, trial: TrialAssignment[LocalConfig], url: str, stream: OutputStream, offset: int) -> bytes:
        """From `<url>/stdout|stderr`: `url` is the trial's working directory on the machine that ran it."""
        return read_output_file(Path(url) / stream, offset, f"trial {trial.trial_id}")

    def clean_up(self, experiment_id: str, config: LocalConfig) -> None:
        """Nothing to remove: a local trial's files live in the experiment's own directory."""

    def close(self) -> None:
        self.keepers.close()

    def run_trial(self, trial: TrialAssignment[LocalConfig], control: TrialControl) -> TrialOutcome | Deferred:
        config = trial.platform_config
        policy = GpuPolicy(
            gpu_number=trial.launch.gpu_number,
            gpu_indices=tuple(config.gpu_indices) if config.gpu_indices is not None else None,
            max_trials_per_gpu=config.max_trial_number_per_gpu,
            use_active_gpu=bool(config.use_active_gpu),
        )
        ledger_key = attempt_member(trial)
        try:  # from the reservation on: whatever happens, even an error while reserving, frees the GPUs
            gpus = self.ledger.reserve(ledger_key, policy)
            if gpus is None:
                count = policy.gpu_number
                return Deferred(f"waiting for {count} free GPU{'s' if count != 1 else ''}")
            cuda = cuda_visible_devices(policy, gpus)
            return _AttemptFollower(trial, control, cuda, self.kill_grace_s, self.keepers).run(gpus)
        except GpuRequestImpossible as error:
            return TrialOutcome(TrialJobStatus.FAILED, message=str(error))
        finally:
            if policy.gpu_number:  # an outage now must not turn the trial's outcome into an error
                until_redis_answers(lambda: self.ledger.release(ledger_key), f"trial {trial.trial_id}")


class _Keeper:
    """A keeper process, started before its trial is known: it waits on its lifeline for what to run."""

    def __init__(self) -> None:
        keeper_end, self.lifeline = os.pipe()  # the worker holds `lifeline` open until the trial must be gone
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _KEEPER],
                env={},  # nothing of the worker's: the trial's environment comes with its command
                stdin=keeper_end,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,  # until it opens the trial's stderr file
                start_new_session=True,  # no terminal's signals; a process group for the last resort
            )
        except BaseException:
            os.close(self.lifeline)
            raise
        finally:
            os.close(keeper_end)

    def run(self, command: str, cwd: Path, env: dict[str, str], stderr: Path) -> bool:
        """Send the keeper its trial; False if it is gone."""
        launch = marshal.dumps((command, str(cwd), env, str(stderr)))
        message = memoryview(len(launch).to_bytes(4, "big") + launch)
        try:
            while message:
                message = message[os.write(self.lifeline, message) :]
        except BrokenPipeError:
            return False
        return True

    def close(self) -> None:
        """Close the lifeline: the keeper kills what is left of its trial, if anything; then reap it."""
        os.close(self.lifeline)
        self.process.wait()

    def discard(self) -> None:
        """Close a keeper that runs no trial, its stdout pipe too (a trial's is its reader's to close)."""
        self.close()
        assert self.process.stdout is not None
        self.process.stdout.close()


class _Keepers:
    """Keepers started ahead of their trials: a keeper's start-up (Python's, ~15 ms, and the worker's fork)
    is paid while the worker waits for work or its trial runs, not between a trial's pick-up and its start.
    One spare per worker process; the first trial, and a second one launched at the same moment, start
    their own."""

    def __init__(self) -> None:
        self._spare: _Keeper | None = None
        self._lock = threading.Lock()
        self._closed = False

    def launch(self, command: str, cwd: Path, env: dict[str, str], stderr: Path) -> _Keeper:
        """A keeper running `command`: the spare if there is one (`replenish` starts the next)."""
        with self._lock:
            keeper, self._spare = self._spare, None
        if keeper is None or not keeper.run(command, cwd, env, stderr):
            if keeper is not None:  # killed while it waited
                keeper.discard()
            keeper = _Keeper()
            if not keeper.run(command, cwd, env, stderr):
                keeper.discard()
                raise RuntimeError("the trial's keeper exited before it got its trial")
        return keeper

    def replenish(self) -> None:
        """Start a spare for the next trial, on a thread of its own: called once a trial's start is recorded, since
        the spare's fork and start-up (~15 ms of CPU) beside the launch and that record slowed them from 2.4 to
        4.6 ms (p50 at concurrency 1)."""
        threading.Thread(target=self._replenish, name="spare-keeper", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            keeper, self._spare = self._spare, None
        if keeper is not None:
            keeper.discard()

    def _replenish(self) -> None:
        try:
            keeper: _Keeper | None = _Keeper()
        except OSError as error:  # the next launch starts its own
            log.warning("cannot start a spare keeper: %s", error)
            return
        with self._lock:
            if self._spare is None and not self._closed:
                self._spare, keeper = keeper, None
        if keeper is not None:
            keeper.discard()


class _AttemptFollower:
    """One launch of a trial command under its keeper, watched until it ends."""

    def __init__(
        self,
        trial: TrialAssignment[LocalConfig],
        control: TrialControl,
        cuda: str | None,
        grace_s: float,
        keepers: _Keepers,
    ) -> None:
        self.trial = trial
        self.keepers = keepers
        self.control = control
        self.cuda = cuda
        self.grace_s = grace_s
        self.sys_dir = Path(trial.working_directory)
        self.reader = MetricFileReader(self.sys_dir / ".nni" / "metrics")

    def run(self, gpus: list[int]) -> TrialOutcome:
        code_dir = Path(self.trial.launch.code_directory)
        if not code_dir.is_dir():
            return TrialOutcome(TrialJobStatus.FAILED, message=f"trialCodeDirectory {code_dir} does not exist")
        if self.trial.attempt > 1:
            self._archive_attempt(self.trial.attempt - 1)
        (self.sys_dir / ".nni").mkdir(parents=True, exist_ok=True)
        write_parameters(self.sys_dir, self.trial.form.hyper_parameters.value)
        paths = TrialPaths(sys_dir=str(self.sys_dir), output_dir=str(self.sys_dir), code_dir=str(code_dir))
        env = nni_environment(os.environ, LocalPlatform.name, self.trial, paths, self.cuda)
        with (self.sys_dir / "stdout").open("wb") as stdout_file:
            keeper = self.keepers.launch(self.trial.launch.command, code_dir, env, self.sys_dir / "stderr")
            process = keeper.process
            assert process.stdout is not None
            pump = _StdoutReader(process.stdout, StdoutMetricPump(self.control, stdout_file))
            try:
                self.control.started(str(self.sys_dir), url=str(self.sys_dir), gpu_indices=gpus or None)
                self.keepers.replenish()
                pump.start()
                stop = self._watch(process)
            finally:
                keeper.close()  # the keeper kills whatever is left of the trial, if anything
                _signal_group(process.pid, signal.SIGKILL)  # should the trial have killed its keeper
                pump.finish(DRAIN_S)
        forward_file_metrics(self.reader, self.control, final=True)
        return self._outcome(process.returncode, stop)

    def _archive_attempt(self, attempt: int) -> None:
        """Move a lost attempt's output aside, so the retry's metrics are read from a fresh file."""
        archive = self.sys_dir / f"attempt-{attempt}"
        archive.mkdir(parents=True, exist_ok=True)
        for name in ("stdout", "stderr", ".nni/metrics"):
            with contextlib.suppress(FileNotFoundError):
                (self.sys_dir / name).replace(archive / Path(name).name)

    def _watch(self, process: subprocess.Popen[bytes]) -> StopRequest | None:
        """Forward metrics and parameter updates until the process exits or must stop.

        Woken by what happens, not by polling: polling every few milliseconds cost ~5 % of a core
        per running trial, which the trials themselves need.
        """
        exited = os.pidfd_open(process.pid)  # before anything reaps it; the thread closes it
        threading.Thread(
            target=_wake_on_exit_or_write, args=(exited, self.sys_dir / ".nni", self.control), daemon=True
        ).start()
        while True:
            forward_file_metrics(self.reader, self.control)
            for form in self.control.new_forms():
                write_parameters(self.sys_dir, form.hyper_parameters.value, form.hyper_parameters.index)
            if process.poll() is not None:
                return None
            stop = self.control.stop_request()
            if stop is not None:
                self._terminate(process)
                return stop
            self.control.wait(IDLE_WAIT_S)

    def _terminate(self, process: subprocess.Popen[bytes]) -> None:
        """SIGTERM to every process of the trial (the keeper forwards it), SIGKILL after the grace
        period (when the caller closes the keeper's lifeline)."""
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(self.grace_s)

    def _outcome(self, returncode: int, stop: StopRequest | None) -> TrialOutcome:
        if stop is not None:
            return TrialOutcome(stop.status, exit_code=returncode, message=stop.reason)
        if returncode == 0:
            return TrialOutcome(TrialJobStatus.SUCCEEDED, exit_code=0)
        message = failure_message(returncode, read_tail(self.sys_dir / "stderr"))
        return TrialOutcome(TrialJobStatus.FAILED, exit_code=returncode, message=message)


class _StdoutReader:
    """Reads a trial's stdout pipe into a pump, on a thread of its own; never blocks the trial's end,
    even if some process still held the pipe.

    Told to stop, it still reads every byte queued in the pipe then: the trial has ended, so that
    is the rest of what it wrote. Feeding one chunk may take long (its metrics' append waits out a
    Redis failover); stopping then must not drop the metric lines the trial printed meanwhile.
    """

    def __init__(self, stream: IO[bytes], pump: StdoutMetricPump) -> None:
        self._fd = stream.fileno()
        self._stream = stream
        self._pump = pump
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def finish(self, drain_s: float) -> None:
        """Wait up to `drain_s` for the pipe's end, then read what is queued in it and close it."""
        if self._thread.ident is not None:
            self._thread.join(drain_s)
            self._stop.set()
            self._thread.join()
        self._stream.close()

    def _run(self) -> None:
        left: int | None = None  # once stopping: the bytes queued in the pipe then, still to read
        while left is None or left > 0:
            if left is None and self._stop.is_set():
                left = _queued_bytes(self._fd)
                continue
            ready, _, _ = select.select([self._fd], [], [], POLL_S * 20 if left is None else 0)
            if not ready:
                if left is None:
                    continue
                break
            data = os.read(self._fd, READ_BYTES if left is None else min(left, READ_BYTES))
            if not data:
                break
            if left is not None:
                left -= len(data)
            try:
                self._pump.feed(data)
            except Exception:  # the pipe must keep being drained, or the trial blocks writing to it
                log.exception("trial stdout: a chunk could not be handled; reading on")
        self._pump.close()


def _queued_bytes(fd: int) -> int:
    """How many bytes a pipe holds that nobody has read yet (FIONREAD)."""
    return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0])


def read_output_file(path: Path, offset: int, whose: str) -> bytes:
    """Up to OUTPUT_READ_BYTES of `path` from byte `offset` on (b"" at its end, so far)."""
    try:
        with path.open("rb") as output:
            output.seek(offset)
            return output.read(OUTPUT_READ_BYTES)
    except FileNotFoundError:
        raise OutputUnavailable(
            f"no {path.name} of {whose} at {path}: removed, or on another machine (a local trial's output"
            " stays on the machine that ran it)"
        ) from None
    except OSError as error:
        raise OutputUnavailable(f"the {path.name} of {whose} at {path} cannot be read: {error.strerror}") from None


def attempt_member(trial: TrialAssignment[LocalConfig]) -> str:
    """The attempt's name in the GPU ledger: as in the lease set."""
    return AttemptRef(trial.experiment_id, trial.trial_id, trial.attempt).member


def _wake_on_exit_or_write(exited: int, metrics_dir: Path, control: TrialControl) -> None:
    """Wake the watch loop each time the trial writes in its `.nni` directory (inotify), and when it
    exits (`exited`, its pidfd, becomes readable): then return.

    Without an inotify instance to spare (fs.inotify.max_user_instances), it wakes the loop every
    POLL_S instead, so metrics are still read promptly.
    """
    inotify: INotify | None = None
    try:
        inotify = INotify()
        inotify.add_watch(metrics_dir, flags.MODIFY | flags.CREATE | flags.MOVED_TO)
    except OSError as error:
        log.warning("no inotify for %s (%s): polling it every %g s", metrics_dir, error, POLL_S)
        if inotify is not None:
            inotify.close()
            inotify = None
    try:
        watched = [exited] if inotify is None else [exited, inotify.fileno()]
        while True:
            ready, _, _ = select.select(watched, [], [], POLL_S if inotify is None else None)
            if inotify is not None and inotify.fileno() in ready:
                inotify.read(timeout=0)
            control.wake()
            if exited in ready:
                return
    finally:
        os.close(exited)
        if inotify is not None:
            inotify.close()


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signum)
