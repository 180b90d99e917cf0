"""The remote platform: trials run on machines reached over SSH (NNI's `remote` training service).

A trial goes to a machine of the list with free capacity (GPU-aware, by the local platform's rules,
with each host's GPUs read from its own `nvidia-smi`), in its own directory there, detached from the
SSH session. The worker follows it through its files (workers.platforms.remote.machine): metrics from its stdout
and metrics file, read from offsets committed with the metric events, so neither a dropped connection
nor a restarted worker loses or repeats one. The host never connects back to anything.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import random
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import redis

from core import keys
from core.leases import AttemptRef
from core.platform import (
    Abandoned,
    Deferred,
    Lost,
    OutputStream,
    OutputUnavailable,
    StopRequest,
    TrialAssignment,
    TrialControl,
    TrialOutcome,
)
from core.settings import Settings
from schemas.events import TrialLaunchSpec
from schemas.trial import TrialJobStatus
from workers.platforms.remote.config import RemoteConfig, RemoteMachine
from workers.platforms.remote.machine import PROCESS_FUNCTIONS, RemoteHost, probe, script
from workers.platforms.remote.settings import RemoteSettings
from workers.platforms.remote.ssh import SshError, SshPool
from workers.platforms.shared.code_package import CodeDirectoryError, CodePackage, check_size, pack
from workers.platforms.shared.gpu import (
    GpuLedger,
    GpuPolicy,
    GpuQueryError,
    GpuRequestImpossible,
    NoGpuSource,
    cuda_visible_devices,
)
from workers.platforms.shared.output_reader import READ_LIMIT, OutputReader
from workers.platforms.shared.trial_contract import (
    TrialPaths,
    failure_message,
    nni_environment,
    parameter_file_name,
)

log = logging.getLogger(__name__)

FOLLOW_IDLE_S = 5.0  # a safety net: the monitor, a stop, a lost lease or a lost host wake a follower at once
DOWN_CHECK_S = 0.5  # while the host is down: how often UNKNOWN and unreachableTimeout are checked
UNKNOWN_AFTER_S = 2.0  # a connection down this long makes the trial UNKNOWN (a quick reconnect does not)
STDERR_TAIL = 2000
SWEEP_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)  # between tries to reach a host where lost attempts are left to kill

# $1 attempt dir, $2 staged code, $3 watch dir, $4 key, $5 command, $6 pythonPath (relative to the home), then
# NAME=VALUE for the environment; parameter.cfg on stdin. Prints "pid dir"; idempotent. docs/platforms.md, Remote.
_LAUNCH = (
    PROCESS_FUNCTIONS
    + r"""
set -e
d="$HOME/$1"; code="$HOME/$2"; watch="$HOME/$3"; key="$4"; command="$5"; python_path="$6"
shift 6
if [ -e "$d/pid" ]; then recorded "$d" || :; mkdir -p "$watch"; ln -sfn "$d" "$watch/$key"; echo "$p $d"; exit 0; fi
rm -rf "$d"
mkdir -p "$d/.nni" "$d/code" "$watch"
cp -R "$code/." "$d/code/"
cat > "$d/parameter.cfg"
cat /proc/sys/kernel/random/boot_id > "$d/boot_id" 2>/dev/null || :
[ -z "$python_path" ] || PATH="$python_path:$PATH"
export PATH NNI_SYS_DIR="$d" NNI_OUTPUT_DIR="$d" NNI_CODE_DIR="$d/code"
cd "$d/code"
env "$@" setsid sh -c 'sh -c "$2" > "$1/stdout" 2> "$1/stderr" < /dev/null
echo $? > "$1/exit.partial"; mv "$1/exit.partial" "$1/exit"' trial "$d" "$command" < /dev/null > /dev/null 2>&1 &
p=$!
trap 'kill -s KILL -- "-$p" "$p" 2>/dev/null; rm -f "$d/pid" "$d/pid.partial"' EXIT
started "$p" || :
echo "$p $s" > "$d/pid.partial"; mv "$d/pid.partial" "$d/pid"
ln -sfn "$d" "$watch/$key"
trap - EXIT
echo "$p $d"
"""
)

# $1 attempt dir, $2 tenths of a second to wait after SIGTERM before SIGKILL, for the trial's process group
# (unless its pid is another process's by now). Whether a process of the group is left is read through /proc
# with builtins (zombies do not count).
_KILL = (
    PROCESS_FUNCTIONS
    + r"""
group "$1" || exit 0
g="$p"; grace="$2"
alive() {
  for f in /proc/[0-9]*/stat; do
    l=; read -r l 2>/dev/null < "$f" || continue
    set -- ${l##*) }
    [ "$3" = "$g" ] && [ "$1" != Z ] && return 0
  done
  return 1
}
kill -s TERM -- "-$g" 2>/dev/null || exit 0
i=0
while alive && [ "$i" -lt "$grace" ]; do sleep 0.1; i=$((i + 1)); done
kill -s KILL -- "-$g" 2>/dev/null
exit 0
"""
)

# $@ attempt dirs (of lost attempts): what still runs of each is killed.
_KILL_ATTEMPTS = (
    PROCESS_FUNCTIONS
    + r"""
for d; do group "$d" && kill -s KILL -- "-$p" 2>/dev/null; done
exit 0
"""
)

# $1 attempt dir: its absolute path, then "running", "exited", or why nothing of the attempt runs there.
_STATE = (
    PROCESS_FUNCTIONS
    + r"""
d="$1"
echo "$HOME/$d"
[ -e "$d/exit" ] && { echo exited; exit 0; }
recorded "$d" || { echo "never started"; exit 0; }
runs "$d" && { echo running; exit 0; }
[ -e "$d/exit" ] && { echo exited; exit 0; }
b=; read -r b 2>/dev/null < /proc/sys/kernel/random/boot_id
o=; read -r o 2>/dev/null < "$d/boot_id"
if [ -n "$o" ] && [ "$b" != "$o" ]; then echo rebooted; else echo vanished; fi
"""
)

# $1 root, $2 experiment, $3 "keep" or not: what still runs of the experiment is killed (attempts that
# ended are left alone), then its files go.
_CLEAN_UP = (
    PROCESS_FUNCTIONS
    + r"""
root="$1"; experiment="$2"; keep="$3"
for d in "$root/experiments/$experiment"/*/attempt-*; do
  [ -e "$d/exit" ] || ! group "$d" || kill -s KILL -- "-$p" 2>/dev/null
done
rm -f "$root"/watch/*/"$experiment".*
[ "$keep" = keep ] || rm -rf "$root/experiments/$experiment"
exit 0
"""
)


class NotStarted(Exception):
    """Nothing of the trial runs on the host: staging its code or its launch failed there. `answered`: the
    host answered and cannot take it (a full disk); else it could not be reached."""

    def __init__(self, reason: str, answered: bool) -> None:
        super().__init__(reason)
        self.answered = answered


class RemotePlatform:
    name: ClassVar[str] = "remote"
    config_model: ClassVar[type[RemoteConfig]] = RemoteConfig
    trials_per_process: ClassVar[int] = 256
    trials_outlive_worker: ClassVar[bool] = True

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.settings = settings
        self.own = settings.of(RemoteSettings)
        self.client = client
        self.pool = SshPool()
        self.watcher = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._hosts: dict[tuple[str | None, ...], RemoteHost] = {}  # one per machine entry (experiments differ)
        self._hosts_lock = threading.Lock()
        self._packages: dict[str, CodePackage] = {}
        self._cache = Path(tempfile.mkdtemp(prefix="trialstream-code-"))
        self._sweeping: set[str] = set()  # hosts this worker tries to reach to kill lost attempts left there
        self._sweeping_lock = threading.Lock()
        self._closed = threading.Event()

    @classmethod
    def check(cls, config: RemoteConfig, code_directory: Path, settings: Settings) -> list[str]:
        """Every machine connected and probed at once (auth, host key, a shell, the tools, pythonPath),
        and the code directory within what NNI lets a platform copy."""
        problems: list[str] = []
        try:
            check_size(code_directory)
        except (CodeDirectoryError, OSError) as error:
            problems.append(f"trialCodeDirectory: {error}")
        own = settings.of(RemoteSettings)
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(config.machine_list))) as pool:
            found = pool.map(lambda machine: probe(machine, own), config.machine_list)
            problems += [problem for problem in found if problem]
        return problems

    def stage(self, experiment_id: str, launch: TrialLaunchSpec, config: RemoteConfig) -> None:
        """Pack the code directory once per experiment and worker; hosts get it when a trial goes there."""
        self._packages[experiment_id] = pack(Path(launch.code_directory), self._cache / f"{experiment_id}.tgz")

    def run_trial(
        self, trial: TrialAssignment[RemoteConfig], control: TrialControl
    ) -> TrialOutcome | Deferred | Lost | Abandoned:
        config = trial.platform_config
        not_started: dict[str, NotStarted] = {}  # host label -> why the trial could not start there
        while True:
            placed = self._place(trial, config, not_started)
            if not isinstance(placed, RemoteHost):
                return placed
            follower = _AttemptFollower(self, placed, trial, control, config)
            try:
                follower.launch(self._packages[trial.experiment_id])
            except NotStarted as error:  # its place there is freed, and another machine tried
                self._ledger(placed).release(attempt_member(trial))
                not_started[placed.label] = error
                continue
            except SshError as error:  # it may have started there: followed as such, and asked again (idempotent)
                follower.relaunch = self._packages[trial.experiment_id]
                if not placed.connection.connected:
                    placed.mark_down(str(error))  # UNKNOWN, then lost, unless the host is back in time
            return self._followed(placed, follower)

    def reattach(
        self, trial: TrialAssignment[RemoteConfig], control: TrialControl
    ) -> TrialOutcome | Lost | Abandoned | None:
        config = trial.platform_config
        host = self._host_holding(trial, config)
        if host is None:
            return None  # never placed, or its end was already recorded
        follower = _AttemptFollower(self, host, trial, control, config)
        follower.gpus = self._held_gpus(host, trial)
        try:
            state = follower.state()
        except SshError as error:  # whether it started is not known: launched again (idempotent) once reached
            follower.relaunch = self._packages[trial.experiment_id]
            if not host.connection.connected:
                host.mark_down(str(error))  # unreachable now: followed as down (UNKNOWN, then lost)
            return self._followed(host, follower)
        if state == "never started":
            self._ledger(host).release(attempt_member(trial))
            return None
        follower.unknown = True  # its view may say UNKNOWN (its last worker lost the host): RUNNING once reached
        return self._followed(host, follower)

    def _followed(self, host: RemoteHost, follower: _AttemptFollower) -> TrialOutcome | Lost | Abandoned:
        """Follow the attempt to its end, then free its place on the host. A lost attempt keeps it (its
        release, queued with the loss, kills what may still run there); so does an abandoned one (the
        worker that took it over follows it). Any other failure kills the trial: nobody would follow it."""
        outcome: TrialOutcome | Lost | Abandoned | None = None
        try:
            outcome = follower.follow()
            return outcome
        except Exception:
            with contextlib.suppress(Exception):
                follower.kill()
            raise
        finally:
            if not isinstance(outcome, Lost | Abandoned):
                self._ledger(host).release(attempt_member(follower.trial))

    def release(self, trial: TrialAssignment[RemoteConfig]) -> None:
        """Kill what is left of a lost attempt on its host and free its place. A host that cannot be reached
        now has the attempt put on its list of attempts to kill, which the next worker to reach it kills."""
        config = trial.platform_config
        host = self._host_holding(trial, config)
        if host is not None:
            directory = host.attempt_dir(trial.experiment_id, trial.trial_id, trial.attempt)
            try:
                host.run(_KILL_ATTEMPTS, directory)
            except SshError as error:
                log.warning("%s; attempt %s is killed once the host is reached again", error, directory)
                self._doom(host, directory)
        GpuLedger(self.client, "", NoGpuSource()).release_everywhere(attempt_member(trial))

    def read_output(self, trial: TrialAssignment[RemoteConfig], url: str, stream: OutputStream, offset: int) -> bytes:
        config = trial.platform_config
        for machine in config.machine_list:
            prefix = f"ssh://{machine.user}@{machine.host}:{machine.port}"
            if url.startswith(prefix + "/"):
                host = self._host(machine)
                path = f"{url.removeprefix(prefix)}/{stream}"
                try:
                    return host.connection.read(path, offset, READ_LIMIT)
                except FileNotFoundError:
                    raise OutputUnavailable(
                        f"{host.label}: {path} does not exist (removed when the experiment was cleaned up?)"
                    ) from None
                except SshError as error:
                    raise OutputUnavailable(str(error)) from None
        raise OutputUnavailable(f"{url} is not on a machine of the experiment's machineList")

    def clean_up(self, experiment_id: str, config: RemoteConfig) -> None:
        keep = "keep" if config.keep_trial_files else "remove"
        for machine in config.machine_list:
            host = self._host(machine)
            try:
                host.run(_CLEAN_UP, host.root, experiment_id, keep)
            except SshError as error:
                log.warning("clean-up of experiment %s: %s", experiment_id, error)

    def close(self) -> None:
        self._closed.set()
        self.pool.close()
        for package in self._packages.values():
            package.path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self._cache.rmdir()

    # placement

    def _host(self, machine: RemoteMachine) -> RemoteHost:
        secrets = (machine.password, machine.ssh_passphrase)  # masked in the JSON, so part of the key apart
        key = (machine.model_dump_json(), *(secret.get_secret_value() if secret else None for secret in secrets))
        with self._hosts_lock:
            host = self._hosts.get(key)
            if host is None:
                host = RemoteHost(machine, self.pool, self.own, self.watcher)
                self._hosts[key] = host
            return host

    def _ledger(self, host: RemoteHost) -> GpuLedger:
        return GpuLedger(self.client, f"remote:{host.label}", host)

    def _place(
        self, trial: TrialAssignment[RemoteConfig], config: RemoteConfig, not_started: Mapping[str, NotStarted]
    ) -> RemoteHost | Deferred | TrialOutcome:
        """The machine with the fewest of our trials among those that can take this one now (and where it
        has not failed to start in this delivery), its GPUs reserved in the machine's ledger; else wait
        (Deferred) or, if no machine can (ever, or now that it failed to start on the others), fail."""
        member = attempt_member(trial)
        earlier = self._host_holding(trial, config, search_hosts=False)
        if earlier is not None:  # an earlier delivery placed it there, and may have launched it
            return earlier
        hosts = [self._host(machine) for machine in config.machine_list]
        random.shuffle(hosts)  # among machines as loaded, any: trials placed at once, seeing the same loads, spread
        load = {host.label: self.client.hlen(self._ledger(host).holders_key) for host in hosts}
        cannot = [str(error) for error in not_started.values() if error.answered]
        impossible: list[str] = []
        unreachable = [str(error) for error in not_started.values() if not error.answered]
        busy = 0
        for host in sorted(hosts, key=lambda host: (host.down_since is not None, load[host.label])):
            if host.label in not_started:
                continue
            policy = _policy(trial, host.machine)
            ledger = self._ledger(host)
            try:
                host.connection.connect()  # at once when connected; a host that went away is skipped
                self._kill_doomed(host)
                gpus = ledger.reserve(member, policy)
            except GpuRequestImpossible as error:
                impossible.append(f"{host.label}: {error}")
                continue
            except (SshError, GpuQueryError) as error:
                unreachable.append(str(error))
                continue
            if gpus is None:
                busy += 1
                continue
            if not gpus:
                self.client.hset(ledger.holders_key, member, "[]")  # counted in the machine's load
            return host
        if len(impossible) + len(cannot) == len(hosts):
            ever = "" if cannot else " ever"
            return TrialOutcome(
                TrialJobStatus.FAILED, message=f"no machine can{ever} run it: " + "; ".join(cannot + impossible)
            )
        if busy:
            count = trial.launch.gpu_number or 0
            return Deferred(f"waiting for {count} free GPU{'s' if count != 1 else ''} on any machine")
        return Deferred("no machine can be reached: " + "; ".join(unreachable))

    def _held_gpus(self, host: RemoteHost, trial: TrialAssignment[RemoteConfig]) -> list[int]:
        held = self.client.hget(self._ledger(host).holders_key, attempt_member(trial))
        return [int(index) for index in json.loads(held)] if held else []

    def _host_holding(
        self, trial: TrialAssignment[RemoteConfig], config: RemoteConfig, search_hosts: bool = True
    ) -> RemoteHost | None:
        """Where the attempt was placed: its ledger entry, written before it was launched; else (its
        worker died between freeing the entry and recording the end) the host that has its directory."""
        member = attempt_member(trial)
        hosts = [self._host(machine) for machine in config.machine_list]
        for host in hosts:
            if self.client.hexists(self._ledger(host).holders_key, member):
                return host
        for host in hosts if search_hosts else []:
            directory = host.attempt_dir(trial.experiment_id, trial.trial_id, trial.attempt)
            with contextlib.suppress(SshError):
                if host.run('test -e "$1/pid"', directory).exit_code == 0:
                    return host
        return None

    # lost attempts on hosts that could not be reached when they were released

    @staticmethod
    def _doomed_key(host: RemoteHost) -> str:
        """Set: directories of lost attempts on the host that could not be killed when they were released (it
        was unreachable): the next worker to reach it kills them."""
        return f"{keys.LOG_PREFIX}:doomed:remote:{host.label}"

    def _doom(self, host: RemoteHost, directory: str) -> None:
        """The attempt in `directory` must not run on, but its host cannot be reached now: kill it when it can."""
        self.client.sadd(self._doomed_key(host), directory)
        self._sweep_when_back(host)

    def _kill_doomed(self, host: RemoteHost) -> None:
        """Kill the lost attempts listed for the host, now that it answers (raises SshError if it does not)."""
        key = self._doomed_key(host)
        directories = sorted(str(directory) for directory in self.client.smembers(key))  # a decoding client
        if directories:
            host.run(_KILL_ATTEMPTS, *directories)
            self.client.srem(key, *directories)
            log.info("%s: killed what was left of %d lost attempt(s) there", host.label, len(directories))

    def _sweep_when_back(self, host: RemoteHost) -> None:
        """Keep trying to reach the host (backing off) until its list of attempts to kill is empty, so that a
        lost attempt does not run on beside its retry once the host is back; one such thread per host."""
        with self._sweeping_lock:
            if host.label in self._sweeping:
                return
            self._sweeping.add(host.label)
        threading.Thread(target=self._sweep, args=(host,), name=f"sweep-{host.label}", daemon=True).start()

    def _sweep(self, host: RemoteHost) -> None:
        failures = 0
        while not self._closed.wait(SWEEP_BACKOFF_S[min(failures, len(SWEEP_BACKOFF_S) - 1)]):
            try:
                self._kill_doomed(host)
                with self._sweeping_lock:
                    if not self.client.scard(self._doomed_key(host)):
                        self._sweeping.discard(host.label)
                        return
            except (SshError, redis.RedisError) as error:
                log.debug("%s: still cannot kill the lost attempts there: %s", host.label, error)
                failures += 1
        with self._sweeping_lock:
            self._sweeping.discard(host.label)


def _policy(trial: TrialAssignment[RemoteConfig], machine: RemoteMachine) -> GpuPolicy:
    return GpuPolicy(
        gpu_number=trial.launch.gpu_number,
        gpu_indices=tuple(machine.gpu_indices) if machine.gpu_indices is not None else None,
        max_trials_per_gpu=machine.max_trial_number_per_gpu,
        use_active_gpu=bool(machine.use_active_gpu),
    )


def attempt_member(trial: TrialAssignment[RemoteConfig]) -> str:
    return AttemptRef(trial.experiment_id, trial.trial_id, trial.attempt).member


class _AttemptFollower:
    """One attempt of a trial on its host: launched, then followed to its end."""

    def __init__(
        self,
        platform: RemotePlatform,
        host: RemoteHost,
        trial: TrialAssignment[RemoteConfig],
        control: TrialControl,
        config: RemoteConfig,
    ) -> None:
        self.platform = platform
        self.host = host
        self.trial = trial
        self.control = control
        self.config = config
        self.key = f"{trial.experiment_id}.{trial.trial_id}.{trial.attempt}"
        self.directory = host.attempt_dir(trial.experiment_id, trial.trial_id, trial.attempt)
        self.output = OutputReader(control, self._read, "stdout")
        self.absolute = self.directory  # made absolute by the launch or a state check (its host's $HOME)
        self.gpus: list[int] = []  # held on the host, known once launched
        self.unknown = False
        self.relaunch: CodePackage | None = None  # the launch's answer was lost: whether it started is not known
        self.linked = False  # in this worker's watch directory, so its monitor reports it
        self.start_recorded = False

    def launch(self, package: CodePackage) -> None:
        """Stage the code and start the trial. NotStarted: nothing of it runs there. SshError: the connection
        dropped while the launch ran, which may have started the trial."""
        try:
            code_dir = self.host.stage(package)
        except (SshError, OSError) as error:  # "error": the host answered (a full disk), not a timeout or a drop
            answered = self.host.connection.connected and getattr(error, "kind", "error") == "error"
            raise NotStarted(str(error) if answered else f"{error} (while staging the code)", answered) from error
        trial = self.trial
        self.gpus = gpus = self.platform._held_gpus(self.host, trial)
        policy = _policy(trial, self.host.machine)
        paths = TrialPaths(sys_dir=self.directory, output_dir=self.directory, code_dir=f"{self.directory}/code")
        environment = nni_environment({}, RemotePlatform.name, trial, paths, cuda_visible_devices(policy, gpus))
        for set_by_the_launch in ("NNI_SYS_DIR", "NNI_OUTPUT_DIR", "NNI_CODE_DIR"):  # absolute only there
            environment.pop(set_by_the_launch)
        result = self.host.connection.run(
            script(
                _LAUNCH,
                self.directory,
                code_dir,
                self.host.watch_dir,
                self.key,
                trial.launch.command,
                self.host.machine.python_path or "",
                *(f"{name}={value}" for name, value in environment.items()),
            ),
            stdin=trial.form.hyper_parameters.value.encode(),
        )
        if result.exit_code == -1:  # killed by a signal: it may have started the trial (the next launch tells)
            raise SshError(f"{self.host.label}: the launch was killed before it finished", "error")
        if result.exit_code != 0:  # it failed, and killed what it had started
            problem = result.stderr.decode(errors="replace").strip()
            raise NotStarted(f"{self.host.label}: the trial could not be started: {problem}", answered=True)
        self.absolute = result.stdout.decode().strip().partition(" ")[2]
        self.linked = True

    def _link(self) -> None:
        """Follow an attempt launched by another worker: link it into this worker's watch directory
        (again once the host is back, if it was down when the attempt was taken up)."""
        link = 'mkdir -p "$2" && ln -sfn "$HOME/$1" "$2/$3" && echo "$HOME/$1"'
        linked = self.host.run(link, self.directory, self.host.watch_dir, self.key)
        if linked.exit_code != 0:
            raise OSError(f"cannot follow the trial: {linked.stderr.decode(errors='replace').strip()}")
        self.absolute = linked.stdout.decode().strip()
        self.linked = True

    def _record_start(self) -> None:
        """TrialStarted, once per attempt whoever follows it (the key `started:<trial>:<attempt>` keeps one):
        a worker that re-attaches records it too, in case its predecessor died before it could."""
        url = self.host.url(self.absolute)
        self.control.started(self.absolute, url=url, gpu_indices=self.gpus or None)
        self.start_recorded = True

    def state(self) -> str:
        absolute, _, state = self.host.run(_STATE, self.directory).stdout.decode().strip().partition("\n")
        self.absolute = absolute
        return state

    def follow(self) -> TrialOutcome | Lost | Abandoned:
        self.host.follow(self.key, self.control.wake)
        try:
            return self._follow()
        finally:
            self.host.unfollow(self.key)
            with contextlib.suppress(SshError):
                self.host.run('rm -f "$1/$2"', self.host.watch_dir, self.key)

    def _follow(self) -> TrialOutcome | Lost | Abandoned:
        control = self.control
        while True:
            down_since = self.host.down_since
            if down_since is not None:
                ended = self._while_down(time.monotonic() - down_since)
                if ended is not None:
                    return ended
                control.wait(DOWN_CHECK_S)
                continue
            try:
                ended = self._round()
                if ended is not None:
                    return ended
            except SshError as error:
                if not self.host.connection.connected:
                    self.host.mark_down(str(error))  # the monitor reconnects, and says when the host is back
                else:
                    log.warning(
                        "trial %s: %s; retrying",
                        self.trial.trial_id,
                        error,
                        extra={"experiment": self.trial.experiment_id, "trial": self.trial.trial_id},
                    )
                    control.wait(FOLLOW_IDLE_S)
                continue
            except OSError as error:  # its files cannot be read (removed, or their permissions changed)
                with contextlib.suppress(SshError, OSError):
                    self.kill()
                return TrialOutcome(TrialJobStatus.FAILED, message=f"{self.host.label}: {error}")
            control.wait(FOLLOW_IDLE_S)

    def _round(self) -> TrialOutcome | Lost | Abandoned | None:
        """One look at the trial while its host answers: its start, output, new forms, end or stop."""
        control = self.control
        stop = control.stop_request()
        if stop is not None and stop.lease_lost:  # another worker follows it now: leave it running
            return Abandoned(stop.reason)
        if self.relaunch is not None:
            relaunched = self._relaunch(self.relaunch, stop)
            if relaunched is not None:
                return relaunched
        if not self.linked:
            self._link()
        if not self.start_recorded:
            self._record_start()
        if self.unknown:
            control.unreachable(None)
            self.unknown = False
        files = self.host.files(self.key)
        self.output.pull(False, files.stdout, files.metrics)
        for form in control.new_forms():
            name = parameter_file_name(form.hyper_parameters.index)
            self.host.connection.write(f"{self.directory}/{name}", form.hyper_parameters.value.encode())
        if files.exited:
            return self._exited()
        if files.dead:
            vanished = self._vanished()
            if vanished is not None:
                return vanished
        if stop is not None:
            self.kill()
            self.output.pull(True)
            return TrialOutcome(stop.status, message=stop.reason)
        return None

    def _relaunch(self, package: CodePackage, stop: StopRequest | None) -> TrialOutcome | None:
        """The host answers again after a launch whose answer was lost: stopped, whatever may run is killed;
        else the launch runs again, which starts the trial only if the first one did not."""
        if stop is not None:
            self.kill()
            return TrialOutcome(stop.status, message=stop.reason)
        try:
            self.launch(package)
        except NotStarted as error:
            if not error.answered:
                raise SshError(str(error), "disconnected") from error
            return TrialOutcome(TrialJobStatus.FAILED, message=str(error))
        self.relaunch = None
        return None

    def _while_down(self, down_s: float) -> TrialOutcome | Lost | Abandoned | None:
        """The host cannot be reached: UNKNOWN after a moment, lost after unreachableTimeout. A stop
        ends the attempt at once (what runs there is killed as soon as a worker reaches the host again)."""
        reason = f"{self.host.label} unreachable: {self.host.down_reason}"
        stop = self.control.stop_request()
        if stop is not None and stop.lease_lost:
            return Abandoned(stop.reason)
        if stop is not None:
            self.platform._doom(self.host, self.directory)
            return TrialOutcome(stop.status, message=f"{stop.reason} (while {reason})")
        if down_s >= self.config.unreachable_timeout:
            return Lost(f"host {reason} for {down_s:.0f}s (unreachableTimeout {self.config.unreachable_timeout:g}s)")
        if down_s >= UNKNOWN_AFTER_S and not self.unknown:
            self.control.unreachable(reason)
            self.unknown = True
        return None

    def _exited(self) -> TrialOutcome:
        self.output.pull(True)
        code = int(self.host.connection.read(f"{self.directory}/exit", 0).strip() or b"-1")
        if code == 0:
            return TrialOutcome(TrialJobStatus.SUCCEEDED, exit_code=0)
        tail = self.host.run('tail -c "$2" "$1/stderr" 2>/dev/null', self.directory, str(STDERR_TAIL)).stdout
        message = failure_message(code, tail.decode(errors="replace").strip())
        return TrialOutcome(TrialJobStatus.FAILED, exit_code=code, message=f"{message} (on {self.host.label})")

    def _vanished(self) -> TrialOutcome | None:
        """The monitor saw no process and no exit code: why (None: a false alarm, it runs)."""
        state = self.state()
        if state == "running":
            return None
        self.output.pull(True)
        if state == "exited":
            return self._exited()
        if state == "rebooted":
            why = f"{self.host.label} was rebooted while the trial ran"
        else:
            why = f"the trial's process on {self.host.label} ended without an exit code (killed from outside?)"
        return TrialOutcome(TrialJobStatus.FAILED, message=why)

    def kill(self) -> None:
        """SIGTERM to the trial's process group, SIGKILL after the grace period."""
        tenths = str(int(self.platform.settings.kill_grace_s * 10))
        self.host.run(_KILL, self.directory, tenths, timeout_s=self.platform.settings.kill_grace_s + 30)

    def _read(self, name: str, offset: int, limit: int) -> bytes:
        try:
            return self.host.connection.read(f"{self.directory}/{name}", offset, limit)
        except FileNotFoundError:
            return b""
