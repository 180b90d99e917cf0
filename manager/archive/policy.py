"""Archiving experiments by themselves, `archive_after_h` hours after they ended (TRIALSTREAM_ARCHIVE_AFTER_H)."""

from __future__ import annotations

import logging
import threading
import time

import redis

from core import keys
from core.settings import Settings
from manager.archive.moves import ArchiveError, archive
from manager.archive.stores import ArchiveStore, ArchiveStoreError, open_store
from manager.views import ViewStore

log = logging.getLogger(__name__)


def store_of(settings: Settings) -> ArchiveStore:
    """The archive the settings name; `<experiments_dir>/.archive` by default: a name no experiment can have (an
    embedded experiment's directory is its id there, and deleting one deletes its directory)."""
    location = settings.archive_location or str(settings.experiments_dir.expanduser() / ".archive")
    return open_store(location, settings.archive_endpoint_url)


def due(client: redis.Redis, after_s: float, now_ms: int) -> list[str]:
    """Experiments in Redis that ended at least `after_s` ago."""
    archived = set(client.hkeys(keys.ARCHIVED))
    found = []
    for experiment_id in client.zrange(keys.EXPERIMENTS, 0, -1):
        if experiment_id in archived:
            continue
        view = ViewStore(client, str(experiment_id)).experiment()
        if view is not None and view.status != "RUNNING" and (view.end_time or now_ms) <= now_ms - after_s * 1000:
            found.append(str(experiment_id))
    return found


def archive_due(client: redis.Redis, settings: Settings) -> list[str]:
    """Archive every experiment the policy says is due; those archived. One that cannot be (a runner took it up,
    it changed meanwhile) is left for the next round."""
    if settings.archive_after_h is None:
        return []
    store = store_of(settings)
    done = []
    for experiment_id in due(client, settings.archive_after_h * 3600, int(time.time() * 1000)):
        try:
            archive(
                client,
                experiment_id,
                store,
                thaw_s=settings.archive_thaw_s,
            )
        except ArchiveError as error:
            log.info("experiment %s not archived this round: %s", experiment_id, error)
            continue
        log.info("experiment %s archived to %s", experiment_id, store.location, extra={"experiment": experiment_id})
        done.append(experiment_id)
    return done


def run_policy(client: redis.Redis, settings: Settings, stop: threading.Event) -> None:
    """Every `archive_check_s` until `stop`, archive what is due; an error is logged and retried next round."""
    while not stop.wait(settings.archive_check_s):
        try:
            archive_due(client, settings)
        except ArchiveStoreError as error:  # set up wrong, or out of room: the error says what to fix
            log.warning("archiving failed this round: %s; trying again in %gs", error, settings.archive_check_s)
        except Exception:
            log.exception("archiving failed this round; trying again in %gs", settings.archive_check_s)


def start_policy(client: redis.Redis, settings: Settings, stop: threading.Event) -> threading.Thread | None:
    """The policy's thread, when the settings ask for one (a projector's process, a manager's, runs it)."""
    if settings.archive_after_h is None:
        return None
    thread = threading.Thread(target=run_policy, args=(client, settings, stop), name="archive-policy", daemon=True)
    thread.start()
    return thread
