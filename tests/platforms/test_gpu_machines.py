"""Several machines with different GPUs serving one local queue, each worker a real process with fake GPUs: a
trial that a worker's machine can never run (too few GPUs) is handed back for a machine that can, and a machine
counts in an experiment's GPU check only while a worker of it lives."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from core.connections import connect
from core.event_store import StoredEvent
from core.settings import Settings
from manager.config import experiment_spec
from manager.preflight import platform_problems
from schemas.config import ConfigError
from schemas.events import TrialDeferred, TrialRequeued, TrialStarted
from schemas.trial import TrialJobStatus
from tests.conftest import Processes, ServiceFactory, form, wait_for_status, wait_until
from tests.platforms.test_gpu_preflight import gpu_config
from tests.platforms.test_gpu_scheduling import cuda_of, gpu_service, release
from tests.platforms.test_parking import events_of
from workers.platforms.local.gpus import live_machines


def machine(tmp_path: Path, name: str, gpus: int, **env: str) -> dict[str, str]:
    """A worker's environment that makes it a worker of machine `name`, which has `gpus` (fake) GPUs."""
    fake = tmp_path / f"{name}-gpus.json"
    fake.write_text(json.dumps({"gpus": [{"index": index} for index in range(gpus)]}))
    return {"TRIALSTREAM_MACHINE_ID": name, "TRIALSTREAM_FAKE_GPUS": str(fake), **env}


def test_a_trial_a_machine_has_too_few_gpus_for_is_handed_back_to_one_with_enough(
    make_service: ServiceFactory, processes: Processes, code_dir: Path, tmp_path: Path
) -> None:
    service = gpu_service(make_service, code_dir, 2, useActiveGpu=False)
    processes.worker(env=machine(tmp_path, "cpu-box", 0))  # alone on the queue: it takes the trial first
    trial_id = service.submit_trial_job(form(0)).id
    first = wait_until(lambda: events_of(service, trial_id, TrialDeferred), 20, what="cpu-box to hand it back")[0]
    assert first.reason == (
        f"host {socket.gethostname()}: trial asks for 2 GPUs but this machine has none;"
        " no other machine with a live local"
        " worker has enough: waiting for a worker of one that has"
    )
    wait_until(lambda: service.get_trial_job(trial_id).message == first.reason, 10, what="it in the trial's message")
    assert service.get_trial_job(trial_id).status is TrialJobStatus.WAITING  # as `trials show` says

    processes.worker(env=machine(tmp_path, "gpu-box", 2))
    running = wait_for_status(service, trial_id, "RUNNING", timeout=60)  # woken at its re-check, on either worker
    wait_until(lambda: (Path(running.working_directory) / "cuda").exists(), 10, what="the trial's CUDA devices")
    assert cuda_of(running) == "0,1"  # gpu-box's: cpu-box never starts it
    release(service)
    assert wait_for_status(service, trial_id, "SUCCEEDED", "FAILED").status is TrialJobStatus.SUCCEEDED
    events = [entry.event for entry in service.store.read() if isinstance(entry, StoredEvent)]
    started = next(event for event in events if isinstance(event, TrialStarted) and event.trial_id == trial_id)
    requeued = [event for event in events if isinstance(event, TrialRequeued) and event.time <= started.time]
    assert requeued and all(event.attempt == 1 for event in requeued)  # the same attempt, queued again: no retry


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

    client = connect(processes.redis_url)
    wait_until(lambda: {"cpu-box", "gpu-box"} <= live_machines(client).keys(), 20, what="both machines recorded")
    assert refusal() == ""  # gpu-box has the 2 GPUs
    gpu_box.terminate()
    gpu_box.wait(20)
    refused = wait_until(refusal, 20, interval=0.2, what="gpu-box's record to lapse")
    # cpu-box was recorded before gpu-box: still counted, its worker has renewed its record meanwhile
    assert "the one machine with a live local worker on this Redis has no GPU" in refused, refused

    processes.stop()  # no machine with a live worker left: unknown, so nothing is refused (trials wait for one)
    wait_until(lambda: refusal() == "", 20, interval=0.2, what="cpu-box's record to lapse")
