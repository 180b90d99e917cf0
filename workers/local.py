"""The local platform: trials are processes on the worker's machine, with cwd = the code directory."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import threading
from pathlib import Path
from typing import BinaryIO, ClassVar

import redis
from inotify_simple import INotify, flags

from core.connections import until_redis_answers
from core.leases import AttemptRef
from core.platform import Deferred, StopRequest, TrialAssignment, TrialControl, TrialOutcome
from core.settings import Settings, trial_environment
from schemas.config import LocalConfig, PlatformConfig
from schemas.events import TrialLaunchSpec
from schemas.trial import TrialJobStatus
from workers.gpu import (
    FakeGpuSource,
    GpuLedger,
    GpuPolicy,
    GpuRequestImpossible,
    cuda_visible_devices,
    detect_gpu_source,
)
from workers.metrics import MAX_RECORD_BYTES, MetricFileReader, MetricRejected, parse_stdout_line

log = logging.getLogger(__name__)

# The trial's shell forks a keeper into the trial's process group, then execs the trial command.
# The keeper blocks reading a pipe whose other end only the worker holds: if the worker dies, even
# by SIGKILL, the kernel closes that end, the read returns, and the keeper kills the whole group,
# so no trial process outlives its worker. It ignores SIGTERM, so a graceful cancel reaches the
# trial alone. The pipe arrives as stdin; the trial itself gets /dev/null. $1 is the trial command.
_KEEPER = """
exec 3<&0 </dev/null
(trap '' TERM INT HUP; read _ <&3; kill -9 0) >/dev/null 2>&1 &
exec 3<&-
exec /bin/sh -c "$1"
"""
IDLE_WAIT_S = 0.5  # a safety net: the watch loop is woken by the trial's exit, its metric writes and commands
POLL_S = 0.005  # how often the metrics file is read where inotify is not available
ORPHAN_GRACE_S = 1.0
STDERR_TAIL_BYTES = 2000


class LocalPlatform:
    """Trials are processes of the worker's own machine, and die with their worker (so a lost attempt
    is never re-attached: it is retried or failed)."""

    name: ClassVar[str] = "local"
    config_model: ClassVar[type[LocalConfig]] = LocalConfig
    trials_per_process: ClassVar[int] = 64
    trials_outlive_worker: ClassVar[bool] = False

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        source = FakeGpuSource(settings.fake_gpus) if settings.fake_gpus else detect_gpu_source()
        self.ledger = GpuLedger(client, settings.machine_id, source)
        self.kill_grace_s = settings.kill_grace_s

    def stage(self, experiment_id: str, launch: TrialLaunchSpec, config: PlatformConfig) -> None:
        """Nothing to copy: trials run in the code directory itself, on the machine that has it."""

    def reattach(self, trial: TrialAssignment, control: TrialControl) -> TrialOutcome | None:
        return None  # the trial's processes died with the worker that launched them

    def release(self, trial: TrialAssignment) -> None:
        """The GPUs the lost attempt held, on whichever machine's ledger holds them."""
        self.ledger.release_everywhere(attempt_member(trial))

    def close(self) -> None:
        pass

    def run_trial(self, trial: TrialAssignment, control: TrialControl) -> TrialOutcome | Deferred:
        config = trial.platform_config
        assert isinstance(config, LocalConfig)
        policy = GpuPolicy(
            gpu_number=trial.launch.gpu_number,
            gpu_indices=tuple(config.gpu_indices) if config.gpu_indices is not None else None,
            max_trials_per_gpu=config.max_trial_number_per_gpu,
            use_active_gpu=bool(config.use_active_gpu),
        )
        ledger_key = attempt_member(trial)
        try:
            gpus = self.ledger.reserve(ledger_key, policy)
        except GpuRequestImpossible as error:
            return TrialOutcome(TrialJobStatus.FAILED, message=str(error))
        if gpus is None:
            count = policy.gpu_number
            return Deferred(f"waiting for {count} free GPU{'s' if count != 1 else ''}")
        try:
            return _TrialProcess(trial, control, cuda_visible_devices(policy, gpus), self.kill_grace_s).run(gpus)
        finally:
            if gpus:  # an outage now must not turn the trial's outcome into an error
                until_redis_answers(lambda: self.ledger.release(ledger_key), f"trial {trial.trial_id}")


class _TrialProcess:
    """One launch of a trial command, watched until it ends."""

    def __init__(self, trial: TrialAssignment, control: TrialControl, cuda: str | None, grace_s: float) -> None:
        self.trial = trial
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
        _write_atomically(self.sys_dir / "parameter.cfg", self.trial.form.hyper_parameters.value)
        keeper_end, worker_end = os.pipe()  # the worker holds `worker_end` open for as long as it lives
        with (self.sys_dir / "stdout").open("wb") as stdout_file, (self.sys_dir / "stderr").open("wb") as stderr:
            try:
                process = subprocess.Popen(
                    ["/bin/sh", "-c", _KEEPER, "trialstream-trial", self.trial.launch.command],
                    cwd=code_dir,
                    env=self._environment(code_dir),
                    stdin=keeper_end,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    start_new_session=True,  # its own process group, so a cancel reaches every child
                )
            except BaseException:
                os.close(worker_end)
                raise
            finally:
                os.close(keeper_end)
            try:
                self.control.started(str(self.sys_dir), url=str(self.sys_dir), gpu_indices=gpus or None)
                assert process.stdout is not None
                pump = threading.Thread(target=self._pump_stdout, args=(process.stdout, stdout_file), daemon=True)
                pump.start()
                stop = self._watch(process)
                pump.join(ORPHAN_GRACE_S)  # children of the trial may still hold its stdout: the trial is over
                _signal_group(process.pid, signal.SIGKILL)  # leftovers and the keeper
                pump.join()
            finally:
                os.close(worker_end)
        self._forward_file_metrics(final=True)
        return self._outcome(process.returncode, stop)

    def _archive_attempt(self, attempt: int) -> None:
        """Move a lost attempt's output aside, so the retry's metrics are read from a fresh file."""
        archive = self.sys_dir / f"attempt-{attempt}"
        archive.mkdir(parents=True, exist_ok=True)
        for name in ("stdout", "stderr", ".nni/metrics"):
            with contextlib.suppress(FileNotFoundError):
                (self.sys_dir / name).replace(archive / Path(name).name)

    def _environment(self, code_dir: Path) -> dict[str, str]:
        env = trial_environment(os.environ)
        env.update(
            NNI_PLATFORM="local",
            NNI_EXP_ID=self.trial.experiment_id,
            NNI_TRIAL_JOB_ID=self.trial.trial_id,
            NNI_SYS_DIR=str(self.sys_dir),
            NNI_OUTPUT_DIR=str(self.sys_dir),
            NNI_TRIAL_SEQ_ID=str(self.trial.form.sequence_id),
            NNI_CODE_DIR=str(code_dir),
            MULTI_PHASE="false",
            PYTHONUNBUFFERED="1",
        )
        env.pop("NNI_TRIAL_COMMAND_CHANNEL", None)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        if self.cuda is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.cuda
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the indices NVML reported
        return env

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
            self._forward_file_metrics()
            for form in self.control.new_forms():
                index = form.hyper_parameters.index
                _write_atomically(self.sys_dir / f"parameter_{index}.cfg", form.hyper_parameters.value)
            if process.poll() is not None:
                return None
            stop = self.control.stop_request()
            if stop is not None:
                self._terminate(process)
                return stop
            self.control.wait(IDLE_WAIT_S)

    def _terminate(self, process: subprocess.Popen[bytes]) -> None:
        """SIGTERM to the whole process group, SIGKILL after the grace period."""
        _signal_group(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(self.grace_s)
        _signal_group(process.pid, signal.SIGKILL)  # also reaps children that outlived the leader
        process.wait()

    def _pump_stdout(self, stream: BinaryIO, copy: BinaryIO) -> None:
        """Copy stdout to its file; turn `NNISDK_MEb'...'` lines into metrics as they are printed."""
        while line := stream.readline(MAX_RECORD_BYTES + 64):
            copy.write(line)
            copy.flush()
            if not line.endswith(b"\n") and len(line) > MAX_RECORD_BYTES:
                while (rest := stream.readline(MAX_RECORD_BYTES)) and not rest.endswith(b"\n"):
                    copy.write(rest)
                copy.write(rest)
                line += rest  # only its length matters now: parse rejects it as too large
            try:
                metric = parse_stdout_line(line)
            except MetricRejected as error:
                self.control.rejected(str(error))
                continue
            if metric is not None:
                self.control.metrics([metric])

    def _forward_file_metrics(self, final: bool = False) -> None:
        metrics, problems = self.reader.read_new(final=final)
        if metrics:
            self.control.metrics(metrics)
        for problem in problems:
            self.control.rejected(problem)

    def _outcome(self, returncode: int, stop: StopRequest | None) -> TrialOutcome:
        if stop is not None:
            return TrialOutcome(stop.status, exit_code=returncode, message=stop.reason)
        if returncode == 0:
            return TrialOutcome(TrialJobStatus.SUCCEEDED, exit_code=0)
        return TrialOutcome(TrialJobStatus.FAILED, exit_code=returncode, message=self._failure_message(returncode))

    def _failure_message(self, returncode: int) -> str:
        if returncode < 0:
            summary = f"killed by signal {signal.Signals(-returncode).name}"
        elif returncode == 127:
            summary = "exit code 127: command not found"
        else:
            summary = f"exit code {returncode}"
        tail = _tail(self.sys_dir / "stderr", STDERR_TAIL_BYTES)
        return f"{summary}; stderr: {tail}" if tail else summary


def attempt_member(trial: TrialAssignment) -> str:
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


def _write_atomically(path: Path, text: str) -> None:
    """The SDK may read the file the moment it appears: it must never see half of it."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    partial.replace(path)


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signum)


def _tail(path: Path, size: int) -> str:
    with path.open("rb") as file:
        file.seek(max(0, path.stat().st_size - size))
        return file.read().decode(errors="replace").strip()
