"""GPU discovery and allocation for trials on one host.

Several RQ worker processes on a machine may start trials at the same time, so the choice of GPUs
is one optimistic transaction (WATCH/MULTI) against a shared ledger of who holds what: no lock that
could expire half-way, and a choice made from a ledger that changed meanwhile is never written.
The rules follow NNI's local training service: a GPU is usable when we do not occupy it and it runs
no compute process (unless ``useActiveGpu``), or when we occupy it with fewer than
``maxTrialNumberPerGpu`` trials.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pynvml
from redis import Redis, WatchError

from core import keys

NVIDIA_SMI_TIMEOUT_S = 15.0
_MIB = 1024 * 1024


def gpu_holders(host: str) -> str:
    """Hash: `<exp>/<trial>` -> the GPU indices it holds on `host` (the machine's ledger)."""
    return f"{keys.LOG_PREFIX}:gpu:{host}:holders"


@dataclass(frozen=True)
class GpuInfo:
    index: int
    active_processes: int
    memory_used_mib: int = 0
    memory_total_mib: int = 0


class GpuSource(Protocol):
    def gpus(self) -> list[GpuInfo]: ...


class GpuQueryError(RuntimeError):
    """A GPU tool exists but failed, which is not the same as "this machine has no GPU"."""


class NoGpuSource:
    """The source of a machine without an NVIDIA driver: requests for GPUs there are impossible."""

    def gpus(self) -> list[GpuInfo]:
        return []


class FakeGpuSource:
    """GPUs described by a JSON file, re-read on every call so tests can simulate activity."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def gpus(self) -> list[GpuInfo]:
        data = json.loads(self.path.read_text())
        return [
            GpuInfo(
                index=int(entry["index"]),
                active_processes=int(entry.get("active_processes", 0)),
                memory_used_mib=int(entry.get("memory_used_mib", 0)),
                memory_total_mib=int(entry.get("memory_total_mib", 0)),
            )
            for entry in data["gpus"]
        ]


class NvmlGpuSource:
    """GPUs read through NVML; construction fails with ``pynvml.NVMLError`` when there is no driver."""

    def __init__(self) -> None:
        pynvml.nvmlInit()

    def gpus(self) -> list[GpuInfo]:
        try:
            infos = []
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                infos.append(
                    GpuInfo(
                        index=index,
                        active_processes=len(pynvml.nvmlDeviceGetComputeRunningProcesses(handle)),
                        memory_used_mib=int(memory.used) // _MIB,
                        memory_total_mib=int(memory.total) // _MIB,
                    )
                )
            return infos
        except pynvml.NVMLError as exc:
            raise GpuQueryError(f"NVML query failed: {exc}") from exc


def _mib(field: str) -> int:
    """nvidia-smi prints "[N/A]" for memory it cannot read (some MIG or vGPU setups)."""
    try:
        return int(field)
    except ValueError:
        return 0


NVIDIA_SMI_GPUS = "--query-gpu=index,uuid,memory.used,memory.total"
NVIDIA_SMI_APPS = "--query-compute-apps=gpu_uuid,pid"
NVIDIA_SMI_FORMAT = "--format=csv,noheader,nounits"


def parse_nvidia_smi(gpu_rows: str, app_rows: str) -> list[GpuInfo]:
    """GPUs from the CSV of `nvidia-smi NVIDIA_SMI_GPUS` and `nvidia-smi NVIDIA_SMI_APPS` (both with
    NVIDIA_SMI_FORMAT), wherever they ran: here, or on a remote host."""

    def rows(text: str) -> list[list[str]]:
        return [[field.strip() for field in line.split(",")] for line in text.splitlines() if line.strip()]

    processes: dict[str, int] = {}
    for app in rows(app_rows):
        processes[app[0]] = processes.get(app[0], 0) + 1
    gpus = rows(gpu_rows)
    try:
        return sorted(
            (
                GpuInfo(
                    index=int(index),
                    active_processes=processes.get(uuid, 0),
                    memory_used_mib=_mib(used),
                    memory_total_mib=_mib(total),
                )
                for index, uuid, used, total in gpus
            ),
            key=lambda info: info.index,
        )
    except ValueError as exc:
        raise GpuQueryError(f"unexpected nvidia-smi output: {gpus!r}") from exc


class NvidiaSmiGpuSource:
    """GPUs read by running ``nvidia-smi``; a missing binary means the machine has no GPU."""

    def _query(self, executable: str, query: str) -> str:
        try:
            result = subprocess.run(
                [executable, query, NVIDIA_SMI_FORMAT],
                capture_output=True,
                text=True,
                timeout=NVIDIA_SMI_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise GpuQueryError(f"nvidia-smi {query} failed: {exc}") from exc
        if result.returncode != 0:
            message = (result.stderr or result.stdout).strip()
            raise GpuQueryError(f"nvidia-smi {query} exited {result.returncode}: {message}")
        return result.stdout

    def gpus(self) -> list[GpuInfo]:
        executable = shutil.which("nvidia-smi")
        if executable is None:
            return []
        return parse_nvidia_smi(self._query(executable, NVIDIA_SMI_GPUS), self._query(executable, NVIDIA_SMI_APPS))


def detect_gpu_source() -> GpuSource:
    """Pick the best available source; a machine without driver or tools simply has no GPU."""
    try:
        return NvmlGpuSource()
    except pynvml.NVMLError:
        pass
    if shutil.which("nvidia-smi") is not None:
        return NvidiaSmiGpuSource()
    return NoGpuSource()


@dataclass(frozen=True)
class GpuPolicy:
    gpu_number: int | None
    gpu_indices: tuple[int, ...] | None = None
    max_trials_per_gpu: int = 1
    use_active_gpu: bool = False

    def __post_init__(self) -> None:
        if self.gpu_number is not None and self.gpu_number < 0:
            raise ValueError(f"trialGpuNumber must be >= 0, got {self.gpu_number}")
        if self.max_trials_per_gpu < 1:
            raise ValueError(f"maxTrialNumberPerGpu must be >= 1, got {self.max_trials_per_gpu}")


class GpuRequestImpossible(Exception):
    """The request can never be met on this host (too few GPUs, or gpuIndices names one it lacks), busy or not:
    the trial must go to another host (local: another machine's worker; remote: another listed machine)."""


def _occupancy(holders: Mapping[str | bytes, str | bytes]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for raw in holders.values():
        for index in json.loads(raw):
            counts[index] = counts.get(index, 0) + 1
    return counts


def _join(indices: list[int]) -> str:
    return ",".join(str(index) for index in indices)


def choose_gpus(gpus: list[GpuInfo], occupancy: Mapping[int, int], policy: GpuPolicy) -> list[int] | None:
    """Pure: indices to use, [] when gpu_number is None/0, None when the request must wait.

    Raises GpuRequestImpossible when gpuIndices names a missing GPU or the trial asks for more GPUs
    than the (restricted) machine has.  Prefers the least-occupied usable GPUs, then the lowest index.
    """
    if not policy.gpu_number:
        return []
    by_index = {gpu.index: gpu for gpu in gpus}
    existing = sorted(by_index)
    if policy.gpu_indices is None:
        candidates = existing
        scope = f"GPUs: {_join(existing)}"
    else:
        missing = sorted(set(policy.gpu_indices) - set(by_index))
        if missing:
            what = f"GPU {missing[0]}, which does" if len(missing) == 1 else f"GPUs {_join(missing)}, which do"
            raise GpuRequestImpossible(f"gpuIndices names {what} not exist (GPUs: {_join(existing) or 'none'})")
        candidates = sorted(set(policy.gpu_indices))
        scope = f"gpuIndices {_join(candidates)}"
    if policy.gpu_number > len(candidates):
        asked = f"{policy.gpu_number} GPU" + ("" if policy.gpu_number == 1 else "s")
        has = f"{len(candidates)} ({scope})" if existing else "none"
        raise GpuRequestImpossible(f"trial asks for {asked} but this machine has {has}")

    def usable(index: int) -> bool:
        occupied = occupancy.get(index, 0)
        if occupied:
            return occupied < policy.max_trials_per_gpu
        return policy.use_active_gpu or by_index[index].active_processes == 0

    ranked = sorted((occupancy.get(index, 0), index) for index in candidates if usable(index))
    if len(ranked) < policy.gpu_number:
        return None
    return sorted(index for _, index in ranked[: policy.gpu_number])


def cuda_visible_devices(policy: GpuPolicy, indices: list[int]) -> str | None:
    """The value NNI's local service gives CUDA_VISIBLE_DEVICES; None means leave it unset."""
    if policy.gpu_number is None:
        return None
    if policy.gpu_number == 0:
        return "-1"
    return _join(indices)


class GpuLedger:
    """Shared record, in Redis, of which trials hold which GPUs on one machine.

    The holders hash is the single source of truth (occupancy is derived from it, so there is no
    counter to drift); a transaction that watches it makes read-choose-write atomic across workers.
    """

    def __init__(self, redis: Redis, host: str, source: GpuSource) -> None:
        self._redis = redis
        self._source = source
        self.holders_key = gpu_holders(host)

    def occupancy(self) -> dict[int, int]:
        return _occupancy(self._redis.hgetall(self.holders_key))

    def reserve(self, trial_key: str, policy: GpuPolicy) -> list[int] | None:
        """GPUs now held by ``trial_key``, or None when it must wait for busy GPUs.

        Idempotent: a trial that already holds GPUs gets the same ones back. Raises
        GpuRequestImpossible, and GpuQueryError when the GPU tools fail. When it raises, nothing
        was recorded (or, after a lost connection, possibly recorded: callers release in any case).
        """
        if not policy.gpu_number:
            return []
        with self._redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(self.holders_key)
                    # Queried while watching: a slow nvidia-smi blocks no one, and a retry sees fresh activity.
                    gpus = self._source.gpus()
                    holders = pipe.hgetall(self.holders_key)
                    held = holders.get(trial_key) or holders.get(trial_key.encode())
                    if held is not None:
                        return [int(index) for index in json.loads(held)]
                    chosen = choose_gpus(gpus, _occupancy(holders), policy)
                    if chosen is None:
                        return None
                    pipe.multi()
                    pipe.hset(self.holders_key, trial_key, json.dumps(chosen))
                    pipe.execute()
                    return chosen
                except WatchError:
                    continue  # another worker reserved meanwhile: choose again from what it left

    def release(self, trial_key: str) -> None:
        """Idempotent; a single HDEL is atomic, so no lock is needed."""
        self._redis.hdel(self.holders_key, trial_key)

    def release_everywhere(self, trial_key: str) -> None:
        """Release `trial_key` on every machine's ledger: whoever frees a lost attempt's GPUs may not
        know on which machine it ran."""
        for holders in self._redis.scan_iter(match=gpu_holders("*"), count=1000):
            self._redis.hdel(holders, trial_key)
