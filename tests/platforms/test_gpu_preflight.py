"""A local experiment asking for more GPUs than the machines its trials would run on have is refused before
anything runs, as a bad config (exit 2, a 422 from the manager), naming the key; one those machines can serve runs.
The machines are this one (no GPU here, unless TRIALSTREAM_FAKE_GPUS says otherwise) for an embedded run, and those
with a live worker serving a shared Redis, as its workers record them (tests/platforms/test_gpu_machines.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tests.cli.test_cli_manager import trialstream
from tests.conftest import Processes
from tests.support import web
from tests.support.configs import write_config_file

TRIAL = "import trialstream_sdk as nni\nnni.get_next_parameter()\nnni.report_final_result(1.0)\n"


def gpu_config(code: Path, gpus: int, **local: object) -> dict[str, Any]:
    """One trial asking for `gpus` GPUs on the local platform, its code in `code`."""
    code.mkdir(exist_ok=True)
    (code / "trial.py").write_text(TRIAL)
    return {
        "trialCommand": f"{sys.executable} trial.py",
        "trialCodeDirectory": str(code),
        "trialConcurrency": 1,
        "maxTrialNumber": 1,
        "trialGpuNumber": gpus,
        "searchSpace": {"x": {"_type": "choice", "_value": [1]}},
        "trainingService": {"platform": "local", "useActiveGpu": False, **local},
    }


def fake_gpus(path: Path, count: int) -> str:
    path.write_text(json.dumps({"gpus": [{"index": index} for index in range(count)]}))
    return str(path)


def refused(result: Any, *said: str) -> str:
    """The one line of a bad config's refusal (exit 2), which says each of `said`."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    for words in said:
        assert words in result.stderr, result.stderr
    return str(result.stderr)


def test_an_embedded_run_counts_this_machine_s_gpus(tmp_path: Path) -> None:
    experiments = tmp_path / "experiments"
    config = write_config_file(tmp_path, gpu_config(tmp_path / "code", 1))
    env = {"TRIALSTREAM_EXPERIMENTS_DIR": str(experiments)}
    none = refused(trialstream("run", str(config), env=env, timeout=60), f"{config}: trialGpuNumber: ", "no GPU")
    assert "lower trialGpuNumber to 0" in none
    assert not experiments.exists() or not any(experiments.iterdir())  # nothing was created

    two = {**env, "TRIALSTREAM_FAKE_GPUS": fake_gpus(tmp_path / "gpus.json", 2)}
    indices = write_config_file(tmp_path, gpu_config(tmp_path / "code", 2, gpuIndices=[1, 2]), "indices.yml")
    refused(trialstream("run", str(indices), env=two, timeout=60), "trainingService.gpuIndices: ", "2 GPUs (0,1)")
    # a worker gives no GPU where gpuIndices lists one its machine lacks: the trial would only wait for another
    missing = write_config_file(tmp_path, gpu_config(tmp_path / "code", 1, gpuIndices=[0, 5]), "missing.yml")
    refused(trialstream("run", str(missing), env=two, timeout=60), "trainingService.gpuIndices: 0,5 leaves at most 0")

    ran = trialstream("run", str(config), "--json", env=two, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert [trial["status"] for trial in json.loads(ran.stdout)["trials"]] == ["SUCCEEDED"]


def test_a_run_on_a_shared_redis_counts_its_workers_machines(tmp_path: Path, served: Processes) -> None:
    env = {"TRIALSTREAM_REDIS_URL": served.redis_url, "TRIALSTREAM_FAKE_GPUS": fake_gpus(tmp_path / "here.json", 4)}
    config = write_config_file(tmp_path, gpu_config(tmp_path / "code", 1))
    result = trialstream("run", str(config), env=env, timeout=60)  # this machine's (fake) GPUs are not the worker's
    refused(result, "trialGpuNumber: ", "the one machine with a live local worker on this Redis has no GPU")
    listed = trialstream("experiments", "list", "--json", env=env)
    assert json.loads(listed.stdout) == [], listed.stderr


def test_the_manager_refuses_what_its_workers_machines_cannot_serve(tmp_path: Path, processes: Processes) -> None:
    processes.worker(env={"TRIALSTREAM_MACHINE_ID": "cpu-box"})  # no GPU here
    manager = processes.manager(env={"TRIALSTREAM_EXPERIMENTS_DIR": str(tmp_path / "manager-experiments")})
    config = gpu_config(tmp_path / "code", 2)
    answer = web.post(f"{manager}/api/v1/experiments", json={"config": config})
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"].startswith("config: trialGpuNumber: each trial asks for 2 GPUs")
    assert "has no GPU" in answer.json()["error"]
    assert web.get(f"{manager}/api/v1/experiments").json() == []

    processes.worker(env={"TRIALSTREAM_MACHINE_ID": "gpu-box", "TRIALSTREAM_FAKE_GPUS": fake_gpus(tmp_path / "g", 2)})
    answer = web.post(f"{manager}/api/v1/experiments", json={"config": gpu_config(tmp_path / "code", 3)})
    assert answer.status_code == 422, answer.text
    assert "the 2 machines with a live local worker on this Redis have at most 2 GPUs each" in answer.json()["error"]
    answer = web.post(f"{manager}/api/v1/experiments", json={"config": config})
    assert answer.status_code == 201, answer.text
    web.post(f"{manager}/api/v1/experiments/{answer.json()['id']}/stop")
