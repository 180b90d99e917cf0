"""How many worker processes `trialstream run` starts for a platform, and how many trials each follows."""

from __future__ import annotations

import pytest

from core.registry import platform_class
from manager.stack import worker_slots


def test_trials_that_run_on_their_worker_get_a_process_each_and_a_spare() -> None:
    assert worker_slots(platform_class("local"), 4) == [1, 1, 1, 1, 1]


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
