"""A test platform whose trials outlive their worker: each trial is a detached session on this
machine, followed through files (its pid, its exit code, its stdout and metrics file). It is the
shape of a remote platform without SSH, so the core's re-attachment is tested on real processes.

Loaded by name through the `platforms` setting: TRIALSTREAM_PLATFORMS=detached=tests.platforms.detached:DetachedPlatform
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import ClassVar, Literal

import redis

from core.platform import Deferred, OutputStream, TrialAssignment, TrialControl, TrialOutcome
from core.settings import Settings
from schemas.config import PlatformConfig
from schemas.events import TrialLaunchSpec
from schemas.trial import TrialJobStatus
from workers.platforms.local.adapter import read_output_file
from workers.platforms.shared.metrics import MetricFileReader
from workers.platforms.shared.trial_contract import (
    StdoutMetricPump,
    TrialPaths,
    failure_message,
    forward_file_metrics,
    nni_environment,
    read_tail,
    write_parameters,
)

FOLLOW_S = 0.05

# $1: the trial command, $2: the attempt's directory. The exit code is written when it returns, atomically.
_WRAPPER = (
    'sh -c "$1" >"$2/stdout" 2>"$2/stderr" </dev/null; echo $? >"$2/.exit.partial"; mv "$2/.exit.partial" "$2/.exit"'
)


class DetachedConfig(PlatformConfig):
    platform: Literal["detached"] = "detached"


class DetachedPlatform:
    name: ClassVar[str] = "detached"
    config_model: ClassVar[type[DetachedConfig]] = DetachedConfig
    trials_per_process: ClassVar[int] = 64
    trials_outlive_worker: ClassVar[bool] = True

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.grace_s = settings.kill_grace_s

    @classmethod
    def check(cls, config: PlatformConfig, code_directory: Path, settings: Settings) -> list[str]:
        return []

    def stage(self, experiment_id: str, launch: TrialLaunchSpec, config: PlatformConfig) -> None:
        """Trials run in the code directory, on this machine."""

    def run_trial(self, trial: TrialAssignment, control: TrialControl) -> TrialOutcome | Deferred:
        run_dir = self._run_dir(trial)
        run_dir.mkdir(parents=True, exist_ok=True)
        sys_dir = Path(trial.working_directory)
        (sys_dir / ".nni").mkdir(parents=True, exist_ok=True)
        write_parameters(sys_dir, trial.form.hyper_parameters.value)
        paths = TrialPaths(trial.working_directory, trial.working_directory, trial.launch.code_directory)
        environment = nni_environment(os.environ, self.name, trial, paths, None)
        session = subprocess.Popen(
            ["/bin/sh", "-c", _WRAPPER, "detached-trial", trial.launch.command, str(run_dir)],
            cwd=trial.launch.code_directory,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # outlives this worker, as a trial on a remote host does
        )
        (run_dir / ".pid").write_text(str(session.pid))
        control.started(trial.working_directory)
        return self._follow(trial, control, session)

    def reattach(self, trial: TrialAssignment, control: TrialControl) -> TrialOutcome | None:
        run_dir = self._run_dir(trial)
        if not (run_dir / ".exit").exists() and not _alive(_pid(run_dir)):
            return None
        return self._follow(trial, control, None)

    def release(self, trial: TrialAssignment) -> None:
        with contextlib.suppress(ProcessLookupError, FileNotFoundError, ValueError):
            os.killpg(_pid(self._run_dir(trial)), signal.SIGKILL)

    def read_output(self, trial: TrialAssignment, url: str, stream: OutputStream, offset: int) -> bytes:
        """From the attempt's own directory: `url` (None when it started) is not needed."""
        return read_output_file(self._run_dir(trial) / stream, offset, f"trial {trial.trial_id}")

    def clean_up(self, experiment_id: str, config: PlatformConfig) -> None:
        """Nothing to remove: the trials' files live in the experiment's own directory."""

    def close(self) -> None:
        pass

    def _run_dir(self, trial: TrialAssignment) -> Path:
        return Path(trial.working_directory) / f"attempt-{trial.attempt}"

    def _follow(
        self, trial: TrialAssignment, control: TrialControl, session: subprocess.Popen[bytes] | None
    ) -> TrialOutcome:
        """From the start of its files: a re-sent metric is stored once (its idempotency key)."""
        run_dir = self._run_dir(trial)
        metrics = MetricFileReader(Path(trial.working_directory) / ".nni" / "metrics")
        stdout = StdoutMetricPump(control)
        offset = 0
        while True:
            if session is not None:
                session.poll()  # reap it when it exits: this worker is its parent
            exited = (run_dir / ".exit").exists()
            offset = _feed(stdout, run_dir / "stdout", offset)
            forward_file_metrics(metrics, control, final=exited)
            if exited:
                stdout.close()
                code = int((run_dir / ".exit").read_text())
                if code == 0:
                    return TrialOutcome(TrialJobStatus.SUCCEEDED, exit_code=0)
                message = failure_message(code, read_tail(run_dir / "stderr"))
                return TrialOutcome(TrialJobStatus.FAILED, exit_code=code, message=message)
            stop = control.stop_request()
            if stop is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(_pid(run_dir), signal.SIGKILL)
                return TrialOutcome(stop.status, message=stop.reason)
            control.wait(FOLLOW_S)


def _feed(pump: StdoutMetricPump, path: Path, offset: int) -> int:
    """Feed the pump what the trial printed since `offset`; returns the new offset."""
    try:
        with path.open("rb") as stdout:
            stdout.seek(offset)
            chunk = stdout.read()
    except FileNotFoundError:
        return offset
    pump.feed(chunk)
    return offset + len(chunk)


def _pid(run_dir: Path) -> int:
    return int((run_dir / ".pid").read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(FileNotFoundError):
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    return False
