"""Object storage with one global resourceVersion counter, bounded event history and watch fan-out.

Semantics mirrored from the real apiserver (kubernetes/kubernetes):
- resourceVersion is one cluster-wide increasing counter (etcd revision), rendered as a string; a no-op update
  does not bump it (`staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go`).
- metadata.generation starts at 1 and increments when the spec changes; with a status subresource, writes to the
  main resource keep the stored status and writes to /status keep everything but status
  (`staging/src/k8s.io/apiextensions-apiserver/pkg/registry/customresource/strategy.go`).
- Watch (`staging/src/k8s.io/apiserver/pkg/storage/cacher/cacher.go`, `watch_cache.go`): from resourceVersion R
  the events after R are replayed from the window, then live ones; R older than the window is 410 Expired; R absent
  or "0" first sends a synthetic ADDED for each current object. A filtered watch turns an update that leaves the
  selector into DELETED and one that enters it into ADDED (`cacheWatcher.convertToWatchEvent`).
- Deletion (`registry/store.go` Delete + `pkg/controller/garbagecollector`): an object with finalizers only gets
  metadata.deletionTimestamp; it is removed once its finalizers are gone. propagationPolicy Orphan adds the
  `orphan` finalizer, Foreground the `foregroundDeletion` finalizer; Background removes at once and the garbage
  collector deletes the dependents. A bound pod's deletion is graceful: deletionTimestamp = now + grace and
  deletionGracePeriodSeconds (spec.terminationGracePeriodSeconds, default 30); the kubelet removes it once its
  containers are gone. A pod not bound to a node is removed at once (`pkg/registry/core/pod/strategy.go`
  CheckGracefulDelete).
"""

from __future__ import annotations

import base64
import builtins
import copy
import datetime as dt
import json
import queue
import threading
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from simulators.kubesim import errors
from simulators.kubesim.resources import ResourceType
from simulators.kubesim.selectors import Selector

ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"


def now_rfc3339(offset_s: float = 0.0) -> str:
    """Second-precision RFC3339 UTC, like metav1.Time."""
    t = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=offset_s)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Event:
    rv: int
    type: str
    plural: str
    namespace: str
    obj: dict[str, Any]
    old: dict[str, Any] | None


class Watcher:
    """One open watch: a queue of (type, object) for the events that pass its namespace and selectors."""

    def __init__(self, plural: str, namespace: str | None, selector: Selector) -> None:
        self.plural = plural
        self.namespace = namespace
        self.selector = selector
        self.events: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue()
        self.closed = False

    def offer(self, ev: Event) -> None:
        if ev.plural != self.plural or (self.namespace and ev.namespace != self.namespace):
            return
        new_match = self.selector.matches(ev.obj)
        if ev.type == MODIFIED:
            old_match = ev.old is not None and self.selector.matches(ev.old)
            if old_match and new_match:
                self.events.put((MODIFIED, ev.obj))
            elif new_match:
                self.events.put((ADDED, ev.obj))
            elif old_match:
                self.events.put((DELETED, ev.obj))
        elif new_match:
            self.events.put((ev.type, ev.obj))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.events.put(None)


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    md = obj["metadata"]
    return md.get("namespace", ""), md["name"]


def _spec_part(rt: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
    """What counts as 'spec' for generation: everything but metadata (and status with a status subresource)."""
    skip = {"metadata", "status"} if rt.status_subresource else {"metadata"}
    return {k: v for k, v in obj.items() if k not in skip}


class Store:
    """Thread-safe object store; every write emits an Event to watchers and internal listeners under one lock."""

    def __init__(self, history_limit: int = 10000) -> None:
        self.lock = threading.RLock()
        self._objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {}
        # indexes kept by _put/_pop, so that finding an object by uid or an owner's dependents scans nothing
        self._by_uid: dict[str, tuple[str, tuple[str, str]]] = {}
        self._dependents: dict[str, set[tuple[str, tuple[str, str]]]] = {}
        self._types: dict[str, ResourceType] = {}
        self._rv = 0
        self._history: deque[Event] = deque()
        self._floor = 0  # the history holds every event with rv > floor
        self._history_limit = history_limit
        self._watchers: set[Watcher] = set()
        self._listeners: list[Callable[[Event], None]] = []

    # ---- plumbing -------------------------------------------------------------------------------------------
    def register(self, rt: ResourceType) -> None:
        with self.lock:
            self._types[rt.plural] = rt
            self._objects.setdefault(rt.plural, {})

    def subscribe(self, listener: Callable[[Event], None]) -> None:
        """Internal controllers get every event; the callback runs under the store lock and must not block."""
        with self.lock:
            self._listeners.append(listener)

    @property
    def resource_version(self) -> int:
        with self.lock:
            return self._rv

    def _emit(self, rt: ResourceType, type_: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        ev = Event(
            self._rv,
            type_,
            rt.plural,
            obj["metadata"].get("namespace", ""),
            copy.deepcopy(obj),
            copy.deepcopy(old) if old is not None else None,
        )
        self._history.append(ev)
        while len(self._history) > self._history_limit:
            self._floor = self._history.popleft().rv
        for w in list(self._watchers):
            w.offer(ev)
        for listener in self._listeners:
            listener(ev)

    def compact(self) -> None:
        with self.lock:
            self._history.clear()
            self._floor = self._rv

    def _put(self, rt: ResourceType, key: tuple[str, str], obj: dict[str, Any]) -> None:
        old = self._objects[rt.plural].get(key)
        if old is not None:
            self._unindex(rt.plural, key, old)
        self._objects[rt.plural][key] = obj
        self._by_uid[obj["metadata"]["uid"]] = (rt.plural, key)
        for ref in obj["metadata"].get("ownerReferences") or []:
            self._dependents.setdefault(ref.get("uid", ""), set()).add((rt.plural, key))

    def _pop(self, rt: ResourceType, key: tuple[str, str]) -> dict[str, Any]:
        obj = self._objects[rt.plural].pop(key)
        self._unindex(rt.plural, key, obj)
        return obj

    def _unindex(self, plural: str, key: tuple[str, str], obj: dict[str, Any]) -> None:
        self._by_uid.pop(obj["metadata"]["uid"], None)
        for ref in obj["metadata"].get("ownerReferences") or []:
            owner = ref.get("uid", "")
            dependents = self._dependents.get(owner)
            if dependents is not None:
                dependents.discard((plural, key))
                if not dependents:
                    del self._dependents[owner]

    # ---- reads ----------------------------------------------------------------------------------------------
    def get(self, rt: ResourceType, namespace: str, name: str) -> dict[str, Any] | None:
        with self.lock:
            obj = self._objects.get(rt.plural, {}).get((namespace if rt.namespaced else "", name))
            return copy.deepcopy(obj) if obj is not None else None

    def must_get(self, rt: ResourceType, namespace: str, name: str) -> dict[str, Any]:
        obj = self.get(rt, namespace, name)
        if obj is None:
            raise errors.not_found(rt.plural, rt.group, name)
        return obj

    def list(
        self, rt: ResourceType, namespace: str | None, selector: Selector | None = None
    ) -> tuple[list[dict[str, Any]], int]:
        with self.lock:
            items = [
                copy.deepcopy(o)
                for k, o in sorted(self._objects.get(rt.plural, {}).items())
                if (not namespace or k[0] == namespace) and (selector is None or selector.matches(o))
            ]
            return items, self._rv

    def has_uid(self, uid: str) -> bool:
        with self.lock:
            return uid in self._by_uid

    def get_by_uid(self, uid: str) -> tuple[ResourceType, dict[str, Any]] | None:
        """The stored object with this uid (a copy) and its type."""
        with self.lock:
            found = self._by_uid.get(uid)
            if found is None:
                return None
            plural, key = found
            return self._types[plural], copy.deepcopy(self._objects[plural][key])

    def dependent_uids(self, owner_uid: str) -> builtins.list[str]:
        """The uids of the objects with an ownerReference to `owner_uid`."""
        with self.lock:
            return [
                self._objects[plural][key]["metadata"]["uid"] for plural, key in self._dependents.get(owner_uid, ())
            ]

    def dependents(
        self, owner_uid: str, plural: str | None = None
    ) -> builtins.list[tuple[ResourceType, dict[str, Any]]]:
        """The objects (copies; of one resource if `plural` is given) with an ownerReference to `owner_uid`, in
        (resource, namespace, name) order."""
        with self.lock:
            return [
                (self._types[p], copy.deepcopy(self._objects[p][key]))
                for p, key in sorted(self._dependents.get(owner_uid, ()))
                if plural is None or p == plural
            ]

    # ---- writes ---------------------------------------------------------------------------------------------
    def create(self, rt: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            obj = copy.deepcopy(obj)
            md = obj.setdefault("metadata", {})
            if not rt.namespaced:
                md.pop("namespace", None)
            key = _key(obj)
            if key in self._objects[rt.plural]:
                raise errors.already_exists(rt.plural, rt.group, md["name"])
            for drop in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds", "selfLink"):
                md.pop(drop, None)
            md["uid"] = str(uuid.uuid4())
            md["creationTimestamp"] = now_rfc3339()
            if rt.custom:
                md["generation"] = 1
            self._rv += 1
            md["resourceVersion"] = str(self._rv)
            obj["apiVersion"], obj["kind"] = rt.api_version, rt.kind
            self._put(rt, key, obj)
            self._emit(rt, ADDED, obj, None)
            return copy.deepcopy(obj)

    def update(
        self,
        rt: ResourceType,
        namespace: str,
        name: str,
        mutate: Callable[[dict[str, Any]], dict[str, Any] | None],
        *,
        subresource: str | None = None,
        expect_rv: str | None = None,
        expect_uid: str | None = None,
    ) -> dict[str, Any]:
        """Read-modify-write under the lock. `mutate` edits a copy in place (or returns a replacement)."""
        with self.lock:
            key = (namespace if rt.namespaced else "", name)
            cur = self._current(rt, key, expect_uid)
            md = cur["metadata"]
            if expect_rv and expect_rv != md["resourceVersion"]:
                raise errors.conflict(
                    rt.plural,
                    rt.group,
                    name,
                    "the object has been modified; please apply your changes to the latest version and try again",
                )
            draft = copy.deepcopy(cur)
            replaced = mutate(draft)
            new = replaced if replaced is not None else draft
            if subresource == "status":
                status = new.get("status")
                new = copy.deepcopy(cur)
                if status is None:
                    new.pop("status", None)
                else:
                    new["status"] = status
            elif rt.status_subresource and subresource is None:
                if "status" in cur:
                    new["status"] = copy.deepcopy(cur["status"])
                else:
                    new.pop("status", None)
            nmd = new.setdefault("metadata", {})
            for fixed in (
                "uid",
                "creationTimestamp",
                "namespace",
                "name",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "generation",
            ):
                if fixed in md:
                    nmd[fixed] = md[fixed]
                else:
                    nmd.pop(fixed, None)
            nmd["resourceVersion"] = md["resourceVersion"]
            new["apiVersion"], new["kind"] = rt.api_version, rt.kind
            if new == cur:
                return copy.deepcopy(cur)
            if rt.custom and _spec_part(rt, new) != _spec_part(rt, cur):
                nmd["generation"] = int(md.get("generation", 1)) + 1
            self._rv += 1
            nmd["resourceVersion"] = str(self._rv)
            self._put(rt, key, new)
            self._emit(rt, MODIFIED, new, cur)
            if nmd.get("deletionTimestamp") and not nmd.get("finalizers") and rt.plural != "pods":
                self._remove(rt, key)
            return copy.deepcopy(new)

    def delete(
        self,
        rt: ResourceType,
        namespace: str,
        name: str,
        *,
        propagation: str | None = None,
        grace_period: int | None = None,
        precondition_uid: str | None = None,
        precondition_rv: str | None = None,
    ) -> tuple[dict[str, Any], bool]:
        """Start (or finish) deleting an object; returns (object, removed_now)."""
        with self.lock:
            key = (namespace if rt.namespaced else "", name)
            cur = self._current(rt, key, precondition_uid)
            md = cur["metadata"]
            if precondition_rv and precondition_rv != md["resourceVersion"]:
                raise errors.conflict(
                    rt.plural,
                    rt.group,
                    name,
                    f"Precondition failed: ResourceVersion in precondition: {precondition_rv}, "
                    f"ResourceVersion in object meta: {md['resourceVersion']}",
                )
            finalizers = list(md.get("finalizers") or [])
            if propagation == "Orphan" and "orphan" not in finalizers:
                finalizers.append("orphan")
            elif propagation == "Foreground" and "foregroundDeletion" not in finalizers:
                finalizers.append("foregroundDeletion")
            is_bound_pod = rt.plural == "pods" and bool((cur.get("spec") or {}).get("nodeName"))
            if is_bound_pod:
                if grace_period is None:
                    grace_period = int((cur.get("spec") or {}).get("terminationGracePeriodSeconds", 30))
                if md.get("deletionTimestamp"):
                    current = int(md.get("deletionGracePeriodSeconds", 0))
                    if grace_period >= current and grace_period != 0:
                        return copy.deepcopy(cur), False
            already = bool(md.get("deletionTimestamp"))
            if (is_bound_pod and grace_period) or finalizers:

                def mark(obj: dict[str, Any]) -> None:
                    omd = obj["metadata"]
                    grace = grace_period if (is_bound_pod and grace_period) else 0
                    if not already or is_bound_pod:
                        omd["deletionTimestamp"] = now_rfc3339(grace)
                        omd["deletionGracePeriodSeconds"] = grace
                    if finalizers:
                        omd["finalizers"] = finalizers

                self._mark_deleting(rt, key, mark)
                if not (is_bound_pod and grace_period) and not finalizers:
                    return self._remove(rt, key), True
                return copy.deepcopy(self._objects[rt.plural][key]), False
            return self._remove(rt, key), True

    def _current(self, rt: ResourceType, key: tuple[str, str], expect_uid: str | None) -> dict[str, Any]:
        """The stored object a write applies to: 404 if there is none, 409 if it is not the uid expected."""
        cur = self._objects.get(rt.plural, {}).get(key)
        if cur is None:
            raise errors.not_found(rt.plural, rt.group, key[1])
        uid = cur["metadata"]["uid"]
        if expect_uid and uid != expect_uid:
            raise errors.conflict(
                rt.plural,
                rt.group,
                key[1],
                f"Precondition failed: UID in precondition: {expect_uid}, UID in object meta: {uid}",
            )
        return cur

    def _mark_deleting(self, rt: ResourceType, key: tuple[str, str], mark: Callable[[dict[str, Any]], None]) -> None:
        cur = self._objects[rt.plural][key]
        new = copy.deepcopy(cur)
        mark(new)
        if new == cur:
            return
        self._rv += 1
        new["metadata"]["resourceVersion"] = str(self._rv)
        self._put(rt, key, new)
        self._emit(rt, MODIFIED, new, cur)

    def finalize(self, rt: ResourceType, namespace: str, name: str, uid: str) -> bool:
        """Remove an object that is deleting and has no finalizers left (the kubelet's last step for a pod)."""
        with self.lock:
            key = (namespace if rt.namespaced else "", name)
            cur = self._objects.get(rt.plural, {}).get(key)
            if cur is None or cur["metadata"]["uid"] != uid:
                return False
            if cur["metadata"].get("finalizers"):
                return False
            self._remove(rt, key)
            return True

    def remove_finalizer(self, rt: ResourceType, namespace: str, name: str, finalizer: str) -> None:
        def drop(obj: dict[str, Any]) -> None:
            fins = [f for f in obj["metadata"].get("finalizers") or [] if f != finalizer]
            if fins:
                obj["metadata"]["finalizers"] = fins
            else:
                obj["metadata"].pop("finalizers", None)

        with self.lock:
            try:
                obj = self.update(rt, namespace, name, drop)
            except errors.ApiError:
                return
            md = obj["metadata"]
            if rt.plural == "pods" and md.get("deletionTimestamp") and not md.get("finalizers"):
                # a pod also waits for the kubelet; the kubelet finalizes it when its process is gone
                return

    def _remove(self, rt: ResourceType, key: tuple[str, str]) -> dict[str, Any]:
        cur = self._pop(rt, key)
        self._rv += 1
        gone = copy.deepcopy(cur)
        gone["metadata"]["resourceVersion"] = str(self._rv)
        self._emit(rt, DELETED, gone, None)
        return gone

    def drop_all(self, rt: ResourceType) -> None:
        """Remove every object of a resource (its CRD was deleted) and end its watches."""
        with self.lock:
            for key in list(self._objects.get(rt.plural, {})):
                self._remove(rt, key)
            for w in list(self._watchers):
                if w.plural == rt.plural:
                    w.close()
                    self._watchers.discard(w)

    # ---- watch ----------------------------------------------------------------------------------------------
    def watch(self, rt: ResourceType, namespace: str | None, selector: Selector, rv: int | None) -> Watcher:
        """Register a watcher; raises ApiError 410 when rv is older than the history window."""
        with self.lock:
            w = Watcher(rt.plural, namespace, selector)
            if rv is None or rv == 0:
                for (ns, _), obj in sorted(self._objects.get(rt.plural, {}).items()):
                    if (not namespace or ns == namespace) and selector.matches(obj):
                        w.events.put((ADDED, copy.deepcopy(obj)))
            else:
                if rv < self._floor:
                    raise errors.expired(rv, self._floor + 1)
                for ev in self._history:
                    if ev.rv > rv:
                        w.offer(ev)
            self._watchers.add(w)
            return w

    def unwatch(self, w: Watcher) -> None:
        with self.lock:
            self._watchers.discard(w)
            w.close()


def encode_continue(rv: int, after: tuple[str, str]) -> str:
    return base64.urlsafe_b64encode(
        json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": list(after)}).encode()
    ).decode()


def decode_continue(token: str) -> tuple[int, tuple[str, str]]:
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()))
        return int(data["rv"]), (data["start"][0], data["start"][1])
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise errors.bad_request("continue key is not valid: incorrect encoded start resourceVersion") from e
