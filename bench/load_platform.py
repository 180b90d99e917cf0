"""A bench-only platform whose trials are threads of the worker (issue 29's load test): each reports one
intermediate metric every `interval` seconds through the worker's real control (an append per report, as a real
trial's follower makes), then a final one. The trial command says how: `metrics=30 interval=1.0`.

Loaded by name through the `platforms` setting: threads=bench.load_platform:ThreadPlatform. Each metric's value is
the wall-clock time it was reported at, so the log's own entry ids tell how late it was stored.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import ClassVar, Literal

import redis

from core.platform import OutputStream, ParsedMetric, TrialAssignment, TrialControl, TrialOutcome
from core.settings import Settings
from schemas.config import PlatformConfig
from schemas.events import TrialLaunchSpec
from schemas.trial import TrialJobStatus


class ThreadsConfig(PlatformConfig):
    platform: Literal["threads"] = "threads"


def _plan(command: str) -> tuple[int, float]:
    """(metrics, interval) from a command such as `metrics=30 interval=1.0`."""
    words = dict(word.partition("=")[::2] for word in command.split())
    return int(words.get("metrics", "10")), float(words.get("interval", "1.0"))


def _reported(value: float) -> str:
    return json.dumps(json.dumps(value))  # NNI's `data`: a JSON string holding the value's JSON


class ThreadPlatform:
    name: ClassVar[str] = "threads"
    config_model: ClassVar[type[ThreadsConfig]] = ThreadsConfig
    trials_per_process: ClassVar[int] = 10_000
    trials_outlive_worker: ClassVar[bool] = False

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        pass

    @classmethod
    def check(cls, config: ThreadsConfig, code_directory: Path, settings: Settings) -> list[str]:
        return []

    def stage(self, experiment_id: str, launch: TrialLaunchSpec, config: ThreadsConfig) -> None:
        """Nothing to copy: a trial is a thread."""

    def run_trial(self, trial: TrialAssignment[ThreadsConfig], control: TrialControl) -> TrialOutcome:
        count, interval = _plan(trial.launch.command)
        control.started(trial.working_directory)
        began = time.monotonic()
        for sequence in range(count):
            control.wait(max(0.0, began + (sequence + 1) * interval - time.monotonic()))
            stop = control.stop_request()
            if stop is not None:
                return TrialOutcome(stop.status, message=stop.reason)
            control.metrics([ParsedMetric("0", "PERIODICAL", sequence, _reported(time.time()))])
        control.metrics([ParsedMetric("0", "FINAL", 0, _reported(time.time()))])
        return TrialOutcome(TrialJobStatus.SUCCEEDED, exit_code=0)

    def reattach(self, trial: TrialAssignment[ThreadsConfig], control: TrialControl) -> TrialOutcome | None:
        return None  # the thread died with its worker

    def release(self, trial: TrialAssignment[ThreadsConfig]) -> None:
        """Nothing held."""

    def read_output(self, trial: TrialAssignment[ThreadsConfig], url: str, stream: OutputStream, offset: int) -> bytes:
        return b""

    def clean_up(self, experiment_id: str, config: ThreadsConfig) -> None:
        """Nothing left behind."""

    def close(self) -> None:
        pass
