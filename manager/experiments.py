"""Creating experiments, finding them again, listing and deleting them."""

from __future__ import annotations

import json
import re
import secrets
import string
from collections import Counter
from pathlib import Path
from typing import Any

import redis
from pydantic import BaseModel, Field

from core import keys
from core.assignments import secrets_by_platform
from core.connections import same_server, text_fields
from core.event_store import EventStore, Fence
from core.queueing import ExperimentJob, enqueue, execute_enqueued
from manager.archive.moves import archived, experiment_keys, forget, glob_escaped, thaw
from manager.training_service import TrainingService
from schemas.events import ExperimentCreated, ExperimentFinished

_ID_ALPHABET = string.ascii_lowercase + string.digits


class ExperimentNotFound(LookupError):
    pass


def new_id(length: int) -> str:
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(length))


def create_experiment(
    client: redis.Redis,
    config: dict[str, Any],
    root: Path,
    experiment_id: str | None = None,
    secrets: dict[str, str] | None = None,
) -> str:
    """Append ExperimentCreated and register the experiment, atomically; returns its id (8 chars, as NNI).
    The config's `secrets` (masked in `config`) are kept beside the log, for the platform's workers."""
    while experiment_id is None:
        candidate = new_id(8)
        if client.zscore(keys.EXPERIMENTS, candidate) is None:
            experiment_id = candidate
    if client.zscore(keys.EXPERIMENTS, experiment_id) is not None:
        raise ValueError(f"experiment {experiment_id} already exists")
    working_directory = str(root / experiment_id)
    event = ExperimentCreated(experiment_id=experiment_id, config=config, working_directory=working_directory)
    with client.pipeline(transaction=True) as pipe:
        pipe.multi()
        EventStore(client, experiment_id).append(event, idempotency_key="created", pipeline=pipe)
        pipe.zadd(keys.EXPERIMENTS, {experiment_id: event.time})
        for platform, held in secrets_by_platform(config.get("trainingService"), secrets or {}).items():
            for path, value in held.items():
                pipe.hset(keys.secrets(experiment_id, platform), path, value)
        pipe.execute()
    return experiment_id


def finish_experiment(
    client: redis.Redis,
    rq_connection: redis.Redis,
    experiment_id: str,
    platforms: str | list[str],
    status: str,
    message: str | None = None,
    read_up_to: str | None = None,
    fence: Fence | None = None,
) -> bool:
    """A resumed experiment finishes again: the last ExperimentFinished holds. With it, each of its
    platforms (several in a hybrid experiment) is asked to clean up where the trials ran (a job of its
    queue: its workers hold its clients). With `read_up_to`, only if that is still the log's last entry
    (under a WATCH of the log: nothing is appended in between); whether it finished. With `fence` (a runner's),
    only while it holds (core.event_store.AppendFenced, with nothing written nor queued)."""
    event = ExperimentFinished(experiment_id=experiment_id, status=status, message=message)  # type: ignore[arg-type]
    names = [platforms] if isinstance(platforms, str) else platforms
    jobs = [ExperimentJob(platform, experiment_id) for platform in names]
    store = EventStore(client, experiment_id, fence)
    with client.pipeline(transaction=True) as pipe:
        try:
            if read_up_to is not None:
                pipe.watch(store.stream)
                if store.last_id() != read_up_to:
                    return False
            pipe.multi()
            execute_enqueued(pipe, enqueue(pipe, rq_connection, store, event, jobs))
        except redis.WatchError:
            return False
    return True


def resolve_experiment(client: redis.Redis, experiment_id: str | None) -> str:
    """The given experiment if it exists, else the newest one; an archived one is read from its archive
    (manager.archive.moves.thaw) for a while from now."""
    if experiment_id is None:
        newest = client.zrange(keys.EXPERIMENTS, -1, -1)
        if not newest:
            raise ExperimentNotFound("no experiment has been run against this Redis yet")
        experiment_id = str(newest[0])
    else:
        resolve_known(client, experiment_id)
    thaw(client, experiment_id)
    return experiment_id


def resolve_known(client: redis.Redis, experiment_id: str) -> None:
    """A clear not-found for an experiment this Redis never had (or deleted); nothing is read from an archive."""
    if client.zscore(keys.EXPERIMENTS, experiment_id) is None:
        raise ExperimentNotFound(f"experiment {experiment_id!r} not found")


class ExperimentRunning(RuntimeError):
    pass


class ExperimentSummary(BaseModel):
    """One line of `trialstream experiments list`."""

    id: str
    status: str
    created: int | None = Field(description="epoch ms")
    ended: int | None = Field(description="epoch ms, None while it runs")
    trial_counts: dict[str, int] = Field(serialization_alias="trialCounts")
    directory: str = Field(description="its working directory; an embedded experiment's Redis data is under it")
    archived: bool = Field(default=False, description="its log is in its archive: reads go there, resume restores it")


def list_experiments(client: redis.Redis) -> list[ExperimentSummary]:
    """Every experiment of this Redis, oldest first. An archived one is read through the views it keeps in Redis (a
    listing does not bring it back)."""
    rq_connection = same_server(client, decode=False)
    summaries = []
    archived_ids = set(client.hkeys(keys.ARCHIVED))
    for experiment_id in map(str, client.zrange(keys.EXPERIMENTS, 0, -1)):
        service = TrainingService(client, rq_connection, experiment_id)
        view = service.experiment_view()  # the status first: a DONE one counts every trial ended before it
        summaries.append(
            ExperimentSummary(
                id=view.id,
                status=view.status,
                created=view.start_time,
                ended=None if view.status == "RUNNING" else view.end_time,
                trial_counts=_trial_counts(service, experiment_id in archived_ids),
                directory=view.working_directory,
                archived=experiment_id in archived_ids,
            )
        )
    return summaries


def _trial_counts(service: TrainingService, archived: bool) -> dict[str, int]:
    """Trials by status: the views' counts where they have folded the whole log (read with the log's last id, in
    one transaction), else from every trial's view and the log past them (~2 s for 100k trials). Read only: a
    viewer lists too."""
    view_keys = service.views.keys
    with service.store.client.pipeline(transaction=True) as pipe:
        pipe.hget(view_keys.position, "position")
        pipe.hgetall(view_keys.counts)  # `lost` and `retried` attempts too
        pipe.xrevrange(service.store.stream, count=1)
        position, counts, last = pipe.execute()
    if archived or (position or "0-0") == (last[0][0] if last else "0-0"):
        return {str(name): int(count) for name, count in counts.items() if str(name).isupper() and int(count)}
    return dict(Counter(str(trial.status) for trial in service.list_trial_jobs()))


def move_legacy_secrets(client: redis.Redis, experiment_id: str, training_service: Any) -> None:
    """An experiment created before secrets were kept per platform has them in one hash: split it under
    `keys.secrets` (once, atomically), so that its workers find them where they look now."""
    held = client.hgetall(keys.legacy_secrets(experiment_id))
    if not held:
        return
    texts = text_fields(held)
    with client.pipeline(transaction=True) as pipe:
        for platform, secrets_of_platform in secrets_by_platform(training_service, texts).items():
            for path, value in secrets_of_platform.items():
                pipe.hset(keys.secrets(experiment_id, platform), path, value)
        pipe.delete(keys.legacy_secrets(experiment_id))
        pipe.execute()


def delete_experiment(client: redis.Redis, experiment_id: str) -> int:
    """Delete everything Redis holds of a stopped experiment: its log and what serves it, its views
    in every namespace, its queued and finished jobs, its entries in shared sets, and its archive if it
    has one. Returns how many keys went. Refused while a runner holds the experiment's claim."""
    resolve_known(client, experiment_id)
    record = archived(client, experiment_id)
    runner_key = keys.runner(experiment_id)
    owned = experiment_keys(client, experiment_id)
    staged = f"{keys.staging(glob_escaped(experiment_id), '*')}*"
    owned |= {str(key) for key in client.scan_iter(match=staged, count=1000)}
    job_keys = _job_keys(client, experiment_id)
    job_ids = {match.group("job") for match in job_keys.values()}
    with client.pipeline(transaction=True) as pipe:
        pipe.watch(runner_key, keys.ARCHIVED)  # a runner that claims it from now on makes the deletion fail
        if pipe.exists(runner_key):
            holder: Any = pipe.get(runner_key)
            raise ExperimentRunning(f"experiment {experiment_id} is running ({holder}): stop it first")
        shared_entries = _shared_entries(pipe, experiment_id, job_ids)
        pipe.multi()
        for key in sorted(owned | set(job_keys)):
            pipe.delete(key)
        for key, kind, members in shared_entries:
            for member in members:
                if kind == "list":
                    pipe.lrem(key, 0, member)
                elif kind == "hash":
                    pipe.hdel(key, member)
                else:
                    pipe.zrem(key, member)
        pipe.zrem(keys.EXPERIMENTS, experiment_id)
        pipe.zrem(keys.ACTIVITY, experiment_id)
        pipe.srem(keys.MANAGER_HOSTED, experiment_id)  # a manager must not resume what is gone
        pipe.hdel(keys.ARCHIVED, experiment_id)
        try:
            pipe.execute()
        except redis.WatchError:
            taken = f"experiment {experiment_id} was just taken up by a runner or moved: try again"
            raise ExperimentRunning(taken) from None
    if record is not None:
        forget(record, experiment_id)  # after Redis: a crash in between leaves files, never a record without them
    return len(owned) + len(job_keys) + (record.keys if record is not None else 0)


def _job_keys(client: redis.Redis, experiment_id: str) -> dict[str, re.Match[str]]:
    """RQ's keys of the experiment's jobs (`rq:job:<job id>`, `rq:results:<job id>`, ...). A job id is
    `<exp>-<trial>-<attempt>-<run|release>-<ns>`, or `<exp>--clean-up-<ns>`; a trial id has no dash, so
    `a-b`'s jobs are not `a`'s."""
    escaped = re.escape(experiment_id)
    job = re.compile(rf"(^|:)(?P<job>{escaped}-([^-:]+-\d+-(run|release)|-clean-up)-\d+)(:|$)")
    found = {}
    for key in client.scan_iter(match=f"rq:*{glob_escaped(experiment_id)}-*", count=1000):
        match = job.search(str(key))
        if match:
            found[str(key)] = match
    return found


def _shared_entries(client: Any, experiment_id: str, job_ids: set[str]) -> list[tuple[str, str, list[str]]]:
    """(key, type, members) of the experiment's entries in keys shared with other experiments: leases,
    parked attempts, GPU holders, and RQ's queues and job registries."""
    entries: list[tuple[str, str, list[str]]] = []
    prefix = f"{experiment_id}/"
    leases = [member for member, _ in client.zscan_iter(keys.LEASES, match=f"{glob_escaped(prefix)}*")]
    entries.append((keys.LEASES, "zset", leases))
    for key in client.scan_iter(match=f"{keys.LOG_PREFIX}:parked:*", count=1000):
        parked = [m for m in client.zrange(key, 0, -1) if json.loads(m)[0] == experiment_id]
        entries.append((str(key), "zset", parked))
    for key in client.scan_iter(match=f"{keys.LOG_PREFIX}:gpu:*:holders", count=1000):
        holders = [field for field, _ in client.hscan_iter(key, match=f"{glob_escaped(prefix)}*")]
        entries.append((str(key), "hash", holders))
    if job_ids:
        for key in client.scan_iter(match="rq:*", count=1000):
            kind = str(client.type(key))
            if kind == "list":
                entries.append((str(key), kind, [m for m in client.lrange(key, 0, -1) if m in job_ids]))
            elif kind == "zset":
                entries.append((str(key), kind, [m for m in client.zrange(key, 0, -1) if m in job_ids]))
    return [entry for entry in entries if entry[2]]
