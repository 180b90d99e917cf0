"""Redis ACL users for least privilege: what each kind of trialstream process may do, by key pattern.

The table lives beside `core.keys`, whose keys it names. A rule list is in redis-server's ACL syntax
(Redis 7 selectors: a command is allowed if the root rules or one `(...)` selector allow it on every key it
touches, also inside Lua scripts). Workers may append to the log but never delete, trim or rename it: the
commands that could (`DEL`, `XTRIM`, `SET`, `EXPIRE`, ...) are granted only on the keys a worker owns
(claims, offsets, leases, RQ's `rq:*`), never on an experiment's stream. What ACLs cannot express in Redis 7.0:
arguments. `XADD ... MAXLEN 0` trims a stream, and a worker must be allowed XADD on the log.
"""

from __future__ import annotations

import hashlib

from core import keys

MANAGER = "manager"
WORKER = "worker"
VIEWER = "viewer"
DEFAULT_WORKER_PLATFORM = "local"
"""The `worker` user serves this platform; another platform's workers log in as `worker-<platform>`, so that
none reads the secrets of another (an SSH password of a remote machine list, say)."""

_P = keys.LOG_PREFIX


class AclError(ValueError):
    """A password file that cannot be used: the user's to fix."""


_EXP = f"{_P}:exp:*"

CONNECTION = "+@connection -@admin -@dangerous +info +time +role +@transaction"
"""Keyless commands every user needs: AUTH, HELLO, PING, SELECT, CLIENT SETNAME, MULTI/EXEC, INFO (the reaper
reads the server's uptime), TIME (leases run on Redis's clock), ROLE and WAIT (an append waits for the
replicas ROLE lists: core.replication). WATCH has keys: where no key pattern of the user's matches, it is
refused."""

SCRIPTS = "+eval +evalsha +eval_ro +evalsha_ro +script|load +script|exists"
"""Lua scripts (the idempotent append, leases, RQ's), never SCRIPT FLUSH, KILL or DEBUG, nor FUNCTION."""

SAFE = "-@dangerous -@admin -script|flush -script|kill -script|debug -@pubsub -function"
"""Taken back after a broad grant: FLUSHALL, FLUSHDB, KEYS, SORT, CONFIG, ACL, DEBUG, SHUTDOWN, MODULE, ..."""

LOG_KEYS = (f"{_EXP}:events", f"{_EXP}:idem", f"{_EXP}:commands:*", keys.ACTIVITY, keys.ACTIVITY_CLOCK)
"""What one append writes (core.event_store's script): the stream, its idempotency hash, the trials' command
streams and the activity index: added to, never deleted, trimmed or renamed by a worker."""

APPEND = "+@read +xadd +hset +hdel +zadd +incr +watch"

WORKER_OWNED = (
    f"{_EXP}:claim:*",  # claims of attempts: set, released, deleted when a deferred attempt is given up
    f"{_EXP}:offsets:*",  # output read so far, deleted with the attempt's end
    f"{_EXP}:placement-turn",  # a retry placed among a hybrid experiment's platforms
    keys.LEASES,
    f"{_P}:reaper:*",  # the reap rounds and their hold
    f"{_P}:parked:*",
    f"{_P}:gpu:*",  # the GPU ledger of a machine (workers.platforms.shared.gpu), the machines' GPUs (local.gpus)
    f"{_P}:doomed:*",  # the remote platform's kill list of a host
    f"{_P}:wake:*",  # a worker's commands reader is woken through these (workers.runtime.trial_links)
    "rq:*",  # RQ: queues, jobs, registries, executions, worker registrations; it deletes jobs and workers
)

READ_ONLY = (
    keys.EXPERIMENTS,
    keys.ARCHIVED,  # read by the append script (a call of its own, not one of its KEYS: those need write access)
    f"{_P}:view:*",
    f"{_EXP}:runner",
    f"{_EXP}:runner-epoch",
    f"{_P}:projector:*",
    f"{_P}:manager:*",
)
"""Keys a worker or a viewer reads but never writes. A viewer also reads everything a worker writes."""

THAWED = (keys.thawed("*"),)
"""What says an archived experiment's copy is in Redis for a while (manager.archive.moves.thaw): a viewer may not
bring one back, but reads one another user did."""

RESTORE = "+restore"
"""Taken back with `@dangerous` (a forged payload can crash a server): the manager restores what it dumped itself
into its archive, checked against the archive's checksums, when an archived experiment is read or restored."""


def _patterns(patterns: tuple[str, ...], permission: str = "") -> str:
    return " ".join(f"{permission}~{pattern}" for pattern in patterns)


def worker_user(platform: str) -> str:
    return WORKER if platform == DEFAULT_WORKER_PLATFORM else f"{WORKER}-{platform}"


def rules(worker_platforms: list[str]) -> dict[str, str]:
    """User -> its ACL rules (without `on` and its password): `default` off, then the users, each platform's
    worker on its own."""
    table = {
        "default": "off resetpass resetkeys resetchannels -@all",
        MANAGER: f"resetkeys resetchannels ~* &* +@all {SAFE} {CONNECTION} +@pubsub {SCRIPTS} {RESTORE}",
        VIEWER: (
            f"resetkeys resetchannels -@all {CONNECTION} "
            f"({_patterns(LOG_KEYS + WORKER_OWNED + READ_ONLY + THAWED, '%R')} +@read -@dangerous)"
        ),
    }
    for platform in worker_platforms:
        table[worker_user(platform)] = (
            f"resetkeys resetchannels &rq:pubsub:* -@all {CONNECTION} {SCRIPTS} +subscribe +unsubscribe "
            f"({_patterns(LOG_KEYS)} {APPEND} -@dangerous {SCRIPTS}) "
            f"({_patterns(WORKER_OWNED)} +@read +@write +watch -@dangerous {SCRIPTS}) "
            f"(%R~{keys.secrets('*', platform)} {_patterns(READ_ONLY, '%R')} +@read -@dangerous)"
        )
    return table


def password_hash(password: str) -> str:
    """What an ACL file stores instead of the password: `#` and its SHA-256 (redis-server's own form)."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def acl_file(passwords: dict[str, str], worker_platforms: list[str]) -> str:
    """The ACL file's text: one `user` line per user, `passwords` by user, stored hashed."""
    lines = []
    for user, rule in rules(worker_platforms).items():
        login = "" if user == "default" else f"on {password_hash(passwords[user])} "
        lines.append(f"user {user} {login}{rule}\n")
    return "".join(lines)
