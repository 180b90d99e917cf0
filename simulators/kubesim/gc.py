"""The garbage collector: cascading deletion through metadata.ownerReferences.

Facts (kubernetes/kubernetes `pkg/controller/garbagecollector/garbagecollector.go`): an object whose owners are
all gone is deleted (background); an owner deleting with the `orphan` finalizer has its ownerReference removed
from every dependent before the finalizer is dropped; an owner deleting with the `foregroundDeletion` finalizer
has its dependents deleted and keeps existing (with deletionTimestamp) until they are gone.
"""

from __future__ import annotations

import contextlib
from typing import Any

from simulators.kubesim.controller import Controller
from simulators.kubesim.errors import ApiError
from simulators.kubesim.store import Event, Store


class GarbageCollector(Controller):
    """Keys are object uids. An event on an object queues the object itself, its owners (a foreground owner waits
    for its dependents) and, once it is gone, its dependents (they may have no owner left): the store's uid and
    owner indexes answer each of them without scanning every object."""

    name = "garbage-collector"

    def __init__(self, store: Store) -> None:
        super().__init__()
        self.store = store
        store.subscribe(self._on_event)

    def _on_event(self, ev: Event) -> None:
        md = ev.obj["metadata"]
        if not (ev.type == "DELETED" or md.get("deletionTimestamp") or md.get("ownerReferences")):
            return
        self.queue.add(md["uid"])
        for obj in (ev.obj, ev.old):
            for ref in (obj or {}).get("metadata", {}).get("ownerReferences") or []:
                self.queue.add(ref.get("uid", ""))
        if ev.type == "DELETED":
            for uid in self.store.dependent_uids(md["uid"]):
                self.queue.add(uid)

    def reconcile(self, key: Any) -> None:
        found = self.store.get_by_uid(key)
        if found is None:
            return
        rt, o = found
        md = o["metadata"]
        ns = md.get("namespace", "")
        finalizers = md.get("finalizers") or []
        if md.get("deletionTimestamp") and "orphan" in finalizers:
            for drt, d in self.store.dependents(md["uid"]):
                self._drop_owner(drt, d, md["uid"])
            self.store.remove_finalizer(rt, ns, md["name"], "orphan")
        elif md.get("deletionTimestamp") and "foregroundDeletion" in finalizers:
            remaining = self.store.dependents(md["uid"])
            for drt, d in remaining:
                if not d["metadata"].get("deletionTimestamp"):
                    self._delete(drt, d, "Foreground")
            if not remaining:
                self.store.remove_finalizer(rt, ns, md["name"], "foregroundDeletion")
        refs = md.get("ownerReferences") or []
        if refs and not md.get("deletionTimestamp") and not any(self.store.has_uid(r.get("uid", "")) for r in refs):
            self._delete(rt, o, "Background")

    def _drop_owner(self, rt: Any, obj: dict[str, Any], owner_uid: str) -> None:
        def drop(o: dict[str, Any]) -> None:
            refs = [r for r in o["metadata"].get("ownerReferences") or [] if r.get("uid") != owner_uid]
            if refs:
                o["metadata"]["ownerReferences"] = refs
            else:
                o["metadata"].pop("ownerReferences", None)

        with contextlib.suppress(ApiError):
            self.store.update(
                rt,
                obj["metadata"].get("namespace", ""),
                obj["metadata"]["name"],
                drop,
                expect_uid=obj["metadata"]["uid"],
            )

    def _delete(self, rt: Any, obj: dict[str, Any], propagation: str) -> None:
        with contextlib.suppress(ApiError):
            self.store.delete(
                rt,
                obj["metadata"].get("namespace", ""),
                obj["metadata"]["name"],
                propagation=propagation,
                precondition_uid=obj["metadata"]["uid"],
            )
