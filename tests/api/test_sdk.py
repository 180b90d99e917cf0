"""Tests for trialstream_sdk: real subprocess trials, checked against bytes observed from nni 3.0.

Behavioural tests run for both ``trialstream_sdk`` and, when it is importable, the real ``nni``
against the same expectations, so a pass proves the launcher cannot tell the two apart.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

import trialstream_sdk as sdk

REPO = Path(__file__).resolve().parents[2]
PARAMS_7 = {
    "parameter_id": 7,
    "parameter_source": "algorithm",
    "parameters": {"x": 0.67, "act": "relu"},
    "parameter_index": 0,
}
PARAMS_8 = {"parameter_id": 8, "parameter_source": "algorithm", "parameters": {"x": 1}, "parameter_index": 1}

# Exactly what nni 3.0 appended to $NNI_SYS_DIR/.nni/metrics for BASIC_TRIAL (length counts the "\n").
NNI_LOCAL_BYTES = (
    b'ME000098{"parameter_id": 7, "trial_job_id": "abc12", "type": "PERIODICAL", "sequence": 0, '
    b'"value": "0.1"}\n'
    b'ME000128{"parameter_id": 7, "trial_job_id": "abc12", "type": "PERIODICAL", "sequence": 1, '
    b'"value": "{\\"default\\": 0.2, \\"loss\\": 1.5}"}\n'
    b'ME000093{"parameter_id": 7, "trial_job_id": "abc12", "type": "FINAL", "sequence": 0, "value": "0.5"}\n'
)
BASIC_TRIAL = """
p = nni.get_next_parameter()
out("params", p, nni.get_current_parameter(), nni.get_current_parameter("act"))
out("ids", nni.get_experiment_id(), nni.get_trial_id(), nni.get_sequence_id())
print("hello from trial")
nni.report_intermediate_result(0.1)
nni.report_intermediate_result({"default": 0.2, "loss": 1.5})
nni.report_final_result(0.5)
"""
HEADER = """
import json, os, sys
import {module} as nni
def out(*args):
    sys.stderr.write("RESULT " + json.dumps(args) + "\\n")
    sys.stderr.flush()
def attempt(func, *args):
    try:
        return ["ok", func(*args)]
    except Exception as exc:
        return [type(exc).__name__, None]
"""


@pytest.fixture(params=["trialstream_sdk", "nni"])
def impl(request: pytest.FixtureRequest) -> str:
    """The SDK a trial imports; the real nni is skipped cleanly when it is not installed."""
    if request.param == "nni":
        pytest.importorskip("nni")
    return str(request.param)


@dataclass
class Trial:
    proc: subprocess.Popen[str]
    sys_dir: Path
    stdout: str = ""
    stderr: str = ""

    def wait(self, timeout: float = 60) -> Trial:
        self.stdout, self.stderr = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, self.stderr
        return self

    @property
    def results(self) -> dict[str, list[Any]]:
        rows = [json.loads(line[7:]) for line in self.stderr.splitlines() if line.startswith("RESULT ")]
        return {row[0]: row[1:] for row in rows}

    def metrics_bytes(self) -> bytes:
        """The metrics file so far (empty until the SDK has created it)."""
        path = self.sys_dir / ".nni" / "metrics"
        return path.read_bytes() if path.exists() else b""


def start_trial(
    tmp_path: Path,
    module: str,
    body: str,
    *,
    platform: str | None = "local",
    params: dict[str, Any] | None = PARAMS_7,
    extra_env: dict[str, str] | None = None,
) -> Trial:
    """Launch ``body`` as a trial the way a launcher does: env vars plus a prepared trial directory."""
    sys_dir = tmp_path / f"trial-{module}"
    sys_dir.mkdir()
    if params is not None:
        (sys_dir / "parameter.cfg").write_text(json.dumps(params))
    script = tmp_path / f"trial_{module}.py"
    script.write_text(HEADER.format(module=module) + body)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NNI_") and k not in ("MULTI_PHASE", "REUSE_MODE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    if platform is not None:
        env.update(
            NNI_PLATFORM=platform,
            NNI_EXP_ID="exp1",
            NNI_TRIAL_JOB_ID="abc12",
            NNI_TRIAL_SEQ_ID="3",
            NNI_SYS_DIR=str(sys_dir),
            NNI_OUTPUT_DIR=str(sys_dir),
        )
    env.update(extra_env or {})
    proc = subprocess.Popen(
        [sys.executable, str(script)], cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    return Trial(proc, sys_dir)


def parse_frames(data: bytes) -> list[dict[str, Any]]:
    """Decode ``ME%06d`` framed records strictly: every byte must belong to a whole record."""
    records, pos = [], 0
    while pos < len(data):
        assert data[pos : pos + 2] == b"ME", data[pos : pos + 40]
        size = int(data[pos + 2 : pos + 8])
        body = data[pos + 8 : pos + 8 + size]
        assert len(body) == size and body.endswith(b"\n")
        records.append(json.loads(body))
        pos += 8 + size
    return records


def wait_until(condition: Callable[[], bool], trial: Trial, timeout: float = 30) -> None:
    """Wait for a condition with a deadline, failing at once if the trial dies first."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert trial.proc.poll() is None, f"trial exited early: {trial.proc.communicate()}"
        assert time.monotonic() < deadline, "condition not met before the deadline"
        time.sleep(0.02)


def write_atomically(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def strip_stamp(text: str) -> list[str]:
    return [re.sub(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] ", "", line) for line in text.splitlines()]


# --- local platform: metrics file ---


def test_local_metrics_file_and_parameters(tmp_path: Path, impl: str) -> None:
    trial = start_trial(tmp_path, impl, BASIC_TRIAL).wait()
    assert trial.metrics_bytes() == NNI_LOCAL_BYTES
    assert trial.results["params"] == [PARAMS_7["parameters"], PARAMS_7["parameters"], "relu"]
    assert trial.results["ids"] == ["exp1", "abc12", 3]
    # stdout is redirected into trial.log on local, each line stamped and tagged PRINT
    assert trial.stdout == ""
    log = (trial.sys_dir / "trial.log").read_text()
    assert re.search(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] PRINT hello from trial$", log, re.M), log


def test_byte_identical_to_real_nni(tmp_path: Path) -> None:
    pytest.importorskip("nni")
    ours = start_trial(tmp_path, "trialstream_sdk", BASIC_TRIAL)
    real = start_trial(tmp_path, "nni", BASIC_TRIAL)
    ours.wait(), real.wait()
    assert ours.metrics_bytes() == real.metrics_bytes()
    keys = ("parameter_id", "trial_job_id", "type", "sequence", "value")
    mine, theirs = parse_frames(ours.metrics_bytes()), parse_frames(real.metrics_bytes())
    assert [[r[k] for k in keys] for r in mine] == [[r[k] for k in keys] for r in theirs]
    assert all(list(r) == list(keys) for r in mine)
    assert ours.results == real.results
    assert strip_stamp((ours.sys_dir / "trial.log").read_text()) == strip_stamp(
        (real.sys_dir / "trial.log").read_text()
    )


def test_report_before_get_next_parameter_asserts(tmp_path: Path, impl: str) -> None:
    body = """
out("early", attempt(nni.report_intermediate_result, 0.1), attempt(nni.report_final_result, 0.1))
out("first", attempt(nni.get_next_parameter))
out("second", attempt(nni.get_next_parameter), nni.get_current_parameter())
out("after", attempt(nni.report_final_result, 0.1))
"""
    trial = start_trial(tmp_path, impl, body).wait()
    assert trial.results == {
        "early": [["AssertionError", None], ["AssertionError", None]],
        "first": [["ok", PARAMS_7["parameters"]]],
        "second": [["ok", None], None],  # single-phase: no second parameter set, and it forgets the first
        "after": [["AssertionError", None]],
    }
    assert trial.metrics_bytes() == b""


def test_multi_phase_requests_and_parameter_files(tmp_path: Path, impl: str) -> None:
    body = """
for phase in range(2):
    out("phase%d" % phase, nni.get_next_parameter())
    nni.report_intermediate_result(phase / 10)
    nni.report_final_result(phase)
"""
    trial = start_trial(tmp_path, impl, body, extra_env={"MULTI_PHASE": "true"})
    wait_until(lambda: b"REQUEST_PARAMETER" in trial.metrics_bytes(), trial)
    write_atomically(trial.sys_dir / "parameter_1.cfg", PARAMS_8)
    trial.wait()
    assert trial.results == {"phase0": [PARAMS_7["parameters"]], "phase1": [PARAMS_8["parameters"]]}
    assert trial.metrics_bytes() == (
        b'ME000098{"parameter_id": 7, "trial_job_id": "abc12", "type": "PERIODICAL", "sequence": 0, '
        b'"value": "0.0"}\n'
        b'ME000091{"parameter_id": 7, "trial_job_id": "abc12", "type": "FINAL", "sequence": 0, '
        b'"value": "0"}\n'
        b'ME000092{"trial_job_id": "abc12", "type": "REQUEST_PARAMETER", "sequence": 0, '
        b'"parameter_index": 1}\n'
        b'ME000098{"parameter_id": 8, "trial_job_id": "abc12", "type": "PERIODICAL", "sequence": 1, '
        b'"value": "0.1"}\n'
        b'ME000091{"parameter_id": 8, "trial_job_id": "abc12", "type": "FINAL", "sequence": 0, '
        b'"value": "1"}\n'
    )


def test_missing_parameter_file_is_requested(tmp_path: Path) -> None:
    trial = start_trial(tmp_path, "trialstream_sdk", BASIC_TRIAL, params=None)
    wait_until(lambda: trial.metrics_bytes() != b"", trial)
    assert trial.metrics_bytes() == (
        b'ME000092{"trial_job_id": "abc12", "type": "REQUEST_PARAMETER", "sequence": 0, "parameter_index": 0}\n'
    )
    write_atomically(trial.sys_dir / "parameter.cfg", PARAMS_7)
    trial.wait()
    assert trial.metrics_bytes().endswith(NNI_LOCAL_BYTES)


# --- other platforms: stdout lines ---


def test_stdout_lines_on_remote_platform(tmp_path: Path, impl: str) -> None:
    trial = start_trial(tmp_path, impl, BASIC_TRIAL, platform="remote").wait()
    assert trial.stdout.splitlines() == ["hello from trial"] + [
        f"NNISDK_MEb'{frame[8:-1].decode()}'" for frame in re.findall(rb"ME\d{6}[^\n]*\n", NNI_LOCAL_BYTES)
    ]
    assert trial.metrics_bytes() == b""  # created, never written
    assert trial.results["ids"] == ["exp1", "abc12", 3]


def test_reuse_mode_prints_even_on_local(tmp_path: Path) -> None:
    trial = start_trial(tmp_path, "trialstream_sdk", BASIC_TRIAL, extra_env={"REUSE_MODE": "true"}).wait()
    assert trial.stdout.splitlines()[0] == "hello from trial"
    assert [line[:11] for line in trial.stdout.splitlines()[1:]] == ["NNISDK_MEb'"] * 3
    assert trial.metrics_bytes() == b""


def test_standalone_without_platform(tmp_path: Path, impl: str) -> None:
    body = """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out("params", nni.get_next_parameter(), [w.category.__name__ for w in caught])
out("ids", nni.get_experiment_id(), nni.get_trial_id(), nni.get_sequence_id())
nni.report_intermediate_result(0.1)
nni.report_final_result(0.5)
"""
    trial = start_trial(tmp_path, impl, body, platform=None).wait()
    assert trial.results == {"params": [{}, ["RuntimeWarning"]], "ids": ["STANDALONE", "STANDALONE", 0]}
    assert "Intermediate result: 0.1  (Index 0)" in trial.stdout
    assert "Final result: 0.5" in trial.stdout
    assert not (trial.sys_dir / ".nni").exists()


# --- metric values ---

GOOD_VALUES: list[tuple[Any, str]] = [
    (0.5, "0.5"),
    (1, "1"),
    (0.1 + 0.2, "0.30000000000000004"),
    (1e300, "1e+300"),
    (Fraction(1, 4), "0.25"),
    ({"default": 0.2, "loss": 1.5}, '{"default": 0.2, "loss": 1.5}'),
    ({"b": 1, "a": 2, "default": 3}, '{"b": 1, "a": 2, "default": 3}'),
    ({"default": 1, "\u00fc": "\u00e9"}, '{"default": 1, "\\u00fc": "\\u00e9"}'),
]


@pytest.mark.parametrize(("value", "expected"), GOOD_VALUES)
def test_metric_encoding_matches_nni(value: Any, expected: str) -> None:
    assert sdk.encode_metric(value) == expected


def test_metric_encoding_equals_nni_dump() -> None:
    nni = pytest.importorskip("nni")
    for value, _ in GOOD_VALUES:
        if not isinstance(value, Fraction):  # json_tricks has its own Fraction format; not a metric anyway
            assert sdk.encode_metric(value) == nni.dump(value)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (math.nan, ValueError),
        (math.inf, ValueError),
        (-math.inf, ValueError),
        ({"default": math.nan}, ValueError),
        ({"default": 1, "loss": math.inf}, ValueError),
        ("0.5", TypeError),
        (None, TypeError),
        ([1, 2], TypeError),
        (True, TypeError),
        ({"loss": 1.0}, TypeError),
        ({"default": "x"}, TypeError),
        ({"default": 1, "f": object()}, TypeError),
    ],
)
def test_invalid_metric_values_are_refused(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        sdk.encode_metric(value)


def test_refused_metric_writes_nothing_and_keeps_sequence(tmp_path: Path) -> None:
    body = """
nni.get_next_parameter()
out("nan", attempt(nni.report_intermediate_result, float("nan")))
out("str", attempt(nni.report_final_result, "good"))
nni.report_intermediate_result(0.1)
"""
    trial = start_trial(tmp_path, "trialstream_sdk", body).wait()
    assert trial.results == {"nan": [["ValueError", None]], "str": [["TypeError", None]]}
    assert trial.metrics_bytes() == NNI_LOCAL_BYTES.split(b"\n")[0] + b"\n"


@pytest.mark.parametrize("platform", ["local", "remote"])
def test_record_size_limit_same_boundary_as_nni(tmp_path: Path, impl: str, platform: str) -> None:
    # local: len(json) + 1 ("\n") must be < 1,000,000; stdout: len(json) < 1,000,000 -- as in nni.
    body = f"""
nni.get_next_parameter()
def size(n, seq):
    value = json.dumps({{"default": 1, "s": "x" * n}})
    return len(json.dumps({{"parameter_id": 7, "trial_job_id": "abc12", "type": "PERIODICAL",
                            "sequence": seq, "value": value}}))
largest = 999_999 - {1 if platform == "local" else 0}
n = largest - size(0, 0)
out("too_big", attempt(nni.report_intermediate_result, {{"default": 1, "s": "x" * (n + 1)}}))
out("largest", attempt(nni.report_intermediate_result, {{"default": 1, "s": "x" * n}}))
out("too_big_again", attempt(nni.report_intermediate_result, {{"default": 1, "s": "x" * (n + 1)}}))
"""
    trial = start_trial(tmp_path, impl, body, platform=platform).wait()
    refused = "ValueError" if impl == "trialstream_sdk" else "AssertionError"  # nni asserts
    assert trial.results == {
        "too_big": [[refused, None]],
        "largest": [["ok", None]],
        "too_big_again": [[refused, None]],
    }
    if platform == "local":
        data = trial.metrics_bytes()
        assert data.startswith(b"ME999999") and len(data) == 8 + 999_999
        assert [r["sequence"] for r in parse_frames(data)] == [0]
    else:
        lines = trial.stdout.splitlines()
        assert len(lines) == 1 and len(lines[0]) == len("NNISDK_MEb''") + 999_999


# --- in-process checks of the write path ---


def test_each_record_is_one_write_on_an_append_fd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = sdk._Env.read(
        {
            "NNI_PLATFORM": "local",
            "NNI_TRIAL_JOB_ID": "t",
            "NNI_SYS_DIR": str(tmp_path),
            "NNI_OUTPUT_DIR": str(tmp_path),
        }
    )
    channel = sdk._Channel(env)
    writes: list[bytes] = []
    real_write = os.write

    def spy(fd: int, data: Any) -> int:
        writes.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", spy)
    for size in (10, 5000, 500_000):
        channel.send({"type": "PERIODICAL", "value": sdk.encode_metric({"default": 1, "s": "x" * size})})
    monkeypatch.undo()
    assert len(writes) == 3 and all(len(parse_frames(w)) == 1 for w in writes)
    assert (tmp_path / ".nni" / "metrics").read_bytes() == b"".join(writes)
    assert os.fstat(channel.fd).st_size == sum(map(len, writes))
    os.close(channel.fd)


def test_half_written_parameter_file_is_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = sdk._Env.read(
        {
            "NNI_PLATFORM": "local",
            "NNI_TRIAL_JOB_ID": "t",
            "NNI_SYS_DIR": str(tmp_path),
            "NNI_OUTPUT_DIR": str(tmp_path),
        }
    )
    cfg = tmp_path / "parameter.cfg"
    cfg.write_text(json.dumps(PARAMS_7)[:20])
    sleeps: list[float] = []

    def finish_writing(seconds: float) -> None:  # the launcher completes the file while the SDK waits
        sleeps.append(seconds)
        cfg.write_text(json.dumps(PARAMS_7))

    monkeypatch.setattr(time, "sleep", finish_writing)
    channel = sdk._Channel(env)
    assert channel.receive_parameter() == PARAMS_7
    assert sleeps == [sdk.PARAMETER_POLL_S]
    assert (tmp_path / ".nni" / "metrics").read_bytes() == b""  # the file existed: no REQUEST_PARAMETER
    os.close(channel.fd)
