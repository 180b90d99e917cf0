"""The remote platform beyond the conformance suite, on real sshd hosts: dropped connections, hosts that
go away, restarted workers, metrics read exactly once, cancel of a whole process tree, clean-up, the
code directory's upload, GPU scheduling across machines (a fake `nvidia-smi` on each host's PATH)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import redis

from core import keys
from core.connections import same_server
from manager.experiments import finish_experiment
from manager.projector import Projector
from manager.training_service import TrainingService
from schemas.events import TrialEnded, TrialReattached, TrialStarted, TrialUnreachable
from schemas.trial import TrialJobStatus
from simulators.sshd import SshHost, SshUser
from tests.api.test_timeline_page import drawn, ready
from tests.conftest import Processes, form, wait_for_status, wait_until
from tests.support.browser import Browser, browser  # noqa: F401  (the fixture)
from tests.support.conformance import history
from tests.support.remote_setup import RemoteWorkers


@pytest.fixture
def tmp_path(shared_tmp_path: Path) -> Path:
    """Trials on the hosts (another user) read and write the markers these tests create."""
    return shared_tmp_path


def periodical(service: TrainingService, trial_id: str) -> list[int]:
    Projector(service.store.client).catch_up(service.experiment_id)
    return sorted(m.sequence for m in service.views.metrics(trial_id) if m.type == "PERIODICAL")


def attempt_dir(host: SshHost, service: TrainingService, trial_id: str, attempt: int = 1) -> Path:
    """The attempt's directory as the tests see it (each host's home is a directory of the tests)."""
    return host.home / ".trialstream" / "experiments" / service.experiment_id / trial_id / f"attempt-{attempt}"


def host_of(hosts: list[SshHost], service: TrainingService, trial_id: str) -> SshHost:
    """Where the trial's latest attempt runs (its TrialStarted may land a moment after the trial started)."""
    url = wait_until(lambda: service.get_trial_job(trial_id).url, 30, what=f"trial {trial_id} to have started")
    return next(host for host in hosts if f"@{host.address}:{host.port}/" in url)


def test_a_dropped_connection_is_reestablished_and_no_metric_is_lost_or_repeated(
    remote, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost], tmp_path: Path
) -> None:
    service = remote()
    remote_workers.start()
    gate, started = tmp_path / "gate", tmp_path / "started"
    trial_id = service.submit_trial_job(
        form(0, before=[0, 1, 2], gate=str(gate), started=str(started), after=[3, 4])
    ).id
    wait_until(started.exists, 30, what="the trial to report its first metrics")
    wait_until(lambda: periodical(service, trial_id) == [0, 1, 2], 30, what="metrics 0-2")
    host = host_of(ssh_hosts, service, trial_id)
    for _ in range(3):  # every connection of the worker to the host dies, three times over
        assert host.kill_sessions() > 0
        wait_until(lambda: host.session_pids(), 30, what="the worker to reconnect")
    gate.touch()
    trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.SUCCEEDED, trial.message
    assert periodical(service, trial_id) == [0, 1, 2, 3, 4]
    assert len([e for e in history(service, trial_id) if isinstance(e, TrialStarted)]) == 1


def test_a_restarted_worker_resumes_reading_from_the_committed_offsets(
    remote, remote_workers: RemoteWorkers, client: redis.Redis, tmp_path: Path
) -> None:
    service = remote()
    fast = {"TRIALSTREAM_TRIAL_LEASE_S": "1"}
    victim = remote_workers.start(env=fast)
    gate, started = tmp_path / "gate", tmp_path / "started"
    trial_id = service.submit_trial_job(form(0, before=[0, 1], gate=str(gate), started=str(started), after=[2])).id
    wait_until(lambda: periodical(service, trial_id) == [0, 1], 30, what="metrics 0-1")
    offsets = client.hgetall(keys.read_offsets(service.experiment_id, trial_id, 1))
    assert int(offsets["stdout"]) > 0  # committed with the metrics
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    remote_workers.start(env=fast)
    wait_until(lambda: service.get_trial_job(trial_id).worker != f"{trial_id}", 30)
    gate.touch()
    trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.SUCCEEDED and trial.attempt == 1, trial.message
    assert periodical(service, trial_id) == [0, 1, 2]
    reported = [e for e in service.store.read() if getattr(e.event, "trial_id", None) == trial_id]
    sequences = [e.event.sequence for e in reported if type(e.event).__name__ == "TrialMetricReported"]
    assert sorted(sequences) == [0, 0, 1, 2]  # each PERIODICAL once (and the FINAL): nothing read twice
    assert not client.exists(keys.read_offsets(service.experiment_id, trial_id, 1))  # gone with the attempt


def _cut(host: SshHost) -> None:
    """A network partition: the host's link goes down, its processes run on."""
    subprocess.run(["ip", "link", "set", str(host.veth), "down"], check=True)
    subprocess.run(["ip", "route", "replace", "unreachable", str(host.subnet)], check=True)


def _heal(host: SshHost) -> None:
    subprocess.run(["ip", "route", "del", "unreachable", str(host.subnet)], check=True)
    subprocess.run(["ip", "link", "set", str(host.veth), "up"], check=True)


def test_a_partitioned_host_makes_its_trial_unknown_and_the_trial_goes_on_when_it_is_back(
    remote,
    remote_workers: RemoteWorkers,
    ssh_hosts: list[SshHost],
    tmp_path: Path,
    processes: Processes,
    browser: Browser,  # noqa: F811
) -> None:
    """Watched on the experiment's timeline page as it happens (issue 28): the UNKNOWN period drawn live."""
    host = ssh_hosts[0]
    if host.veth is None:
        pytest.skip("partitions need the network-namespace hosts")
    service = remote(hosts=[host], unreachableTimeout="5m")
    remote_workers.start()
    gate, started = tmp_path / "gate", tmp_path / "started"
    trial_id = service.submit_trial_job(form(0, before=[0], gate=str(gate), started=str(started), after=[1])).id
    wait_until(lambda: periodical(service, trial_id) == [0], 30, what="metric 0")
    driver = browser.driver
    driver.get(f"{processes.manager()}/timeline/{service.experiment_id}")
    ready(driver)
    key = f"{trial_id}/1"
    assert drawn(driver)[key]["outcome"] == "RUNNING"
    assert [f"{host.address}:{host.port}" in lane for lane in drawn(driver)[key]["lanes"]] == [True]
    _cut(host)
    try:
        unknown = wait_for_status(service, trial_id, "UNKNOWN", timeout=60)
        assert "unreachable" in (unknown.message or "")
        wait_until(lambda: drawn(driver)[key]["outcome"] == "UNKNOWN", 30, what="the page to follow the log")
        browser.screenshot("host-cut-off")
        gate.touch()  # the trial finishes while its host cannot be reached
    finally:
        _heal(host)
    trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.SUCCEEDED, trial.message
    assert periodical(service, trial_id) == [0, 1]
    reasons = [e.reason for e in history(service, trial_id) if isinstance(e, TrialUnreachable)]
    assert reasons[0] and reasons[-1] is None  # UNKNOWN, then reachable again
    wait_until(lambda: drawn(driver)[key]["outcome"] == "SUCCEEDED", 30, what="the page to show the end")
    [(cut_at, back_at)] = drawn(driver)[key]["unknown"]
    assert cut_at is not None and back_at is not None and cut_at < back_at
    browser.screenshot("host-back")
    assert browser.uncaught_errors() == []


@pytest.mark.parametrize("retries", [0, 1])
def test_a_host_that_stays_down_fails_its_trial_or_retries_it_elsewhere(
    remote, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost], tmp_path: Path, retries: int
) -> None:
    marker, gate = tmp_path / "marker", tmp_path / "gate"
    # the first attempt starts the marker and holds; a retry finds the marker and does not hold
    command = f"test -e {marker} || {{ touch {marker}; while [ ! -e {gate} ]; do sleep 0.05; done; }}"
    service = remote(command=command, unreachableTimeout="3s", max_retries=retries)
    remote_workers.start()
    trial_id = service.submit_trial_job(form(0)).id
    wait_until(marker.exists, 30, what="the first attempt to start")
    first = host_of(ssh_hosts, service, trial_id)
    # it cannot be reached for good: cut off (its trial runs on there, unseen), or stopped where there is no
    # namespace to cut (its trial dies with it, which the worker may see first: then it says so instead)
    if first.veth is not None:
        _cut(first)
    else:
        first.stop()
    try:
        trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=90)
    finally:
        if first.veth is not None:
            _heal(first)
    if first.veth is None and not retries and "unreachable" not in (trial.message or ""):
        assert "ended without an exit code" in (trial.message or "")
        return
    if retries:
        assert trial.status is TrialJobStatus.SUCCEEDED and trial.attempt == 2, trial.message
        assert host_of(ssh_hosts, service, trial_id) is not first
    else:
        assert trial.status is TrialJobStatus.FAILED
        assert "unreachable" in (trial.message or "") and first.address in (trial.message or "")


def test_a_rebooted_host_fails_its_trial_saying_so(
    remote, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost], tmp_path: Path
) -> None:
    service = remote(hosts=ssh_hosts[:1])
    remote_workers.start()
    gate, started = tmp_path / "gate", tmp_path / "started"
    trial_id = service.submit_trial_job(form(0, gate=str(gate), started=str(started))).id
    wait_until(started.exists, 30, what="the trial to start")
    ssh_hosts[0].reboot()
    trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.FAILED
    assert "rebooted" in (trial.message or "")


def test_cancel_kills_the_trial_s_whole_process_tree_on_its_host(
    remote, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost], tmp_path: Path
) -> None:
    command = f"sh -c 'sleep 3001 & sleep 3002 & touch {tmp_path}/started; wait'"
    service = remote(hosts=ssh_hosts[:1], command=command)
    remote_workers.start()
    trial_id = service.submit_trial_job(form(0)).id
    wait_until((tmp_path / "started").exists, 30, what="the trial's children to start")
    host = ssh_hosts[0]
    assert len(_sleepers(host)) == 2
    service.cancel_trial_job(trial_id)
    assert wait_for_status(service, trial_id, "USER_CANCELED").status is TrialJobStatus.USER_CANCELED
    wait_until(lambda: not _sleepers(host), 30, what="every process of the trial to be gone")


def _sleepers(host: SshHost) -> list[int]:
    found = []
    for pid in host.processes():
        try:
            if b"sleep\x00300" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


@pytest.mark.parametrize("keep", [False, True])
def test_clean_up_removes_the_experiment_s_files_on_the_hosts_unless_kept(
    remote, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost], client: redis.Redis, keep: bool
) -> None:
    service = remote(keepTrialFiles=keep)
    remote_workers.start()
    trial_ids = [service.submit_trial_job(form(n)).id for n in range(2)]
    for trial_id in trial_ids:
        assert wait_for_status(service, trial_id, "SUCCEEDED", "FAILED").status is TrialJobStatus.SUCCEEDED
    directories = [attempt_dir(host_of(ssh_hosts, service, t), service, t) for t in trial_ids]
    assert all((directory / "stdout").exists() for directory in directories)
    finish_experiment(client, same_server(client, decode=False), service.experiment_id, "remote", "DONE")
    experiment_dirs = {directory.parent.parent for directory in directories}
    if keep:
        wait_until(lambda: _clean_up_ran(client, service), 30, what="the clean-up job")
        assert all(directory.exists() for directory in experiment_dirs)
    else:
        wait_until(lambda: not any(d.exists() for d in experiment_dirs), 30, what="the files to go")


def _clean_up_ran(client: redis.Redis, service: TrainingService) -> bool:
    from rq import Queue

    from core.queueing import SERIALIZER, queue_name

    queue = Queue(queue_name("remote"), connection=same_server(client, decode=False), serializer=SERIALIZER)
    return any(
        job_id.startswith(f"{service.experiment_id}--clean-up") for job_id in queue.finished_job_registry.get_job_ids()
    )


def test_the_code_is_uploaded_once_per_machine_and_never_served_stale(
    remote, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost], code_dir: Path
) -> None:
    (code_dir / ".nniignore").write_text("data/\n*.log\n!keep.log\n")
    (code_dir / "data").mkdir()
    (code_dir / "data" / "big.bin").write_bytes(b"x" * 1000)
    (code_dir / "noise.log").write_text("ignored")
    (code_dir / "keep.log").write_text("kept")
    (code_dir / "version.txt").write_text("one")
    remote_workers.start(args=("--concurrency", "4"))
    first = remote(hosts=ssh_hosts[:1], keepTrialFiles=True)
    trial_ids = [first.submit_trial_job(form(n)).id for n in range(3)]
    for trial_id in trial_ids:
        assert wait_for_status(first, trial_id, "SUCCEEDED", "FAILED").status is TrialJobStatus.SUCCEEDED
    code_root = ssh_hosts[0].home / ".trialstream" / "code"
    published = [path for path in code_root.iterdir() if path.is_symlink()]
    assert len(published) == 1  # three trials, one upload
    copy = attempt_dir(ssh_hosts[0], first, trial_ids[0]) / "code"
    assert sorted(p.name for p in copy.iterdir()) == [".nniignore", "keep.log", "trial.py", "version.txt"]
    (code_dir / "version.txt").write_text("two")  # the next experiment's code differs
    second = remote(hosts=ssh_hosts[:1], keepTrialFiles=True)
    trial_id = second.submit_trial_job(form(0)).id
    assert wait_for_status(second, trial_id, "SUCCEEDED", "FAILED").status is TrialJobStatus.SUCCEEDED
    assert (attempt_dir(ssh_hosts[0], second, trial_id) / "code" / "version.txt").read_text() == "two"
    assert len([path for path in code_root.iterdir() if path.is_symlink()]) == 2


def test_several_workers_serve_the_queue_and_no_trial_runs_twice(
    remote, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost]
) -> None:
    service = remote()
    for _ in range(2):
        remote_workers.start(args=("--concurrency", "8"))
    trial_ids = [service.submit_trial_job(form(n, before=[0])).id for n in range(16)]
    for trial_id in trial_ids:
        assert wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=90).status is TrialJobStatus.SUCCEEDED
    started = [e for e in service.store.read() if isinstance(getattr(e, "event", None), TrialStarted)]
    assert sorted(e.event.trial_id for e in started) == sorted(trial_ids)
    assert len({e.event.source for e in started}) == 2
    assert {host_of(ssh_hosts, service, t).address for t in trial_ids} == {h.address for h in ssh_hosts}


FAKE_NVIDIA_SMI = """#!/bin/sh
case "$1" in
  --query-gpu=*) i=0; while [ $i -lt COUNT ]; do echo "$i, GPU-HOST-$i, 0, 16000"; i=$((i + 1)); done ;;
  --query-compute-apps=*) ;;
  *) echo "fake nvidia-smi: $*" >&2; exit 2 ;;
esac
"""


def test_trials_go_to_free_gpus_across_machines_and_wait_without_blocking_others(
    remote, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost], ssh_user: SshUser, tmp_path: Path
) -> None:
    for host, count in zip(ssh_hosts, (1, 2), strict=True):
        host.add_command("nvidia-smi", FAKE_NVIDIA_SMI.replace("COUNT", str(count)).replace("HOST", host.hostname))
    service = remote(gpu_number=1)
    remote_workers.start(args=("--concurrency", "8"))
    gates = [tmp_path / f"gate-{n}" for n in range(4)]
    trial_ids = [service.submit_trial_job(form(n, gate=str(gates[n]))).id for n in range(4)]
    wait_until(lambda: _statuses(service, trial_ids).count("RUNNING") == 3, 60, what="three trials on three GPUs")
    waiting = next(t for t in trial_ids if service.get_trial_job(t).status is TrialJobStatus.WAITING)
    assert "free GPU" in (service.get_trial_job(waiting).message or "")
    running = [t for t in trial_ids if t != waiting]
    placed = {(host_of(ssh_hosts, service, t).hostname, tuple(_started(service, t).gpu_indices or [])) for t in running}
    assert placed == {("trial-host-1", (0,)), ("trial-host-2", (0,)), ("trial-host-2", (1,))}
    gates[trial_ids.index(running[0])].touch()  # one ends: the waiting trial takes its GPU
    wait_for_status(service, waiting, "RUNNING", timeout=60)
    for gate in gates:
        gate.touch()
    for trial_id in trial_ids:
        trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60)
        assert trial.status is TrialJobStatus.SUCCEEDED
        assert isinstance(trial.final_metric, dict) and trial.final_metric["cuda"] in ("0", "1")


def test_a_gpu_request_no_machine_can_meet_fails_at_once_saying_why(
    remote, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost]
) -> None:
    for host in ssh_hosts:
        host.add_command("nvidia-smi", FAKE_NVIDIA_SMI.replace("COUNT", "1").replace("HOST", host.hostname))
    service = remote(gpu_number=2)
    remote_workers.start()
    trial = wait_for_status(service, service.submit_trial_job(form(0)).id, "FAILED", timeout=30)
    assert "no machine can ever run it" in (trial.message or "")
    assert all(host.address in (trial.message or "") for host in ssh_hosts)
    assert "asks for 2 GPUs" in (trial.message or "")


def _started(service: TrainingService, trial_id: str) -> TrialStarted:
    return next(e for e in history(service, trial_id) if isinstance(e, TrialStarted))


def _statuses(service: TrainingService, trial_ids: list[str]) -> list[str]:
    return [str(trial.status) for trial in service.get_trial_jobs(trial_ids)]


def test_the_trial_runs_detached_with_its_files_on_the_host(
    remote, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost]
) -> None:
    service = remote(hosts=ssh_hosts[:1], keepTrialFiles=True)
    remote_workers.start()
    trial_id = service.submit_trial_job(form(0, before=[0], code=4)).id
    trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED")
    assert trial.status is TrialJobStatus.FAILED and trial.exit_code == 4
    directory = attempt_dir(ssh_hosts[0], service, trial_id)
    assert (directory / "exit").read_text().strip() == "4"
    pid, start = (directory / "pid").read_text().split()  # its pid, and its start time: a reused pid is told apart
    assert int(pid) > 1 and int(start) > 0
    assert b"NNISDK_MEb" in (directory / "stdout").read_bytes()
    assert json.loads((directory / "parameter.cfg").read_text())["parameters"]["code"] == 4
    host = ssh_hosts[0]
    assert trial.url == f"ssh://{host.user.name}@{host.address}:{host.port}{directory_on_host(host, directory)}"


def directory_on_host(host: SshHost, directory: Path) -> str:
    return host.user.home + "/" + str(directory.relative_to(host.home))


NNI_TRIAL = """
import nni
params = nni.get_next_parameter()
nni.report_intermediate_result({"default": 0.25, "note": 'a "quoted" \\\\ value'})
nni.report_final_result({"default": params["x"] * 2, "platform": "remote"})
"""


def test_unmodified_nni_trial_code_reports_through_stdout(
    remote, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost], code_dir: Path
) -> None:
    """NNI's SDK prints `NNISDK_MEb'<raw json>'` on platforms other than local: dicts with quotes too."""
    (code_dir / "nni_trial.py").write_text(textwrap.dedent(NNI_TRIAL))
    service = remote(hosts=ssh_hosts[:1], command=f"{sys.executable} nni_trial.py")
    remote_workers.start()
    trial = wait_for_status(service, service.submit_trial_job(form(0, x=0.5)).id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.SUCCEEDED, trial.message
    assert trial.final_metric == {"default": 1.0, "platform": "remote"}
    Projector(service.store.client).catch_up(service.experiment_id)
    [intermediate] = [m.value for m in service.views.metrics(trial.id) if m.type == "PERIODICAL"]
    assert intermediate == {"default": 0.25, "note": 'a "quoted" \\ value'}


def test_logs_of_a_remote_trial_are_read_from_its_host_and_a_failure_carries_its_stderr(
    remote, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost], client: redis.Redis, redis_url: str
) -> None:
    command = "printf 'out [b]1[/b]\\n'; printf 'the last words\\n' >&2; exit 3"
    service = remote(hosts=ssh_hosts[1:], command=command)
    remote_workers.start()
    trial = wait_for_status(service, service.submit_trial_job(form(0)).id, "SUCCEEDED", "FAILED")
    assert trial.status is TrialJobStatus.FAILED and trial.exit_code == 3
    assert "the last words" in (trial.message or "") and ssh_hosts[1].address in (trial.message or "")
    env = {**remote_workers.env, "TRIALSTREAM_REDIS_URL": redis_url}

    def logs(*extra: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "manager.cli", "trials", "logs", trial.id, "-e", service.experiment_id, *extra],
            env={**os.environ, **env},
            capture_output=True,
            timeout=60,
        )

    assert logs().stdout == b"out [b]1[/b]\n"
    assert logs("--stderr").stdout == b"the last words\n"
    finish_experiment(client, same_server(client, decode=False), service.experiment_id, "remote", "DONE")
    wait_until(lambda: b"does not exist" in logs().stderr, 30, what="the files to be cleaned up")


def test_the_shell_monitor_sees_what_the_python_monitor_sees(tmp_path: Path) -> None:
    """Hosts without python get the shell monitor: the same snapshot, from real processes here."""
    from workers.platforms.remote.machine import PYTHON_MONITOR, SHELL_MONITOR, RemoteHost, script

    watch = tmp_path / "watch"
    for key, files in {
        "e.running.1": {"stdout": b"12345", ".nni/metrics": b"ME000001\n", "pid": str(os.getpid()).encode()},
        "e.ended.1": {"stdout": b"", "exit": b"0\n", "pid": b"999999999"},
        "e.vanished.1": {"stdout": b"x", "pid": b"999999999"},
    }.items():
        attempt = tmp_path / key
        (attempt / ".nni").mkdir(parents=True)
        for name, data in files.items():
            (attempt / name).write_bytes(data)
        watch.mkdir(exist_ok=True)
        (watch / key).symlink_to(attempt)

    def first_snapshot(monitor: str) -> dict[str, Any]:
        command = ["sh", "-c", script(monitor, str(watch))]
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert process.stdout is not None
            return next(RemoteHost._snapshots(line.rstrip("\n") for line in process.stdout))
        finally:
            process.kill()
            process.wait()

    python_snapshot = first_snapshot(f'exec {sys.executable} -c {shlex.quote(PYTHON_MONITOR)} "$1"')
    assert python_snapshot == first_snapshot(SHELL_MONITOR)
    assert python_snapshot["e.running.1"].stdout == 5 and python_snapshot["e.running.1"].metrics == 9
    assert python_snapshot["e.ended.1"].exited and python_snapshot["e.vanished.1"].dead
    assert not python_snapshot["e.running.1"].dead


def test_a_stalled_worker_that_wakes_up_leaves_the_trial_to_the_worker_that_took_it_over(
    remote, remote_workers: RemoteWorkers, tmp_path: Path
) -> None:
    """Its lease expired while it was frozen (SIGSTOP: a long GC pause, a paused VM): another worker
    re-attached; when it wakes, it must neither kill the trial nor record an end for it."""
    service = remote()
    fast = {"TRIALSTREAM_TRIAL_LEASE_S": "1"}
    stalled = remote_workers.start(env=fast)
    gate, started = tmp_path / "gate", tmp_path / "started"
    trial_id = service.submit_trial_job(form(0, before=[0], gate=str(gate), started=str(started), after=[1])).id
    wait_until(started.exists, 30, what="the trial to start")
    stalled.send_signal(signal.SIGSTOP)
    try:
        remote_workers.start(env=fast)
        wait_until(lambda: any(isinstance(e, TrialReattached) for e in history(service, trial_id)), 30)
    finally:
        stalled.send_signal(signal.SIGCONT)
    stalled_log = remote_workers.processes.log_dir / "worker-0.log"
    wait_until(lambda: f"completed trial {trial_id}" in stalled_log.read_text(), 30, what="the woken worker to let go")
    gate.touch()
    trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.SUCCEEDED and trial.attempt == 1, trial.message
    assert periodical(service, trial_id) == [0, 1]
    events = history(service, trial_id)
    [ended] = [e for e in events if isinstance(e, TrialEnded)]
    # recorded by a worker that took the attempt over (on a loaded machine the 1 s lease of the one that
    # took it over can lapse too, and the woken one take it back: then either may record the one end)
    assert ended.source in {e.source for e in events if isinstance(e, TrialReattached)}
