"""The trial code directory as an archive file a remote platform stages on its hosts.

What goes in, NNI's limits and the bytes are core/code_archive.py's (the manager's CLI uploads the
same archive); here the archive is written to a file once per experiment, atomically, since the
file's hash is what a host is later asked whether it already has.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from core.code_archive import (
    MAX_BYTES,
    MAX_FILES,
    CodeDirectoryError,
    CodeDirectoryTooLarge,
    check_size,
    scan,
    write_archive,
)

__all__ = [
    "MAX_BYTES",
    "MAX_FILES",
    "CodeDirectoryError",
    "CodeDirectoryTooLarge",
    "CodePackage",
    "check_size",
    "pack",
]


@dataclass(frozen=True)
class CodePackage:
    """A written archive; ``sha256`` is of the uncompressed tar stream, so it does not depend on zlib's build."""

    path: Path
    sha256: str
    file_count: int
    total_bytes: int


def pack(code_directory: Path, destination: Path) -> CodePackage:
    """List the included files, refuse them if over NNI's limits, then write ``destination`` (a .tgz):
    beside it first, then renamed, so a crash never leaves a truncated archive to trust."""
    entries = scan(code_directory)
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{destination.name}.", dir=destination.parent)
    try:
        with os.fdopen(fd, "wb") as raw:
            sha256 = write_archive(entries, raw)
            raw.flush()
            os.fsync(raw.fileno())
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, destination)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return CodePackage(
        path=destination, sha256=sha256, file_count=len(entries), total_bytes=sum(e.size for e in entries)
    )
