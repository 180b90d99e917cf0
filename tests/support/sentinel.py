"""A Sentinel set on loopback: a master, replicas and sentinels, each a real `redis-server` process the test owns
(killed, paused and resumed by signal), optionally TLS-only with a CA of the test's own (simulators/tls.py)."""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from simulators.tls import make_self_signed
from simulators.waiting import wait_until
from tests.support.ports import free_port
from tests.support.redis_process import killed, started, stopped

MASTER = "trialstream"
HA_NODE_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "redis" / "ha-node.conf"  # what the project ships


@dataclass(frozen=True)
class Tls:
    """One self-signed certificate: the CA clients trust, the servers' certificate and a client's."""

    ca: Path
    key: Path

    @classmethod
    def make(cls, directory: Path) -> Tls:
        ca, key = make_self_signed(directory, "trialstream-redis")
        return cls(ca, key)

    def server_args(self, port: int) -> list[str]:
        files = ["--tls-cert-file", str(self.ca), "--tls-key-file", str(self.key), "--tls-ca-cert-file", str(self.ca)]
        return ["--port", "0", "--tls-port", str(port), *files, "--tls-auth-clients", "optional"]

    def client_kwargs(self) -> dict[str, Any]:
        return {"ssl": True, "ssl_ca_certs": str(self.ca), "ssl_certfile": str(self.ca), "ssl_keyfile": str(self.key)}


class RedisProcess:
    """One redis-server on 127.0.0.1:`port` (a data node, or a sentinel with `sentinel=True`), started by `start`."""

    def __init__(self, directory: Path, port: int, args: list[str], tls: Tls | None, sentinel: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed")
        self.binary, self.directory, self.port, self.args, self.tls = binary, directory, port, args, tls
        self.sentinel = sentinel
        self.process: subprocess.Popen[bytes] | None = None
        directory.mkdir(parents=True, exist_ok=True)

    def start(self, extra: tuple[str, ...] = ()) -> None:
        listen = self.tls.server_args(self.port) if self.tls else ["--port", str(self.port)]
        if self.sentinel:  # sentinel mode reads (and rewrites) a config file, named first
            config = self.directory / "sentinel.conf"
            command = [self.binary, str(config), "--sentinel", *listen]
        else:
            command = [self.binary, *self.args, *listen, *extra]
        command += ["--bind", "127.0.0.1", "--dir", str(self.directory), "--logfile", "redis.log"]
        self.process = started(command, self.client(), self.log_tail)

    def client(self) -> redis.Redis:
        """A client with no retries and short timeouts: for probes and role checks."""
        tls = self.tls.client_kwargs() if self.tls else {}
        options: dict[str, Any] = {"socket_timeout": 2, "socket_connect_timeout": 2, "decode_responses": True, **tls}
        return redis.Redis("127.0.0.1", self.port, **options)

    def signal(self, signum: signal.Signals) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL: no shutdown; whatever was not replicated is gone."""
        killed(self.process)

    def stop(self) -> None:
        stopped(self.process)

    def role(self) -> str:
        with self.client() as probe:
            return str(probe.execute_command("ROLE")[0])

    def replicas_online(self) -> set[int]:
        """The ports of the replicas this node streams to now (none unless it is a master)."""
        try:
            with self.client() as probe:
                role = probe.execute_command("ROLE")
        except (redis.ConnectionError, redis.TimeoutError):
            return set()
        return {int(port) for _, port, _ in role[2]} if role[0] == "master" else set()

    def log_tail(self) -> str:
        log = self.directory / "redis.log"
        return log.read_text(errors="replace")[-1500:] if log.exists() else ""


class SentinelSet:
    """A master, `replicas` replicas and `sentinels` sentinels (quorum: a majority) on loopback.

    The data nodes refuse writes without a replica in reach (`min-replicas-to-write 1`, as deploy/ ships), so
    an isolated old master takes none; the sentinels declare a master down after `down_after_ms`.
    """

    def __init__(
        self,
        root: Path,
        *,
        replicas: int = 2,
        sentinels: int = 3,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
        tls: Tls | None = None,
    ) -> None:
        self.tls = tls
        data_args = ["--save", "", "--appendonly", "no", "--daemonize", "no"]  # no disk: cheap
        if not replicas:
            data_args += ["--min-replicas-to-write", "0"]  # a lone master must take writes
        if tls:
            data_args += ["--tls-replication", "yes"]
        self.nodes = []
        for index in range(replicas + 1):
            directory = root / f"node{index}"
            directory.mkdir(parents=True)
            config = shutil.copy(HA_NODE_CONFIG, directory / "redis.conf")  # a copy: sentinels rewrite it
            self.nodes.append(RedisProcess(directory, free_port(), [str(config), *data_args], tls))
        self.sentinels = [RedisProcess(root / f"sentinel{i}", free_port(), [], tls, True) for i in range(sentinels)]
        self.quorum = sentinels // 2 + 1
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        scheme = "rediss+sentinel" if tls else "redis+sentinel"
        self.url = f"{scheme}://{','.join(f'127.0.0.1:{s.port}' for s in self.sentinels)}/{MASTER}/0"

    def start(self) -> None:
        master = self.nodes[0]
        master.start()
        for replica in self.nodes[1:]:
            replica.start(("--replicaof", "127.0.0.1", str(master.port)))
        for sentinel in self.sentinels:
            tls = "tls-replication yes\n" if self.tls else ""  # the sentinels reach the nodes by TLS too
            (sentinel.directory / "sentinel.conf").write_text(
                f"sentinel monitor {MASTER} 127.0.0.1 {master.port} {self.quorum}\n"
                f"sentinel down-after-milliseconds {MASTER} {self.down_after_ms}\n"
                f"sentinel failover-timeout {MASTER} {self.failover_timeout_ms}\n"
                f"sentinel parallel-syncs {MASTER} {len(self.nodes)}\n{tls}"
            )
            sentinel.start()
        self.wait_settled(master)

    def master(self) -> RedisProcess:
        """The node the sentinels name master now."""
        with self.sentinels[0].client() as probe:
            _, port = probe.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)
        return next(node for node in self.nodes if node.port == int(port))

    def wait_settled(self, master: RedisProcess, timeout: float = 30) -> None:
        """Until every sentinel names `master`, sees the others, and the master streams to every live replica."""
        live = [node for node in self.nodes if node is not master and node.process and node.process.poll() is None]

        def settled() -> bool:
            try:
                for sentinel in self.sentinels:
                    with sentinel.client() as probe:
                        state = probe.sentinel_master(MASTER)
                        others = int(state["num-other-sentinels"])
                        if int(state["port"]) != master.port or others < len(self.sentinels) - 1:
                            return False
                        if "s_down" in state["flags"] or "failover" in state["flags"]:
                            return False
                return master.replicas_online() >= {node.port for node in live}
            except (redis.ConnectionError, redis.TimeoutError):
                return False

        wait_until(settled, timeout, what=f"the sentinels to settle on {master.port} with {len(live)} replicas")

    def stop(self) -> None:
        for process in [*self.sentinels, *self.nodes]:
            process.stop()


@pytest.fixture
def sentinel_set(tmp_path: Path) -> Iterator[SentinelSet]:
    """A master, 2 replicas and 3 sentinels (down after 1 s), settled; stopped at teardown."""
    sentinels = SentinelSet(tmp_path / "sentinel-set")
    try:
        sentinels.start()
        yield sentinels
    finally:
        sentinels.stop()
