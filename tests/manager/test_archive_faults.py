"""The archive when its store fails: a directory that cannot be written, a write that fails half way (a full
disk), a clean-up that fails once a move took effect, a damaged segment or manifest, and an S3 store set up
wrong (no bucket, no server, no or wrong credentials). Each is one clear line naming the file or the setting
to fix, never a traceback, and leaves the experiment whole in Redis or in its archive."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis

from core import keys
from core.event_store import InvalidExperimentId, check_experiment_id
from core.settings import Settings
from manager.archive.moves import archive, archived, restore
from manager.archive.policy import run_policy, store_of
from manager.archive.stores import ArchiveStoreError, S3Store, open_store
from simulators.waiting import wait_until
from tests.cli.test_cli import trialstream
from tests.manager.test_archive import REPO, ended, owned
from tests.support.ports import free_port
from tests.support.s3_setup import S3Server

SECRET = "wrong-secret-Zq81xKp"


def _one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    """The error a failed command printed: one `trialstream: error:` line, no traceback."""
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trialstream: error: "), done.stderr
    return lines[0]


def test_a_directory_that_cannot_be_written_is_named_and_nothing_moves(
    client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    ended(client, "blocked", trials=3)
    before = owned(client, "blocked")
    (tmp_path / "a-file").write_text("not a directory")
    location = tmp_path / "a-file" / "archive"
    done = trialstream(
        "experiments",
        "archive",
        "blocked",
        env={"TRIALSTREAM_REDIS_URL": redis_url, "TRIALSTREAM_ARCHIVE_LOCATION": str(location)},
    )
    line = _one_error_line(done)
    assert str(location) in line and "TRIALSTREAM_ARCHIVE_LOCATION" in line, line
    assert archived(client, "blocked") is None and owned(client, "blocked") == before


_FILLED = """
import resource, signal, sys
from core.connections import connect
from manager.archive import moves
from manager.archive.stores import ArchiveStoreError, open_store

url, experiment_id, location = sys.argv[1:]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) as on a full disk
written = []


def checkpoint(step: str) -> None:
    written.append(step)
    if len(written) == 2:  # two segments are on disk: no file may grow past 16 bytes from now on
        resource.setrlimit(resource.RLIMIT_FSIZE, (16, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


try:
    moves.archive(connect(url), experiment_id, open_store(location), checkpoint=checkpoint, segment_bytes=1024)
except ArchiveStoreError as error:
    print(error)
    sys.exit(7)
"""


def test_a_write_that_fails_half_way_leaves_no_part_of_the_archive(
    client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    ended(client, "full", trials=6)
    before = owned(client, "full")
    location = tmp_path / "archive"
    done = subprocess.run(
        [sys.executable, "-c", _FILLED, redis_url, "full", str(location)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 7, done.stderr
    assert "File too large" in done.stdout and str(location / "full") in done.stdout, done.stdout
    assert archived(client, "full") is None and owned(client, "full") == before
    assert not (location / "full").exists()  # neither its segments nor their folders: a full disk gets its space back

    record = archive(client, "full", open_store(str(location)))  # the next try, with room
    assert [path.name for path in (location / "full").iterdir()] == [record.archive_id]


_CLEAN_UP_FAILS = """
import logging, resource, sys
from core.connections import connect
from manager.archive import moves

url, experiment_id = sys.argv[1:]
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")


def checkpoint(step: str) -> None:
    if step == "switched":  # the move took effect: opening anything (the archive's folder) fails from now on
        resource.setrlimit(resource.RLIMIT_NOFILE, (3, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


print(moves.restore(connect(url), experiment_id, checkpoint=checkpoint))
"""


def test_a_restore_whose_archive_cannot_be_deleted_is_done_and_says_what_is_left(
    client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    ended(client, "kept", trials=3)
    before = owned(client, "kept")
    store = open_store(str(tmp_path / "archive"))
    record = archive(client, "kept", store)
    done = subprocess.run(
        [sys.executable, "-c", _CLEAN_UP_FAILS, redis_url, "kept"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(record.keys)
    assert "Traceback" not in done.stderr
    assert f"WARNING experiment kept: its archive in {store.location} could not be deleted" in done.stderr
    assert archived(client, "kept") is None and owned(client, "kept") == before
    assert all(client.pttl(name) == -1 for name in before)
    assert store.names("kept/")  # left behind, said so; the next archive of it deletes them
    again = archive(client, "kept", store)
    assert {name.split("/")[1] for name in store.names("kept/")} == {again.archive_id}


def test_archived_files_are_readable_as_the_umask_allows(client: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    """Every process that reads the experiment reads its archive: the manager's user, not only the archiving one."""
    ended(client, "shared", trials=2)
    done = subprocess.run(
        [
            "sh",
            "-c",
            'umask 022 && exec "$@"',
            "sh",
            sys.executable,
            "-m",
            "manager.cli",
            "experiments",
            "archive",
            "shared",
        ],
        cwd=REPO,
        env={
            **os.environ,
            "TRIALSTREAM_REDIS_URL": redis_url,
            "TRIALSTREAM_ARCHIVE_LOCATION": str(tmp_path / "archive"),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    files = [path for path in (tmp_path / "archive").rglob("*") if path.is_file()]
    assert files and {path.stat().st_mode & 0o777 for path in files} == {0o644}


@pytest.mark.parametrize("damage", ["flipped", "truncated", "manifest"])
def test_a_damaged_archive_names_its_file_and_nothing_comes_back(
    client: redis.Redis, redis_url: str, tmp_path: Path, damage: str
) -> None:
    ended(client, "hurt", trials=3)
    location = tmp_path / "archive"
    record = archive(client, "hurt", open_store(str(location)))
    kept = owned(client, "hurt")
    folder = location / "hurt" / record.archive_id
    damaged = folder / ("manifest.json" if damage == "manifest" else "segment-00000.zz")
    data = damaged.read_bytes()
    damaged.write_bytes(
        data[: len(data) // 2] if damage == "truncated" else data[:10] + bytes([data[10] ^ 0xFF]) + data[11:]
    )
    env = {"TRIALSTREAM_REDIS_URL": redis_url}
    for command in (("trials", "list", "-e", "hurt"), ("experiments", "restore", "hurt")):
        line = _one_error_line(trialstream(*command, env=env))
        assert f"{damaged}: its SHA-256" in line and "damaged" in line, line
        assert archived(client, "hurt") == record and owned(client, "hurt") == kept  # nothing half restored
        assert not list(client.scan_iter(match=f"{keys.staging('hurt', '*')}*"))


def _s3_env(redis_url: str, location: str, endpoint: str, **credentials: str) -> dict[str, str]:
    """A command's environment: this S3 archive, only these credentials (no ~/.aws, no instance metadata)."""
    return {
        "TRIALSTREAM_REDIS_URL": redis_url,
        "TRIALSTREAM_ARCHIVE_LOCATION": location,
        "TRIALSTREAM_ARCHIVE_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "",
        "AWS_SECRET_ACCESS_KEY": "",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials",
        "AWS_CONFIG_FILE": "/nonexistent/config",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_DEFAULT_REGION": "us-east-1",
        **credentials,
    }


def test_an_s3_archive_set_up_wrong_says_which_setting_to_fix(
    client: redis.Redis,
    redis_url: str,
    s3_server: S3Server,
    s3_server_with_auth: S3Server,
    s3_credentials: dict[str, str],
) -> None:
    ended(client, "cloud", trials=2)
    before = owned(client, "cloud")
    good = {name: s3_credentials[name] for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    bucket = s3_server.bucket("cloud")
    cases = {
        "no such bucket": (
            _s3_env(redis_url, "s3://no-such-bucket/archive", s3_server.endpoint_url, **good),
            ["no-such-bucket", "TRIALSTREAM_ARCHIVE_LOCATION", "create it"],
        ),
        "no server there": (
            _s3_env(redis_url, bucket, f"http://127.0.0.1:{free_port()}", **good),
            ["TRIALSTREAM_ARCHIVE_ENDPOINT_URL", "does not answer"],
        ),
        "not a URL": (
            _s3_env(redis_url, bucket, "s3.example", **good),
            ["TRIALSTREAM_ARCHIVE_ENDPOINT_URL", "s3.example", "http"],
        ),
        "no credentials": (
            _s3_env(redis_url, bucket, s3_server.endpoint_url),
            ["no S3 credentials", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"],
        ),
        "wrong credentials": (
            _s3_env(
                redis_url,
                "s3://any-bucket/archive",
                s3_server_with_auth.endpoint_url,
                AWS_ACCESS_KEY_ID="AKIAWRONGWRONGWRONG1",
                AWS_SECRET_ACCESS_KEY=SECRET,
            ),
            ["refused", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"],
        ),
    }
    for case, (env, named) in cases.items():
        line = _one_error_line(trialstream("experiments", "archive", "cloud", env=env, timeout=120))
        assert all(part in line for part in named), (case, line)
        assert SECRET not in line and good["AWS_SECRET_ACCESS_KEY"] not in line, case
        assert archived(client, "cloud") is None and owned(client, "cloud") == before, case

    working = _s3_env(redis_url, bucket, s3_server.endpoint_url, **good)
    done = trialstream("experiments", "archive", "cloud", env=working)
    assert done.returncode == 0, done.stderr
    assert json.loads(trialstream("trials", "list", "-e", "cloud", "--json", env=working).stdout)
    assert restore(client, "cloud") == len(before)


def test_an_s3_server_that_never_answers_fails_a_call_after_a_bounded_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that takes the connection and never answers (a hung proxy) ends a call after the timeout and the
    tries the store allows, as one error naming the server: boto3's defaults would have held it five minutes."""
    for name, value in _s3_env("", "", "", AWS_ACCESS_KEY_ID="AKIAFAKE", AWS_SECRET_ACCESS_KEY="fake").items():
        monkeypatch.setenv(name, value)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel accepts the connections; nobody answers
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        store = S3Store("bucket", "archive", endpoint, timeout_s=0.2, attempts=2)  # short: no production back-off
        with pytest.raises(ArchiveStoreError) as raised:
            store.put("manifest.json", b"{}")
        silent.setblocking(False)
        tries = 0
        while True:
            try:
                silent.accept()[0].close()
            except BlockingIOError:
                break
            tries += 1
    said = str(raised.value)
    assert f"{endpoint} does not answer within 0.2 s, 2 tries" in said
    assert "TRIALSTREAM_ARCHIVE_ENDPOINT_URL" in said
    assert tries == 2


def test_the_default_archive_is_where_no_experiment_can_be_and_a_failing_one_is_a_line_a_round(
    client: redis.Redis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An embedded experiment's directory is its id under the experiments dir, and deleting the experiment deletes
    it: the archive's default, `.archive`, is a name no id can have. A store the policy cannot write is one warning
    a round, saying what to fix, not a traceback."""
    settings = Settings(experiments_dir=tmp_path, archive_after_h=0, archive_check_s=0.05)
    assert store_of(settings).location == str(tmp_path / ".archive")
    with pytest.raises(InvalidExperimentId):
        check_experiment_id(".archive")
    ended(client, "due", trials=1)
    (tmp_path / ".archive").write_text("a file where the archive's directory would be")
    stop = threading.Event()
    policy = threading.Thread(target=run_policy, args=(client, settings, stop))
    with caplog.at_level(logging.WARNING, logger="manager.archive.policy"):
        policy.start()
        try:
            said = wait_until(lambda: caplog.records, 20, what="the policy's round")
        finally:
            stop.set()
            policy.join(20)
    assert said[0].exc_info is None and "TRIALSTREAM_ARCHIVE_LOCATION" in said[0].getMessage(), said[0].getMessage()
    assert archived(client, "due") is None
