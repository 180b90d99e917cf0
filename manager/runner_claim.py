"""The runner claim: an experiment has one runner at a time (two would both submit trials and overspend the
budget), fenced by an epoch that every runner taking the claim counts up, which the runner's appends carry: the
log refuses them once another runner took the claim (`RunnerClaim.fence`)."""

from __future__ import annotations

import time
from typing import Any

import redis

from core import keys
from core.event_store import Fence

RUNNER_RENEW_S = 1.0  # at most: a fifth of a shorter lease

# The claim is fenced by an epoch counted up by every runner that takes it. KEYS: claim, epoch.
_CLAIM = """
if not redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
return redis.call('incr', KEYS[2])
"""
# Compare-and-set renewal: a runner that stalled past its lease must not renew the claim a `resume`
# took meanwhile. A claim that merely lapsed (Redis was paused or restarted, nobody took it since:
# the epoch is still this runner's) is taken back. KEYS: claim, epoch. ARGV: name, lease ms, epoch.
_RENEW_IF_MINE = """
local holder = redis.call('get', KEYS[1])
if holder == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
if not holder and redis.call('get', KEYS[2]) == ARGV[3] then
  redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
_RELEASE_IF_MINE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


class RunnerClaim:
    """One runner's hold on one experiment for `lease_s` (`Settings.runner_lease_s`): taken, renewed once a second
    (a fifth of a shorter lease) while it is still this runner's, let go."""

    def __init__(self, client: redis.Redis, experiment_id: str, name: str, lease_s: float) -> None:
        self._client = client
        self._keys = [keys.runner(experiment_id), keys.runner_epoch(experiment_id)]
        self.name = name
        self.lease_s = lease_s
        self.renew_s = min(RUNNER_RENEW_S, lease_s / 5)
        self._take = client.register_script(_CLAIM)
        self._renew_if_mine = client.register_script(_RENEW_IF_MINE)
        self._release_if_mine = client.register_script(_RELEASE_IF_MINE)
        self._epoch = 0
        self._renewed_at = 0.0

    def take(self, wait_s: float) -> bool:
        """Take the claim, waiting up to `wait_s` for another runner's to lapse; False if it did not."""
        give_up = time.monotonic() + wait_s
        lease_ms = int(self.lease_s * 1000)
        while not (taken := int(self._take(keys=self._keys, args=[self.name, lease_ms]))):
            if time.monotonic() >= give_up:
                return False
            time.sleep(0.1)
        self._epoch = taken
        self._renewed_at = time.monotonic()
        return True

    def keep(self) -> bool:
        """Renew the claim, every `renew_s` (not once per wake-up: a write is an fsync away), and only while it is
        still this runner's; False once it is not (a runner that lost it must submit nothing more)."""
        if time.monotonic() - self._renewed_at < self.renew_s:
            return True
        if not self._renew_if_mine(keys=self._keys, args=[self.name, int(self.lease_s * 1000), self._epoch]):
            return False
        self._renewed_at = time.monotonic()
        return True

    @property
    def fence(self) -> Fence:
        """What this runner's appends are fenced by once it took the claim: its epoch, while no other runner has
        taken the claim since. keep() answers from memory between renewals, so only this check, made by the append
        itself, stops a runner that stalled past its lease after keep() and wakes to write."""
        return Fence(self._keys[1], str(self._epoch))

    def holder(self) -> Any:
        return self._client.get(self._keys[0])

    def release(self) -> None:
        self._release_if_mine(keys=self._keys[:1], args=[self.name])
