"""The trial code directory as one deterministic tarball: what is sent to other machines, and unpacked there.

A remote platform uploads the code directory once per experiment and machine (workers/platforms/shared/),
and `trialstream --manager URL run` uploads it to the manager; the archive's hash is the key that says
"this machine already has this code", so the same content must give the same bytes whatever the
mtimes, owners or umask. The rules follow NNI 3.0 (``ts/nni_manager/common/tarball.ts``):
only ``.nniignore`` at the root of the code directory excludes anything, with gitignore semantics;
nothing else is skipped implicitly (not ``.git``, not ``__pycache__``, not ``.nniignore`` itself);
only files and symlinks are counted and stored (empty directories are dropped); more than 2000 files
or more than 300 MiB of them is refused, before anything is written (NNI's docs and 2.x say 300 MB;
3.0's tarball.ts raised it to 1 GiB without saying so, and we keep the documented limit). `unpack` is
the manager's side of an upload: the same limits, and no member that leaves its directory.
"""

from __future__ import annotations

import bz2
import copy
import gzip
import hashlib
import io
import lzma
import os
import shutil
import stat
import tarfile
import tempfile
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import pathspec

from schemas.config import ConfigError

if TYPE_CHECKING:
    from typing_extensions import Buffer

IGNORE_FILE = ".nniignore"
MAX_FILES = 2000
MAX_BYTES = 300 * 1024 * 1024  # NNI: ``fileTotalSize > 300 * 1024 * 1024`` is an error
# The tar stream `write_archive` writes within those limits is at most MAX_TAR_BYTES: per member a
# header block, PAX records for a long or non-ASCII name and link target (each under PATH_MAX, 4096
# bytes) with their own header, and padding to 512 bytes; then the end blocks and the last record's padding.
MEMBER_OVERHEAD_BYTES = 16 * 1024
MAX_TAR_BYTES = MAX_BYTES + MAX_FILES * MEMBER_OVERHEAD_BYTES + 2 * tarfile.RECORDSIZE
# ...and gzip makes at most this of it (zlib's compressBound, plus gzip's header and trailer): the
# largest upload the CLI can send, what an HTTP limit on code uploads must let through.
MAX_ARCHIVE_BYTES = MAX_TAR_BYTES + (MAX_TAR_BYTES >> 12) + (MAX_TAR_BYTES >> 14) + (MAX_TAR_BYTES >> 25) + 13 + 18
_OFFENDERS = 5
_GZIP_LEVEL = 6


class CodeDirectoryError(ValueError):
    """The code directory holds something that cannot be shipped as it is (fixable with ``.nniignore``)."""


class CodeDirectoryTooLarge(CodeDirectoryError):
    """More files or bytes than NNI lets a platform copy; the message names what to ignore."""

    def __init__(self, message: str, file_count: int, total_bytes: int) -> None:
        super().__init__(message)
        self.file_count = file_count
        self.total_bytes = total_bytes


@dataclass(frozen=True)
class Entry:
    name: str  # relative POSIX path inside the archive
    path: Path
    size: int  # lstat size: a symlink counts its target's length, as in NNI
    link_target: str | None
    executable: bool


def scan(code_directory: Path) -> list[Entry]:
    """The files an archive of `code_directory` holds, in archive order; refused over NNI's limits.

    Symlinks are stored as symlinks and never followed, as NNI uploads them "as is": a link to a
    shared mount (``data -> /nfs/datasets``) is a normal setup on clusters and must keep working,
    refusing it would reject code directories NNI accepts, and following it could pull in a whole
    dataset or anything outside the code directory. A link that is dangling on the remote host
    fails there exactly as it would under NNI.
    """
    root = _checked_root(code_directory)
    entries = _scan(root)
    _check_limits(root, entries)
    return entries


def archive(code_directory: Path) -> bytes:
    """The whole archive in memory, for an upload (NNI's limits keep it bounded)."""
    buffer = io.BytesIO()
    write_archive(scan(code_directory), buffer)
    return buffer.getvalue()


def check_size(code_directory: Path) -> None:
    """What `scan` refuses, without writing anything: before an experiment starts."""
    scan(code_directory)


def _checked_root(code_directory: Path) -> Path:
    """Fail with the path in the message rather than with a half-walked tree later."""
    root = Path(code_directory)
    if not root.exists():
        raise FileNotFoundError(f"code directory {root} does not exist")
    if not root.is_dir():
        raise NotADirectoryError(f"code directory {root} is not a directory")
    if not os.access(root, os.R_OK | os.X_OK):
        raise PermissionError(f"code directory {root} is not readable")
    return root.resolve()


def _ignore_spec(root: Path) -> pathspec.GitIgnoreSpec:
    """Only the root's ``.nniignore`` counts (NNI 3.0); nested ones are ordinary files."""
    ignore_file = root / IGNORE_FILE
    if not ignore_file.is_file():
        return pathspec.GitIgnoreSpec.from_lines([])
    try:
        text = ignore_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CodeDirectoryError(f"cannot read {ignore_file}: {exc}") from exc
    return pathspec.GitIgnoreSpec.from_lines(text.splitlines())


def _scan(root: Path) -> list[Entry]:
    """Walk with lstat only, pruning ignored directories: git cannot re-include below an excluded one."""
    spec = _ignore_spec(root)
    entries: list[Entry] = []
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        directory = root / rel_dir if rel_dir else root
        try:
            children = list(os.scandir(directory))
        except OSError as exc:
            raise CodeDirectoryError(
                f"cannot read {directory} in code directory {root}: {exc.strerror}; "
                f"fix its permissions or add '{rel_dir}/' to {root / IGNORE_FILE}"
            ) from exc
        for child in children:
            name = f"{rel_dir}/{child.name}" if rel_dir else child.name
            st = child.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                if not spec.match_file(name + "/"):
                    pending.append(name)
                continue
            if spec.match_file(name):
                continue
            if stat.S_ISLNK(st.st_mode):
                entries.append(Entry(name, Path(child.path), st.st_size, os.readlink(child.path), False))
            elif stat.S_ISREG(st.st_mode):
                entries.append(Entry(name, Path(child.path), st.st_size, None, bool(st.st_mode & 0o111)))
            else:
                raise CodeDirectoryError(
                    f"{child.path} in code directory {root} is not a regular file, directory or symlink "
                    f"(a FIFO, socket or device cannot be copied); add '{name}' to {root / IGNORE_FILE}"
                )
    entries.sort(key=lambda e: e.name)
    return entries


def _check_limits(root: Path, entries: list[Entry]) -> None:
    """Refuse as NNI does, but say what to ignore: the biggest files and the most crowded directories."""
    count = len(entries)
    total = sum(e.size for e in entries)
    if count <= MAX_FILES and total <= MAX_BYTES:
        return
    largest = sorted(entries, key=lambda e: (-e.size, e.name))[:_OFFENDERS]
    dir_files: Counter[str] = Counter()
    dir_bytes: Counter[str] = Counter()
    for e in entries:
        parts = e.name.split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            d = "/".join(parts[:depth])
            dir_files[d] += 1
            dir_bytes[d] += e.size

    def _redundant(d: str) -> bool:
        # "a/b/" adds nothing when "a/" holds exactly the same files: ignoring "a/" is the fix.
        parent = d.rpartition("/")[0]
        return bool(parent) and dir_files[parent] == dir_files[d]

    crowded = sorted((d for d in dir_files if not _redundant(d)), key=lambda d: (-dir_files[d], d))[:_OFFENDERS]
    lines = [
        f"code directory {root} has {count} files, {total} bytes ({_mib(total)}) after {IGNORE_FILE}; "
        f"NNI allows at most {MAX_FILES} files and {MAX_BYTES} bytes ({_mib(MAX_BYTES)}).",
        "Largest files:",
        *(f"  {e.name} ({e.size} bytes, {_mib(e.size)})" for e in largest),
    ]
    if crowded:
        lines.append("Directories with the most files:")
        lines.extend(f"  {d}/ ({dir_files[d]} files, {_mib(dir_bytes[d])})" for d in crowded)
    lines.append(
        f"Fix: add what the trial does not need (data, checkpoints, logs, environments) to "
        f"{root / IGNORE_FILE}, gitignore syntax, e.g. 'data/' or '*.ckpt'."
    )
    raise CodeDirectoryTooLarge("\n".join(lines), count, total)


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):.1f} MiB"


class _HashingWriter(io.RawIOBase):
    """Hashes the tar stream on its way into gzip, so the hash needs no second read of the archive."""

    def __init__(self, sink: gzip.GzipFile) -> None:
        super().__init__()
        self._sink = sink
        self.digest = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data: Buffer) -> int:
        self.digest.update(data)
        return self._sink.write(data)


def write_archive(entries: list[Entry], sink: BinaryIO) -> str:
    """Write the tar.gz of `entries` to `sink` (left open); returns the sha256 of the uncompressed tar
    stream, which does not depend on zlib's build."""
    with gzip.GzipFile(filename="", mode="wb", fileobj=sink, compresslevel=_GZIP_LEVEL, mtime=0) as gz:
        hashing = _HashingWriter(gz)
        with tarfile.open(fileobj=hashing, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for entry in entries:
                _add(tar, entry)
    return hashing.digest.hexdigest()


def _add(tar: tarfile.TarFile, entry: Entry) -> None:
    """Normalise everything but name, content, link target and the executable bit."""
    info = tarfile.TarInfo(entry.name)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if entry.link_target is not None:
        info.type = tarfile.SYMTYPE
        info.linkname = entry.link_target
        info.mode = 0o777
        tar.addfile(info)
        return
    info.mode = 0o755 if entry.executable else 0o644
    try:
        with open(entry.path, "rb") as f:
            info.size = os.fstat(f.fileno()).st_size
            tar.addfile(info, f)
    except OSError as exc:
        raise CodeDirectoryError(
            f"cannot read {entry.path}: {exc.strerror or exc}; fix its permissions or add it to {IGNORE_FILE}"
        ) from exc


# Unpacking an uploaded archive (`trialstream manager`'s PUT /code), within the same limits.


class ArchiveTooLarge(ValueError):
    """An archive over NNI's limits for a code directory; the message names the limit."""


# What an upload may unpack to: NNI's limits on a code directory (core/code_archive), as the CLI
# applies them before it uploads. `tar` (unlike the CLI) also writes one entry per directory.
UNPACK_MAX_FILES = MAX_FILES  # files and links
UNPACK_MAX_DIRECTORIES = MAX_FILES
UNPACK_MAX_BYTES = MAX_BYTES  # their contents (a link counts its target's length, as in NNI)
# The tar stream itself (headers, padding, directory entries): bounded before any header is parsed,
# so a small archive cannot decompress to gigabytes of headers either.
UNPACK_MAX_TAR_BYTES = MAX_TAR_BYTES + UNPACK_MAX_DIRECTORIES * MEMBER_OVERHEAD_BYTES


# _code_member has checked each member: Python 3.14's default filter would refuse absolute symlinks
_TRUSTED: dict[str, Any] = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}


def unpack(body: bytes, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=".upload-"))
    try:
        with tarfile.open(fileobj=_Capped(_decompressed(body), UNPACK_MAX_TAR_BYTES), mode="r|") as archive:
            files = directories = size = 0
            for member in archive:  # one at a time, each counted before it is written
                if member.isdir():
                    directories += 1
                else:
                    files += 1
                    size += member.size if member.isreg() else len(member.linkname)
                if files > UNPACK_MAX_FILES:
                    raise ArchiveTooLarge(f"code upload: more than {UNPACK_MAX_FILES} files (NNI's limit for code)")
                if directories > UNPACK_MAX_DIRECTORIES:
                    raise ArchiveTooLarge(f"code upload: more than {UNPACK_MAX_DIRECTORIES} directories")
                if size > UNPACK_MAX_BYTES:
                    raise ArchiveTooLarge(
                        f"code upload: its files hold more than {UNPACK_MAX_BYTES} bytes (NNI's limit for code)"
                    )
                safe = _code_member(member, str(scratch))
                if safe is not None:
                    archive.extract(safe, scratch, **_TRUSTED)
        _check_unpacked(scratch)
        try:
            scratch.rename(target)
        except OSError:
            if not target.is_dir():  # else the same upload, unpacked at the same time: it is there
                raise
    except ArchiveTooLarge:
        raise
    except (tarfile.TarError, OSError, EOFError, ValueError, RecursionError, zlib.error, lzma.LZMAError) as error:
        # ValueError, RecursionError: what tarfile raises on some malformed names and link loops
        raise ConfigError(f"code upload: not a usable tar archive ({error})") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _code_member(member: tarfile.TarInfo, destination: str) -> tarfile.TarInfo | None:
    """What the `data` extraction filter allows, checked here because Python before 3.11.4 (Debian 12's
    3.11.2) has no filters: no path outside `destination`, none written through a link, no devices, no
    setuid or group/other write bits, no foreign owners, a hard link only to a regular file inside. But
    symlinks stay as they are, absolute ones included, as in NNI's uploads. None: nothing to write (the
    archive's own top directory, `./`)."""
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        raise tarfile.ExtractError(f"{member.name!r} is not a file, a directory or a link")
    parts = [part for part in member.name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise tarfile.ExtractError(f"{member.name!r}: '..' in a name")
    if not parts:
        if member.isdir():
            return None
        raise tarfile.ExtractError(f"{member.name!r} is not a file name")
    inside = os.path.realpath(destination)
    name = "/".join(parts)
    path = os.path.join(inside, name)
    if os.path.commonpath([os.path.realpath(path), inside]) != inside:  # through the links unpacked so far
        raise tarfile.ExtractError(f"{member.name!r} is outside the code directory")
    # tarfile, failing to make a link, copies its target's member instead (the unchecked original): so a
    # link must be makeable, never over something already there, and a hard link only to a regular file
    if (member.issym() or member.islnk()) and (not member.linkname or os.path.lexists(path)):
        raise tarfile.ExtractError(f"{member.name!r}: a link with no target, or over an entry already there")
    if member.islnk():
        target = os.path.join(inside, member.linkname)
        if os.path.commonpath([os.path.realpath(target), inside]) != inside or not (
            os.path.isfile(target) and not os.path.islink(target)
        ):
            raise tarfile.ExtractError(f"{member.name!r} links to something other than a file of the code directory")
    mode = member.mode & 0o755
    if member.isreg() or member.islnk():
        mode = (mode if mode & 0o100 else mode & ~0o111) | 0o600
    elif member.isdir():
        mode |= 0o700
    safe = copy.copy(member)
    safe.name, safe.mode = name, mode
    safe.uid, safe.gid, safe.uname, safe.gname = os.getuid(), os.getgid(), "", ""
    return safe


def _check_unpacked(directory: Path) -> None:
    """What is on disk after unpacking, whatever path tarfile took: files, directories and symlinks of this
    process's user, with no setuid, setgid, sticky or group/other write bits."""
    for parent, directories, files in os.walk(directory):
        for entry in (*directories, *files):
            found = os.lstat(os.path.join(parent, entry))
            if stat.S_ISLNK(found.st_mode):
                continue
            if not (stat.S_ISREG(found.st_mode) or stat.S_ISDIR(found.st_mode)):
                raise tarfile.ExtractError(f"{entry!r} is not a file, a directory or a link")
            if found.st_mode & 0o7022 or found.st_uid != os.getuid():
                raise tarfile.ExtractError(f"{entry!r} unpacked with other permissions or owner than allowed")


def _decompressed(body: bytes) -> io.BufferedIOBase:
    """The tar stream of a .tar.gz (what the CLI sends), .tar.bz2, .tar.xz or plain .tar, read lazily."""
    raw = io.BytesIO(body)
    if body.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if body.startswith(b"BZh"):
        return bz2.BZ2File(raw)
    if body.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile(raw)
    return raw


class _Capped(io.RawIOBase):
    """A stream that refuses to give more than `limit` bytes: a gzip bomb stops at the limit."""

    def __init__(self, source: io.BufferedIOBase, limit: int) -> None:
        super().__init__()
        self._source = source
        self._limit = limit
        self._read = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._source.read(min(len(buffer), self._limit + 1 - self._read))
        self._read += len(data)
        if self._read > self._limit:
            raise ArchiveTooLarge(
                f"code upload: unpacks to more than {self._limit} bytes of tar (NNI's limit for code)"
            )
        buffer[: len(data)] = data
        return len(data)
