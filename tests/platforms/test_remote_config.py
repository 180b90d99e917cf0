"""The remote platform's config, its pre-start check and its secrets, on real sshd hosts (simulators/sshd.py).

1. `trainingService: {platform: remote, machineList: [...]}` as NNI writes it loads; each mistake is
   reported as `path: key.path: problem`, naming what to change.
2. `ExperimentRunner.create` checks every machine before anything exists: a failure is a RunnerError
   with one line per bad machine, naming it (user@host:port) and the cause, and Redis stays empty.
3. An SSH password reaches the workers (the trials run) but nothing else: not the log, the views,
   the jobs, the processes' logs, the CLI's answers or the trials' files; the config shows it masked.
4. The secrets go with the experiment when it is deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import redis
from rq import Queue

from core import keys
from core.queueing import queue_name
from core.settings import Settings
from core.variables import REDIS_URL_ENV
from manager.config import ExperimentSpec, load_experiment_config
from manager.experiments import delete_experiment
from manager.runner import ExperimentRunner, RunnerError
from manager.training_service import TrainingService
from schemas.trial import TrialJobStatus
from simulators.sshd import MuteHost, SshHost, SshUser, write_known_hosts
from simulators.waiting import wait_until
from tests.conftest import REPO, Processes
from tests.support import configs, web
from tests.support.configs import rejection
from tests.support.remote_setup import RemoteWorkers

pytest.importorskip("paramiko")

MASK = "**********"
TIMEOUT_S = 2.0  # ssh_timeout_s of every check here
SPACE = {"x": {"_type": "choice", "_value": [1, 2, 3]}}
HEADER = "trainingService: cannot run trials there:"


@pytest.fixture
def tmp_path(shared_tmp_path: Path) -> Path:
    """The hosts' user reaches it too: a pythonPath directory here is one the host can look into."""
    return shared_tmp_path


# --- helpers ----------------------------------------------------------------------------------------------------


def key_machine(host: SshHost, user: SshUser, **extra: Any) -> dict[str, Any]:
    return {"host": host.address, "port": host.port, "user": user.name, "sshKeyFile": str(user.private_key), **extra}


def password_machine(host: SshHost, user: SshUser, password: str, **extra: Any) -> dict[str, Any]:
    return {"host": host.address, "port": host.port, "user": user.name, "password": password, **extra}


def label(machine: dict[str, Any]) -> str:
    return f"{machine['user']}@{machine['host']}:{machine.get('port', 22)}"


def write_config(directory: Path, machines: list[dict[str, Any]], **top: Any) -> Path:
    section = {"platform": "remote", "machineList": machines}
    return configs.write_config(directory, section, SPACE, name="remote-config", **top)


def settings_for(tmp_path: Path, known_hosts: Path) -> Settings:
    remote = {"TRIALSTREAM_KNOWN_HOSTS": str(known_hosts), "TRIALSTREAM_SSH_TIMEOUT_S": str(TIMEOUT_S)}
    return Settings.from_environment(remote, experiments_dir=tmp_path / "experiments")


def refused_machines(
    tmp_path: Path, machines: list[dict[str, Any]], client: redis.Redis, rq_connection: redis.Redis, known_hosts: Path
) -> list[str]:
    """The pre-start check's problems for an experiment on `machines`, trusting `known_hosts`."""
    spec = load_experiment_config(write_config(tmp_path, machines))
    return refused(spec, client, rq_connection, settings_for(tmp_path, known_hosts))


def refused(spec: ExperimentSpec, client: redis.Redis, rq_connection: redis.Redis, settings: Settings) -> list[str]:
    """The problem lines of the RunnerError `create` raises, after checking that nothing was created."""
    with pytest.raises(RunnerError) as raised:
        ExperimentRunner.create(spec, client, rq_connection, settings=settings)
    assert client.zcard(keys.EXPERIMENTS) == 0
    assert Queue(queue_name("remote"), connection=rq_connection).count == 0
    assert client.dbsize() == 0, sorted(client.keys("*"))  # no log, no secrets, no job, no claim
    header, *problems = str(raised.value).splitlines()
    assert header == HEADER
    return [line.strip() for line in problems]


def one_problem(problems: list[str], machine: dict[str, Any]) -> str:
    [problem] = problems
    assert problem.startswith(f"{label(machine)}: "), problem
    return problem.removeprefix(f"{label(machine)}: ")


def unused_port(host: SshHost) -> int:
    """A port nothing listens on at the host's address (netns hosts listen on 22 only)."""
    if host.netns is not None:
        return 2222
    with socket.socket() as probe:
        probe.bind((host.address, 0))
        return int(probe.getsockname()[1])


def close(runner: ExperimentRunner) -> None:
    """A created runner that will not run: its tuner's thread stops (run() does this on its way out)."""
    if runner._tuner is not None:
        runner._tuner.close()


@pytest.fixture
def known_hosts(tmp_path: Path, ssh_hosts: list[SshHost]) -> Path:
    return write_known_hosts(tmp_path / "known_hosts", ssh_hosts)


# --- 1. config validation ---------------------------------------------------------------------------------------


def test_nni_s_remote_keys_load(tmp_path: Path) -> None:
    machines = [
        {
            "host": "10.1.2.3",
            "port": 2222,
            "user": "alice",
            "password": "pa55word",
            "useActiveGpu": False,
            "maxTrialNumberPerGpu": 2,
            "gpuIndices": "0,1",
            "pythonPath": "/opt/conda/bin",
        },
        {
            "host": "gpu-box",
            "user": "bob",
            "ssh_key_file": "~/.ssh/id_rsa",  # NNI's keys are case- and underscore-insensitive
            "SSHPassphrase": "s3cret-phrase",
            "useActiveGpu": True,
            "gpuIndices": 3,
        },
    ]
    section = {"platform": "remote", "machineList": machines, "reuseMode": True}
    spec = load_experiment_config(write_config(tmp_path, machines, trialGpuNumber=1, trainingService=section))
    platform = spec.platform
    first, second = platform.machine_list  # type: ignore[attr-defined]
    assert (first.host, first.port, first.user, first.label) == ("10.1.2.3", 2222, "alice", "alice@10.1.2.3:2222")
    assert first.password.get_secret_value() == "pa55word" and first.ssh_key_file is None
    assert (first.use_active_gpu, first.max_trial_number_per_gpu, first.gpu_indices) == (False, 2, [0, 1])
    assert first.python_path == "/opt/conda/bin" and first.check_host_key is True
    assert (second.port, second.ssh_key_file, second.gpu_indices) == (22, "~/.ssh/id_rsa", [3])
    assert second.ssh_passphrase.get_secret_value() == "s3cret-phrase"
    assert platform.reuse_mode is True  # type: ignore[attr-defined]
    stored = json.dumps(spec.as_event_config)
    assert "pa55word" not in stored and "s3cret-phrase" not in stored  # the config as the log holds it
    assert spec.as_event_config["trainingService"]["machineList"][0]["password"] == MASK


BAD_MACHINES = [
    pytest.param(
        {"password": "pw", "sshKeyFile": "~/.ssh/id_rsa"},
        "trainingService.machineList.0: give either 'password' or 'sshKeyFile', not both",
        id="password-and-key",
    ),
    pytest.param(
        {},
        "trainingService.machineList.0: give 'password' or 'sshKeyFile' (a private key; add 'sshPassphrase' "
        "if it has one)",
        id="neither",
    ),
    pytest.param(
        {"password": "pw", "sshPassphrase": "phrase"},
        "trainingService.machineList.0: sshPassphrase: only used with 'sshKeyFile'",
        id="passphrase-without-key",
    ),
    pytest.param(
        {"sshKeyPath": "~/.ssh/id_rsa"},
        "trainingService.machineList.0.sshKeyPath: unknown key; check its spelling against the NNI v2 config "
        "reference (did you mean 'sshKeyFile'?)",
        id="misspelt-key",
    ),
]


@pytest.mark.parametrize(("extra", "expected"), BAD_MACHINES)
def test_a_machine_s_mistake_names_its_key_path_and_the_fix(
    tmp_path: Path, extra: dict[str, Any], expected: str
) -> None:
    machine = {"host": "10.1.2.3", "user": "alice", **extra}
    assert rejection(write_config(tmp_path, [machine])) == [expected]


def test_an_empty_machine_list_is_refused(tmp_path: Path) -> None:
    [problem] = rejection(write_config(tmp_path, []))
    assert problem.startswith("trainingService.machineList: ")
    assert "at least 1 item" in problem


def test_gpu_trials_need_use_active_gpu_on_every_machine(tmp_path: Path) -> None:
    machines: list[dict[str, Any]] = [
        {"host": "a", "user": "u", "password": "pw", "useActiveGpu": True},
        {"host": "b", "user": "u", "password": "pw"},
    ]
    [problem] = rejection(write_config(tmp_path, machines, trialGpuNumber=1))
    assert problem.startswith("trainingService.machineList.1.useActiveGpu: required when trialGpuNumber > 0")
    assert "set true" in problem and "false" in problem
    assert load_experiment_config(write_config(tmp_path, machines, trialGpuNumber=0))  # no GPUs: not needed


def test_the_same_machine_twice_is_refused(tmp_path: Path) -> None:
    machines: list[dict[str, Any]] = [
        {"host": "a", "user": "u", "password": "pw"},
        {"host": "a", "port": 22, "user": "u", "sshKeyFile": "~/.ssh/id_rsa"},
    ]
    assert rejection(write_config(tmp_path, machines)) == ["trainingService.machineList: u@a:22 is listed twice"]
    machines[1]["port"] = 2222  # another sshd on the same address is another machine
    assert load_experiment_config(write_config(tmp_path, machines))


# --- 2. the pre-start check -------------------------------------------------------------------------------------


def test_a_good_config_passes_the_check_and_creates_the_experiment(
    tmp_path: Path, ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, client: redis.Redis, rq_connection
) -> None:
    machines = [key_machine(host, ssh_user) for host in ssh_hosts]
    spec = load_experiment_config(write_config(tmp_path, machines))
    runner = ExperimentRunner.create(spec, client, rq_connection, settings=settings_for(tmp_path, known_hosts))
    try:
        assert client.zrange(keys.EXPERIMENTS, 0, -1) == [runner.experiment_id]
        assert not client.exists(keys.secrets(runner.experiment_id, "remote"))  # key files are paths, not secrets
    finally:
        close(runner)


def test_a_wrong_password(
    tmp_path: Path, ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, client: redis.Redis, rq_connection
) -> None:
    wrong = ssh_user.password + "-wrong"
    machine = password_machine(ssh_hosts[0], ssh_user, wrong)
    problems = refused_machines(tmp_path, [machine], client, rq_connection, known_hosts)
    assert one_problem(problems, machine) == "authentication failed (wrong password, or the key is not authorized)"
    assert wrong not in "\n".join(problems)


def test_a_key_the_host_does_not_authorize(
    tmp_path: Path, ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, client: redis.Redis, rq_connection
) -> None:
    stranger = tmp_path / "stranger_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    machine = {**key_machine(ssh_hosts[1], ssh_user), "sshKeyFile": str(stranger)}
    problems = refused_machines(tmp_path, [machine], client, rq_connection, known_hosts)
    assert one_problem(problems, machine) == "authentication failed (wrong password, or the key is not authorized)"


def test_an_unknown_host_key(
    tmp_path: Path, ssh_hosts: list[SshHost], ssh_user: SshUser, client: redis.Redis, rq_connection
) -> None:
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    machine = key_machine(ssh_hosts[0], ssh_user)
    problems = refused(
        load_experiment_config(write_config(tmp_path, [machine])), client, rq_connection, settings_for(tmp_path, empty)
    )
    cause = one_problem(problems, machine)
    assert cause.startswith(f"host key is not in {empty}")
    assert "ssh-keyscan" in cause and "checkHostKey: false" in cause


def test_check_host_key_false_passes_the_check_and_its_trials_run(
    tmp_path: Path,
    ssh_hosts: list[SshHost],
    ssh_user: SshUser,
    processes: Processes,
    client: redis.Redis,
    rq_connection,
) -> None:
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    machine = key_machine(ssh_hosts[0], ssh_user, checkHostKey=False)
    spec = load_experiment_config(write_config(tmp_path, [machine]))
    processes.projector()
    processes.worker("remote", env={"TRIALSTREAM_KNOWN_HOSTS": str(empty)})
    result = ExperimentRunner.create(spec, client, rq_connection, settings=settings_for(tmp_path, empty)).run()
    assert [trial.status for trial in result.trials] == [TrialJobStatus.SUCCEEDED]
    assert empty.read_text() == ""  # the key was trusted, not saved


def test_a_changed_host_key(
    tmp_path: Path, ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, client: redis.Redis, rq_connection
) -> None:
    host = ssh_hosts[0]  # known_hosts trusts its old key
    host.new_host_key()
    host.stop()
    host.start()
    machine = key_machine(host, ssh_user)
    problems = refused_machines(tmp_path, [machine], client, rq_connection, known_hosts)
    assert one_problem(problems, machine) == (
        f"host key does not match the one in {known_hosts} (the host was reinstalled, or it is an impostor)"
    )


def test_a_refused_connection(
    tmp_path: Path, ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, client: redis.Redis, rq_connection
) -> None:
    machine = key_machine(ssh_hosts[0], ssh_user, port=unused_port(ssh_hosts[0]))
    problems = refused_machines(tmp_path, [machine], client, rq_connection, known_hosts)
    assert one_problem(problems, machine) == "connection refused"


def test_a_host_that_never_speaks_ssh_fails_within_the_timeout(
    tmp_path: Path, mute_host: MuteHost, ssh_user: SshUser, known_hosts: Path, client: redis.Redis, rq_connection
) -> None:
    machine = {"host": mute_host.address, "port": mute_host.port, "user": ssh_user.name, "password": "x"}
    spec = load_experiment_config(write_config(tmp_path, [machine]))
    started = time.monotonic()
    problems = refused(spec, client, rq_connection, settings_for(tmp_path, known_hosts))
    elapsed = time.monotonic() - started
    assert one_problem(problems, machine) == "it accepts connections but does not speak SSH (no banner within 2s)"
    assert TIMEOUT_S <= elapsed < 2 * TIMEOUT_S + 2, elapsed


def test_a_host_that_is_down(
    tmp_path: Path, ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, client: redis.Redis, rq_connection
) -> None:
    host = ssh_hosts[1]
    host.stop()
    machine = key_machine(host, ssh_user)
    spec = load_experiment_config(write_config(tmp_path, [machine]))
    started = time.monotonic()
    problems = refused(spec, client, rq_connection, settings_for(tmp_path, known_hosts))
    assert time.monotonic() - started < 2 * TIMEOUT_S + 2
    # netns: the link is down and an `unreachable` route covers it; loopback: nothing listens any more
    expected = "host unreachable" if host.netns is not None else "connection refused"
    assert one_problem(problems, machine) == expected


def test_a_python_path_without_python(
    tmp_path: Path, ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, client: redis.Redis, rq_connection
) -> None:
    no_python = tmp_path / "no-python-here"
    no_python.mkdir(mode=0o755)
    (no_python / "pip").write_text("#!/bin/sh\n")  # something is there, just no interpreter
    machine = key_machine(ssh_hosts[0], ssh_user, pythonPath=str(no_python))
    problems = refused_machines(tmp_path, [machine], client, rq_connection, known_hosts)
    assert one_problem(problems, machine) == f"pythonPath {no_python} holds no python3 or python"


def test_a_python_path_with_python_passes(
    tmp_path: Path, ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, client: redis.Redis, rq_connection
) -> None:
    machine = key_machine(ssh_hosts[0], ssh_user, pythonPath=os.path.dirname(sys.executable))
    spec = load_experiment_config(write_config(tmp_path, [machine]))
    close(ExperimentRunner.create(spec, client, rq_connection, settings=settings_for(tmp_path, known_hosts)))
    assert client.zcard(keys.EXPERIMENTS) == 1


def test_a_code_directory_with_too_many_files(
    tmp_path: Path, ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, client: redis.Redis, rq_connection
) -> None:
    path = write_config(tmp_path, [key_machine(ssh_hosts[0], ssh_user)])
    shards = tmp_path / "code" / "shards"
    shards.mkdir()
    for n in range(2001):
        (shards / f"{n}.txt").write_text("x")
    problems = refused(load_experiment_config(path), client, rq_connection, settings_for(tmp_path, known_hosts))
    assert problems[0].startswith(f"trialCodeDirectory: code directory {tmp_path / 'code'} has 2001 files")
    assert "NNI allows at most 2000 files" in problems[0]
    assert any(line.startswith("shards/ (2001 files") for line in problems)  # what to put in .nniignore
    assert not any("@" in line for line in problems)  # the machine itself is fine


def test_two_bad_machines_are_two_lines(
    tmp_path: Path, ssh_hosts: list[SshHost], ssh_user: SshUser, known_hosts: Path, client: redis.Redis, rq_connection
) -> None:
    wrong = password_machine(ssh_hosts[0], ssh_user, ssh_user.password + "-wrong")
    closed = key_machine(ssh_hosts[1], ssh_user, port=unused_port(ssh_hosts[1]))
    problems = refused_machines(tmp_path, [wrong, closed], client, rq_connection, known_hosts)
    assert problems == [
        f"{label(wrong)}: authentication failed (wrong password, or the key is not authorized)",
        f"{label(closed)}: connection refused",
    ]


# --- 3. and 4. secrets ------------------------------------------------------------------------------------------


def redis_values(raw: Any) -> dict[bytes, list[bytes]]:
    """Every key of the database, with every byte string it holds (and each one's zlib-inflated form:
    RQ compresses its jobs' data)."""
    found: dict[bytes, list[bytes]] = {}
    for key in raw.scan_iter(count=1000):
        kind = raw.type(key)
        values: list[bytes] = [key]
        if kind == b"none":  # expired since the scan saw it (RQ's execution keys have a TTL)
            continue
        if kind == b"string":
            values.append(raw.get(key) or b"")
        elif kind == b"hash":
            values += [part for pair in raw.hgetall(key).items() for part in pair]
        elif kind == b"list":
            values += raw.lrange(key, 0, -1)
        elif kind == b"set":
            values += list(raw.smembers(key))
        elif kind == b"zset":
            values += [member for member, _ in raw.zrange(key, 0, -1, withscores=True)]
        elif kind == b"stream":
            for entry_id, fields in raw.xrange(key):
                values += [entry_id, *(part for pair in fields.items() for part in pair)]
        else:
            raise AssertionError(f"{key!r} is a {kind!r}: teach this scan to read it")
        for value in list(values):
            with contextlib.suppress(zlib.error):
                values.append(zlib.decompress(value))
        found[key] = values
    return found


def cli(processes: Processes, known_hosts: Path, *args: str) -> str:
    """`trialstream ARGS` against the test's Redis (`trials logs` reads the trial's files over SSH)."""
    result = subprocess.run(
        [sys.executable, "-m", "manager.cli", *args],
        env={**os.environ, REDIS_URL_ENV: processes.redis_url, "TRIALSTREAM_KNOWN_HOSTS": str(known_hosts)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"{args}: {result.stderr}"
    return result.stdout + result.stderr


def files_under(root: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in root.rglob("*") if path.is_file() and not path.is_symlink()}


def test_a_password_reaches_the_trials_and_nothing_else_and_goes_with_the_experiment(
    tmp_path: Path,
    ssh_hosts: list[SshHost],
    ssh_user: SshUser,
    processes: Processes,
    remote_workers: RemoteWorkers,
    client: redis.Redis,
    rq_connection: redis.Redis,
) -> None:
    password = ssh_user.password
    machines = [password_machine(host, ssh_user, password) for host in ssh_hosts]
    # the trial prints its whole environment: the password must not be in it either
    command = f'{sys.executable} -c "import os; print(1); print(dict(os.environ))"'
    path = write_config(
        tmp_path,
        machines,
        trialCommand=command,
        maxTrialNumber=2,
        trialConcurrency=2,
        maxExperimentDuration="90s",
        trainingService={"platform": "remote", "machineList": machines, "keepTrialFiles": True},
    )
    processes.projector()
    remote_workers.start(args=("--concurrency", "4"))
    spec = load_experiment_config(path)
    runner = ExperimentRunner.create(
        spec, client, rq_connection, settings=settings_for(tmp_path, remote_workers.known_hosts)
    )
    experiment_id = runner.experiment_id
    result = runner.run()

    # the workers logged in with the real password: every trial ran and succeeded
    assert len(result.trials) == 2
    assert all(trial.status is TrialJobStatus.SUCCEEDED for trial in result.trials), [
        (trial.id, trial.status, trial.message) for trial in result.trials
    ]
    service = TrainingService(client, rq_connection, experiment_id)
    wait_until(lambda: service.experiment_view().status == "DONE", 30, what="the projector to show the end")

    # Redis: only the secrets hash holds it
    secret_key = keys.secrets(experiment_id, "remote").encode()
    holding = {
        key for key, values in redis_values(rq_connection).items() if any(password.encode() in v for v in values)
    }
    assert holding == {secret_key}
    assert client.hgetall(keys.secrets(experiment_id, "remote")) == {
        "machineList.0.password": password,
        "machineList.1.password": password,
    }

    # the config as stored and shown: masked
    stored = service.experiment_view().config["trainingService"]["machineList"]
    assert [machine["password"] for machine in stored] == [MASK, MASK]

    # the processes' logs, the CLI's answers
    logs = processes.logs()
    assert logs.strip() and password not in logs
    trial_ids = [trial.id for trial in result.trials]
    outputs = [
        cli(processes, remote_workers.known_hosts, "experiments", "list"),
        cli(processes, remote_workers.known_hosts, "experiments", "list", "--json"),
        cli(processes, remote_workers.known_hosts, "trials", "list", "-e", experiment_id, "--json"),
        cli(processes, remote_workers.known_hosts, "events", experiment_id, "--json"),
        cli(processes, remote_workers.known_hosts, "export", experiment_id),
    ]
    for trial_id in trial_ids:
        outputs.append(cli(processes, remote_workers.known_hosts, "trials", "show", trial_id, "-e", experiment_id))
        outputs.append(
            cli(
                processes,
                remote_workers.known_hosts,
                "trials",
                "show",
                trial_id,
                "-e",
                experiment_id,
                "--json",
                "--history",
            )
        )
        outputs.append(cli(processes, remote_workers.known_hosts, "trials", "logs", trial_id, "-e", experiment_id))
    for output in outputs:
        assert password not in output
    assert MASK in outputs[3]  # the ExperimentCreated event, shown with its config masked
    assert all(trial_id in outputs[2] for trial_id in trial_ids)
    assert outputs[-1].startswith("1\n") and "NNI_EXP_ID" in outputs[-1]  # `trials logs`: the trial's stdout

    # the files of the experiment here and of the trials on the hosts (kept: keepTrialFiles)
    here = files_under(tmp_path / "experiments")
    there = {p: data for host in ssh_hosts for p, data in files_under(host.home / ".trialstream").items()}
    assert any(p.name == "stdout" and b"NNI_PLATFORM" in data for p, data in there.items())  # the env printed
    leaked = [str(p) for p, data in {**here, **there}.items() if password.encode() in data]
    assert leaked == []

    # 4. deleting the experiment deletes its secrets
    assert delete_experiment(client, experiment_id) > 0
    assert not client.exists(keys.secrets(experiment_id, "remote"))
    assert client.zcard(keys.EXPERIMENTS) == 0


def test_a_password_in_a_config_the_manager_accepted_is_never_read_back_over_http(
    tmp_path: Path, ssh_hosts: list[SshHost], ssh_user: SshUser, processes: Processes, remote_workers: RemoteWorkers
) -> None:
    """The config goes to a real manager over HTTP, passes its SSH check with the password and runs on the
    hosts; no answer of trialstream's API nor of NNI's (config, profile, trials, events, export) holds it."""
    password = ssh_user.password
    machines = [password_machine(host, ssh_user, password) for host in ssh_hosts]
    remote_workers.start(args=("--concurrency", "2"))
    url = processes.manager(env=remote_workers.env)  # the manager checks the hosts too, trusting their keys
    (tmp_path / "code").mkdir()
    config = {
        "trialCommand": f'{sys.executable} -c "print(1)"',
        "trialCodeDirectory": str(tmp_path / "code"),
        "trialConcurrency": 2,
        "maxTrialNumber": 2,
        "searchSpace": SPACE,
        "tuner": {"name": "Random"},
        "trainingService": {"platform": "remote", "machineList": machines},
    }
    created = web.post(f"{url}/api/v1/experiments", json={"config": config}, timeout=60)
    assert created.status_code == 201, created.text
    experiment_id = created.json()["id"]
    done = wait_until(
        lambda: (state := web.get(f"{url}/api/v1/experiments/{experiment_id}").json())["status"] == "DONE" and state,
        90,
        what="the experiment on the hosts to finish",
    )
    trials = web.get(f"{url}/api/v1/experiments/{experiment_id}/trials").json()["items"]
    outcomes = [(trial["status"], trial.get("message")) for trial in trials]
    assert done["trialCounts"] == {"SUCCEEDED": 2}, outcomes  # the workers logged in with the password

    answers = [created]
    for path in (
        "/api/v1/experiments",
        f"/api/v1/experiments/{experiment_id}",
        f"/api/v1/experiments/{experiment_id}/trials",
        f"/api/v1/experiments/{experiment_id}/events?limit=1000",
        *(f"/api/v1/experiments/{experiment_id}/trials/{trial['id']}" for trial in trials),
        *(f"/nni/{experiment_id}/api/v1/nni{path}" for path in ("/experiment", "/trial-jobs", "/export-data")),
        "/api/v1/nni/experiments-info",
    ):
        answer = web.get(f"{url}{path}", timeout=30)
        assert answer.status_code == 200, (path, answer.text)
        answers.append(answer)
    for answer in answers:
        assert password not in answer.text, answer.request.url
    assert [machine["password"] for machine in done["config"]["trainingService"]["machineList"]] == [MASK, MASK]
    profile = answers[-4].json()["params"]["trainingService"]
    profile = profile[0] if isinstance(profile, list) else profile
    assert [machine["password"] for machine in profile["machineList"]] == [MASK, MASK]
    assert password not in processes.logs()
