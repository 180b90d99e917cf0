"""GPU scheduling on the local platform, end to end, with a fake GPU source read by real workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rq import Queue, Worker

from core.connections import connect
from core.queueing import queue_name
from core.variables import REDIS_URL_ENV
from schemas.trial import TrialJobStatus
from tests.conftest import REPO, Processes, ServiceFactory, form, wait_for_status, wait_until

GPU_TRIAL = """
import os, sys, time
sys_dir = os.environ["NNI_SYS_DIR"]
with open(os.path.join(sys_dir, "cuda.tmp"), "w") as seen:  # renamed: a reader never sees it half written
    seen.write(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
os.replace(os.path.join(sys_dir, "cuda.tmp"), os.path.join(sys_dir, "cuda"))
release = os.path.join(os.path.dirname(os.path.dirname(sys_dir)), "release")
deadline = time.time() + 30
while not os.path.exists(release) and time.time() < deadline:
    time.sleep(0.02)
"""


def gpu_file(tmp_path: Path, active: list[int]) -> Path:
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"gpus": [{"index": i, "active_processes": n} for i, n in enumerate(active)]}))
    return path


def gpu_service(make_service: ServiceFactory, code_dir: Path, gpus: int, **local: object):
    (code_dir / "gpu_trial.py").write_text(textwrap.dedent(GPU_TRIAL))
    return make_service(
        f"{sys.executable} gpu_trial.py", platform_config={"platform": "local", **local}, gpu_number=gpus
    )


def cuda_of(trial) -> str:
    return (Path(trial.working_directory) / "cuda").read_text()


def release(service) -> None:
    """Let every GPU_TRIAL of the experiment exit."""
    trial_dir = Path(service.list_trial_jobs()[0].working_directory)
    (trial_dir.parent.parent / "release").touch()


def test_trials_get_their_gpus_in_cuda_visible_devices(make_service, processes: Processes, code_dir, tmp_path):
    fake = gpu_file(tmp_path, [0, 0])
    service = gpu_service(make_service, code_dir, 1, useActiveGpu=False)
    for _ in range(2):
        processes.worker(env={"TRIALSTREAM_FAKE_GPUS": str(fake)})
    first, second = (service.submit_trial_job(form(n)).id for n in range(2))
    running = [wait_for_status(service, trial_id, "RUNNING") for trial_id in (first, second)]
    wait_until(lambda: all((Path(t.working_directory) / "cuda").exists() for t in running), 10)
    assert sorted(cuda_of(trial) for trial in running) == ["0", "1"]
    release(service)
    for trial_id in (first, second):
        assert wait_for_status(service, trial_id, "SUCCEEDED", "FAILED").status is TrialJobStatus.SUCCEEDED


def test_a_trial_waits_for_busy_gpus_without_blocking_smaller_ones(
    make_service, processes: Processes, code_dir, tmp_path
) -> None:
    fake = gpu_file(tmp_path, [0])
    big = gpu_service(make_service, code_dir, 1, useActiveGpu=False)
    small = gpu_service(make_service, code_dir, 0)
    for _ in range(2):
        processes.worker(env={"TRIALSTREAM_FAKE_GPUS": str(fake)})
    holder = big.submit_trial_job(form(0)).id
    wait_for_status(big, holder, "RUNNING")
    waiter = big.submit_trial_job(form(1)).id
    waiting = wait_until(lambda: big.get_trial_job(waiter).message, 10, what="a deferral message")
    assert "waiting for 1 free GPU" in waiting
    assert big.get_trial_job(waiter).status is TrialJobStatus.WAITING
    cpu_only = small.submit_trial_job(form(0)).id  # needs no GPU: must not queue behind the waiter
    started = wait_for_status(small, cpu_only, "RUNNING")
    wait_until(lambda: (Path(started.working_directory) / "cuda").exists(), 10)
    assert cuda_of(started) == "-1"
    assert big.get_trial_job(waiter).status is TrialJobStatus.WAITING
    release(big)
    release(small)
    assert wait_for_status(big, waiter, "SUCCEEDED", "FAILED", timeout=30).status is TrialJobStatus.SUCCEEDED
    assert cuda_of(big.get_trial_job(waiter)) == "0"


def test_a_gpu_used_by_another_program_is_skipped_unless_use_active_gpu(
    make_service, processes: Processes, code_dir, tmp_path
) -> None:
    fake = gpu_file(tmp_path, [1, 0])  # GPU 0 runs someone else's process
    service = gpu_service(make_service, code_dir, 1, useActiveGpu=False)
    processes.worker(env={"TRIALSTREAM_FAKE_GPUS": str(fake)})
    trial = wait_for_status(service, service.submit_trial_job(form(0)).id, "RUNNING")
    wait_until(lambda: (Path(trial.working_directory) / "cuda").exists(), 10)
    assert cuda_of(trial) == "1"
    release(service)


def can_set_host_name() -> bool:
    """A new UTS namespace per worker is how two containers of one machine differ here (needs root)."""
    try:
        return subprocess.run(["unshare", "--uts", "hostname", "probe"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


def worker_on_host(processes: Processes, host: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A worker whose host name is `host`, as in a container of its own; returned once it serves."""
    queue = Queue(queue_name("local"), connection=connect(processes.redis_url, decode=False))
    before = len(Worker.all(queue=queue))
    log = (processes.log_dir / f"worker-{host}.log").open("wb")
    serve = 'hostname "$1" && exec "$0" -m manager.cli worker --platform local'
    process = subprocess.Popen(
        ["unshare", "--uts", "sh", "-c", serve, sys.executable, host],
        env={**os.environ, REDIS_URL_ENV: processes.redis_url, **env},
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    processes.running.append(process)
    wait_until(lambda: len(Worker.all(queue=queue)) > before, 20, what=f"the worker on {host} to register")
    return process


@pytest.mark.skipif(not can_set_host_name(), reason="needs `unshare --uts` (root) to give workers their own host names")
def test_workers_with_other_host_names_on_one_machine_share_its_gpu_ledger(
    make_service, processes: Processes, code_dir, tmp_path
) -> None:
    """A7: the ledger was keyed by the host name, which differs per container on one machine."""
    fake = str(gpu_file(tmp_path, [0]))
    service = gpu_service(make_service, code_dir, 1, useActiveGpu=False)
    worker_on_host(processes, "host-a", {"TRIALSTREAM_FAKE_GPUS": fake, "TRIALSTREAM_MACHINE_ID": "machine-1"})
    second_host = worker_on_host(
        processes, "host-b", {"TRIALSTREAM_FAKE_GPUS": fake, "TRIALSTREAM_MACHINE_ID": "machine-1"}
    )
    holder = service.submit_trial_job(form(0)).id
    running = wait_for_status(service, holder, "RUNNING")
    assert (running.worker or "").split(":")[0] in {"host-a", "host-b"}  # the other one, idle, defers the waiter
    waiter = service.submit_trial_job(form(1)).id
    waiting = wait_until(lambda: service.get_trial_job(waiter).message, 20, what="a deferral message")
    assert "waiting for 1 free GPU" in waiting
    wait_until(lambda: (Path(running.working_directory) / "cuda").exists(), 10)
    assert cuda_of(running) == "0"
    assert service.get_trial_job(waiter).status is TrialJobStatus.WAITING
    second_host.terminate()  # idle: it leaves at once; the waiter's next try finds the other machine
    second_host.wait(20)

    worker_on_host(processes, "host-a", {"TRIALSTREAM_FAKE_GPUS": fake, "TRIALSTREAM_MACHINE_ID": "machine-2"})

    other = wait_for_status(service, waiter, "RUNNING", timeout=60)  # its own ledger, where GPU 0 is free
    assert (other.worker or "").startswith("host-a:")  # the same host name as a worker of machine-1
    wait_until(lambda: (Path(other.working_directory) / "cuda").exists(), 10)
    assert cuda_of(other) == "0"
    assert service.get_trial_job(holder).status is TrialJobStatus.RUNNING
    release(service)
    for trial_id in (holder, waiter):
        assert wait_for_status(service, trial_id, "SUCCEEDED", "FAILED").status is TrialJobStatus.SUCCEEDED
