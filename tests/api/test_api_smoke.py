"""The manager's own API end to end: an experiment created over HTTP runs on a real worker."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from simulators.waiting import wait_until
from tests.conftest import Processes
from tests.support import web

TRIAL = "import trialstream_sdk as nni\nnni.report_final_result(nni.get_next_parameter()['x'])\n"


def experiment_config(code: Path, trials: int = 4, concurrency: int = 2, **extra: Any) -> dict[str, Any]:
    """A small experiment of `trial.py` in `code`, NNI's keys; `extra` adds or replaces keys."""
    return {
        "trialCommand": f"{sys.executable} trial.py",
        "trialCodeDirectory": str(code),
        "trialConcurrency": concurrency,
        "maxTrialNumber": trials,
        "searchSpace": {"x": {"_type": "uniform", "_value": [0, 1]}},
        "tuner": {"name": "Random"},
        "trainingService": {"platform": "local"},
        "experimentWorkingDirectory": str(code / "experiments"),
        **extra,
    }


def test_an_experiment_created_over_http_runs_to_the_end(tmp_path: Path, processes: Processes) -> None:
    (tmp_path / "trial.py").write_text(TRIAL)
    processes.worker()
    url = processes.manager()
    created = web.post(f"{url}/api/v1/experiments", json={"config": experiment_config(tmp_path)})
    assert created.status_code == 201, created.text
    experiment_id = created.json()["id"]

    def done() -> dict[str, object] | None:
        state = web.get(f"{url}/api/v1/experiments/{experiment_id}").json()
        return state if state["status"] == "DONE" else None

    state = wait_until(done, 60, what="the experiment to finish")
    assert state["trialCounts"] == {"SUCCEEDED": 4}
    page = web.get(f"{url}/api/v1/experiments/{experiment_id}/trials", params={"limit": 3}).json()
    assert page["total"] == 4
    assert [trial["sequenceId"] for trial in page["items"]] == [0, 1, 2]
