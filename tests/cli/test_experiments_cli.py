"""`trialstream experiments list|delete` (A15): on a shared Redis and on embedded experiments."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import redis

from core import keys
from core.event_store import EventStore
from manager.stack import CREATED
from manager.views import ViewStore
from tests.cli.test_cli import SDK_TRIAL, trialstream
from tests.conftest import Processes, free_port, wait_until
from tests.support.configs import write_local_config
from workers.platforms.shared.gpu import gpu_holders


def keys_of(client: redis.Redis, experiment_id: str) -> set[str]:
    return set(client.scan_iter(match=f"*{experiment_id}*", count=1000))


def members_of(client: redis.Redis, experiment_id: str) -> list[str]:
    """Entries of the experiment in keys shared by all (leases, parking, GPU holders, RQ's queues and registries)."""
    found = []
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        members: Any = []
        if kind == "zset":
            members = client.zrange(key, 0, -1)
        elif kind == "list":
            members = client.lrange(key, 0, -1)
        elif kind == "hash" and key.startswith("ts:gpu:"):
            members = client.hkeys(key)
        found += [f"{key}: {member}" for member in members if experiment_id in member]
    return found


def projected(client: redis.Redis, experiment_id: str) -> None:
    """The projector has folded the whole log: its views stop changing."""
    head = EventStore(client, experiment_id).head()
    wait_until(lambda: ViewStore(client, experiment_id).position() == head, what="the projector to catch up")


def run_experiment(tmp_path: Path, env: dict[str, str], name: str) -> str:
    directory = tmp_path / name
    directory.mkdir()
    result = trialstream("run", str(write_local_config(directory, SDK_TRIAL, maxTrialNumber=2)), "--json", env=env)
    assert result.returncode == 0, result.stderr
    return str(json.loads(result.stdout)["experimentId"])


def test_list_and_delete_on_a_shared_redis(tmp_path: Path, processes: Processes, client: redis.Redis) -> None:
    processes.projector()
    worker = processes.worker()
    env = {"TRIALSTREAM_REDIS_URL": processes.redis_url}
    gone, kept = run_experiment(tmp_path, env, "one"), run_experiment(tmp_path, env, "two")
    projected(client, gone)
    projected(client, kept)
    worker.terminate()  # its housekeeping would wake the parked attempts planted below while we compare
    worker.wait(30)
    for experiment_id in (gone, kept):  # state of attempts that a crash could leave behind
        client.zadd(keys.LEASES, {f"{experiment_id}/t0001/1": 1})
        client.zadd(keys.parked("local"), {json.dumps([experiment_id, "t0001", 1, 0, ""]): 1})
        client.hset(gpu_holders("host"), f"{experiment_id}/t0001", "[0]")

    listed = trialstream("experiments", "list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    summaries = {summary["id"]: summary for summary in json.loads(listed.stdout)}
    assert set(summaries) == {gone, kept}
    assert summaries[gone]["status"] == "DONE" and summaries[gone]["trialCounts"] == {"SUCCEEDED": 2}
    assert summaries[gone]["created"] <= summaries[gone]["ended"]
    assert summaries[gone]["directory"].endswith(gone)
    table = trialstream("experiments", "list", env={**env, "COLUMNS": "300"})
    assert table.returncode == 0 and gone in table.stdout and "2 SUCCEEDED" in table.stdout

    kept_keys, kept_members = keys_of(client, kept), members_of(client, kept)
    assert keys_of(client, gone) and members_of(client, gone)
    deleted = trialstream("experiments", "delete", gone, "--yes", env=env)
    assert deleted.returncode == 0, deleted.stderr
    assert keys_of(client, gone) == set() and members_of(client, gone) == []
    assert keys_of(client, kept) == kept_keys and members_of(client, kept) == kept_members  # untouched
    assert [s["id"] for s in json.loads(trialstream("experiments", "list", "--json", env=env).stdout)] == [kept]
    assert trialstream("trials", "list", "-e", kept, "--json", env=env).returncode == 0

    again = trialstream("experiments", "delete", gone, "--yes", env=env)
    assert again.returncode == 1 and f"experiment '{gone}' not found" in again.stderr
    assert "Traceback" not in again.stderr


def test_a_running_experiment_is_not_deleted(tmp_path: Path, processes: Processes, client: redis.Redis) -> None:
    processes.projector()
    processes.worker()
    env = {"TRIALSTREAM_REDIS_URL": processes.redis_url}
    experiment_id = run_experiment(tmp_path, env, "one")
    projected(client, experiment_id)
    client.set(keys.runner(experiment_id), "runner:elsewhere:1")  # a runner holds it
    before = keys_of(client, experiment_id)
    refused = trialstream("experiments", "delete", experiment_id, "--yes", env=env)
    assert refused.returncode == 1 and "is running" in refused.stderr and "stop it first" in refused.stderr
    assert keys_of(client, experiment_id) == before

    unasked = trialstream("experiments", "delete", experiment_id, env=env)  # no terminal to ask on
    assert unasked.returncode == 1 and "--yes" in unasked.stderr and keys_of(client, experiment_id) == before


def test_list_and_delete_embedded_experiments(tmp_path: Path) -> None:
    env = {"TRIALSTREAM_EXPERIMENTS_DIR": str(tmp_path / "root")}
    config = write_local_config(
        tmp_path, SDK_TRIAL, maxTrialNumber=1, experimentWorkingDirectory=str(tmp_path / "root")
    )
    ran = trialstream("run", str(config), "--json", env=env)
    assert ran.returncode == 0, ran.stderr
    experiment_id = json.loads(ran.stdout)["experimentId"]

    listed = trialstream("experiments", "list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    [summary] = json.loads(listed.stdout)
    assert summary["id"] == experiment_id and summary["status"] == "DONE"
    assert summary["directory"] == str(tmp_path / "root" / experiment_id)

    unreachable = {"platform": "remote", "machineList": [{"host": "127.0.0.1", "port": free_port(), "user": "u"}]}
    unreachable["machineList"][0]["password"] = "p"  # type: ignore[index]
    refused = config.with_name("refused.yml")
    refused.write_text(config.read_text().replace('{"platform": "local"}', json.dumps(unreachable)))
    failed = trialstream("run", str(refused), env=env)
    assert failed.returncode != 0 and "127.0.0.1" in failed.stderr, failed.stderr
    assert [path.name for path in (tmp_path / "root").iterdir()] == [experiment_id]  # it left no directory
    assert (tmp_path / "root" / experiment_id / CREATED).is_file()  # what orders the experiments (test_embedded_redis)

    deleted = trialstream("experiments", "delete", experiment_id, "--yes", env=env)
    assert deleted.returncode == 0, deleted.stderr
    assert not (tmp_path / "root" / experiment_id).exists()
    assert json.loads(trialstream("experiments", "list", "--json", env=env).stdout) == []
    missing = trialstream("experiments", "delete", experiment_id, "--yes", env=env)
    assert missing.returncode == 1 and "not found" in missing.stderr
