"""NNI 3.0's remote mode against trialstream's remote platform, on real OpenSSH hosts on loopback addresses.

Each host is an unprivileged `/usr/sbin/sshd -D` on its own 127.0.0.N address and a free port, in its own mount
namespace with its own copy of the trial user's home (as simulators/sshd.py sets hosts up, without pytest). Trials log
in as the plain user `tstrial` with an ed25519 key; sshd sets their PATH (`SetEnv`): the directory of this
python (which has `nni`) first, so NNI's "install nni on the host" finds it already there.

Both systems run the same NNI v2 YAML: 20 trials of the benchmark trial (`trials/trial.py nni`, the real `nni`),
2 at a time, seeded Random tuner, one host. Then trialstream alone: how soon a host-side metric is in the log,
and what one worker costs while it supervises 100 quietly running trials on 2 hosts.
"""

from __future__ import annotations

import contextlib
import math
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import nnictl, versus_nni
from bench.harness import (
    NNI_TRIAL,
    REPO,
    TRIALS_DIR,
    Figure,
    Section,
    cpu_seconds,
    descendants,
    median_of,
    percentile,
    repeat,
    rss_mb,
    scratch_redis,
    stream_ms,
    trialstream_run,
    wait_until,
)
from bench.ingestion import sent_time
from bench.overhead import form
from bench.versus_nni import trial_cpu_seconds
from core.connections import connect
from core.event_store import StoredEvent
from core.settings import Settings
from core.variables import PREFIX, REDIS_URL_ENV
from manager.config import load_experiment_config
from manager.runner import ExperimentRunner
from manager.stack import DATA_DIR, EmbeddedRedis, ServiceProcesses
from manager.training_service import TrainingService
from schemas.events import TrialEnded, TrialMetricReported, TrialStarted, TrialSubmitted

TRIALS = 20
CONCURRENCY = 2
SEED = 7
DEADLINE_S = 300.0
POLL_S = 0.1
USER = "tstrial"
SSHD = "/usr/sbin/sshd"
KNOWN_HOSTS_ENV = f"{PREFIX}KNOWN_HOSTS"  # the known_hosts setting


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
        session_path = f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin"
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
            f"SetEnv PATH={session_path}",
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
    first_submitted_s: float | None = None  # trialstream: launch -> the first TrialSubmitted


def experiment_config(directory: Path, name: str, machines: list[dict[str, Any]], **overrides: Any) -> Path:
    """The `nni` group's YAML with TRIALS at CONCURRENCY on `machines`; `overrides` are NNI keys (camelCase)."""
    return versus_nni.experiment_config(
        directory,
        name,
        **{
            "trialConcurrency": CONCURRENCY,
            "maxTrialNumber": TRIALS,
            "trainingService": {"platform": "remote", "machineList": machines},
            **overrides,
        },
    )


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


def run_nni(directory: Path, name: str, hosts: Hosts) -> Run:
    """`nnictl create` launch -> DONE, then `nnictl stop` (not timed in) and nothing of it left on the hosts."""
    config = experiment_config(directory, name, hosts.machine_list())
    experiment = nnictl.run(config, TRIALS, DEADLINE_S, POLL_S)
    jobs, launched = experiment.jobs, experiment.launched
    log = directory / "experiments" / experiment.id / "log" / "nnimanager.log"
    times = [
        (job["startTime"] / 1000, job.get("endTime", job["startTime"]) / 1000) for job in jobs if "startTime" in job
    ]
    return Run(
        wall_s=experiment.wall_s,
        first_running_s=min(start for start, _ in times) - launched,
        submit_to_running_ms=[],
        refill_ms=refills_from_times(times, CONCURRENCY),
        failed=sum(job["status"] != "SUCCEEDED" for job in jobs),
        stages=nni_stages(log, launched),
    )


# --- trialstream ---------------------------------------------------------------------------------------------


def trialstream_environment(hosts: Hosts) -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items() if key != REDIS_URL_ENV}
    environment[KNOWN_HOSTS_ENV] = str(hosts.known_hosts)
    return environment


@contextlib.contextmanager
def experiment_log(experiment_dir: Path, experiment_id: str) -> Iterator[list[tuple[str, Any]]]:
    """The log an embedded `trialstream run` left in its experiment directory: (stream id, event) in order."""

    server = EmbeddedRedis(experiment_dir / DATA_DIR)
    url = server.start()
    try:
        service = TrainingService(connect(url), connect(url, decode=False), experiment_id)
        yield [(entry.id, entry.event) for entry in service.store.read() if isinstance(entry, StoredEvent)]
    finally:
        server.stop()


def launch(directory: Path, config: Path, hosts: Hosts) -> tuple[dict[str, Any], float, float]:
    """`trialstream run CONFIG --json` (embedded stack), host keys checked against the hosts' known_hosts file;
    (its result, wall s, launch epoch s)."""
    result, wall_s, launched, _ = trialstream_run(
        config, directory / "trialstream.stderr", trialstream_environment(hosts), DEADLINE_S
    )
    return result, wall_s, launched


def run_trialstream(directory: Path, name: str, hosts: Hosts) -> Run:
    config = experiment_config(directory, name, hosts.machine_list())
    result, wall_s, launched = launch(directory, config, hosts)
    experiment_dir = directory / "experiments" / result["experimentId"]
    submitted: dict[str, int] = {}
    started: dict[str, int] = {}
    to_running, refills = [], []
    last_ended, trigger = 0, {}
    with experiment_log(experiment_dir, result["experimentId"]) as entries:
        for entry_id, event in entries:
            at = stream_ms(entry_id)
            if isinstance(event, TrialSubmitted):
                submitted[event.trial_id] = at
                if event.form.sequence_id >= CONCURRENCY:
                    trigger[event.trial_id] = last_ended  # the end that freed this trial's slot
            elif isinstance(event, TrialStarted) and event.trial_id not in started:
                started[event.trial_id] = at
                to_running.append(float(at - submitted[event.trial_id]))
                if event.trial_id in trigger:
                    refills.append(float(at - trigger.pop(event.trial_id)))
            elif isinstance(event, TrialEnded):
                last_ended = at
    if not started:
        raise RuntimeError(f"no trial of {result['experimentId']} ever started: {result}")
    return Run(
        wall_s=wall_s,
        first_running_s=min(started.values()) / 1000 - launched,
        submit_to_running_ms=to_running,
        refill_ms=refills,
        failed=sum(trial["status"] != "SUCCEEDED" for trial in result["trials"]) + TRIALS - len(result["trials"]),
        stages={},
        first_submitted_s=min(submitted.values()) / 1000 - launched,
    )


METRICS = 20


def metric_latencies(directory: Path, hosts: Hosts) -> list[float]:
    """One remote trial (bench/trials/metrics.py, as the ingestion group runs it) reports METRICS intermediate
    metrics 50 ms apart and a final one, each {"default": step, "sent": its host-side time.time()}; ms from `sent`
    to the log time (its stream id) of its TrialMetricReported."""
    code = directory / "code"  # the trial imports the dependency-free SDK: upload it with the trial
    code.mkdir(parents=True, exist_ok=True)
    shutil.copy(TRIALS_DIR / "metrics.py", code)
    shutil.copy(REPO / "trialstream_sdk.py", code)
    config = experiment_config(
        directory,
        "metrics",
        hosts.machine_list(),
        trialCommand=f"{sys.executable} metrics.py {METRICS} 0.05",
        trialCodeDirectory=str(code),
        trialConcurrency=1,
        maxTrialNumber=1,
    )
    result, _, _ = launch(directory, config, hosts)
    latencies = []
    with experiment_log(directory / "experiments" / result["experimentId"], result["experimentId"]) as entries:
        for entry_id, event in entries:
            if isinstance(event, TrialMetricReported):
                latencies.append(stream_ms(entry_id) - sent_time(event.data) * 1000)
    if len(latencies) < METRICS:
        raise RuntimeError(f"{len(latencies)} of {METRICS + 1} metrics reached the log: {result}")
    return latencies


QUIET_TRIALS = 100
SAMPLE_S = 10.0


@dataclass(frozen=True)
class Footprint:
    rss_mb: float
    cpu_percent: float
    children: int  # processes the worker started (ssh clients, ...), if any
    children_rss_mb: float
    to_all_running_s: float


def worker_footprint(directory: Path, hosts: Hosts) -> Footprint:
    """`trialstream worker --platform remote --concurrency 100` on a private redis-server; 100 `sleep` trials over
    the hosts through TrainingService; once all are RUNNING, the worker's RSS and CPU over SAMPLE_S seconds."""

    config = experiment_config(
        directory,
        "quiet",
        hosts.machine_list(),
        trialCommand="sleep 600",
        trialConcurrency=QUIET_TRIALS,
        maxTrialNumber=QUIET_TRIALS,
    )
    with scratch_redis(directory) as (client, url):
        settings = Settings.from_environment({"TRIALSTREAM_KNOWN_HOSTS": str(hosts.known_hosts)}, redis_url=url)
        services = ServiceProcesses(settings, directory / "logs")
        try:
            services.start("worker", "--platform", "remote", "--concurrency", str(QUIET_TRIALS), log_name="worker")
            pid = services.processes[-1].pid
            spec = load_experiment_config(config)
            # settings: the known_hosts its pre-start check reads
            service = ExperimentRunner.create(spec, client, connect(url, decode=False), settings=settings).service
            started = time.perf_counter()
            trials = [
                service.submit_trial_job(form(index, {"x": index / QUIET_TRIALS, "y": 1}))
                for index in range(QUIET_TRIALS)
            ]

            def all_running() -> bool:
                jobs = service.list_trial_jobs()
                failed = [job for job in jobs if job.status in ("FAILED", "SYS_CANCELED", "USER_CANCELED")]
                if failed:
                    first = failed[0]
                    raise RuntimeError(f"{len(failed)} quiet trials ended, {first.id}: {first.status} {first.message}")
                return sum(job.status == "RUNNING" for job in jobs) >= QUIET_TRIALS

            wait_until(all_running, 180, f"{QUIET_TRIALS} remote trials to be RUNNING", interval=0.5)
            to_all_running_s = time.perf_counter() - started
            time.sleep(2.0)  # let the start-up burst settle
            cpu_before, sampled = cpu_seconds(pid), time.perf_counter()
            time.sleep(SAMPLE_S)
            cpu_percent = (cpu_seconds(pid) - cpu_before) / (time.perf_counter() - sampled) * 100
            children = descendants(pid)
            children_rss = 0.0
            for child in children:
                with contextlib.suppress(OSError, LookupError):
                    children_rss += rss_mb(child)
            footprint = Footprint(rss_mb(pid), cpu_percent, len(children), children_rss, to_all_running_s)
            for trial in trials:
                with contextlib.suppress(Exception):
                    service.cancel_trial_job(trial.id)
            with contextlib.suppress(TimeoutError):
                wait_until(
                    lambda: not any(job.status == "RUNNING" for job in service.list_trial_jobs()),
                    60,
                    "the quiet trials to stop",
                    interval=0.5,
                )
            return footprint
        finally:
            services.stop()


# --- the section ---------------------------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    return median_of(values) if values else None


def _why(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip()[-600:]}"


@dataclass
class _Measured:
    """What `run` measured on two loopback sshd hosts, and why any part of it could not be."""

    nni_runs: list[Run] = field(default_factory=list)
    ts_runs: list[Run] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    latencies: list[list[float]] = field(default_factory=list)
    footprint: Footprint | None = None
    bare_trial: tuple[float, float] | None = None


def _measure(root: Path, runs: int) -> _Measured:
    measured = _Measured()
    nni_runs, ts_runs, failures = measured.nni_runs, measured.ts_runs, measured.failures
    if shutil.which("nnictl") is None:
        failures["NNI"] = "nnictl is not on PATH"
    try:
        hosts_context = loopback_hosts(root / "hosts", 2)
        hosts = hosts_context.__enter__()
    except (RuntimeError, OSError, TimeoutError) as error:
        failures["sshd"] = f"no loopback sshd hosts: {_why(error)}"
        hosts_context = None
    if hosts_context is not None:
        try:
            one = Hosts(hosts.hosts[:1], hosts.key, hosts.known_hosts)
            print(f"  hosts: {', '.join(f'{h.address}:{h.port}' for h in hosts.hosts)} (user {USER})", flush=True)

            def attempt(system: str, runs_so_far: list[Run], one_run: Callable[[], Run]) -> None:
                try:
                    runs_so_far.append(one_run())
                    print(f"      {system}: {runs_so_far[-1].wall_s:.1f}s", flush=True)
                except (RuntimeError, OSError, ValueError, KeyError, subprocess.SubprocessError) as error:
                    failures.setdefault(system, _why(error))  # NniError is a RuntimeError
                    print(f"      {system} failed: {_why(error)}", flush=True)

            def measure(index: int) -> None:
                if "NNI" not in failures or index > 0:
                    attempt("NNI", nni_runs, lambda: run_nni(root / "nni" / f"run{index}", f"nni-remote{index}", one))
                attempt(
                    "trialstream",
                    ts_runs,
                    lambda: run_trialstream(root / "trialstream" / f"run{index}", f"ts-remote{index}", one),
                )

            measured.bare_trial = trial_cpu_seconds(root)
            repeat(runs, measure)
            try:
                measured.latencies = repeat(runs, lambda index: metric_latencies(root / "metrics" / f"run{index}", one))
            except (RuntimeError, OSError, ValueError, KeyError, subprocess.SubprocessError) as error:
                failures["metrics"] = _why(error)
            try:
                measured.footprint = worker_footprint(root / "quiet", hosts)
            except (RuntimeError, OSError, ValueError, KeyError, TimeoutError) as error:
                failures["footprint"] = _why(error)
        finally:
            hosts_context.__exit__(None, None, None)
    return measured


def run(root: Path, runs: int) -> Section:
    section = Section("Remote hosts over SSH: NNI 3.0 against trialstream", "python -m bench --only remote")
    measured = _measure(root, runs)
    nni_runs, ts_runs, failures = measured.nni_runs, measured.ts_runs, measured.failures
    latencies, footprint, bare_trial = measured.latencies, measured.footprint, measured.bare_trial

    def why_not(system: str) -> str:
        return f"not measured: {failures[system]}" if system in failures else ""

    first_submitted = _median([r.first_submitted_s for r in ts_runs if r.first_submitted_s is not None])
    nni_s = _median([r.wall_s for r in nni_runs])
    ts_s = _median([r.wall_s for r in ts_runs])
    per_run = lambda rs: ", ".join(f"{r.wall_s:.1f}" for r in rs)  # noqa: E731
    section.add(
        Figure(
            f"NNI remote: {TRIALS} trials at concurrency {CONCURRENCY}, wall time",
            nni_s,
            "s",
            detail=f"median of {per_run(nni_runs)} s" if nni_runs else why_not("NNI"),
        ),
        Figure(
            f"trialstream remote: {TRIALS} trials at concurrency {CONCURRENCY}, wall time",
            ts_s,
            "s",
            detail=f"median of {per_run(ts_runs)} s" if ts_runs else why_not("trialstream"),
        ),
        Figure("NNI / trialstream wall time (speed-up)", nni_s / ts_s if nni_s and ts_s else None, "x", ">= 2"),
        Figure(
            "NNI remote: launch -> first trial RUNNING",
            _median([r.first_running_s for r in nni_runs]),
            "s",
            detail="from `nnictl create` to the earliest `startTime` in /trial-jobs",
        ),
        Figure(
            "trialstream remote: launch -> first trial RUNNING",
            _median([r.first_running_s for r in ts_runs]),
            "s",
            "<= 1.5",
            detail="from launching `trialstream run` to the first TrialStarted's log time"
            + (f"; {first_submitted:.2f} s of it to the first TrialSubmitted" if first_submitted is not None else ""),
        ),
        Figure(
            "trialstream remote: submit -> RUNNING p50",
            _median([percentile(r.submit_to_running_ms, 50) for r in ts_runs if r.submit_to_running_ms]),
            "ms",
            "<= 150",
            detail="TrialSubmitted -> TrialStarted, log times, all trials of the 20-trial runs",
        ),
        Figure(
            "trialstream remote: freed slot refill p50",
            _median([percentile(r.refill_ms, 50) for r in ts_runs if r.refill_ms]),
            "ms",
            "<= 100",
            detail="a trial's TrialEnded -> the next trial's TrialStarted, log times",
        ),
        Figure(
            "NNI remote: freed slot refill p50",
            _median([percentile(r.refill_ms, 50) for r in nni_runs if r.refill_ms]),
            "ms",
            detail="a trial's `endTime` -> the next trial's `startTime`, /trial-jobs",
        ),
        Figure(
            "trialstream remote: metric on the host -> in the log p50",
            _median([percentile(samples, 50) for samples in latencies]),
            "ms",
            "<= 250",
            detail=f"{METRICS} intermediate metrics + the final one per run, 50 ms apart; "
            "the metric's `sent` (host time.time()) -> TrialMetricReported's stream id"
            if latencies
            else why_not("metrics"),
        ),
        Figure(
            "trialstream remote: metric on the host -> in the log p99",
            _median([percentile(samples, 99) for samples in latencies]),
            "ms",
            "<= 1000",
        ),
        Figure(
            f"one remote worker, {QUIET_TRIALS} quiet trials on 2 hosts: RSS",
            footprint.rss_mb if footprint else None,
            "MB",
            "<= 300",
            detail=(
                f"VmRSS of the worker process; its {footprint.children} child processes hold "
                f"{footprint.children_rss_mb:.0f} MB more; all {QUIET_TRIALS} RUNNING "
                f"{footprint.to_all_running_s:.1f} s after the first submit"
                if footprint
                else why_not("footprint")
            ),
        ),
        Figure(
            f"one remote worker, {QUIET_TRIALS} quiet trials on 2 hosts: CPU",
            footprint.cpu_percent if footprint else None,
            "% of a core",
            "<= 10",
            detail=f"utime + stime of the worker process over {SAMPLE_S:.0f} s, /proc/<pid>/stat",
        ),
    )
    section.notes.append(
        f"Hosts: unprivileged OpenSSH sshd (`{SSHD} -D`) on 127.0.0.2 and 127.0.0.3, each in its own mount "
        f"namespace with its own home for the plain user `{USER}`, ed25519 key auth; sshd sets PATH so the "
        f"host's `python` is this machine's {sys.executable} (which has nni). The same NNI v2 YAML for both "
        f"systems: {TRIALS} trials of `{NNI_TRIAL}` (the real `nni`), trialConcurrency {CONCURRENCY}, Random "
        f"tuner (seed {SEED}), `trainingService: {{platform: remote, machineList: [{{host, port, user, "
        "sshKeyFile}]}`, one host; alternating NNI then trialstream, runs: "
        f"{runs}. NNI: `nnictl create` -> `check-status` DONE (or all trials terminal), polled every {POLL_S} s, "
        "`nnictl stop` not timed in. trialstream: `trialstream run CONFIG --json` (embedded stack) launch -> exit; "
        "its submit/start/end times are read afterwards from the log it left in the experiment directory."
    )
    if bare_trial is not None:
        cores = os.cpu_count() or 1
        section.notes.append(
            f"The trial command alone takes {bare_trial[0]:.2f} s, {bare_trial[1]:.2f} s of it CPU (mostly `import "
            f"nni`): on this machine's {cores} cores {TRIALS} trials need at least {TRIALS * bare_trial[1] / cores:.0f}"
            " s of CPU whatever runs them, and sshd, the hosts' sessions and each system's own processes share those "
            "cores, so the trials bound trialstream's wall time here and cap the speed-up."
        )
    stages = [r.stages for r in nni_runs if r.stages]
    if stages:
        medians = {stage: median_of([s[stage] for s in stages if stage in s]) for stage in NNI_STAGES}
        section.notes.append(
            "Where NNI's time goes before the first trial (median seconds after launch at which nnimanager.log "
            "starts each step; the log has 1 s resolution): "
            + ", ".join(f"{stage} {at:.0f} s" for stage, at in medians.items() if not math.isnan(at))
            + ". See bench/FINDINGS.md (remote)."
        )
    failed = [r.failed for r in nni_runs + ts_runs if r.failed]
    if failed:
        section.notes.append(f"Some runs had trials that did not succeed: {failed}")
    for system, why in failures.items():
        section.notes.append(f"{system}: {why}")
    return section
