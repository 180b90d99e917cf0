"""Reads at scale and replay: experiments of 1k, 10k and 100k finished trials (10 events each: submitted,
started, 6 intermediate metrics, a final one, ended), projected from nothing by a real `trialstream projector`.

The logs are written straight into Redis with `redis-cli --pipe`, from one trial's events built and
validated by the schemas, its id and index substituted: running 111k real trials would measure the
trials, not the reads.
"""

from __future__ import annotations

import functools
import json
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness import BenchStack, Figure, Section, median_of, peak_rss_mb, percentile, wait_until
from bench.overhead import form
from core import keys
from core.event_store import EventStore, encode_event
from manager.experiments import create_experiment
from manager.projector import Projector
from manager.training_service import TrainingService
from manager.views import ViewStore
from schemas.events import Event, TrialEnded, TrialLaunchSpec, TrialMetricReported, TrialStarted, TrialSubmitted
from schemas.trial import TrialJobStatus

SIZES = (1_000, 10_000, 100_000)
GETS = 500
LISTS = {1_000: 20, 10_000: 10, 100_000: 3}
SENTINEL_TRIAL, SENTINEL_INDEX = "TRIALID", 987654321

# Run in a fresh interpreter: the memory a manager process needs to list 100k trials.
_LIST_IN_A_PROCESS = """
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from core.connections import connect
from manager.training_service import TrainingService
url, experiment_id = sys.argv[1:]
trials = TrainingService(connect(url), connect(url, decode=False), experiment_id).list_trial_jobs()
status = Path("/proc/self/status").read_text().splitlines()
print(len(trials), next(line.split()[1] for line in status if line.startswith("VmHWM:")))
"""


def trial_events(experiment_id: str, trial_id: str, index: int) -> list[Event]:
    """A finished trial's events: submitted, started, 6 intermediate metrics, a final one, ended."""
    base: dict[str, Any] = {"experiment_id": experiment_id, "trial_id": trial_id}
    directory = f"/bench/{experiment_id}/trials/{trial_id}"
    launch = TrialLaunchSpec(command="python3 trial.py", code_directory="/bench", platform_config={"platform": "local"})
    events: list[Event] = [
        TrialSubmitted(
            **base,
            platform="local",
            form=form(index, {"x": 0.25, "y": 2}),
            working_directory=directory,
            launch=launch,
        ),
        TrialStarted(**base, attempt=1, source="bench:1", working_directory=directory, url=directory),
    ]
    for step in range(7):
        final = step == 6
        events.append(
            TrialMetricReported(
                **base,
                attempt=1,
                source="bench:1",
                parameter_id=str(index),
                metric_type="FINAL" if final else "PERIODICAL",
                sequence=0 if final else step,
                data=json.dumps(json.dumps(0.1 * step)),
            )
        )
    events.append(TrialEnded(**base, attempt=1, source="bench:1", status=TrialJobStatus.SUCCEEDED, exit_code=0))
    return events


def _resp(*parts: str) -> bytes:
    """One command in Redis's wire protocol, for `redis-cli --pipe`."""
    encoded = [part.encode() for part in parts]
    return b"*%d\r\n" % len(encoded) + b"".join(b"$%d\r\n%s\r\n" % (len(part), part) for part in encoded)


def write_log(socket: str, experiment_id: str, trials: int) -> int:
    """Append `trials` finished trials to the experiment's log; returns how many events that is."""
    templates = [encode_event(event) for event in trial_events(experiment_id, SENTINEL_TRIAL, SENTINEL_INDEX)]
    stream = keys.events(experiment_id)
    commands = []
    for index in range(trials):
        trial_id = f"t{index:06d}"
        for fields in templates:
            payload = fields["json"].replace(SENTINEL_TRIAL, trial_id).replace(str(SENTINEL_INDEX), str(index))
            commands.append(_resp("XADD", stream, "*", "type", fields["type"], "trial", trial_id, "json", payload))
    binary = shutil.which("redis-cli")
    if binary is None:
        raise RuntimeError("redis-cli is needed to load the benchmark logs (Debian: redis-tools)")
    subprocess.run([binary, "-s", socket, "--pipe"], input=b"".join(commands), check=True, capture_output=True)
    return len(commands)


def timed_ms(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return (time.perf_counter() - started) * 1000


def read_figures(service: TrainingService, size: int) -> list[Figure]:
    """get_trial_job on random trials, and whole lists, of an experiment of `size` trials, read through
    a TrainingService that has read nothing yet."""
    first_list = timed_ms(service.list_trial_jobs)  # parses every view
    lists = [timed_ms(service.list_trial_jobs) for _ in range(LISTS[size])]  # reuses those still unchanged
    picks = [f"t{random.randrange(size):06d}" for _ in range(GETS)]
    gets = [timed_ms(functools.partial(service.get_trial_job, trial_id)) for trial_id in picks]
    list_target = "<= 100" if size == 10_000 else ""
    return [
        Figure(f"get_trial_job, {size:,} trials: p50", percentile(gets, 50), "ms", "<= 1" if size == 100_000 else ""),
        Figure(f"get_trial_job, {size:,} trials: p99", percentile(gets, 99), "ms"),
        Figure(f"list_trial_jobs, {size:,} trials: a process's first", first_list, "ms", list_target),
        Figure(f"list_trial_jobs, {size:,} trials: later calls", median_of(lists), "ms", list_target),
    ]


def run(root: Path, runs: int) -> list[Section]:
    reads = Section("Reads at scale", "python -m bench --only scale")
    replay = Section("Replay", "python -m bench --only scale")
    with BenchStack(root / "scale", workers=0, projector=False) as stack:
        socket = stack.url.removeprefix("unix://")
        experiments: dict[int, str] = {}
        total = 0
        for size in SIZES:
            experiments[size] = create_experiment(stack.client, {}, stack.root, f"scale{size}")
            total += write_log(socket, experiments[size], size) + 1
        print(f"  wrote {total:,} events", flush=True)

        started = time.perf_counter()
        stack.start_projector()
        heads = {exp: EventStore(stack.client, exp).head() for exp in experiments.values()}
        wait_until(
            lambda: all(ViewStore(stack.client, exp).position() == head for exp, head in heads.items()),
            900,
            "the projector to catch up",
            interval=0.05,
        )
        elapsed = time.perf_counter() - started
        assert stack.projector_pid is not None
        replay.add(
            Figure(
                "full rebuild by `trialstream projector`, from an empty projection",
                total / elapsed,
                "events/s",
                ">= 50000",
                detail=f"{total:,} events ({elapsed:.1f} s, process start included)",
            )
        )
        peak_mb = peak_rss_mb(stack.projector_pid)
        reads.add(Figure("projector peak RSS after projecting them all (111k trials)", peak_mb, "MB", "<= 250"))

        rebuilds = []
        for index in range(runs):
            projector = Projector(stack.client, namespace=f"bench-rebuild-{index}")
            rebuilds.append(timed_ms(functools.partial(projector.rebuild, experiments[10_000])) / 1000)
        replay.add(Figure("rebuild of one experiment of 10k trials (100k events)", median_of(rebuilds), "s"))

        for size in SIZES:
            reads.add(*read_figures(TrainingService(stack.client, stack.rq_connection, experiments[size]), size))
        listed = subprocess.run(
            [sys.executable, "-c", _LIST_IN_A_PROCESS, stack.url, experiments[100_000]],
            capture_output=True,
            text=True,
            check=True,
        )
        count, peak_kb = listed.stdout.split()
        assert int(count) == 100_000
        reads.add(Figure("a manager process listing 100k trials: peak RSS", int(peak_kb) / 1024, "MB"))
    calls = ", ".join(f"{count} ({size:,} trials)" for size, count in LISTS.items())
    reads.notes.append(
        f"get_trial_job: {GETS} calls on random trials. list_trial_jobs: the first call of a TrainingService, "
        f"then the median of {calls} more; later calls reuse the views parsed before while their JSON is "
        "unchanged (up to 20k views), as a CLI or UI polling the list does."
    )
    return [reads, replay]
