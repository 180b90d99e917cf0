"""The docker-compose stack, run for real: the real Docker Engine, the real Compose v2, images built here.

No image registry is reachable, so the images are made on this machine: a base from Debian's packages
(deploy/base-image.sh: python3, redis-server, openssh-server) and trialstream's image built on it from
wheels made beforehand (deploy/wheels, so the build itself needs no network). Each test gets a compose
project of its own, on its own network, its manager published on a free port of 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from simulators.waiting import wait_until
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGE = "trialstream-base:bookworm"
TAG = "test"  # trialstream:test, so a developer's own trialstream:latest is left alone
WHEELS = ROOT / "deploy" / "wheels"
# What the image's pip needs beyond the package's own requirements: the build backend, and what
# Debian's Python 3.11.2 needs that the host's newer 3.11 does not (redis-py's async-timeout).
EXTRA_WHEELS = ("setuptools>=68", "wheel", "async-timeout>=4.0.3")
REQUIRE_ENV = "TRIALSTREAM_REQUIRE_DOCKER"  # .ci/run sets it: there a missing engine fails the tests


def docker_missing() -> str | None:
    """Why the stack cannot run here, or None."""
    if shutil.which("docker") is None:
        return "no docker client (scripts/setup.sh --test installs Docker)"
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
    if info.returncode != 0:
        return f"no Docker Engine answers: {info.stderr.strip()[:200]} (scripts/setup.sh --test starts dockerd)"
    compose = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if compose.returncode != 0:
        return "no Compose v2 plugin (scripts/setup.sh --test installs it)"
    return None


def make_wheels() -> None:
    """The image's dependencies as wheels in deploy/wheels (wheels put there by hand stay: pip takes the newest
    that fits). They are made once per pyproject.toml on this machine, kept in the user's cache and linked in:
    a fresh clone (CI's) would spend a minute of CPU making them again, and since wheels built from sources
    differ byte for byte each time, docker's layer cache would then install them all again in the image."""
    made_for = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trialstream" / "image-wheels" / made_for
    if not (cache / ".complete").exists():
        shutil.rmtree(cache, ignore_errors=True)
        command = [sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "-w", str(cache)]
        subprocess.run([*command, f"{ROOT}[nni,s3]", *EXTRA_WHEELS], check=True, capture_output=True, timeout=600)
        for own in cache.glob("trialstream-*.whl"):  # the image builds the package from its sources
            own.unlink()
        (cache / ".complete").touch()
    for wheel in cache.glob("*.whl"):
        if not (WHEELS / wheel.name).exists():
            try:
                os.link(wheel, WHEELS / wheel.name)
            except OSError:  # the cache is on another filesystem
                shutil.copy2(wheel, WHEELS / wheel.name)


def build_images(directory: Path) -> None:
    """The base image (once per machine) and trialstream's image (docker's layer cache makes a rebuild of
    the same sources take seconds), with the compose file's own build section."""
    subprocess.run([str(ROOT / "deploy" / "base-image.sh"), BASE_IMAGE], check=True, timeout=900)
    make_wheels()
    Stack.create(directory, "trialstream-build").compose("build", "--quiet", timeout=900)


def compose_environment() -> dict[str, str]:
    """The compose CLI's environment: nothing of the developer's TRIALSTREAM_* or COMPOSE_* (the env file
    says it all)."""
    kept = {name: value for name, value in os.environ.items() if not name.startswith(("TRIALSTREAM_", "COMPOSE_"))}
    return {**kept, "COMPOSE_BAKE": "false"}  # no buildx here: the engine's own BuildKit builds


@dataclass
class Stack:
    """One compose project of docker-compose.yml (plus `extra_files`), its settings in an env file."""

    project: str
    env_file: Path
    settings: dict[str, str]
    extra_files: list[Path] = field(default_factory=list)

    @classmethod
    def create(cls, directory: Path, project: str, **settings: str) -> Stack:
        ssh_dir = directory / "ssh"
        values = {
            "TRIALSTREAM_REDIS_PASSWORD": secrets.token_hex(16),
            "TRIALSTREAM_MANAGER_TOKEN": secrets.token_hex(16),
            "TRIALSTREAM_BASE_IMAGE": BASE_IMAGE,
            "TRIALSTREAM_REDIS_IMAGE": BASE_IMAGE,
            "TRIALSTREAM_PIP_NO_INDEX": "1",
            "TRIALSTREAM_TAG": TAG,
            "TRIALSTREAM_PORT": str(free_port()),
            "TRIALSTREAM_SSH_DIR": str(ssh_dir),
            **settings,
        }
        env_file = directory / "stack.env"
        ssh_dir.mkdir(parents=True, exist_ok=True)
        os.chown(ssh_dir, 1000, 1000)  # the image's user reads the mounted secret
        env_file.write_text("".join(f"{name}={value}\n" for name, value in values.items()))
        return cls(project, env_file, values)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings['TRIALSTREAM_PORT']}"

    @property
    def token(self) -> str:
        return self.settings["TRIALSTREAM_MANAGER_TOKEN"]

    def compose(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        files = [arg for path in [ROOT / "docker-compose.yml", *self.extra_files] for arg in ("-f", str(path))]
        command = ["docker", "compose", *files, "--project-directory", str(ROOT), "--env-file", str(self.env_file)]
        done = subprocess.run(
            [*command, "-p", self.project, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=compose_environment(),
            cwd=ROOT,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
        return done

    def up(self, *args: str) -> None:
        """`docker compose up -d --wait`: returns once every service is healthy."""
        self.compose("up", "-d", "--wait", "--no-build", *args)

    def down(self, *args: str) -> None:
        """`docker compose down`: each service gets its own stop_grace_period unless `args` say otherwise."""
        self.compose("down", *args, timeout=600)

    def containers(self, service: str) -> list[str]:
        """The full ids of a service's running containers (a container's host name is its id's first 12)."""
        return self.compose("ps", "-q", service).stdout.split()

    def logs(self) -> str:
        try:
            return self.compose("logs", "--no-color", "--timestamps", check=False).stdout
        except subprocess.TimeoutExpired:
            return "(docker compose logs timed out)"

    @contextmanager
    def api(self) -> Iterator[httpx.Client]:
        headers = {"Authorization": f"Bearer {self.token}"}
        with httpx.Client(base_url=f"{self.url}/api/v1", headers=headers, timeout=30) as client:
            yield client

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """The host's `trialstream --manager URL ...`, as the README runs it."""
        return subprocess.run(
            [sys.executable, "-m", "manager.cli", "--manager", self.url, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**compose_environment(), "TRIALSTREAM_MANAGER_TOKEN": self.token},
            cwd=ROOT,
        )

    def submit(self, config: Path) -> subprocess.Popen[str]:
        """`trialstream --manager URL run CONFIG --json` in the background (it waits for the end)."""
        return subprocess.Popen(
            [sys.executable, "-m", "manager.cli", "--manager", self.url, "run", str(config), "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**compose_environment(), "TRIALSTREAM_MANAGER_TOKEN": self.token},
            cwd=ROOT,
        )


def newest_experiment(api: httpx.Client, timeout: float = 60) -> str:
    def found() -> str | None:
        experiments = api.get("/experiments").json()
        return experiments[0]["id"] if experiments else None

    return wait_until(found, timeout, 0.2, "the experiment to be created")


def trials(api: httpx.Client, experiment_id: str) -> list[dict[str, Any]]:
    answer = api.get(f"/experiments/{experiment_id}/trials", params={"limit": 1000})
    answer.raise_for_status()
    return list(answer.json()["items"])


def experiment(api: httpx.Client, experiment_id: str) -> dict[str, Any]:
    answer = api.get(f"/experiments/{experiment_id}")
    answer.raise_for_status()
    return dict(answer.json())


def events(api: httpx.Client, experiment_id: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        params: dict[str, Any] = {"limit": 1000, **({"after": after} if after else {})}
        page = api.get(f"/experiments/{experiment_id}/events", params=params).json()["items"]
        found += [item["event"] for item in page]
        if len(page) < 1000:
            return found
        after = page[-1]["id"]


def wait_for(probe: Any, timeout: float, what: str) -> Any:
    """wait_until with a pause fit for polling a stack over HTTP, riding out a restart's refused requests."""

    def tolerant() -> Any:
        try:
            return probe()
        except (httpx.HTTPError, KeyError):
            return None

    return wait_until(tolerant, timeout, 0.25, what)


def finish(process: subprocess.Popen[str], timeout: float = 300) -> str:
    """The --json output of a `submit`ted run, which must have succeeded."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
    assert process.returncode == 0, f"run exited {process.returncode}: {err[-2000:]}"
    return out
