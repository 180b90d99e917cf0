"""The code package (workers/platforms/shared) on real directories: what NNI's remote platforms would upload,
byte for byte."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

from workers.platforms.shared.code_package import (
    MAX_BYTES,
    MAX_FILES,
    CodeDirectoryError,
    CodeDirectoryTooLarge,
    CodePackage,
    pack,
)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)


def _members(package: CodePackage) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(package.path, "r:gz") as tar:
        return {m.name: m for m in tar.getmembers()}


def _pack(tmp_path: Path, code: Path, name: str = "code.tgz") -> CodePackage:
    return pack(code, tmp_path / "out" / name)


@pytest.fixture
def code(tmp_path: Path) -> Path:
    root = tmp_path / "code"
    _write(
        root,
        {
            "main.py": "print('train')\n",
            "model.ckpt": "weights",
            "keep.ckpt": "kept weights",
            "sub/deep/other.ckpt": "nested weights",
            "sub/deep/util.py": "x = 1\n",
            "data/train.csv": "1,2\n",
            "sub/data/nested.csv": "3,4\n",
            "build/out.o": "root build",
            "sub/build/out.o": "nested build is not anchored away",
            "logs/run1/events": "log",
            "logs/keep.txt": "kept",
            "#literal": "a file whose name starts with a hash",
            ".git/HEAD": "ref: refs/heads/main\n",
        },
    )
    lines = ["# checkpoints are big", "", "*.ckpt", "   ", "data/", "/build", "!keep.ckpt"]
    lines += ["logs/*", "!logs/keep.txt", "\\#literal"]
    (root / ".nniignore").write_text("\n".join(lines) + "\n")
    return root


def test_nniignore_follows_gitignore_semantics(tmp_path: Path, code: Path) -> None:
    package = _pack(tmp_path, code)
    assert sorted(_members(package)) == [
        ".git/HEAD",  # NNI skips nothing implicitly
        ".nniignore",
        "keep.ckpt",
        "logs/keep.txt",
        "main.py",
        "sub/build/out.o",
        "sub/deep/util.py",
    ]
    assert package.file_count == 7
    assert package.total_bytes == sum(m.size for m in _members(package).values())


def test_a_file_inside_an_ignored_directory_cannot_be_re_included(tmp_path: Path) -> None:
    # git: "It is not possible to re-include a file if a parent directory of that file is excluded."
    root = tmp_path / "code"
    _write(root, {"data/keep.csv": "k", "data/drop.csv": "d", "run.py": ""})
    (root / ".nniignore").write_text("data/\n!data/keep.csv\n")
    assert sorted(_members(_pack(tmp_path, root))) == [".nniignore", "run.py"]


def test_only_the_root_nniignore_counts(tmp_path: Path) -> None:
    root = tmp_path / "code"
    _write(root, {"sub/.nniignore": "*.py\n", "sub/a.py": "", "b.py": ""})
    assert sorted(_members(_pack(tmp_path, root))) == ["b.py", "sub/.nniignore", "sub/a.py"]


def test_directory_pattern_does_not_match_a_file_of_that_name(tmp_path: Path) -> None:
    root = tmp_path / "code"
    _write(root, {"data": "a file, not a directory", "x/data/f": ""})
    (root / ".nniignore").write_text("data/\n")
    assert sorted(_members(_pack(tmp_path, root))) == [".nniignore", "data"]


def test_unpacking_reproduces_the_included_tree(tmp_path: Path, code: Path) -> None:
    (code / "main.py").chmod(0o700)
    (code / "sub/deep/util.py").chmod(0o600)
    package = _pack(tmp_path, code)
    out = tmp_path / "unpacked"
    with tarfile.open(package.path, "r:gz") as tar:
        tar.extractall(out, filter="tar")
    unpacked = {p.relative_to(out).as_posix(): p for p in out.rglob("*") if p.is_file()}
    assert sorted(unpacked) == sorted(_members(package))
    for name, path in unpacked.items():
        original = code / name
        assert path.read_bytes() == original.read_bytes(), name
        assert os.access(path, os.X_OK) == bool(original.stat().st_mode & 0o111), name
    assert (out / "main.py").stat().st_mode & 0o777 == 0o755
    assert (out / "sub/deep/util.py").stat().st_mode & 0o777 == 0o644


def test_same_content_gives_byte_identical_archives(tmp_path: Path, code: Path) -> None:
    first = _pack(tmp_path, code, "a.tgz")
    # A copy elsewhere with other mtimes and another creation order is the same code.
    copy = tmp_path / "copy"
    for path in sorted(code.rglob("*"), reverse=True):
        if path.is_file():
            target = copy / path.relative_to(code)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
            os.chmod(target, path.stat().st_mode & 0o777)
            os.utime(target, (1_000_000, 1_000_000))
    second = _pack(tmp_path, copy, "b.tgz")
    assert first.path.read_bytes() == second.path.read_bytes()
    assert first.sha256 == second.sha256
    assert len(first.sha256) == 64
    # Packs within one second would hide a clock in the gzip header: check it directly.
    header = first.path.read_bytes()[:10]
    assert header[4:8] == b"\0\0\0\0" and not header[3] & 0x08  # no mtime, no file name


def test_touching_mtimes_keeps_the_hash(tmp_path: Path, code: Path) -> None:
    before = _pack(tmp_path, code, "a.tgz")
    for path in code.rglob("*"):
        os.utime(path, (2_000_000_000, 2_000_000_000))
    after = _pack(tmp_path, code, "b.tgz")
    assert after.sha256 == before.sha256
    assert after.path.read_bytes() == before.path.read_bytes()


def test_changing_an_ignored_file_keeps_the_hash(tmp_path: Path, code: Path) -> None:
    before = _pack(tmp_path, code, "a.tgz").sha256
    (code / "model.ckpt").write_text("retrained weights, much bigger")
    (code / "data/new.csv").write_text("new data")
    assert _pack(tmp_path, code, "b.tgz").sha256 == before


@pytest.mark.parametrize("change", ["content", "name", "exec_bit", "new_file"])
def test_the_hash_follows_included_files(tmp_path: Path, code: Path, change: str) -> None:
    before = _pack(tmp_path, code, "a.tgz").sha256
    main = code / "main.py"
    if change == "content":
        main.write_text("print('train!')\n")
    elif change == "name":
        main.rename(code / "main2.py")
    elif change == "exec_bit":
        main.chmod(main.stat().st_mode | 0o100)
    else:
        (code / "extra.py").write_text("")
    assert _pack(tmp_path, code, "b.tgz").sha256 != before


def test_symlinks_are_stored_as_links_and_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    _write(outside, {"huge.bin": "x" * 1000, "secret": "not to be shipped"})
    root = tmp_path / "code"
    _write(root, {"run.py": ""})
    (root / "datasets").symlink_to(outside)
    (root / "alias.py").symlink_to("run.py")
    package = _pack(tmp_path, root)
    members = _members(package)
    assert sorted(members) == ["alias.py", "datasets", "run.py"]
    assert members["datasets"].issym() and members["datasets"].linkname == str(outside)
    assert members["alias.py"].issym() and members["alias.py"].linkname == "run.py"
    assert package.total_bytes == len(str(outside)) + len("run.py")


def test_exactly_the_file_limit_is_accepted(tmp_path: Path) -> None:
    root = tmp_path / "code"
    root.mkdir()
    for i in range(MAX_FILES):
        (root / f"f{i:04d}").write_bytes(b"x")
    assert _pack(tmp_path, root).file_count == MAX_FILES


def test_too_many_files_names_counts_offenders_and_fix(tmp_path: Path) -> None:
    root = tmp_path / "code"
    for directory, count in [("node_modules/pkg/lib", 1500), ("venv", 400), ("src", 95), ("a", 3), ("b", 2)]:
        (root / directory).mkdir(parents=True)
        for i in range(count):
            (root / directory / f"m{i}.js").write_bytes(b"x")
    (root / "weights.bin").write_bytes(b"w" * 50)
    (root / "tiny.txt").write_bytes(b"")
    ignored = root / "ignored"
    ignored.mkdir()
    for i in range(10):
        (ignored / f"i{i}").write_bytes(b"i")
    (root / ".nniignore").write_text("ignored/\n")
    destination = tmp_path / "out" / "code.tgz"
    with pytest.raises(CodeDirectoryTooLarge) as excinfo:
        pack(root, destination)
    error = excinfo.value
    message = str(error)
    # 1500 + 400 + 95 + 3 + 2 + weights.bin + tiny.txt + .nniignore
    assert error.file_count == 2003
    assert error.total_bytes == 2000 + 50 + len("ignored/\n")
    assert f"has 2003 files, {error.total_bytes} bytes" in message
    assert f"at most {MAX_FILES} files and {MAX_BYTES} bytes" in message
    assert "weights.bin (50 bytes" in message
    assert ".nniignore (9 bytes" in message
    assert "node_modules/ (1500 files" in message
    assert "node_modules/pkg/" not in message  # same files as node_modules/: no news
    assert "venv/ (400 files" in message
    assert "src/ (95 files" in message
    assert "ignored/ (" not in message
    assert message.index("node_modules/") < message.index("venv/") < message.index("src/")
    assert str(root / ".nniignore") in message
    assert not destination.exists()
    assert not list(destination.parent.glob("*"))


def test_too_many_bytes_with_sparse_files(tmp_path: Path) -> None:
    root = tmp_path / "code"
    root.mkdir()
    sizes = {"big.bin": 200 * 1024 * 1024, "mid.bin": MAX_BYTES - 200 * 1024 * 1024, "one.bin": 1}
    for name, size in sizes.items():
        with open(root / name, "wb") as f:
            os.truncate(f.fileno(), size)
    with pytest.raises(CodeDirectoryTooLarge) as excinfo:
        pack(root, tmp_path / "code.tgz")
    message = str(excinfo.value)
    assert excinfo.value.file_count == 3
    assert excinfo.value.total_bytes == MAX_BYTES + 1
    assert f"has 3 files, {MAX_BYTES + 1} bytes (300.0 MiB)" in message
    assert f"big.bin ({200 * 1024 * 1024} bytes, 200.0 MiB)" in message
    assert message.index("big.bin") < message.index("mid.bin") < message.index("one.bin")
    assert "Fix: add" in message
    assert not (tmp_path / "code.tgz").exists()


def test_missing_code_directory_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        pack(missing, tmp_path / "code.tgz")


def test_a_file_as_code_directory_names_the_path(tmp_path: Path) -> None:
    not_dir = tmp_path / "file.py"
    not_dir.write_text("")
    with pytest.raises(NotADirectoryError, match=str(not_dir)):
        pack(not_dir, tmp_path / "code.tgz")


def test_a_fifo_is_refused_with_the_fix(tmp_path: Path) -> None:
    root = tmp_path / "code"
    root.mkdir()
    os.mkfifo(root / "pipe")
    with pytest.raises(CodeDirectoryError, match=r"pipe.*add 'pipe' to"):
        pack(root, tmp_path / "code.tgz")
    (root / ".nniignore").write_text("pipe\n")
    assert _pack(tmp_path, root).file_count == 1


def test_unreadable_directories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulated: the suite may run as root, which reads a directory whatever its mode.
    root = tmp_path / "code"
    _write(root, {"secret/x": "", "run.py": ""})
    real_scandir = os.scandir

    def scandir(path: Path) -> object:
        if Path(path).name == "secret":
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(CodeDirectoryError, match=r"cannot read .*secret.*Permission denied.*add 'secret/' to"):
        pack(root, tmp_path / "code.tgz")
    (root / ".nniignore").write_text("secret/\n")
    assert _pack(tmp_path, root).file_count == 2  # an ignored directory is never opened
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(PermissionError, match=f"code directory {root} is not readable"):
        pack(root, tmp_path / "code.tgz")
