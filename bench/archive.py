"""Archiving ended experiments (issue 29): what an experiment holds in Redis live and once archived, how big its
archive is, and how long archiving, a first read from the archive and a restore take, beside the baselines in
the same run (reading the live experiment the same way; DUMPing its keys, what any archive must at least do).

One synthetic experiment (tests/support/experiment_log.py) of TRIALS trials x METRICS metrics, imported into a
scratch redis-server and projected (views and timeline), archived into a directory.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import redis

from bench.harness import Figure, Section, median_of, repeat, scratch_redis, used_memory
from core import keys
from core.connections import same_server
from manager.archive.moves import archive, restore
from manager.archive.stores import open_store
from manager.experiments import resolve_experiment
from manager.projector import Projector
from manager.training_service import TrainingService
from manager.transfer import LogFile, import_log
from tests.support.experiment_log import synthetic_log

TRIALS, METRICS = 1_000, 100


def _read(client: redis.Redis, experiment_id: str) -> float:
    """A process's first look: resolve the experiment, list its trials, read one trial's metrics."""
    began = time.perf_counter()
    resolve_experiment(client, experiment_id)
    service = TrainingService(client, same_server(client, decode=False), experiment_id)
    trials = service.list_trial_jobs()
    service.views.metrics(trials[-1].id)
    return time.perf_counter() - began


def run(root: Path, runs: int) -> Section:
    section = Section("Archiving ended experiments", "python -m bench --only archive")
    with scratch_redis(root / "archive-redis", appendfsync="everysec") as (client, _):
        empty = used_memory(client)
        entries = list(synthetic_log("big", TRIALS, METRICS))
        import_log(client, LogFile("big", entries, {}))
        Projector(client).catch_up("big")
        live = used_memory(client) - empty
        store = open_store(str(root / "archive"))
        raw = same_server(client, decode=False)
        names = list(client.scan_iter(match="ts:exp:big:*")) + list(client.scan_iter(match="ts:view:big:*"))

        def dump_all(_: int) -> float:
            began = time.perf_counter()
            with raw.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.dump(name)
                pipe.execute()
            return time.perf_counter() - began

        dumped = median_of(repeat(runs, dump_all))
        read_live = median_of(repeat(runs, lambda _: _read(client, "big")))
        archived_s, thawed_s, restored_s, sizes = [], [], [], []
        for _ in range(runs):
            began = time.perf_counter()
            record = archive(client, "big", store, thaw_s=600)
            archived_s.append(time.perf_counter() - began)
            sizes.append(record.size)
            kept = _held(client, "big")
            thawed_s.append(_read(client, "big"))
            began = time.perf_counter()
            restore(client, "big")
            restored_s.append(time.perf_counter() - began)
        per_archived = _kept_bytes(client, root, store)
    section.add(
        Figure("Redis memory of the experiment, live", live / 1e6, "MB", detail=f"{live / len(entries):.0f} B/entry"),
        Figure("Redis memory of the experiment, archived", kept, "B"),
        Figure("its archive (compressed segments + manifest)", median_of(sizes) / 1e6, "MB"),
        Figure("DUMP of its keys (baseline)", dumped, "s"),
        Figure("archive it (DUMP, compress, write, swap)", median_of(archived_s), "s"),
        Figure("first read, live (resolve, list trials, one trial's metrics)", read_live * 1000, "ms"),
        Figure("first read, archived (the same, thawing it first)", median_of(thawed_s) * 1000, "ms"),
        Figure("restore it for good", median_of(restored_s), "s"),
        Figure("Redis memory per archived experiment (10 trials)", per_archived, "B"),
    )
    section.notes.append(
        f"{TRIALS:,} trials x {METRICS} metrics = {len(entries):,} log entries, projected (views and timeline); "
        f"{runs} runs, medians; a directory archive on this machine's disk. What stays in Redis for an archived "
        "experiment: its experiment, counts and position views, its entry in the experiments index and its "
        "archive record (and its secrets, which never leave Redis)."
    )
    return section


def _kept_bytes(client: redis.Redis, root: Path, store: Any) -> float:
    """What a small archived experiment holds in Redis: MEMORY USAGE of the views it keeps, its archive record,
    its member of the experiments index (a median of 20)."""
    held = []
    for index in range(20):
        experiment_id = f"small{index}"
        import_log(client, LogFile(experiment_id, list(synthetic_log(experiment_id, 10, 10)), {}))
        Projector(client).catch_up(experiment_id)
        archive(client, experiment_id, store)
        held.append(_held(client, experiment_id))
    return median_of(held)


def _held(client: redis.Redis, experiment_id: str) -> int:
    """MEMORY USAGE of the views an archived experiment keeps, its record and index entry (~64 B of overhead)."""
    views = sum(int(client.memory_usage(name) or 0) for name in keys.ViewKeys(experiment_id).kept_when_archived)
    return views + int(client.hstrlen(keys.ARCHIVED, experiment_id)) + 2 * len(experiment_id) + 64
