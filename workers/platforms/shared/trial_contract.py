"""NNI's trial-side contract, the same on every platform: what a trial finds (its environment and
`parameter.cfg` files), how its metrics come back (the two wire formats of `workers.platforms.shared.metrics`), and
how its failure is told. A platform adds only how it runs processes where its trials live.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from core.platform import ParsedMetric, TrialAssignment, TrialControl
from core.settings import trial_environment
from workers.platforms.shared.metric_framing import MAX_RECORD_BYTES
from workers.platforms.shared.metrics import (
    STDOUT_PREFIX,
    MetricFileReader,
    MetricRejected,
    parse_stdout_line,
)

__all__ = [
    "MetricBatch",
    "MetricFileReader",
    "StdoutMetricPump",
    "TrialPaths",
    "failure_message",
    "forward_file_metrics",
    "nni_environment",
    "write_parameters",
]

STDERR_TAIL_BYTES = 2000
_NOT_FOR_TRIALS = ("NNI_TRIAL_COMMAND_CHANNEL", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


@dataclass(frozen=True)
class TrialPaths:
    """Where a trial runs and writes, as the trial's host sees them."""

    sys_dir: str  # NNI_SYS_DIR: parameter files, .nni/metrics
    output_dir: str  # NNI_OUTPUT_DIR
    code_dir: str  # NNI_CODE_DIR, the trial's cwd


def nni_environment(
    user_environ: Mapping[str, str],
    platform: str,
    trial: TrialAssignment[Any],
    paths: TrialPaths,
    cuda_visible_devices: str | None,
) -> dict[str, str]:
    """The environment a trial runs with: the user's (never trialstream's settings or secrets), plus
    NNI's variables.

    `cuda_visible_devices` follows NNI: None leaves CUDA_VISIBLE_DEVICES unset (no trialGpuNumber),
    "-1" hides every GPU, else the indices given, in the PCI bus order NVML reports them in. A value
    the user had is never passed on: the GPUs are the scheduler's to give.
    """
    env = trial_environment(user_environ)
    for name in _NOT_FOR_TRIALS:  # NNI's HTTP command channel is not offered: the SDK must use files
        env.pop(name, None)
    env.update(
        NNI_PLATFORM=platform,
        NNI_EXP_ID=trial.experiment_id,
        NNI_TRIAL_JOB_ID=trial.trial_id,
        NNI_SYS_DIR=paths.sys_dir,
        NNI_OUTPUT_DIR=paths.output_dir,
        NNI_TRIAL_SEQ_ID=str(trial.form.sequence_id),
        NNI_CODE_DIR=paths.code_dir,
        MULTI_PHASE="false",
        PYTHONUNBUFFERED="1",  # metrics printed to stdout arrive as they are printed
    )
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return env


def parameter_file_name(index: int | None) -> str:
    """`parameter.cfg` for the first parameter set, `parameter_<i>.cfg` for the ones sent later."""
    return "parameter.cfg" if not index else f"parameter_{index}.cfg"


def write_parameters(sys_dir: Path, value: str, index: int | None = None) -> Path:
    """Written atomically: the SDK may read the file the moment it appears, and must never see half."""
    path = sys_dir / parameter_file_name(index)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(value)
    partial.replace(path)
    return path


def forward_file_metrics(reader: MetricFileReader, control: TrialControl, final: bool = False) -> None:
    """Report what the trial appended to its metrics file since the last call, all of it (in bounded reads)."""
    while True:
        metrics, problems = reader.read_new(final=final)
        if metrics:
            control.metrics(metrics)
        for problem in problems:
            control.rejected(problem)
        if not reader.behind:
            return


class MetricSink(Protocol):
    """Where parsed metrics go: a TrialControl, or a batch a platform commits with its read offsets."""

    def metrics(self, metrics: Sequence[ParsedMetric]) -> None: ...

    def rejected(self, reason: str) -> None: ...


class MetricBatch:
    """Collects what a pump parses, so that a platform commits it with the offset it was read up to."""

    def __init__(self, control: TrialControl) -> None:
        self.control = control
        self.found: list[ParsedMetric] = []

    def metrics(self, metrics: Sequence[ParsedMetric]) -> None:
        self.found.extend(metrics)

    def rejected(self, reason: str) -> None:
        self.control.rejected(reason)

    def take(self) -> list[ParsedMetric]:
        found, self.found = self.found, []
        return found


class StdoutMetricPump:
    """Turns a trial's stdout, fed in chunks of any size from any byte stream (a pipe, an SSH channel),
    into metrics: each `NNISDK_MEb'...'` line is one. Every other byte is only copied.

    Its memory is bounded: a line longer than a record may be is counted, not kept, and rejected
    (with its exact size) if it was a metric line. A bad line never stops the pump: a pump that
    stopped would leave the trial blocked on a full pipe.
    """

    def __init__(self, control: MetricSink, copy: BinaryIO | None = None) -> None:
        self._control = control
        self._copy = copy
        self._line = bytearray()
        self._overflow = 0  # bytes of the current line beyond what is kept
        self._overflow_is_metric = False
        self._last_bytes = b""  # of an overflowing line: its line ending is not part of its size

    def feed(self, data: bytes) -> None:
        if self._copy is not None:
            self._copy.write(data)
            self._copy.flush()
        metrics: list[ParsedMetric] = []
        start = 0
        while (newline := data.find(b"\n", start)) != -1:
            self._take(data[start : newline + 1])
            self._end_line(metrics)
            start = newline + 1
        self._take(data[start:])
        if metrics:
            self._control.metrics(metrics)

    def close(self) -> None:
        """The stream ended: a last line without its newline is still a line."""
        metrics: list[ParsedMetric] = []
        if self._line or self._overflow:
            self._end_line(metrics)
        if metrics:
            self._control.metrics(metrics)

    def _take(self, piece: bytes) -> None:
        if not piece:
            return
        if self._overflow:
            self._overflow += len(piece)
        else:
            self._line += piece
            if len(self._line) <= MAX_RECORD_BYTES + 2:  # a record and its "\r\n" fit
                return
            self._overflow_is_metric = self._line.startswith(STDOUT_PREFIX)
            self._overflow = len(self._line)
            self._line.clear()
        self._last_bytes = (self._last_bytes + piece)[-2:]

    def _end_line(self, metrics: list[ParsedMetric]) -> None:
        if self._overflow:
            ending = len(self._last_bytes) - len(self._last_bytes.rstrip(b"\r\n"))
            size, is_metric = self._overflow - ending, self._overflow_is_metric
            self._overflow, self._last_bytes = 0, b""
            if is_metric:
                self._control.rejected(f"metric line of {size} bytes exceeds the {MAX_RECORD_BYTES}-byte limit")
            return
        line = bytes(self._line)
        self._line.clear()
        try:
            metric = parse_stdout_line(line)
        except MetricRejected as error:
            self._control.rejected(str(error))
            return
        if metric is not None:
            metrics.append(metric)


def failure_message(returncode: int, stderr_tail: str) -> str:
    """Why a trial failed, in one line: how it ended, then the end of what it wrote to stderr."""
    if returncode < 0:
        summary = f"killed by signal {signal.Signals(-returncode).name}"
    elif returncode == 127:
        summary = "exit code 127: command not found"
    else:
        summary = f"exit code {returncode}"
    return f"{summary}; stderr: {stderr_tail}" if stderr_tail else summary


def read_tail(path: Path, size: int = STDERR_TAIL_BYTES) -> str:
    """The last `size` bytes of a trial's output file, as text (undecodable bytes replaced)."""
    try:
        with path.open("rb") as file:
            file.seek(max(0, path.stat().st_size - size))
            return file.read().decode(errors="replace").strip()
    except FileNotFoundError:
        return ""
