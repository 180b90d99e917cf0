"""A2: Ctrl-C (SIGINT to the terminal's process group) or SIGTERM on an embedded `trialstream run`.

The private redis-server, projector and workers are in sessions of their own, so the signal reaches
the runner alone; it stops the experiment cleanly (running trials SYS_CANCELED, the experiment
STOPPED), stops its stack, and exits 130 or 143; `trialstream resume` then runs it on to DONE.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from core.connections import connect
from manager.stack import embedded_experiments, live_url
from manager.training_service import TrainingService
from tests.conftest import REPO, wait_until
from tests.support.configs import write_local_config

# Trials sleep while the marker exists, and end at once without it: the resumed run finishes quickly.
SLEEPS_WHILE_MARKED = """
import os, time
while os.path.exists(os.environ["MARKER"]):
    time.sleep(0.1)
"""


def environment(tmp_path: Path) -> dict[str, str]:
    inherited = {name: value for name, value in os.environ.items() if not name.startswith("TRIALSTREAM_")}
    marker = tmp_path / "marker"
    return {**inherited, "TRIALSTREAM_EXPERIMENTS_DIR": str(tmp_path / "experiments"), "MARKER": str(marker)}


def trialstream(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "manager.cli", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


def running_trials(experiments: Path) -> list[str] | None:
    """The ids of the running trials of the one experiment under `experiments`, read from its live Redis."""
    directories = embedded_experiments(experiments)
    url = live_url(directories[0]) if directories else None
    if url is None:
        return None
    try:
        trials = TrainingService(connect(url), connect(url, decode=False), directories[0].name)
        running = [trial.id for trial in trials.list_trial_jobs() if trial.status == "RUNNING"]
    except Exception:  # the stack is still starting
        return None
    return running if len(running) == 2 else None


def processes_of(tmp_path: Path) -> list[str]:
    """Every process (but this one) whose command line, environment or directory is under `tmp_path`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (entry / "environ").read_bytes().decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
        except OSError:  # gone, or not ours
            continue
        if str(tmp_path) in cmdline or str(tmp_path) in environ or cwd.startswith(str(tmp_path)):
            found.append(f"{entry.name}: {cmdline}")
    return found


@contextmanager
def embedded_run(tmp_path: Path, config: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """`trialstream run CONFIG --json` in a session of its own, its output in run.out and run.err; killed with
    everything it started if a test leaves it running."""
    with (tmp_path / "run.out").open("w") as out, (tmp_path / "run.err").open("w") as err:
        run = subprocess.Popen(
            [sys.executable, "-m", "manager.cli", "run", str(config), "--json"],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=err,
            start_new_session=True,  # its own process group, as a terminal's foreground job
        )
    try:
        yield run
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()


@pytest.mark.parametrize(
    ("signum", "to_group", "status"),
    [(signal.SIGINT, True, 130), (signal.SIGTERM, False, 143)],
    ids=["ctrl-c-to-the-group", "sigterm-to-the-runner"],
)
def test_an_interrupted_embedded_run_stops_cleanly_and_resumes(
    tmp_path: Path, signum: int, to_group: bool, status: int
) -> None:
    config = write_local_config(tmp_path, SLEEPS_WHILE_MARKED, trialConcurrency=2, maxTrialNumber=3)
    env = environment(tmp_path)
    (tmp_path / "marker").touch()
    with embedded_run(tmp_path, config, env) as run:
        wait_until(lambda: running_trials(tmp_path / "experiments"), 60, 0.2, what="two trials RUNNING")
        if to_group:
            os.killpg(run.pid, signum)
        else:
            os.kill(run.pid, signum)
        assert run.wait(60) == status, (tmp_path / "run.err").read_text()
    stderr = (tmp_path / "run.err").read_text()
    assert "Traceback" not in stderr, stderr
    assert "trialstream resume" in stderr, stderr
    wait_until(lambda: not processes_of(tmp_path), 20, 0.2, what="no redis-server, worker or trial left")

    experiment_id = next((tmp_path / "experiments").glob("*/redis")).parent.name
    listed = trialstream("trials", "list", "-e", experiment_id, "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    assert sorted(trial["status"] for trial in json.loads(listed.stdout)) == ["SYS_CANCELED", "SYS_CANCELED"]
    finished = trialstream("events", experiment_id, "--type", "ExperimentFinished", "--json", env=env)
    assert finished.returncode == 0, finished.stderr
    assert [json.loads(line)["event"]["status"] for line in finished.stdout.splitlines()] == ["STOPPED"]

    (tmp_path / "marker").unlink()
    resumed = trialstream("resume", experiment_id, "--json", env=env)
    assert resumed.returncode == 0, resumed.stderr
    statuses = sorted(trial["status"] for trial in json.loads(resumed.stdout)["trials"])
    assert statuses == ["SUCCEEDED", "SYS_CANCELED", "SYS_CANCELED"]
    finished = trialstream("events", experiment_id, "--type", "ExperimentFinished", "--json", env=env)
    assert [json.loads(line)["event"]["status"] for line in finished.stdout.splitlines()] == ["STOPPED", "DONE"]
    wait_until(lambda: not processes_of(tmp_path), 20, 0.2, what="no process left after the resumed run")
