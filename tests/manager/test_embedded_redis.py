"""The private redis-server of an embedded run: found by every command while the run serves it, wherever
the experiment's directory is."""

from __future__ import annotations

import os
import subprocess
from contextlib import suppress
from pathlib import Path

import pytest
import redis

from core.connections import RedisGone
from core.settings import Settings
from manager import stack
from manager.stack import (
    CREATED,
    DATA_DIR,
    EmbeddedRedis,
    EmbeddedStack,
    StackError,
    embedded_experiments,
    live_url,
    served_data,
    socket_path,
)


@pytest.mark.parametrize("depth", [1, 12], ids=["short path", "path too long for a unix socket"])
def test_a_live_run_s_redis_is_the_one_every_command_reads(tmp_path: Path, depth: int) -> None:
    """Regression: past ~100 characters the run's Redis listened on a TCP port with a password that no other
    command knew, so `trials list` during the run found no live server and started a second redis-server
    on the same files."""
    directory = tmp_path.joinpath(*["nested-directory"] * depth) / "experiment"
    server = EmbeddedRedis(directory / DATA_DIR)
    url = server.start()
    try:
        assert url.startswith("unix://")
        assert live_url(directory) == url
        with served_data(directory) as served:
            assert served == url  # the run's own server, not a second one on its data
    finally:
        server.stop()
    assert live_url(directory) is None


def test_a_private_socket_directory_another_user_could_have_made_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    shared = tmp_path / f"trialstream-{os.getuid()}"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # as if made by another user, or open to them
    with pytest.raises(StackError, match="not a private directory"):
        socket_path(tmp_path.joinpath(*["nested-directory"] * 12) / DATA_DIR, create=True)


def test_the_newest_embedded_experiment_is_the_last_created_whatever_was_opened_since(tmp_path: Path) -> None:
    """Every command that opens an experiment changes its data directory: the order is its `created` file's,
    and only an experiment from before that file is ordered by its data."""
    older, legacy, newer = tmp_path / "older", tmp_path / "legacy", tmp_path / "newer"
    for directory, created in ((older, 1000), (newer, 2000)):
        (directory / DATA_DIR).mkdir(parents=True)
        (directory / CREATED).touch()
        os.utime(directory / CREATED, (created, created))
    os.utime(older / DATA_DIR, (3000, 3000))  # opened since
    os.utime(newer / DATA_DIR, (2000, 2000))
    (legacy / DATA_DIR).mkdir(parents=True)
    os.utime(legacy / DATA_DIR, (1500, 1500))
    (tmp_path / "refused").mkdir()  # no data: no experiment
    assert embedded_experiments(tmp_path) == [older, legacy, newer]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs")
def test_a_redis_that_cannot_start_again_ends_its_clients_retries_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its disk full, redis-server exits at its next write (`appendfsync always` cannot go on) and again after
    each start. Once the stack gives up on it, its clients stop waiting at once (they retried for a minute a
    call, and the run hung for minutes, silent), and the error says what Redis said and the room left."""
    monkeypatch.setattr(stack, "RESTART_BACKOFF_S", 0.05)  # the rule, not its production pace
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], check=True)
    try:
        with EmbeddedStack(disk / "experiment", Settings()) as embedded:
            embedded.services.supervise()
            with (disk / "filler").open("wb") as filler, suppress(OSError):  # until the disk is full
                while True:
                    filler.write(b"\0" * 65536)
                    filler.flush()
            with pytest.raises(RedisGone):
                embedded.client.set("key", "x" * 10_000)
            assert embedded.services.failure is not None
            assert "embedded redis-server exited with status 1, the 5th time in a row" in embedded.services.failure
            assert "it said: " in embedded.services.failure and "0 bytes free" in embedded.services.failure
            with pytest.raises(redis.ConnectionError):  # a later call too, without a retry budget's wait
                embedded.rq_connection.ping()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)
