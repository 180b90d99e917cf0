"""The Redis URLs trialstream takes: their forms, parsing Sentinel's, checking any, and hiding passwords.

A module of its own because a URL is checked (`core.settings`) and printed with its password hidden
(the command line) where no connection is made, and because redis-py does not parse Sentinel's
`redis+sentinel://` URLs: the forms trialstream takes (`URL_FORMS`) and what each part means live here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote

import redis

from core.variables import REDIS_URL_ENV


class InvalidRedisUrl(ValueError):
    """A Redis URL that cannot be used; the message names the setting and how to write it."""

    def __init__(self, url: str, problem: str) -> None:
        super().__init__(f"{REDIS_URL_ENV} (--redis) {redact_url(url)}: {problem}; write {URL_FORMS}")


URL_FORMS = (
    "redis://[user:password@]host:port[/db], rediss://... (TLS), unix:///path, or "
    "redis+sentinel://[user:password@]host:port[,host:port...]/master_name[/db] (rediss+sentinel:// for TLS)"
)
SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
PLAIN_SCHEMES = ("redis", "rediss", "unix")


_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """Hide a password in a Redis URL (any scheme, Sentinel's included) before it is printed or logged: in its
    user part, and in its query (`?password=`, as redis-py takes it, a unix socket's URL above all)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    if "@" in rest:
        credentials, _, rest = rest.rpartition("@")
        user = credentials.split(":", 1)[0]
        rest = f"{user + ':' if user else ':'}***@{rest}"
    return f"{scheme}://" + _QUERY_PASSWORD.sub(r"\1***", rest)


@dataclass(frozen=True)
class SentinelUrl:
    """`redis+sentinel://[user:password@]host:port[,host:port...]/master_name[/db]`: the credentials are the
    master's (the sentinels take none), TLS (`rediss+sentinel`) is to the sentinels and the master alike."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int
    username: str | None
    password: str | None
    tls: bool


def parse_sentinel_url(url: str) -> SentinelUrl | None:
    """The Sentinel URL's parts, None for another scheme; InvalidRedisUrl when it is malformed."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SENTINEL_SCHEMES:
        if scheme not in PLAIN_SCHEMES or not sep:
            raise InvalidRedisUrl(url, f"unknown scheme {scheme + '://' if sep else '(none)'}")
        return None
    credentials, _, rest = rest.rpartition("@")
    username, _, password = credentials.partition(":")
    hosts, _, path = rest.partition("/")
    master, _, db = path.strip("/").partition("/")
    sentinels = []
    for item in filter(None, hosts.split(",")):
        host, colon, port = item.rpartition(":")
        if not colon or not host or not port.isdigit():
            raise InvalidRedisUrl(url, f"sentinel {item!r} is not host:port")
        sentinels.append((host.strip("[]"), int(port)))
    if not sentinels:
        raise InvalidRedisUrl(url, "no sentinel host:port")
    if not master or "/" in db or (db and not db.isdigit()):
        raise InvalidRedisUrl(url, "name the master after the sentinels (/master_name, then /db if not 0)")
    return SentinelUrl(
        tuple(sentinels),
        unquote(master),
        int(db or 0),
        unquote(username) or None,
        unquote(password) or None,
        SENTINEL_SCHEMES[scheme],
    )


def check_redis_url(url: str) -> str:
    """`url` if trialstream can use it, else InvalidRedisUrl naming the setting."""
    if parse_sentinel_url(url) is None:
        try:
            redis.connection.parse_url(url)
        except ValueError as error:
            raise InvalidRedisUrl(url, str(error).split(" (")[0]) from None
    return url
