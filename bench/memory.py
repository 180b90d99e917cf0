"""Redis memory per metric event (issue 29): what one more metric of a trial costs, key family by key family,
against the 200-byte target, and what the stream node settings change.

Two synthetic experiments (tests/support/experiment_log.py) of TRIALS trials, one with METRICS intermediate
metrics each and one with a single one, imported into a scratch redis-server and projected (views and
timeline): the difference, over the metrics it adds, is the cost of a metric event. `used_memory` measures it
whole; `MEMORY USAGE ... SAMPLES 0` of each key splits it.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import redis

from bench.harness import Figure, Section, scratch_redis, used_memory
from core import keys
from manager.projector import Projector
from manager.transfer import LogFile, import_log
from tests.support.experiment_log import synthetic_log

TRIALS, METRICS = 1_000, 100
TARGET = "<= 200"
WORKER = "3f2a1b9c0d4e:48213"
NODES = [(4096, 100), (16384, 500), (65536, 2000)]  # stream-node-max-bytes, -entries; Redis's default first


def _family(name: str, experiment_id: str) -> str:
    rest = name.split(f":{experiment_id}:", 1)[-1]
    if name.startswith(f"{keys.LOG_PREFIX}:exp:"):
        return {"events": "the log (stream)"}.get(rest, f"log: {rest.split(':')[0]}")
    if rest.startswith("metrics:"):
        return "views: metric lists"
    if rest.startswith("timeline"):
        return "views: the timeline"
    if rest in ("metric-marks", "metric-keys"):
        return "views: metric dedup"
    return "views: trials and indexes" if rest in ("trials", "order", "ranking") else "views: the rest"


def _by_family(client: redis.Redis, experiment_id: str) -> Counter[str]:
    sizes: Counter[str] = Counter()
    for pattern in (f"ts:exp:{experiment_id}:*", f"ts:view:{experiment_id}:*"):
        for name in client.scan_iter(match=pattern, count=1000):
            sizes[_family(str(name), experiment_id)] += int(
                client.execute_command("MEMORY", "USAGE", name, "SAMPLES", 0)
            )
    return sizes


def _as_reported(entries: Iterable[tuple[str, dict[str, str]]]) -> Iterator[tuple[str, dict[str, str]]]:
    """The synthetic log's metrics as a worker reports them: its name as their source (a compose container's
    host name and the worker's pid), NNI's double-encoded float as their data."""
    rng = random.Random(29)
    for entry_id, fields in entries:
        if fields["type"] == "TrialMetricReported":
            values = json.loads(fields["json"])
            values[2], values[-1] = WORKER, json.dumps(json.dumps(rng.random()))
            fields = {**fields, "json": json.dumps(values, separators=(",", ":"))}
        yield entry_id, fields


def _experiment(client: redis.Redis, experiment_id: str, metrics: int) -> tuple[int, Counter[str]]:
    before = used_memory(client)
    log = list(_as_reported(synthetic_log(experiment_id, TRIALS, metrics)))
    import_log(client, LogFile(experiment_id, log, {}))
    Projector(client).catch_up(experiment_id)
    return used_memory(client) - before, _by_family(client, experiment_id)


def run(root: Path, runs: int) -> Section:
    section = Section("Redis memory per metric event", "python -m bench --only memory")
    added = TRIALS * (METRICS - 1)
    per_node: dict[tuple[int, int], float] = {}
    for node_bytes, node_entries in NODES:
        with scratch_redis(root / f"memory-{node_bytes}", appendfsync="everysec") as (client, _):
            client.config_set("stream-node-max-bytes", node_bytes)
            client.config_set("stream-node-max-entries", node_entries)
            small, small_families = _experiment(client, "x7k2m9q1", 1)  # ids of NNI's length: 8 characters
            large, large_families = _experiment(client, "p4w8n3z6", METRICS)
            per_node[(node_bytes, node_entries)] = (large - small) / added
            if (node_bytes, node_entries) == NODES[0]:
                families = {name: (large_families[name] - small_families[name]) / added for name in large_families}
    default = per_node[NODES[0]]
    section.add(Figure("a metric event, all of it (used_memory)", default, "B", TARGET))
    section.add(Figure("a metric event, its keys' MEMORY USAGE summed", sum(families.values()), "B", TARGET))
    for name, size in sorted(families.items(), key=lambda item: -item[1]):
        section.add(Figure(f"  of which {name}", size, "B"))
    for (node_bytes, node_entries), size in per_node.items():
        section.add(Figure(f"with stream-node-max-bytes {node_bytes}, -entries {node_entries}", size, "B", TARGET))
    section.notes.append(
        f"{TRIALS:,} trials with {METRICS} intermediate metrics against the same with 1: the difference over the "
        f"{added:,} metric events it adds, each from a worker named {WORKER!r} with a random float as NNI encodes it; "
        f"Redis {client_version(root)}; families from MEMORY USAGE ... SAMPLES 0 "
        "(allocator rounding included, the keyspace's own per-key overhead not)."
    )
    return section


def client_version(root: Path) -> str:
    with scratch_redis(root / "memory-version", appendfsync="everysec") as (client, _):
        info: Any = client.info("server")
        return str(info["redis_version"])
