"""An embedded run keeps its services running: a worker process that dies (the OOM killer) is reaped and
started again, so the run goes on to DONE rather than waiting for ever on a queue nothing serves; one that
cannot start at all is given up on after a few quick exits, and the run ends with the reason."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from core.settings import Settings
from manager import stack
from manager.stack import QUICK_EXITS, ServiceProcesses, StackError
from tests.cli.test_interrupt import embedded_run, environment, processes_of, running_trials
from tests.conftest import REPO, wait_until
from tests.support.configs import write_local_config

SLEEPS = """
import time
time.sleep(3)
"""


def children(pid: int) -> list[tuple[int, str, str]]:
    """(pid, state, command line) of every child process of `pid`; state Z: a zombie not yet reaped."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone
            continue
        state, parent = stat[stat.rindex(")") + 2 :].split()[:2]
        if int(parent) == pid:
            found.append((int(entry.name), state, cmdline))
    return found


def workers_of(pid: int) -> list[int]:
    return [child for child, state, cmdline in children(pid) if state != "Z" and " -m workers " in cmdline]


def ended_cleanly(run: subprocess.Popen[bytes], tmp_path: Path) -> str:
    """The run's stderr, once it has exited 0 with no traceback."""
    assert run.wait(90) == 0, (tmp_path / "run.err").read_text()
    stderr = (tmp_path / "run.err").read_text()
    assert "Traceback" not in stderr, stderr
    return stderr


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "manager.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )


def test_a_run_whose_workers_are_all_killed_starts_them_again_and_finishes(tmp_path: Path) -> None:
    config = write_local_config(tmp_path, SLEEPS, trialConcurrency=2, maxTrialNumber=4)
    env = {**environment(tmp_path), "TRIALSTREAM_TRIAL_LEASE_S": "1"}  # the killed trials are lost within seconds
    with embedded_run(tmp_path, config, env) as run:
        wait_until(lambda: running_trials(tmp_path / "experiments"), 60, 0.1, what="two trials RUNNING")
        killed = workers_of(run.pid)
        assert len(killed) == 3, children(run.pid)  # one per concurrent trial, and the spare
        for pid in killed:
            os.kill(pid, signal.SIGKILL)

        def replaced() -> bool:
            current = children(run.pid)
            zombies = [child for child in current if child[1] == "Z"]
            return not zombies and len(set(workers_of(run.pid)) - set(killed)) == 3

        wait_until(replaced, 30, 0.1, what="the killed workers reaped and started again")
        stderr = ended_cleanly(run, tmp_path)
    for index in range(3):
        assert f"embedded worker-{index} (pid " in stderr and "was killed by SIGKILL; starting it again" in stderr
    result = json.loads((tmp_path / "run.out").read_text())
    statuses = sorted(trial["status"] for trial in result["trials"])
    assert len(statuses) == 4 and set(statuses) <= {"SUCCEEDED", "FAILED"}, statuses
    assert statuses.count("FAILED") == 2, statuses  # the two the killed workers held: lost, as designed
    experiment_id = result["experimentId"]
    finished = cli(env, "events", experiment_id, "--type", "ExperimentFinished", "--json")
    assert finished.returncode == 0, finished.stderr
    assert [json.loads(line)["event"]["status"] for line in finished.stdout.splitlines()] == ["DONE"]
    wait_until(lambda: not processes_of(tmp_path), 20, 0.2, what="no redis-server, worker or trial left")


REPORTS = """
import time
import nni
nni.get_next_parameter()
for step in range(4):
    time.sleep(0.3)
    nni.report_intermediate_result(step)
nni.report_final_result(1.0)
"""


def test_a_run_whose_redis_server_is_killed_starts_it_again_and_loses_nothing(tmp_path: Path) -> None:
    """The embedded Redis (its AOF fsynced on every write) is started again on its data and socket: every
    client waits for it, the trials running meanwhile go on, and no event is lost or written twice."""
    config = write_local_config(tmp_path, REPORTS)
    env = environment(tmp_path)
    with embedded_run(tmp_path, config, env) as run:
        wait_until(lambda: running_trials(tmp_path / "experiments"), 60, 0.1, what="two trials RUNNING")
        servers = [pid for pid, state, cmdline in children(run.pid) if state != "Z" and "redis-server" in cmdline]
        assert len(servers) == 1, children(run.pid)
        os.kill(servers[0], signal.SIGKILL)
        stderr = ended_cleanly(run, tmp_path)
    assert f"embedded redis-server (pid {servers[0]}) was killed by SIGKILL; starting it again" in stderr, stderr
    result = json.loads((tmp_path / "run.out").read_text())
    assert [trial["status"] for trial in result["trials"]] == ["SUCCEEDED"] * 4
    metrics = cli(env, "events", result["experimentId"], "--type", "TrialMetricReported", "--json")
    assert metrics.returncode == 0, metrics.stderr
    reported = Counter(json.loads(line)["event"]["trialId"] for line in metrics.stdout.splitlines())
    assert sorted(reported.values()) == [5] * 4, reported  # four intermediate and the final, each once
    check = cli(env, "replay", result["experimentId"], "--check")
    assert check.returncode == 0, check.stdout + check.stderr
    wait_until(lambda: not processes_of(tmp_path), 20, 0.2, what="no redis-server, worker or trial left")


def test_a_service_that_exits_at_once_on_every_start_is_given_up_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stack, "RESTART_BACKOFF_S", 0.05)  # the rule, not its production pace
    services = ServiceProcesses(Settings(), tmp_path / "logs")
    services.start(log_name="broken", module="no_such_module")  # python -m no_such_module: exit status 1
    services.supervise()
    try:
        with pytest.raises(StackError, match=rf"embedded broken exited with status 1, the {QUICK_EXITS}th time"):
            wait_until(lambda: services.check(), 30, 0.05, what="never: check raises")
        assert [process.poll() for process in services.processes] == [1]  # reaped, not started again
    finally:
        services.stop()
    log = (tmp_path / "logs" / "broken.log").read_text()
    assert log.count("No module named no_such_module") == QUICK_EXITS
