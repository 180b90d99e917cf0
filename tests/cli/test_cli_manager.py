"""`trialstream --manager URL ...` end to end: a real manager and worker on a real Redis, and the CLI as a
subprocess whose environment names no Redis at all. What it prints is compared with what the same
commands print reading Redis itself: one rendering, whichever way the data comes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from simulators.waiting import wait_until
from tests.conftest import REPO, Processes, free_port
from tests.support import web

TRIAL = """
import os
import sys
sys.stdout.write(f"trial in {os.getcwd()}\\n")  # before the SDK, which sends stdout to trial.log as NNI's does
sys.stdout.flush()
import trialstream_sdk as nni
x = nni.get_next_parameter()["x"]
nni.report_intermediate_result(x / 2)
nni.report_final_result(x * 10)
"""
SLOW_TRIAL = "import time\ntime.sleep(120)\n"
pytestmark = pytest.mark.xdist_group("cli-manager")  # the tests of managed_run read one run, in file order


def trialstream(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The CLI with none of trialstream's settings in its environment but those given."""
    clean = {name: value for name, value in os.environ.items() if not name.startswith("TRIALSTREAM_")}
    return subprocess.run(
        [sys.executable, "-m", "manager.cli", *args],
        cwd=REPO,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def client_code(directory: Path, trial: str, **overrides: object) -> Path:
    """A code directory on the client's side only, with an ignored file and a search space file."""
    directory.mkdir()
    (directory / "trial.py").write_text(textwrap.dedent(trial))
    (directory / ".nniignore").write_text("secret.txt\n")
    (directory / "secret.txt").write_text("not to be uploaded")
    (directory / "space.json").write_text(json.dumps({"x": {"_type": "choice", "_value": [1, 2, 3, 4]}}))
    config = {
        "trialCommand": f"{sys.executable} trial.py",
        "trialCodeDirectory": ".",
        "trialConcurrency": 2,
        "maxTrialNumber": 4,
        "searchSpaceFile": "space.json",
        "tuner": {"name": "Random", "classArgs": {"seed": 1}},
        "trainingService": {"platform": "local"},
        **overrides,
    }
    path = directory / "config.yml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


@pytest.fixture
def manager_dir(tmp_path: Path) -> Path:
    return tmp_path / "manager-experiments"


@pytest.fixture
def manager(processes: Processes, manager_dir: Path) -> str:
    """A manager (its own projector) and a local worker following up to 4 trials."""
    processes.worker(args=("--concurrency", "4"))
    return processes.manager(env={"TRIALSTREAM_EXPERIMENTS_DIR": str(manager_dir)})


@dataclass(frozen=True)
class ManagedRun:
    """An experiment run to its end with `trialstream --manager URL run`, on a manager the module shares."""

    manager: str
    redis_url: str
    result: subprocess.CompletedProcess
    uploads: list[Path]

    @property
    def run(self) -> dict[str, Any]:
        return dict(json.loads(self.result.stdout))

    def via_manager(self, *args: str) -> subprocess.CompletedProcess:
        return trialstream("--manager", self.manager, *args)

    def via_redis(self, *args: str) -> subprocess.CompletedProcess:
        return trialstream("--redis", self.redis_url, *args)


@pytest.fixture(scope="module")
def managed_run(module_processes: Processes, tmp_path_factory: pytest.TempPathFactory) -> ManagedRun:
    root = tmp_path_factory.mktemp("managed-run")
    module_processes.worker(args=("--concurrency", "4"))
    url = module_processes.manager(env={"TRIALSTREAM_EXPERIMENTS_DIR": str(root / "manager-experiments")})
    result = trialstream("--manager", url, "run", str(client_code(root / "client", TRIAL)), "--json")
    assert result.returncode == 0, result.stderr + module_processes.logs()
    uploads = list((root / "manager-experiments" / "code").iterdir())
    return ManagedRun(url, module_processes.redis_url, result, uploads)


def test_run_through_the_manager_uploads_the_code_and_runs_it(managed_run: ManagedRun) -> None:
    run = managed_run.run
    assert set(run) == {"experimentId", "trials"}
    trials = run["trials"]
    assert [trial["sequenceId"] for trial in trials] == [0, 1, 2, 3]
    for trial in trials:
        assert set(trial) == {"id", "status", "finalMetric", "sequenceId", "hyperParameters"}
        assert trial["status"] == "SUCCEEDED"
        assert trial["finalMetric"] == trial["hyperParameters"]["x"] * 10
    assert "running" in managed_run.result.stderr and "best" in managed_run.result.stderr  # the live progress table

    [upload] = managed_run.uploads  # one upload, without the .nniignore'd file
    assert {path.name for path in upload.iterdir()} == {"trial.py", ".nniignore", "space.json", "config.yml"}
    logs = managed_run.via_manager("trials", "logs", trials[0]["id"])
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout == f"trial in {upload}\n"  # it ran the uploaded code


READS = [
    ("trials", "list", "--json"),
    ("trials", "list", "--sort", "metric", "--json"),
    ("trials", "show", "{first}", "--history", "--json"),
    ("events", "{experiment}", "--json"),
    ("events", "--trial", "{first}", "--type", "TrialStarted,TrialEnded", "--json"),
    ("trials", "show", "{first}"),
    ("events", "{experiment}"),
]


@pytest.mark.parametrize("command", READS, ids=" ".join)
def test_a_read_through_the_manager_prints_what_it_prints_from_redis(
    managed_run: ManagedRun, command: tuple[str, ...]
) -> None:
    names = {"experiment": managed_run.run["experimentId"], "first": managed_run.run["trials"][0]["id"]}
    args = [part.format(**names) for part in command]
    managed, direct = managed_run.via_manager(*args), managed_run.via_redis(*args)
    assert managed.returncode == 0, managed.stderr
    assert managed.stdout == direct.stdout


def test_experiments_list_and_delete_through_the_manager(managed_run: ManagedRun) -> None:
    """Last in the module: it deletes the experiment the others read."""
    experiment_id = managed_run.run["experimentId"]
    listed = managed_run.via_manager("experiments", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    [summary] = json.loads(listed.stdout)
    assert summary["id"] == experiment_id and summary["status"] == "DONE"
    assert summary["trialCounts"] == {"SUCCEEDED": 4}
    [direct_summary] = json.loads(managed_run.via_redis("experiments", "list", "--json").stdout)
    assert {**summary, "directory": None} == {**direct_summary, "directory": None}  # the API does not say where

    needs_redis = managed_run.via_manager("replay", experiment_id, "--check")
    assert needs_redis.returncode == 1 and "use --redis URL" in needs_redis.stderr
    deleted = managed_run.via_manager("experiments", "delete", experiment_id, "--yes")
    assert deleted.returncode == 0, deleted.stderr
    assert json.loads(managed_run.via_manager("experiments", "list", "--json").stdout) == []


def test_cancel_and_interrupt_through_the_manager(tmp_path: Path, processes: Processes, manager: str) -> None:
    config = client_code(tmp_path / "client", SLOW_TRIAL, maxTrialNumber=1, trialConcurrency=1)

    def started_run() -> tuple[subprocess.Popen[str], str, str]:
        """`run` following an experiment whose one trial is running."""
        known = {state["id"] for state in web.get(f"{manager}/api/v1/experiments").json()}  # before it starts
        clean = {name: value for name, value in os.environ.items() if not name.startswith("TRIALSTREAM_")}
        process = subprocess.Popen(
            [sys.executable, "-m", "manager.cli", "--manager", manager, "run", str(config), "--json"],
            cwd=REPO,
            env=clean,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

        def running_trial() -> tuple[str, str] | None:
            for state in web.get(f"{manager}/api/v1/experiments").json():
                if state["id"] not in known:
                    page = web.get(f"{manager}/api/v1/experiments/{state['id']}/trials").json()
                    running = [trial["id"] for trial in page["items"] if trial["status"] == "RUNNING"]
                    return (state["id"], running[0]) if running else None
            return None

        experiment_id, trial_id = wait_until(running_trial, 60, what="the trial to run")
        return process, experiment_id, trial_id

    run, experiment_id, trial_id = started_run()
    followed = tmp_path / "followed.jsonl"
    with followed.open("w") as sink:
        follower = subprocess.Popen(
            [sys.executable, "-m", "manager.cli", "--manager", manager, "events", experiment_id, "--follow", "--json"],
            cwd=REPO,
            env={name: value for name, value in os.environ.items() if not name.startswith("TRIALSTREAM_")},
            stdout=sink,
        )
    try:
        wait_until(lambda: '"TrialStarted"' in followed.read_text(), 30, what="the history, followed")
        for wrong in ("../stop?x=", "nope?x=", "nope%2F..%2Fstop"):  # an id never reaches another route
            refused = trialstream("--manager", manager, "trials", "cancel", wrong, "-e", experiment_id)
            assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
            assert f"{wrong!r} is no experiment or trial id" in refused.stderr or "not found" in refused.stderr
        assert web.get(f"{manager}/api/v1/experiments/{experiment_id}").json()["status"] == "RUNNING"
        canceled = trialstream("--manager", manager, "trials", "cancel", trial_id, "-e", experiment_id)
        assert canceled.returncode == 0, canceled.stderr
        assert canceled.stdout.startswith(f"cancel requested for trial {trial_id}")
        out, err = run.communicate(timeout=60)
        wait_until(lambda: '"ExperimentFinished"' in followed.read_text(), 30, what="new events, followed")
        follower.send_signal(signal.SIGINT)
        assert follower.wait(30) == 0
    finally:
        run.kill()
        follower.kill()
    assert run.returncode == 0, err
    assert [trial["status"] for trial in json.loads(out)["trials"]] == ["USER_CANCELED"]
    types = [json.loads(line)["event"]["type"] for line in followed.read_text().splitlines()]
    assert types.count("TrialStarted") == 1 and types.count("TrialCancelRequested") == 1  # no gap, no repeat

    run, experiment_id, trial_id = started_run()
    try:
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 130, err
    assert f"stopping experiment {experiment_id}" in err and f"resume {experiment_id}" in err
    assert "Traceback" not in err
    assert web.get(f"{manager}/api/v1/experiments/{experiment_id}").json()["status"] == "STOPPED"
    trial = web.get(f"{manager}/api/v1/experiments/{experiment_id}/trials/{trial_id}").json()
    assert trial["status"] == "SYS_CANCELED"


def test_following_a_managed_experiment_asks_nothing_before_it_can_stop_it() -> None:
    """The experiment runs on the manager once created; a request before `run` (where an interrupt becomes
    the experiment's stop) would be a window where Ctrl-C leaves it running: none is made."""
    from manager.api_client import ManagerClient, ManagerError
    from manager.cli.managed import ManagedRun

    followed = ManagedRun(ManagerClient(f"http://127.0.0.1:{free_port()}", None), "abc12345", lambda _: None, 0)
    with pytest.raises(ManagerError, match=r"127\.0\.0\.1"):  # nothing answers there: the first request is run's
        followed.run()


def test_errors_through_the_manager_are_one_line(tmp_path: Path, processes: Processes, manager_dir: Path) -> None:
    url = processes.manager(
        env={"TRIALSTREAM_MANAGER_TOKEN": "the-token", "TRIALSTREAM_EXPERIMENTS_DIR": str(manager_dir)}
    )
    config = client_code(tmp_path / "client", TRIAL)

    def fails(*args: str, token: str | None = None, manager: str = url, status: int = 1) -> str:
        result = trialstream(*args, env={"TRIALSTREAM_MANAGER_URL": manager, "TRIALSTREAM_MANAGER_TOKEN": token or ""})
        assert result.returncode == status, result.stderr
        assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
        return result.stderr

    assert "requires a token: set TRIALSTREAM_MANAGER_TOKEN" in fails("experiments", "list")
    assert "refused the token in TRIALSTREAM_MANAGER_TOKEN" in fails("trials", "list", token="wrong")
    assert "experiment 'nope' not found" in fails("trials", "list", "-e", "nope", token="the-token")
    nowhere = f"http://127.0.0.1:{free_port()}"
    assert f"cannot reach the manager at {nowhere}" in fails("experiments", "list", manager=nowhere)
    assert "with no JSON (text/html" in fails("experiments", "list", manager=f"{url}/nope", token="the-token")

    config.write_text(config.read_text().replace("trialConcurrency", "trialConcurency"))
    local = trialstream("run", str(config), timeout=30)
    managed = trialstream("run", str(config), env={"TRIALSTREAM_MANAGER_URL": url, "TRIALSTREAM_MANAGER_TOKEN": "x"})
    assert managed.returncode == local.returncode == 2
    assert "trialConcurency: unknown key" in managed.stderr and managed.stderr == local.stderr  # every key's line
    assert not (manager_dir / "code").exists()  # checked before anything was sent

    listed = trialstream(
        "experiments", "list", "--json", env={"TRIALSTREAM_MANAGER_URL": url, "TRIALSTREAM_MANAGER_TOKEN": "the-token"}
    )
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stderr


def test_a_run_that_fails_before_its_first_progress_prints_the_error_alone(tmp_path: Path) -> None:
    """No manager answers, so `run` fails inside its live display before that drew anything: with stderr not a
    terminal, the error is its only line, with no blank one from the display."""
    nowhere = f"http://127.0.0.1:{free_port()}"
    result = trialstream("--manager", nowhere, "run", str(client_code(tmp_path / "client", TRIAL)), timeout=30)
    assert result.returncode == 1
    refused = f"cannot reach the manager at {nowhere}: [Errno 111] Connection refused"
    assert result.stderr == f"trialstream: error: {refused}\n"


def running_experiment(manager: str) -> str | None:
    """The id of an experiment of the manager at `manager` with a RUNNING trial, as its API lists them."""
    for state in web.get(f"{manager}/api/v1/experiments").json():
        page = web.get(f"{manager}/api/v1/experiments/{state['id']}/trials").json()
        if any(trial["status"] == "RUNNING" for trial in page["items"]):
            return str(state["id"])
    return None


def test_resume_through_the_manager_continues_a_stopped_experiment(
    tmp_path: Path, processes: Processes, manager: str
) -> None:
    """`resume` against a manager: the manager runs the rest of an interrupted experiment from its log, and
    the command follows it to its end as `run` does; its unknown-experiment error is one line."""
    gate = tmp_path / "gate"
    gated = f"import pathlib, time\nwhile not pathlib.Path({str(gate)!r}).exists():\n    time.sleep(0.05)\n{TRIAL}"
    config = client_code(tmp_path / "client", gated, maxTrialNumber=2, trialConcurrency=1)
    clean = {name: value for name, value in os.environ.items() if not name.startswith("TRIALSTREAM_")}
    run = subprocess.Popen(
        [sys.executable, "-m", "manager.cli", "--manager", manager, "run", str(config)],
        cwd=REPO,
        env=clean,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        experiment_id = wait_until(lambda: running_experiment(manager), 60, what="the first trial to run")
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 130, err
    assert web.get(f"{manager}/api/v1/experiments/{experiment_id}").json()["status"] == "STOPPED"

    gate.touch()
    resumed = trialstream("--manager", manager, "resume", experiment_id, "--json")
    assert resumed.returncode == 0, resumed.stderr
    result = json.loads(resumed.stdout)
    assert result["experimentId"] == experiment_id
    statuses = sorted(trial["status"] for trial in result["trials"])
    assert statuses == ["SUCCEEDED", "SYS_CANCELED"]  # the canceled one kept, the rest of the budget run
    assert web.get(f"{manager}/api/v1/experiments/{experiment_id}").json()["status"] == "DONE"

    unknown = trialstream("--manager", manager, "resume", "nosuchxp")
    assert unknown.returncode == 1 and len(unknown.stderr.strip().splitlines()) == 1, unknown.stderr
    assert "nosuchxp" in unknown.stderr
