"""The token a manager on loopback makes for itself when it is given none.

Loopback is open to every user of the machine, not only the manager's: on a shared GPU server, anyone could
otherwise send it an experiment whose trial command runs as its user. So, as Jupyter does, a manager given no
token makes one and writes it where only its user reads it; the same user's CLI finds it there by the URL's
port, and a browser logs in once at `/login?token=...`. `trialstream manager --no-token` opts out.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from urllib.parse import urlsplit

_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


def token_file(port: int) -> Path:
    """Where the manager on `port` keeps its token: the user's runtime directory (a tmpfs of their own), else
    ~/.local/state."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime else Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return base / "trialstream" / f"manager-{port}.token"


def make_token(port: int) -> tuple[str, Path]:
    """A new token for the manager on `port`, written for its user alone (the directory 0700, the file 0600;
    one left by a manager that ended without removing it is replaced)."""
    path = token_file(port)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    path.unlink(missing_ok=True)
    token = secrets.token_urlsafe(32)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(token + "\n")
    return token, path


def found_token(url: str) -> tuple[str, Path] | None:
    """The token of the manager at `url`, and its file, when it runs on this machine's loopback and made its own."""
    parts = urlsplit(url)
    if parts.hostname not in _LOOPBACK_NAMES or parts.port is None:
        return None
    path = token_file(parts.port)
    try:
        token = path.read_text().strip()
    except OSError:
        return None
    return (token, path) if token else None
