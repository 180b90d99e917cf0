"""The reader the remote and openpai platforms share for a trial's output files (workers/output_reader.py),
in openpai's shape: files on a local mount, read by a real reader into a real LogTrialControl (real
Redis). The fault is real too and tied to progress: after the first chunk of the metrics file has been
read, the file is made unreadable (a directory in its place), so the next read raises an OSError."""

from __future__ import annotations

import json
from pathlib import Path

import redis

from core import keys
from core.event_store import EventStore
from core.leases import AttemptRef, Lease
from core.queueing import load_submission
from schemas.events import TrialMetricReported
from tests.conftest import ServiceFactory, form
from workers.platforms.shared.output_reader import METRICS_FILE, OutputReader
from workers.runtime.control import LogTrialControl

RECORDS = 3000


def _records(count: int) -> bytes:
    records = []
    for sequence in range(count):
        value = json.dumps({"default": sequence, "pad": "x" * 450})
        data = json.dumps({"parameter_id": 0, "type": "PERIODICAL", "sequence": sequence, "value": value}).encode()
        records.append(b"ME%06d" % (len(data) + 1) + data + b"\n")
    return b"".join(records)


def test_a_read_that_fails_after_the_first_chunk_loses_no_record_read_before_it(
    make_service: ServiceFactory, client: redis.Redis, tmp_path: Path
) -> None:
    service = make_service(platform_config={"platform": "local"})
    trial_id = service.submit_trial_job(form(0)).id
    store = EventStore(client, service.experiment_id)
    lease = Lease(client, AttemptRef(service.experiment_id, trial_id, 1), "test-worker", 10.0)
    assert lease.acquire()
    control = LogTrialControl(store, load_submission(store, trial_id), lease, commands=[])
    directory = tmp_path / "attempt"
    (directory / ".nni").mkdir(parents=True)
    metrics = directory / METRICS_FILE
    metrics.write_bytes(_records(RECORDS))  # ~1.6 MB: two reads of 1 MiB
    aside = directory / "metrics.aside"
    reads: list[int] = []

    def read(name: str, offset: int, limit: int) -> bytes:
        if name == METRICS_FILE:
            reads.append(offset)
            if len(reads) == 2:  # its second read, once: the mount fails
                metrics.rename(aside)
                metrics.mkdir()
        try:
            with (directory / name).open("rb") as file:
                file.seek(offset)
                return file.read(limit)
        except FileNotFoundError:
            return b""

    try:
        reader = OutputReader(control, read, "trial.stdout")
        try:
            reader.pull(final=False)
        except IsADirectoryError:
            pass
        else:
            raise AssertionError("the second read should have failed")
        committed = int(client.hget(keys.read_offsets(service.experiment_id, trial_id, 1), "metrics") or 0)
        assert 0 < committed <= 1 << 20  # the first chunk's records, committed before the failing read
        metrics.rmdir()
        aside.rename(metrics)
        reader.pull(final=True)  # it goes on, as a follower does once its connection is back
    finally:
        control.close()
    sequences = [e.event.sequence for e in store.read() if isinstance(e.event, TrialMetricReported)]  # type: ignore[union-attr]
    assert sorted(sequences) == list(range(RECORDS))  # each once: none lost, none read twice
    assert client.hget(keys.read_offsets(service.experiment_id, trial_id, 1), "metrics") == str(metrics.stat().st_size)
