"""Driving NNI 3.0 through `nnictl`, as the `nni` (local) and `remote` groups both do: create an experiment, poll
its REST API until it is done, stop it and make sure nothing of it is left.

nnictl 3.0 imports pkg_resources, which setuptools >= 81 no longer ships; every nnictl call here runs with a
small stand-in for it on its PYTHONPATH where the installed setuptools lacks it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import reap

NNI_TERMINAL = {"SUCCEEDED", "FAILED", "USER_CANCELED", "SYS_CANCELED", "EARLY_STOPPED"}
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STOP_TIMEOUT_S = 60.0


class NniError(RuntimeError):
    """NNI did not run the experiment to its end; the benchmark reports that instead of a time."""


# nnictl 3.0 imports pkg_resources (for `nnictl --version` only); this stand-in, on nnictl's PYTHONPATH alone,
# answers what nnictl asks of it
PKG_RESOURCES_SHIM = """
from importlib import metadata


class ResolutionError(Exception):
    pass


class _Distribution:
    def __init__(self, name):
        try:
            self.version = metadata.version(name)
        except metadata.PackageNotFoundError as error:
            raise ResolutionError(name) from error


def get_distribution(name):
    return _Distribution(name)
"""


def nnictl_environment(scratch: Path) -> dict[str, str]:
    """This environment, plus the pkg_resources stand-in (written under `scratch`) where the installed setuptools
    lacks pkg_resources."""
    environment = dict(os.environ)
    if importlib.util.find_spec("pkg_resources") is None:
        shim = scratch / "pkg_resources_shim"
        shim.mkdir(parents=True, exist_ok=True)
        (shim / "pkg_resources.py").write_text(PKG_RESOURCES_SHIM)
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), environment.get("PYTHONPATH")]))
    return environment


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get_json(port: int, route: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/nni/{route}", timeout=10) as response:
        return json.load(response)


def nni_manager_group(port: int) -> int | None:
    """The process group of the NNI manager serving `port`: it leads one holding the dispatcher and the trials."""
    found = subprocess.run(["pgrep", "-f", f"main.js --port {port} "], capture_output=True, text=True, check=False)
    pids = found.stdout.split()
    return os.getpgid(int(pids[0])) if pids else None


def create(config: Path, port: int, scratch: Path) -> tuple[str, int | None]:
    """`nnictl create` (it returns once the manager is up, the experiment going on in the background); (experiment
    id, the manager's process group). Where it fails, the caller stops what it started by the port's group."""
    created = subprocess.run(
        ["nnictl", "create", "--config", str(config), "--port", str(port)],
        env=nnictl_environment(scratch),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = ANSI.sub("", created.stdout + created.stderr)
    group = nni_manager_group(port)
    match = re.search(r"Experiment ID: (\w+)", output)
    if created.returncode != 0 or match is None:
        raise NniError(f"nnictl create failed ({created.returncode}): {output.strip()[-500:]}")
    return match.group(1), group


def wait_done(port: int, trials: int, deadline_s: float, poll_s: float) -> list[dict[str, Any]]:
    """Poll until NNI says DONE, or until all `trials` are terminal (check-status can lag); its trial jobs."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            status = get_json(port, "check-status")
            if status["status"] == "ERROR":
                raise NniError(f"NNI reports an error: {status.get('errors')}")
            jobs: list[dict[str, Any]] = get_json(port, "trial-jobs")
            if status["status"] == "DONE" or (
                len(jobs) >= trials and all(job["status"] in NNI_TERMINAL for job in jobs)
            ):
                return jobs
        except urllib.error.URLError:
            pass  # the manager is still coming up; the deadline bounds this
        time.sleep(poll_s)
    raise NniError(f"the experiment was not done after {deadline_s:.0f}s")


def stop(experiment_id: str, group: int | None, scratch: Path) -> list[str]:
    """`nnictl stop`, timed (it is no part of any wall time), then make sure nothing of the experiment is left."""
    remarks = []
    if experiment_id:
        started = time.perf_counter()
        stopped = subprocess.run(
            ["nnictl", "stop", experiment_id],
            env=nnictl_environment(scratch),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=STOP_TIMEOUT_S,
            check=False,
        )
        remarks.append(f"nnictl stop took {time.perf_counter() - started:.1f}s (exit {stopped.returncode})")
    if group is not None:
        remarks += reap("-g", group, "NNI")
    return remarks


@dataclass(frozen=True)
class Experiment:
    """One NNI experiment run to its end: its id, trial jobs, launch -> done (s), launch epoch s, remarks."""

    id: str
    jobs: list[dict[str, Any]]
    wall_s: float
    launched: float
    remarks: list[str]


def run(config: Path, trials: int, deadline_s: float, poll_s: float) -> Experiment:
    """`nnictl create` launch -> DONE (`nnictl stop`, not timed in, then nothing of it left here, whatever
    happened); the trial jobs are kept in trial-jobs.json next to the config, the pkg_resources stand-in under the
    config's parent directory."""
    directory, port = config.parent, free_port()
    experiment_id, group = "", None
    remarks: list[str] = []
    launched = time.time()
    started = time.perf_counter()
    try:
        experiment_id, group = create(config, port, directory.parent)
        jobs = wait_done(port, trials, deadline_s, poll_s)
        wall_s = time.perf_counter() - started
        (directory / "trial-jobs.json").write_text(json.dumps(jobs))
    finally:
        remarks += stop(experiment_id, group if group is not None else nni_manager_group(port), directory.parent)
    return Experiment(experiment_id, jobs, wall_s, launched, remarks)
