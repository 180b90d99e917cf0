"""Soak: a 500-trial experiment, 20 metrics each, while a random worker is SIGKILLed every 40 ended trials.

The kills follow progress, not the clock, so there are as many on a fast machine as on a slow one.

The runner is the real `trialstream run` against this Redis; workers and the projector are real
processes. At the end: every trial terminal, every metric in the views exactly once, and the live
views equal a replay of the log.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import cast

import pytest
import redis

from core import keys
from core.event_store import EventStore, StoredEvent
from manager.replay import check
from manager.views import ViewStore
from schemas.events import Event, TrialAttemptLost, TrialEnded, TrialMetricReported
from tests.conftest import REPO, Processes, wait_until

TRIALS = 500
METRICS = 20
WORKERS = 6
KILL_EVERY = 40  # ended trials between two kills
KILLS = (TRIALS - 1) // KILL_EVERY  # each bound to happen before the last trial ends
ENV = {"TRIALSTREAM_TRIAL_LEASE_S": "1"}  # a lost attempt is retried after about one lease plus 6 s

# NNI's stdout wire format from a shell loop: a trial costs a fork, not a Python start-up.
TRIAL = f"""
i=0
while [ $i -lt {METRICS - 1} ]; do
  echo "NNISDK_MEb'{{\\"parameter_id\\": 0, \\"type\\": \\"PERIODICAL\\", \\"sequence\\": $i, \\"value\\": \\"$i\\"}}'"
  i=$((i + 1))
done
echo "NNISDK_MEb'{{\\"parameter_id\\": 0, \\"type\\": \\"FINAL\\", \\"sequence\\": 0, \\"value\\": \\"1.5\\"}}'"
"""


def trial_ended_by(event: Event) -> str | None:
    """The trial this event ends for good (a lost attempt that is retried ends nothing)."""
    if isinstance(event, TrialEnded) or (isinstance(event, TrialAttemptLost) and event.status != "WAITING"):
        return event.trial_id
    return None


@pytest.mark.timeout(180)
def test_soak_with_random_worker_kills(tmp_path: Path, processes: Processes, redis_url: str, client: redis.Redis):
    (tmp_path / "trial.sh").write_text(TRIAL)
    config = {
        "trialCommand": "sh trial.sh",
        "trialCodeDirectory": str(tmp_path),
        "trialConcurrency": WORKERS,
        "maxTrialNumber": TRIALS,
        "maxTrialRetries": 5,
        "searchSpace": {"x": {"_type": "randint", "_value": [0, 1000]}},
        "tuner": {"name": "Random", "classArgs": {"seed": 3}},
        "trainingService": {"platform": "local"},
        "experimentWorkingDirectory": str(tmp_path / "experiments"),
    }
    (tmp_path / "config.yml").write_text(json.dumps(config))
    processes.projector()
    workers = [processes.worker(env=ENV) for _ in range(WORKERS)]
    runner = subprocess.Popen(
        [sys.executable, "-m", "manager.cli", "--redis", redis_url, "run", str(tmp_path / "config.yml"), "--json"],
        cwd=REPO,
        env={**os.environ, **ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )

    kills = 0
    stop = threading.Event()
    chaos = random.Random(11)

    def kill_as_trials_end() -> None:
        """Tail the log; each time another KILL_EVERY trials have ended, SIGKILL a random worker."""
        nonlocal kills
        experiments = wait_until(
            lambda: cast(list[str], client.zrange(keys.EXPERIMENTS, 0, -1)), 30, what="the experiment"
        )
        store = EventStore(client, str(experiments[0]))
        ended: set[str] = set()
        position = "0-0"
        while kills < KILLS and not stop.is_set():
            for entry in store.wait(position, block_ms=200):
                position = entry.id
                if isinstance(entry, StoredEvent) and (trial_id := trial_ended_by(entry.event)):
                    ended.add(trial_id)
            while kills < KILLS and len(ended) >= (kills + 1) * KILL_EVERY:
                victim = workers.pop(chaos.randrange(len(workers)))
                victim.send_signal(signal.SIGKILL)
                victim.wait()
                kills += 1
                workers.append(processes.start("worker", "--platform", "local", env=ENV))  # a replacement

    killer = threading.Thread(target=kill_as_trials_end, daemon=True)
    killer.start()
    started = time.monotonic()
    try:
        output, _ = runner.communicate(timeout=150)
        killer.join(30)  # the last threshold is crossed before the last trial ends
    finally:
        stop.set()
        killer.join()
        if runner.poll() is None:
            runner.kill()
    elapsed = time.monotonic() - started
    assert runner.returncode == 0
    experiment_id = json.loads(output)["experimentId"]

    store = EventStore(client, experiment_id)
    head = store.head()
    wait_until(lambda: ViewStore(client, experiment_id).position() == head, 30, what="the projector to catch up")
    views = ViewStore(client, experiment_id)
    trials = views.trials()
    entries = store.read()
    logged = Counter(
        (e.event.trial_id, e.event.attempt, e.event.parameter_id, e.event.metric_type, e.event.sequence)
        for e in entries
        if isinstance(e, StoredEvent) and isinstance(e.event, TrialMetricReported)
    )
    lost = [e.event for e in entries if isinstance(e, StoredEvent) and isinstance(e.event, TrialAttemptLost)]

    assert len(trials) == TRIALS
    assert all(trial.status.is_terminal for trial in trials)
    assert max(logged.values()) == 1  # each metric appended once, however often it was retried
    projected = Counter(
        (m.trial_job_id, m.attempt, m.parameter_id, m.type, m.sequence) for t in trials for m in views.metrics(t.id)
    )
    assert projected == logged  # none lost, none counted twice
    succeeded = [trial for trial in trials if trial.status == "SUCCEEDED"]
    for trial in succeeded:
        final_attempt = [m for m in views.metrics(trial.id) if m.attempt == trial.attempt]
        assert sorted(m.sequence for m in final_attempt if m.type == "PERIODICAL") == list(range(METRICS - 1))
        assert [m.type for m in final_attempt].count("FINAL") == 1
    assert check(client, experiment_id) == []
    assert kills == KILLS

    print(
        f"\nsoak in {elapsed:.0f}s: {len(trials)} trials ({len(succeeded)} succeeded), {len(entries)} events, "
        f"{sum(logged.values())} metrics, {kills} workers killed, {len(lost)} attempts lost and "
        f"{sum(1 for e in lost if e.status == 'WAITING')} retried"
    )
