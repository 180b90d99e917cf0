"""What a trial can see of its worker: NNI's variables and the user's environment, never trialstream's
settings or the Redis password (A12)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis

from core import keys
from schemas.trial import TrialJobStatus
from simulators.sshd import local_test_user
from simulators.waiting import wait_until
from tests.conftest import REPO, Processes, RedisServer, form, free_port, wait_for_status

PASSWORD = "s3cret-Redis-pass"
USER = "trialstream-isolation"

DUMP_TRIAL = """
import json, os
sys_dir = os.environ["NNI_SYS_DIR"]
json.dump(dict(os.environ), open(os.path.join(sys_dir, "environ.json"), "w"))
parent = open(f"/proc/{os.getppid()}/environ", "rb").read()  # the trial's keeper
open(os.path.join(sys_dir, "parent-environ"), "wb").write(parent)
"""


@pytest.fixture
def url_with_password(client: redis.Redis, redis_url: str) -> Iterator[str]:
    """The test Redis through a user that needs a password, as a shared deployment has."""
    client.acl_setuser(USER, enabled=True, passwords=[f"+{PASSWORD}"], keys=["*"], channels=["*"], commands=["+@all"])
    parts = urlsplit(redis_url)
    yield urlunsplit(parts._replace(netloc=f"{USER}:{PASSWORD}@{parts.hostname}:{parts.port}"))
    client.acl_deluser(USER)


def test_a_trial_gets_nni_and_user_variables_but_no_trialstream_setting_or_password(
    make_service, processes: Processes, code_dir: Path, url_with_password: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (code_dir / "dump.py").write_text(textwrap.dedent(DUMP_TRIAL))
    service = make_service(f"{sys.executable} dump.py")
    monkeypatch.setenv("MY_DATASET_DIR", "/data/cifar")  # the user's own variable, inherited by the worker
    processes.worker(env={"TRIALSTREAM_REDIS_URL": url_with_password, "TRIALSTREAM_KILL_GRACE_S": "2"})
    trial_id = service.submit_trial_job(form(0)).id

    trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED")

    assert trial.status is TrialJobStatus.SUCCEEDED, trial.message
    assert trial.worker is not None  # it ran on the worker that has the password
    environ = json.loads((Path(trial.working_directory) / "environ.json").read_text())
    assert [name for name in environ if name.startswith("TRIALSTREAM_")] == []
    assert not any(PASSWORD in f"{name}={value}" for name, value in environ.items())
    assert environ["MY_DATASET_DIR"] == "/data/cifar"
    assert environ["NNI_TRIAL_JOB_ID"] == trial_id and environ["NNI_EXP_ID"] == service.experiment_id
    assert environ["NNI_PLATFORM"] == "local" and environ["NNI_SYS_DIR"] == trial.working_directory
    parent = (Path(trial.working_directory) / "parent-environ").read_bytes()
    assert b"TRIALSTREAM_" not in parent and PASSWORD.encode() not in parent


def test_trialstreams_processes_hide_their_environment_from_other_processes_of_their_user(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    """A local trial runs as its worker's user, so it could read the environment (the Redis password, the manager's
    token) of any trialstream process of that user in /proc: the worker, a projector, a manager, `run`. Each makes
    itself non-dumpable first thing. Run as a user other than root here, which reads any process's /proc."""
    user = local_test_user()
    as_user = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups"]
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, user.pw_uid, user.pw_gid)
    tmp_path.chmod(0o755)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "TRIALSTREAM_REDIS_URL": own_redis.url,
        "TRIALSTREAM_MANAGER_TOKEN": "the-token-to-hide",
        "TRIALSTREAM_EXPERIMENTS_DIR": str(home),
    }
    commands = {
        "worker": [sys.executable, "-m", "manager.cli", "worker", "--platform", "local"],
        "projector": [sys.executable, "-m", "manager.cli", "projector"],
        "manager": [sys.executable, "-m", "manager.cli", "manager", "--port", str(free_port())],
    }
    started = {
        name: subprocess.Popen([*as_user, *command], cwd=REPO, env=env, stderr=subprocess.PIPE)
        for name, command in commands.items()
    }
    try:
        client = redis.Redis.from_url(own_redis.url)
        wait_until(lambda: client.exists(keys.PROJECTOR_HEARTBEAT), 30, what="the projector")
        wait_until(lambda: client.keys("rq:worker:*"), 30, what="the worker")
        for name, process in started.items():
            assert process.poll() is None, f"{name}: {process.stderr.read().decode() if process.stderr else None}"
            peek = subprocess.run([*as_user, "cat", f"/proc/{process.pid}/environ"], capture_output=True)
            assert peek.returncode != 0 and b"the-token-to-hide" not in peek.stdout, name
            assert "Permission denied" in peek.stderr.decode(), name
    finally:
        for process in started.values():
            process.kill()
            process.wait()
