"""The real `nnictl` (from the `nni` package) against `trialstream manager --nnictl-registry`: it finds the
experiment in its registry and reads it through the experiment's own port, as it reads NNI's manager."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from bench.nnictl import nnictl_environment
from core.variables import PREFIX
from manager.api.app import MAX_BODY_BYTES
from simulators.waiting import wait_until
from tests.api.test_api import write_trial
from tests.api.test_api_smoke import experiment_config
from tests.conftest import Processes
from tests.support import web

needs_nnictl = pytest.mark.skipif(shutil.which("nnictl") is None, reason="nnictl comes with the nni extra")
TOKEN_ENV = f"{PREFIX}MANAGER_TOKEN"
TOKEN = "tok-5b0e77c2-nnictl"

# Each trial waits for its gate file, so the experiment is running while nnictl looks at it.
TRIAL = """
import os, pathlib, time, trialstream_sdk as nni
x = nni.get_next_parameter()["x"]
gate = pathlib.Path(os.environ["GATES"]) / os.environ["NNI_TRIAL_JOB_ID"]
while not gate.exists():
    time.sleep(0.05)
nni.report_final_result(x)
"""


def nnictl(home: Path, *args: str) -> str:
    environment = nnictl_environment(home / "scratch")
    environment["HOME"] = str(home)
    done = subprocess.run(
        [sys.executable, "-m", "nni.tools.nnictl.nnictl", *args],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"nnictl {' '.join(args)}: {done.stdout}\n{done.stderr}"
    return done.stdout


@needs_nnictl
def test_nnictl_lists_shows_exports_and_stops_an_experiment_the_manager_runs(
    tmp_path: Path, processes: Processes
) -> None:
    home, gates = tmp_path / "home", tmp_path / "gates"
    home.mkdir()
    gates.mkdir()
    (tmp_path / "trial.py").write_text(TRIAL)
    processes.worker(env={"GATES": str(gates)})
    url = processes.manager("--nnictl-registry", env={"HOME": str(home)})
    manager = processes.running[-1]
    config = {**experiment_config(tmp_path, trials=3), "experimentName": "nnictl-sees-me", "trialConcurrency": 1}
    experiment_id = web.post(f"{url}/api/v1/experiments", json={"config": config}).json()["id"]
    registry = home / "nni-experiments" / ".experiment"
    wait_until(lambda: registry.exists() and experiment_id in json.loads(registry.read_text()), 30, what="the entry")

    def trials() -> list[dict[str, object]]:
        return web.get(f"{url}/api/v1/experiments/{experiment_id}/trials").json()["items"]

    first = wait_until(lambda: [t for t in trials() if t["status"] == "RUNNING"], 30, what="a running trial")[0]
    (gates / str(first["id"])).touch()
    wait_until(lambda: any(t["status"] == "SUCCEEDED" for t in trials()), 30, what="a trial to succeed")

    listed = nnictl(home, "experiment", "list")
    assert experiment_id in listed and "nnictl-sees-me" in listed and "RUNNING" in listed
    shown = nnictl(home, "experiment", "show", experiment_id)
    assert json.loads(shown[shown.index("{") :])["id"] == experiment_id
    assert "RUNNING" in nnictl(home, "experiment", "status", experiment_id)
    listed_trials = nnictl(home, "trial", "ls", experiment_id)
    assert str(first["id"]) in listed_trials and "SUCCEEDED" in listed_trials
    exported = tmp_path / "export.json"
    nnictl(home, "experiment", "export", experiment_id, "--type", "json", "--filename", str(exported))
    rows = json.loads(exported.read_text())
    assert [row["trialJobId"] for row in rows] == [first["id"]]
    assert rows[0]["parameter"] == json.loads(str(first["form"]["hyperParameters"]["value"]))["parameters"]  # type: ignore[index]

    assert str(first["id"]) in nnictl_top(home)

    pid = json.loads(registry.read_text())[experiment_id]["pid"]
    assert pid != manager.pid and psutil.pid_exists(pid)  # the experiment's own process
    nnictl(home, "stop", experiment_id)  # SIGTERM to that process; nnictl waits until it is gone
    assert not psutil.pid_exists(pid)
    experiment = f"{url}/api/v1/experiments/{experiment_id}"
    wait_until(lambda: web.get(experiment).json()["status"] == "STOPPED", 30, what="the experiment, STOPPED")

    def stopped() -> bool:
        entry = json.loads(registry.read_text())[experiment_id]
        return bool(entry["status"] == "STOPPED" and isinstance(entry["endTime"], int))

    wait_until(stopped, 30, what="the entry, STOPPED with its end time")
    statuses = {str(t["status"]) for t in trials_from_redis(processes, experiment_id)}
    assert statuses <= {"SUCCEEDED", "SYS_CANCELED"} and "SYS_CANCELED" in statuses
    assert manager.poll() is None  # it stopped that experiment alone: the manager serves on


@needs_nnictl
def test_nnictl_reaches_a_manager_that_has_a_token(tmp_path: Path, processes: Processes) -> None:
    """nnictl sends no token: the experiment's own port (127.0.0.1 alone) asks for none; the main port still does."""
    home, code = tmp_path / "home", write_trial(tmp_path / "code")
    home.mkdir()
    processes.worker()
    url = processes.manager("--nnictl-registry", env={"HOME": str(home), TOKEN_ENV: TOKEN})  # on 127.0.0.1
    http = httpx.Client(base_url=f"{url}/api/v1", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    created = http.post("/experiments", json={"config": experiment_config(code, trials=1)})
    assert created.status_code == 201, created.text
    experiment_id = created.json()["id"]
    registry = home / "nni-experiments" / ".experiment"
    wait_until(lambda: registry.exists() and experiment_id in json.loads(registry.read_text()), 30, what="the entry")
    port = json.loads(registry.read_text())[experiment_id]["port"]

    def running() -> list[Any]:
        trials = http.get(f"/experiments/{experiment_id}/trials").json()["items"]
        return [trial["id"] for trial in trials if trial["status"] == "RUNNING"]

    trial_id = wait_until(running, 30, what="a running trial")[0]
    listed = nnictl(home, "trial", "ls", experiment_id)
    assert trial_id in listed and "RUNNING" in listed, listed

    own = f"http://127.0.0.1:{port}/api/v1/nni"
    assert web.get(f"{own}/check-status").status_code == 200
    over = web.put(
        f"{own}/experiment", content=b"x" * (MAX_BODY_BYTES + 1), headers={"content-type": "application/json"}
    )
    assert over.status_code == 413  # its body limit stays
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    for elsewhere in ("/api/v1/experiments", f"/api/v1/experiments/{experiment_id}/trials"):  # NNI's API alone
        assert web.get(f"http://127.0.0.1:{port}{elsewhere}", headers=bearer).status_code == 404, elsewhere
    metrics = web.get(f"http://127.0.0.1:{port}/metrics", headers=bearer)  # a UI path here: NNI's page, no metrics
    assert metrics.headers["content-type"].startswith("text/html"), metrics.text
    for path in ("/api/v1/nni/check-status", f"/nni/{experiment_id}/api/v1/nni/check-status", "/api/v1/experiments"):
        assert web.get(f"{url}{path}").status_code == 401, path
    (code / "gates" / "all").touch()
    wait_until(lambda: http.get(f"/experiments/{experiment_id}").json()["status"] == "DONE", 60, what="DONE")


def test_an_experiments_own_port_answers_loopback_names_and_its_experiment_alone(
    tmp_path: Path, processes: Processes
) -> None:
    """Issue 24, A4: an experiment's nnictl port, which takes no token even when the main port has one, answers
    as a port with no token does: only to a loopback Host (nnictl's `localhost:<port>`) and no other site's
    Origin, so a rebinding page cannot edit the experiment; and it knows its own experiment alone."""
    home, code = tmp_path / "home", write_trial(tmp_path / "code")
    home.mkdir()
    url = processes.manager("--nnictl-registry", env={"HOME": str(home), TOKEN_ENV: TOKEN})
    http = httpx.Client(base_url=f"{url}/api/v1", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    config = experiment_config(code, trials=2, concurrency=1)
    mine, other = (http.post("/experiments", json={"config": config}).json()["id"] for _ in range(2))
    registry = home / "nni-experiments" / ".experiment"
    wait_until(lambda: registry.exists() and {mine, other} <= set(json.loads(registry.read_text())), 30, what="entries")
    port = json.loads(registry.read_text())[mine]["port"]
    own = f"http://127.0.0.1:{port}/api/v1/nni"
    nnictl_host = {"Host": f"localhost:{port}"}

    listed = web.get(f"{own}/experiments-info", headers=nnictl_host)
    assert [entry["id"] for entry in listed.json()] == [mine]
    # its API is at this port's root: no prefix, as its registry entry says (a client would apply one)
    assert listed.json()[0]["prefixUrl"] is None
    assert web.get(f"{own}/experiment-metadata", headers=nnictl_host).json()["prefixUrl"] is None
    assert web.get(f"{own}/experiment", headers=nnictl_host).json()["id"] == mine
    bearer = {**nnictl_host, "Authorization": f"Bearer {TOKEN}"}
    for path in (f"/nni/{other}/api/v1/nni/experiment", f"/nni/{other}/api/v1/nni/check-status", f"/nni/{other}/oview"):
        assert web.get(f"http://127.0.0.1:{port}{path}", headers=bearer).status_code == 404, path

    def concurrency() -> int:
        return int(http.get(f"/experiments/{mine}").json()["config"]["trialConcurrency"])

    def edit(trial_concurrency: int, headers: dict[str, str]) -> int:
        """`nnictl update concurrency`'s request, with these headers: its status."""
        body = {"params": {"trialConcurrency": trial_concurrency}}
        return web.put(f"{own}/experiment?update_type=TRIAL_CONCURRENCY", json=body, headers=headers).status_code

    for foreign in ({"Host": f"attacker.example:{port}"}, {**nnictl_host, "Origin": f"http://attacker.example:{port}"}):
        assert edit(50, foreign) == 403, foreign
        assert web.get(f"{own}/experiments-info", headers=foreign).status_code == 403, foreign
        assert web.get(f"http://127.0.0.1:{port}/oview", headers={**bearer, **foreign}).status_code == 403, foreign
    assert concurrency() == 1
    assert edit(2, nnictl_host) == 200
    wait_until(lambda: concurrency() == 2, 10, what="nnictl's edit")


def test_an_experiments_own_port_serves_the_web_ui_for_it_behind_the_token(
    tmp_path: Path, processes: Processes
) -> None:
    """As NNI's manager serves its port, the experiment's own port serves NNI's web UI, its API calls (made
    at the port's root, no prefix) answered for that experiment. Its pages and logs take the manager's token,
    as on the main port: `/login` there, or the cookie the main port's login set, which a browser sends to
    every port of the host; NNI's REST API alone takes none (nnictl). No page of another site may frame it."""
    home, code = tmp_path / "home", write_trial(tmp_path / "code")
    home.mkdir()
    url = processes.manager("--nnictl-registry", env={"HOME": str(home), TOKEN_ENV: TOKEN})
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    created = web.post(f"{url}/api/v1/experiments", json={"config": experiment_config(code, trials=1)}, headers=bearer)
    experiment_id = created.json()["id"]
    registry = home / "nni-experiments" / ".experiment"
    wait_until(lambda: registry.exists() and experiment_id in json.loads(registry.read_text()), 30, what="the entry")
    port = json.loads(registry.read_text())[experiment_id]["port"]
    own = f"http://127.0.0.1:{port}"

    refused = web.get(f"{own}/oview")
    assert refused.status_code == 401 and refused.json() == {"error": "a bearer token is required"}
    assert web.get(f"{own}/logs/dispatcher.log").status_code == 401
    assert web.get(f"{own}/api/v1/nni/check-status").status_code == 200  # nnictl's reads take no token

    login = web.get(f"{own}/login", params={"token": TOKEN})
    assert (login.status_code, login.headers["location"]) == (303, "/oview")
    cookie = {"Cookie": login.headers["set-cookie"].split(";")[0]}
    main_cookie = web.get(f"{url}/login", params={"token": TOKEN}).headers["set-cookie"].split(";")[0]
    assert main_cookie == cookie["Cookie"]  # the main port's login lets the browser in here too
    for page in ("", "/oview", "/detail", "/experiment"):
        answer = web.get(f"{own}{page}", headers=cookie)
        assert answer.status_code == 200 and "<title>Neural Network Intelligence</title>" in answer.text, page
        assert answer.headers["x-frame-options"] == "DENY", page
    script = re.search(r'src="\./(static/js/main\.[0-9a-f]+\.js)"', web.get(own, headers=cookie).text)
    assert script is not None and web.get(f"{own}/{script[1]}", headers=cookie).status_code == 200
    assert web.get(f"{own}/logs/dispatcher.log", headers=cookie).status_code == 200

    # the API calls the page makes, at its root: this experiment's
    profile = web.get(f"{own}/api/v1/nni/experiment", headers=cookie).json()
    metadata = web.get(f"{own}/api/v1/nni/experiment-metadata", headers=cookie).json()
    assert profile["id"] == metadata["id"] == experiment_id
    assert (metadata["port"], metadata["prefixUrl"]) == (port, None)  # All experiments links to this port's root
    assert web.get(f"{own}/api/v1/nni/check-status", headers=cookie).json()["status"] in ("RUNNING", "NO_MORE_TRIAL")


def test_the_registry_entry_turns_done_with_its_end_time(tmp_path: Path, processes: Processes) -> None:
    """An experiment that finishes under a running manager is DONE in nnictl's registry, with its end
    time (NNI's milliseconds), as NNI's manager leaves it; the manager's own answer agrees."""
    home, gates = tmp_path / "home", tmp_path / "gates"
    home.mkdir()
    gates.mkdir()
    (tmp_path / "trial.py").write_text(TRIAL)
    processes.worker(env={"GATES": str(gates)})
    url = processes.manager("--nnictl-registry", env={"HOME": str(home)})
    config = {**experiment_config(tmp_path, trials=1), "trialConcurrency": 1}
    experiment_id = web.post(f"{url}/api/v1/experiments", json={"config": config}).json()["id"]
    registry = home / "nni-experiments" / ".experiment"

    def entry() -> dict[str, Any]:
        entries: dict[str, dict[str, Any]] = json.loads(registry.read_text()) if registry.exists() else {}
        return entries.get(experiment_id, {})

    def trials() -> list[dict[str, Any]]:
        return web.get(f"{url}/api/v1/experiments/{experiment_id}/trials").json()["items"]

    running = wait_until(lambda: [t for t in trials() if t["status"] == "RUNNING"], 30, what="a running trial")
    assert entry()["status"] == "RUNNING" and entry()["endTime"] == "N/A"  # as NNI writes it while running
    (gates / str(running[0]["id"])).touch()
    wait_until(lambda: entry().get("status") == "DONE", 60, what="the entry, DONE")
    profile = web.get(f"{url}/api/v1/nni/experiment").json()
    assert isinstance(entry()["endTime"], int) and entry()["endTime"] == profile["endTime"]
    assert entry()["endTime"] >= entry()["startTime"]
    assert processes.running[-1].poll() is None  # the manager serves on
    if shutil.which("nnictl") is not None:
        assert "DONE" in nnictl(home, "experiment", "status", experiment_id)


def test_a_registry_it_cannot_write_costs_no_experiment(tmp_path: Path, processes: Processes) -> None:
    """nnictl's registry is a side matter: where it cannot be written (~/nni-experiments is a file), the
    experiment is still created (201) and run, and a manager that starts again still resumes it."""
    home, code = tmp_path / "home", write_trial(tmp_path / "code")
    home.mkdir()
    (home / "nni-experiments").write_text("a file where nnictl wants its directory")
    processes.worker()
    args = ("--nnictl-registry", "--on-exit", "detach", "--log-format", "json")
    url = processes.manager(*args, env={"HOME": str(home)})
    created = web.post(f"{url}/api/v1/experiments", json={"config": experiment_config(code, trials=1)})
    assert created.status_code == 201, created.text
    experiment_id = created.json()["id"]

    def experiment() -> dict[str, Any]:
        return web.get(f"{url}/api/v1/experiments/{experiment_id}").json()

    def trials() -> list[dict[str, Any]]:
        return web.get(f"{url}/api/v1/experiments/{experiment_id}/trials").json()["items"]

    wait_until(lambda: [t for t in trials() if t["status"] == "RUNNING"], 30, what="a running trial")
    assert experiment()["status"] == "RUNNING"
    failures = [line for line in json_lines(processes) if line.get("experiment") == experiment_id]
    assert any(line["level"] == "error" and "nni-experiments" in line.get("exception", "") for line in failures)

    first = processes.running[-1]
    first.send_signal(signal.SIGTERM)  # detached: the next manager resumes the experiment
    assert first.wait(60) == 0
    url = processes.manager(*args, env={"HOME": str(home)})  # its start, resuming, meets the same registry
    assert experiment()["status"] == "RUNNING"
    (code / "gates" / "all").touch()
    wait_until(lambda: experiment()["status"] == "DONE", 60, what="DONE")
    assert [t["status"] for t in trials()] == ["SUCCEEDED"]
    assert processes.running[-1].poll() is None


def json_lines(processes: Processes) -> list[dict[str, Any]]:
    lines = []
    for line in processes.logs().splitlines():
        try:
            parsed = json.loads(line)
        except ValueError:
            continue
        if isinstance(parsed, dict):
            lines.append(parsed)
    return lines


def nnictl_top(home: Path) -> str:
    """`nnictl top` refreshes forever: what it printed once it showed a trial table."""
    environment = nnictl_environment(home / "scratch")
    environment["HOME"] = str(home)
    top = subprocess.Popen(
        [sys.executable, "-m", "nni.tools.nnictl.nnictl", "top", "--time", "1"],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert top.stdout is not None
    printed = ""
    try:
        while "SUCCEEDED" not in printed:
            line = top.stdout.readline()  # the pipe closes if it exits: then the loop ends on the assert below
            assert line, f"nnictl top exited: {printed}"
            printed += line
    finally:
        top.kill()
        top.wait()
    return printed


def trials_from_redis(processes: Processes, experiment_id: str) -> list[dict[str, object]]:
    from core.connections import connect
    from manager.training_service import TrainingService

    client = connect(processes.redis_url)
    service = TrainingService(client, connect(processes.redis_url, decode=False), experiment_id)
    return [json.loads(trial.to_json()) for trial in service.list_trial_jobs()]
