"""The keeper a Kubernetes trial pod runs (workers/pod_keeper.py), as a real process in a directory laid
out as the pod's: the code from the ConfigMap parts, parameter.cfg, NNI's file metrics turned into
stdout lines, the trial's exit code and stderr tail, and a SIGTERM passed on to the trial."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from simulators.waiting import wait_until
from workers.platforms.shared import pod_keeper
from workers.platforms.shared.metrics import MetricRejected, parse_stdout_line

TRIAL = """
import json, os, sys, time
sys_dir = os.environ["NNI_SYS_DIR"]
form = json.load(open(os.path.join(sys_dir, "parameter.cfg")))
os.makedirs(os.path.join(sys_dir, ".nni"), exist_ok=True)
def to_file(kind, sequence, value):
    data = json.dumps({"parameter_id": form["parameter_id"], "type": kind, "sequence": sequence,
                       "value": json.dumps(value)}).encode() + b"\\n"
    with open(os.path.join(sys_dir, ".nni", "metrics"), "ab") as metrics:
        metrics.write(b"ME%06d" % len(data) + data)
print("hello from", os.getcwd(), flush=True)
to_file("PERIODICAL", 0, 0.5)
if form["parameters"].get("bad"):  # bytes that are no record, between two that are
    with open(os.path.join(sys_dir, ".nni", "metrics"), "ab") as metrics:
        metrics.write(form["parameters"]["bad"].encode())
to_file("REQUEST_PARAMETER", 0, "")
to_file("FINAL", 0, {"default": 0.75, "params": form["parameters"]})
if form["parameters"].get("hold"):
    open(os.path.join(sys_dir, "held"), "w").close()
    time.sleep(300)
sys.stderr.write("last words\\n")
sys.exit(form["parameters"].get("code", 0))
"""


def pod(tmp_path: Path, parts: int = 3) -> Path:
    """The pod's working directory: the code archive split over `parts` ConfigMap keys, and the keeper."""
    work = tmp_path / "trialstream"
    archive = work / pod_keeper.ARCHIVE_DIR
    archive.mkdir(parents=True)
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode="w:gz") as tar:
        data = textwrap.dedent(TRIAL).encode()
        info = tarfile.TarInfo("trial.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    blob = packed.getvalue()
    size = -(-len(blob) // parts)
    for index in range(parts):
        (archive / f"code-{index:03d}").write_bytes(blob[index * size : (index + 1) * size])
    for name, source in pod_keeper.keeper_files().items():
        (archive / name).write_text(source)
    return work


def keeper(work: Path, **parameters: object) -> subprocess.Popen[bytes]:
    form = {"parameter_id": 4, "parameter_source": "algorithm", "parameters": parameters, "parameter_index": 0}
    env = {
        "PATH": os.environ["PATH"],
        "NNI_PLATFORM": "kubeflow",
        "NNI_EXP_ID": "exp",
        "NNI_TRIAL_JOB_ID": "abc",
        pod_keeper.PARAMETERS_VARIABLE: json.dumps(form),
        pod_keeper.COMMAND_VARIABLE: f"{sys.executable} trial.py",
    }
    return subprocess.Popen(
        [sys.executable, f"{pod_keeper.ARCHIVE_DIR}/{pod_keeper.KEEPER}"],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_the_code_runs_with_its_parameters_and_file_metrics_come_out_on_stdout(tmp_path: Path) -> None:
    work = pod(tmp_path)
    out, err = keeper(work, lr=0.1).communicate(timeout=60)
    hello = f"hello from {work / 'code'}".encode()
    lines = out.splitlines()  # the trial's own lines and the forwarded metrics: two sources, in no set order
    assert lines.count(hello) == 1
    metrics = [parse_stdout_line(line) for line in lines if line != hello]
    assert [(m.metric_type, m.sequence) for m in metrics if m] == [("PERIODICAL", 0), ("FINAL", 0)]
    final = json.loads(json.loads(metrics[-1].data)) if metrics[-1] else None
    assert final == {"default": 0.75, "params": {"lr": 0.1}}
    assert err == b"last words\n"
    assert not (work / pod_keeper.TERMINATION_LOG).exists()  # only a failure leaves a message


def test_a_failure_exits_with_the_trial_s_code_and_leaves_its_stderr_tail(tmp_path: Path) -> None:
    work = pod(tmp_path, parts=1)
    process = keeper(work, code=3)
    process.communicate(timeout=60)
    assert process.returncode == 3
    assert (work / pod_keeper.TERMINATION_LOG).read_text() == "last words\n"


def test_sigterm_is_passed_on_to_the_trial(tmp_path: Path) -> None:
    work = pod(tmp_path)
    process = keeper(work, hold=True)
    wait_until(lambda: (work / "held").exists(), 30, what="the trial to hold")
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=30)
    assert process.returncode == 128 + signal.SIGTERM
    assert (work / pod_keeper.TERMINATION_LOG).exists()


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ('MEabcdef{"type": "FINAL"}\n', "malformed metric record header b'MEabcdef'; skipped"),
        ('ME000005{"type": "PERIODICAL", "sequence": 1}\n', "metric record length does not match its content; skipped"),
    ],
    ids=["non-digit length", "lying length"],
)
def test_a_bad_record_is_reported_and_the_records_after_it_still_come_out(
    tmp_path: Path, bad: str, problem: str
) -> None:
    """Regression (issue 24 A5): the keeper trusted the length header. A non-digit one raised ValueError (the
    keeper exited 1, the trial FAILED); a lying one stopped its reading for good (every later metric lost).
    It now frames the file with the worker's own code: the bad bytes become one rejection, the rest is read."""
    work = pod(tmp_path)
    process = keeper(work, bad=bad)
    out, _ = process.communicate(timeout=60)

    assert process.returncode == 0
    metrics, rejected = [], []
    for line in out.splitlines()[1:]:
        try:
            metrics.append(parse_stdout_line(line))
        except MetricRejected as error:
            rejected.append(str(error))
    assert [(m.metric_type, m.sequence) for m in metrics if m] == [("PERIODICAL", 0), ("FINAL", 0)]
    assert rejected == [problem]
