"""nnictl's registry file, against NNI's own reader, writer and lock (the installed `nni` package), on real files."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from manager import nnictl_registry
from manager.nnictl_registry import SETTLE_S, NnictlRegistry, RegistryLockTimeout
from schemas.nni_rest import ExperimentMetadata as RegistryEntry

config_utils = pytest.importorskip("nni.tools.nnictl.config_utils")
common_utils = pytest.importorskip("nni.tools.nnictl.common_utils")
filelock = pytest.importorskip("filelock")


def entry(experiment_id: str, **changes: Any) -> RegistryEntry:
    fields: dict[str, Any] = {
        "id": experiment_id,
        "port": 42259,
        "start_time": 1795391722459,
        "status": "RUNNING",
        "platform": "local",
        "experiment_name": "trialstream",
        "pid": os.getpid(),
        "log_dir": "/home/user/nni-experiments",
        "end_time": "N/A",
        "prefix_url": None,
    }
    return RegistryEntry(**{**fields, **changes})


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """NNI's home directory (`~/nni-experiments`) under a HOME of the test's own."""
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path / "nni-experiments"


def nni_experiments(home: Path) -> dict[str, Any]:
    """The registry as nnictl reads it (under its lock, on construction)."""
    return dict(config_utils.Experiments(home_dir=str(home)).get_all_experiments())


def lock_files(home: Path) -> list[Path]:
    return sorted(home.glob(".experiment.lock.*"))


def test_nni_reads_what_we_write_and_writes_it_back_byte_for_byte(home: Path) -> None:
    ours = entry("ours0001", experiment_name="café", tag=["a"], web_ui_url=["http://127.0.0.1:42259"])
    NnictlRegistry().register(ours)

    read = nni_experiments(home)
    assert list(read["ours0001"].items()) == list(ours.model_dump(by_alias=True).items())
    assert read["ours0001"]["endTime"] == "N/A" and read["ours0001"]["prefixUrl"] is None
    assert RegistryEntry.model_validate(read["ours0001"]) == ours

    written = (home / ".experiment").read_bytes()
    experiments = config_utils.Experiments(home_dir=str(home))
    experiments.write_file()  # nnictl's own serialisation of the same content
    assert (home / ".experiment").read_bytes() == written
    assert lock_files(home) == []


def test_an_entry_nni_wrote_is_kept_as_nni_wrote_it(home: Path) -> None:
    config_utils.Experiments(home_dir=str(home)).add_experiment(
        "nni00001", 8080, 1795391722459, "local", "naïve ☃", pid=12183, logDir=home
    )
    config_utils.Experiments(home_dir=str(home)).update_experiment("nni00001", "port", None)  # as NNI's manager does
    theirs = json.loads((home / ".experiment").read_text())["nni00001"]

    registry = NnictlRegistry()
    registry.register(entry("ours0001"))
    registry.update("ours0001", "DONE", 1795391742951)

    text = (home / ".experiment").read_text()
    assert json.loads(text)["nni00001"] == theirs
    experiments = config_utils.Experiments(home_dir=str(home))
    assert experiments.get_all_experiments()["nni00001"] == theirs
    experiments.write_file()
    assert (home / ".experiment").read_text() == text


def test_update_sets_status_and_end_time_and_remove_drops_the_entry(home: Path) -> None:
    registry = NnictlRegistry()
    registry.register(entry("ours0001"))
    registry.register(entry("ours0002"))

    registry.update("ours0001", "DONE", 1795391742951)
    assert registry.entries()["ours0001"]["status"] == "DONE"
    assert nni_experiments(home)["ours0001"]["endTime"] == 1795391742951

    registry.update("ours0001", "RUNNING", None)
    assert registry.entries()["ours0001"]["endTime"] == "N/A"

    registry.remove("ours0001")
    assert list(registry.entries()) == ["ours0002"]
    assert list(nni_experiments(home)) == ["ours0002"]


def test_update_or_remove_of_an_unknown_id_changes_nothing(home: Path) -> None:
    registry = NnictlRegistry()
    assert registry.entries() == {}
    registry.update("gone0001", "STOPPED", 1)
    assert not home.joinpath(".experiment").exists()

    registry.register(entry("ours0001"))
    before = home.joinpath(".experiment").stat()
    registry.update("gone0001", "STOPPED", 1)
    registry.remove("gone0001")
    after = home.joinpath(".experiment").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_an_unparseable_file_reads_as_empty_and_is_replaced_by_the_next_write(home: Path) -> None:
    home.mkdir()
    (home / ".experiment").write_text('{"nni00001": {"id": "nni0')
    registry = NnictlRegistry()
    assert registry.entries() == {}
    assert nni_experiments(home) == {}

    registry.register(entry("ours0001"))
    assert list(nni_experiments(home)) == ["ours0001"]


def test_the_path_is_expanded_at_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    registry = NnictlRegistry()
    monkeypatch.setenv("HOME", str(tmp_path / "later"))
    registry.register(entry("ours0001"))
    assert (tmp_path / "later" / "nni-experiments" / ".experiment").is_file()


def waits_then_releases(monkeypatch: pytest.MonkeyPatch, home: Path, release: Any) -> list[float]:
    """Replaces the registry's sleep: its first poll checks nothing was written yet, then lets the holder go."""
    polls: list[float] = []

    def sleep(seconds: float) -> None:
        if seconds == SETTLE_S:
            return
        if not polls:
            assert not (home / ".experiment").exists(), "written while another writer held the lock"
            release()
        polls.append(seconds)

    monkeypatch.setattr(nnictl_registry, "sleep", sleep)
    return polls


def test_a_fresh_lock_file_of_another_process_makes_the_write_wait(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home.mkdir()
    foreign = home / ".experiment.lock.4194303"
    foreign.touch()
    os.utime(foreign, (time.time() + 60, time.time() + 60))  # stays fresh however slow this machine is
    polls = waits_then_releases(monkeypatch, home, foreign.unlink)

    NnictlRegistry().register(entry("ours0001"))

    assert polls, "the write did not wait for the lock"
    assert list(nni_experiments(home)) == ["ours0001"]
    assert lock_files(home) == []


def test_nni_own_lock_held_in_a_thread_makes_the_write_wait(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home.mkdir()
    nni_lock = common_utils.get_file_lock(str(home / ".experiment"), stale=2)
    acquired, released = threading.Event(), threading.Event()

    def hold() -> None:
        with nni_lock:
            acquired.set()
            released.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert acquired.wait(30)

    def release() -> None:
        released.set()
        holder.join(30)

    polls = waits_then_releases(monkeypatch, home, release)
    NnictlRegistry().register(entry("ours0001"))

    assert polls
    assert list(nni_experiments(home)) == ["ours0001"]
    assert lock_files(home) == []


def test_nni_lock_waits_while_we_hold_ours(home: Path) -> None:
    home.mkdir()
    registry = NnictlRegistry()
    nni_lock = common_utils.get_file_lock(str(home / ".experiment"), stale=2)
    with registry._locked(), pytest.raises(filelock.Timeout):
        nni_lock.acquire(blocking=False)
    with nni_lock.acquire(blocking=False):
        pass


def test_a_stale_lock_file_does_not_block(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home.mkdir()
    stale_foreign = home / ".experiment.lock.4194303"
    stale_ours = home / f".experiment.lock.{os.getpid()}"  # left by a dead process that had our pid (containers)
    for lock in (stale_foreign, stale_ours):
        lock.touch()
        os.utime(lock, (time.time() - 10, time.time() - 10))
    polls = waits_then_releases(monkeypatch, home, lambda: pytest.fail("waited for a stale lock"))

    NnictlRegistry().register(entry("ours0001"))

    assert polls == []
    assert list(nni_experiments(home)) == ["ours0001"]
    assert lock_files(home) == [stale_foreign]  # NNI leaves others' stale files too


def test_a_lock_that_stays_names_its_files_in_the_error(home: Path) -> None:
    home.mkdir()
    foreign = home / ".experiment.lock.4194303"
    foreign.touch()
    os.utime(foreign, (time.time() + 60, time.time() + 60))

    with pytest.raises(RegistryLockTimeout, match=r"\.experiment\.lock\.4194303"):
        NnictlRegistry(lock_timeout=0.2).register(entry("ours0001"))
    assert lock_files(home) == [foreign]
    assert not (home / ".experiment").exists()


def add_ours(home: str, prefix: str, count: int, start: Any) -> None:
    start.wait()
    registry = NnictlRegistry(Path(home) / ".experiment", lock_timeout=60)
    for i in range(count):
        registry.register(entry(f"{prefix}{i:04d}"))


def add_nni(home: str, prefix: str, count: int, start: Any) -> None:
    start.wait()
    for i in range(count):
        experiments = config_utils.Experiments(home_dir=home)
        experiments.add_experiment(f"{prefix}{i:04d}", 8080, 1795391722459, "local", "nni", pid=1, logDir=home)


def test_concurrent_writers_ours_and_nni_lose_no_entry(home: Path) -> None:
    home.mkdir()
    count = 12
    context = multiprocessing.get_context("fork")
    start = context.Event()
    processes = [context.Process(target=add_ours, args=(str(home), f"p{n}", count, start)) for n in range(4)]
    processes.append(context.Process(target=add_nni, args=(str(home), "nni", count, start)))  # one: NNI races itself
    threads = [threading.Thread(target=add_ours, args=(str(home), f"t{n}", count, start)) for n in range(3)]
    starting: list[multiprocessing.process.BaseProcess | threading.Thread] = [*processes, *threads]
    for worker in starting:
        worker.start()
    start.set()
    for thread in threads:
        thread.join(120)
    for process in processes:
        process.join(120)
        assert process.exitcode == 0

    prefixes = ("p0", "p1", "p2", "p3", "nni", "t0", "t1", "t2")
    expected = {f"{prefix}{i:04d}" for prefix in prefixes for i in range(count)}
    assert set(NnictlRegistry(home / ".experiment").entries()) == expected
    assert set(nni_experiments(home)) == expected
    assert lock_files(home) == []
