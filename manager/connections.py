"""Redis connections, and errors that say which server could not be reached."""

from __future__ import annotations

import os

import redis

REDIS_URL_ENV = "TRIALSTREAM_REDIS_URL"


class RedisUnavailable(ConnectionError):
    def __init__(self, url: str, cause: Exception) -> None:
        super().__init__(f"cannot reach Redis at {redact_url(url)}: {cause}")


def redact_url(url: str) -> str:
    """Hide a password in a Redis URL before it is printed or logged."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    credentials, _, host = rest.rpartition("@")
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user + ':' if user else ':'}***@{host}"


def redis_url(explicit: str | None = None) -> str | None:
    return explicit or os.environ.get(REDIS_URL_ENV) or None


def connect(url: str, *, check: bool = True, decode: bool = True) -> redis.Redis:
    """A client (decoded strings unless `decode=False`, which RQ needs); `check` pings so a wrong URL fails here."""
    client = redis.Redis.from_url(url, decode_responses=decode, health_check_interval=30)
    if check:
        try:
            client.ping()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as error:
            raise RedisUnavailable(url, error) from error
    return client
