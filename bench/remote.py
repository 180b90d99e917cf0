"""NNI 3.0's remote mode against trialstream's remote platform, on real OpenSSH hosts on loopback addresses.

Each host is an unprivileged `/usr/sbin/sshd -D` on its own 127.0.0.N address and a free port, in its own mount
namespace with its own copy of the trial user's home (as tests/sshd.py sets hosts up, without pytest). Trials log
in as the plain user `tstrial` with an ed25519 key; sshd sets their PATH (`SetEnv`): the directory of this
python (which has `nni`) first, so NNI's "install nni on the host" finds it already there.

Both systems run the same NNI v2 YAML: 20 trials of the benchmark trial (`trials/trial.py nni`, the real `nni`),
2 at a time, seeded Random tuner, one host. Then trialstream alone: how soon a host-side metric is in the log,
and what one worker costs while it supervises 100 quietly running trials on 2 hosts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.harness import (
    NNI_TRIAL,
    REPO,
    SEARCH_SPACE,
    TRIALS_DIR,
    Figure,
    Section,
    median_of,
    percentile,
    repeat,
    stream_ms,
    wait_until,
)
from bench.versus_nni import ANSI, NNI_TERMINAL, NniError, free_port, get_json, nni_manager_group, reap
from core.settings import REDIS_URL_ENV

TRIALS = 20
CONCURRENCY = 2
SEED = 7
DEADLINE_S = 300.0
POLL_S = 0.1
USER = "tstrial"
SSHD = "/usr/sbin/sshd"
KNOWN_HOSTS_ENV = "TRIALSTREAM_KNOWN_HOSTS"


# --- loopback sshd hosts -------------------------------------------------------------------------------------


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited with {result.returncode}: {result.stderr.strip()}")
    return result


def ensure_user() -> pwd.struct_passwd:
    """The plain user trials log in as (the tests create the same one), able to run this python."""
    try:
        entry = pwd.getpwnam(USER)
    except KeyError:
        _sh("useradd", "--create-home", "--user-group", "--shell", "/bin/bash", USER)
        entry = pwd.getpwnam(USER)
    Path(entry.pw_dir).mkdir(exist_ok=True)  # each host bind-mounts its own home here
    for path in {sys.executable, os.path.realpath(sys.executable), sys.prefix, sys.base_prefix}:
        for directory in Path(path).parents:
            if not os.stat(directory).st_mode & stat.S_IXOTH:
                _sh("setfacl", "-m", f"u:{USER}:x", str(directory))  # pyenv under /root: x only
    return entry


def _free_port(address: str) -> int:
    with socket.socket() as probe:
        probe.bind((address, 0))
        return int(probe.getsockname()[1])


def _answers(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=1.0) as connection:
            return connection.recv(4).startswith(b"SSH-")
    except OSError:
        return False


class LoopbackHost:
    """One SSH host: sshd on 127.0.0.N, its own host key, mount namespace and home directory."""

    def __init__(self, base: Path, number: int, user: pwd.struct_passwd, public_key: str) -> None:
        self.user = user
        self.address = f"127.0.0.{number}"
        self.port = _free_port(self.address)
        self.dir = base / f"host-{number}"
        self.home = self.dir / "home"
        self.config = self.dir / "sshd_config"
        self.host_key = self.dir / "ssh_host_ed25519_key"
        self.pid_file = self.dir / "sshd.pid"
        self.process: subprocess.Popen[bytes] | None = None
        (self.home / ".ssh").mkdir(parents=True, mode=0o700)
        (self.home / ".ssh" / "authorized_keys").write_text(public_key + "\n")
        for path in (self.home, self.home / ".ssh", self.home / ".ssh" / "authorized_keys"):
            os.chown(path, user.pw_uid, user.pw_gid)
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", self.address, "-f", str(self.host_key))
        path = f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin"
        lines = [
            f"Port {self.port}",
            f"ListenAddress {self.address}",
            f"HostKey {self.host_key}",
            f"PidFile {self.pid_file}",
            "AuthorizedKeysFile .ssh/authorized_keys",
            "UsePAM no",
            "StrictModes no",
            "Subsystem sftp internal-sftp",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PubkeyAuthentication yes",
            f"AllowUsers {user.pw_name}",
            "PrintMotd no",
            "MaxSessions 200",
            "MaxStartups 200",
            f"SetEnv PATH={path}",
        ]
        self.config.write_text("\n".join(lines) + "\n")

    @property
    def known_hosts_line(self) -> str:
        key = " ".join(self.host_key.with_suffix(".pub").read_text().split()[:2])
        return f"[{self.address}]:{self.port} {key}"

    def start(self) -> None:
        script = 'mount --bind "$1" "$2" && exec "$3" -D -e -f "$4"'
        args = [str(self.home), self.user.pw_dir, SSHD, str(self.config)]
        command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *args]
        with (self.dir / "sshd.log").open("ab") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

        def up() -> bool:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"sshd on {self.address} exited: {(self.dir / 'sshd.log').read_text()[-800:]}")
            return self.pid_file.exists() and _answers(self.address, self.port)

        wait_until(up, 10, f"sshd on {self.address}:{self.port}")

    def mount_namespace(self) -> str | None:
        with contextlib.suppress(OSError, ValueError):
            return os.readlink(f"/proc/{int(self.pid_file.read_text())}/ns/mnt")
        return None

    def stop(self) -> None:
        """sshd and everything started in its namespace (NNI's trial keeper daemonizes and outlives sessions)."""
        namespace = self.mount_namespace()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(10)
        if namespace is not None:
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    with contextlib.suppress(OSError):
                        if os.readlink(entry / "ns" / "mnt") == namespace:
                            os.kill(int(entry.name), signal.SIGKILL)
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@dataclass
class Hosts:
    hosts: list[LoopbackHost]
    key: Path  # the client's private key
    known_hosts: Path

    def machine_list(self, **extra: Any) -> list[dict[str, Any]]:
        return [
            {"host": host.address, "port": host.port, "user": USER, "sshKeyFile": str(self.key), **extra}
            for host in self.hosts
        ]


@contextlib.contextmanager
def loopback_hosts(root: Path, count: int) -> Iterator[Hosts]:
    """`count` running sshd hosts on 127.0.0.2, .3, ...; a client key; a known_hosts file trusting them."""
    if os.geteuid() != 0:
        raise RuntimeError("the sshd hosts need root (useradd, mount namespaces, sshd privilege separation)")
    for tool in (SSHD, "ssh-keygen", "unshare", "setfacl"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is not installed (apt-get install openssh-server util-linux acl)")
    user = ensure_user()
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="trialstream-bench-sshd-"))
    base.chmod(0o755)
    hosts: list[LoopbackHost] = []
    try:
        key = base / "id_ed25519"
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "trialstream-bench", "-f", str(key))
        public_key = key.with_suffix(".pub").read_text().strip()
        for index in range(count):
            hosts.append(LoopbackHost(base, index + 2, user, public_key))
            hosts[-1].start()
        known_hosts = base / "known_hosts"
        known_hosts.write_text("".join(host.known_hosts_line + "\n" for host in hosts))
        yield Hosts(hosts, key, known_hosts)
    finally:
        for host in hosts:
            host.stop()
        shutil.rmtree(base, ignore_errors=True)


# --- NNI 3.0 -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One system's run of the 20-trial experiment; times in seconds, from launch (epoch `launched`)."""

    wall_s: float
    first_running_s: float
    submit_to_running_ms: list[float]
    refill_ms: list[float]
    failed: int
    stages: dict[str, float]  # NNI: when its manager log says each host set-up stage began, s after launch


def experiment_config(directory: Path, name: str, machines: list[dict[str, Any]]) -> Path:
    config = {
        "experimentName": name,
        "trialCommand": NNI_TRIAL,
        "trialCodeDirectory": str(TRIALS_DIR),
        "trialConcurrency": CONCURRENCY,
        "maxTrialNumber": TRIALS,
        "searchSpace": SEARCH_SPACE,
        "tuner": {"name": "Random", "classArgs": {"seed": SEED}},
        "trainingService": {"platform": "remote", "machineList": machines},
        "experimentWorkingDirectory": str(directory / "experiments"),
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def wait_nni_done(port: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            status = get_json(port, "check-status")
            if status["status"] == "ERROR":
                raise NniError(f"NNI reports an error: {status.get('errors')}")
            jobs: list[dict[str, Any]] = get_json(port, "trial-jobs")
            if status["status"] == "DONE" or (len(jobs) >= TRIALS and all(j["status"] in NNI_TERMINAL for j in jobs)):
                return jobs
        time.sleep(POLL_S)
    raise NniError(f"the experiment was not done after {DEADLINE_S:.0f}s")


# what NNI's manager log says as it sets a host up (nni_node/training_service/remote_v3/worker.js), in order
NNI_STAGES = {
    "SSH connect": "Initializing SSH worker",
    "pip install nni --upgrade": "Installing nni and dependencies",
    "version checks, trial keeper start": "Installed nni v",
    "code upload": "Uploading",
    "host ready": "initialized",
}
LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)\]")


def nni_stages(log: Path, launched: float) -> dict[str, float]:
    """Seconds after launch at which NNI's manager log first mentions each host set-up stage."""
    stages: dict[str, float] = {}
    if not log.is_file():
        return stages
    for line in log.read_text(errors="replace").splitlines():
        match = LOG_TIME.match(line)
        if match is None:
            continue
        for stage, needle in NNI_STAGES.items():
            if stage not in stages and needle in line and "RemoteV3" in line:
                stamp = time.mktime(time.strptime(match.group(1).split(".")[0], "%Y-%m-%d %H:%M:%S"))
                fraction = float("0." + match.group(1).split(".")[1]) if "." in match.group(1) else 0.0
                stages[stage] = stamp + fraction - launched
    return stages


def refills_from_times(trials: list[tuple[float, float]], concurrency: int) -> list[float]:
    """(start, end) per trial in start order: a trial past the first `concurrency` took the slot of the latest end
    before its start; ms from that end to its start."""
    ordered = sorted(trials)
    refills = []
    for start, _ in ordered[concurrency:]:
        ends = [end for _, end in ordered if end <= start]
        if ends:
            refills.append((start - max(ends)) * 1000)
    return refills


# nnictl 3.0 imports pkg_resources (for `nnictl --version` only), which setuptools >= 81 no longer ships; this
# stand-in, on nnictl's PYTHONPATH alone, answers what nnictl asks of it
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


def nnictl_environment(directory: Path) -> dict[str, str]:
    """This environment, plus the pkg_resources stand-in where the installed setuptools lacks pkg_resources."""
    environment = dict(os.environ)
    if importlib.util.find_spec("pkg_resources") is None:
        shim = directory / "pkg_resources_shim"
        shim.mkdir(parents=True, exist_ok=True)
        (shim / "pkg_resources.py").write_text(PKG_RESOURCES_SHIM)
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), environment.get("PYTHONPATH")]))
    return environment


def stop_nni(experiment_id: str, group: int | None, scratch: Path) -> None:
    """`nnictl stop` (not timed in), then make sure nothing of NNI's manager is left here."""
    if experiment_id:
        subprocess.run(
            ["nnictl", "stop", experiment_id],
            env=nnictl_environment(scratch),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=60,
            check=False,
        )
    if group is not None:
        reap("-g", group, "NNI")


def run_nni(directory: Path, name: str, hosts: Hosts) -> Run:
    """`nnictl create` launch -> DONE, then `nnictl stop` (not timed in) and nothing of it left on the hosts."""
    config = experiment_config(directory, name, hosts.machine_list())
    port = free_port()
    experiment_id, group = "", None
    launched = time.time()
    started = time.perf_counter()
    try:
        created = subprocess.run(
            ["nnictl", "create", "--config", str(config), "--port", str(port)],
            env=nnictl_environment(directory.parent),
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
        experiment_id = match.group(1)
        jobs = wait_nni_done(port)
        wall_s = time.perf_counter() - started
        (directory / "trial-jobs.json").write_text(json.dumps(jobs))
    finally:
        stop_nni(experiment_id, group if group is not None else nni_manager_group(port), directory.parent)
    log = directory / "experiments" / experiment_id / "log" / "nnimanager.log"
    times = [(job["startTime"] / 1000, job.get("endTime", job["startTime"]) / 1000) for job in jobs if "startTime" in job]
    return Run(
        wall_s=wall_s,
        first_running_s=min(start for start, _ in times) - launched,
        submit_to_running_ms=[],
        refill_ms=refills_from_times(times, CONCURRENCY),
        failed=sum(job["status"] != "SUCCEEDED" for job in jobs),
        stages=nni_stages(log, launched),
    )
