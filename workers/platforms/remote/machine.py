"""One remote machine as a worker process sees it: its SSH connection, the code staged there, and a
monitor that tells the trials followed there when their files change.

Nothing of trialstream runs on the host but POSIX shell scripts (plus `setsid`, `stat` and `tar`):
each trial is a detached session writing its pid, stdout, stderr and exit code into its own
directory, and one monitor command per host and worker process polls the sizes of the files of every
trial the worker follows there (a `stat` every WATCH_PERIOD_S, on the host), printing a snapshot only
when something changed. So a worker following many quiet trials sends and receives nothing, and a
metric reaches the worker one monitor period after it is written, with no per-trial polling over SSH.
"""

from __future__ import annotations

import logging
import shlex
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from workers.platforms.remote.config import RemoteMachine
from workers.platforms.remote.settings import RemoteSettings
from workers.platforms.remote.ssh import RunResult, SshConnection, SshError, SshPool, SshTarget
from workers.platforms.shared.code_package import CodePackage
from workers.platforms.shared.gpu import (
    NVIDIA_SMI_APPS,
    NVIDIA_SMI_FORMAT,
    NVIDIA_SMI_GPUS,
    GpuInfo,
    GpuQueryError,
    parse_nvidia_smi,
)

log = logging.getLogger(__name__)

ROOT_NAME = ".trialstream"  # under the user's home on each host
WATCH_PERIOD_S = 0.05
LIVENESS_ROUNDS = 10  # monitor rounds between checks that each followed trial's process still lives
RECONNECT_BACKOFF_S = (0.1, 0.25, 0.5, 1.0, 2.0)
REQUIRED_TOOLS = ("setsid", "stat", "tar")

# Shell functions for the scripts that ask whether an attempt's process still runs, or kill it. An attempt's
# pid file holds "PID START": its pid and the process's start time (clock ticks after boot, field 22 of
# /proc/PID/stat), so a pid the kernel has given to another process since is not taken for the trial.
PROCESS_FUNCTIONS = r"""
started() {  # PID: whether it lives (not a zombie); its start time in $s
  s=; l=; read -r l 2>/dev/null < "/proc/$1/stat" || return 1
  set -- ${l##*) }
  case "$1" in Z|X) return 1;; esac
  s=${20}
}
recorded() {  # DIR: the attempt's pid and start time, from its pid file, in $p and $t
  p=; t=; read -r p t 2>/dev/null < "$1/pid" || [ -n "$p" ]
}
runs() {  # DIR: whether the attempt's process still runs
  recorded "$1" && started "$p" && { [ -z "$t" ] || [ "$s" = "$t" ]; }
}
group() {  # DIR: its process group ($p) may be killed: its leader is ours, or gone (a group id is not reused meanwhile)
  recorded "$1" && { ! started "$p" || [ -z "$t" ] || [ "$s" = "$t" ]; }
}
"""

# $1: the worker's watch directory (a symlink per followed attempt). Prints a snapshot of the attempts'
# file sizes and exits whenever they change, "dead KEY" for a vanished one; ends with its stdin.
# docs/platforms.md, Remote, says why python where there is one, and why stdin.
_PYTHON_TEMPLATE = r"""
import os, sys, threading, time

def orphaned():
    sys.stdin.buffer.read()
    os._exit(0)

threading.Thread(target=orphaned, daemon=True).start()
os.makedirs(sys.argv[1], exist_ok=True)
os.chdir(sys.argv[1])
last, dead, rounds = None, [], 0

def gone(key):
    try:
        pid, _, start = open(key + "/pid").read().strip().partition(" ")
    except OSError:
        return False
    try:
        fields = open("/proc/%s/stat" % pid).read().rpartition(")")[2].split()
    except OSError:
        fields = []
    runs = fields[:1] not in ([], ["Z"], ["X"]) and (not start or fields[19:20] == [start])
    return not runs and not os.path.exists(key + "/exit")

while True:
    keys = sorted(os.listdir("."))
    if rounds <= 0:
        rounds, dead = ROUNDS, [key for key in keys if not os.path.exists(key + "/exit") and gone(key)]
    rounds -= 1
    lines = []
    for key in keys:
        for name in ("stdout", ".nni/metrics", "exit"):
            try:
                lines.append("%s/%s %d" % (key, name, os.stat(key + "/" + name).st_size))
            except OSError:
                pass
    lines += ["dead " + key for key in dead]
    if lines != last:
        sys.stdout.write("".join(line + "\n" for line in lines) + ".\n")
        sys.stdout.flush()
        last = lines
    time.sleep(PERIOD)
"""
_SHELL_TEMPLATE = (
    PROCESS_FUNCTIONS
    + r"""
exec 3<&0
{ cat <&3 > /dev/null 2>&1; kill $$ 2>/dev/null; } &
exec 3<&-
W="$1"; mkdir -p "$W" && cd "$W" || exit 1
last=; dead=; n=0
while :; do
  if [ "$n" -le 0 ]; then
    dead=; n=ROUNDS
    for k in *; do
      [ -e "$k/exit" ] || ! recorded "$k" || runs "$k" || [ -e "$k/exit" ] || dead="$dead
dead $k"
    done
  fi
  n=$((n - 1))
  now="$(stat -L -c '%n %s' -- */stdout */.nni/metrics */exit 2>/dev/null)$dead"
  if [ "$now" != "$last" ]; then printf '%s\n.\n' "$now"; last=$now; fi
  sleep PERIOD
done
"""
)


def _filled(template: str) -> str:
    return template.replace("ROUNDS", str(LIVENESS_ROUNDS)).replace("PERIOD", str(WATCH_PERIOD_S))


PYTHON_MONITOR = _filled(_PYTHON_TEMPLATE)
SHELL_MONITOR = _filled(_SHELL_TEMPLATE)
# $1 the watch directory, $2 PYTHON_MONITOR: the python one where the host has python, else the shell one
_MONITOR = (
    'python=$(command -v python3 || command -v python) && "$python" -c "import sys; sys.exit(sys.version_info < (3,))" '
    '2>/dev/null && exec "$python" -c "$2" "$1"\n' + SHELL_MONITOR
)

# Unpacks an uploaded archive ($1) into a fresh directory and publishes it under its hash ($2) with
# one `ln -s`, which fails if another worker published it first: then ours is removed.
_UNPACK = r"""
t=$(mktemp -d "$2.unpack-XXXXXX") || exit 1
tar -xzf "$1" -C "$t" || { s=$?; rm -rf "$t" "$1"; exit "$s"; }
rm -f "$1"
ln -sn "${t##*/}" "$2" 2>/dev/null || rm -rf "$t"
[ -d "$2" ]
"""

_PROBE = r"""
for t in TOOLS; do command -v "$t" >/dev/null 2>&1 || echo "missing $t"; done
if [ -n "$1" ]; then
  found=; IFS=:
  for d in $1; do for p in python3 python; do [ -f "$d/$p" ] && [ -x "$d/$p" ] && found=1; done; done
  unset IFS; [ -n "$found" ] || echo "no python"
fi
echo ok
""".replace("TOOLS", " ".join(REQUIRED_TOOLS))


def script(body: str, *args: str) -> str:
    """`body` with `args` as its positional parameters, every one quoted: trial text is data here."""
    return f"set -- {' '.join(shlex.quote(arg) for arg in args)}\n{body}" if args else body


def target_of(machine: RemoteMachine, settings: RemoteSettings) -> SshTarget:
    return SshTarget(
        host=machine.host,
        port=machine.port,
        user=machine.user,
        password=machine.password.get_secret_value() if machine.password else None,
        key_file=machine.ssh_key_file,
        passphrase=machine.ssh_passphrase.get_secret_value() if machine.ssh_passphrase else None,
        check_host_key=machine.check_host_key,
        known_hosts=settings.known_hosts.expanduser(),
        timeout_s=settings.ssh_timeout_s,
        dead_after_s=settings.ssh_dead_after_s,
    )


def probe(machine: RemoteMachine, settings: RemoteSettings) -> str | None:
    """Can trials run on `machine`? None, or one line naming the host and what is wrong."""
    connection = SshConnection(target_of(machine, settings))
    try:
        result = connection.run(script(_PROBE, machine.python_path or ""), timeout_s=settings.ssh_timeout_s)
    except SshError as error:
        return str(error)
    finally:
        connection.close()
    lines = result.stdout.decode(errors="replace").splitlines()
    if result.exit_code != 0 or "ok" not in lines:
        return f"{machine.label}: its shell does not run commands (`sh -c` exited {result.exit_code})"
    missing = [line.removeprefix("missing ") for line in lines if line.startswith("missing ")]
    if missing:
        return f"{machine.label}: needs {', '.join(missing)} on the host's PATH"
    if "no python" in lines:
        return f"{machine.label}: pythonPath {machine.python_path} holds no python3 or python"
    return None


@dataclass(frozen=True)
class AttemptFiles:
    """What the monitor last saw of one attempt's files on the host."""

    stdout: int = 0
    metrics: int = 0
    exited: bool = False
    dead: bool = False


class RemoteHost:
    """One machine of the machine list, shared by every trial a worker process follows there."""

    def __init__(self, machine: RemoteMachine, pool: SshPool, settings: RemoteSettings, watcher: str):
        self.machine = machine
        self.label = machine.label
        self.connection = pool.connection(target_of(machine, settings))
        self._watcher = watcher  # this worker process's name among the monitors of the host
        self._uploaded: set[str] = set()
        self._upload_lock = threading.Lock()
        self._lock = threading.Lock()
        self._files: dict[str, AttemptFiles] = {}
        self._followers: dict[str, Callable[[], None]] = {}
        self._monitor: threading.Thread | None = None
        self.down_since: float | None = None
        self.down_reason = ""

    # where things are on the host

    @property
    def root(self) -> str:
        """Relative to the user's home, where every command and SFTP path starts: no round trip to
        find out where that is (the launch script makes the trial's paths absolute)."""
        return ROOT_NAME

    def experiment_dir(self, experiment_id: str) -> str:
        return f"{self.root}/experiments/{experiment_id}"

    def attempt_dir(self, experiment_id: str, trial_id: str, attempt: int) -> str:
        return f"{self.experiment_dir(experiment_id)}/{trial_id}/attempt-{attempt}"

    @property
    def _path_prefix(self) -> str:
        """pythonPath first on PATH, as for the trials: the monitor runs in the trials' python."""
        python_path = self.machine.python_path
        return f'PATH={shlex.quote(python_path)}:"$PATH"\n' if python_path else ""

    @property
    def watch_dir(self) -> str:
        return f"{self.root}/watch/{self._watcher}"

    def url(self, directory: str) -> str:
        return f"ssh://{self.machine.user}@{self.machine.host}:{self.machine.port}{directory}"

    # commands

    def run(self, body: str, *args: str, timeout_s: float = 60.0) -> RunResult:
        return self.connection.run(script(body, *args), timeout_s=timeout_s)

    def gpus(self) -> list[GpuInfo]:
        """The host's GPUs, from its own `nvidia-smi`; none when it has no such command."""
        gpus, apps = (f"nvidia-smi {query} {NVIDIA_SMI_FORMAT}" for query in (NVIDIA_SMI_GPUS, NVIDIA_SMI_APPS))
        result = self.run(f"command -v nvidia-smi >/dev/null 2>&1 || exit 127\n{gpus} && echo -- && {apps}")
        if result.exit_code == 127:
            return []
        if result.exit_code != 0:
            problem = result.stderr.decode(errors="replace").strip()
            raise GpuQueryError(f"{self.label}: nvidia-smi exited {result.exit_code}: {problem}")
        gpu_rows, _, app_rows = result.stdout.decode(errors="replace").partition("--\n")
        return parse_nvidia_smi(gpu_rows, app_rows)

    def stage(self, package: CodePackage) -> str:
        """The directory on the host holding `package`'s files, uploaded (SFTP) and unpacked the first
        time any worker needs it there: named by content hash, so changed code is never served stale.
        Raises SshError; its kind is "error" when the host answered but cannot hold the code (a full disk)."""
        code_root = f"{self.root}/code"
        code_dir = f"{code_root}/{package.sha256}"
        with self._upload_lock:
            if package.sha256 in self._uploaded:
                return code_dir
            if self.run('test -d "$1"', code_dir).exit_code != 0:
                self.run('mkdir -p "$1"', code_root)
                archive = f"{code_dir}.{self._watcher}.tgz"
                try:
                    self.connection.put(package.path, archive)
                except (SshError, OSError) as error:
                    if not self.connection.connected:
                        raise
                    # the host answered: its SFTP server refused the file (no space, no permission)
                    why = str(error).removeprefix(f"{self.label}: ")
                    size = package.path.stat().st_size
                    raise SshError(
                        f"{self.label}: cannot upload the code ({size} bytes) into ~/{code_root}: "
                        f"{why}{self._free_space(code_root)}",
                        "error",
                    ) from error
                unpacked = self.run(_UNPACK, archive, code_dir)
                if unpacked.exit_code != 0:
                    problem = unpacked.stderr.decode(errors="replace").strip()
                    raise SshError(f"{self.label}: cannot unpack the code: {problem}", "error")
            self._uploaded.add(package.sha256)
        return code_dir

    def _free_space(self, directory: str) -> str:
        """ "; N KiB free there" as the host's `df` tells it (SFTP says only "Failure" when its disk is full)."""
        result = self.run('df -Pk "$1" 2>/dev/null', directory)
        fields = result.stdout.decode(errors="replace").splitlines()[-1:]
        free = fields[0].split()[3:4] if fields else []
        return f"; {free[0]} KiB free there" if result.exit_code == 0 and free and free[0].isdigit() else ""

    # following attempts

    def follow(self, key: str, wake: Callable[[], None]) -> None:
        """Tell `wake` whenever the files of attempt `key` (linked in the watch directory) change."""
        with self._lock:
            self._followers[key] = wake
            if self._monitor is None or not self._monitor.is_alive():
                self._monitor = threading.Thread(target=self._watch, name=f"monitor-{self.label}", daemon=True)
                self._monitor.start()

    def unfollow(self, key: str) -> None:
        with self._lock:
            self._followers.pop(key, None)
            self._files.pop(key, None)

    def files(self, key: str) -> AttemptFiles:
        with self._lock:
            return self._files.get(key, AttemptFiles())

    def mark_down(self, reason: str) -> None:
        with self._lock:
            if self.down_since is None:
                self.down_since = time.monotonic()
            self.down_reason = reason
            wakes = list(self._followers.values())
        for wake in wakes:
            wake()

    def _watch(self) -> None:
        """Run the monitor, and run it again after the connection dropped (backing off while it stays down)."""
        failures = 0
        while True:
            with self._lock:
                if not self._followers:
                    self._monitor = None
                    self.down_since = None  # unknown, not down: the next follower's monitor finds out
                    return
            try:
                self.connection.connect()
                watch_dir = self.watch_dir
                self._up()
                failures = 0
                monitor = script(self._path_prefix + _MONITOR, watch_dir, PYTHON_MONITOR)
                for snapshot in self._snapshots(self.connection.lines(monitor)):
                    self._update(snapshot)
                raise SshError(f"{self.label}: the monitor command ended", "disconnected")
            except SshError as error:
                self.mark_down(str(error))
                time.sleep(RECONNECT_BACKOFF_S[min(failures, len(RECONNECT_BACKOFF_S) - 1)])
                failures += 1
            except Exception:  # the monitor must outlive anything: trials depend on it
                log.exception("%s: the monitor failed; restarting it", self.label)
                time.sleep(1.0)

    def _up(self) -> None:
        with self._lock:
            self.down_since = None
            self.down_reason = ""
            wakes = list(self._followers.values())
        for wake in wakes:
            wake()

    @staticmethod
    def _snapshots(lines: Iterator[str]) -> Iterator[dict[str, AttemptFiles]]:
        current: dict[str, dict[str, int | bool]] = {}
        for line in lines:
            if line == ".":
                yield {key: AttemptFiles(**fields) for key, fields in current.items()}  # type: ignore[arg-type]
                current = {}
            elif line.startswith("dead "):
                current.setdefault(line[5:], {})["dead"] = True
            elif line:
                path, _, size = line.rpartition(" ")
                key, _, name = path.partition("/")
                entry = current.setdefault(key, {})
                if name == "stdout":
                    entry["stdout"] = int(size)
                elif name == ".nni/metrics":
                    entry["metrics"] = int(size)
                elif name == "exit":
                    entry["exited"] = True

    def _update(self, snapshot: dict[str, AttemptFiles]) -> None:
        with self._lock:
            changed = [
                wake
                for key, wake in self._followers.items()
                if snapshot.get(key, AttemptFiles()) != self._files.get(key, AttemptFiles())
            ]
            self._files = snapshot  # all of it: an attempt may be followed after its files were last seen
        for wake in changed:
            wake()
