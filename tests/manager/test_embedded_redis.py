"""The private redis-server of an embedded run: found by every command while the run serves it, wherever
the experiment's directory is."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from manager.stack import (
    CREATED,
    DATA_DIR,
    EmbeddedRedis,
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
