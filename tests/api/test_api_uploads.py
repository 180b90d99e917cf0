"""Code uploads (`PUT /api/v1/code`) to a real `trialstream manager`: what the CLI packs is unpacked as it
was (absolute symlinks included), and what would not fit NNI's limits for code, or would leave the
upload's directory, is refused with the reason."""

from __future__ import annotations

import io
import os
import tarfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from core import code_archive
from tests.conftest import Processes

pytestmark = pytest.mark.xdist_group("api-uploads")  # one manager for the module, started once


@pytest.fixture(scope="module")
def experiments(module_processes: Processes, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The module's manager (its URL) and its experiments directory: every test uploads to it, each checking
    what its own uploads leave (an upload's directory is named by its content, so tests do not collide)."""
    path = tmp_path_factory.mktemp("uploads") / "experiments"
    return module_processes.manager(env={"TRIALSTREAM_EXPERIMENTS_DIR": str(path)}), path


@pytest.fixture
def uploads(experiments: tuple[str, Path]) -> Iterator[tuple[httpx.Client, Path]]:
    """The manager's /api/v1 and where it unpacks uploads."""
    url, path = experiments
    with httpx.Client(base_url=f"{url}/api/v1", timeout=60) as http:
        yield http, path / "code"


def tar_gz(members: Sequence[tuple[tarfile.TarInfo, io.RawIOBase | io.BufferedIOBase | None]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w|gz", format=tarfile.PAX_FORMAT) as archive:
        for info, content in members:
            archive.addfile(info, content)
    return buffer.getvalue()


def regular(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, io.BytesIO]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, io.BytesIO(data)


class Zeros(io.RawIOBase):
    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        buffer[:] = bytes(len(buffer))
        return len(buffer)


def test_an_archive_the_cli_makes_keeps_its_absolute_symlink(
    uploads: tuple[httpx.Client, Path], tmp_path: Path
) -> None:
    http, stored = uploads
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    (code / "trial.py").write_text("print('hi')\n")
    (code / "pkg" / "run.sh").write_text("#!/bin/sh\n")
    (code / "pkg" / "run.sh").chmod(0o755)
    os.symlink("/nfs/datasets", code / "data")  # a shared mount, absent here: kept as it is, as NNI does
    body = code_archive.archive(code)
    answer = http.put("/code", content=body)
    assert answer.status_code == 201, answer.text
    unpacked = stored / answer.json()["codeId"]
    assert os.readlink(unpacked / "data") == "/nfs/datasets"
    assert (unpacked / "trial.py").read_text() == "print('hi')\n"
    assert os.access(unpacked / "pkg" / "run.sh", os.X_OK)


def test_a_gzip_bomb_is_refused_naming_the_limit(uploads: tuple[httpx.Client, Path]) -> None:
    http, stored = uploads
    before = {path for path in stored.rglob("*") if path.is_file()}  # the other tests' uploads
    info = tarfile.TarInfo("zeros.bin")
    info.size = code_archive.MAX_BYTES + 1024 * 1024  # a few hundred KB of gzip, over 300 MiB unpacked
    body = tar_gz([(info, Zeros())])
    assert len(body) < 2 * 1024 * 1024
    answer = http.put("/code", content=body)
    assert answer.status_code == 413, answer.text
    assert str(code_archive.MAX_BYTES) in answer.json()["error"]
    assert {path for path in stored.rglob("*") if path.is_file()} == before  # nothing left behind


def test_more_files_than_nni_allows_are_refused(uploads: tuple[httpx.Client, Path]) -> None:
    http, _ = uploads
    body = tar_gz([regular(f"f{index}.txt") for index in range(code_archive.MAX_FILES + 1)])
    answer = http.put("/code", content=body)
    assert answer.status_code == 413, answer.text
    assert f"more than {code_archive.MAX_FILES} files" in answer.json()["error"]


def test_members_leaving_the_upload_are_refused(uploads: tuple[httpx.Client, Path], tmp_path: Path) -> None:
    http, stored = uploads
    escape = tar_gz([regular("trial.py"), regular("../escaped.txt")])
    answer = http.put("/code", content=escape)
    assert answer.status_code == 422, answer.text
    assert "escaped.txt" in answer.json()["error"]
    assert not (stored.parent / "escaped.txt").exists()  # the experiments directory
    link = tarfile.TarInfo("out")
    link.type, link.linkname = tarfile.SYMTYPE, str(tmp_path)
    through = tar_gz([(link, None), regular("out/through-the-link.txt")])  # writing through a link
    answer = http.put("/code", content=through)
    assert answer.status_code == 422, answer.text
    assert not (tmp_path / "through-the-link.txt").exists()


def test_links_out_devices_and_setuid_bits_do_not_survive_an_upload(
    uploads: tuple[httpx.Client, Path], tmp_path: Path
) -> None:
    """Checked by trialstream itself: Python before 3.11.4 (Debian 12's, in the stack's image) has no
    extraction filters."""
    http, code = uploads
    hard = tarfile.TarInfo("passwd")
    hard.type, hard.linkname = tarfile.LNKTYPE, "../../../../../../etc/passwd"
    device = tarfile.TarInfo("null")
    device.type = tarfile.CHRTYPE
    for hostile, named in ((hard, "passwd"), (device, "null")):
        answer = http.put("/code", content=tar_gz([regular("trial.py"), (hostile, None)]))
        assert answer.status_code == 422, answer.text
        assert named in answer.json()["error"]
    setuid, data = regular("/tool.sh")  # an absolute name lands inside, as tar -x does
    setuid.mode = 0o6777
    answer = http.put("/code", content=tar_gz([(setuid, data)]))
    assert answer.status_code in (200, 201), answer.text
    unpacked = code / answer.json()["codeId"] / "tool.sh"
    assert unpacked.stat().st_mode & 0o7777 == 0o755
    assert unpacked.stat().st_uid == os.getuid()


def test_links_that_tarfile_could_not_make_are_refused_rather_than_copied(
    uploads: tuple[httpx.Client, Path],
) -> None:
    """tarfile, failing to make a link, writes the link target's original member instead: its mode, and as
    root its owner. Such links are refused before tarfile tries, and what is unpacked is checked after."""
    http, _ = uploads

    def directory(name: str, mode: int = 0o755) -> tuple[tarfile.TarInfo, None]:
        info = tarfile.TarInfo(name)
        info.type, info.mode = tarfile.DIRTYPE, mode
        return info, None

    def link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, None]:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = kind, target
        return info, None

    hostile = {
        "over a directory": [directory("e"), directory("d", 0o7777), link("e", "d")],
        "with no target": [directory("a"), link("a/..", "")],
        "a hard link to a directory": [directory("d"), link("e", "d", tarfile.LNKTYPE)],
    }
    for what, members in hostile.items():
        answer = http.put("/code", content=tar_gz(members))
        assert answer.status_code == 422, (what, answer.text)
    made_by_tar = tar_gz([directory("."), regular("./trial.py")])  # `tar -C code -c .` starts with ./
    assert http.put("/code", content=made_by_tar).status_code in (200, 201)


def test_the_same_upload_at_once_succeeds_twice(uploads: tuple[httpx.Client, Path]) -> None:
    http, stored = uploads
    body = tar_gz([regular(f"dir{index}/f.txt", b"data" * 1000) for index in range(200)])
    start = threading.Barrier(2)
    answers: list[httpx.Response] = []

    def upload() -> None:
        start.wait()
        answers.append(http.put("/code", content=body))

    threads = [threading.Thread(target=upload) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [answer.status_code for answer in answers] == [201, 201], [answer.text for answer in answers]
    assert answers[0].json() == answers[1].json()
    assert (stored / answers[0].json()["codeId"] / "dir199" / "f.txt").read_bytes() == b"data" * 1000
