"""The openpai platform against the simulated OpenPAI cluster (simulators/paisim), point by point:

1. NNI v2's `openpai` keys load, bad ones are one line each, and the token never appears in events, logs
   or answers (it reaches OpenPAI only in the Authorization header).
2. One job per trial over REST v2 with NNI's name and protocol v2 YAML; states read as NNI reads them
   (WAITING, RUNNING, ended), a job the cluster stops is SYS_CANCELED, a cancel is `executionType: STOP`,
   a job OpenPAI refuses is a FAILED trial with OpenPAI's words, openpaiConfig is the user's own job.
3. Code staged once per experiment on the storage (.nniignore), each trial's output written there by the
   job's command wrapper and read from the local mount with committed offsets.
4. The pre-start check: host unreachable, bad token, unknown virtual cluster, unknown storage, missing mount
   point, one line each, before any trial.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from core import keys
from core.assignments import load_assignment
from core.registry import platform_class
from core.settings import Settings
from core.variables import REDIS_URL_ENV
from manager.config import load_experiment_config
from manager.runner import ExperimentRunner, RunnerError
from manager.training_service import TrainingService
from schemas.events import TrialMetricReported, TrialReattached, TrialStarted
from schemas.trial import TrialJobStatus
from simulators.paisim import SimulatedOpenpai
from simulators.waiting import wait_until
from tests.conftest import REPO, Processes, ServiceFactory, form, wait_for_status
from tests.platforms.test_remote_config import redis_values
from tests.support import configs
from tests.support.configs import rejection
from tests.support.conformance import history
from tests.support.pai_setup import PAI_TOKEN, PAI_USER, pai_cluster, pai_section  # noqa: F401
from tests.support.workers import PlatformWorkers
from workers.platforms.openpai.adapter import OpenpaiPlatform, job_name, trial_status
from workers.platforms.openpai.config import OpenpaiConfig

MASK = "**********"
HEADER = "trainingService: cannot run trials there:"
SPACE = {"x": {"_type": "choice", "_value": [1, 2]}}


def write_config(directory: Path, section: dict[str, Any], **top: Any) -> Path:
    return configs.write_config(directory, section, SPACE, **top)


def check(section: dict[str, Any], code_dir: Path) -> list[str]:
    config = OpenpaiConfig.model_validate(section)
    return platform_class("openpai").check(config, code_dir, Settings())


def trial_form(sequence_id: int = 0, **parameters: Any) -> Any:
    return form(sequence_id, **parameters)


@pytest.fixture
def pai(make_service: ServiceFactory, pai_cluster: SimulatedOpenpai, code_dir: Path):  # noqa: F811
    """An experiment on the simulated cluster whose trial runs `command` (a Python snippet) in code_dir."""

    def make(snippet: str = "print(1)", **extra: Any) -> TrainingService:
        (code_dir / "trial.py").write_text(snippet)
        return make_service(f"{sys.executable} trial.py", platform_config=pai_section(pai_cluster, **extra))

    return make


# --- 1. the config and its secret ---------------------------------------------------------------------------


def test_nni_s_openpai_keys_load(tmp_path: Path) -> None:
    mount = tmp_path / "mnt"
    mount.mkdir()
    template = tmp_path / "job.yml"
    template.write_text(yaml.safe_dump({"protocolVersion": 2, "name": "x", "type": "job", "taskRoles": {"t": {}}}))
    section = {
        "platform": "openpai",
        "host": "pai.example.com",
        "username": "alice",
        "token": "secret-token",
        "trialCpuNumber": 2,
        "trialMemorySize": "8gb",
        "trialGpuNumber": 1,
        "storageConfigName": "confignfs",
        "dockerImage": "msranni/nni:v2",
        "virtualCluster": "gpu",
        "localStorageMountPoint": str(mount),
        "containerStorageMountPoint": "/mnt/confignfs/",
        "reuseMode": False,
    }
    spec = load_experiment_config(write_config(tmp_path, section))
    config = spec.platform
    assert isinstance(config, OpenpaiConfig)
    assert config.host == "https://pai.example.com"  # NNI's rule: no scheme is https
    assert config.trial_memory_size == 8192 and config.trial_gpu_number == 1
    assert config.container_storage_mount_point == "/mnt/confignfs"
    assert config.token.get_secret_value() == "secret-token"
    assert spec.as_event_config["trainingService"]["token"] == MASK
    # openpaiConfigFile: an invalid job in it is one line naming the file
    lines = rejection(write_config(tmp_path, {**section, "openpaiConfigFile": str(template)}))
    assert lines == [f"trainingService: {template}: taskRoles.t.commands: give a list of command lines"]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"trialGpuNumber": None}, "trainingService.trialGpuNumber: required by the openpai platform"),
        ({"token": None}, "trainingService.token: required key is missing"),
        ({"tokn": "x"}, "trainingService.tokn: unknown key; check its spelling against the NNI v2 config reference"),
        ({"openpaiConfig": {"taskRoles": {}}, "openpaiConfigFile": "job.yml"}, "give either 'openpaiConfig' or"),
        ({"openpaiConfigFile": "/no/such/job.yml"}, "cannot read /no/such/job.yml"),
        ({"containerStorageMountPoint": "mnt/data"}, "trainingService.containerStorageMountPoint: String should"),
    ],
)
def test_a_bad_section_is_one_line_naming_the_key(tmp_path: Path, change: dict[str, Any], expected: str) -> None:
    section = {
        "platform": "openpai",
        "host": "http://127.0.0.1:9",
        "username": "alice",
        "token": "s3cr3t-value",
        "trialCpuNumber": 1,
        "trialMemorySize": 1024,
        "trialGpuNumber": 0,
        "storageConfigName": "s",
        "localStorageMountPoint": str(tmp_path),
        "containerStorageMountPoint": "/mnt/s",
    }
    section.update(change)
    section = {key: value for key, value in section.items() if value is not None}
    [line] = rejection(write_config(tmp_path, section))
    assert expected in line, line
    assert "s3cr3t-value" not in line


def test_the_token_reaches_openpai_only_in_the_authorization_header(
    tmp_path: Path,
    pai_cluster: SimulatedOpenpai,  # noqa: F811
    processes: Processes,
    client: redis.Redis,
    rq_connection: redis.Redis,
) -> None:
    # the trial prints its whole environment: the token must not be in it either
    command = f'{sys.executable} -c "import os; print(1); print(dict(os.environ))"'
    path = write_config(tmp_path, pai_section(pai_cluster), trialCommand=command, maxTrialNumber=2)
    processes.projector()
    PlatformWorkers(processes, "openpai").start(args=("--concurrency", "2"))
    runner = ExperimentRunner.create(load_experiment_config(path), client, rq_connection, settings=Settings())
    experiment_id = runner.experiment_id
    result = runner.run()
    assert [trial.status for trial in result.trials] == [TrialJobStatus.SUCCEEDED] * 2

    holding = {
        key for key, values in redis_values(rq_connection).items() if any(PAI_TOKEN.encode() in v for v in values)
    }
    assert holding == {keys.secrets(experiment_id, "openpai").encode()}  # kept beside the log, not in it
    service = TrainingService(client, rq_connection, experiment_id)
    assert service.experiment_view().config["trainingService"]["token"] == MASK
    logs = processes.logs()
    assert logs.strip() and PAI_TOKEN not in logs
    events = subprocess.run(
        [sys.executable, "-m", "manager.cli", "events", experiment_id, "--json"],
        env={**os.environ, REDIS_URL_ENV: processes.redis_url},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert events.returncode == 0 and MASK in events.stdout and PAI_TOKEN not in events.stdout + events.stderr
    # what OpenPAI got: the token in the header of every request, in no job's YAML, command or file
    assert all(headers["Authorization"] == f"Bearer {PAI_TOKEN}" for _, _, headers in pai_cluster.requests)
    assert all(PAI_TOKEN not in job.raw for job in pai_cluster.jobs.values())
    share = pai_cluster.storages["confignfs"].path
    written = [path for path in share.rglob("*") if path.is_file() and PAI_TOKEN.encode() in path.read_bytes()]
    assert written == []
    assert any(b"NNI_PLATFORM" in path.read_bytes() for path in share.rglob("trial.stdout"))  # the env was printed


# --- 2. jobs through the REST API ----------------------------------------------------------------------------


def test_a_trial_is_one_job_with_nni_s_name_and_protocol(
    pai,
    pai_cluster: SimulatedOpenpai,  # noqa: F811
    processes: Processes,
    client: redis.Redis,
    code_dir: Path,
) -> None:
    (code_dir / ".nniignore").write_text("data/\n")
    (code_dir / "data").mkdir()
    (code_dir / "data" / "big.bin").write_bytes(b"0" * 1000)
    snippet = (
        "import json, os\n"
        "print('hello from the job')\n"
        "print(\"NNISDK_MEb'\" + json.dumps({'parameter_id': 0, 'type': 'FINAL', 'sequence': 0, "
        "'value': '0.5'}) + \"'\")\n"
    )
    service = pai(snippet, virtualCluster="gpu", trialCpuNumber=2, trialMemorySize="2gb")
    PlatformWorkers(processes, "openpai").start(args=("--concurrency", "2"))
    ids = [service.submit_trial_job(trial_form(i)).id for i in range(2)]
    trials = [wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60) for trial_id in ids]
    assert [trial.status for trial in trials] == [TrialJobStatus.SUCCEEDED] * 2, [t.message for t in trials]
    assert [trial.final_metric for trial in trials] == [0.5, 0.5]

    experiment = service.experiment_id
    trial = trials[0]
    job = pai_cluster.job(PAI_USER, f"nni_exp_{experiment}_trial_{trial.id}")
    assert job.state == "SUCCEEDED"
    protocol = yaml.safe_load(job.raw)
    assert protocol["protocolVersion"] == 2 and protocol["type"] == "job" and protocol["jobRetryCount"] == 0
    assert protocol["prerequisites"] == [{"type": "dockerimage", "uri": "msranni/nni:latest", "name": "docker_image_0"}]
    role = protocol["taskRoles"]["taskrole"]
    assert role["resourcePerInstance"] == {"gpu": 0, "cpu": 2, "memoryMB": 2048}
    assert role["instances"] == 1 and role["dockerImage"] == "docker_image_0"
    assert protocol["extras"]["storages"] == [{"name": "confignfs"}]
    assert protocol["defaults"] == {"virtualCluster": "gpu"}
    [command] = role["commands"]
    assert "NNI_SYS_DIR=/mnt/confignfs/" in command and str(pai_cluster.storages["confignfs"].path) not in command
    assert "TRIALSTREAM" not in command and "redis" not in command  # nothing in the container reaches back
    submissions = [headers for method, path, headers in pai_cluster.requests if method == "POST"]
    assert len(submissions) == 2 and all(headers["Content-Type"] == "text/yaml" for headers in submissions)
    started = [e for e in history(service, trial.id) if isinstance(e, TrialStarted)]
    assert started[0].url == f"{pai_cluster.url}/job-detail.html?username={PAI_USER}&jobName={job.name}"

    # 3. the code on the storage once, without what .nniignore excludes; the output there, read by offsets
    share = pai_cluster.storages["confignfs"].path
    staged = share / experiment / "nni-code"
    assert (staged / "trial.py").is_file() and not (staged / "data").exists()
    directory = share / experiment / trial.id
    assert (directory / "code" / "trial.py").is_file() and (directory / "parameter.cfg").is_file()
    stdout = (directory / "trial.stdout").read_bytes()
    assert stdout.startswith(b"hello from the job\n")
    assert not client.exists(keys.read_offsets(experiment, trial.id, 1))  # gone with the attempt
    assert (directory / ".exitcode").read_text().strip() == "0"
    platform = OpenpaiPlatform(Settings(), client)
    try:
        assignment = _assignment(service, trial.id)
        assert platform.read_output(assignment, started[0].url or "", "stdout", 0) == stdout
        assert platform.read_output(assignment, started[0].url or "", "stdout", 6) == stdout[6:]
    finally:
        platform.close()


def _assignment(service: TrainingService, trial_id: str) -> Any:
    return load_assignment(service.store.client, platform_class("openpai"), service.experiment_id, trial_id, 1)


RESUMABLE = """
import json, os, time
sys_dir = os.environ["NNI_SYS_DIR"]
gate = json.load(open(os.path.join(sys_dir, "parameter.cfg")))["parameters"]["gate"]


def record(sequence):
    return json.dumps({"parameter_id": 0, "type": "PERIODICAL", "sequence": sequence, "value": str(sequence)})


def to_stdout(sequence):
    print("NNISDK_MEb'" + record(sequence) + "'", flush=True)


def to_file(sequence):
    os.makedirs(os.path.join(sys_dir, ".nni"), exist_ok=True)
    data = record(sequence).encode() + b"\\n"
    with open(os.path.join(sys_dir, ".nni", "metrics"), "ab") as metrics:
        metrics.write(b"ME%06d" % len(data) + data)


to_stdout(0)
to_file(1)
while not os.path.exists(gate):
    time.sleep(0.05)
to_stdout(2)
to_file(3)
"""


def periodical(service: TrainingService, trial_id: str) -> list[int]:
    """The sequences of the trial's PERIODICAL metrics in the log, as often as they were reported."""
    return sorted(
        event.sequence
        for event in history(service, trial_id)
        if isinstance(event, TrialMetricReported) and event.metric_type == "PERIODICAL"
    )


def test_a_restarted_worker_reads_on_from_the_committed_offsets(
    pai, processes: Processes, client: redis.Redis, tmp_path: Path
) -> None:
    service = pai(RESUMABLE)
    fast = {"TRIALSTREAM_TRIAL_LEASE_S": "1"}
    victim = PlatformWorkers(processes, "openpai").start(env=fast)
    gate = tmp_path / "gate"
    trial_id = service.submit_trial_job(trial_form(0, gate=str(gate))).id
    wait_until(lambda: periodical(service, trial_id) == [0, 1], 60, what="metrics 0 and 1")
    offsets = client.hgetall(keys.read_offsets(service.experiment_id, trial_id, 1))
    assert int(offsets["stdout"]) > 0 and int(offsets["metrics"]) > 0  # committed with the metrics
    PlatformWorkers(processes, "openpai").start(env=fast)  # the survivor that notices, and takes the trial up
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    wait_until(lambda: any(isinstance(e, TrialReattached) for e in history(service, trial_id)), 30)
    gate.touch()
    trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.SUCCEEDED and trial.attempt == 1, trial.message
    assert periodical(service, trial_id) == [0, 1, 2, 3]  # each once: nothing lost, nothing read twice


def test_a_job_the_cluster_holds_is_waiting_then_runs(
    pai,
    pai_cluster: SimulatedOpenpai,  # noqa: F811
    processes: Processes,
) -> None:
    pai_cluster.hold.set()
    service = pai()
    PlatformWorkers(processes, "openpai").start()
    trial_id = service.submit_trial_job(trial_form(0)).id
    name = f"nni_exp_{service.experiment_id}_trial_{trial_id}"
    polled = f"/rest-server/api/v2/jobs/{PAI_USER}~{name}"
    wait_until(lambda: sum(path == polled for _, path, _ in pai_cluster.requests) >= 2, 30, what="two polls")
    assert pai_cluster.job(PAI_USER, name).state == "WAITING"
    assert service.get_trial_job(trial_id).status is TrialJobStatus.WAITING  # WAITING, not RUNNING
    assert not any(isinstance(e, TrialStarted) for e in history(service, trial_id))
    pai_cluster.release()
    assert wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60).status is TrialJobStatus.SUCCEEDED


def test_a_job_the_cluster_stops_is_sys_canceled_and_a_cancel_is_execution_type_stop(
    pai,
    pai_cluster: SimulatedOpenpai,  # noqa: F811
    processes: Processes,
) -> None:
    service = pai("import time\ntime.sleep(300)\n")
    PlatformWorkers(processes, "openpai").start(args=("--concurrency", "2"))
    stopped_by_cluster, cancelled = (service.submit_trial_job(trial_form(i)).id for i in range(2))
    for trial_id in (stopped_by_cluster, cancelled):
        wait_for_status(service, trial_id, "RUNNING", timeout=60)
    name = f"nni_exp_{service.experiment_id}_trial_{stopped_by_cluster}"
    pai_cluster.stop_by_cluster(PAI_USER, name)
    trial = wait_for_status(service, stopped_by_cluster, "SYS_CANCELED", "FAILED", "SUCCEEDED", timeout=60)
    assert trial.status is TrialJobStatus.SYS_CANCELED and "OpenPAI stopped job" in (trial.message or "")

    service.cancel_trial_job(cancelled)
    assert wait_for_status(service, cancelled, "USER_CANCELED", timeout=60).status is TrialJobStatus.USER_CANCELED
    other = f"nni_exp_{service.experiment_id}_trial_{cancelled}"
    stop = f"/rest-server/api/v2/jobs/{PAI_USER}~{other}/executionType"
    assert any(method == "PUT" and path == stop for method, path, _ in pai_cluster.requests)
    wait_until(lambda: pai_cluster.job(PAI_USER, other).state == "STOPPED", 30, what="the job to be STOPPED")


def test_the_user_s_openpai_config_is_the_job_with_nni_s_name_and_command(
    pai,
    pai_cluster: SimulatedOpenpai,  # noqa: F811
    processes: Processes,
) -> None:
    template = {
        "protocolVersion": 2,
        "name": "my-job",
        "type": "job",
        "prerequisites": [{"type": "dockerimage", "uri": "pytorch/pytorch", "name": "image"}],
        "taskRoles": {
            "main": {
                "instances": 1,
                "dockerImage": "image",
                "resourcePerInstance": {"cpu": 4, "memoryMB": 8192, "gpu": 0},
                "commands": ["echo from-the-template", f"{sys.executable} trial.py"],
            }
        },
    }
    service = pai("print('the trial ran')\n", openpaiConfig=template)
    PlatformWorkers(processes, "openpai").start()
    trial = wait_for_status(service, service.submit_trial_job(trial_form(0)).id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.SUCCEEDED, trial.message
    [job] = pai_cluster.jobs.values()
    assert job.name == f"nni_exp_{service.experiment_id}_trial_{trial.id}"
    protocol = yaml.safe_load(job.raw)
    assert protocol["taskRoles"]["main"]["resourcePerInstance"] == {"cpu": 4, "memoryMB": 8192, "gpu": 0}
    assert protocol["extras"]["storages"] == [{"name": "confignfs"}] and protocol["defaults"]["virtualCluster"]
    stdout = pai_cluster.storages["confignfs"].path / service.experiment_id / trial.id / "trial.stdout"
    assert stdout.read_text() == "from-the-template\nthe trial ran\n"


def test_a_job_openpai_refuses_fails_the_trial_with_openpai_s_words(
    pai,
    pai_cluster: SimulatedOpenpai,  # noqa: F811
    processes: Processes,
) -> None:
    template = {
        "protocolVersion": 2,
        "name": "x",
        "type": "job",
        "prerequisites": [{"type": "dockerimage", "uri": "img", "name": "image"}],
        "taskRoles": {"main": {"dockerImage": "image", "resourcePerInstance": {"cpu": 1}, "commands": ["true"]}},
    }
    service = pai(openpaiConfig=template)
    PlatformWorkers(processes, "openpai").start()
    trial = wait_for_status(service, service.submit_trial_job(trial_form(0)).id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.FAILED
    assert trial.message == (
        f"OpenPAI at {pai_cluster.url} refused the job: 400 InvalidProtocolError: "
        ".taskRoles['main'].resourcePerInstance should have required property 'memoryMB'"
    )
    assert pai_cluster.jobs == {}


def test_openpai_s_states_read_as_nni_reads_them() -> None:
    assert [trial_status(state) for state in ("WAITING", "RUNNING", "UNKNOWN")] == [None, None, None]
    assert trial_status("SUCCEEDED") is TrialJobStatus.SUCCEEDED
    assert trial_status("FAILED") is TrialJobStatus.FAILED
    assert trial_status("STOPPING") is trial_status("STOPPED") is TrialJobStatus.SYS_CANCELED


def test_a_retry_is_a_new_job_since_openpai_refuses_a_name_twice() -> None:
    class Named:
        experiment_id, trial_id = "exp1", "Ab3xY"

        def __init__(self, attempt: int) -> None:
            self.attempt = attempt

    assert job_name(Named(1)) == "nni_exp_exp1_trial_Ab3xY"  # type: ignore[arg-type]
    assert job_name(Named(2)) == "nni_exp_exp1_trial_Ab3xY_attempt_2"  # type: ignore[arg-type]


# --- 4. the pre-start check ----------------------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_good_section_passes_the_check(pai_cluster: SimulatedOpenpai, code_dir: Path) -> None:  # noqa: F811
    assert check(pai_section(pai_cluster), code_dir) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            {"host": "http://127.0.0.1:{closed}"},
            "host: cannot reach OpenPAI at http://127.0.0.1:{closed}: ",
        ),
        (
            {"token": "not-the-token"},
            "token: OpenPAI at {url} refused it (Your token is invalid.): copy a valid token from the web portal's "
            "profile page",
        ),
        (
            {"virtualCluster": "vc-x"},
            "virtualCluster: 'vc-x' is not a virtual cluster of OpenPAI at {url}; it has default, gpu",
        ),
        (
            {"storageConfigName": "nope"},
            "storageConfigName: OpenPAI at {url} has no storage 'nope' (Storage nope is not found.): give the name "
            "of a storage your user may mount",
        ),
        (
            {"localStorageMountPoint": "/no/such/mount"},
            "localStorageMountPoint: /no/such/mount is not a directory: mount the storage 'confignfs' there "
            "(the jobs see it at /mnt/confignfs)",
        ),
    ],
    ids=["unreachable", "bad-token", "unknown-virtual-cluster", "unknown-storage", "missing-mount-point"],
)
def test_each_problem_is_one_line_before_any_trial(
    pai_cluster: SimulatedOpenpai,  # noqa: F811
    tmp_path: Path,
    client: redis.Redis,
    rq_connection: redis.Redis,
    change: dict[str, Any],
    expected: str,
) -> None:
    closed = closed_port()
    change = {key: value.format(closed=closed) for key, value in change.items()}
    expected = expected.format(closed=closed, url=pai_cluster.url)
    spec = load_experiment_config(write_config(tmp_path, {**pai_section(pai_cluster), **change}))
    with pytest.raises(RunnerError) as raised:
        ExperimentRunner.create(spec, client, rq_connection, settings=Settings())
    header, *problems = str(raised.value).splitlines()
    assert header == HEADER
    [problem] = [line.strip() for line in problems]
    assert problem.startswith(expected), problem
    assert PAI_TOKEN not in problem and "not-the-token" not in problem
    assert client.dbsize() == 0  # no experiment, no job, no secret
    assert not any(method == "POST" for method, _, _ in pai_cluster.requests)


def test_two_problems_are_two_lines(pai_cluster: SimulatedOpenpai, code_dir: Path) -> None:  # noqa: F811
    section = pai_section(pai_cluster, token="wrong", localStorageMountPoint="/no/such/mount")
    problems = check(section, code_dir)
    assert [problem.split(":")[0] for problem in problems] == ["localStorageMountPoint", "token"]


def test_the_example_is_a_valid_config() -> None:
    spec = load_experiment_config(REPO / "examples" / "openpai" / "config.yml")
    assert isinstance(spec.platform, OpenpaiConfig)
    assert (spec.code_directory / "trial.py").is_file()
    assert json.dumps(spec.as_event_config).count(MASK) == 1
