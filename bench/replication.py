"""Slot refill and metric ingestion with a replica and `WAIT` on (issue 27), beside today's set-up in the same run.

Two stacks (`BenchStack`) are up together: today's (the embedded redis-server alone) and the same redis-server
made the master of one replica, every append waiting for it (`WAIT 1`, TRIALSTREAM_REDIS_REPLICAS=1). Each step
of a run measures both, one after the other, the first of the two alternating, so that both see the same machine:
the slot refill as bench/overhead.py measures it and the metric ingestion as bench/ingestion.py does.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path

from bench.harness import NODE_CONFIG, REPO, BenchStack, Figure, Section, median_of, percentile, repeat, replicas_online
from bench.ingestion import (
    BURST_METRICS,
    BURST_TRIALS,
    PACED_INTERVAL_S,
    PACED_METRICS,
    PACED_TRIALS,
    ingestion_rate,
    latencies,
)
from bench.overhead import TRIALS, WORKERS, refill_run
from core import keys

SETUPS = {"today": "today (one redis-server)", "replica": "1 replica, WAIT 1"}
STEPS = ("refill1", "refill4", "rate", "paced")  # what a run measures, in order
FIGURES = (  # key of `measure`, figure, unit
    ("refill1", "slot refill at concurrency 1 (trial ends -> next RUNNING) p50", "ms"),
    ("refill4", "slot refill at concurrency 4 (trial ends -> next RUNNING) p50", "ms"),
    ("rate", "metrics into the views", "metrics/s"),
    ("to_log50", "metric reported -> in the log p50", "ms"),
    ("to_log99", "metric reported -> in the log p99", "ms"),
    ("to_listener50", "metric reported -> delivered to a metric listener p50", "ms"),
    ("to_listener99", "metric reported -> delivered to a metric listener p99", "ms"),
    ("to_views50", "metric reported -> in the projected views p50", "ms"),
    ("to_views99", "metric reported -> in the projected views p99", "ms"),
)


def measure(stack: BenchStack, step: str, name: str) -> dict[str, float]:
    """One step of a run on `stack` (an experiment `name`): its figures, keyed as FIGURES."""
    if step.startswith("refill"):
        concurrency = int(step.removeprefix("refill"))
        _, refills, _ = refill_run(stack, name, concurrency)
        return {step: percentile(refills, 50)}
    if step == "rate":
        return {step: ingestion_rate(stack, name)}
    paced = latencies(stack, name)
    return {f"{key}{q}": percentile(samples, q) for key, samples in paced.items() for q in (50, 99)}


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _difference(today: float, replica: float, unit: str) -> str:
    change = replica - today
    relative = f" ({change / today * 100:+.0f} %)" if today else ""
    return f"{'+' if change >= 0 else '-'}{_number(abs(change))} {unit}{relative}"


def _waits(stack: BenchStack) -> int:
    """The WAITs the stack's redis-server has answered."""
    return int(stack.client.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


def run(root: Path, runs: int) -> Section:
    title = "Slot refill and metric ingestion with a replica (issue 27)"
    section = Section(title, "python -m bench --only replication")
    samples: dict[str, list[dict[str, float]]] = {setup: [] for setup in SETUPS}
    load_before = os.getloadavg()[0]
    with ExitStack() as opened:
        stacks = {
            setup: opened.enter_context(BenchStack(root / setup, workers=WORKERS, replica=setup == "replica"))
            for setup in SETUPS
        }

        def one_run(index: int) -> None:
            figures: dict[str, dict[str, float]] = {setup: {} for setup in SETUPS}
            for number, step in enumerate(STEPS):  # each step on both set-ups, the first alternating
                for setup in list(SETUPS)[:: 1 if (index + number) % 2 == 0 else -1]:
                    figures[setup] |= measure(stacks[setup], step, f"{setup}{index}{step}")
            for setup in SETUPS:
                samples[setup].append(figures[setup])

        repeat(runs, one_run)
        waits = {setup: _waits(stack) for setup, stack in stacks.items()}
        timeouts = int(stacks["replica"].client.get(keys.REPLICATION_TIMEOUTS) or 0)
        replicas = replicas_online(stacks["replica"].client)
    load_after = os.getloadavg()[0]
    if waits["today"] or not waits["replica"] or replicas != 1:
        raise RuntimeError(f"WAITs {waits}, replicas online at the end {replicas}: not the two set-ups compared")

    print("  side by side:", flush=True)
    for key, name, unit in FIGURES:
        today, replica = (median_of([figures[key] for figures in samples[setup]]) for setup in SETUPS)
        runs_of = {setup: ", ".join(_number(figures[key]) for figures in samples[setup]) for setup in SETUPS}
        difference = _difference(today, replica, unit)
        section.figures += [
            Figure(f"{name}: {SETUPS['today']}", today, unit, detail=f"runs: {runs_of['today']}"),
            Figure(
                f"{name}: {SETUPS['replica']}",
                replica,
                unit,
                detail=f"{difference} against today's; runs: {runs_of['replica']}",
            ),
        ]
        print(f"  {name}: {_number(today)} | {_number(replica)} {unit} | {difference}", flush=True)
    section.notes.append(
        f"Both set-ups up together, {WORKERS} local workers and a projector each; each step of a run (the refills "
        "at concurrency 1, at 4, the ingestion rate, the latencies) runs on one set-up then the other, the first "
        f"alternating, so both see the same machine: its load average was {load_before:.1f} when the group "
        f"started and {load_after:.1f} when it ended, on {os.cpu_count()} cores. Today's: the redis-server "
        "`trialstream run` starts (AOF with `appendfsync always`, clients on its unix socket), alone. With a "
        "replica: the same redis-server, also listening on loopback TCP (replication needs a port), given the "
        f"replication settings of {NODE_CONFIG.relative_to(REPO)} (`min-replicas-to-write 1`, diskless sync) but "
        "keeping its AOF, and a replica started from that file as shipped (AOF with fsync every second) with "
        "`--replicaof`, in sync before anything connects; every process (runner, projector, workers) has "
        "TRIALSTREAM_REDIS_REPLICAS=1, so each append waits for `WAIT 1` (after a ROLE), and the clients stay on "
        f"the unix socket: the replica and its acknowledgement are all that differs. The master answered "
        f"{waits['replica']:,} WAITs ({timeouts} timed out); today's none."
    )
    section.notes.append(
        f"Slot refill: {TRIALS} trials at concurrency 1 then 4, as bench/overhead.py (stream-id times, 1 ms steps). "
        f"Ingestion, as bench/ingestion.py: the rate with {BURST_TRIALS} trials x {BURST_METRICS} metrics reported "
        f"as fast as they can, the latencies with {PACED_TRIALS} trials x {PACED_METRICS} metrics "
        f"{PACED_INTERVAL_S * 1000:g} ms apart. Each row is the median over the runs (a p50 or p99: the median of "
        "the runs' p50s or p99s); the runs' own values follow it."
    )
    return section
