"""Tests for GPU discovery and allocation (workers/gpu.py).

GpuLedger tests run against a real redis-server started by pytest-redis's ``redisdb`` fixture.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
import redis

from core.settings import Settings
from tests.conftest import wait_until
from workers.platforms.local import adapter as local_adapter
from workers.platforms.local.adapter import LocalPlatform
from workers.platforms.local.gpus import _FORGET_UNCHANGED, MACHINES, handed_back, live_machines, record
from workers.platforms.shared import gpu
from workers.platforms.shared.gpu import (
    FakeGpuSource,
    GpuInfo,
    GpuLedger,
    GpuPolicy,
    GpuQueryError,
    GpuRequestImpossible,
    NoGpuSource,
    NvidiaSmiGpuSource,
    NvmlGpuSource,
    choose_gpus,
    cuda_visible_devices,
    detect_gpu_source,
)


def free(*indices: int) -> list[GpuInfo]:
    return [GpuInfo(index=i, active_processes=0) for i in indices]


class StaticSource:
    def __init__(self, gpus: list[GpuInfo]) -> None:
        self._gpus = gpus

    def gpus(self) -> list[GpuInfo]:
        return list(self._gpus)


# --- choose_gpus ---------------------------------------------------------------------------------


@pytest.mark.parametrize("number", [None, 0])
def test_no_gpu_request_gets_empty_list_even_without_gpus(number: int | None) -> None:
    assert choose_gpus([], {}, GpuPolicy(gpu_number=number)) == []
    assert choose_gpus(free(0), {0: 5}, GpuPolicy(gpu_number=number, gpu_indices=(9,))) == []


def test_free_gpus_are_chosen_lowest_index_first() -> None:
    assert choose_gpus(free(0, 1, 2), {}, GpuPolicy(gpu_number=1)) == [0]
    assert choose_gpus(free(0, 1, 2), {}, GpuPolicy(gpu_number=2)) == [0, 1]


def test_active_gpus_are_skipped() -> None:
    gpus = [GpuInfo(0, active_processes=1), GpuInfo(1, active_processes=0), GpuInfo(2, active_processes=3)]
    assert choose_gpus(gpus, {}, GpuPolicy(gpu_number=1)) == [1]
    assert choose_gpus(gpus, {}, GpuPolicy(gpu_number=2)) is None


def test_use_active_gpu_ignores_foreign_processes() -> None:
    gpus = [GpuInfo(0, active_processes=1), GpuInfo(1, active_processes=2)]
    assert choose_gpus(gpus, {}, GpuPolicy(gpu_number=2, use_active_gpu=True)) == [0, 1]
    # ... but never exceeds maxTrialNumberPerGpu on GPUs we occupy.
    assert choose_gpus(gpus, {0: 1}, GpuPolicy(gpu_number=2, use_active_gpu=True)) is None


def test_occupied_gpu_is_busy_with_default_max_trials() -> None:
    assert choose_gpus(free(0, 1), {0: 1}, GpuPolicy(gpu_number=1)) == [1]
    assert choose_gpus(free(0, 1), {0: 1, 1: 1}, GpuPolicy(gpu_number=1)) is None


def test_max_trials_per_gpu_shares_gpus_even_though_our_trials_are_active() -> None:
    # Our own trial shows up as an active process; sharing must still be allowed.
    gpus = [GpuInfo(0, active_processes=1)]
    policy = GpuPolicy(gpu_number=1, max_trials_per_gpu=2)
    assert choose_gpus(gpus, {0: 1}, policy) == [0]
    assert choose_gpus(gpus, {0: 2}, policy) is None


def test_least_occupied_gpus_are_preferred() -> None:
    policy = GpuPolicy(gpu_number=2, max_trials_per_gpu=3)
    gpus = [GpuInfo(0, 1), GpuInfo(1, 1), GpuInfo(2, 0), GpuInfo(3, 1)]
    assert choose_gpus(gpus, {0: 2, 1: 1, 3: 1}, policy) == [1, 2]


def test_gpu_indices_restrict_the_usable_set() -> None:
    policy = GpuPolicy(gpu_number=1, gpu_indices=(2, 1))
    assert choose_gpus(free(0, 1, 2), {}, policy) == [1]
    assert choose_gpus(free(0, 1, 2), {1: 1}, policy) == [2]
    assert choose_gpus(free(0, 1, 2), {1: 1, 2: 1}, policy) is None


def test_nonexistent_gpu_index_is_an_error() -> None:
    with pytest.raises(GpuRequestImpossible, match=r"gpuIndices names GPU 7, which does not exist \(GPUs: 0,1\)"):
        choose_gpus(free(0, 1), {}, GpuPolicy(gpu_number=1, gpu_indices=(0, 7)))
    with pytest.raises(GpuRequestImpossible, match=r"GPUs 5,7, which do not exist \(GPUs: none\)"):
        choose_gpus([], {}, GpuPolicy(gpu_number=1, gpu_indices=(7, 5)))


def test_asking_for_more_gpus_than_exist_is_impossible_not_a_wait() -> None:
    with pytest.raises(GpuRequestImpossible, match=r"asks for 3 GPUs but this machine has 2 \(GPUs: 0,1\)"):
        choose_gpus(free(0, 1), {}, GpuPolicy(gpu_number=3))
    with pytest.raises(GpuRequestImpossible, match=r"asks for 4 GPUs but this machine has 2 \(gpuIndices 0,1\)"):
        choose_gpus(free(0, 1, 2, 3), {}, GpuPolicy(gpu_number=4, gpu_indices=(0, 1)))
    with pytest.raises(GpuRequestImpossible, match=r"asks for 1 GPU but this machine has none"):
        choose_gpus([], {}, GpuPolicy(gpu_number=1))
    # Impossible even while every GPU is busy: the trial must not wait forever.
    with pytest.raises(GpuRequestImpossible):
        choose_gpus(free(0, 1), {0: 1, 1: 1}, GpuPolicy(gpu_number=3))


def test_asking_for_exactly_all_gpus_works_when_free() -> None:
    assert choose_gpus(free(0, 1, 2, 3), {}, GpuPolicy(gpu_number=4)) == [0, 1, 2, 3]
    assert choose_gpus(free(0, 1, 2), {}, GpuPolicy(gpu_number=2, gpu_indices=(0, 2))) == [0, 2]
    assert choose_gpus(free(0, 1, 2, 3), {3: 1}, GpuPolicy(gpu_number=4)) is None


def test_occupancy_of_vanished_gpus_is_ignored() -> None:
    assert choose_gpus(free(0), {5: 1}, GpuPolicy(gpu_number=1)) == [0]


@pytest.mark.parametrize(
    "kwargs", [{"gpu_number": -1}, {"gpu_number": 1, "max_trials_per_gpu": 0}], ids=["negative", "max0"]
)
def test_invalid_policy_is_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        GpuPolicy(**kwargs)


# --- cuda_visible_devices ------------------------------------------------------------------------


def test_cuda_visible_devices_follows_nni_local() -> None:
    assert cuda_visible_devices(GpuPolicy(gpu_number=None), []) is None
    assert cuda_visible_devices(GpuPolicy(gpu_number=0), []) == "-1"
    assert cuda_visible_devices(GpuPolicy(gpu_number=1), [3]) == "3"
    assert cuda_visible_devices(GpuPolicy(gpu_number=2), [0, 2]) == "0,2"


# --- sources -------------------------------------------------------------------------------------


def write_fake(path: Path, gpus: list[dict[str, int]]) -> None:
    path.write_text(json.dumps({"gpus": gpus}))


def test_fake_source_rereads_the_file_every_call(tmp_path: Path) -> None:
    path = tmp_path / "gpus.json"
    write_fake(path, [{"index": 0, "active_processes": 0}, {"index": 1, "active_processes": 0}])
    source = FakeGpuSource(str(path))
    assert source.gpus() == free(0, 1)
    write_fake(path, [{"index": 0, "active_processes": 2, "memory_used_mib": 10, "memory_total_mib": 80}])
    assert source.gpus() == [GpuInfo(0, active_processes=2, memory_used_mib=10, memory_total_mib=80)]


FAKE_SMI = """#!/bin/sh
here=$(dirname "$0")
[ "$2" = "--format=csv,noheader,nounits" ] || { echo "bad format: $2" >&2; exit 3; }
case "$1" in
  --query-gpu=index,uuid,memory.used,memory.total) cat "$here/gpus.csv" ;;
  --query-compute-apps=gpu_uuid,pid) cat "$here/apps.csv" ;;
  *) echo "unexpected query: $1" >&2; exit 2 ;;
esac
"""


@pytest.fixture
def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake ``nvidia-smi`` first on PATH; the test writes its gpus.csv and apps.csv."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "nvidia-smi"
    script.write_text(FAKE_SMI)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    (bindir / "apps.csv").write_text("")
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    return bindir


def test_nvidia_smi_source_maps_processes_by_uuid(fake_smi: Path) -> None:
    (fake_smi / "gpus.csv").write_text("1, GPU-bbbb, 2048, 81559\n0, GPU-aaaa, 5, 81559\n2, GPU-cccc, [N/A], [N/A]\n")
    (fake_smi / "apps.csv").write_text("GPU-bbbb, 101\nGPU-bbbb, 102\nGPU-cccc, 103\nGPU-gone, 104\n")
    assert NvidiaSmiGpuSource().gpus() == [
        GpuInfo(0, active_processes=0, memory_used_mib=5, memory_total_mib=81559),
        GpuInfo(1, active_processes=2, memory_used_mib=2048, memory_total_mib=81559),
        GpuInfo(2, active_processes=1, memory_used_mib=0, memory_total_mib=0),
    ]


def test_nvidia_smi_source_failure_is_an_error_not_no_gpus(fake_smi: Path) -> None:
    # gpus.csv missing: the script's cat fails and nvidia-smi exits non-zero.
    with pytest.raises(GpuQueryError, match="exited"):
        NvidiaSmiGpuSource().gpus()
    (fake_smi / "gpus.csv").write_text("garbage line\n")
    with pytest.raises(GpuQueryError, match="unexpected nvidia-smi output"):
        NvidiaSmiGpuSource().gpus()


def test_nvidia_smi_source_without_binary_has_no_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert NvidiaSmiGpuSource().gpus() == []


def no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)


def test_nvml_source_reads_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    mib = 1024 * 1024
    processes = {0: [], 1: [object(), object()]}
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 2)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: i)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", lambda h: processes[h])
    monkeypatch.setattr(
        pynvml, "nvmlDeviceGetMemoryInfo", lambda h: SimpleNamespace(used=(h + 1) * mib, total=80 * mib)
    )
    assert NvmlGpuSource().gpus() == [GpuInfo(0, 0, 1, 80), GpuInfo(1, 2, 2, 80)]

    def broken(handle: int) -> list[object]:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", broken)
    with pytest.raises(GpuQueryError, match="NVML query failed"):
        NvmlGpuSource().gpus()


def test_detect_uses_nvml_when_it_initialises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    assert isinstance(detect_gpu_source(), NvmlGpuSource)


def test_detect_falls_back_to_nvidia_smi(fake_smi: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    no_nvml(monkeypatch)
    (fake_smi / "gpus.csv").write_text("0, GPU-aaaa, 0, 100\n")
    source = detect_gpu_source()
    assert isinstance(source, NvidiaSmiGpuSource)
    assert source.gpus() == [GpuInfo(0, 0, 0, 100)]


def test_detect_without_driver_or_tools_means_no_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    no_nvml(monkeypatch)
    source = detect_gpu_source()
    assert isinstance(source, NoGpuSource)
    assert source.gpus() == []


def test_detect_never_raises_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unpatched: on a machine without a driver NVML raises LibraryNotFound, which must be caught."""
    assert isinstance(detect_gpu_source().gpus(), list)


# --- GpuLedger (real redis-server) ---------------------------------------------------------------


def second_client(client: redis.Redis, cls: type[redis.Redis] = redis.Redis, **overrides: Any) -> redis.Redis:
    """Another client (its own connection pool) to the same server, as another worker process has."""
    pool = client.connection_pool
    kwargs = {**pool.connection_kwargs, **overrides}
    return cls(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs))


class SlowSource(StaticSource):
    """Widens the read-choose-write window (GPUs are queried inside it), so that a missing transaction
    would show as a double booking."""

    def gpus(self) -> list[GpuInfo]:
        time.sleep(0.05)
        return super().gpus()


class SlowRedis(redis.Redis):
    """Slow reads: a host lock with a short TTL would expire while they run."""

    def hgetall(self, name: Any) -> Any:
        time.sleep(0.05)
        return super().hgetall(name)


@pytest.fixture
def clients(redisdb: redis.Redis) -> Iterator[tuple[redis.Redis, redis.Redis]]:
    a, b = second_client(redisdb, SlowRedis), second_client(redisdb, SlowRedis)
    yield a, b
    a.close()
    b.close()


ONE = GpuPolicy(gpu_number=1)


def test_reserve_records_holder_and_release_frees(redisdb: redis.Redis) -> None:
    ledger = GpuLedger(redisdb, "host1", StaticSource(free(0, 1)))
    assert ledger.reserve("exp/t1", ONE) == [0]
    assert ledger.reserve("exp/t2", ONE) == [1]
    assert ledger.reserve("exp/t3", ONE) is None
    held = redisdb.hget("ts:gpu:host1:holders", "exp/t1")
    assert held is not None
    assert json.loads(held) == [0]
    assert ledger.occupancy() == {0: 1, 1: 1}
    ledger.release("exp/t1")
    assert ledger.occupancy() == {1: 1}
    assert ledger.reserve("exp/t3", ONE) == [0]


def test_reserve_is_idempotent(redisdb: redis.Redis) -> None:
    ledger = GpuLedger(redisdb, "host1", StaticSource(free(0, 1, 2)))
    assert ledger.reserve("t1", GpuPolicy(gpu_number=2)) == [0, 1]
    assert ledger.reserve("t1", GpuPolicy(gpu_number=2)) == [0, 1]
    assert ledger.occupancy() == {0: 1, 1: 1}


def test_release_is_idempotent(redisdb: redis.Redis) -> None:
    ledger = GpuLedger(redisdb, "host1", StaticSource(free(0)))
    ledger.release("never-reserved")
    assert ledger.reserve("t1", ONE) == [0]
    ledger.release("t1")
    ledger.release("t1")
    assert ledger.occupancy() == {}


def test_no_gpu_request_touches_nothing(redisdb: redis.Redis) -> None:
    ledger = GpuLedger(redisdb, "host1", NoGpuSource())
    assert ledger.reserve("t1", GpuPolicy(gpu_number=None)) == []
    assert ledger.reserve("t2", GpuPolicy(gpu_number=0)) == []
    assert redisdb.exists("ts:gpu:host1:holders") == 0


def test_impossible_request_raises_and_records_nothing(redisdb: redis.Redis) -> None:
    ledger = GpuLedger(redisdb, "host1", StaticSource(free(0, 1)))
    with pytest.raises(GpuRequestImpossible, match="asks for 3 GPUs but this machine has 2"):
        ledger.reserve("t1", GpuPolicy(gpu_number=3))
    with pytest.raises(GpuRequestImpossible, match="GPU 7"):
        ledger.reserve("t1", GpuPolicy(gpu_number=1, gpu_indices=(7,)))
    assert ledger.occupancy() == {}


def test_sharing_up_to_max_trials_per_gpu(redisdb: redis.Redis) -> None:
    ledger = GpuLedger(redisdb, "host1", StaticSource(free(0)))
    policy = GpuPolicy(gpu_number=1, max_trials_per_gpu=2)
    assert ledger.reserve("t1", policy) == [0]
    assert ledger.reserve("t2", policy) == [0]
    assert ledger.reserve("t3", policy) is None
    assert ledger.occupancy() == {0: 2}


def test_hosts_are_independent(redisdb: redis.Redis) -> None:
    a = GpuLedger(redisdb, "host-a", StaticSource(free(0)))
    b = GpuLedger(redisdb, "host-b", StaticSource(free(0)))
    assert a.reserve("t1", ONE) == [0]
    assert b.reserve("t2", ONE) == [0]
    assert a.occupancy() == {0: 1}


def test_works_with_decoded_responses(redisdb: redis.Redis) -> None:
    client = second_client(redisdb, decode_responses=True)
    ledger = GpuLedger(client, "host1", StaticSource(free(0, 1)))
    assert ledger.reserve("t1", ONE) == [0]
    assert ledger.reserve("t1", ONE) == [0]
    assert ledger.occupancy() == {0: 1}
    client.close()


def test_waits_while_a_foreign_process_is_active(redisdb: redis.Redis, tmp_path: Path) -> None:
    path = tmp_path / "gpus.json"
    write_fake(path, [{"index": 0, "active_processes": 1}])
    ledger = GpuLedger(redisdb, "host1", FakeGpuSource(path))
    assert ledger.reserve("t1", ONE) is None
    write_fake(path, [{"index": 0, "active_processes": 0}])
    assert ledger.reserve("t1", ONE) == [0]


def test_two_ledgers_competing_for_one_gpu_never_share_it(clients: tuple[redis.Redis, redis.Redis]) -> None:
    ledgers = [GpuLedger(client, "host1", SlowSource(free(0))) for client in clients]
    for round_ in range(10):
        barrier = threading.Barrier(2)

        def attempt(i: int, barrier: threading.Barrier = barrier, round_: int = round_) -> list[int] | None:
            barrier.wait()
            return ledgers[i].reserve(f"r{round_}-t{i}", ONE)

        with ThreadPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(attempt, range(2)))
        assert sorted(results, key=lambda r: r is None) == [[0], None], f"round {round_}: {results}"
        winner = results.index([0])
        assert ledgers[0].occupancy() == {0: 1}
        ledgers[1 - winner].release(f"r{round_}-t{winner}")  # either ledger may release
        assert ledgers[winner].occupancy() == {}


def test_many_trials_get_disjoint_gpus(clients: tuple[redis.Redis, redis.Redis]) -> None:
    ledgers = [GpuLedger(client, "host1", SlowSource(free(0, 1, 2, 3))) for client in clients]
    barrier = threading.Barrier(8)

    def attempt(i: int) -> list[int] | None:
        barrier.wait()
        return ledgers[i % 2].reserve(f"t{i}", ONE)

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(attempt, range(8)))
    granted = [r for r in results if r is not None]
    assert sorted(index for r in granted for index in r) == [0, 1, 2, 3]
    assert results.count(None) == 4
    assert ledgers[0].occupancy() == {0: 1, 1: 1, 2: 1, 3: 1}


class InterferingSource(StaticSource):
    """Another worker's reservation lands while this one is choosing: exactly when a lost update would happen."""

    def __init__(self, gpus: list[GpuInfo], other: GpuLedger, times: int = 1) -> None:
        super().__init__(gpus)
        self._other = other
        self._times = times
        self.calls = 0

    def gpus(self) -> list[GpuInfo]:
        self.calls += 1
        if self.calls <= self._times:
            assert self._other.reserve(f"other-{self.calls}", ONE) is not None
        return super().gpus()


def test_a_reservation_made_while_choosing_is_seen_and_never_overwritten(redisdb: redis.Redis) -> None:
    """Replaces a test that slept 0.3 s and hoped: the competing write is made at the exact moment."""
    other = GpuLedger(second_client(redisdb), "host1", StaticSource(free(0, 1, 2)))
    source = InterferingSource(free(0, 1, 2), other, times=2)
    ledger = GpuLedger(redisdb, "host1", source)

    assert ledger.reserve("t1", ONE) == [2]  # GPUs 0 and 1 were taken meanwhile, one per try

    assert source.calls == 3
    assert ledger.occupancy() == {0: 1, 1: 1, 2: 1}


def test_an_expiring_lock_never_leaves_gpus_held_by_a_failed_reservation(
    redisdb: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (A6): a host lock that expired between HSET and its release raised after recording
    the GPUs, outside the caller's try/finally, so an ended attempt held them for ever. Reserving takes
    no lock now, whatever its TTL would be."""
    monkeypatch.setattr(gpu, "LOCK_TTL_S", 0.01, raising=False)
    slow = second_client(redisdb, SlowRedis)
    ledger = GpuLedger(slow, "host1", StaticSource(free(0)))
    try:
        reserved = ledger.reserve("t1", ONE)
    except redis.RedisError:
        reserved = None
    held = redisdb.hget("ts:gpu:host1:holders", "t1")
    assert (reserved, held and json.loads(held)) in ((None, None), ([0], [0]))  # an error leaves nothing held
    assert reserved == [0]


# --- the local platform's machines (workers/platforms/local/gpus.py) ---------------------------------------------


def test_a_machine_that_can_never_run_a_trial_says_whether_another_with_a_live_worker_can(
    client: redis.Redis,
) -> None:
    impossible = "trial asks for 2 GPUs but this machine has none"
    record(client, "cpu-box", [], 60)
    alone = handed_back(client, "cpu-box", impossible, 2, None)
    assert alone == (
        f"host {socket.gethostname()}: {impossible}; no other machine with a live local worker has enough:"
        " waiting for a worker"
        " of one that has"
    )
    record(client, "gpu-box", [0, 1], 60)
    assert handed_back(client, "cpu-box", impossible, 2, None) == (
        f"host {socket.gethostname()}: {impossible}; handed back for a worker of a machine with enough"
    )
    assert handed_back(client, "cpu-box", impossible, 2, [0, 5]) == alone  # a worker gives none where GPU 5 is missing
    client.hset(MACHINES, "old-box", json.dumps([0, 1, 2]))  # an earlier version's record: never renewed, not counted
    assert live_machines(client) == {"cpu-box": [], "gpu-box": [0, 1]}


def test_a_worker_recording_its_machine_lets_lapsed_records_go_but_not_one_renewed_meanwhile(
    client: redis.Redis,
) -> None:
    record(client, "gpu-box", [0, 1], 60)
    client.hset(MACHINES, "gone-box", json.dumps({"gpus": [0], "until": 1}))  # its workers went long ago
    client.hset(MACHINES, "old-box", json.dumps([0, 1, 2]))  # an earlier version's record, never renewed
    record(client, "cpu-box", [], 60)
    assert sorted(client.hkeys(MACHINES)) == ["cpu-box", "gpu-box"]

    # read as lapsed, then renewed by its worker before the delete: the delete leaves the new record alone
    stale, renewed = json.dumps({"gpus": [0], "until": 1}), json.dumps({"gpus": [0], "until": 2**40})
    client.hset(MACHINES, "late-box", renewed)
    client.register_script(_FORGET_UNCHANGED)(keys=[MACHINES], args=["late-box", stale])
    assert client.hget(MACHINES, "late-box") == renewed


class AnswersLate:
    """GPU tools that fail `failures` times, then answer; counting the calls."""

    def __init__(self, failures: int, gpus: list[GpuInfo]) -> None:
        self.failures, self.answer, self.calls = failures, gpus, 0

    def gpus(self) -> list[GpuInfo]:
        self.calls += 1
        if self.calls <= self.failures:
            raise GpuQueryError("nvidia-smi did not answer within 15 s")
        return list(self.answer)


def test_a_worker_asks_for_its_machines_gpus_until_they_answer_then_renews_what_they_said(
    client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each renewal asking nvidia-smi again could hold the worker's housekeeping for its whole timeout."""
    source = AnswersLate(1, free(0, 1))
    monkeypatch.setattr(local_adapter, "gpu_source", lambda settings: source)
    environment = {"TRIALSTREAM_MACHINE_ID": "late-box", "TRIALSTREAM_GPU_RECORD_TTL_S": "3"}
    platform = LocalPlatform(Settings.from_environment(environment), client)

    def until() -> int:
        return int(json.loads(client.hget(MACHINES, "late-box") or "{}").get("until", 0))

    def renewed_since(before: int) -> bool:
        platform.keep_alive()  # as the worker's housekeeping does, each round
        return until() > before

    try:
        platform.keep_alive()
        assert "late-box" not in live_machines(client)  # the tools failed: nothing said on their word
        platform.keep_alive()  # asked again on the next round, not a third of the TTL later
        assert live_machines(client)["late-box"] == [0, 1]
        first = until()
        source.answer = free(0)  # were the tools asked again, they would say otherwise
        wait_until(lambda: renewed_since(first), 10, what="the record renewed")
        assert live_machines(client)["late-box"] == [0, 1]
        assert source.calls == 2
    finally:
        platform.close()
