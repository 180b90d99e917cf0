"""GPU scheduling on real NVIDIA GPUs, read through NVML and nvidia-smi, with real workers and trials.

Skipped where NVML finds no GPU (CI has none); run on a GPU machine. Each trial holds its GPU until
the test releases it, so what runs at once is decided by the scheduler, not by timing.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pynvml
import pytest

from core.event_store import StoredEvent
from schemas.events import TrialEnded, TrialStarted
from schemas.trial import TrialJobStatus
from tests.conftest import Processes, ServiceFactory, form, wait_for_status, wait_until
from workers.platforms.shared.gpu import NvidiaSmiGpuSource, NvmlGpuSource


def _gpu_count() -> int:
    try:
        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError:
        return 0


GPUS = _gpu_count()
pytestmark = pytest.mark.skipif(GPUS == 0, reason="no NVIDIA GPU: NVML found none")

TRIAL = """
import json, os, sys, time
sys_dir = os.environ["NNI_SYS_DIR"]
seen = {"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "order": os.environ.get("CUDA_DEVICE_ORDER")}
try:
    import torch
    seen["torch_devices"] = torch.cuda.device_count()
    seen["name"] = torch.cuda.get_device_name(0) if seen["torch_devices"] else None
except ImportError:
    pass
json.dump(seen, open(os.path.join(sys_dir, "seen.json"), "w"))
release = os.path.join(os.path.dirname(os.path.dirname(sys_dir)), "release")
deadline = time.time() + 120
while not os.path.exists(release) and time.time() < deadline:
    time.sleep(0.05)
"""


def gpu_service(make_service: ServiceFactory, code_dir: Path, gpus: int):
    (code_dir / "trial.py").write_text(textwrap.dedent(TRIAL))
    platform = {"platform": "local", "useActiveGpu": True}  # a shared machine may run other GPU programs
    return make_service(f"{sys.executable} trial.py", platform_config=platform, gpu_number=gpus)


def seen_by(working_directory: str) -> dict:
    """What the trial saw of its GPUs, once it has written it down."""
    path = Path(working_directory) / "seen.json"
    wait_until(path.exists, 60, what=f"{path} to be written")
    return dict(json.loads(path.read_text()))


def test_nvml_and_nvidia_smi_see_the_same_gpus() -> None:
    nvml = NvmlGpuSource().gpus()
    assert [gpu.index for gpu in nvml] == list(range(GPUS))
    assert all(gpu.memory_total_mib > 0 for gpu in nvml)
    smi = NvidiaSmiGpuSource().gpus()
    assert [(gpu.index, gpu.memory_total_mib) for gpu in smi] == [(gpu.index, gpu.memory_total_mib) for gpu in nvml]


def test_each_trial_gets_a_gpu_of_its_own_and_one_more_waits_for_a_free_one(
    make_service: ServiceFactory, processes: Processes, code_dir: Path
) -> None:
    service = gpu_service(make_service, code_dir, 1)
    processes.worker(args=("--concurrency", str(GPUS + 1)))
    trial_ids = [service.submit_trial_job(form(n)).id for n in range(GPUS + 1)]
    *first, extra = trial_ids
    running = [wait_for_status(service, trial_id, "RUNNING", timeout=60) for trial_id in first]
    seen = [seen_by(trial.working_directory) for trial in running]
    assert sorted(s["cuda"] for s in seen) == [str(index) for index in range(GPUS)]  # one GPU each, all used
    assert all(s["order"] == "PCI_BUS_ID" for s in seen)
    if "torch_devices" in seen[0]:
        assert all(s["torch_devices"] == 1 for s in seen)  # the trial sees its GPU and no other
    waiting = service.get_trial_job(extra)
    assert waiting.status is TrialJobStatus.WAITING and "waiting for 1 free GPU" in (waiting.message or "")

    (Path(running[0].working_directory).parent.parent / "release").touch()
    for trial_id in trial_ids:
        assert wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=90).status is TrialJobStatus.SUCCEEDED
    events = [e.event for e in service.store.read() if isinstance(e, StoredEvent)]
    first_end = min(e.time for e in events if isinstance(e, TrialEnded))
    extra_start = next(e for e in events if isinstance(e, TrialStarted) and e.trial_id == extra)
    assert extra_start.time >= first_end  # it started only once a GPU was free


def test_a_trial_asking_for_more_gpus_than_the_machine_has_waits_saying_why(
    make_service: ServiceFactory, processes: Processes, code_dir: Path
) -> None:
    """No other machine serves the queue: the trial waits for a worker of one with enough GPUs."""
    service = gpu_service(make_service, code_dir, GPUS + 1)
    processes.worker()
    trial_id = service.submit_trial_job(form(0)).id
    message = wait_until(lambda: service.get_trial_job(trial_id).message, 60, what="a deferral message")
    assert f"asks for {GPUS + 1} GPUs but this machine has {GPUS}" in message
    assert "no other machine with a live local worker has enough" in message
    assert service.get_trial_job(trial_id).status is TrialJobStatus.WAITING
