"""`trialstream redis-acl`: the ACL file of a shared Redis, one user per kind of process (core.acl)."""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path

from core import acl
from core.settings import Settings


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    command = commands.add_parser(
        "redis-acl",
        help="print an ACL file for redis-server's `aclfile`: users manager, worker (and worker-PLATFORM), viewer",
    )
    command.add_argument(
        "--passwords",
        metavar="DIR",
        type=Path,
        required=True,
        help="each user's password is read from DIR/<user>; a missing one is made (random, mode 0600)",
    )
    command.add_argument(
        "--platform",
        action="append",
        default=[],
        metavar="NAME",
        help=f"also a user worker-NAME for that platform's workers (`worker` serves {acl.DEFAULT_WORKER_PLATFORM})",
    )
    command.set_defaults(handler=_print_acl_file)


def _print_acl_file(args: argparse.Namespace, settings: Settings) -> int:
    platforms = list(dict.fromkeys([acl.DEFAULT_WORKER_PLATFORM, *args.platform]))
    users = [user for user in acl.rules(platforms) if user != "default"]
    passwords = {user: _password(args.passwords, user) for user in users}
    print(acl.acl_file(passwords, platforms), end="")
    return 0


def _password(directory: Path, user: str) -> str:
    """The user's password from its file, made first when missing: only its owner can read it."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / user
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        password = path.read_text().strip()
        if not password:
            raise acl.AclError(f"{path} is empty: put the password of Redis user {user} in it, or delete it") from None
        return password
    with os.fdopen(descriptor, "w") as file:
        file.write(secrets.token_hex(32) + "\n")
    return path.read_text().strip()
