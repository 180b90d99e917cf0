"""The local platform: trials are processes on the worker's machine, with cwd = the code directory."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import math
import os
import select
import signal
import struct
import termios
import threading
import time
from pathlib import Path
from typing import IO, ClassVar

import redis

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
from schemas.config import ExperimentConfig
from schemas.events import TrialLaunchSpec
from schemas.trial import TrialJobStatus
from workers.platforms.local.config import LocalConfig
from workers.platforms.local.gpus import gpu_problems, gpu_source, handed_back, record
from workers.platforms.local.keeper import Keeper, Keepers
from workers.platforms.local.settings import LocalSettings
from workers.platforms.local.wakeups import TrialWakeups
from workers.platforms.shared.gpu import (
    GpuLedger,
    GpuPolicy,
    GpuQueryError,
    GpuRequestImpossible,
    cuda_visible_devices,
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

IDLE_WAIT_S = 0.5  # a safety net: the watch loop is woken by the trial's exit, its metric writes and commands
# A fork refused for the machine's limits: the trial waits (parked) and starts when a process ends, not FAILED.
_OUT_OF_PROCESSES = frozenset({errno.EAGAIN, errno.ENOMEM})
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
        self._client, self._machine_id, self._gpus = client, own.machine_id, gpu_source(settings)
        self.ledger = GpuLedger(client, own.machine_id, self._gpus)
        self._record_ttl_s = own.gpu_record_ttl_s
        self._recorded_at = -math.inf  # time.monotonic() of this worker's last record of its machine's GPUs
        self._indices: list[int] | None = None  # its GPUs, once its tools have answered
        self.kill_grace_s = settings.kill_grace_s
        self.keepers = Keepers(own.kill_wait_s)
        self.wakeups = TrialWakeups()

    @classmethod
    def check(cls, config: LocalConfig, code_directory: Path, settings: Settings) -> list[str]:
        """Nothing to reach: trials run on the workers' own machines."""
        return []

    @classmethod
    def config_problems(cls, config: LocalConfig, experiment: ExperimentConfig, settings: Settings) -> dict[str, str]:
        """GPUs asked for that no machine a trial could run on has (see workers/platforms/local/gpus.py)."""
        return gpu_problems(config, experiment, settings)

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

    def warm_up(self) -> None:
        """The zygote and the first trial's keeper, forked before a trial waits for them; this machine's GPUs
        recorded for the checks of the experiments it may serve."""
        self.keepers.replenish()
        self.keep_alive()

    def keep_alive(self) -> None:
        """This machine's GPU record renewed every third of its TTL: it counts while a worker of the machine
        lives, and lapses once none does. Its GPUs are asked for until the tools answer once, then renewed as
        read: a machine's GPUs stay while its worker runs, and nvidia-smi may take seconds of every round."""
        if time.monotonic() - self._recorded_at < self._record_ttl_s / 3:
            return
        if self._indices is None:
            try:
                self._indices = [gpu.index for gpu in self._gpus.gpus()]
            except GpuQueryError:  # nothing refused on their word: they may work by the time a trial asks
                return  # asked again next round, before the record lapses
        record(self._client, self._machine_id, self._indices, self._record_ttl_s)
        self._recorded_at = time.monotonic()

    def close(self) -> None:
        self.keepers.close()
        self.wakeups.close()

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
            return _AttemptFollower(trial, control, cuda, self.kill_grace_s, self.keepers, self.wakeups).run(gpus)
        except GpuRequestImpossible as error:  # another machine serving the queue may have the GPUs: it waits
            wanted = policy.gpu_number or 0
            return Deferred(handed_back(self._client, self._machine_id, str(error), wanted, config.gpu_indices))
        finally:
            if policy.gpu_number:  # an outage now must not turn the trial's outcome into an error
                until_redis_answers(lambda: self.ledger.release(ledger_key), f"trial {trial.trial_id}")


class _AttemptFollower:
    """One launch of a trial command under its keeper, watched until it ends."""

    def __init__(
        self,
        trial: TrialAssignment[LocalConfig],
        control: TrialControl,
        cuda: str | None,
        grace_s: float,
        keepers: Keepers,
        wakeups: TrialWakeups,
    ) -> None:
        self.trial = trial
        self.keepers = keepers
        self.wakeups = wakeups
        self.control = control
        self.cuda = cuda
        self.grace_s = grace_s
        self.sys_dir = Path(trial.working_directory)
        self.reader = MetricFileReader(self.sys_dir / ".nni" / "metrics")

    def run(self, gpus: list[int]) -> TrialOutcome | Deferred:
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
            try:
                keeper = self.keepers.launch(self.trial.launch.command, code_dir, env, self.sys_dir / "stderr")
            except OSError as error:
                if error.errno not in _OUT_OF_PROCESSES:
                    raise
                return Deferred(f"waiting to start a process: {error.strerror} (a limit on processes or memory)")
            pump = _StdoutReader(keeper.stdout, StdoutMetricPump(self.control, stdout_file))
            try:
                self.control.started(str(self.sys_dir), url=str(self.sys_dir), gpu_indices=gpus or None)
                self.keepers.replenish()
                pump.start()
                stop = self._watch(keeper)
            finally:
                returncode = keeper.close()  # the keeper kills whatever is left of the trial, if anything
                if keeper.died_without_a_word:  # the trial killed its keeper: its group is what is left of it
                    _signal_group(keeper.pid, signal.SIGKILL)  # (only then: a group gone may have its id reused)
                pump.finish(DRAIN_S)
        forward_file_metrics(self.reader, self.control, final=True)
        return self._outcome(returncode, stop)

    def _archive_attempt(self, attempt: int) -> None:
        """Move a lost attempt's output aside, so the retry's metrics are read from a fresh file."""
        archive = self.sys_dir / f"attempt-{attempt}"
        archive.mkdir(parents=True, exist_ok=True)
        for name in ("stdout", "stderr", ".nni/metrics"):
            with contextlib.suppress(FileNotFoundError):
                (self.sys_dir / name).replace(archive / Path(name).name)

    def _watch(self, keeper: Keeper) -> StopRequest | None:
        """Forward metrics and parameter updates until the process exits or must stop.

        Woken by what happens, not by polling: polling every few milliseconds cost ~5 % of a core
        per running trial, which the trials themselves need.
        """
        self.wakeups.watch(self.sys_dir / ".nni", keeper.exit_signal(), self.control.wake)
        while True:
            forward_file_metrics(self.reader, self.control)
            for form in self.control.new_forms():
                write_parameters(self.sys_dir, form.hyper_parameters.value, form.hyper_parameters.index)
            if keeper.poll() is not None:
                return None
            stop = self.control.stop_request()
            if stop is not None:
                self._terminate(keeper)
                return stop
            self.control.wait(IDLE_WAIT_S)

    def _terminate(self, keeper: Keeper) -> None:
        """SIGTERM to every process of the trial (the keeper forwards it), SIGKILL after the grace
        period (when the caller closes the keeper's lifeline)."""
        keeper.send_signal(signal.SIGTERM)
        keeper.wait(self.grace_s)

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
        # Told to stop through a pipe of its own, it waits on the trial's without a timeout: checking its stop every
        # 100 ms was ~a fifth of a worker's CPU per metric with 500 trials reporting once a second.
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def finish(self, drain_s: float) -> None:
        """Wait up to `drain_s` for the pipe's end, then read what is queued in it and close it."""
        if self._thread.ident is not None:
            self._thread.join(drain_s)
            self._stop.set()
            os.write(self._wake_w, b"s")
            self._thread.join()
        self._stream.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        left: int | None = None  # once stopping: the bytes queued in the pipe then, still to read
        while left is None or left > 0:
            if left is None and self._stop.is_set():
                left = _queued_bytes(self._fd)
                continue
            ready, _, _ = select.select([self._fd, self._wake_r], [], [], None if left is None else 0)
            if self._fd not in ready:
                if left is None:  # told to stop
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


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signum)
