"""Several machines with different GPUs serving one local queue, each worker a real process with fake GPUs: a
machine counts in an experiment's GPU check only while a worker of it lives."""

from __future__ import annotations

import json
from pathlib import Path

from core.settings import Settings
from manager.config import experiment_spec
from manager.preflight import platform_problems
from schemas.config import ConfigError
from tests.conftest import Processes, wait_until
from tests.platforms.test_gpu_preflight import gpu_config


def machine(tmp_path: Path, name: str, gpus: int, **env: str) -> dict[str, str]:
    """A worker's environment that makes it a worker of machine `name`, which has `gpus` (fake) GPUs."""
    fake = tmp_path / f"{name}-gpus.json"
    fake.write_text(json.dumps({"gpus": [{"index": index} for index in range(gpus)]}))
    return {"TRIALSTREAM_MACHINE_ID": name, "TRIALSTREAM_FAKE_GPUS": str(fake), **env}


def test_a_machine_counts_in_the_gpu_check_only_while_a_worker_of_it_lives(
    processes: Processes, tmp_path: Path
) -> None:
    ttl = {"TRIALSTREAM_GPU_RECORD_TTL_S": "3"}
    processes.worker(env=machine(tmp_path, "cpu-box", 0, **ttl))
    gpu_box = processes.worker(env=machine(tmp_path, "gpu-box", 2, **ttl))
    spec = experiment_spec(gpu_config(tmp_path / "code", 2), "config")
    settings = Settings.from_environment({"TRIALSTREAM_REDIS_URL": processes.redis_url})

    def refusal() -> str:
        try:
            platform_problems(spec, settings)
        except ConfigError as error:
            return str(error)
        return ""

    assert refusal() == ""  # gpu-box has the 2 GPUs
    gpu_box.terminate()
    gpu_box.wait(20)
    refused = wait_until(refusal, 20, interval=0.2, what="gpu-box's record to lapse")
    # cpu-box was recorded before gpu-box: still counted, its worker has renewed its record meanwhile
    assert "the one machine with a live local worker on this Redis has no GPU" in refused, refused

    processes.stop()  # no machine with a live worker left: unknown, so nothing is refused (trials wait for one)
    wait_until(lambda: refusal() == "", 20, interval=0.2, what="cpu-box's record to lapse")
