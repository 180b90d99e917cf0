"""The compose stack: `up` to healthy, and 200 trivial trials through 1, 2 and 4 worker containers, each
next to the same on bare processes (a `trialstream manager` and workers on this host) in the same run.

Both go through a manager over HTTP with the host's `trialstream --manager URL run`, with the same
config and trial, so the ratio is what the containers cost: Docker's network, overlay file system and
cgroups. The trials start Python with `-S` (no site-packages) next to a copy of the SDK, and the bare
workers find this interpreter's own directory first on PATH: here `python3` is otherwise pyenv's shim,
a shell script that took 95 ms to start Python against 11 ms for the image's, which would be measured
instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest.mock import patch

import httpx
import yaml

from bench.harness import REPO, BenchStack, Figure, Section, median_of, wait_until
from bench.nnictl import free_port
from tests.support.stack import Stack, build_images, docker_missing

WORKER_COUNTS = (1, 2, 4)
TRIALS = 200


def _config(root: Path, workers: int) -> Path:
    """200 trials of the dependency-free trial; twice as many at once as workers, so none waits for work."""
    code = root / "code"
    code.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "bench" / "trials" / "trial.py", code)
    shutil.copy(REPO / "trialstream_sdk.py", code)
    config = {
        "experimentName": f"stack-bench-{workers}",
        "trialCommand": "python3 -S trial.py trialstream_sdk",
        "trialCodeDirectory": str(code),
        "trialConcurrency": 2 * workers,
        "maxTrialNumber": TRIALS,
        "searchSpace": {"x": {"_type": "uniform", "_value": [0, 1]}},
        "tuner": {"name": "Random", "classArgs": {"seed": 7}},
        "trainingService": {"platform": "local"},
    }
    path = root / f"stack-{workers}.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def _experiment_s(url: str, token: str | None, config: Path) -> float:
    """Seconds from `trialstream --manager URL run` to its exit; every trial must have SUCCEEDED."""
    env = {"PATH": "/usr/bin:/bin", **({"TRIALSTREAM_MANAGER_TOKEN": token} if token else {})}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "manager.cli", "--manager", url, "run", str(config), "--json"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=REPO,
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"run exited {done.returncode}: {done.stderr[-1500:]}")
    statuses = {trial["status"] for trial in json.loads(done.stdout)["trials"]}
    if statuses != {"SUCCEEDED"}:
        raise RuntimeError(f"benchmark trials ended {statuses}")
    return seconds


@contextmanager
def _bare(root: Path, workers: int) -> Iterator[str]:
    """A manager and `workers` local workers as processes of this host, on a private redis-server; the
    processes started here inherit PATH with this interpreter's own directory first."""
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    with patch.dict(os.environ, {"PATH": path}), BenchStack(root, workers=workers, projector=False) as stack:
        assert stack.services is not None
        port = free_port()
        stack.services.start("manager", "--port", str(port), "--no-token", log_name="manager")
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _ready(url), 60, "the manager")
        yield url


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/api/v1/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _bare_healthy_s(root: Path) -> float:
    started = time.perf_counter()
    with _bare(root, 2):
        return time.perf_counter() - started


def _stack_healthy_s(stack: Stack) -> float:
    started = time.perf_counter()
    stack.up()
    seconds = time.perf_counter() - started
    stack.down("--volumes", "--timeout", "2")
    return seconds


def run(root: Path, runs: int) -> Section:
    section = Section("The compose stack", "python -m bench --only stack")
    missing = docker_missing()
    if missing:
        section.notes.append(f"Not measured: {missing}.")
        return section
    root.mkdir(parents=True, exist_ok=True)
    build_images(root / "build")
    stack = Stack.create(root, "trialstream-bench")
    try:
        up = median_of([_stack_healthy_s(stack) for _ in range(runs)])
        bare = median_of([_bare_healthy_s(root / f"bare-up-{index}") for index in range(runs)])
        section.add(
            Figure("`docker compose up -d --wait` to healthy (redis, manager, 2 workers)", up, "s"),
            Figure("the same as bare processes (redis-server, manager, 2 workers), to ready", bare, "s"),
        )
        ratios = []
        for workers in WORKER_COUNTS:
            config = _config(root, workers)
            stack.up("--scale", f"worker-local={workers}")
            in_containers = median_of([_experiment_s(stack.url, stack.token, config) for _ in range(runs)])
            stack.down("--volumes", "--timeout", "2")
            with _bare(root / f"bare-{workers}", workers) as url:
                on_host = median_of([_experiment_s(url, None, config) for _ in range(runs)])
            ratios.append(in_containers / on_host)
            section.add(
                Figure(f"{TRIALS} trials, {workers} worker container(s)", TRIALS / in_containers * 60, "trials/min"),
                Figure(f"{TRIALS} trials, {workers} bare worker process(es)", TRIALS / on_host * 60, "trials/min"),
            )
    finally:
        stack.down("--volumes", "--timeout", "2")
    section.notes.append(
        f"Each experiment: {TRIALS} trials of bench/trials/trial.py (the dependency-free SDK), twice as many at once "
        "as workers, submitted with the host's `trialstream --manager URL run` and timed to its exit. Containers "
        f"take {min(ratios):.2f}x to {max(ratios):.2f}x the bare processes' time (1, 2, 4 workers), which is not "
        "Docker's alone: the containers also reach Redis over TCP (the bare processes over a unix socket), run the "
        "image's Python, and run their health checks. The stack is built on the Debian base of "
        "deploy/base-image.sh; its up time excludes the image build and is mostly the health checks' cadence."
    )
    return section
