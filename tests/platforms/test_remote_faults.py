"""The remote platform under faults met at a given point of its work, on real sshd hosts (issue 24): a
connection dropped between two reads of a metrics file, a worker killed in the middle of a launch, a full
disk while the code is staged or after the trial started, a lost attempt on a host cut off when it is
released, a pid the kernel gave to another process, and monitors whose worker or connection is gone.
Each fault is tied to the work's progress (bytes through a proxy, a launch step reached), not to a clock."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from rq import Queue

from core import keys
from core.connections import same_server
from core.queueing import SERIALIZER, queue_name
from manager.training_service import TrainingService
from schemas.events import TrialReattached, TrialStarted
from schemas.trial import TrialJobStatus
from simulators.processes import process_gone
from simulators.sshd import CuttingProxy, SshHost, SshUser
from tests.conftest import ServiceFactory, form, wait_for_status, wait_until
from tests.platforms.test_remote_platform import _cut, _heal, attempt_dir, host_of, periodical
from tests.support.conformance import history
from tests.support.remote_setup import RemoteWorkers, machine
from workers.platforms.remote.machine import PYTHON_MONITOR, SHELL_MONITOR, script

FAST_LEASE = {"TRIALSTREAM_TRIAL_LEASE_S": "1"}


@pytest.fixture
def tmp_path(shared_tmp_path: Path) -> Path:
    """Trials on the hosts (another user) read and write the markers these tests create."""
    return shared_tmp_path


# --- A1: a connection dropped between two reads of one metrics file -----------------------------------------

RECORDS = 3000
RECORDS_TRIAL = r"""
import json, os, sys, time
write, end = sys.argv[1], sys.argv[2]
while not os.path.exists(write):
    time.sleep(0.02)
directory = os.path.join(os.environ["NNI_SYS_DIR"], ".nni")
with open(os.path.join(directory, "metrics.partial"), "wb") as file:
    for sequence in range(COUNT):
        value = json.dumps({"default": sequence, "pad": "x" * 450})
        record = json.dumps({"parameter_id": 0, "type": "PERIODICAL", "sequence": sequence, "value": value})
        data = record.encode() + b"\n"
        file.write(b"ME%06d" % len(data) + data)
os.replace(os.path.join(directory, "metrics.partial"), os.path.join(directory, "metrics"))  # all at once
while not os.path.exists(end):
    time.sleep(0.02)
"""


def test_a_connection_dropped_after_the_first_chunk_of_the_metrics_file_loses_no_record(
    make_service: ServiceFactory,
    code_dir: Path,
    remote_workers: RemoteWorkers,
    ssh_hosts: list[SshHost],
    ssh_user: SshUser,
    tmp_path: Path,
) -> None:
    host = ssh_hosts[0]
    proxy = CuttingProxy((host.address, host.port))
    try:
        with remote_workers.known_hosts.open("a") as known_hosts:  # the proxy speaks with the host's key
            known_hosts.write(f"[127.0.0.1]:{proxy.port} {host.host_key}\n")
        (code_dir / "records.py").write_text(RECORDS_TRIAL.replace("COUNT", str(RECORDS)))
        write, end = tmp_path / "write", tmp_path / "end"
        section: dict[str, Any] = {
            "platform": "remote",
            "machineList": [{**machine(host, ssh_user), "host": "127.0.0.1"}],
        }
        section["machineList"][0]["port"] = proxy.port
        command = f"{sys.executable} records.py {write} {end}"
        service = make_service(command, platform_config=section)
        remote_workers.start()
        trial_id = service.submit_trial_job(form(0)).id
        wait_for_status(service, trial_id, "RUNNING", timeout=30)
        # ~1.6 MB of records appear at once: the worker reads them in chunks of 1 MiB; the connection drops
        # once a quarter MiB more than the first chunk has come through, in the middle of the second read
        proxy.cut_after((1 << 20) + (1 << 18))
        write.touch()
        wait_until(proxy.cut.is_set, 60, what="the connection to be cut during the second read")
        end.touch()
        trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60)
        assert trial.status is TrialJobStatus.SUCCEEDED, trial.message
        assert periodical(service, trial_id) == list(range(RECORDS))
    finally:
        proxy.close()


# --- A2: a worker killed during the launch -------------------------------------------------------------------

HOLDING_LN = """#!/bin/sh
# the launch links its attempt into the worker's watch directory (`ln -sfn`) after the trial started:
# there it waits while HOLD exists, having said so in REACHED
case "$1" in -sfn) if [ -e HOLD ]; then touch REACHED; while [ -e HOLD ]; do sleep 0.02; done; fi;; esac
exec /bin/ln "$@"
"""


def test_a_worker_killed_during_the_launch_leaves_a_trial_whose_start_the_next_worker_records(
    remote, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost], tmp_path: Path
) -> None:
    host = ssh_hosts[0]
    hold, reached = tmp_path / "hold", tmp_path / "reached"
    host.add_command("ln", HOLDING_LN.replace("HOLD", str(hold)).replace("REACHED", str(reached)))
    hold.touch()
    service = remote(hosts=[host])
    victim = remote_workers.start(env=FAST_LEASE)
    gate, started = tmp_path / "gate", tmp_path / "started"
    trial_id = service.submit_trial_job(form(0, before=[0], gate=str(gate), started=str(started), after=[1])).id
    wait_until(reached.exists, 30, what="the launch to reach its `ln -sfn`, after the trial started")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    hold.unlink()
    remote_workers.start(env=FAST_LEASE)
    wait_until(lambda: any(isinstance(e, TrialReattached) for e in history(service, trial_id)), 30)
    running = wait_for_status(service, trial_id, "RUNNING", timeout=30)
    assert running.url and f"@{host.address}:{host.port}/" in running.url and running.start_time
    gate.touch()
    trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.SUCCEEDED and trial.attempt == 1, trial.message
    assert len([e for e in history(service, trial_id) if isinstance(e, TrialStarted)]) == 1
    assert periodical(service, trial_id) == [0, 1]


@pytest.mark.parametrize("then", ["heal", "cancel"])
def test_a_host_cut_off_before_the_launch_answers_makes_its_trial_unknown_not_waiting(
    remote, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost], tmp_path: Path, then: str
) -> None:
    """The launch's answer is lost with the connection, after the trial started: the attempt is followed as on
    a host that went down (UNKNOWN), launched again once the host is back (which only reports the running
    one), or, canceled meanwhile, killed there once the host is back."""
    host = ssh_hosts[0]
    if host.veth is None:
        pytest.skip("partitions need the network-namespace hosts")
    hold, reached = tmp_path / "hold", tmp_path / "reached"
    host.add_command("ln", HOLDING_LN.replace("HOLD", str(hold)).replace("REACHED", str(reached)))
    hold.touch()
    service = remote(hosts=[host], unreachableTimeout="5m")
    remote_workers.start(env={"TRIALSTREAM_SSH_TIMEOUT_S": "2"})
    gate, started = tmp_path / "gate", tmp_path / "started"
    trial_id = service.submit_trial_job(form(0, before=[0], gate=str(gate), started=str(started), after=[1])).id
    wait_until(reached.exists, 30, what="the launch to reach its `ln -sfn`, after the trial started")
    pid = int((attempt_dir(host, service, trial_id) / "pid").read_text().split()[0])
    _cut(host)
    try:
        hold.unlink()  # the launch ends on the host; its answer cannot reach the worker
        wait_for_status(service, trial_id, "UNKNOWN", timeout=60)
        if then == "cancel":
            service.cancel_trial_job(trial_id)
            wait_for_status(service, trial_id, "USER_CANCELED")
            assert not process_gone(pid)  # the host could not be reached: it runs on there
    finally:
        _heal(host)
    if then == "cancel":
        wait_until(lambda: process_gone(pid), 30, what="the canceled trial to be killed once its host is back")
        return
    running = wait_for_status(service, trial_id, "RUNNING", timeout=60)
    assert running.url and f"@{host.address}:{host.port}/" in running.url
    gate.touch()
    trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.SUCCEEDED and trial.attempt == 1, trial.message
    assert len([e for e in history(service, trial_id) if isinstance(e, TrialStarted)]) == 1
    assert periodical(service, trial_id) == [0, 1]


# --- A3: a full disk ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("another_host", [True, False])
def test_a_host_whose_disk_cannot_hold_the_code_gets_no_trial(
    remote, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost], code_dir: Path, another_host: bool
) -> None:
    """The trial goes to the other machine; with none, it fails saying why, instead of waiting forever."""
    full, free = ssh_hosts
    full.mount_tmpfs(".trialstream/code", "size=64k")
    (code_dir / "weights.bin").write_bytes(os.urandom(256 * 1024))  # incompressible: the archive does not fit
    service = remote(hosts=[full, free] if another_host else [full])  # the full one first: it is tried first
    remote_workers.start()
    trial = wait_for_status(service, service.submit_trial_job(form(0)).id, "SUCCEEDED", "FAILED", timeout=60)
    if another_host:
        assert trial.status is TrialJobStatus.SUCCEEDED, trial.message
        assert host_of(ssh_hosts, service, trial.id) is free
    else:
        assert trial.status is TrialJobStatus.FAILED
        assert "cannot upload the code" in (trial.message or "") and full.address in (trial.message or "")


def _trial_processes(host: SshHost, trial_id: str) -> list[int]:
    """The host's processes with the trial's environment (its wrapper and what it runs)."""
    found = []
    for pid in host.processes():
        try:
            if f"NNI_TRIAL_JOB_ID={trial_id}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(pid)
        except OSError:
            pass
    return found


def test_a_launch_that_fails_after_the_trial_started_kills_it(
    remote, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost]
) -> None:
    """The disk of the watch directory is out of inodes: the launch's `ln -sfn` fails, after the `&`."""
    host = ssh_hosts[0]
    host.mount_tmpfs(".trialstream/watch", "nr_inodes=2")  # its root and the worker's directory, no link
    service = remote(hosts=[host], command="exec sleep 300")
    remote_workers.start()
    trial = wait_for_status(service, service.submit_trial_job(form(0)).id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.FAILED
    assert "No space left on device" in (trial.message or "") and host.address in (trial.message or "")
    wait_until(lambda: not _trial_processes(host, trial.id), 10, what="the trial started there to be killed")


# --- A9: lost attempts on a host cut off when they are released, and reused pids ------------------------------


def _release_ran(client: redis.Redis, service: TrainingService, trial_id: str) -> bool:
    queue = Queue(queue_name("remote"), connection=same_server(client, decode=False), serializer=SERIALIZER)
    prefix = f"{service.experiment_id}"
    return any(
        job_id.startswith(prefix) and f"{trial_id}" in job_id and "-release-" in job_id
        for job_id in queue.finished_job_registry.get_job_ids()
    )


def test_a_lost_attempt_on_a_host_cut_off_at_its_release_is_killed_once_the_host_is_back(
    remote, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost], client: redis.Redis, tmp_path: Path
) -> None:
    if ssh_hosts[0].veth is None:
        pytest.skip("partitions need the network-namespace hosts")
    first, gate = tmp_path / "first.pid", tmp_path / "gate"
    # the first attempt records its pid and runs until killed; the retry waits for the gate
    command = (
        f"if [ -e {first} ]; then while [ ! -e {gate} ]; do sleep 0.05; done; "
        f"else echo $$ > {first}; while :; do sleep 0.05; done; fi"
    )
    service = remote(command=command, unreachableTimeout="2s", max_retries=1)
    remote_workers.start(env={**FAST_LEASE, "TRIALSTREAM_SSH_TIMEOUT_S": "2"})
    trial_id = service.submit_trial_job(form(0)).id
    wait_until(lambda: first.exists() and first.read_text().strip(), 30, what="the first attempt to start")
    pid = int(first.read_text())
    cut = host_of(ssh_hosts, service, trial_id)
    _cut(cut)
    try:
        wait_until(lambda: _release_ran(client, service, trial_id), 60, what="attempt 1 to be lost and released")
        assert not process_gone(pid)  # the host could not be reached: it runs on there
    finally:
        _heal(cut)
    wait_until(lambda: process_gone(pid), 30, what="the lost attempt to be killed once its host is back")
    assert not service.get_trial_job(trial_id).status.is_terminal  # by then, not by the experiment's clean-up
    gate.touch()
    trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.SUCCEEDED and trial.attempt == 2, trial.message
    assert not client.exists(f"{keys.LOG_PREFIX}:doomed:remote:{ssh_hosts[0].user.name}@{cut.address}:{cut.port}")


def test_a_trial_canceled_while_its_host_is_cut_off_is_killed_once_the_host_is_back(
    remote, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost], tmp_path: Path
) -> None:
    host = ssh_hosts[0]
    if host.veth is None:
        pytest.skip("partitions need the network-namespace hosts")
    pid_file = tmp_path / "trial.pid"
    service = remote(hosts=[host], command=f"echo $$ > {pid_file}; while :; do sleep 0.05; done")
    remote_workers.start(env={"TRIALSTREAM_SSH_TIMEOUT_S": "2"})
    trial_id = service.submit_trial_job(form(0)).id
    wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), 30, what="the trial to start")
    pid = int(pid_file.read_text())
    _cut(host)
    try:
        wait_for_status(service, trial_id, "UNKNOWN", timeout=60)
        service.cancel_trial_job(trial_id)
        assert wait_for_status(service, trial_id, "USER_CANCELED").status is TrialJobStatus.USER_CANCELED
        assert not process_gone(pid)  # the host could not be reached: it runs on there
    finally:
        _heal(host)
    wait_until(lambda: process_gone(pid), 30, what="the canceled trial to be killed once its host is back")


def _monitors(host: SshHost) -> list[int]:
    """The host's monitor processes (python: every host here has it) sleeping between two rounds: so they
    have written their first snapshot, and from then on write only when a file they watch changes."""
    found = []
    for pid in host.processes():
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
            sleeping = "nanosleep" in Path(f"/proc/{pid}/wchan").read_text()
        except OSError:
            continue
        if b"os.listdir" in command and command.startswith(sys.executable.encode()) and sleeping:
            found.append(pid)
    return found


def _with_pid(pid: int) -> subprocess.Popen[bytes] | None:
    """A new process that the kernel gives `pid` (as root: the next pid is set through ns_last_pid); None when
    another process took it first (the suite's other processes fork all the time)."""
    for _ in range(100):
        if Path(f"/proc/{pid}").exists():
            return None
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        process = subprocess.Popen(["sleep", "300"])
        if process.pid == pid:
            return process
        process.kill()
        process.wait()
    return None


def test_a_trial_whose_pid_another_process_has_since_is_not_taken_for_alive(
    remote, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost], tmp_path: Path
) -> None:
    host = ssh_hosts[0]
    service = remote(hosts=[host])
    remote_workers.start()
    for sequence in range(5):  # a trial whose pid another process took before this test could: another trial
        gate, started = tmp_path / f"gate{sequence}", tmp_path / f"started{sequence}"
        trial_id = service.submit_trial_job(form(sequence, gate=str(gate), started=str(started))).id
        wait_until(started.exists, 30, what="the trial to start")
        pid = int((attempt_dir(host, service, trial_id) / "pid").read_text().split()[0])
        [monitor] = wait_until(lambda: _monitors(host), 30, what="the monitor")
        os.kill(monitor, signal.SIGSTOP)  # it does not look while the trial dies and its pid is given again
        try:
            os.killpg(pid, signal.SIGKILL)  # killed from outside: no exit code is written
            wait_until(lambda: not Path(f"/proc/{pid}").exists(), 30, what="the trial's process to be reaped")  # noqa: B023
            impostor = _with_pid(pid)
        finally:
            os.kill(monitor, signal.SIGCONT)
        if impostor is not None:
            break
    else:
        raise AssertionError("5 trials' pids were each taken by other processes before the test could")
    try:
        trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=30)
        assert trial.status is TrialJobStatus.FAILED
        assert "ended without an exit code" in (trial.message or "")
        assert impostor.poll() is None  # and nobody killed the process that has its pid now
    finally:
        impostor.kill()
        impostor.wait()


# --- A10: monitors end with their worker's channel ----------------------------------------------------------


def test_a_host_s_monitor_ends_when_its_connection_drops_and_when_its_worker_is_killed(
    remote, remote_workers: RemoteWorkers, ssh_hosts: list[SshHost], tmp_path: Path
) -> None:
    host = ssh_hosts[0]
    service = remote(hosts=[host])
    worker = remote_workers.start()
    gate, started = tmp_path / "gate", tmp_path / "started"
    trial_id = service.submit_trial_job(form(0, gate=str(gate), started=str(started))).id
    wait_until(started.exists, 30, what="the trial to start")
    seen = set(wait_until(lambda: _monitors(host), 30, what="the monitor"))
    # the worker reconnects and starts a monitor now that the trial's files are all there: that one has
    # written its snapshot, and has nothing more to write while the trial waits for its gate
    host.kill_sessions()
    [dropped] = wait_until(lambda: [p for p in _monitors(host) if p not in seen], 30, what="a new monitor")
    host.kill_sessions()
    wait_until(lambda: process_gone(dropped), 10, what="the monitor of the dropped connection to end")
    seen.add(dropped)
    [replaced] = wait_until(lambda: [p for p in _monitors(host) if p not in seen], 30, what="another monitor")
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    wait_until(lambda: process_gone(replaced), 10, what="the killed worker's monitor to end")
    assert not service.get_trial_job(trial_id).status.is_terminal


@pytest.mark.parametrize("kind", ["python", "shell"])
def test_a_monitor_ends_when_its_stdin_closes(tmp_path: Path, kind: str) -> None:
    """Hosts without python get the shell monitor: it ends the same way (real processes here)."""
    watch, attempt = tmp_path / "watch", tmp_path / "attempt"
    (attempt / ".nni").mkdir(parents=True)
    (attempt / "stdout").write_bytes(b"")
    watch.mkdir()
    (watch / "e.t.1").symlink_to(attempt)
    monitor = f'exec {sys.executable} -c {shlex.quote(PYTHON_MONITOR)} "$1"' if kind == "python" else SHELL_MONITOR
    command = ["sh", "-c", script(monitor, str(watch))]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert process.stdin is not None and process.stdout is not None
        assert process.stdout.readline() == b"e.t.1/stdout 0\n"  # its first snapshot: it runs
        process.stdin.close()
        wait_until(lambda: process.poll() is not None, 10, what=f"the {kind} monitor to end")
    finally:
        process.kill()
        process.wait()
