"""`trialstream trials logs` as a user runs it: real workers, real trials, their output read back unchanged."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from core import keys
from core.queueing import submission_key
from core.registry import add_platforms
from schemas.events import TrialStarted
from schemas.trial import TrialJobStatus
from tests.conftest import REPO, Processes, ServiceFactory, form, wait_for_status, wait_until

# Bytes that rich would read as markup, an escape sequence, and bytes that are not UTF-8: all are the trial's data.
STDOUT = b"first line\n[bold]x[/bold] [red]not red[/red]\n\x1b[1mbold?\x1b[0m\n\xff\xfe\x80 not utf-8\nno newline"
STDERR = b"[/] warning: \xc3\x28 half a character\n"

TRIAL = """
import os, sys, time

mode = sys.argv[1]
if mode == "write":
    sys.stdout.buffer.write({stdout!r})
    sys.stderr.buffer.write({stderr!r})
elif mode == "wait":  # one line, then another once the test creates the `go` file
    go = sys.argv[2]
    sys.stdout.buffer.write(b"before [i]go[/i]\\n")
    sys.stdout.flush()
    deadline = time.time() + 60
    while not os.path.exists(go) and time.time() < deadline:
        time.sleep(0.01)
    sys.stdout.buffer.write(b"after go \\xff\\n")
"""


def trialstream(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    inherited = {name: value for name, value in os.environ.items() if name != "TRIALSTREAM_REDIS_URL"}
    return subprocess.run(
        [sys.executable, "-m", "manager.cli", *args],
        cwd=REPO,
        env={**inherited, **env},
        capture_output=True,
        timeout=timeout,
    )


def fails(result: subprocess.CompletedProcess[bytes], message: str) -> str:
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == 1, stderr
    assert message in stderr and "Traceback" not in stderr, stderr
    assert result.stdout == b""
    return stderr


def follow_running(service, trial_id: str, redis_url: str) -> subprocess.Popen[bytes]:
    """`trialstream trials logs TRIAL --follow` on the trial, once it runs."""
    wait_for_status(service, trial_id, "RUNNING")
    return subprocess.Popen(
        [sys.executable, "-m", "manager.cli", "trials", "logs", trial_id, "--follow"],
        cwd=REPO,
        env={**os.environ, "TRIALSTREAM_REDIS_URL": redis_url},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@pytest.fixture
def trial_script(code_dir: Path) -> str:
    (code_dir / "trial.py").write_text(textwrap.dedent(TRIAL.format(stdout=STDOUT, stderr=STDERR)))
    return f"{sys.executable} trial.py"


def test_logs_prints_the_trials_stdout_and_stderr_byte_for_byte(
    served: Processes, make_service: ServiceFactory, trial_script: str
) -> None:
    service = make_service(f"{trial_script} write")
    trial_id = service.submit_trial_job(form(0)).id
    assert wait_for_status(service, trial_id, "SUCCEEDED", "FAILED").status is TrialJobStatus.SUCCEEDED
    env = {"TRIALSTREAM_REDIS_URL": served.redis_url}

    stdout = trialstream("trials", "logs", trial_id, "--experiment", service.experiment_id, env=env)
    assert stdout.returncode == 0, stdout.stderr
    assert stdout.stdout == STDOUT
    stderr = trialstream("trials", "logs", trial_id, "--stderr", env=env)  # the newest experiment
    assert stderr.returncode == 0, stderr.stderr
    assert stderr.stdout == STDERR
    followed = trialstream("trials", "logs", trial_id, "--follow", env=env)  # an ended trial: all, then done
    assert (followed.returncode, followed.stdout) == (0, STDOUT), followed.stderr

    fails(trialstream("trials", "logs", "zzzzz", env=env), "trial 'zzzzz' not found")

    stdout_file = Path(service.get_trial_job(trial_id).url or "") / "stdout"
    stdout_file.unlink()
    fails(trialstream("trials", "logs", trial_id, env=env), f"no stdout of trial {trial_id} at {stdout_file}")


def test_follow_prints_output_as_it_is_written_and_returns_when_the_trial_ends(
    served: Processes, make_service: ServiceFactory, trial_script: str, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    service = make_service(f"{trial_script} wait {go}")
    trial_id = service.submit_trial_job(form(0)).id
    follower = follow_running(service, trial_id, served.redis_url)
    chunks: queue.Queue[bytes] = queue.Queue()
    threading.Thread(target=lambda: _pump(follower, chunks), daemon=True).start()
    received = bytearray()

    def has(expected: bytes) -> bool:
        while not chunks.empty():
            received.extend(chunks.get())
        return received == expected

    try:
        wait_until(lambda: has(b"before [i]go[/i]\n"), what="the line written before `go`")
        assert follower.poll() is None  # the trial still runs: the follower waits for more
        go.touch()
        assert follower.wait(30) == 0, follower.stderr.read() if follower.stderr else ""
        wait_until(lambda: has(b"before [i]go[/i]\nafter go \xff\n"), what="the whole output")
        assert service.get_trial_job(trial_id).status is TrialJobStatus.SUCCEEDED
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()


def test_ctrl_c_ends_a_follow_quietly(
    served: Processes, make_service: ServiceFactory, trial_script: str, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    service = make_service(f"{trial_script} wait {go}")
    trial_id = service.submit_trial_job(form(0)).id
    follower = follow_running(service, trial_id, served.redis_url)
    try:
        assert follower.stdout is not None and follower.stderr is not None
        assert follower.stdout.readline() == b"before [i]go[/i]\n"  # following: the trial waits for `go`
        follower.send_signal(signal.SIGINT)
        assert follower.wait(30) == 0  # the way to stop a follow, not a failure
        assert follower.stderr.read() == b""
    finally:
        go.touch()  # the trial ends, so the worker stops promptly at teardown
        if follower.poll() is None:
            follower.kill()
            follower.wait()


def _pump(process: subprocess.Popen[bytes], chunks: queue.Queue[bytes]) -> None:
    assert process.stdout is not None
    while chunk := os.read(process.stdout.fileno(), 65536):
        chunks.put(chunk)


def test_a_trial_that_never_started_has_no_output(
    redis_url: str, make_service: ServiceFactory, trial_script: str
) -> None:
    """No worker serves the queue: the trial waits, then is canceled before it starts."""
    service = make_service(f"{trial_script} write")
    trial_id = service.submit_trial_job(form(0)).id
    env = {"TRIALSTREAM_REDIS_URL": redis_url}
    fails(trialstream("trials", "logs", trial_id, env=env), f"trial {trial_id} has not started yet: no output")
    service.cancel_trial_job(trial_id)
    fails(trialstream("trials", "logs", trial_id, "--follow", env=env), f"trial {trial_id} never started: no output")


def test_logs_of_a_trial_on_a_plugged_in_platform(
    processes: Processes, make_service: ServiceFactory, trial_script: str
) -> None:
    """The detached test platform (its trials outlive their worker) names no url: it reads its own files."""
    platforms = "detached=tests.platforms.detached:DetachedPlatform"
    add_platforms({"detached": "tests.platforms.detached:DetachedPlatform"})
    processes.projector()
    processes.worker("detached", env={"TRIALSTREAM_PLATFORMS": platforms})
    service = make_service(f"{trial_script} write", platform_config={"platform": "detached"})
    trial_id = service.submit_trial_job(form(0)).id
    assert wait_for_status(service, trial_id, "SUCCEEDED", "FAILED").status is TrialJobStatus.SUCCEEDED
    env = {"TRIALSTREAM_REDIS_URL": processes.redis_url, "TRIALSTREAM_PLATFORMS": platforms}
    stderr = trialstream("trials", "logs", trial_id, "--stderr", env=env)
    assert (stderr.returncode, stderr.stdout) == (0, STDERR), stderr.stderr


def test_a_trial_whose_log_lacks_its_submission_key_says_its_output_cannot_be_found(
    redis_url: str, make_service: ServiceFactory, trial_script: str
) -> None:
    """A log imported from elsewhere may lack the key that finds a trial's submission, and with it where it ran."""
    service = make_service(f"{trial_script} write")
    trial_id = service.submit_trial_job(form(0)).id
    started = TrialStarted(
        experiment_id=service.experiment_id, trial_id=trial_id, attempt=1, source="elsewhere", working_directory="/w"
    )
    service.store.append(started)
    service.store.client.hdel(keys.idempotency(service.experiment_id), submission_key(trial_id))
    env = {"TRIALSTREAM_REDIS_URL": redis_url}
    fails(
        trialstream("trials", "logs", trial_id, env=env),
        "has no submission in the log: where its output is cannot be told",
    )
