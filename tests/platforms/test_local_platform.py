"""The local platform with real worker processes and real trial subprocesses."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from inotify_simple import INotify

from core.platform import ParsedMetric
from core.settings import Settings
from manager.projector import Projector
from schemas.events import TrialDeferred, TrialMetricRejected
from schemas.trial import TrialJobStatus
from simulators.processes import process_gone
from tests.conftest import REPO, Processes, form, wait_for_status, wait_until
from workers.platforms.local import adapter as local
from workers.platforms.local import wakeups
from workers.platforms.local.keeper import Keeper, TrialLaunch, Zygote
from workers.platforms.shared.trial_contract import StdoutMetricPump


def script(code_dir: Path, name: str, body: str) -> str:
    (code_dir / name).write_text(textwrap.dedent(body))
    return f"{sys.executable} {name}"


def pid_alive(pid: int) -> bool:
    return not process_gone(pid)


def test_trial_runs_with_nni_environment_and_reports_metrics(make_service, processes: Processes, code_dir) -> None:
    command = script(
        code_dir,
        "trial.py",
        """
        import json, os, trialstream_sdk as nni
        params = nni.get_next_parameter()
        keys = ["NNI_PLATFORM", "NNI_EXP_ID", "NNI_TRIAL_JOB_ID", "NNI_SYS_DIR", "NNI_OUTPUT_DIR",
                "NNI_TRIAL_SEQ_ID", "NNI_CODE_DIR", "MULTI_PHASE", "CUDA_VISIBLE_DEVICES"]
        json.dump({"env": {k: os.environ.get(k) for k in keys}, "cwd": os.getcwd(), "params": params},
                  open(os.path.join(os.environ["NNI_SYS_DIR"], "seen.json"), "w"))
        nni.report_intermediate_result(0.25)
        line = json.dumps({"parameter_id": 3, "trial_job_id": "x", "type": "PERIODICAL", "sequence": 1, "value": "0.5"})
        os.write(1, ("NNISDK_MEb'" + line + "'\\n").encode())  # the SDK sends print() to trial.log on local
        nni.report_final_result({"default": 0.75, "loss": 1.0})
        """,
    )
    service = make_service(command)
    processes.worker()
    trial_id = service.submit_trial_job(form(3, lr=0.01)).id
    trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED")
    assert trial.status is TrialJobStatus.SUCCEEDED, trial.message
    seen = json.loads((Path(trial.working_directory) / "seen.json").read_text())
    assert seen["params"] == {"lr": 0.01}
    assert seen["cwd"] == str(code_dir)
    assert seen["env"] == {
        "NNI_PLATFORM": "local",
        "NNI_EXP_ID": service.experiment_id,
        "NNI_TRIAL_JOB_ID": trial_id,
        "NNI_SYS_DIR": trial.working_directory,
        "NNI_OUTPUT_DIR": trial.working_directory,
        "NNI_TRIAL_SEQ_ID": "3",
        "NNI_CODE_DIR": str(code_dir),
        "MULTI_PHASE": "false",
        "CUDA_VISIBLE_DEVICES": None,  # trialGpuNumber not configured
    }
    assert trial.final_metric == {"default": 0.75, "loss": 1.0}
    assert trial.start_time is not None and trial.end_time is not None
    Projector(service.store.client).catch_up(service.experiment_id)
    metrics = service.views.metrics(trial_id)
    assert sorted((m.type, m.sequence, m.value) for m in metrics) == [
        ("FINAL", 0, {"default": 0.75, "loss": 1.0}),
        ("PERIODICAL", 0, 0.25),
        ("PERIODICAL", 1, 0.5),
    ]
    assert (Path(trial.working_directory) / "stdout").read_bytes().count(b"NNISDK_MEb") == 1


def test_a_failing_trial_reports_exit_code_and_stderr(make_service, processes: Processes, code_dir) -> None:
    command = script(code_dir, "fail.py", "import sys\nsys.stderr.write('out of memory on step 3\\n')\nsys.exit(3)\n")
    service = make_service(command)
    processes.worker()
    trial = wait_for_status(service, service.submit_trial_job(form(0)).id, "FAILED", "SUCCEEDED")
    assert trial.status is TrialJobStatus.FAILED
    assert trial.exit_code == 3
    assert "exit code 3" in (trial.message or "") and "out of memory on step 3" in (trial.message or "")


def test_a_command_that_does_not_exist_fails_saying_so(make_service, processes: Processes) -> None:
    service = make_service("no-such-command-xyz --flag")
    processes.worker()
    trial = wait_for_status(service, service.submit_trial_job(form(0)).id, "FAILED", "SUCCEEDED")
    assert trial.status is TrialJobStatus.FAILED and trial.exit_code == 127
    assert "command not found" in (trial.message or "") and "no-such-command-xyz" in (trial.message or "")


CHILD_TRIAL = """
import os, subprocess, sys, time
child = subprocess.Popen(["sleep", "60"])
open(os.path.join(os.environ["NNI_SYS_DIR"], "pids"), "w").write(f"{os.getpid()} {child.pid}")
time.sleep(60)
"""


@pytest.mark.parametrize(
    ("early", "expected"), [(False, TrialJobStatus.USER_CANCELED), (True, TrialJobStatus.EARLY_STOPPED)]
)
def test_cancel_kills_the_whole_process_group(make_service, processes: Processes, code_dir, early, expected) -> None:
    service = make_service(script(code_dir, "child.py", CHILD_TRIAL))
    processes.worker()
    trial_id = service.submit_trial_job(form(0)).id
    running = wait_for_status(service, trial_id, "RUNNING")
    pid_file = Path(running.working_directory) / "pids"
    pids = [int(pid) for pid in wait_until(lambda: pid_file.read_text() if pid_file.exists() else None, 10).split()]
    service.cancel_trial_job(trial_id, is_early_stopped=early)
    trial = wait_for_status(service, trial_id, expected, timeout=15)
    assert trial.is_early_stopped is early
    wait_until(lambda: not any(pid_alive(pid) for pid in pids), 5, what="trial and child gone")


def test_a_trial_ignoring_sigterm_is_killed_after_the_grace_period(make_service, processes: Processes, code_dir):
    command = script(
        code_dir,
        "stubborn.py",
        """
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(os.path.join(os.environ["NNI_SYS_DIR"], "ready"), "w").write(str(os.getpid()))
        time.sleep(60)
        """,
    )
    service = make_service(f"exec {command}")  # the trial itself leads the process group
    processes.worker(env={"TRIALSTREAM_KILL_GRACE_S": "0.5"})
    trial_id = service.submit_trial_job(form(0)).id
    running = wait_for_status(service, trial_id, "RUNNING")
    ready = Path(running.working_directory) / "ready"
    pid = int(wait_until(lambda: ready.read_text() if ready.exists() else None, 10))
    service.cancel_trial_job(trial_id)
    trial = wait_for_status(service, trial_id, "USER_CANCELED", timeout=10)
    assert trial.exit_code == -9  # SIGKILL, after SIGTERM was ignored
    assert not pid_alive(pid)


def test_max_trial_duration_stops_the_trial_as_early_stopped(make_service, processes: Processes) -> None:
    service = make_service("sleep 30", max_trial_duration=1.0)
    processes.worker()
    trial = wait_for_status(service, service.submit_trial_job(form(0)).id, "EARLY_STOPPED", "SUCCEEDED", timeout=15)
    assert trial.status is TrialJobStatus.EARLY_STOPPED
    assert "maxTrialDuration" in (trial.message or "")


def test_bad_metric_records_are_skipped_and_reported_while_the_trial_goes_on(
    make_service, processes: Processes, code_dir
) -> None:
    command = script(
        code_dir,
        "noisy.py",
        """
        import os, trialstream_sdk as nni
        nni.get_next_parameter()
        path = os.path.join(os.environ["NNI_SYS_DIR"], ".nni", "metrics")
        with open(path, "ab") as f:
            f.write(b"XX garbage that is no record\\n")
            f.write(b'ME000020{"not": "a metric"}\\n')
        os.write(1, b"NNISDK_MEb'" + b"x" * 2_500_000 + b"'\\n")
        nni.report_intermediate_result(1.5)
        nni.report_final_result(2.5)
        """,
    )
    service = make_service(command)
    processes.worker()
    trial = wait_for_status(service, service.submit_trial_job(form(0)).id, "SUCCEEDED", "FAILED")
    assert trial.status is TrialJobStatus.SUCCEEDED
    assert trial.final_metric == 2.5
    reasons = [
        entry.event.reason
        for entry in service.store.read()
        if isinstance(getattr(entry, "event", None), TrialMetricRejected)
    ]
    assert any("malformed" in reason for reason in reasons)
    assert any("type" in reason for reason in reasons)
    assert "metric line of 2500012 bytes exceeds the 1000000-byte limit" in reasons  # its exact size


SURROGATE_RECORD = b'{"parameter_id": "\\ud800", "type": "PERIODICAL", "sequence": 0, "value": "1.0"}'


def rejections(service) -> list[str]:
    return [
        entry.event.reason
        for entry in service.store.read()
        if isinstance(getattr(entry, "event", None), TrialMetricRejected)
    ]


def test_a_metric_that_cannot_be_encoded_in_the_metrics_file_is_rejected_and_the_trial_goes_on(
    make_service, processes: Processes, code_dir
) -> None:
    """Regression (A5): a lone surrogate failed when the metric was stored, which killed the trial."""
    command = script(
        code_dir,
        "surrogate_file.py",
        f"""
        import os, trialstream_sdk as nni
        nni.get_next_parameter()
        data = {SURROGATE_RECORD!r} + b"\\n"
        with open(os.path.join(os.environ["NNI_SYS_DIR"], ".nni", "metrics"), "ab") as f:
            f.write(b"ME%06d" % len(data) + data)
        nni.report_final_result(2.5)
        """,
    )
    service = make_service(command)
    processes.worker()
    trial = wait_for_status(service, service.submit_trial_job(form(0)).id, "SUCCEEDED", "FAILED")
    assert trial.status is TrialJobStatus.SUCCEEDED, trial.message
    assert trial.final_metric == 2.5
    assert any("lone surrogate" in reason for reason in rejections(service))


def test_a_metric_line_that_cannot_be_encoded_is_rejected_and_a_chatty_trial_goes_on(
    make_service, processes: Processes, code_dir
) -> None:
    """Regression (A5): the stdout thread died on such a line, so a trial printing more blocked for ever."""
    command = script(
        code_dir,
        "surrogate_stdout.py",
        f"""
        import os
        os.write(1, b"NNISDK_MEb'" + {SURROGATE_RECORD!r} + b"'\\n")
        for _ in range(2000):  # ~8 MB: far more than a pipe holds
            os.write(1, b"chatter " * 512 + b"\\n")
        good = b'{{"parameter_id": 0, "type": "FINAL", "sequence": 0, "value": "3.5"}}'
        os.write(1, b"NNISDK_MEb'" + good + b"'\\n")
        """,
    )
    service = make_service(command)
    processes.worker()
    trial = wait_for_status(service, service.submit_trial_job(form(0)).id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.SUCCEEDED, trial.message
    assert trial.final_metric == 3.5
    assert any("lone surrogate" in reason for reason in rejections(service))


def read_pid(path: Path) -> int:
    return int(wait_until(lambda: path.read_text().strip() if path.exists() else None, 15, what=f"{path.name}"))


ESCAPING_TRIAL = 'setsid sleep 60 & echo $! > "$NNI_SYS_DIR/escaped"; echo hi; '


def test_a_trial_ends_when_its_main_process_exits_and_its_setsid_child_is_killed(
    make_service, processes: Processes
) -> None:
    """Regression (A4): a `setsid` child holding stdout hung the worker; the trial stayed RUNNING."""
    service = make_service(ESCAPING_TRIAL + "exit 0")
    processes.worker()
    trial = wait_for_status(service, service.submit_trial_job(form(0)).id, "SUCCEEDED", "FAILED", timeout=20)
    assert trial.status is TrialJobStatus.SUCCEEDED, trial.message
    escaped = read_pid(Path(trial.working_directory) / "escaped")
    wait_until(lambda: not pid_alive(escaped), 10, what="the setsid child gone")
    assert (Path(trial.working_directory) / "stdout").read_bytes() == b"hi\n"


def test_a_double_forked_daemon_of_the_trial_is_killed_at_its_end(make_service, processes: Processes) -> None:
    """Not in the trial's process group nor a child of anything of the trial's: re-parented, still found."""
    service = make_service("(setsid sh -c 'sleep 60 & echo $! > \"$NNI_SYS_DIR/daemon\"' &) >/dev/null; sleep 0.5")
    processes.worker()
    trial = wait_for_status(service, service.submit_trial_job(form(0)).id, "SUCCEEDED", "FAILED", timeout=20)
    assert trial.status is TrialJobStatus.SUCCEEDED, trial.message
    daemon = read_pid(Path(trial.working_directory) / "daemon")
    wait_until(lambda: not pid_alive(daemon), 10, what="the daemon gone")


def test_cancel_kills_a_setsid_child_too(make_service, processes: Processes) -> None:
    service = make_service(ESCAPING_TRIAL + "sleep 60")
    processes.worker()
    trial_id = service.submit_trial_job(form(0)).id
    running = wait_for_status(service, trial_id, "RUNNING")
    escaped = read_pid(Path(running.working_directory) / "escaped")
    service.cancel_trial_job(trial_id)
    wait_for_status(service, trial_id, "USER_CANCELED", timeout=20)
    wait_until(lambda: not pid_alive(escaped), 10, what="the setsid child gone")


def test_a_setsid_child_dies_with_its_sigkilled_worker(make_service, processes: Processes) -> None:
    service = make_service(ESCAPING_TRIAL + "sleep 60")
    worker = processes.worker()
    running = wait_for_status(service, service.submit_trial_job(form(0)).id, "RUNNING")
    escaped = read_pid(Path(running.working_directory) / "escaped")
    worker.kill()
    worker.wait()
    wait_until(lambda: not pid_alive(escaped), 10, what="the setsid child gone")


def children_of(parent: int) -> list[int]:
    """The live processes whose parent is `parent` and that run the keepers' script (`python -I -S -c`)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            parent_now = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if parent_now == parent and command.split(b"\0")[1:4] == [b"-I", b"-S", b"-c"] and pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def test_keepers_are_forked_by_a_zygote_holding_nothing_of_the_worker_and_a_dead_one_is_replaced(
    make_service, processes: Processes
) -> None:
    """The worker's one zygote forks each trial's keeper, and the next trial's ahead (so no interpreter starts
    per trial): both are there before the first trial comes, and hold no environment until a trial's does.
    A spare keeper killed while it waits, or the zygote itself, is replaced at the next launch; both end with
    their worker."""
    service = make_service("exit 0")
    worker = processes.worker()

    def succeeds(sequence: int) -> None:
        trial = wait_for_status(service, service.submit_trial_job(form(sequence)).id, "SUCCEEDED", "FAILED", timeout=20)
        assert trial.status is TrialJobStatus.SUCCEEDED, trial.message

    zygote = wait_until(lambda: children_of(worker.pid), 15, what="the keeper zygote, before any trial")
    assert len(zygote) == 1
    spare = wait_until(lambda: children_of(zygote[0]), 15, what="a spare keeper, before any trial")
    assert len(spare) == 1
    ahead = wait_until(lambda: children_of(spare[0]), 15, what="the spare's process for its trial, forked ahead")
    for pid in (*zygote, *spare, *ahead):
        assert Path(f"/proc/{pid}/environ").read_bytes() == b""

    succeeds(0)  # with the spare forked before it
    assert children_of(worker.pid) == zygote
    spare = wait_until(lambda: children_of(zygote[0]), 15, what="the next spare keeper")
    ahead = wait_until(lambda: children_of(spare[0]), 15, what="its process for its trial")
    os.kill(spare[0], 9)
    wait_until(lambda: not any(map(pid_alive, ahead)), 10, what="a killed spare's process for its trial gone")
    succeeds(1)
    assert children_of(worker.pid) == zygote

    os.kill(zygote[0], 9)
    succeeds(2)  # the spare forked before
    succeeds(3)  # forked by a new zygote
    zygote = wait_until(lambda: children_of(worker.pid), 15, what="the new keeper zygote")
    spare = wait_until(lambda: children_of(zygote[0]), 15, what="the new zygote's spare keeper")
    ahead = wait_until(lambda: children_of(spare[0]), 15, what="its process for its trial")
    worker.kill()
    worker.wait()
    left = [*zygote, *spare, *ahead]
    wait_until(lambda: not any(map(pid_alive, left)), 10, what="the zygote and its spare gone with their worker")


def test_a_platform_made_to_read_output_starts_no_keeper(client) -> None:
    """The manager makes a local platform to read a trial's output: only a worker's `warm_up` starts the zygote
    and a spare keeper, not every platform made."""
    platform = local.LocalPlatform(Settings(), client)
    try:
        for thread in threading.enumerate():
            if thread.name == "spare-keeper":
                thread.join(15)
        assert children_of(os.getpid()) == []
    finally:
        platform.close()


def test_a_running_trial_outlives_its_zygote(make_service, processes: Processes) -> None:
    """The zygote only forks keepers: killed while a trial runs, it takes nothing of that trial with it."""
    service = make_service('touch "$NNI_SYS_DIR/up"; until [ -e "$NNI_SYS_DIR/go" ]; do sleep 0.01; done; exit 0')
    worker = processes.worker()
    trial_id = service.submit_trial_job(form(0)).id
    directory = Path(wait_for_status(service, trial_id, "RUNNING").working_directory)
    wait_until((directory / "up").exists, 10, what="the trial up")
    zygote = children_of(worker.pid)
    assert len(zygote) == 1
    os.kill(zygote[0], 9)
    wait_until(lambda: not pid_alive(zygote[0]), 10, what="the zygote gone")
    (directory / "go").touch()
    trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=20)
    assert trial.status is TrialJobStatus.SUCCEEDED, trial.message


_WITHOUT_PROC = """
import json, sys
from pathlib import Path
from workers.platforms.local.keeper import Keeper, TrialLaunch, Zygote
directory = Path(sys.argv[1])
zygote = Zygote()
path = {"PATH": "/usr/bin:/bin"}
ended = Keeper(zygote)  # its trial ends, leaving a process in a session of its own
ended.run(TrialLaunch("setsid sleep 300 & echo $! > left; exit 3", str(directory), path, str(directory / "e1"), 10))
canceled = Keeper(zygote)  # its trial runs until the worker ends it
canceled.run(TrialLaunch("echo $$ > running; exec sleep 300", str(directory), path, str(directory / "e2"), 10))
print(json.dumps([ended.wait(30), canceled.close(), ended.close()]))
zygote.close()
"""


def test_a_keeper_that_cannot_read_proc_still_ends_and_reports(tmp_path: Path) -> None:
    """Without a readable /proc (an empty one here, in a mount namespace) the keeper cannot find what a trial
    left: it still reports the trial's status at its end, and still kills the trial itself on a cancel."""
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs `unshare --mount` (root) to hide /proc")
    script = f"mount -t tmpfs none /proc && exec {sys.executable} -c '{_WITHOUT_PROC}' {tmp_path}"
    try:
        answer = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert answer.returncode == 0, answer.stderr
        assert json.loads(answer.stdout) == [3, -signal.SIGKILL, 3]
    finally:
        for name in ("left", "running"):  # outside the namespace, /proc finds them
            pid = (tmp_path / name).read_text().strip() if (tmp_path / name).exists() else ""
            if pid:  # empty: killed by its cancel before it wrote its pid
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)


@contextlib.contextmanager
def pids_cgroup(name: str) -> Iterator[Path]:
    """A pids cgroup of its own (v1's hierarchy, or v2's root where it delegates pids); at the end, what is still in
    it goes back to the root group and it is removed. Skips where there is none to make (not root, no pids
    controller)."""
    root = Path("/sys/fs/cgroup/pids")
    if not root.is_dir():
        root = Path("/sys/fs/cgroup")
        with contextlib.suppress(OSError):
            if "pids" not in (root / "cgroup.subtree_control").read_text().split():
                pytest.skip("no pids cgroup controller to limit the processes with")
    group = root / name
    try:
        group.mkdir()
    except OSError as error:
        pytest.skip(f"cannot make a pids cgroup: {error}")
    try:
        yield group
    finally:

        def removed() -> bool:
            """Its processes moved out, then it removed: a zygote may fork one into it meanwhile (EBUSY), and one
            exiting counts there until it is reaped; both are gone at a later try."""
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):  # gone meanwhile
                    (root / "cgroup.procs").write_text(pid)
            try:
                group.rmdir()
            except OSError as error:
                if error.errno != errno.EBUSY:
                    raise
                return False
            return True

        wait_until(removed, 15, what=f"the pids cgroup {group} emptied and removed")


@pytest.mark.parametrize("refused", ["the keeper's fork of its trial", "the zygote's fork of a keeper"])
def test_a_trial_the_machine_cannot_fork_yet_waits_and_starts_when_a_trial_ends(
    make_service, processes: Processes, refused: str
) -> None:
    """At a limit on processes (a pids cgroup's `pids.max` here, as a container's can be), a fork for a trial fails
    with EAGAIN. The trial did not fail: it waits, saying why, and starts once a process is free."""
    with pids_cgroup(f"trialstream-test-{os.getpid()}-{len(refused)}") as group:
        service = make_service("exit 0")
        worker = processes.worker()
        zygote = wait_until(lambda: children_of(worker.pid), 15, what="the keeper zygote")
        spare = wait_until(lambda: children_of(zygote[0]), 15, what="a spare keeper")
        # The zygote alone in it, and room for a keeper (whose fork of its trial's process is then refused), or none.
        (group / "pids.max").write_text("2" if refused == "the keeper's fork of its trial" else "1")
        (group / "cgroup.procs").write_text(str(zygote[0]))
        ahead = wait_until(lambda: children_of(spare[0]), 15, what="the spare's process for its trial")
        os.kill(spare[0], signal.SIGKILL)  # the launch forks a keeper of its own
        gone = [*spare, *ahead]  # the latter holds the spare's lifeline until its first statement
        wait_until(lambda: not any(map(pid_alive, gone)), 10, what="the spare keeper and its process gone")
        waiting = service.submit_trial_job(form(0)).id

        def deferred() -> list[str]:
            return [
                entry.event.reason
                for entry in service.store.read()
                if isinstance(getattr(entry, "event", None), TrialDeferred)
            ]

        reasons = wait_until(deferred, 20, what="the trial deferred")
        assert reasons == [
            "waiting to start a process: Resource temporarily unavailable (a limit on processes or memory)"
        ]
        view = service.get_trial_job(waiting)
        assert view.status is TrialJobStatus.WAITING and view.message == reasons[0]
        (group / "pids.max").write_text("max")
        ended = wait_for_status(service, service.submit_trial_job(form(1)).id, "SUCCEEDED", "FAILED", timeout=20)
        assert ended.status is TrialJobStatus.SUCCEEDED, ended.message
        trial = wait_for_status(service, waiting, "SUCCEEDED", "FAILED", timeout=20)  # woken by that end
        assert trial.status is TrialJobStatus.SUCCEEDED and trial.attempt == 1, trial.message
        worker.kill()
        worker.wait()


def test_a_keeper_whose_fork_was_refused_says_so_though_it_ended_before_its_trial_came(tmp_path: Path) -> None:
    """A keeper refused its fork writes E and ends, often before the worker sends it the trial: the send then
    fails, and the E still in the lifeline says why (it was taken for a keeper killed while it waited, and the
    trial FAILED as an internal error)."""
    with pids_cgroup(f"trialstream-test-{os.getpid()}-ended") as group:
        zygote = Zygote()
        try:
            Keeper(zygote).discard()  # starts the zygote
            [zygote_pid] = children_of(os.getpid())
            (group / "pids.max").write_text("2")  # the zygote, and a keeper whose fork is refused
            (group / "cgroup.procs").write_text(str(zygote_pid))
            refused = Keeper(zygote)
            wait_until(lambda: not pid_alive(refused.pid), 10, what="the refused keeper ended")
            launch = TrialLaunch("true", str(tmp_path), {}, str(tmp_path / "stderr"), 1.0)
            with pytest.raises(OSError) as raised:
                refused.run(launch)
            assert raised.value.errno == errno.EAGAIN
            refused.discard()
        finally:
            zygote.close()


def test_a_process_of_the_trial_that_sigkill_cannot_end_is_left_and_named_and_the_trial_ends(
    make_service, processes: Processes
) -> None:
    """A process stuck where SIGKILL waits (frozen by a v1 freezer cgroup here, as one in a GPU driver or on a dead
    NFS mount is) would hold its keeper, the trial and its worker's slot for good: after TRIALSTREAM_KILL_WAIT_S
    the keeper leaves it, names it on the trial's stderr, and reports the trial's status."""
    freezer = Path("/sys/fs/cgroup/freezer")
    group = freezer / f"trialstream-test-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as error:
        pytest.skip(f"needs a v1 freezer cgroup, where a frozen process waits out SIGKILL: {error}")
    try:
        service = make_service(
            'sleep 300 & echo $! > "$NNI_SYS_DIR/child"; until [ -e "$NNI_SYS_DIR/go" ]; do sleep 0.01; done; exit 3'
        )
        processes.worker(env={"TRIALSTREAM_KILL_WAIT_S": "0.5"})
        trial_id = service.submit_trial_job(form(0)).id
        directory = Path(wait_for_status(service, trial_id, "RUNNING").working_directory)
        child = read_pid(directory / "child")
        (group / "cgroup.procs").write_text(str(child))
        (group / "freezer.state").write_text("FROZEN")
        wait_until(lambda: (group / "freezer.state").read_text().strip() == "FROZEN", 10, what="the child frozen")
        (directory / "go").touch()
        trial = wait_for_status(service, trial_id, "FAILED", "SUCCEEDED", timeout=20)
        assert trial.exit_code == 3
        assert f"left running, beyond the keeper's SIGKILL: pids [{child}]" in (directory / "stderr").read_text()
        assert pid_alive(child)
    finally:
        (group / "freezer.state").write_text("THAWED")  # its SIGKILL lands
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                (freezer / "cgroup.procs").write_text(pid)
        group.rmdir()


def test_a_trial_killed_by_a_signal_fails_saying_which(make_service, processes: Processes) -> None:
    service = make_service("echo about to go >&2; kill -SEGV $$")
    processes.worker()
    trial = wait_for_status(service, service.submit_trial_job(form(0)).id, "FAILED", "SUCCEEDED")
    assert trial.exit_code == -11
    assert trial.message == "killed by signal SIGSEGV; stderr: about to go"


def test_a_trial_that_kills_its_keeper_fails_as_killed_and_its_processes_go(make_service, processes: Processes) -> None:
    """A keeper SIGKILLed says nothing on its lifeline: the trial counts as killed, and its process group is
    killed after it."""
    service = make_service('echo $$ > "$NNI_SYS_DIR/pid"; kill -9 $PPID; sleep 60')
    processes.worker()
    trial = wait_for_status(service, service.submit_trial_job(form(0)).id, "FAILED", "SUCCEEDED", timeout=20)
    assert trial.exit_code == -9 and trial.message == "killed by signal SIGKILL"
    shell = read_pid(Path(trial.working_directory) / "pid")
    wait_until(lambda: not pid_alive(shell), 10, what="the trial's shell gone")


def test_a_trial_holds_no_descriptor_but_its_three_and_ignores_no_signal(make_service, processes: Processes) -> None:
    """Nothing of the worker, its zygote or its keeper leaks to the trial: no socket or pipe of theirs, and no
    signal Python ignores (SIGPIPE, SIGXFSZ) or the keeper handles stays ignored in a trial's processes."""
    service = make_service('echo $$ > "$NNI_SYS_DIR/pid"; exec sleep 60')
    processes.worker()
    trial_id = service.submit_trial_job(form(0)).id
    running = wait_for_status(service, trial_id, "RUNNING")
    pid = read_pid(Path(running.working_directory) / "pid")
    wait_until(lambda: b"sleep" in Path(f"/proc/{pid}/cmdline").read_bytes(), 10, what="the trial's exec")
    assert sorted(int(fd) for fd in os.listdir(f"/proc/{pid}/fd")) == [0, 1, 2]
    ignored = int(
        next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if "SigIgn" in line)[7:], 16
    )
    for number in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
        assert not ignored & 1 << (number - 1), number.name  # what the worker was started with ignoring stays so
    service.cancel_trial_job(trial_id)
    wait_for_status(service, trial_id, "USER_CANCELED", timeout=20)


def test_update_trial_job_hands_a_new_parameter_set_to_the_running_trial(
    make_service, processes: Processes, code_dir
) -> None:
    command = script(
        code_dir,
        "phases.py",
        """
        import json, os, time
        path = os.path.join(os.environ["NNI_SYS_DIR"], "parameter_1.cfg")
        deadline = time.time() + 20
        while not os.path.exists(path) and time.time() < deadline:
            time.sleep(0.02)
        raise SystemExit(0 if json.load(open(path))["parameters"] == {"x": 2} else 1)
        """,
    )
    service = make_service(command)
    processes.worker()
    trial_id = service.submit_trial_job(form(0, x=1)).id
    wait_for_status(service, trial_id, "RUNNING")
    second = form(0, x=2)
    second = second.model_copy(update={"hyper_parameters": second.hyper_parameters.model_copy(update={"index": 1})})
    service.update_trial_job(trial_id, second)
    assert wait_for_status(service, trial_id, "SUCCEEDED", "FAILED").status is TrialJobStatus.SUCCEEDED


def test_rq_default_job_timeout_never_kills_a_trial(make_service, redis_url: str, tmp_path: Path) -> None:
    """A worker whose RQ defaults say 1 s still lets a 3 s trial finish."""
    service = make_service("sleep 3")
    trial_id = service.submit_trial_job(form(0)).id
    strict_worker = textwrap.dedent(
        f"""
        import rq.defaults, rq.queue
        rq.defaults.DEFAULT_JOB_TIMEOUT = 1
        rq.queue.Queue.DEFAULT_TIMEOUT = 1
        from core.settings import Settings
        from workers.runtime.worker import serve
        serve(Settings(redis_url={redis_url!r}), "local", burst=True)
        """
    )
    subprocess.run([sys.executable, "-c", strict_worker], cwd=REPO, check=True, timeout=60, capture_output=True)
    assert service.get_trial_job(trial_id).status is TrialJobStatus.SUCCEEDED


class CountingControl:
    """Only wake() matters here: the watch loop's wake-ups."""

    def __init__(self) -> None:
        self.wakes = 0

    def wake(self) -> None:
        self.wakes += 1


def test_a_worker_watches_all_its_trials_with_one_inotify_instance(make_service, processes: Processes) -> None:
    """Instances are a per-user limit (128 on Debian) that an instance per trial ran out of. At most one: none
    where the rest of the machine holds all of the user's instances as the trials start (in the suite, the other
    tests' workers and containers, all root's, may: it happened once in a pass), and its trials are then polled."""
    service = make_service('touch "$NNI_SYS_DIR/up"; sleep 60')
    worker = processes.worker(args=("--concurrency", "3"))
    trial_ids = [service.submit_trial_job(form(index)).id for index in range(3)]
    for trial_id in trial_ids:
        up = Path(wait_for_status(service, trial_id, "RUNNING").working_directory) / "up"
        wait_until(up.exists, 10, what="the trial up")
    assert open_descriptors(worker.pid).count("anon_inode:inotify") <= 1  # the code before held one per trial: 3
    for trial_id in trial_ids:
        service.cancel_trial_job(trial_id)
    for trial_id in trial_ids:
        wait_for_status(service, trial_id, "USER_CANCELED", timeout=20)


def open_descriptors(pid: int) -> list[str]:
    """What a live process's descriptors point at; one it closes while they are read is skipped."""
    links = []
    for descriptor in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):
            links.append(os.readlink(descriptor))
    return links


def gated_trial(directory: Path) -> subprocess.Popen[bytes]:
    """A trial that appends to its metrics file once `write` appears beside it, and exits once `exit` does."""
    script = "until [ -e write ]; do sleep 0.01; done; echo ME >> .nni/metrics; until [ -e exit ]; do sleep 0.01; done"
    return subprocess.Popen(["/bin/sh", "-c", script], cwd=directory)


@pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "no-inotify-instance-left"])
def test_trials_are_woken_by_their_own_metric_writes_and_by_their_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inotify: bool
) -> None:
    """One thread and one inotify instance wake every trial of a worker: each at its own writes (without inotify,
    every few milliseconds), once more at its exit, then it is forgotten. Two attempts of a trial may watch the
    same directory: the one still running is woken after the other has gone."""
    if not inotify:

        def no_instance_left() -> None:
            raise OSError(24, "Too many open files")

        monkeypatch.setattr(wakeups, "INotify", no_instance_left)
    directories = [tmp_path / name for name in ("a", "b", "b")]  # two attempts of b
    for directory in directories:
        (directory / ".nni").mkdir(parents=True, exist_ok=True)
    watcher = wakeups.TrialWakeups()
    trials = [gated_trial(directory) for directory in directories]
    controls = [CountingControl() for _ in trials]
    for directory, trial, control in zip(directories, trials, controls, strict=True):
        watcher.watch(directory / ".nni", os.pidfd_open(trial.pid), control.wake)
    try:
        (tmp_path / "a" / "write").touch()
        wait_until(lambda: controls[0].wakes >= 1, 5, what="a wake-up for a's write")
        if inotify:
            assert controls[1].wakes == controls[2].wakes == 0  # b wrote nothing
        assert all(trial.poll() is None for trial in trials)  # woken by the write, not by an exit

        (tmp_path / "a" / "exit").touch()
        assert trials[0].wait(5) == 0
        wait_until(lambda: len(watcher._by_fd) == 2, 5, what="a forgotten")
        woken_at_exit = controls[0].wakes
        (tmp_path / "b" / "write").touch()  # b's attempts both write in b: first the older one ends
        wait_until(lambda: controls[1].wakes >= 1 and controls[2].wakes >= 1, 5, what="b's wake-ups")
        trials[1].kill()
        trials[1].wait(5)
        wait_until(lambda: len(watcher._by_fd) == 1, 5, what="b's first attempt forgotten")
        wakes = controls[2].wakes
        with (tmp_path / "b" / ".nni" / "metrics").open("a") as metrics:
            metrics.write("ME\n")
        wait_until(lambda: controls[2].wakes > wakes, 5, what="a wake-up of b's second attempt at its write")
        assert controls[0].wakes == woken_at_exit  # a, gone, is never woken again
    finally:  # every gate open, so that no trial outlives a failed assertion
        for name in ("a", "b"):
            (tmp_path / name / "write").touch()
            (tmp_path / name / "exit").touch()
        for trial in trials:
            trial.wait(5)
        wait_until(lambda: not watcher._by_fd, 5, what="every trial forgotten")
        watcher.close()


def test_a_worker_without_an_inotify_instance_takes_one_at_a_later_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user's inotify instances ran out as the worker's first trial came (fs.inotify.max_user_instances):
    that trial is polled, and the next one asks again, gets an instance once one is free, and is watched."""
    refusals = [OSError(24, "Too many open files")]

    def instance_once_free() -> object:
        if refusals:
            raise refusals.pop()
        return INotify()

    monkeypatch.setattr(wakeups, "INotify", instance_once_free)
    directories = [tmp_path / name for name in ("first", "second")]
    for directory in directories:
        (directory / ".nni").mkdir(parents=True)
    watcher = wakeups.TrialWakeups()
    trials = [gated_trial(directory) for directory in directories]
    controls = [CountingControl() for _ in trials]
    try:
        for directory, trial, control in zip(directories, trials, controls, strict=True):
            watcher.watch(directory / ".nni", os.pidfd_open(trial.pid), control.wake)
        first, second = (next(w for w in watcher._by_fd.values() if w.wake == c.wake) for c in controls)
        assert first.wd is None and watcher._polled == {first}
        assert second.wd is not None
        (tmp_path / "second" / ".nni" / "metrics").write_text("ME\n")
        wait_until(lambda: controls[1].wakes >= 1, 5, what="a wake-up of the second trial at its write")
    finally:
        for directory, trial in zip(directories, trials, strict=True):
            (directory / "write").touch()
            (directory / "exit").touch()
            trial.wait(5)
        wait_until(lambda: not watcher._by_fd, 5, what="every trial forgotten")
        watcher.close()


class StalledSink:
    """Takes metrics as a trial's control does, its first append held until `release` is set: an append
    that waits out a Redis failover."""

    def __init__(self) -> None:
        self.found: list[ParsedMetric] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def metrics(self, metrics: Sequence[ParsedMetric]) -> None:
        self.entered.set()
        self.release.wait(30)
        self.found.extend(metrics)

    def rejected(self, reason: str) -> None:
        raise AssertionError(reason)


def test_stdout_printed_while_an_append_waits_is_read_after_the_drain_time(tmp_path: Path) -> None:
    """Regression (tests/faults/test_failover.py lost 4 metrics of a trial): the first line's append waited
    out a failover past the drain time; the reader then stopped with the trial's other lines still in the pipe."""
    go_on = tmp_path / "go-on"
    prints = (
        "import json, os, time\n"
        "for sequence in range(5):\n"
        "    record = json.dumps({'parameter_id': 0, 'type': 'PERIODICAL', 'sequence': sequence, 'value': 1})\n"
        "    print(f\"NNISDK_MEb'{record}'\", flush=True)\n"
        f"    while not os.path.exists({str(go_on)!r}):  # the first line is read alone\n"
        "        time.sleep(0.01)\n"
    )
    trial = subprocess.Popen([sys.executable, "-c", prints], stdout=subprocess.PIPE)
    assert trial.stdout is not None
    sink = StalledSink()
    reader = local._StdoutReader(trial.stdout, StdoutMetricPump(sink))
    reader.start()
    assert sink.entered.wait(10), "the first metric line read"
    go_on.touch()
    assert trial.wait(10) == 0  # the other lines are in the pipe, unread
    finisher = threading.Thread(target=reader.finish, args=(0.05,))
    finisher.start()
    wait_until(lambda: reader._stop.is_set(), 10, what="the drain time over")
    sink.release.set()  # Redis is back: the first append returns
    finisher.join(10)
    assert not finisher.is_alive()
    assert [metric.sequence for metric in sink.found] == [0, 1, 2, 3, 4]
