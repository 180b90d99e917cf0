"""`trialstream --manager URL run`, `events --follow` and `trials logs --follow` while the manager is away: a
pause longer than uvicorn's keep-alive (5 s), after which it may reset the connection the CLI's poll waits on, and
a restart (for `events --follow`, one under way as it starts too) are ridden out; a manager gone for good ends the
command within TRIALSTREAM_MANAGER_WAIT_S, saying how to take it up again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from manager.api_client import PAGE
from manager.training_service import TrainingService
from schemas.events import ClusterMetadataSet
from simulators.waiting import wait_until
from tests.cli.test_cli_manager import TRIAL, client_code, running_experiment
from tests.conftest import REPO, Processes, ServiceFactory, form, free_port, stream_entries, wait_for_status
from tests.support import web
from tests.support.http_outage import HttpOutage

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

    return run, wait_until(lambda: running_experiment(manager), 60, what="a trial to run")


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
    err = followed_to_its_end(run, out, experiment_id, tmp_path / "run.err", processes)
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
        kill_noticed(processes, manager, tmp_path / "run.err")
        restart(processes, manager, env)
        gate.touch()
        out, _ = run.communicate(timeout=120)
    finally:
        gate.touch()
        run.kill()
    err = followed_to_its_end(run, out, experiment_id, tmp_path / "run.err", processes)
    assert err.count(f"the manager at {manager} does not answer") == 1 and "answers again" in err, err


def followed_to_its_end(
    run: subprocess.Popen[str], out: str, experiment_id: str, stderr: Path, processes: Processes
) -> str:
    """The command's stderr, once it has exited 0 with its experiment's two trials SUCCEEDED and no traceback."""
    err = stderr.read_text()
    assert run.returncode == 0, err + processes.logs()
    result = json.loads(out)
    assert result["experimentId"] == experiment_id
    assert [trial["status"] for trial in result["trials"]] == ["SUCCEEDED", "SUCCEEDED"]
    assert "Traceback" not in err
    return err


def kill_noticed(processes: Processes, manager: str, stderr: Path) -> None:
    """Kill the newest process (the manager at `manager`), then wait for the command writing `stderr` to say
    that it does not answer."""
    processes.running[-1].kill()
    processes.running[-1].wait()
    noticed = f"the manager at {manager} does not answer"
    wait_until(lambda: noticed in stderr.read_text(), 30, what="the command to notice")


def restart(processes: Processes, manager: str, env: dict[str, str] | None = None) -> None:
    """A new manager on the port of `manager`, once it answers."""
    processes.start("manager", "--port", manager.rsplit(":", 1)[1], "--no-token", env=env)
    wait_until(lambda: answers(manager), 30, what="the new manager to answer")


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


def following(
    manager: str, command: tuple[str, ...], directory: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """`command` (one that follows) through the manager, its stdout and stderr into files of `directory` (read
    while it runs)."""
    printed, stderr = directory / "followed.out", directory / "follow.err"
    clean = {name: value for name, value in os.environ.items() if not name.startswith("TRIALSTREAM_")}
    with printed.open("w") as out, stderr.open("w") as err:
        follower = subprocess.Popen(
            [sys.executable, "-m", "manager.cli", "--manager", manager, *command],
            cwd=REPO,
            env={**clean, **(env or {})},
            stdout=out,
            stderr=err,
        )
    return follower, printed, stderr


def following_events(
    manager: str, experiment_id: str, directory: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """`events EXP --follow --json` through the manager."""
    return following(manager, ("events", experiment_id, "--follow", "--json"), directory, env)


def printed_ids(printed: Path) -> list[str]:
    """The ids of the entries printed so far (whole lines only)."""
    lines = printed.read_text().splitlines(keepends=True)
    return [json.loads(line)["id"] for line in lines if line.endswith("\n")]


def printed_whole_log(printed: Path, service: TrainingService) -> bool:
    """Whether the ids printed are those of the experiment's log, each once, in its order."""
    return printed_ids(printed) == [
        entry_id for entry_id, _ in stream_entries(service.store.client, service.store.stream)
    ]


def test_events_follow_goes_on_from_its_last_event_across_a_manager_restart(
    tmp_path: Path, processes: Processes, make_service: ServiceFactory
) -> None:
    """Events appended before, during and after the outage are each printed once, in log order: the follow
    asks again from the last entry it got."""
    service = make_service()
    manager = processes.manager()
    follower, printed, stderr = following_events(manager, service.experiment_id, tmp_path)

    try:
        service.set_cluster_metadata("note", "before the outage")
        wait_until(lambda: printed_whole_log(printed, service), 30, what="the history and a new event, followed")
        kill_noticed(processes, manager, stderr)
        service.set_cluster_metadata("note", "during the outage")
        restart(processes, manager)
        service.set_cluster_metadata("note", "after the outage")
        wait_until(lambda: printed_whole_log(printed, service), 30, what="every event, followed once")
        follower.send_signal(signal.SIGINT)
        assert follower.wait(30) == 0, stderr.read_text()
    finally:
        follower.kill()
    notes = [json.loads(line)["event"].get("value") for line in printed.read_text().splitlines()]
    assert notes[-3:] == ["before the outage", "during the outage", "after the outage"]
    _noted_once_each_way(stderr, manager)


def test_events_follow_gives_up_on_a_manager_gone_for_good(
    tmp_path: Path, processes: Processes, make_service: ServiceFactory
) -> None:
    service = make_service()
    manager = processes.manager()
    last = stream_entries(service.store.client, service.store.stream)[-1][0]
    follower, printed, stderr = following_events(
        manager, service.experiment_id, tmp_path, env={"TRIALSTREAM_MANAGER_WAIT_S": "2"}
    )
    wait_until(lambda: last in printed_ids(printed), 30, what="the history, followed")
    said = _gives_up_once_the_manager_is_gone(processes, follower, stderr, manager)
    assert f"is {last}: " in said  # --since is inclusive: the command named starts just after the last one read
    milliseconds, sequence = last.split("-")
    next_id = f"{milliseconds}-{int(sequence) + 1}"
    assert f"trialstream --manager {manager} events {service.experiment_id} --follow --since {next_id}`" in said


def test_events_follow_waits_for_a_manager_down_as_it_starts(
    tmp_path: Path, processes: Processes, make_service: ServiceFactory
) -> None:
    """The manager restarting as the command starts: it waits (printing nothing), then prints the history and
    follows on, each event once, in log order."""
    service = make_service()
    manager = processes.manager()
    processes.running[-1].kill()
    processes.running[-1].wait()
    follower, printed, stderr = following_events(manager, service.experiment_id, tmp_path)

    def waiting() -> bool:
        assert follower.poll() is None, stderr.read_text()
        return f"the manager at {manager} does not answer" in stderr.read_text()

    try:
        wait_until(waiting, 30, what="the command to wait for the manager")
        assert printed.read_text() == ""
        restart(processes, manager)
        _follows_on_then_ends_on_ctrl_c(follower, stderr, printed, service, "after the wait")
    finally:
        follower.kill()
    assert json.loads(printed.read_text().splitlines()[-1])["event"].get("value") == "after the wait"
    _noted_once_each_way(stderr, manager)


def test_events_follow_rides_out_a_manager_lost_between_two_pages_of_its_history(
    tmp_path: Path, processes: Processes, make_service: ServiceFactory
) -> None:
    """The history is read a page at a time: lost after the first page, the follow asks for the next one again once
    the manager answers, and prints each event once, in log order."""
    service = make_service()
    notes = [ClusterMetadataSet(experiment_id=service.experiment_id, key="note", value=str(n)) for n in range(PAGE)]
    service.store.append_all(notes, [None] * len(notes))
    logged = [entry_id for entry_id, _ in stream_entries(service.store.client, service.store.stream)]
    assert len(logged) > PAGE
    manager = processes.manager()
    outage = HttpOutage(int(manager.rsplit(":", 1)[1]), f"after={logged[PAGE - 1]}&".encode())  # the second page
    follower, printed, stderr = following_events(outage.url, service.experiment_id, tmp_path)

    try:
        wait_until(lambda: f"the manager at {outage.url} does not answer" in stderr.read_text(), 30, what="the outage")
        assert outage.tripped and follower.poll() is None
        outage.up()
        _follows_on_then_ends_on_ctrl_c(follower, stderr, printed, service, "after the outage")
    finally:
        follower.kill()
        outage.close()
    _noted_once_each_way(stderr, outage.url)


def test_events_follow_gives_up_on_a_manager_that_never_answered(tmp_path: Path, make_service: ServiceFactory) -> None:
    """Nothing was printed, so the way on is the same command, once the manager answers."""
    service = make_service()
    manager = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    follower, printed, stderr = following_events(
        manager, service.experiment_id, tmp_path, env={"TRIALSTREAM_MANAGER_WAIT_S": "2"}
    )
    try:
        follower.wait(60)
        waited = time.monotonic() - started
    finally:
        follower.kill()
    err = stderr.read_text()
    assert follower.returncode == 1, err
    assert 2 <= waited < 20, waited
    assert printed.read_text() == "" and "Traceback" not in err
    noted, said = err.splitlines()
    assert noted.startswith(f"the manager at {manager} does not answer"), err
    assert said.startswith("trialstream: error: ") and "has not answered for 2 s" in said, err
    assert "; nothing was printed yet: the same command prints it all once the manager answers" in said, err


COUNTING_TRIAL = """
import pathlib, sys, time

gate = pathlib.Path(sys.argv[1])
line = 0
while not gate.exists():
    print(f"line {line}", flush=True)
    line += 1
    time.sleep(0.05)
print("the end", flush=True)
"""


@dataclass
class PrintingTrial:
    """A running trial that prints a numbered line every 50 ms until `gate` exists, then `the end`."""

    manager: str
    experiment_id: str
    trial_id: str
    gate: Path
    stdout: Path  # what it wrote, as its platform keeps it

    def logs_follow(
        self, directory: Path, env: dict[str, str] | None = None
    ) -> tuple[subprocess.Popen[bytes], Path, Path]:
        """`trials logs TRIAL --follow` through the manager."""
        return following(
            self.manager, ("trials", "logs", self.trial_id, "-e", self.experiment_id, "--follow"), directory, env
        )


@pytest.fixture
def printing_trial(
    processes: Processes, make_service: ServiceFactory, code_dir: Path, tmp_path: Path
) -> Iterator[PrintingTrial]:
    """A worker, then a manager (the newest process), and a PrintingTrial running there; ended at teardown."""
    processes.worker()
    manager = processes.manager()
    (code_dir / "trial.py").write_text(COUNTING_TRIAL)
    gate = tmp_path / "gate"
    service = make_service(f"{sys.executable} trial.py {gate}")
    trial_id = service.submit_trial_job(form(0)).id
    trial = wait_for_status(service, trial_id, "RUNNING")
    yield PrintingTrial(manager, service.experiment_id, trial_id, gate, Path(trial.url or "") / "stdout")
    gate.touch()  # the worker stops promptly at teardown


def test_trials_logs_follow_goes_on_from_the_byte_it_printed_across_a_manager_restart(
    tmp_path: Path, processes: Processes, printing_trial: PrintingTrial
) -> None:
    """The lines written before, during and after the outage are each printed once, in order: the follow asks
    again from the byte it had printed up to."""
    trial = printing_trial
    follower, printed, stderr = trial.logs_follow(tmp_path)
    try:
        wait_until(lambda: b"line 3\n" in printed.read_bytes(), 30, what="the first lines, followed")
        kill_noticed(processes, trial.manager, stderr)
        away = len(printed.read_bytes())
        wait_until(lambda: trial.stdout.stat().st_size > away, 30, what="a line written while the manager is away")
        restart(processes, trial.manager)
        back = trial.stdout.stat().st_size
        wait_until(lambda: len(printed.read_bytes()) > back, 30, what="a line written since, followed")
        trial.gate.touch()
        assert follower.wait(30) == 0, stderr.read_text()
    finally:
        follower.kill()
    output = printed.read_bytes()
    assert output == trial.stdout.read_bytes()
    lines = output.decode().splitlines()
    assert lines == [f"line {number}" for number in range(len(lines) - 1)] + ["the end"]
    _noted_once_each_way(stderr, trial.manager)


def test_trials_logs_follow_gives_up_saying_what_it_printed(
    tmp_path: Path, processes: Processes, printing_trial: PrintingTrial
) -> None:
    trial = printing_trial
    follower, printed, stderr = trial.logs_follow(tmp_path, env={"TRIALSTREAM_MANAGER_WAIT_S": "2"})
    wait_until(lambda: b"line 3\n" in printed.read_bytes(), 30, what="the first lines, followed")
    said = _gives_up_once_the_manager_is_gone(processes, follower, stderr, trial.manager)
    output = printed.read_bytes()
    assert output == trial.stdout.read_bytes()[: len(output)]
    logs = f"trialstream --manager {trial.manager} trials logs {trial.trial_id} -e {trial.experiment_id} --follow"
    printed_up_to = f"this command printed trial {trial.trial_id}'s stdout up to byte {len(output)}: `{logs}`"
    assert printed_up_to in said, stderr.read_text()


@pytest.mark.parametrize("command", [("events", "exp", "--follow"), ("trials", "logs", "trial", "-e", "exp", "-f")])
def test_ctrl_c_stops_a_follow_waiting_for_the_manager_quietly(tmp_path: Path, command: tuple[str, ...]) -> None:
    """^C is how a follow is stopped, whatever it is doing: 0 and nothing more said, as when it follows."""
    manager = f"http://127.0.0.1:{free_port()}"
    follower, printed, stderr = following(manager, command, tmp_path)

    def waiting() -> bool:
        assert follower.poll() is None, stderr.read_text()
        return f"the manager at {manager} does not answer" in stderr.read_text()

    try:
        wait_until(waiting, 30, what="the command to wait for the manager")
        follower.send_signal(signal.SIGINT)
        assert follower.wait(30) == 0, stderr.read_text()
    finally:
        follower.kill()
    assert printed.read_text() == ""
    assert len(stderr.read_text().splitlines()) == 1, stderr.read_text()  # the note that it waits, alone


def _gives_up_once_the_manager_is_gone(
    processes: Processes, follower: subprocess.Popen[bytes], stderr: Path, manager: str
) -> str:
    """Kill the manager a follow (started with TRIALSTREAM_MANAGER_WAIT_S=2) reads from: it waits, gives up with 1
    within a few seconds, having said so, and its last line is the error; that line."""
    try:
        processes.running[-1].kill()
        started = time.monotonic()
        follower.wait(60)
        waited = time.monotonic() - started
    finally:
        follower.kill()
    err = stderr.read_text()
    assert follower.returncode == 1, err
    assert waited < 20, waited
    assert "Traceback" not in err and f"the manager at {manager} does not answer" in err
    said = err.strip().splitlines()[-1]
    assert said.startswith("trialstream: error: ") and "has not answered for 2 s" in said, err
    return said


def _follows_on_then_ends_on_ctrl_c(
    follower: subprocess.Popen[bytes], stderr: Path, printed: Path, service: TrainingService, note: str
) -> None:
    """Once the manager answers, the follow prints the whole log, then a new event (`note`), and ^C ends it with 0."""
    wait_until(lambda: printed_whole_log(printed, service), 30, what="the whole log, once the manager answers")
    service.set_cluster_metadata("note", note)
    wait_until(lambda: printed_whole_log(printed, service), 30, what="a new event, followed")
    follower.send_signal(signal.SIGINT)
    assert follower.wait(30) == 0, stderr.read_text()


def _noted_once_each_way(stderr: Path, manager: str) -> None:
    """A follow that rode out one outage said so once as it began and once as it ended, with no traceback."""
    err = stderr.read_text()
    assert err.count(f"the manager at {manager} does not answer") == 1, err
    assert err.count(f"the manager at {manager} answers again") == 1, err
    assert "Traceback" not in err
