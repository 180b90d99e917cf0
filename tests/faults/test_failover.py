"""Redis fails over mid-experiment, twice: the master SIGKILLed, later the new master SIGSTOPped until the sentinels
have replaced it and moved its replicas, then resumed (an isolated old master). Nothing a trial recorded is lost or
doubled.

A master, 2 replicas and 3 sentinels on loopback (tests/support/sentinel.py, down after 1 s), every process on a
redis+sentinel:// URL: `trialstream run`, the projector and several workers. The faults follow progress (ended
trials), not the clock. Each trial appends what it reports to a file of its own, and the log is checked against
those files, not against itself.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import redis
from rq import Queue, Worker

from core import keys
from core.connections import connect
from core.event_store import EventStore, StoredEvent
from core.queueing import queue_name
from manager.replay import check
from manager.views import ViewStore
from schemas.events import TrialAttemptLost, TrialEnded, TrialMetricReported
from tests.conftest import REPO, Processes, wait_until
from tests.support.sentinel import RedisProcess, SentinelSet

TRIALS = 200
METRICS = 5  # 4 intermediate and the final
WORKERS = 4
CONCURRENCY = 2  # trials per worker
KILL_AFTER, PAUSE_AFTER = 50, 120  # ended trials before each fault
DOWN_AFTER_MS = 2500
# A short lease: a failover (2-3 s here, the renewals' back-off on top) outlasts the gap between two renewals, so
# the reapers' hold after a change of master (core/reaper.py) is what keeps the attempts: none may be given up.
ENV = {"TRIALSTREAM_TRIAL_LEASE_S": "5"}

# Records what it reports (its own side), then reports it on NNI's stdout wire format; `start`/`end` lines
# bound the run, to show that no trial ran twice at once.
TRIAL = f"""
record="$RECORDS/$NNI_TRIAL_JOB_ID"
echo "start $(date +%s%N)" >> "$record"
i=0
while [ $i -lt {METRICS - 1} ]; do
  echo "PERIODICAL $i" >> "$record"
  echo "NNISDK_MEb'{{\\"parameter_id\\": 0, \\"type\\": \\"PERIODICAL\\", \\"sequence\\": $i, \\"value\\": \\"$i\\"}}'"
  i=$((i + 1))
done
echo "FINAL 0" >> "$record"
echo "NNISDK_MEb'{{\\"parameter_id\\": 0, \\"type\\": \\"FINAL\\", \\"sequence\\": 0, \\"value\\": \\"1.5\\"}}'"
echo "end $(date +%s%N)" >> "$record"
"""


@pytest.fixture
def sentinel_set(tmp_path: Path) -> Iterator[SentinelSet]:
    """The set tests/support/sentinel.py makes, but down after DOWN_AFTER_MS: with 1 s, a sentinel on this loaded
    2-core machine once took a just-promoted master for dead and failed it over again (an unplanned failover)."""
    sentinels = SentinelSet(
        tmp_path / "sentinel-set", down_after_ms=DOWN_AFTER_MS, failover_timeout_ms=2 * DOWN_AFTER_MS
    )
    try:
        sentinels.start()
        yield sentinels
    finally:
        sentinels.stop()


@pytest.mark.timeout(120)
def test_an_experiment_survives_two_failovers(tmp_path: Path, sentinel_set: SentinelSet) -> None:
    records = tmp_path / "records"
    records.mkdir()
    (tmp_path / "trial.sh").write_text(TRIAL)
    config = {
        "trialCommand": "sh trial.sh",
        "trialCodeDirectory": str(tmp_path),
        "trialConcurrency": WORKERS * CONCURRENCY,
        "maxTrialNumber": TRIALS,
        "searchSpace": {"x": {"_type": "randint", "_value": [0, 1000]}},
        "tuner": {"name": "Random", "classArgs": {"seed": 3}},
        "trainingService": {"platform": "local"},
        "experimentWorkingDirectory": str(tmp_path / "experiments"),
    }
    (tmp_path / "config.yml").write_text(json.dumps(config))
    url = sentinel_set.url
    client = connect(url)
    (tmp_path / "logs").mkdir()
    processes = Processes(url, tmp_path / "logs")
    env = {**ENV, "RECORDS": str(records)}  # RECORDS reaches the trials (not a TRIALSTREAM_ variable)
    failovers: list[float] = []
    try:
        processes.start("projector")
        for _ in range(WORKERS):  # started together: one by one, their imports alone took seconds
            processes.start("worker", "--platform", "local", "--concurrency", str(CONCURRENCY), env=env)
        queue = Queue(queue_name("local"), connection=connect(url, decode=False))
        wait_until(lambda: len(Worker.all(queue=queue)) == WORKERS, 30, what="the workers to register")
        wait_until(lambda: client.exists(keys.PROJECTOR_HEARTBEAT), 30, what="the projector")
        started = time.monotonic()
        runner = subprocess.Popen(
            [sys.executable, "-m", "manager.cli", "--redis", url, "run", str(tmp_path / "config.yml"), "--json"],
            cwd=REPO,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=(tmp_path / "logs" / "run.log").open("wb"),
            text=True,
        )
        faults = threading.Thread(target=_faults, args=(client, sentinel_set, failovers), daemon=True)
        faults.start()
        try:
            output, _ = runner.communicate(timeout=100)
        except subprocess.TimeoutExpired:
            runner.kill()
            _unless_unplanned(sentinel_set)
            pytest.fail(_unfinished(client, tmp_path / "logs" / "run.log", processes, sentinel_set))
        faults.join(30)
        _unless_unplanned(sentinel_set)
        elapsed = time.monotonic() - started
        assert runner.returncode == 0, processes.logs()[-3000:]
        assert len(failovers) == 2, "both faults happened before the experiment ended"
        experiment_id = json.loads(output)["experimentId"]

        master = sentinel_set.master()
        sentinel_set.wait_settled(master)  # the killed master came back as a replica; the paused one was demoted
        old = [node for node in sentinel_set.nodes if node is not master]
        assert [node.role() for node in old] == ["slave", "slave"]

        store = EventStore(client, experiment_id)
        head = store.head()
        wait_until(lambda: ViewStore(client, experiment_id).position() == head, 30, what="the projector to catch up")
        views = ViewStore(client, experiment_id)
        trials = views.trials()
        views_of = {trial.id for trial in trials}
        entries = [e.event for e in store.read() if isinstance(e, StoredEvent)]
        logged: Counter[tuple[str, str, int]] = Counter(
            (e.trial_id, str(e.metric_type), e.sequence) for e in entries if isinstance(e, TrialMetricReported)
        )
        recorded: Counter[tuple[str, str, int]] = Counter()  # what the trials wrote on their side
        runs: dict[str, list[tuple[int, int]]] = {}
        for path in records.iterdir():
            lines = [line.split() for line in path.read_text().splitlines()]
            recorded.update((path.name, kind, int(value)) for kind, value in lines if kind in ("PERIODICAL", "FINAL"))
            starts, ends = [int(v) for k, v in lines if k == "start"], [int(v) for k, v in lines if k == "end"]
            runs[path.name] = list(zip(starts, ends, strict=False))

        assert len(trials) == TRIALS and all(trial.status.is_terminal for trial in trials)
        ended = {e.trial_id: e.status for e in entries if isinstance(e, TrialEnded)}  # the last end of each
        odd = sorted({trial.id for trial in trials if ended.get(trial.id) != trial.status} | (set(ended) - views_of))
        assert not odd, (
            f"the views disagree with the log on {len(odd)} trials; the first's log:\n{_history(store, odd[0])}"
        )
        lost = recorded - logged
        duplicated = {key: count for key, count in logged.items() if count > 1}
        assert not lost, f"{len(lost)} recorded but not in the log: {sorted(lost)[:5]}"
        assert not duplicated, (
            f"in the log twice: {sorted(duplicated)[:5]}; its trial's log:\n{_history(store, min(duplicated)[0])}"
        )
        assert set(logged) <= set(recorded)
        twice = [trial for trial, spans in runs.items() if any(b[0] < a[1] for a, b in itertools.pairwise(spans))]
        assert not twice, "a trial ran twice at the same time"
        assert check(client, experiment_id) == []  # what `trialstream replay --check` runs
        attempts_lost = sum(1 for e in entries if isinstance(e, TrialAttemptLost))
        timeouts = int(client.get(keys.REPLICATION_TIMEOUTS) or 0)
        print(
            f"\nfailover in {elapsed:.1f}s: {len(trials)} trials "
            f"({sum(1 for t in trials if t.status == 'SUCCEEDED')} succeeded), {sum(recorded.values())} metrics "
            f"recorded by the trials, {sum(logged.values())} in the log, {len(failovers)} failovers "
            f"(master lost -> new master named: {', '.join(f'{s:.1f}s' for s in failovers)}), lost {len(lost)}, "
            f"duplicated {len(duplicated)}, attempts lost {attempts_lost}, appends sent again {timeouts}"
        )
    finally:
        processes.stop()


def _unfinished(client: redis.Redis, run_log: Path, processes: Processes, sentinels: SentinelSet) -> str:
    """Why the experiment did not end: its trials by status, the logs of those that had not ended (and of those
    whose submission a worker could not find), what the sentinels decided, what the runner and services said."""
    experiment_id = str(client.zrange(keys.EXPERIMENTS, 0, -1)[0])
    trials = ViewStore(client, experiment_id).trials()
    waiting = [trial.id for trial in trials if not trial.status.is_terminal]
    counts = Counter(str(trial.status) for trial in trials)
    store = EventStore(client, experiment_id)
    submitted = [
        e.event.trial_id for e in store.read() if isinstance(e, StoredEvent) and e.event.type == "TrialSubmitted"
    ]
    unfound = sorted(set(re.findall(r"trial (\w+) of experiment \w+ has no submission", processes.logs())))
    histories = "\n\n".join(f"{trial_id}:\n{_history(store, trial_id)}" for trial_id in [*waiting[:3], *unfound[:2]])
    return (
        f"the experiment did not end: {dict(counts)} ({len(trials)} trials in the views, {len(submitted)} submitted "
        f"in the log, {len(set(submitted))} different); not ended:\n{histories}\n"
        f"the sentinels decided:\n{_decisions(sentinels)}\n"
        f"the runner said:\n{run_log.read_text()[-3000:]}\nthe services said:\n{processes.logs()[-3000:]}"
    )


def _switches(sentinels: SentinelSet) -> list[str]:
    """Every change of master the sentinels made, `old -> new`, each once (each sentinel logs each it learns)."""
    switches: dict[str, None] = {}
    for sentinel in sentinels.sentinels:
        log = sentinel.directory / "redis.log"
        for line in (log.read_text(errors="replace") if log.exists() else "").splitlines():
            if "+switch-master" in line:
                old_port, new_port = line.split()[-3], line.split()[-1]
                switches[f"{old_port} -> {new_port}"] = None
    return list(switches)


def _unless_unplanned(sentinels: SentinelSet) -> None:
    """A third change of master is the sentinels taking a live master for dead (load): writes a replica of the
    deposed master confirmed meanwhile are lost by Sentinel's design (README, "What is not"), so the test's
    guarantees do not hold for that run: it is skipped, saying so, rather than failed or passed."""
    switches = _switches(sentinels)
    if len(switches) > 2:
        pytest.skip(
            f"an unplanned failover: the sentinels changed master {len(switches)} times ({', '.join(switches)})"
        )


def _decisions(sentinels: SentinelSet) -> str:
    """Each sentinel's failover events (down, promotion, switch) and each data node's role now."""
    marks = ("+sdown master", "+odown", "+try-failover", "+selected-slave", "+promoted-slave", "+switch-master")
    lines = []
    for sentinel in sentinels.sentinels:
        log = sentinel.directory / "redis.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        lines += [f"{sentinel.port}: {line}" for line in text.splitlines() if any(mark in line for mark in marks)]
    roles = ", ".join(f"{node.port} {node.role()}" for node in sentinels.nodes)
    return "\n".join([*lines[-40:], f"roles now: {roles}"])


def _history(store: EventStore, trial_id: str) -> str:
    """A trial's events, one line each: what a failure shows, to tell which fault did what."""
    events = [e for e in store.read() if isinstance(e, StoredEvent) and getattr(e.event, "trial_id", None) == trial_id]
    return "\n".join(f"{entry.id} {entry.event.model_dump_json()[:300]}" for entry in events)


def _faults(client: redis.Redis, sentinels: SentinelSet, failovers: list[float]) -> None:
    """SIGKILL the master after KILL_AFTER ended trials (and bring it back as a replica once replaced); SIGSTOP
    the new master after PAUSE_AFTER, until the sentinels name another and have moved its replicas there, then
    SIGCONT it.

    Resumed sooner, the paused master would still have a replica of its own, which would confirm (WAIT) the
    writes queued for it while it was paused, and then resync from the new master: acknowledged, then lost. That
    is Sentinel's design, not something an append can prevent (README, "What is not").
    """
    experiments = wait_until(lambda: cast(list[str], client.zrange(keys.EXPERIMENTS, 0, -1)), 30, what="the experiment")
    store = EventStore(client, str(experiments[0]))
    ended: set[str] = set()
    position = "0-0"

    def until_ended(count: int) -> None:
        nonlocal position
        while len(ended) < count:
            for entry in store.wait(position, block_ms=200):
                position = entry.id
                if isinstance(entry, StoredEvent) and isinstance(entry.event, TrialEnded):
                    ended.add(entry.event.trial_id)

    until_ended(KILL_AFTER)
    first = sentinels.master()
    first.kill()
    failovers.append(_replaced(sentinels, first))
    first.start(("--replicaof", "127.0.0.1", str(sentinels.master().port)))  # back, as a replica of the new one
    until_ended(PAUSE_AFTER)
    second = sentinels.master()
    second.signal(signal.SIGSTOP)
    try:
        failovers.append(_replaced(sentinels, second))
        new = sentinels.master()
        others = {node.port for node in sentinels.nodes if node not in (new, second)}
        wait_until(lambda: others <= new.replicas_online(), 30, interval=0.05, what="the replicas moved")
    finally:
        second.signal(signal.SIGCONT)


def _replaced(sentinels: SentinelSet, old: RedisProcess) -> float:
    """Seconds until the sentinels name a master other than `old`."""
    lost = time.monotonic()
    wait_until(lambda: sentinels.master() is not old, 30, interval=0.05, what=f"a failover from {old.port}")
    return time.monotonic() - lost
