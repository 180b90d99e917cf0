"""NNI's whole-list answers, rendered once per projection position.

NNI's web UI polls `/trial-jobs` and `/metric-data` (or `-latest` and `-range`) of the experiment it
shows, every few seconds, from every open browser tab; between two projector commits the answer cannot
change. So an answer of an experiment up to CACHED_TRIALS trials is rendered once and kept with the
projection position it was read at (the answer holds at least what that position has): a poll then
costs one HGET. Larger experiments are streamed a chunk at a time and never kept, so memory stays bounded.
Every answer carries the position as its ETag (with `Cache-Control: no-cache`), so a browser revalidates
and gets a bodiless 304 while nothing has changed.

Those revalidations are most of what open web UIs send, so `manager.api.app.Revalidations` answers
them in front of the routes: one pipelined read of the position (and of whether the experiment still
exists and is not archived) on one thread hop, shared by every revalidation of the experiment that arrived
before it was sent, where a route costs three thread hops and three round trips each. It is still a read
of Redis, never the in-process projector's position: other projectors (`trialstream projector`, another
manager, an import, a rebuild), a delete or an archive change the views without this process knowing,
and a 304 must mean that the views are, when the request is answered, what the ETag says.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from itertools import islice

from fastapi.responses import Response, StreamingResponse

from manager.views import CHUNK, ViewStore

JSON_TYPE = "application/json"
CACHED_TRIALS = 5_000  # an answer of more trials is streamed instead
CACHED_BYTES = 64 * 1024 * 1024  # all kept answers together


def etag(position: str) -> str:
    """The ETag of an answer read at this projection position."""
    return f'"{position}"'


class ListingCache:
    def __init__(self, max_bytes: int = CACHED_BYTES) -> None:
        self.max_bytes = max_bytes
        self._answers: OrderedDict[tuple[str, ...], tuple[str, bytes]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def answer(
        self, views: ViewStore, key: tuple[str, ...], items: Callable[[], Iterable[str]], if_none_match: str | None
    ) -> Response:
        """The JSON array of `items()` (each item one JSON text): a 304 if the client has it already, from
        the cache while the projection has not moved, else rendered (and kept, for a small experiment) or
        streamed (a large one)."""
        position = views.position()
        headers = {"etag": etag(position), "cache-control": "no-cache"}
        if if_none_match == headers["etag"]:
            return Response(status_code=304, headers=headers)
        with self._lock:
            kept = self._answers.get(key)
            if kept is not None and kept[0] == position:
                self._answers.move_to_end(key)
                return Response(kept[1], media_type=JSON_TYPE, headers=headers)
        if views.total() > CACHED_TRIALS:
            return StreamingResponse(_array(items()), media_type=JSON_TYPE, headers=headers)
        body = "".join(_array(items())).encode()
        self._keep(key, position, body)
        return Response(body, media_type=JSON_TYPE, headers=headers)

    def _keep(self, key: tuple[str, ...], position: str, body: bytes) -> None:
        with self._lock:
            old = self._answers.pop(key, None)
            if old is not None:
                self._bytes -= len(old[1])
            self._answers[key] = (position, body)
            self._bytes += len(body)
            while self._bytes > self.max_bytes and self._answers:
                _, (_, evicted) = self._answers.popitem(last=False)
                self._bytes -= len(evicted)


def _array(items: Iterable[str]) -> Iterator[str]:
    iterator = iter(items)
    yield "["
    separator = ""
    while batch := list(islice(iterator, CHUNK)):
        yield separator + ",".join(batch)
        separator = ","
    yield "]"
