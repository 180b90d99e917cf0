"""Real OpenSSH sshd hosts for tests of a platform that runs trials over SSH: no mocked SSH.

Each host is a `/usr/sbin/sshd -D` with its own config, started by pytest (as root), in its own network namespace
(a veth pair on a private /30, port 22, so hosts are truly separate and can be taken off the network) or, where
`ip netns` is not available (or TRIALSTREAM_SSHD_MODE=loopback), on its own loopback address (127.0.0.N). Either way
each host also gets its own mount and UTS namespace: its own hostname and its own copy of the test user's home
directory, so two hosts never share files by accident, and its own boot id (a file bind-mounted over
/proc/sys/kernel/random/boot_id), which `reboot()` changes as a real reboot does.

Sessions log in as a dedicated user (`tstrial`, created once per machine) rather than root, whose shell start-up here
is slow. Its PATH is set by sshd (`SetEnv PATH=...`, no shell start-up file involved): the host's own bin directory
(for fakes such as `nvidia-smi`), then the directory of the python3 running the tests, then the system directories.
Where that python lives under a directory the user cannot traverse (pyenv under /root), an ACL grants it `x` there.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import pwd
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from simulators.processes import descendants, parents, process_gone
from simulators.waiting import wait_until

Mode = Literal["netns", "loopback"]

TEST_USER = "tstrial"
SSHD = "/usr/sbin/sshd"
BOOT_ID = "/proc/sys/kernel/random/boot_id"  # how a process tells a rebooted machine: this changes with each boot
STATE_DIR = Path("/var/lib/trialstream-tests")  # root-only: the test user's password and the machine-wide lock
MODE_ENV = "TRIALSTREAM_SSHD_MODE"  # "netns" or "loopback" forces a mode; unset: netns where `ip netns` works
NAME_PREFIX = "tssh"  # network namespaces are named tssh-<pytest pid>-<n>: stale ones are found by a dead pid
BASE_PREFIX = "trialstream-sshd-"  # temp dirs are /tmp/trialstream-sshd-<pytest pid>-*
SUBNET = "10.234"  # host n of the machine gets 10.234.<k>.2/30, the root side 10.234.<k>.1
DEADLINE_S = 10.0
_host_numbers = itertools.count()


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited with {result.returncode}: {result.stderr.strip()}")
    return result


@contextlib.contextmanager
def _machine_lock() -> Iterator[None]:
    """Serialises user set-up and subnet choice between pytest runs of several worktrees on one machine."""
    STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    with (STATE_DIR / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _pid_alive(pid: int) -> bool:
    return not process_gone(pid)


def _mount_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_until(lambda: all(map(process_gone, pids)), DEADLINE_S, what=f"{pids} to die")


@dataclass(frozen=True)
class SshUser:
    """The account trials log in as on every host, with both ways in: an ed25519 key pair and a password."""

    name: str
    uid: int
    gid: int
    home: str  # as /etc/passwd says; on each host a bind mount of that host's own directory
    password: str
    private_key: Path  # OpenSSH format, no passphrase; paramiko: key_filename=str(private_key)
    public_key: str  # one authorized_keys line


@dataclass(frozen=True)
class SshEnvironment:
    """What every host of a pytest run shares: the mode, the user and a temp dir removed at the end."""

    mode: Mode
    user: SshUser
    base_dir: Path
    python_dir: str  # directory of the tests' python3, on each host's PATH


def _ensure_user() -> tuple[pwd.struct_passwd, str]:
    """Creates the test user once per machine; its random password lives in a root-only file so runs agree."""
    with _machine_lock():
        try:
            entry = pwd.getpwnam(TEST_USER)
        except KeyError:
            _sh("useradd", "--create-home", "--user-group", "--shell", "/bin/bash", TEST_USER)
            entry = pwd.getpwnam(TEST_USER)
        password_file = STATE_DIR / f"{TEST_USER}.password"
        if not password_file.exists():
            password_file.write_text(secrets.token_urlsafe(18))
            password_file.chmod(0o600)
        password = password_file.read_text().strip()
        subprocess.run(["chpasswd"], input=f"{TEST_USER}:{password}\n", text=True, check=True, capture_output=True)
        Path(entry.pw_dir).mkdir(exist_ok=True)  # the bind-mount target on every host
    return entry, password


def _grant_python(entry: pwd.struct_passwd) -> None:
    """Lets the test user traverse (x only, by ACL) the directories above the tests' python (pyenv under /root)."""
    paths = {sys.executable, os.path.realpath(sys.executable), sys.prefix, sys.base_prefix}
    for path in paths:
        for directory in Path(path).parents:
            if not os.stat(directory).st_mode & stat.S_IXOTH:
                if shutil.which("setfacl") is None:
                    raise RuntimeError(f"{TEST_USER} cannot reach {path}: install `acl` (setfacl) or chmod o+x")
                _sh("setfacl", "-m", f"u:{TEST_USER}:x", str(directory))
    as_user = ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--init-groups"]
    found = _sh(*as_user, sys.executable, "-c", "import sys; print(sys.version)", check=False)
    if found.stdout.strip() != sys.version.strip():
        raise RuntimeError(f"{TEST_USER} cannot run {sys.executable}: {found.stderr.strip()}")


def local_test_user() -> pwd.struct_passwd:
    """The test user (created once per machine) able to run the tests' python: for a test that needs processes
    of a user other than root, which reads every process's /proc whatever it is."""
    entry, _ = _ensure_user()
    _grant_python(entry)
    return entry


def detect_mode() -> Mode:
    """netns where `ip netns add` works (root with CAP_SYS_ADMIN), loopback addresses otherwise."""
    forced = os.environ.get(MODE_ENV)
    if forced in ("netns", "loopback"):
        return forced  # type: ignore[return-value]
    if shutil.which("ip") is None:
        return "loopback"
    probe = f"{NAME_PREFIX}-{os.getpid()}-probe"
    if _sh("ip", "netns", "add", probe, check=False).returncode != 0:
        return "loopback"
    _sh("ip", "netns", "del", probe, check=False)
    return "netns"


def clean_stale() -> None:
    """Removes what a killed pytest run (no teardown) left: its namespaces, its sshd processes, its temp dirs."""
    if shutil.which("ip"):
        for line in _sh("ip", "netns", "list", check=False).stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            parts = name.split("-")
            if len(parts) >= 3 and parts[0] == NAME_PREFIX and parts[1].isdigit() and not _pid_alive(int(parts[1])):
                pids = [int(pid) for pid in _sh("ip", "netns", "pids", name, check=False).stdout.split()]
                _kill_all(pids)
                _sh("ip", "netns", "del", name, check=False)
        with _machine_lock():  # `unreachable` routes of stopped hosts whose veth (and address) is gone
            addresses = _sh("ip", "-o", "-4", "addr", "show").stdout
            for line in _sh("ip", "-4", "route", "show", "type", "unreachable", check=False).stdout.splitlines():
                subnet = next((word for word in line.split() if word.startswith(f"{SUBNET}.")), "")
                if subnet and f" {subnet.rsplit('.', 1)[0]}." not in addresses:
                    _sh("ip", "route", "del", "unreachable", subnet, check=False)
    for base in Path(tempfile.gettempdir()).glob(f"{BASE_PREFIX}*"):
        owner = base.name.removeprefix(BASE_PREFIX).split("-")[0]
        if owner.isdigit() and not _pid_alive(int(owner)):
            stale = []
            for pid in parents():
                with contextlib.suppress(OSError):
                    if str(base) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                        stale.append(pid)
            _kill_all(stale)
            shutil.rmtree(base, ignore_errors=True)


def make_environment() -> SshEnvironment:
    """Checks the machine, sets up the user and a client key pair; skips where sshd hosts cannot run at all."""
    if os.geteuid() != 0:
        pytest.skip("sshd hosts need root (useradd, namespaces, privilege separation)")
    for tool in (SSHD, "ssh-keygen", "unshare", "nsenter", "setpriv"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (apt-get install openssh-server util-linux)")
    clean_stale()
    entry, password = _ensure_user()
    _grant_python(entry)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
    base_dir = Path(tempfile.mkdtemp(prefix=f"{BASE_PREFIX}{os.getpid()}-"))
    base_dir.chmod(0o755)  # the test user reaches each host's bin dir through it
    client_dir = base_dir / "client"
    client_dir.mkdir(mode=0o700)
    key = client_dir / "id_ed25519"
    _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "trialstream-tests", "-f", str(key))
    user = SshUser(
        name=TEST_USER,
        uid=entry.pw_uid,
        gid=entry.pw_gid,
        home=entry.pw_dir,
        password=password,
        private_key=key,
        public_key=key.with_suffix(".pub").read_text().strip(),
    )
    return SshEnvironment(detect_mode(), user, base_dir, os.path.dirname(sys.executable))


def _free_subnet() -> int:
    """The third octet of a 10.234.k.0/30 no interface uses (called under the machine lock)."""
    used = _sh("ip", "-o", "-4", "addr", "show").stdout + _sh("ip", "-4", "route", "show").stdout
    for k in range(256):
        if f" {SUBNET}.{k}." not in used and f"{SUBNET}.{k}.0/30" not in used:
            return k
    raise RuntimeError(f"no free /30 left in {SUBNET}.0.0/16")


def _free_port(address: str) -> int:
    with socket.socket() as probe:
        probe.bind((address, 0))
        return int(probe.getsockname()[1])


def _banner(address: str, port: int) -> bool:
    """True once sshd answers with its banner (a bound port alone could still be a starting process)."""
    try:
        with socket.create_connection((address, port), timeout=1.0) as connection:
            return connection.recv(4).startswith(b"SSH-")
    except OSError:
        return False


class SshHost:
    """One machine reachable over SSH: its own sshd, address, hostname, home directory and host key."""

    def __init__(self, environment: SshEnvironment, index: int) -> None:
        self.environment = environment
        self.user = environment.user
        self.number = next(_host_numbers)
        self.hostname = f"trial-host-{index + 1}"
        self.dir = environment.base_dir / f"host-{self.number}"
        self.home = self.dir / "home"  # the user's home as this host sees it (readable from the tests as root)
        self.bin_dir = self.dir / "bin"  # first on this host's PATH: see add_command
        self.config_path = self.dir / "sshd_config"
        self.host_key_path = self.dir / "ssh_host_ed25519_key"
        self.pid_path = self.dir / "sshd.pid"
        self.log_path = self.dir / "sshd.log"
        self.boot_id_path = self.dir / "boot_id"  # what the host's processes read at BOOT_ID
        self.netns: str | None = None
        self.veth: str | None = None
        self.subnet: str | None = None  # netns: while the host is down, an `unreachable` route covers it
        self.process: subprocess.Popen[bytes] | None = None
        self.listener_pid: int | None = None
        self._mount_ns: str | None = None
        # held open while the host is up: a namespace lives while anything refers to it, so its inode number
        # (what _mount_ns names) cannot pass to another host's new namespace while this one still scans for it
        self._mount_ns_fd: int | None = None
        self.dir.mkdir(mode=0o755)
        self.bin_dir.mkdir(mode=0o755)
        (self.home / ".ssh").mkdir(parents=True, mode=0o700)
        (self.home / ".ssh" / "authorized_keys").write_text(self.user.public_key + "\n")
        for path in (self.home, self.home / ".ssh", self.home / ".ssh" / "authorized_keys"):
            os.chown(path, self.user.uid, self.user.gid)
        self.home.chmod(0o755)
        self._new_boot_id()
        self.new_host_key()
        try:
            self._attach_network(environment.mode, index)
        except BaseException:
            self.destroy()
            raise
        self._write_config()

    def _attach_network(self, mode: Mode, index: int) -> None:
        """netns: a namespace and a veth pair on a free /30, sshd on port 22; loopback: 127.0.0.N, a free port."""
        if mode == "netns":
            self.netns = f"{NAME_PREFIX}-{os.getpid()}-{self.number}"
            self.veth = f"tsh{os.getpid()}x{self.number}"[-15:]
            with _machine_lock():
                k = _free_subnet()
                self.subnet = f"{SUBNET}.{k}.0/30"
                _sh("ip", "netns", "add", self.netns)
                _sh("ip", "link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "netns", self.netns)
                _sh("ip", "addr", "add", f"{SUBNET}.{k}.1/30", "dev", self.veth)
            _sh("ip", "link", "set", self.veth, "up")
            _sh("ip", "-n", self.netns, "addr", "add", f"{SUBNET}.{k}.2/30", "dev", "eth0")
            _sh("ip", "-n", self.netns, "link", "set", "eth0", "up")
            _sh("ip", "-n", self.netns, "link", "set", "lo", "up")
            self.address, self.port = f"{SUBNET}.{k}.2", 22
        else:
            self.address = f"127.0.0.{index + 2}"
            self.port = _free_port(self.address)

    @property
    def path(self) -> str:
        """PATH of sessions on this host (set by sshd's SetEnv, so no shell start-up file is involved)."""
        return f"{self.bin_dir}:{self.environment.python_dir}:/usr/local/bin:/usr/bin:/bin"

    @property
    def host_key(self) -> str:
        """The host's public key, `ssh-ed25519 AAAA...` (no comment)."""
        return " ".join(self.host_key_path.with_suffix(".pub").read_text().split()[:2])

    @property
    def known_hosts_line(self) -> str:
        target = self.address if self.port == 22 else f"[{self.address}]:{self.port}"
        return f"{target} {self.host_key}"

    @property
    def boot_id(self) -> str:
        """The id the host's processes read at /proc/sys/kernel/random/boot_id: new after each reboot()."""
        return self.boot_id_path.read_text().strip()

    def _new_boot_id(self) -> None:
        self.boot_id_path.write_text(f"{uuid.uuid4()}\n")  # as the kernel writes it
        self.boot_id_path.chmod(0o444)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def write_known_hosts(self, path: Path, append: bool = False) -> Path:
        """A known_hosts file trusting this host (paramiko: client.load_host_keys(str(path)))."""
        with path.open("a" if append else "w") as file:
            file.write(self.known_hosts_line + "\n")
        return path

    def new_host_key(self) -> str:
        """A fresh host key, used from the next start(): how a reinstalled (or impersonated) machine looks."""
        for path in (self.host_key_path, self.host_key_path.with_suffix(".pub")):
            path.unlink(missing_ok=True)
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", self.hostname, "-f", str(self.host_key_path))
        return self.host_key

    def add_command(self, name: str, script: str) -> Path:
        """An executable on this host's PATH only (e.g. a fake `nvidia-smi`); `script` starts with its #! line."""
        path = self.bin_dir / name
        path.write_text(script)
        path.chmod(0o755)
        return path

    def _write_config(self) -> None:
        self.config_path.write_text(
            "\n".join(
                [
                    f"Port {self.port}",
                    f"ListenAddress {self.address}",
                    f"HostKey {self.host_key_path}",
                    f"PidFile {self.pid_path}",
                    "AuthorizedKeysFile .ssh/authorized_keys",
                    "UsePAM no",
                    "StrictModes no",
                    "Subsystem sftp internal-sftp",
                    "PasswordAuthentication yes",
                    "KbdInteractiveAuthentication no",
                    "PubkeyAuthentication yes",
                    "PermitRootLogin no",
                    f"AllowUsers {self.user.name}",
                    "PrintMotd no",
                    f"SetEnv PATH={self.path}",
                    "",
                ]
            )
        )

    def start(self) -> None:
        """Brings the host up (again, with the same host key unless new_host_key() ran); returns once it answers."""
        if self.running:
            return
        if self.veth is not None and self.subnet is not None:
            _sh("ip", "route", "del", "unreachable", self.subnet, check=False)
            _sh("ip", "link", "set", self.veth, "up")
        self.pid_path.unlink(missing_ok=True)
        # own mount + UTS namespace: own hostname, home and boot id (bind mounts); exec sshd (Popen's pid is sshd)
        script = 'hostname "$1" && mount --bind "$2" "$3" && mount --bind "$6" "$7" && exec "$4" -D -e -f "$5"'
        args = [self.hostname, str(self.home), self.user.home, SSHD, str(self.config_path)]
        args += [str(self.boot_id_path), BOOT_ID]
        command = ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", script, "sh", *args]
        if self.netns is not None:
            command = ["ip", "netns", "exec", self.netns, *command]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

        def answers() -> bool:
            if self.process is not None and self.process.poll() is not None:
                log = self.log_path.read_text()[-1500:]
                raise AssertionError(f"sshd on {self.hostname} exited with {self.process.returncode}: {log}")
            return self.pid_path.exists() and _banner(self.address, self.port)

        wait_until(answers, DEADLINE_S, what=f"sshd on {self.hostname} ({self.address}:{self.port})")
        self.listener_pid = int(self.pid_path.read_text())
        self._mount_ns_fd = os.open(f"/proc/{self.listener_pid}/ns/mnt", os.O_RDONLY)
        self._mount_ns = _mount_ns(self.listener_pid)
        assert self._mount_ns is not None and self._mount_ns != _mount_ns(os.getpid())

    def session_pids(self) -> list[int]:
        """The per-connection sshd processes (privileged monitor, user side, pre-auth), not the listener."""
        if self.listener_pid is None:
            return []
        found: list[int] = []
        for pid in descendants(self.listener_pid):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/exe") == SSHD and not process_gone(pid):
                    found.append(pid)
        return found

    def kill_sessions(self) -> int:
        """SIGKILLs every connection's sshd processes: clients see their connection drop, the host keeps accepting.

        Commands those sessions started keep running (no pty, so no SIGHUP), as after a real network drop;
        one that writes to its lost channel gets SIGPIPE. Returns how many processes were killed.
        """
        pids = self.session_pids()
        _kill_all(pids)
        return len(pids)

    def processes(self) -> list[int]:
        """Every process on this host: sshd, sessions, and the commands they started (same mount namespace)."""
        if self._mount_ns is None:
            return []
        return [pid for pid in parents() if _mount_ns(pid) == self._mount_ns and not process_gone(pid)]

    def stop(self) -> None:
        """The host goes down: listener and sessions and their commands die; in netns mode the link goes down too."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(DEADLINE_S)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            _kill_all(self.processes())
        if self._mount_ns_fd is not None:
            os.close(self._mount_ns_fd)
        self.process = None
        self.listener_pid = None
        self._mount_ns = None
        self._mount_ns_fd = None
        if self.veth is not None and self.subnet is not None:
            # without the route, packets for the host would follow the default route (a gateway may answer them)
            _sh("ip", "link", "set", self.veth, "down")
            _sh("ip", "route", "replace", "unreachable", self.subnet)

    def reboot(self) -> None:
        """The host reboots: every process on it dies (stop()), it comes back (start()) with a new boot id."""
        self.stop()
        self._new_boot_id()
        self.start()

    def run(self, command: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """`sh -c command` as the test user inside the running host, without SSH: for setting up and inspecting."""
        if self.listener_pid is None:
            raise RuntimeError(f"{self.hostname} is down: read {self.home} from the tests instead")
        namespaces = ["--mount", "--uts"] + (["--net"] if self.netns else [])
        user = self.user
        enter = ["nsenter", f"--target={self.listener_pid}", *namespaces, "--"]
        become = ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--init-groups"]
        environ = ["env", "-i", f"HOME={user.home}", f"USER={user.name}", f"LOGNAME={user.name}", f"PATH={self.path}"]
        result = subprocess.run(
            [*enter, *become, *environ, "sh", "-c", f'cd "$HOME" && {command}'],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"{command!r} on {self.hostname} exited with {result.returncode}: {result.stderr}")
        return result

    def mount_tmpfs(self, path: str, options: str) -> None:
        """A small filesystem of this host's own (tmpfs, `options` such as `size=64k` or `nr_inodes=2`) at
        `path` under the user's home, owned by the user: a disk that fills up. It lasts until the host stops."""
        self.run(f'mkdir -p "$HOME/{path}"')
        enter = ["nsenter", f"--target={self.listener_pid}", "--mount", "--"]
        owner = f"uid={self.user.uid},gid={self.user.gid},mode=0755"
        _sh(*enter, "mount", "-t", "tmpfs", "-o", f"{options},{owner}", "tmpfs", f"{self.user.home}/{path}")

    def destroy(self) -> None:
        """Teardown: stop, delete the veth pair and the namespace, remove the host's files. The pair is deleted
        by name: a deleted namespace takes its end with it only when the kernel gets round to it."""
        try:
            self.stop()
        finally:
            if self.netns is not None:
                _kill_all([int(pid) for pid in _sh("ip", "netns", "pids", self.netns, check=False).stdout.split()])
                if self.veth is not None:
                    _sh("ip", "link", "del", self.veth, check=False)
                _sh("ip", "netns", "del", self.netns, check=False)
            if self.subnet is not None:
                _sh("ip", "route", "del", "unreachable", self.subnet, check=False)
            shutil.rmtree(self.dir, ignore_errors=True)

    def __repr__(self) -> str:
        return f"SshHost({self.hostname}, {self.address}:{self.port}, {self.environment.mode})"


def write_known_hosts(path: Path, hosts: list[SshHost]) -> Path:
    """One known_hosts file trusting all `hosts`."""
    path.write_text("".join(host.known_hosts_line + "\n" for host in hosts))
    return path


class MuteHost:
    """A TCP listener that accepts connections and never sends a byte: clients must time out waiting for a banner."""

    def __init__(self, address: str = "127.0.0.1") -> None:
        self.listener = socket.create_server((address, 0))
        self.listener.settimeout(0.1)  # lets the accept loop notice close()
        self.address: str = address
        self.port: int = int(self.listener.getsockname()[1])
        self.accepted: list[socket.socket] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="mute-host", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                connection, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted.append(connection)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(DEADLINE_S)
        self.listener.close()
        for connection in self.accepted:
            connection.close()


class CuttingProxy:
    """A TCP proxy on 127.0.0.1 to `upstream` (an sshd host) that drops every connection through it once it
    has forwarded a given number of bytes from the host since `cut_after` armed it: a connection lost at a
    point of the transfer, not of the clock. Connections made after the cut are forwarded as usual."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self._upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._budget: int | None = None  # bytes from the host still to forward before the cut; None: unarmed
        self.cut = threading.Event()
        threading.Thread(target=self._accept, name="cutting-proxy", daemon=True).start()

    def cut_after(self, downstream_bytes: int) -> None:
        with self._lock:
            self._budget = downstream_bytes

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._upstream, timeout=DEADLINE_S)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._pairs.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, downstream: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if downstream and self._spend(len(data)):
                    return
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def _spend(self, size: int) -> bool:
        """Counts `size` bytes from the host; True (and every connection dropped) once the budget is spent."""
        with self._lock:
            if self._budget is None:
                return False
            self._budget -= size
            if self._budget > 0:
                return False
            self._budget = None
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
        self.cut.set()
        return True

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for sock in pair:
                sock.close()
