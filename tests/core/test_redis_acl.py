"""Least privilege on a real redis-server loaded with `trialstream redis-acl`'s file: a whole experiment runs
with its worker as `worker`, its runner and projector as `manager`, read by `viewer`; what each user must not
do is refused with NOPERM. One server and one experiment for the module (a few seconds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from core import keys
from core.acl import password_hash
from core.assignments import experiment_secrets, secrets_by_platform
from core.variables import REDIS_URL_ENV
from manager.experiments import move_legacy_secrets
from tests.conftest import REPO, Processes, RedisServer
from tests.support.configs import write_local_config

pytestmark = pytest.mark.xdist_group("redis_acl")

TRIAL = """
import trialstream_sdk as nni
x = nni.get_next_parameter()["x"]
nni.report_intermediate_result(x)
nni.report_final_result(x)
"""


@dataclass(frozen=True)
class AclStack:
    server: RedisServer
    passwords: Path
    acl_text: str
    experiment_id: str
    run_output: dict[str, Any]

    def url(self, user: str) -> str:
        return f"redis://{user}:{(self.passwords / user).read_text().strip()}@127.0.0.1:{self.server.port}/0"

    def client(self, user: str) -> redis.Redis:
        return redis.Redis.from_url(self.url(user), decode_responses=True)

    def cli(self, user: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        environment = {**os.environ, REDIS_URL_ENV: self.url(user), **(env or {})}
        return subprocess.run(
            [sys.executable, "-m", "manager.cli", *args], env=environment, capture_output=True, text=True, timeout=60
        )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclStack]:
    """The ACL file as the command prints it, a redis-server loading it, and one experiment of 3 trials run
    through it with each process logged in as its own user."""
    root = tmp_path_factory.mktemp("acl")
    passwords = root / "passwords"
    printed = subprocess.run(
        [sys.executable, "-m", "manager.cli", "redis-acl", "--passwords", str(passwords), "--platform", "remote"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (root / "users.acl").write_text(printed)
    manager_login = ("manager", (passwords / "manager").read_text().strip())
    acl_options = ("--aclfile", str(root / "users.acl"), "--enable-debug-command", "yes")  # DEBUG: the ACL refuses it
    server = RedisServer(root / "redis", *acl_options, login=manager_login)
    server.start()
    (root / "logs").mkdir()
    processes = Processes(f"redis://manager:{manager_login[1]}@127.0.0.1:{server.port}/0", root / "logs")
    try:
        partial = AclStack(server, passwords, printed, "", {})
        processes.projector()
        processes.worker(env={REDIS_URL_ENV: partial.url("worker")}, args=("--concurrency", "2"))
        config = write_local_config(root, TRIAL, maxTrialNumber=3)
        run = partial.cli("manager", "run", str(config), "--json")
        assert run.returncode == 0, f"{run.stderr}\n{processes.logs()}"
        output = json.loads(run.stdout)
        yield AclStack(server, passwords, printed, output["experimentId"], output)
    finally:
        processes.stop()
        server.stop()


def test_the_file_holds_hashed_passwords_kept_in_files_only_their_owner_reads(stack: AclStack) -> None:
    users = {"manager", "worker", "worker-remote", "viewer"}
    assert {path.name for path in stack.passwords.iterdir()} == users
    for user in users:
        password = (stack.passwords / user).read_text().strip()
        assert (stack.passwords / user).stat().st_mode & 0o777 == 0o600
        assert password not in stack.acl_text and password_hash(password) in stack.acl_text
    assert "user default off" in stack.acl_text
    with pytest.raises(redis.AuthenticationError):  # no login, no access
        redis.Redis(port=stack.server.port, retry=Retry(NoBackoff(), 0)).ping()


def test_a_whole_experiment_runs_with_the_restricted_users(stack: AclStack) -> None:
    trials = stack.run_output["trials"]
    assert [trial["status"] for trial in trials] == ["SUCCEEDED"] * 3
    viewed = stack.cli("viewer", "trials", "list", "-e", stack.experiment_id, "--json")
    assert viewed.returncode == 0, viewed.stderr
    assert sorted(trial["id"] for trial in json.loads(viewed.stdout)) == sorted(trial["id"] for trial in trials)
    assert stack.cli("viewer", "events", stack.experiment_id).returncode == 0


def _events(stack: AclStack) -> str:
    return keys.events(stack.experiment_id)


WORKER_REFUSED: dict[str, tuple[str, ...]] = {
    "DEL": ("DEL", "{events}"),
    "UNLINK": ("UNLINK", "{events}"),
    "XDEL": ("XDEL", "{events}", "0-1"),
    "XTRIM": ("XTRIM", "{events}", "MAXLEN", "0"),
    "RENAME": ("RENAME", "{events}", "rq:job:stolen"),
    "SET over the log": ("SET", "{events}", "x"),
    "EXPIRE": ("EXPIRE", "{events}", "1"),
    "DEL in a script": ("EVAL", "return redis.call('DEL', KEYS[1])", "1", "{events}"),
    "FLUSHALL": ("FLUSHALL",),
    "FLUSHDB": ("FLUSHDB",),
    "CONFIG": ("CONFIG", "GET", "*"),
    "ACL": ("ACL", "LIST"),
    "DEBUG": ("DEBUG", "SLEEP", "0"),
    "SHUTDOWN": ("SHUTDOWN", "NOSAVE"),
    "MODULE": ("MODULE", "LIST"),
    "SCRIPT FLUSH": ("SCRIPT", "FLUSH"),
    "another platform's secrets": ("HGETALL", "{remote_secrets}"),
}


@pytest.mark.parametrize("command", WORKER_REFUSED.values(), ids=WORKER_REFUSED.keys())
def test_a_worker_cannot_erase_the_log_administer_redis_or_read_another_platforms_secrets(
    stack: AclStack, command: tuple[str, ...]
) -> None:
    names = {"events": _events(stack), "remote_secrets": keys.secrets(stack.experiment_id, "remote")}
    worker = stack.client("worker")
    before = worker.xlen(_events(stack))
    with pytest.raises(redis.ResponseError, match=r"NOPERM|no permissions|can't access"):  # the last: in a script
        worker.execute_command(*(part.format(**names) for part in command))
    assert worker.xlen(_events(stack)) == before > 0


def test_a_worker_reads_its_own_platforms_secrets_and_the_remote_one_its_own(stack: AclStack) -> None:
    assert stack.client("worker").hgetall(keys.secrets(stack.experiment_id, "local")) == {}
    assert stack.client("worker-remote").hgetall(keys.secrets(stack.experiment_id, "remote")) == {}
    with pytest.raises(redis.exceptions.NoPermissionError):
        stack.client("worker-remote").hgetall(keys.secrets(stack.experiment_id, "local"))


VIEWER_REFUSED: dict[str, tuple[str, ...]] = {
    "XADD": ("XADD", "{events}", "*", "type", "forged"),
    "HSET a view": ("HSET", "{trials}", "x", "y"),
    "DEL": ("DEL", "{events}"),
    "SET": ("SET", "ts:anything", "x"),
    "a script": ("EVAL", "return 1", "1", "{events}"),
    "secrets": ("HGETALL", "{secrets}"),
    "FLUSHALL": ("FLUSHALL",),
}


@pytest.mark.parametrize("command", VIEWER_REFUSED.values(), ids=VIEWER_REFUSED.keys())
def test_a_viewer_only_reads(stack: AclStack, command: tuple[str, ...]) -> None:
    names = {
        "events": _events(stack),
        "trials": keys.ViewKeys(stack.experiment_id).trials,
        "secrets": keys.secrets(stack.experiment_id, "local"),
    }
    with pytest.raises(redis.exceptions.NoPermissionError):
        stack.client("viewer").execute_command(*(part.format(**names) for part in command))


def test_secrets_are_kept_under_the_platform_of_their_section() -> None:
    hybrid = [{"platform": "local"}, {"platform": "remote"}]
    grouped = secrets_by_platform(hybrid, {"1.machineList.0.password": "p"})
    assert grouped == {"remote": {"1.machineList.0.password": "p"}}
    assert secrets_by_platform({"platform": "openpai"}, {"token": "t"}) == {"openpai": {"token": "t"}}


def test_an_experiment_created_before_secrets_were_kept_per_platform_has_them_moved_at_resume(
    client: redis.Redis,
) -> None:
    hybrid = [{"platform": "local"}, {"platform": "remote"}, {"platform": "openpai"}]
    client.hset(keys.legacy_secrets("old"), mapping={"1.machineList.0.password": "p", "2.token": "t"})
    move_legacy_secrets(client, "old", hybrid)
    assert experiment_secrets(client, "old", ["remote"]) == {"1.machineList.0.password": "p"}
    assert experiment_secrets(client, "old", ["openpai"]) == {"2.token": "t"}
    assert not client.exists(keys.legacy_secrets("old"))
    move_legacy_secrets(client, "old", hybrid)  # nothing left to move: the moved secrets stay
    assert experiment_secrets(client, "old", ["remote", "openpai"]) == {"1.machineList.0.password": "p", "2.token": "t"}


def test_the_manager_archives_reads_and_restores_and_a_viewer_reads_what_it_brought_back(stack: AclStack) -> None:
    """A read of an archived experiment writes a copy into Redis for a while (manager.archive.moves.thaw): the
    manager's to write (RESTORE, which `@dangerous` takes back), the viewer's to read; a viewer with no copy to
    read is told what to do."""
    archive = {"TRIALSTREAM_ARCHIVE_LOCATION": str(stack.passwords.parent / "archive")}
    archived = stack.cli("manager", "experiments", "archive", stack.experiment_id, env=archive)
    assert archived.returncode == 0, archived.stderr
    ids = sorted(trial["id"] for trial in stack.run_output["trials"])
    manager = stack.client("manager")
    try:
        refused = stack.cli("viewer", "trials", "list", "-e", stack.experiment_id, "--json")
        assert refused.returncode == 1
        assert f"trialstream experiments restore {stack.experiment_id}" in refused.stderr, refused.stderr
        assert not manager.exists(_events(stack))  # nothing half brought back
        thawed = stack.cli("manager", "trials", "list", "-e", stack.experiment_id, "--json")
        assert thawed.returncode == 0, thawed.stderr
        for _ in range(2):  # then with the copy past half its time, which only a writer may extend
            viewed = stack.cli("viewer", "trials", "list", "-e", stack.experiment_id, "--json")
            assert viewed.returncode == 0, viewed.stderr
            assert sorted(trial["id"] for trial in json.loads(viewed.stdout)) == ids
            assert stack.cli("viewer", "events", stack.experiment_id).returncode == 0
            manager.pexpire(keys.thawed(stack.experiment_id), 60_000)
    finally:
        restored = stack.cli("manager", "experiments", "restore", stack.experiment_id, env=archive)
    assert restored.returncode == 0, restored.stderr
    assert manager.exists(_events(stack)) and not manager.exists(keys.thawed(stack.experiment_id))


def test_the_manager_deletes_an_experiment(stack: AclStack) -> None:
    """Last: the other tests read the experiment."""
    deleted = stack.cli("manager", "experiments", "delete", stack.experiment_id, "--yes")
    assert deleted.returncode == 0, deleted.stderr
    assert not stack.client("manager").exists(_events(stack))
