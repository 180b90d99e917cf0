"""Trial overhead: how long the service takes to start a trial, to record its end, and to refill a slot.

Trials are the dependency-free benchmark trial (`trials/trial.py trialstream_sdk`), so almost all of a
trial's time is the service's own plus the Python start-up that any trial pays.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from bench.harness import SDK_TRIAL, TRIALS_DIR, BenchStack, Figure, Section, median_of, percentile, repeat, stream_ms
from core.event_store import StoredEvent
from manager.config import load_experiment_config
from manager.runner import ExperimentRunner
from manager.training_service import TrainingService
from schemas.events import TrialEnded, TrialStarted, TrialSubmitted
from schemas.trial import HyperParameters, JobApplicationForm

PROBES = 30
WORKERS = 5  # as `trialstream run` starts for trialConcurrency 4: one per slot and a spare
TRIALS = 40
SLEEP_TRIAL = "sleep 0.05"


def form(sequence_id: int, parameters: dict[str, object]) -> JobApplicationForm:
    value = json.dumps(
        {"parameter_id": sequence_id, "parameter_source": "algorithm", "parameters": parameters, "parameter_index": 0}
    )
    return JobApplicationForm(sequence_id=sequence_id, hyper_parameters=HyperParameters(value=value))


def idle_service(stack: BenchStack, name: str, **overrides: object) -> TrainingService:
    """A TrainingService for a new experiment whose trials nobody but the caller submits;
    `overrides` are NNI config keys."""
    config = load_experiment_config(stack.experiment_config(name, **overrides))
    return ExperimentRunner.create(config, stack.client, stack.rq_connection).service


def bare_trial_seconds(root: Path, samples: int = 15) -> float:
    """Median wall time of the trial command run directly, as a local trial but with no service around it."""
    sys_dir = root / "bare-trial"
    (sys_dir / ".nni").mkdir(parents=True, exist_ok=True)
    (sys_dir / "parameter.cfg").write_text(form(0, {"x": 0.5, "y": 1}).hyper_parameters.value)
    env = {**os.environ, "NNI_PLATFORM": "local", "NNI_SYS_DIR": str(sys_dir), "NNI_OUTPUT_DIR": str(sys_dir)}
    env.update(NNI_TRIAL_JOB_ID="bare0", NNI_EXP_ID="bare", NNI_TRIAL_SEQ_ID="0")
    durations = []
    for _ in range(samples):
        started = time.perf_counter()
        subprocess.run(["/bin/sh", "-c", SDK_TRIAL], cwd=TRIALS_DIR, env=env, check=True)
        durations.append(time.perf_counter() - started)
    return median_of(durations)


def probe_latencies(service: TrainingService, count: int) -> tuple[list[float], list[float]]:
    """Submit trials one at a time to idle workers; (submit -> RUNNING, trial exit -> terminal) in ms.

    Both are seen the way a client sees them: by blocking on the log, on which get_trial_job reads.
    """
    store = service.store
    to_running, to_terminal = [], []
    for sequence_id in range(count):
        cursor = store.head()
        submitted_at = time.time()
        trial = service.submit_trial_job(form(sequence_id, {"x": sequence_id / count, "y": 1}))
        running_at = ended_at = None
        while ended_at is None:
            for entry in store.wait(cursor, block_ms=5000):
                cursor = entry.id
                if not isinstance(entry, StoredEvent) or getattr(entry.event, "trial_id", None) != trial.id:
                    continue
                if isinstance(entry.event, TrialStarted):
                    running_at = time.time()
                elif isinstance(entry.event, TrialEnded):
                    ended_at = time.time()
        assert running_at is not None
        exited_at = json.loads((Path(trial.working_directory) / "bench.json").read_text())["exit"]
        to_running.append((running_at - submitted_at) * 1000)
        to_terminal.append((ended_at - exited_at) * 1000)
    return to_running, to_terminal


def slot_refills_ms(service: TrainingService, concurrency: int) -> list[float]:
    """From the log: a trial ends -> the trial submitted to take its slot is RUNNING (stream-id times, 1 ms steps)."""
    last_ended_ms = 0
    trigger: dict[str, int] = {}
    refills = []
    for entry in service.store.read():
        if not isinstance(entry, StoredEvent):
            continue
        event = entry.event
        if isinstance(event, TrialEnded):
            last_ended_ms = stream_ms(entry.id)
        elif isinstance(event, TrialSubmitted) and event.form.sequence_id >= concurrency:
            trigger[event.trial_id] = last_ended_ms
        elif isinstance(event, TrialStarted) and event.trial_id in trigger:
            refills.append(float(stream_ms(entry.id) - trigger.pop(event.trial_id)))
    return refills


PATH_STEPS = (
    "trial ends -> the next one submitted (TrialEnded -> TrialSubmitted: the runner's wake, the tuner, one MULTI)",
    "a worker picks it up and launches it (TrialSubmitted -> TrialStarted)",
    "launched -> the trial exits, less the trial command alone",
    "the trial exits -> its end in the log (exit -> TrialEnded)",
)


def path_ms(service: TrainingService, bare_ms: float) -> dict[str, list[float]]:
    """One trial's path at concurrency 1, step by step (ms), for every trial but the first: from the log's
    times (1 ms steps) and the moment each trial recorded it exits (bench.json)."""
    steps: dict[str, list[float]] = {step: [] for step in PATH_STEPS}
    marks: dict[str, float] = {}
    directories: dict[str, str] = {}
    for entry in service.store.read():
        if not isinstance(entry, StoredEvent):
            continue
        event, at = entry.event, float(stream_ms(entry.id))
        if isinstance(event, TrialSubmitted):
            directories[event.trial_id] = event.working_directory
        if isinstance(event, TrialEnded):
            exited_ms = json.loads((Path(directories[event.trial_id]) / "bench.json").read_text())["exit"] * 1000
            if "started" in marks:
                steps[PATH_STEPS[2]].append(exited_ms - marks["started"] - bare_ms)
                steps[PATH_STEPS[3]].append(at - exited_ms)
            marks = {"ended": at}
        elif isinstance(event, TrialSubmitted) and "ended" in marks:
            marks["submitted"] = at
            steps[PATH_STEPS[0]].append(at - marks["ended"])
        elif isinstance(event, TrialStarted) and "submitted" in marks:
            marks["started"] = at
            steps[PATH_STEPS[1]].append(at - marks["submitted"])
    return steps


def refill_run(
    stack: BenchStack, name: str, concurrency: int, **overrides: object
) -> tuple[float, list[float], TrainingService]:
    """An experiment of `TRIALS` trials at `concurrency`: its wall time (s), its slot refills (ms), its service;
    `overrides` are NNI config keys."""
    config = stack.experiment_config(name, trialConcurrency=concurrency, maxTrialNumber=TRIALS, **overrides)
    result, wall_s = stack.run_experiment(config)
    assert all(trial.status == "SUCCEEDED" for trial in result.trials), "a benchmark trial failed"
    service = TrainingService(stack.client, stack.rq_connection, result.experiment_id)
    return wall_s, slot_refills_ms(service, concurrency), service


def concurrency_4_refill(stack: BenchStack, runs: int, where: str) -> Figure:
    """The slot refill at concurrency 4 on another set-up of the stack, with the benchmark's trial."""
    results = repeat(runs, lambda index: refill_run(stack, f"c4{index}", 4))
    return Figure(
        f"slot refill at concurrency 4, {where}, p50",
        median_of([percentile(samples, 50) for _, samples, _ in results]),
        "ms",
    )


def run(root: Path, runs: int) -> Section:
    section = Section("Trial overhead", "python -m bench --only overhead")
    with BenchStack(root / "always", workers=WORKERS) as stack:
        bare_s = bare_trial_seconds(stack.root)
        print(f"  the trial command alone: {bare_s * 1000:.1f} ms (median of 15)", flush=True)

        probes = repeat(runs, lambda index: probe_latencies(idle_service(stack, f"probe{index}"), PROBES))
        for label, samples in (
            ("submit -> RUNNING", [p[0] for p in probes]),
            ("trial exit -> terminal", [p[1] for p in probes]),
        ):
            section.add(
                Figure(f"{label} p50", median_of([percentile(s, 50) for s in samples]), "ms", "<= 20"),
                Figure(f"{label} p99", median_of([percentile(s, 99) for s in samples]), "ms", "<= 100"),
            )

        bare_before_s: list[float] = []  # the trial command alone, timed right before each run at concurrency 1
        for concurrency in (1, 4):

            def experiment(index: int, concurrency: int = concurrency) -> tuple[float, list[float], TrainingService]:
                if concurrency == 1:
                    bare_before_s.append(bare_trial_seconds(stack.root, samples=9))
                return refill_run(stack, f"c{concurrency}run{index}", concurrency)

            results = repeat(runs, experiment)
            wall_s = median_of([wall for wall, _, _ in results])
            section.add(
                Figure(f"{TRIALS} trials at concurrency {concurrency}: wall time", wall_s, "s"),
                Figure(
                    f"{TRIALS} trials at concurrency {concurrency}: throughput",
                    TRIALS / wall_s * 60,
                    "trials/min",
                    ">= 600" if concurrency == 4 else "",
                ),
                Figure(
                    f"slot refill at concurrency {concurrency} (trial ends -> next RUNNING) p50",
                    median_of([percentile(samples, 50) for _, samples, _ in results]),
                    "ms",
                    "<= 20",
                ),
                Figure(
                    f"slot refill at concurrency {concurrency} p99",
                    median_of([percentile(samples, 99) for _, samples, _ in results]),
                    "ms",
                    "<= 100",
                ),
            )
            if concurrency == 1:
                paired = [(wall, serv, bare) for (wall, _, serv), bare in zip(results, bare_before_s, strict=True)]
                section.add(
                    Figure(
                        "orchestration overhead per trial at concurrency 1",
                        median_of([(wall - TRIALS * bare) / TRIALS * 1000 for wall, _, bare in paired]),
                        "ms",
                        "<= 20",  # issue 29 (it was <= 30)
                        detail=f"per run: (wall - {TRIALS} x the trial command alone, timed just before) / {TRIALS}; "
                        f"alone: {', '.join(f'{bare * 1000:.0f}' for bare in bare_before_s)} ms",
                    )
                )
                paths = [path_ms(service, bare * 1000) for _, service, bare in paired]
                for step in PATH_STEPS:
                    section.add(
                        Figure(
                            f"concurrency 1, one trial's path: {step}, p50",
                            median_of([percentile(path[step], 50) for path in paths]),
                            "ms",
                        )
                    )
        # The same refill with trials that leave the cores to the service: the service's own share of it.
        idle = repeat(runs, lambda index: refill_run(stack, f"c4sleep{index}", 4, trialCommand=SLEEP_TRIAL))
        section.add(
            Figure(
                "slot refill at concurrency 4, trials that sleep (the service's share) p50",
                median_of([percentile(samples, 50) for _, samples, _ in idle]),
                "ms",
                detail=f"`{SLEEP_TRIAL}`: ~1 ms of CPU a trial, where the benchmark trial's Python takes ~100 ms",
            )
        )
    with BenchStack(root / "everysec", workers=WORKERS, appendfsync="everysec") as stack:
        probes = repeat(runs, lambda index: probe_latencies(idle_service(stack, f"probe{index}"), PROBES))
        section.add(
            Figure(
                "submit -> RUNNING p50, Redis with appendfsync everysec",
                median_of([percentile(p[0], 50) for p in probes]),
                "ms",
                detail="the durability cost: every write waits for its fsync under `always`",
            ),
            Figure(
                "submit -> RUNNING p99, Redis with appendfsync everysec",
                median_of([percentile(p[0], 99) for p in probes]),
                "ms",
            ),
        )
        section.add(concurrency_4_refill(stack, runs, "Redis with appendfsync everysec"))
    shared_memory = Path("/dev/shm")
    if shared_memory.is_dir() and os.access(shared_memory, os.W_OK):
        # Redis's AOF and the trials' directories where fsync costs nothing: what the disk adds to the refill.
        with (
            tempfile.TemporaryDirectory(dir=shared_memory) as scratch,
            BenchStack(Path(scratch), workers=WORKERS) as stack,
        ):
            section.add(concurrency_4_refill(stack, runs, "the stack on tmpfs (`appendfsync always`, fsync free)"))
    section.notes.append(
        f"Trials: `{SDK_TRIAL}` (reads its parameters, reports one final metric, exits); alone it takes "
        f"{bare_s * 1000:.0f} ms, most of it Python's start-up."
    )
    return section
