"""The `trialstream` command as a user runs it: real processes, real Redis, real trials."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

import pytest

from core.connections import connect
from core.event_store import EventStore
from tests.conftest import REPO, Processes, wait_until
from tests.support.configs import write_local_config

QUICKSTART = REPO / "examples" / "quickstart" / "config.yml"


def trialstream(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "TRIALSTREAM_REDIS_URL"}
    return subprocess.run(
        [sys.executable, "-m", "manager.cli", *args],
        cwd=REPO,
        env={**full_env, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


SDK_TRIAL = """
import trialstream_sdk as nni
x = nni.get_next_parameter()["x"]
nni.report_intermediate_result(x / 2)
nni.report_final_result(x * 10)
"""


def test_quickstart_runs_embedded_to_completion(tmp_path: Path) -> None:
    """The README's quickstart: a private redis-server, projector and workers, all started and stopped."""
    result = trialstream("run", str(QUICKSTART), "--json", env={"TRIALSTREAM_EXPERIMENTS_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout)
    trials = output["trials"]
    assert len(trials) == 8
    assert {trial["status"] for trial in trials} == {"SUCCEEDED"}
    assert all(isinstance(trial["finalMetric"]["default"], float) for trial in trials)
    assert sorted(trial["sequenceId"] for trial in trials) == list(range(8))
    assert all(set(trial["hyperParameters"]) == {"lr", "steps", "batch_size"} for trial in trials)
    experiment_dir = tmp_path / output["experimentId"]
    assert (experiment_dir / "redis" / "appendonlydir").is_dir()  # AOF on, under the experiment
    workers = sorted(log.name for log in (experiment_dir / "logs").glob("worker-*.log"))
    assert workers == ["worker-0.log", "worker-1.log", "worker-2.log"]  # trialConcurrency 2, and a spare
    assert "running" in result.stderr and "best" in result.stderr  # the live progress table

    listed = trialstream("trials", "list", "--json", env={"TRIALSTREAM_EXPERIMENTS_DIR": str(tmp_path)})
    assert listed.returncode == 0, listed.stderr
    assert sorted(t["id"] for t in json.loads(listed.stdout)) == sorted(t["id"] for t in trials)


def test_real_nni_trial_code_runs_unmodified(tmp_path: Path, processes: Processes) -> None:
    """`import nni` with the real nni package from PyPI: its parameters and metrics go through us."""
    import nni  # noqa: F401  (the test needs the real package, installed by the README's test set-up)

    config = write_local_config(
        tmp_path,
        """
        import nni
        params = nni.get_next_parameter()
        nni.report_intermediate_result(params["x"] / 2)
        nni.report_final_result(params["x"] * 10)
        """,
        maxTrialNumber=2,  # two at once, on two workers; `import nni` alone costs each trial ~2 s of CPU
    )
    processes.projector()
    processes.worker()
    processes.worker()
    result = trialstream("run", str(config), "--json", env={"TRIALSTREAM_REDIS_URL": processes.redis_url})
    assert result.returncode == 0, result.stderr + processes.logs()
    trials = json.loads(result.stdout)["trials"]
    assert len(trials) == 2
    for trial in trials:
        assert trial["status"] == "SUCCEEDED"
        assert trial["finalMetric"] == trial["hyperParameters"]["x"] * 10  # attribution is exact


def test_run_takes_a_config_on_a_platform_the_platforms_setting_plugs_in(tmp_path: Path, processes: Processes) -> None:
    """TRIALSTREAM_PLATFORMS is the control plane's setting too, not only the workers': `trialstream run` (as
    `trialstream manager`) accepts a config naming the plugged-in platform, and its worker runs the trials."""
    platforms = {"TRIALSTREAM_PLATFORMS": "detached=tests.platforms.detached:DetachedPlatform"}
    config = write_local_config(tmp_path, SDK_TRIAL, maxTrialNumber=2, trainingService={"platform": "detached"})
    processes.projector()
    processes.worker("detached", env=platforms)
    result = trialstream("run", str(config), "--json", env={"TRIALSTREAM_REDIS_URL": processes.redis_url, **platforms})
    assert result.returncode == 0, result.stderr + processes.logs()
    assert [trial["status"] for trial in json.loads(result.stdout)["trials"]] == ["SUCCEEDED", "SUCCEEDED"]


def test_external_redis_mode_and_trial_commands(tmp_path: Path, processes: Processes) -> None:
    config = write_local_config(tmp_path, SDK_TRIAL)
    processes.projector()
    processes.worker()
    env = {"TRIALSTREAM_REDIS_URL": processes.redis_url}
    result = trialstream("run", str(config), "--json", env=env)
    assert result.returncode == 0, result.stderr
    run = json.loads(result.stdout)
    trial = run["trials"][0]

    shown = trialstream("trials", "show", trial["id"], "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    detail = json.loads(shown.stdout)
    assert detail["status"] == "SUCCEEDED" and detail["sequenceId"] == trial["sequenceId"]
    assert [m["type"] for m in detail["metrics"]] == ["PERIODICAL", "FINAL"]

    listed = trialstream("trials", "list", "--experiment", run["experimentId"], "--json", env=env)
    assert len(json.loads(listed.stdout)) == 4

    missing = trialstream("trials", "show", "zzzzz", env=env)
    assert missing.returncode == 1
    assert "trial 'zzzzz' not found" in missing.stderr and "Traceback" not in missing.stderr
    cancel_missing = trialstream("trials", "cancel", "zzzzz", env=env)
    assert cancel_missing.returncode == 1 and "not found" in cancel_missing.stderr


def test_cancel_from_the_command_line(tmp_path: Path, processes: Processes) -> None:
    from core.connections import connect
    from manager.training_service import TrainingService
    from tests.conftest import wait_for_status

    config = write_local_config(tmp_path, "import time\ntime.sleep(60)\n", maxTrialNumber=1, trialConcurrency=1)
    processes.projector()
    processes.worker()
    env = {"TRIALSTREAM_REDIS_URL": processes.redis_url}
    run = subprocess.Popen(
        [sys.executable, "-m", "manager.cli", "run", str(config), "--json"],
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        client = connect(processes.redis_url)
        from tests.conftest import wait_until

        experiment_id = wait_until(lambda: cast(list[str], client.zrange("ts:experiments", 0, -1)), 20)[0]
        service = TrainingService(client, connect(processes.redis_url, decode=False), experiment_id)
        trial_id = wait_until(lambda: service.list_trial_jobs(), 20)[0].id
        wait_for_status(service, trial_id, "RUNNING")
        canceled = trialstream("trials", "cancel", trial_id, env=env)
        assert canceled.returncode == 0, canceled.stderr
        out, _ = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 0
    assert json.loads(out)["trials"][0]["status"] == "USER_CANCELED"


def test_trial_concurrency_holds(tmp_path: Path, processes: Processes) -> None:
    from core.connections import connect
    from core.event_store import EventStore, StoredEvent

    config = write_local_config(tmp_path, "import time\ntime.sleep(0.3)\n", maxTrialNumber=6, trialConcurrency=2)
    processes.projector()
    for _ in range(4):
        processes.worker()
    result = trialstream("run", str(config), "--json", env={"TRIALSTREAM_REDIS_URL": processes.redis_url})
    assert result.returncode == 0, result.stderr
    experiment_id = json.loads(result.stdout)["experimentId"]
    running, most = 0, 0
    for entry in EventStore(connect(processes.redis_url), experiment_id).read():
        assert isinstance(entry, StoredEvent)
        running += {"TrialStarted": 1, "TrialEnded": -1}.get(entry.event.type, 0)
        most = max(most, running)
    assert most == 2


def test_max_experiment_duration_lets_running_trials_end_and_starts_no_more(
    tmp_path: Path, processes: Processes
) -> None:
    """As NNI: out of time, the experiment submits nothing more, and the trials running then end as they would
    (here once the test opens their gate, past the duration, freeing both slots), then it is DONE."""
    gate, up = tmp_path / "gate", tmp_path / "up"
    up.mkdir()
    trial = f"""
        import os, pathlib, time
        pathlib.Path({str(up)!r}, str(os.getpid())).write_text(os.environ["NNI_EXP_ID"])
        while not pathlib.Path({str(gate)!r}).exists():
            time.sleep(0.05)
    """
    config = write_local_config(tmp_path, trial, maxExperimentDuration="2s", maxTrialNumber=10)
    processes.projector()
    processes.worker()
    processes.worker()
    env = {k: v for k, v in os.environ.items() if k != "TRIALSTREAM_REDIS_URL"}
    run = subprocess.Popen(
        [sys.executable, "-m", "manager.cli", "run", str(config), "--json"],
        cwd=REPO,
        env={**env, "TRIALSTREAM_REDIS_URL": processes.redis_url},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        started = wait_until(
            lambda: ids if len(ids := [path.read_text() for path in up.iterdir()]) == 2 and all(ids) else None,
            60,
            what="two trials running",
        )
        created_ms = int(next(iter(EventStore(connect(processes.redis_url), started[0]).read())).id.split("-")[0])
        wait_until(lambda: time.time() * 1000 > created_ms + 3000, 30, what="the 2 s to pass, and a second more")
        gate.touch()
        stdout, _ = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 0
    assert [trial["status"] for trial in json.loads(stdout)["trials"]] == ["SUCCEEDED", "SUCCEEDED"]  # no more


def test_grid_search_runs_every_point_once(tmp_path: Path, processes: Processes) -> None:
    space = {"x": {"_type": "choice", "_value": [1, 2, 3]}, "y": {"_type": "choice", "_value": [0, 1]}}
    config = write_local_config(
        tmp_path,
        "import trialstream_sdk as nni\nnni.get_next_parameter()\nnni.report_final_result(1)\n",
        searchSpace=space,
        tuner={"name": "GridSearch"},
        maxTrialNumber=100,
    )
    processes.projector()
    processes.worker()
    result = trialstream("run", str(config), "--json", env={"TRIALSTREAM_REDIS_URL": processes.redis_url})
    assert result.returncode == 0, result.stderr
    points = sorted((t["hyperParameters"]["x"], t["hyperParameters"]["y"]) for t in json.loads(result.stdout)["trials"])
    assert points == [(x, y) for x in (1, 2, 3) for y in (0, 1)]


def test_no_worker_serving_the_queue_is_said_clearly(tmp_path: Path, processes: Processes) -> None:
    config = write_local_config(tmp_path, SDK_TRIAL)
    processes.projector()
    env = {"TRIALSTREAM_REDIS_URL": processes.redis_url, "TRIALSTREAM_SERVED_WAIT_S": "0.5"}  # not the 10 s default
    result = trialstream("run", str(config), env=env, timeout=30)
    assert result.returncode == 1
    assert "no worker serves queue 'trialstream.local'" in result.stderr and "(waited 0.5 s)" in result.stderr
    assert "trialstream worker --platform local" in result.stderr


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"trialConcurency": 2}, "trialConcurency: unknown key"),
        ({"trainingService": {"platform": "nowhere"}}, "unknown platform 'nowhere'; available platforms: "),
        ({"tuner": {"name": "TPEE"}}, "tuner.name"),
        (  # was a NotADirectoryError's traceback, from the embedded stack making its data directory
            {"experimentWorkingDirectory": "/etc/passwd"},
            "experimentWorkingDirectory: cannot create /etc/passwd/",
        ),
        ({"experimentWorkingDirectory": "/proc/nope"}, "set it to a directory you can write to"),
    ],
)
def test_invalid_config_names_the_key(tmp_path: Path, overrides: dict, expected: str) -> None:
    result = trialstream("run", str(write_local_config(tmp_path, SDK_TRIAL, **overrides)), timeout=30)
    assert result.returncode == 2
    assert expected in result.stderr and "Traceback" not in result.stderr


def test_invalid_yaml_is_reported_with_its_file(tmp_path: Path) -> None:
    path = tmp_path / "config.yml"
    path.write_text("trialCommand: [unclosed\n")
    result = trialstream("run", str(path), timeout=30)
    assert result.returncode == 2 and "invalid YAML" in result.stderr and str(path) in result.stderr


def test_unreachable_redis_names_the_url(tmp_path: Path) -> None:
    config = write_local_config(tmp_path, SDK_TRIAL)
    url = "redis://127.0.0.1:1/0"
    for args in (("run", str(config)), ("trials", "list"), ("projector",)):
        result = trialstream(*args, env={"TRIALSTREAM_REDIS_URL": url}, timeout=30)
        assert result.returncode == 1, args
        assert f"cannot reach Redis at {url}" in result.stderr and "Traceback" not in result.stderr


MARKUP_TRIAL = """
import sys
sys.stderr.write("reading [/data/x] and [bold]x[/bold] \\x1b]0;TITLE\\x07\\x1b[2J\\n")
sys.exit(1)
"""


def test_trial_text_that_looks_like_markup_is_shown_literally(tmp_path: Path, processes: Processes) -> None:
    """A16: `[/data/x]` in a trial's message made `trials list` raise MarkupError; `[bold]` vanished. Escape
    sequences (a window title, a cleared screen) reached the terminal as they were."""
    config = write_local_config(tmp_path, MARKUP_TRIAL, maxTrialNumber=1, trialConcurrency=1)
    processes.projector()
    processes.worker()
    env = {"TRIALSTREAM_REDIS_URL": processes.redis_url, "COLUMNS": "400"}
    ran = trialstream("run", str(config), env=env)
    assert ran.returncode == 0, ran.stderr
    assert "[/data/x] and [bold]x[/bold]" in ran.stdout  # the result table at the end of `run`
    listed = trialstream("trials", "list", env=env)
    assert listed.returncode == 0, listed.stderr
    assert "[/data/x] and [bold]x[/bold]" in listed.stdout
    for output in (ran.stdout, listed.stdout):
        assert "\\x1b]0;TITLE\\x07\\x1b[2J" in output and "\x1b" not in output and "\x07" not in output
    trial_id = json.loads(trialstream("trials", "list", "--json", env=env).stdout)[0]["id"]
    shown = trialstream("trials", "show", trial_id, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "[/data/x] and [bold]x[/bold]" in shown.stdout
    missing = trialstream("trials", "show", "[/x][bold]y[/bold]", env=env)  # the error printer quotes it as text
    assert missing.returncode == 1 and "Traceback" not in missing.stderr, missing.stderr
    assert "trial '[/x][bold]y[/bold]' not found" in missing.stderr


def test_a_shared_run_waits_for_services_that_are_still_starting(tmp_path: Path, processes: Processes) -> None:
    """`run` started beside its worker and projector waits a stated time for them instead of failing at once."""
    from tests.conftest import wait_until

    config = write_local_config(tmp_path, SDK_TRIAL, maxTrialNumber=2)
    run = processes.start("run", str(config), "--json")
    wait_until(lambda: "waiting up to 10 s" in processes.logs(), 30, what="the run to say it waits")
    processes.start("projector")
    processes.start("worker", "--platform", "local")
    assert run.wait(120) == 0, processes.logs()
    listed = trialstream("trials", "list", "--json", env={"TRIALSTREAM_REDIS_URL": processes.redis_url})
    assert [trial["status"] for trial in json.loads(listed.stdout)] == ["SUCCEEDED", "SUCCEEDED"]


def test_a_workers_health_check_passes_while_one_of_this_host_beats_and_fails_without(processes: Processes) -> None:
    def healthcheck() -> int:
        env = {**os.environ, "TRIALSTREAM_REDIS_URL": processes.redis_url}
        command = [sys.executable, "-P", "-m", "workers", "--healthcheck"]
        return subprocess.run(command, env=env, cwd=REPO, capture_output=True, timeout=60).returncode

    assert healthcheck() == 1  # no worker here yet
    worker = processes.worker()
    assert healthcheck() == 0
    worker.terminate()
    worker.wait(timeout=60)
    assert healthcheck() == 1  # a stopped worker unregisters
    env = {**os.environ, "TRIALSTREAM_REDIS_URL": "redis://127.0.0.1:1/0"}
    unreachable = subprocess.run([sys.executable, "-m", "workers", "--healthcheck"], env=env, capture_output=True)
    assert unreachable.returncode == 1


def test_worker_hands_over_with_the_global_redis_option_and_its_settings_checked(redis_url: str) -> None:
    """`trialstream worker` execs the worker runtime before loading any settings: --redis still reaches it,
    and a bad setting is still one line naming the variable."""
    served = trialstream("--redis", redis_url, "worker", "--platform", "local", "--burst")
    assert served.returncode == 0, served.stderr
    assert "Listening on trialstream.local" in served.stderr and "done, quitting" in served.stderr
    refused = trialstream("--redis", redis_url, "worker", "--platform", "local", env={"TRIALSTREAM_TRIAL_LEASE_S": "0"})
    assert refused.returncode == 1
    assert refused.stderr.strip() == "trialstream: error: TRIALSTREAM_TRIAL_LEASE_S: Input should be greater than 0"
