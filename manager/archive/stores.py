"""Where archives are kept: a directory (the default) or an S3-compatible bucket, named by one location.

    /srv/archive  or  file:///srv/archive   a directory (on a disk every reader of the experiment sees)
    s3://bucket/prefix                      a bucket; credentials from boto3's usual chain (AWS_* variables,
                                            ~/.aws), an endpoint URL for servers other than AWS (MinIO, ...)

An object is written whole or not at all (a directory's through a renamed temporary file, fsynced), so a
crash never leaves a half-written one under its name. A store that fails (a full disk, a read-only one, a
bucket that is not there, credentials it refuses) raises ArchiveStoreError, naming the object and what to fix.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse


class ArchiveStoreError(RuntimeError):
    pass


class ArchiveStore(Protocol):
    location: str
    endpoint_url: str | None  # an S3-compatible server's, written beside the location where archives are named

    def put(self, name: str, data: bytes) -> None: ...

    def get(self, name: str) -> bytes: ...

    def names(self, prefix: str) -> list[str]:
        """Every object's name under `prefix` (a folder: `exp/`)."""
        ...

    def delete(self, names: list[str]) -> None: ...


_WRITABLE = "; TRIALSTREAM_ARCHIVE_LOCATION names a directory this user may write, on a disk with room"


class DirectoryStore:
    def __init__(self, root: Path) -> None:
        self.root = root.expanduser()
        self.location = str(self.root)
        self.endpoint_url: str | None = None

    def put(self, name: str, data: bytes) -> None:
        path = self.root / name
        try:
            with self._errors(path, "cannot be written", _WRITABLE):
                _write(path, data)
        except ArchiveStoreError:
            for folder in (path.parent, path.parent.parent):  # the folders it made, while nothing is in them
                try:
                    folder.rmdir()
                except OSError:
                    break
            raise

    def get(self, name: str) -> bytes:
        try:
            return (self.root / name).read_bytes()
        except FileNotFoundError:
            raise ArchiveStoreError(f"{self.root / name} is missing from the archive") from None
        except OSError as error:
            raise ArchiveStoreError(f"{self.root / name} cannot be read: {error.strerror or error}") from None

    def names(self, prefix: str) -> list[str]:
        folder = self.root / prefix
        with self._errors(folder, "cannot be listed"):
            files = folder.rglob("*") if folder.is_dir() else []
            return sorted(str(path.relative_to(self.root)) for path in files if path.is_file() and _finished(path))

    def delete(self, names: list[str]) -> None:
        folders = set()
        for name in names:
            with self._errors(self.root / name, "cannot be deleted"):
                (self.root / name).unlink(missing_ok=True)
            folders.add((self.root / name).parent)
        for folder in folders:  # an archive's folder, then its experiment's, once empty
            for empty in (folder, folder.parent):
                try:
                    empty.rmdir()
                except OSError:
                    break

    @staticmethod
    @contextmanager
    def _errors(path: Path, what: str, fix: str = "") -> Iterator[None]:
        """The file system's errors (a full disk, a read-only one, no permission) as one that names the file."""
        try:
            yield
        except OSError as error:
            raise ArchiveStoreError(f"{path} {what}: {error.strerror or error}{fix}") from None


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.parent / f".part-{secrets.token_hex(8)}"
    # Made as any file of this process is (0666 less the umask, not mkstemp's 0600): the other users that read the
    # experiment read its archive too.
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power cut
    finally:
        os.close(directory)


def _finished(path: Path) -> bool:
    """Not a temporary file a put is still writing (or a dead one left)."""
    return not path.name.startswith(".part-")


S3_TIMEOUT_S = 20.0
"""To connect, and for each answer: boto3's default, 60 s tried five times, held an archive round (and a CLI) five
minutes on a server that took the connection and never answered."""
S3_ATTEMPTS = 3


class S3Store:
    def __init__(
        self,
        bucket: str,
        prefix: str,
        endpoint_url: str | None,
        timeout_s: float = S3_TIMEOUT_S,
        attempts: int = S3_ATTEMPTS,
    ) -> None:
        try:
            import boto3  # the `s3` extra: only users of a bucket install it
            from botocore.config import Config
        except ImportError:
            raise ArchiveStoreError("s3:// archives need boto3: pip install 'trialstream[s3]'") from None

        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.location = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.endpoint_url = endpoint_url
        self.timeout_s, self.attempts = timeout_s, attempts
        retries: Any = {"total_max_attempts": attempts, "mode": "standard"}
        config = Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries=retries)
        try:
            self._client: Any = boto3.client("s3", endpoint_url=endpoint_url, config=config)
        except ValueError as error:  # an endpoint that is not a URL
            raise ArchiveStoreError(f"{self.location}: {error}; {_ENDPOINT_URL}") from None

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def put(self, name: str, data: bytes) -> None:
        with self._errors(name):
            self._client.put_object(Bucket=self.bucket, Key=self._key(name), Body=data)

    def get(self, name: str) -> bytes:
        with self._errors(name):
            return bytes(self._client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read())

    def names(self, prefix: str) -> list[str]:
        found = []
        with self._errors(prefix):
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix))
            for page in pages:
                found += [item["Key"] for item in page.get("Contents", [])]
        cut = len(self.prefix) + 1 if self.prefix else 0
        return sorted(key[cut:] for key in found)

    def delete(self, names: list[str]) -> None:
        for start in range(0, len(names), 1000):  # S3's most per request
            objects = [{"Key": self._key(name)} for name in names[start : start + 1000]]
            with self._errors(names[start]):
                self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True})

    @contextmanager
    def _errors(self, name: str) -> Iterator[None]:
        """boto3's errors (a missing object, no credentials, no answer) as one that names the object and, where
        the store is set up wrong, the setting that fixes it. None of them holds a secret."""
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            ConnectTimeoutError,
            EndpointConnectionError,
            NoCredentialsError,
            ReadTimeoutError,
        )

        try:
            yield
        except self._client.exceptions.NoSuchKey:
            raise ArchiveStoreError(f"{self.location}/{name} is missing from the archive") from None
        except NoCredentialsError:
            raise ArchiveStoreError(f"{self.location}: no S3 credentials; {_CREDENTIALS}") from None
        except (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError) as error:
            server = self.endpoint_url or "AWS"
            timed_out = isinstance(error, ConnectTimeoutError | ReadTimeoutError)
            within = f" within {self.timeout_s:g} s, {self.attempts} tries" if timed_out else ""
            raise ArchiveStoreError(
                f"{self.location}/{name}: the S3 server {server} does not answer{within}; {_ENDPOINT_URL}"
            ) from None
        except ClientError as error:
            code = str(error.response.get("Error", {}).get("Code", ""))
            if code == "NoSuchBucket":
                raise ArchiveStoreError(
                    f"{self.location}: there is no bucket {self.bucket} on {self.endpoint_url or 'AWS'}: create it, "
                    "or set TRIALSTREAM_ARCHIVE_LOCATION to s3://BUCKET/prefix of one that is there"
                ) from None
            if code in _REFUSED:
                raise ArchiveStoreError(
                    f"{self.location}/{name}: the S3 server refused these credentials ({code} on "
                    f"{error.operation_name}); {_CREDENTIALS}, and that they may read, write, list and delete there"
                ) from None
            raise ArchiveStoreError(f"{self.location}/{name}: {error}") from None
        except BotoCoreError as error:
            raise ArchiveStoreError(f"{self.location}/{name}: {error}") from None


_ENDPOINT_URL = (
    "TRIALSTREAM_ARCHIVE_ENDPOINT_URL names an S3-compatible server's URL (http://host:port), or none for AWS"
)
_CREDENTIALS = "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, ~/.aws) of this process"
_REFUSED = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "InvalidToken",
        "ExpiredToken",
        "InvalidClientTokenId",
    }
)


def open_store(location: str, endpoint_url: str | None = None) -> ArchiveStore:
    """The store a location names: a path or file:// URL, or s3://bucket/prefix."""
    parsed = urlparse(location)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ArchiveStoreError(f"archive location {location!r}: name the bucket, s3://BUCKET/prefix")
        return S3Store(parsed.netloc, parsed.path, endpoint_url)
    if parsed.scheme == "file":
        return DirectoryStore(Path(parsed.path))
    if parsed.scheme:
        raise ArchiveStoreError(f"archive location {location!r}: use a directory, file:///path or s3://bucket/prefix")
    return DirectoryStore(Path(location))
