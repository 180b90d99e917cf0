"""What a Kubernetes trial pod runs (shipped to it in the experiment's code ConfigMaps): unpack the
code, write `parameter.cfg`, run the trial command, and make everything the trial reports reach the
pod's log, the one channel the worker reads (`read_namespaced_pod_log`): nothing in the pod connects
to trialstream.

Metrics the SDK appended to `$NNI_SYS_DIR/.nni/metrics` (NNI's file format) are printed as
`NNISDK_MEb'...'` lines, the format NNI's SDK prints on every non-local platform, beside the trial's
own output. Its exit code is the container's; when it fails, the end of its stderr goes to the
container's termination message, from which the worker writes the trial's `message`.

Standard library only, Python >= 3.8: it runs with whatever python3 the trial's image has. It is shipped
with `workers/metric_framing.py` beside it (`keeper_files()`), so it frames the metrics file as a worker does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

try:
    from workers.platforms.shared.metric_framing import REJECTED_NOTICE, FramingProblem, RecordTail
except ImportError:  # in the pod: shipped beside this file (KEEPER_FILES)
    from metric_framing import REJECTED_NOTICE, FramingProblem, RecordTail  # type: ignore[no-redef]

ARCHIVE_DIR = "archive"  # the ConfigMaps' projected volume, under the working directory
TERMINATION_LOG = "termination-log"  # the container's terminationMessagePath, under the working directory
STORAGE_DIR = "storage"  # where the pod mounts the nfs storage, if the config has one
PARAMETERS_VARIABLE = "TRIAL_PARAMETER_CFG"
COMMAND_VARIABLE = "TRIAL_COMMAND"
STDERR_TAIL = 2000
_out_lock = threading.Lock()


KEEPER = "keeper.py"
KEEPER_FILES = {KEEPER: "pod_keeper.py", "metric_framing.py": "metric_framing.py"}  # shipped name -> ours


def keeper_files() -> dict[str, str]:
    """What a pod or job is given to run the keeper: file name -> source, all in one directory."""
    here = Path(__file__).resolve().parent
    return {name: (here / source).read_text() for name, source in KEEPER_FILES.items()}


def emit(line: bytes) -> None:
    """One whole line on the pod's stdout: the trial's lines and the metric lines never interleave."""
    with _out_lock:
        sys.stdout.buffer.write(line if line.endswith(b"\n") else line + b"\n")
        sys.stdout.buffer.flush()


def unpack(work: Path) -> Path:
    code = work / "code"
    parts = sorted(path for path in (work / ARCHIVE_DIR).iterdir() if path.name.startswith("code-"))
    archive = work / "code.tgz"
    with archive.open("wb") as joined:
        for part in parts:
            joined.write(part.read_bytes())
    code.mkdir(exist_ok=True)
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(code, filter="data")
        else:  # the archive is trialstream's own (packed from the code directory): no links out, no absolute paths
            tar.extractall(code)
    archive.unlink()
    return code


class MetricFile:
    """Follows NNI's metrics file, framed as a worker frames it: each record becomes a metric line, each
    framing problem a notice line the worker records as a rejected metric, and reading goes on past it."""

    def __init__(self, path: Path) -> None:
        self.tail = RecordTail(path)

    def forward(self, final: bool = False) -> None:
        """Everything completed since the last call; `final`: the trial has ended, read to the end."""
        while True:
            for frame in self.tail.read_new(final):
                if isinstance(frame, FramingProblem):
                    emit(REJECTED_NOTICE + frame.encode())
                elif b'"REQUEST_PARAMETER"' not in frame:
                    emit(b"NNISDK_MEb'" + frame.rstrip(b"\r") + b"'")
            if not self.tail.behind:
                return


def copy_stdout(stream: object) -> None:
    for line in iter(stream.readline, b""):  # type: ignore[attr-defined]
        emit(line)


def copy_stderr(stream: object, tail: bytearray) -> None:
    for line in iter(stream.readline, b""):  # type: ignore[attr-defined]
        sys.stderr.buffer.write(line)
        sys.stderr.buffer.flush()
        tail.extend(line)
        del tail[:-STDERR_TAIL]


def main() -> int:
    work = Path.cwd()
    environment = dict(os.environ)
    parameters = environment.pop(PARAMETERS_VARIABLE, "")
    command = environment.pop(COMMAND_VARIABLE)
    code = unpack(work)
    (work / ".nni").mkdir(exist_ok=True)
    (work / "parameter.cfg").write_text(parameters)
    output = work / "output"
    if (work / STORAGE_DIR).is_dir():  # an nfs storage mounted by the pod: the output outlives it
        output = work / STORAGE_DIR / environment["NNI_EXP_ID"] / environment["NNI_TRIAL_JOB_ID"]
    output.mkdir(parents=True, exist_ok=True)
    environment.update(NNI_SYS_DIR=str(work), NNI_OUTPUT_DIR=str(output), NNI_CODE_DIR=str(code))
    trial = subprocess.Popen(
        ["sh", "-c", command],
        cwd=code,
        env=environment,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )

    def forward_signal(signum: int, _frame: object) -> None:  # the pod is being deleted: the trial goes first
        with contextlib.suppress(ProcessLookupError):
            os.killpg(trial.pid, signum)

    signal.signal(signal.SIGTERM, forward_signal)
    signal.signal(signal.SIGINT, forward_signal)
    tail = bytearray()
    readers = [
        threading.Thread(target=copy_stdout, args=(trial.stdout,), daemon=True),
        threading.Thread(target=copy_stderr, args=(trial.stderr, tail), daemon=True),
    ]
    for reader in readers:
        reader.start()
    metrics = MetricFile(work / ".nni" / "metrics")
    while trial.poll() is None:
        metrics.forward()
        time.sleep(0.2)
    for reader in readers:
        reader.join(timeout=10)  # a child the trial left behind may hold its pipes open
    metrics.forward(final=True)
    if trial.returncode != 0:
        (work / TERMINATION_LOG).write_bytes(bytes(tail))
    return trial.returncode if trial.returncode >= 0 else 128 - trial.returncode


if __name__ == "__main__":
    sys.exit(main())
