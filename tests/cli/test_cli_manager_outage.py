"""`trialstream --manager URL run` while the manager is away: a pause longer than uvicorn's keep-alive (5 s),
after which it may reset the connection the CLI's poll waits on, and a restart, are ridden out; a manager gone
for good ends the command within TRIALSTREAM_MANAGER_WAIT_S, saying the experiment may still run and how to
follow it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from simulators.waiting import wait_until
from tests.cli.test_cli_manager import TRIAL, client_code
from tests.conftest import REPO, Processes
from tests.support import web

PAUSE_S = 7.0  # past uvicorn's timeout_keep_alive (5 s), which the manager does not expose
pytestmark = pytest.mark.xdist_group("cli-manager")


def gated_trial(gate: Path) -> str:
    """TRIAL, once `gate` exists: the experiment runs (and is followed) until the test lets it end."""
    return f"import pathlib, time\nwhile not pathlib.Path({str(gate)!r}).exists():\n    time.sleep(0.05)\n{TRIAL}"


def following_run(
    manager: str, config: Path, stderr: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    """`run --json` through the manager (its stderr into `stderr`, read while it runs), once its experiment has a
    running trial, and the experiment's id."""
    clean = {name: value for name, value in os.environ.items() if not name.startswith("TRIALSTREAM_")}
    with stderr.open("w") as err:
        run = subprocess.Popen(
            [sys.executable, "-m", "manager.cli", "--manager", manager, "run", str(config), "--json"],
            cwd=REPO,
            env={**clean, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )

    def running() -> str | None:
        for state in web.get(f"{manager}/api/v1/experiments").json():
            page = web.get(f"{manager}/api/v1/experiments/{state['id']}/trials").json()
            if any(trial["status"] == "RUNNING" for trial in page["items"]):
                return str(state["id"])
        return None

    return run, wait_until(running, 60, what="a trial to run")


def test_run_rides_out_a_manager_paused_past_its_keep_alive(tmp_path: Path, processes: Processes) -> None:
    processes.worker(args=("--concurrency", "4"))
    manager = processes.manager(env={"TRIALSTREAM_EXPERIMENTS_DIR": str(tmp_path / "manager-experiments")})
    server = processes.running[-1]
    gate = tmp_path / "gate"
    config = client_code(tmp_path / "client", gated_trial(gate), maxTrialNumber=2, trialConcurrency=2)
    run, experiment_id = following_run(manager, config, tmp_path / "run.err")
    try:
        server.send_signal(signal.SIGSTOP)
        time.sleep(PAUSE_S)  # the CLI's poll waits on a connection the manager drops as it wakes
        server.send_signal(signal.SIGCONT)
        gate.touch()
        out, _ = run.communicate(timeout=120)
    finally:
        server.send_signal(signal.SIGCONT)
        gate.touch()
        run.kill()
    err = (tmp_path / "run.err").read_text()
    assert run.returncode == 0, err + processes.logs()
    result = json.loads(out)
    assert result["experimentId"] == experiment_id
    assert [trial["status"] for trial in result["trials"]] == ["SUCCEEDED", "SUCCEEDED"]
    assert "Traceback" not in err
    if "does not answer" in err:  # the reset is a race the manager's wake-up does not always lose: see below
        assert err.count("does not answer") == 1 and "answers again" in err, err


def test_run_follows_its_experiment_across_a_manager_restart(tmp_path: Path, processes: Processes) -> None:
    """The same outage, every time: the manager killed, its port refusing, then a new manager on the same
    port that resumes the experiment (README: the next manager resumes it); the command follows it to its end."""
    processes.worker(args=("--concurrency", "4"))
    env = {"TRIALSTREAM_EXPERIMENTS_DIR": str(tmp_path / "manager-experiments")}
    manager = processes.manager(env=env)
    gate = tmp_path / "gate"
    config = client_code(tmp_path / "client", gated_trial(gate), maxTrialNumber=2, trialConcurrency=2)
    run, experiment_id = following_run(manager, config, tmp_path / "run.err")
    try:
        processes.running[-1].kill()
        processes.running[-1].wait()
        noticed = f"the manager at {manager} does not answer"  # its polls refused meanwhile
        wait_until(lambda: noticed in (tmp_path / "run.err").read_text(), 30, what="the command to notice")
        processes.start("manager", "--port", manager.rsplit(":", 1)[1], "--no-token", env=env)
        wait_until(lambda: answers(manager), 30, what="the new manager to answer")
        gate.touch()
        out, _ = run.communicate(timeout=120)
    finally:
        gate.touch()
        run.kill()
    err = (tmp_path / "run.err").read_text()
    assert run.returncode == 0, err + processes.logs()
    result = json.loads(out)
    assert result["experimentId"] == experiment_id
    assert [trial["status"] for trial in result["trials"]] == ["SUCCEEDED", "SUCCEEDED"]
    assert "Traceback" not in err
    assert err.count(f"the manager at {manager} does not answer") == 1 and "answers again" in err, err


def answers(url: str) -> bool:
    try:
        return web.get(f"{url}/api/v1/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_run_gives_up_on_a_manager_gone_for_good(tmp_path: Path, processes: Processes) -> None:
    processes.worker(args=("--concurrency", "4"))
    manager = processes.manager(env={"TRIALSTREAM_EXPERIMENTS_DIR": str(tmp_path / "manager-experiments")})
    gate = tmp_path / "gate"
    config = client_code(tmp_path / "client", gated_trial(gate), maxTrialNumber=1, trialConcurrency=1)
    run, experiment_id = following_run(manager, config, tmp_path / "run.err", env={"TRIALSTREAM_MANAGER_WAIT_S": "2"})
    try:
        processes.running[-1].kill()
        started = time.monotonic()
        out, _ = run.communicate(timeout=60)
        waited = time.monotonic() - started
    finally:
        gate.touch()
        run.kill()
    err = (tmp_path / "run.err").read_text()
    assert run.returncode == 1, err
    assert waited < 20, waited
    assert out == "" and "Traceback" not in err
    assert f"the manager at {manager} does not answer" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("trialstream: error: ") and "has not answered for 2 s" in last, err
    assert f"experiment {experiment_id} may still be running" in last
    assert f"trialstream --manager {manager} events {experiment_id} --follow" in last
