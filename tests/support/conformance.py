"""The platform conformance suite: what every platform must do, the same tests for each.

A platform's test module subclasses `PlatformConformance` and gives a `harness` fixture: its
trainingService section, how to start a real worker for it, and what it promises (whether its
trials outlive their worker, how many trials one worker may follow). The trial is one script,
`conformance_trial.py`, that speaks NNI's trial-side contract directly (parameter.cfg, `ME` records
in the metrics file, `NNISDK_MEb` lines on stdout), so the suite checks the platform, not an SDK.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from core.connections import connect, same_server
from core.event_store import StoredEvent
from core.registry import platform_class
from manager.projector import Projector
from manager.training_service import TrainingService
from schemas.events import TrialAttemptLost, TrialReattached
from schemas.trial import HyperParameters, JobApplicationForm, TrialJobDetail, TrialJobStatus
from tests.conftest import (
    Processes,
    ServiceFactory,
    new_service,
    processes_on_own_redis,
    wait_for_status,
    wait_until,
)

TRIAL = """
import json, os, sys, time

sys_dir = os.environ["NNI_SYS_DIR"]
form = json.load(open(os.path.join(sys_dir, "parameter.cfg")))
params = form["parameters"]
mode = params["mode"]


def record(kind, sequence, value):
    return json.dumps({"parameter_id": form["parameter_id"], "type": kind, "sequence": sequence,
                       "value": json.dumps(value)})


def to_file(kind, sequence, value):
    os.makedirs(os.path.join(sys_dir, ".nni"), exist_ok=True)
    data = record(kind, sequence, value).encode() + b"\\n"
    with open(os.path.join(sys_dir, ".nni", "metrics"), "ab") as metrics:
        metrics.write(b"ME%06d" % len(data) + data)


def to_stdout(kind, sequence, value):
    print("NNISDK_MEb'" + record(kind, sequence, value) + "'", flush=True)  # the JSON as it is, as NNI prints it


if mode == "environment":
    names = ["NNI_PLATFORM", "NNI_EXP_ID", "NNI_TRIAL_JOB_ID", "NNI_SYS_DIR", "NNI_OUTPUT_DIR",
             "NNI_TRIAL_SEQ_ID", "MULTI_PHASE"]
    seen = {name: os.environ.get(name) for name in names}
    leaked = sorted(name for name in os.environ if name.startswith("TRIALSTREAM_"))
    to_stdout("FINAL", 0, {"default": 1, "environment": seen, "leaked": leaked, "parameters": params})
elif mode == "metrics":
    to_file("PERIODICAL", 0, 0.25)
    to_stdout("PERIODICAL", 1, 0.5)
    to_file("FINAL", 0, {"default": 0.75, "loss": 0.1})
elif mode == "exit":
    sys.stderr.write("the trial's last words\\n")
    sys.exit(params["code"])
elif mode == "sleep":
    open(os.path.join(sys_dir, "started"), "w").close()
    time.sleep(params.get("seconds", 300))
elif mode == "hold-once":  # the first run holds until released (or interrupted); a second run does not
    first = not os.path.exists(params["marker"])
    open(params["marker"], "a").close()
    deadline = time.time() + 300
    while first and not os.path.exists(params["release"]) and time.time() < deadline:
        time.sleep(0.05)
    to_stdout("FINAL", 0, 1.0)
"""


@dataclass
class PlatformHarness:
    """What a platform's test module tells the suite: its trainingService section and what its workers need
    in their environment (a trusted known_hosts file, a simulated workspace's endpoints)."""

    platform_config: dict[str, Any]
    worker_env: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable  # the interpreter trials run with, where they run

    @property
    def name(self) -> str:
        return str(self.platform_config["platform"])

    @property
    def outlives_worker(self) -> bool:
        return platform_class(self.name).trials_outlive_worker

    @property
    def trials_per_process(self) -> int:
        return platform_class(self.name).trials_per_process

    def start_worker(
        self, processes: Processes, env: dict[str, str] | None = None, args: tuple[str, ...] = ()
    ) -> subprocess.Popen[bytes]:
        """A worker of the platform serving its queue on `processes`' Redis."""
        return processes.worker(self.name, env={**self.worker_env, **(env or {})}, args=args)


def history(service: TrainingService, trial_id: str) -> list[Any]:
    return [
        e.event
        for e in service.store.read()
        if isinstance(e, StoredEvent) and getattr(e.event, "trial_id", None) == trial_id
    ]


def trial_form(sequence_id: int = 0, **parameters: Any) -> JobApplicationForm:
    value = json.dumps(
        {"parameter_id": sequence_id, "parameter_source": "algorithm", "parameters": parameters, "parameter_index": 0}
    )
    return JobApplicationForm(sequence_id=sequence_id, hyper_parameters=HyperParameters(value=value))


class PlatformConformance:
    """The behaviour every platform shows. Not collected by itself (its name does not start with Test).

    The platform's parts (simulated cluster, hosts, workspace) start once for the class, and so does one
    worker, on a redis-server of the class's own, for the tests that leave their worker alive: each test
    isolates by the experiment it creates. The tests that kill a worker or start one of their own settings
    run on the per-test Redis, where no other worker takes their trials.
    """

    @pytest.fixture(scope="class")
    def harness(self) -> PlatformHarness:
        raise NotImplementedError("a platform's test module provides the harness")

    @pytest.fixture(scope="class")
    def served(self, harness: PlatformHarness, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
        with processes_on_own_redis(tmp_path_factory.mktemp("conformance")) as processes:
            harness.start_worker(processes)
            yield processes

    @pytest.fixture
    def service_for(self, harness: PlatformHarness, served: Processes, tmp_path: Path, code_dir: Path):
        """An experiment served by the class's worker."""
        client = connect(served.redis_url)
        services: list[TrainingService] = []

        def make(**options: Any) -> TrainingService:
            command = f"{harness.python} conformance_trial.py"
            rq_connection = same_server(client, decode=False)
            services.append(
                new_service(client, rq_connection, tmp_path, code_dir, command, harness.platform_config, **options)
            )
            return services[-1]

        (code_dir / "conformance_trial.py").write_text(textwrap.dedent(TRIAL))
        yield make
        for service in services:  # a failed test leaves no trial holding the shared worker
            service.clean_up()

    @pytest.fixture
    def own_service_for(self, harness: PlatformHarness, make_service: ServiceFactory, code_dir: Path):
        """An experiment on the per-test Redis, which only the workers a test starts serve."""
        (code_dir / "conformance_trial.py").write_text(textwrap.dedent(TRIAL))

        def make(**options: Any) -> TrainingService:
            command = f"{harness.python} conformance_trial.py"
            return make_service(command, platform_config=harness.platform_config, **options)

        return make

    def finished(self, service: TrainingService, trial_id: str, timeout: float = 60) -> TrialJobDetail:
        terminal = [str(status) for status in TrialJobStatus if status.is_terminal]
        return wait_for_status(service, trial_id, *terminal, timeout=timeout)

    def test_trial_gets_nni_environment_and_its_parameters(self, harness: PlatformHarness, service_for) -> None:
        service = service_for()
        trial_id = service.submit_trial_job(trial_form(4, mode="environment", lr=0.5)).id
        trial = self.finished(service, trial_id)
        assert trial.status is TrialJobStatus.SUCCEEDED, trial.message
        seen = trial.final_metric
        assert isinstance(seen, dict)
        assert seen["parameters"] == {"mode": "environment", "lr": 0.5}
        environment = seen["environment"]
        assert environment["NNI_PLATFORM"] == harness.name
        assert environment["NNI_EXP_ID"] == service.experiment_id
        assert environment["NNI_TRIAL_JOB_ID"] == trial_id
        assert environment["NNI_TRIAL_SEQ_ID"] == "4"
        assert environment["NNI_SYS_DIR"] and environment["NNI_OUTPUT_DIR"]
        assert environment["MULTI_PHASE"] == "false"
        assert seen["leaked"] == []  # none of trialstream's settings (the Redis URL among them)

    def test_metrics_arrive_from_both_wire_formats_once_each(self, harness: PlatformHarness, service_for) -> None:
        service = service_for()
        trial_id = service.submit_trial_job(trial_form(0, mode="metrics")).id
        trial = self.finished(service, trial_id)
        assert trial.status is TrialJobStatus.SUCCEEDED, trial.message
        assert trial.final_metric == {"default": 0.75, "loss": 0.1}
        Projector(service.store.client).catch_up(service.experiment_id)
        metrics = service.views.metrics(trial_id)
        assert sorted((m.type, m.sequence, json.dumps(m.value)) for m in metrics) == [
            ("FINAL", 0, json.dumps({"default": 0.75, "loss": 0.1})),
            ("PERIODICAL", 0, "0.25"),
            ("PERIODICAL", 1, "0.5"),
        ]

    @pytest.mark.parametrize(("code", "status"), [(0, TrialJobStatus.SUCCEEDED), (3, TrialJobStatus.FAILED)])
    def test_exit_code_decides_the_status(
        self, harness: PlatformHarness, service_for, code: int, status: TrialJobStatus
    ) -> None:
        service = service_for()
        trial = self.finished(service, service.submit_trial_job(trial_form(0, mode="exit", code=code)).id)
        assert trial.status is status and trial.exit_code == code
        if code:
            assert "exit code 3" in (trial.message or "") and "the trial's last words" in (trial.message or "")

    @pytest.mark.parametrize(
        ("early", "status"), [(False, TrialJobStatus.USER_CANCELED), (True, TrialJobStatus.EARLY_STOPPED)]
    )
    def test_cancel_stops_a_running_trial(
        self, harness: PlatformHarness, service_for, early: bool, status: TrialJobStatus
    ) -> None:
        service = service_for()
        trial_id = service.submit_trial_job(trial_form(0, mode="sleep")).id
        wait_for_status(service, trial_id, "RUNNING")
        service.cancel_trial_job(trial_id, is_early_stopped=early)
        assert self.finished(service, trial_id).status is status

    def test_max_trial_duration_stops_it_early(self, harness: PlatformHarness, service_for) -> None:
        service = service_for(max_trial_duration=1.0)
        trial = self.finished(service, service.submit_trial_job(trial_form(0, mode="sleep")).id)
        assert trial.status is TrialJobStatus.EARLY_STOPPED
        assert "maxTrialDuration" in (trial.message or "")

    def test_clean_up_stops_every_trial_still_running(self, harness: PlatformHarness, service_for) -> None:
        service = service_for()
        trial_id = service.submit_trial_job(trial_form(0, mode="sleep")).id
        wait_for_status(service, trial_id, "RUNNING")
        service.clean_up()
        assert self.finished(service, trial_id).status is TrialJobStatus.SYS_CANCELED

    @pytest.mark.parametrize("retries", [0, 1])
    def test_a_killed_worker_s_attempt_is_lost_retried_or_reattached(
        self, harness: PlatformHarness, own_service_for, processes: Processes, tmp_path: Path, retries: int
    ) -> None:
        service = own_service_for(max_retries=retries)
        fast = {"TRIALSTREAM_TRIAL_LEASE_S": "1"}
        victim = harness.start_worker(processes, env=fast)
        release = tmp_path / "release"
        held = trial_form(0, mode="hold-once", marker=str(tmp_path / "marker"), release=str(release))
        trial_id = service.submit_trial_job(held).id
        wait_for_status(service, trial_id, "RUNNING")
        harness.start_worker(processes, env=fast)  # the survivor that notices, and takes the trial up
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        if harness.outlives_worker:  # the same attempt runs on, followed again by the survivor
            wait_until(lambda: any(isinstance(e, TrialReattached) for e in history(service, trial_id)), 30)
            release.touch()
            trial = self.finished(service, trial_id)
            assert trial.status is TrialJobStatus.SUCCEEDED and trial.attempt == 1
            assert not any(isinstance(e, TrialAttemptLost) for e in history(service, trial_id))
            return
        trial = self.finished(service, trial_id)
        if retries:
            assert trial.status is TrialJobStatus.SUCCEEDED and trial.attempt == 2
        else:
            assert trial.status is TrialJobStatus.FAILED and trial.attempt == 1
            assert "lost" in (trial.message or "")

    def test_one_worker_follows_several_trials_at_once(
        self, harness: PlatformHarness, own_service_for, processes: Processes
    ) -> None:
        concurrency = min(3, harness.trials_per_process)
        if concurrency < 2:
            pytest.skip(f"platform {harness.name} runs one trial per worker process")
        service = own_service_for()
        harness.start_worker(processes, args=("--concurrency", str(concurrency)))
        trial_ids = [service.submit_trial_job(trial_form(i, mode="sleep")).id for i in range(concurrency)]

        def all_running() -> bool:
            return all(trial.status is TrialJobStatus.RUNNING for trial in service.get_trial_jobs(trial_ids))

        wait_until(all_running, 60, what=f"{concurrency} trials running on one worker")
        service.clean_up()
        for trial_id in trial_ids:
            assert self.finished(service, trial_id).status is TrialJobStatus.SYS_CANCELED
