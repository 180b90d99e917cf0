"""NNI 3.0 against trialstream: the same experiment, started from scratch by each system's own command.

Both run 40 trials of the benchmark trial (`trials/trial.py nni`, the real `nni` package), 4 at a time, with a
seeded Random tuner on the local platform. Besides the wall time, each trial's own record (`bench.json`: the
parameters it really received) is compared with the parameters the system reports for it: a service that shows
one trial's parameters next to another trial's metric misleads every analysis built on it.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench import nnictl
from bench.harness import (
    NNI_TRIAL,
    SEARCH_SPACE,
    TRIALS_DIR,
    Figure,
    Section,
    median_of,
    repeat,
    trialstream_run,
)
from bench.nnictl import NniError
from core.variables import REDIS_URL_ENV

TRIALS = 40
CONCURRENCY = 4
SEED = 7
DEADLINE_S = 300.0
POLL_S = 0.2


@dataclass(frozen=True)
class Outcome:
    """One system's run: wall time, trials whose reported parameters are not the ones they ran with."""

    wall_s: float
    attribution_errors: int
    remarks: tuple[str, ...] = ()


def experiment_config(directory: Path, name: str, **overrides: Any) -> Path:
    """The NNI v2 YAML both systems run; each run gets its own experiment directory, so it starts from scratch.
    `overrides` are NNI keys (camelCase): the remote group runs the same experiment on its hosts."""
    config: dict[str, Any] = {
        "experimentName": name,
        "trialCommand": NNI_TRIAL,
        "trialCodeDirectory": str(TRIALS_DIR),
        "trialConcurrency": CONCURRENCY,
        "maxTrialNumber": TRIALS,
        "searchSpace": SEARCH_SPACE,
        "tuner": {"name": "Random", "classArgs": {"seed": SEED}},
        "trainingService": {"platform": "local"},
        "experimentWorkingDirectory": str(directory / "experiments"),
        **overrides,
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def reported_parameters(hyper_parameters: Any) -> Any:
    """The parameters a system shows for a trial: NNI gives a list of JSON strings (the last is current),
    trialstream's `--json` the parameters themselves."""
    if isinstance(hyper_parameters, list):
        hyper_parameters = hyper_parameters[-1]
    if isinstance(hyper_parameters, str):
        return json.loads(hyper_parameters)["parameters"]
    return hyper_parameters


def attribution_errors(trials: Iterable[tuple[Iterable[Path], Any]]) -> tuple[int, list[str]]:
    """Count trials whose record (in the first of their candidate directories holding one) disagrees with the
    parameters reported for them; a trial with no record counts too, as it cannot be checked."""
    errors, missing = 0, 0
    for directories, parameters in trials:
        record = next((d / "bench.json" for d in directories if (d / "bench.json").is_file()), None)
        if record is None:
            missing += 1
        elif json.loads(record.read_text())["parameters"] != parameters:
            errors += 1
    return errors + missing, [f"{missing} trials left no bench.json"] if missing else []


def trial_directory(log_path: str) -> Path:
    """NNI gives a trial's directory as a path or as a file URL (`file://host/path`, `file://localhost:/path`)."""
    return Path(urllib.parse.urlparse(log_path).path if log_path.startswith("file://") else log_path)


def run_nni(directory: Path, name: str) -> Outcome:
    """`nnictl create` -> DONE, then check attribution; the experiment is always stopped and its processes reaped."""
    config = experiment_config(directory, name)
    experiment = nnictl.run(config, TRIALS, DEADLINE_S, POLL_S)
    jobs, remarks = experiment.jobs, experiment.remarks
    experiment_dir = directory / "experiments" / experiment.id
    errors, more = attribution_errors(
        (
            [
                trial_directory(job.get("logPath", "")),
                experiment_dir / "trials" / job["trialJobId"],
                experiment_dir / "environments" / "local-env" / "trials" / job["trialJobId"],
            ],
            reported_parameters(job["hyperParameters"]),
        )
        for job in jobs
    )
    failed = sum(job["status"] != "SUCCEEDED" for job in jobs)
    remarks += more + ([f"{failed} trials did not succeed"] if failed else [])
    return Outcome(experiment.wall_s, errors, tuple(remarks))


def run_trialstream(directory: Path, name: str) -> Outcome:
    """`trialstream run CONFIG --json` in embedded mode, launch -> exit, then check attribution."""
    config = experiment_config(directory, name)
    env = {key: value for key, value in os.environ.items() if key != REDIS_URL_ENV}
    result, wall_s, _, remarks = trialstream_run(config, directory / "trialstream.stderr", env, DEADLINE_S)
    trials_dir = directory / "experiments" / result["experimentId"] / "trials"
    errors, more = attribution_errors(
        ([trials_dir / trial["id"]], reported_parameters(trial["hyperParameters"])) for trial in result["trials"]
    )
    failed = sum(trial["status"] != "SUCCEEDED" for trial in result["trials"])
    if len(result["trials"]) != TRIALS:
        more.append(f"{len(result['trials'])} trials instead of {TRIALS}")
    remarks += more + ([f"{failed} trials did not succeed"] if failed else [])
    return Outcome(wall_s, errors, tuple(remarks))


def trial_cpu_seconds(directory: Path, samples: int = 3) -> tuple[float, float] | None:
    """(wall, CPU) seconds of the trial command alone, median of `samples`, None if it fails (no `nni`): with
    `import nni` most of a trial is CPU, so on a machine with few cores the trials themselves bound both systems."""
    sys_dir = directory / "bare-trial"
    (sys_dir / ".nni").mkdir(parents=True, exist_ok=True)
    value = {"parameter_id": 0, "parameter_source": "algorithm", "parameters": {"x": 0.5, "y": 1}, "parameter_index": 0}
    (sys_dir / "parameter.cfg").write_text(json.dumps(value))
    env = {**os.environ, "NNI_PLATFORM": "local", "NNI_SYS_DIR": str(sys_dir), "NNI_OUTPUT_DIR": str(sys_dir)}
    env.update(NNI_TRIAL_JOB_ID="bare0", NNI_EXP_ID="bare", NNI_TRIAL_SEQ_ID="0")
    walls, cpus = [], []
    for _ in range(samples):
        before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        trial = subprocess.run(["/bin/sh", "-c", NNI_TRIAL], cwd=TRIALS_DIR, env=env, capture_output=True, check=False)
        if trial.returncode != 0:
            return None
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        walls.append(time.perf_counter() - started)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return median_of(walls), median_of(cpus)


def describe(system: str, outcome: Outcome | str) -> str:
    if isinstance(outcome, str):
        return f"      {system}: failed: {outcome}"
    extra = "".join(f"; {remark}" for remark in outcome.remarks)
    return f"      {system}: {outcome.wall_s:.1f}s, {outcome.attribution_errors} attribution errors{extra}"


def run(root: Path, runs: int) -> Section:
    section = Section("NNI 3.0 versus trialstream", "python -m bench --only nni")
    nni_missing = shutil.which("nnictl") is None

    def measure(index: int) -> tuple[Outcome | str, Outcome]:
        nni: Outcome | str = "nnictl is not on PATH"
        if not nni_missing:
            try:
                nni = run_nni(root / "nni" / f"run{index}", f"nni-run{index}")
            except (NniError, OSError, ValueError, KeyError, subprocess.SubprocessError) as error:
                nni = f"{type(error).__name__}: {error}"
        print(describe("NNI", nni), flush=True)
        trialstream = run_trialstream(root / "trialstream" / f"run{index}", f"trialstream-run{index}")
        print(describe("trialstream", trialstream), flush=True)
        return nni, trialstream

    bare_trial = trial_cpu_seconds(root)
    if bare_trial is not None:
        print(
            f"  the trial command alone: {bare_trial[0]:.2f} s wall, {bare_trial[1]:.2f} s CPU (median of 3)",
            flush=True,
        )
    results = repeat(runs, measure)
    nni_runs = [nni for nni, _ in results if isinstance(nni, Outcome)]
    nni_failures = list(dict.fromkeys(nni for nni, _ in results if isinstance(nni, str)))
    ts_runs = [trialstream for _, trialstream in results]

    nni_s = median_of([outcome.wall_s for outcome in nni_runs]) if nni_runs else None
    ts_s = median_of([outcome.wall_s for outcome in ts_runs])
    per_run = ", ".join(f"{outcome.wall_s:.1f}" for outcome in nni_runs)
    stops = "; ".join(remark for outcome in nni_runs for remark in outcome.remarks if remark.startswith("nnictl stop"))
    section.add(
        Figure(
            f"NNI: {TRIALS} trials at concurrency {CONCURRENCY}, wall time",
            nni_s,
            "s",
            detail=f"median of {per_run} s; excludes stopping the experiment ({stops})" if nni_runs else "",
        ),
        Figure(
            f"trialstream: {TRIALS} trials at concurrency {CONCURRENCY}, wall time",
            ts_s,
            "s",
            f"<= {0.8 * nni_s:.1f}" if nni_s is not None else "",
            detail=f"median of {', '.join(f'{outcome.wall_s:.1f}' for outcome in ts_runs)} s; includes stopping "
            "its Redis, projector and workers",
        ),
        Figure("trialstream / NNI wall time", ts_s / nni_s if nni_s else None, "", "<= 0.8"),
        Figure("NNI throughput", TRIALS / nni_s * 60 if nni_s else None, "trials/min"),
        Figure("trialstream throughput", TRIALS / ts_s * 60, "trials/min"),
        Figure(
            "NNI parameter attribution errors (max over runs)",
            max(outcome.attribution_errors for outcome in nni_runs) if nni_runs else None,
            f"of {TRIALS} trials",
            detail="per run: " + ", ".join(str(outcome.attribution_errors) for outcome in nni_runs) if nni_runs else "",
        ),
        Figure(
            "trialstream parameter attribution errors (max over runs)",
            max(outcome.attribution_errors for outcome in ts_runs),
            f"of {TRIALS} trials",
            "<= 0",
            detail="per run: " + ", ".join(str(outcome.attribution_errors) for outcome in ts_runs),
        ),
    )
    section.notes.append(
        f"The same NNI v2 experiment under each system, alternating NNI then trialstream, runs: {runs}; "
        f"{TRIALS} trials, trialConcurrency {CONCURRENCY}, Random tuner (seed {SEED}), local platform, trial "
        f"`{NNI_TRIAL}` (the real `nni` package) in bench/trials. Each run starts from scratch in a new experiment "
        "directory, and each system starts its own servers: `nnictl create` starts NNI's manager (Node.js) and "
        f"tuner dispatcher, `trialstream run` (embedded: no {REDIS_URL_ENV}) its private redis-server, projector "
        f"and {CONCURRENCY} workers plus a spare."
    )
    section.notes.append(
        "NNI's time runs from launching `nnictl create` to `check-status` saying DONE (or all trials terminal in "
        "`trial-jobs`), polled every 0.2 s; `nnictl create` returns once the manager is up, the experiment going on "
        "in the background, and `nnictl stop` (not timed in) takes several seconds more. trialstream's runs from "
        "launch to exit of `python -m manager.cli run CONFIG --json` (the `trialstream` command of this checkout), "
        "its own shutdown included."
    )
    section.notes.append(
        "A parameter attribution error is a trial whose parameters as the system reports them (NNI: the last of its "
        "`hyperParameters` in `/trial-jobs`; trialstream: `hyperParameters` in `--json`) differ from those the trial "
        "received and recorded in bench.json in its own directory (or a trial that left no record). NNI 3.0's local "
        "training service (nni_node/training_service/v3/compat.js) queues the tuner's parameters and hands the next "
        "one to whichever trial asks first, not to the trial it was submitted for, so trials that start together "
        "often get each other's parameters while the API and web UI show the intended ones (microsoft/nni#5726): "
        "their metrics are then shown against parameters they did not run with. NNI puts trial directories under "
        "<experimentWorkingDirectory>/<id>/environments/local-env/trials/<trial>, and every experiment stays "
        "registered in ~/nni-experiments/.experiment."
    )
    cores = os.cpu_count() or 1
    section.notes.append(
        (
            f"The trial command alone takes {bare_trial[0]:.2f} s, {bare_trial[1]:.2f} s of it CPU (mostly `import "
            f"nni`), so on this machine's {cores} cores {TRIALS} trials need at least "
            f"{TRIALS * bare_trial[1] / cores:.0f} s whatever runs them: where that floor is near NNI's time, no "
            "service can be much faster, and a busy machine slows both. "
            if bare_trial is not None
            else f"The trial command alone fails here (`{NNI_TRIAL}` in bench/trials): is `nni` installed? "
        )
        + "NNI's manager looks for ended trials, and so fills freed slots, every 0.5 s on the local platform "
        "(`pollInterval` in nni_node/core/nnimanager.js)."
    )
    for failure in nni_failures:
        section.notes.append(f"An NNI run failed and is left out of the NNI figures: {failure}")
    if not nni_runs:
        section.notes.append("NNI could not run here, so its figures and the comparison are n/a.")
    remarks = {remark for outcome in (*nni_runs, *ts_runs) for remark in outcome.remarks}
    section.notes += sorted(remark for remark in remarks if not remark.startswith("nnictl stop"))
    return section
