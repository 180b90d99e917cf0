"""How many worker processes `trialstream run` starts for a platform, and how many trials each follows."""

from __future__ import annotations

import os

import pytest

from core.registry import platform_class
from manager.stack import PROCESSES_PER_TRIAL_UP_TO, worker_slots


def test_trials_that_run_on_their_worker_get_a_process_each_and_a_spare() -> None:
    assert worker_slots(platform_class("local"), 4) == [1, 1, 1, 1, 1]
    assert worker_slots(platform_class("local"), PROCESSES_PER_TRIAL_UP_TO - 1) == [1] * PROCESSES_PER_TRIAL_UP_TO


def test_many_trials_that_run_on_their_worker_share_a_process_per_core_or_the_floor() -> None:
    """Past a process per trial: no more processes than the floor or the cores, each within the platform's cap."""
    adapter = platform_class("local")
    processes = max(PROCESSES_PER_TRIAL_UP_TO, len(os.sched_getaffinity(0)))
    for concurrency in (processes, 500, 10 * processes * adapter.trials_per_process):
        slots = worker_slots(adapter, concurrency)
        assert sum(slots) == concurrency + 1 and max(slots) - min(slots) <= 1
        assert max(slots) <= adapter.trials_per_process
        assert len(slots) == max(processes, -(-(concurrency + 1) // adapter.trials_per_process))


@pytest.mark.parametrize("platform", ["remote", "kubeflow", "openpai"])
def test_trials_followed_from_afar_fill_as_few_processes_as_hold_them_evenly(platform: str) -> None:
    adapter = platform_class(platform)
    per_process = adapter.trials_per_process
    assert worker_slots(adapter, 3) == [4]
    assert worker_slots(adapter, per_process - 1) == [per_process]
    # Past one process's worth, a process more rather than trials left waiting (one process was the cap).
    slots = worker_slots(adapter, 1000)
    assert sum(slots) == 1001 and max(slots) <= per_process and max(slots) - min(slots) <= 1
    assert len(slots) == -(-1001 // per_process)
