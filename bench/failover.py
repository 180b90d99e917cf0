"""Redis replication and Sentinel failover (issue 27), on loopback with real redis-server processes.

- Append latency: one event appended through `EventStore.append` (the project's append script), on the same
  master with one replica, acknowledged after `WAIT 1` (TRIALSTREAM_REDIS_REPLICAS=1) against without WAIT
  (=0): the two interleaved in blocks, so both see the same machine.
- Failover: a master, 2 replicas and 3 sentinels (down-after-milliseconds 1000), the master SIGKILLed; the
  time from the kill to the first append the new master accepts, through a client on the Sentinel URL that
  was appending before. A fresh set per run.

The data nodes start from deploy/redis/ha-node.conf (each its own copy), as shipped.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import redis

from bench.harness import NODE_CONFIG, REPO, Figure, LoopbackRedis, Section, percentile, repeat, wait_until
from core.connections import RedisOptions, connect
from core.event_store import EventStore
from schemas.events import TrialMetricReported

MASTER = "trialstream"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000
LATENCY_APPENDS, LATENCY_BLOCK = 3000, 100


def _sentinel_config(master_port: int) -> str:
    return (
        f"sentinel monitor {MASTER} 127.0.0.1 {master_port} 2\n"
        f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
        f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n"
    )


def _metric(sequence: int) -> TrialMetricReported:
    return TrialMetricReported(
        experiment_id="benchha",
        trial_id="Ab3dE",
        attempt=1,
        source="host:1234",
        parameter_id="0",
        metric_type="PERIODICAL",
        sequence=sequence,
        data=json.dumps(json.dumps({"default": 0.5})),
    )


def append_latency(root: Path) -> tuple[list[float], list[float]]:
    """Append latencies in ms (without WAIT, with WAIT 1) on one master with one replica."""
    master = LoopbackRedis(root / "master")
    replica = LoopbackRedis(root / "replica", replica_of=master.port)
    try:
        wait_until(lambda: master.replicas_online() == 1, 10, "the replica to sync")
        url = f"redis://127.0.0.1:{master.port}/0"
        plain = EventStore(connect(url, options=RedisOptions(replicas=0)), "benchha")
        waited = EventStore(connect(url, options=RedisOptions(replicas=1)), "benchha")
        samples: dict[int, list[float]] = {0: [], 1: []}
        sequence = 0
        for block in range(2 * LATENCY_APPENDS // LATENCY_BLOCK):
            store, key = (plain, 0) if block % 2 == 0 else (waited, 1)
            for _ in range(LATENCY_BLOCK):
                sequence += 1
                started = time.perf_counter()
                store.append(_metric(sequence))
                samples[key].append((time.perf_counter() - started) * 1000)
        waits = master.client.info("commandstats").get("cmdstat_wait", {}).get("calls", 0)
        assert waits == len(samples[1]), f"{waits} WAITs for {len(samples[1])} appends with WAIT 1"
        return samples[0], samples[1]
    finally:
        replica.stop()
        master.stop()


def failover_once(root: Path) -> tuple[float, float]:
    """Seconds from the master's SIGKILL to the sentinels naming a new master, and to the first append the new
    master accepted."""
    master = LoopbackRedis(root / "node0")
    replicas = [LoopbackRedis(root / f"node{i}", replica_of=master.port) for i in (1, 2)]
    sentinels: list[LoopbackRedis] = []
    try:
        wait_until(lambda: master.replicas_online() == 2, 10, "the replicas to sync")
        config = _sentinel_config(master.port)
        sentinels = [LoopbackRedis(root / f"sentinel{i}", sentinel_config=config) for i in range(3)]

        def settled() -> bool:  # every sentinel sees the 2 others and both replicas
            for sentinel in sentinels:
                state: Any = sentinel.client.sentinel_master(MASTER)
                if int(state["num-other-sentinels"]) < 2 or int(state["num-slaves"]) < 2:
                    return False
            return True

        wait_until(settled, 30, "the sentinels to settle")
        url = "redis+sentinel://" + ",".join(f"127.0.0.1:{s.port}" for s in sentinels) + f"/{MASTER}"
        store = EventStore(connect(url), "benchha")
        for sequence in range(100):  # appending, through the master, when it dies
            store.append(_metric(sequence))
        switched: list[float] = []
        watcher = threading.Thread(target=_watch_switch, args=(sentinels[0].port, master.port, switched))
        master.process.send_signal(signal.SIGKILL)
        killed = time.perf_counter()
        watcher.start()
        store.append(_metric(100))  # the client's own retries carry it to the new master
        accepted = time.perf_counter() - killed
        watcher.join(30)
        _, port = sentinels[0].client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)
        assert int(port) in {replica.port for replica in replicas}, "the append was not on a promoted replica"
        return switched[0] - killed, accepted
    finally:
        for server in [*sentinels, *replicas, master]:
            server.stop()


def _watch_switch(sentinel_port: int, old_port: int, switched: list[float]) -> None:
    """Appends to `switched` when the sentinel first names a master other than `old_port` (polled every 10 ms)."""
    with redis.Redis("127.0.0.1", sentinel_port, socket_timeout=2, decode_responses=True) as sentinel:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            _, port = sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)
            if int(port) != old_port:
                switched.append(time.perf_counter())
                return
            time.sleep(0.01)


def run(root: Path, runs: int) -> Section:
    section = Section("Redis replication and failover (issue 27)", "python -m bench --only failover")
    plain, waited = append_latency(root / "latency")
    section.add(
        Figure("append p50, no WAIT (baseline)", percentile(plain, 50), "ms", detail=f"{len(plain)} appends"),
        Figure("append p99, no WAIT (baseline)", percentile(plain, 99), "ms", detail=f"{len(plain)} appends"),
        Figure(
            "append p50, WAIT 1",
            percentile(waited, 50),
            "ms",
            detail=f"{len(waited)} appends, same master, 1 replica, interleaved with the baseline",
        ),
        Figure("append p99, WAIT 1", percentile(waited, 99), "ms", detail=f"{len(waited)} appends"),
    )
    failover_runs = max(runs, 5)
    measured = repeat(failover_runs, lambda i: failover_once(root / f"failover{i}"))
    switches, times = [m[0] for m in measured], [m[1] for m in measured]
    section.add(
        Figure(
            "failover: SIGKILL to the sentinels naming a new master, p50",
            percentile(switches, 50),
            "s",
            detail=f"{failover_runs} runs (each {', '.join(f'{t:.2f}' for t in switches)} s)",
        ),
        Figure(
            "failover: SIGKILL to first append on the new master, p50",
            percentile(times, 50),
            "s",
            "<= 5",
            f"{failover_runs} runs (each {', '.join(f'{t:.2f}' for t in times)} s); down-after-milliseconds "
            f"{DOWN_AFTER_MS}, 3 sentinels, quorum 2, 2 replicas",
        ),
    )
    section.notes.append(
        "Append latency: one event through `EventStore.append` (the append script), 100 appends without WAIT, "
        "then 100 with `WAIT 1` (TRIALSTREAM_REDIS_REPLICAS=1), and so on, on the same master with one replica "
        f"({NODE_CONFIG.relative_to(REPO)} as shipped: AOF with fsync every second). Failover: the client is "
        "the one trialstream's processes use (`core.connections.connect` on the Sentinel URL); the time includes "
        "its retry back-off between asking the sentinels."
    )
    return section
