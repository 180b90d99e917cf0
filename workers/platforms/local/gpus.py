"""The GPUs the local platform would schedule a trial on, counted before an experiment starts: a config asking for
more GPUs than any of those machines has is refused then, naming the key, instead of failing every trial.

Where a trial runs decides where they are counted: with no shared Redis (`trialstream run`'s embedded stack) its
workers are this machine's, started with these settings, so this machine's GPUs are counted as they would count
them; with a shared Redis they are the machines with a live worker serving it: each worker records its machine's
GPUs in Redis when it starts and renews the record while it lives (`record`), so a machine whose workers are all
gone stops counting once its record lapses.

Within those machines a trial may still reach a worker whose machine has fewer GPUs than it asks for (several
machines serve one queue): that worker hands it back (`handed_back`) for a worker of a machine that has them."""

from __future__ import annotations

import json
import socket

import redis

from core import keys
from core.connections import connect
from core.settings import Settings
from schemas.config import ExperimentConfig
from workers.platforms.local.config import LocalConfig
from workers.platforms.local.settings import LocalSettings
from workers.platforms.shared.gpu import FakeGpuSource, GpuQueryError, GpuSource, detect_gpu_source

MACHINES = f"{keys.LOG_PREFIX}:gpu:local-machines"
"""Hash: machine id -> JSON {"gpus": the GPU indices its local workers found there, "until": when the record lapses,
in seconds of Redis's clock}, renewed by each of the machine's workers while it lives."""

NONE_FOUND = "no NVIDIA driver or nvidia-smi found"


def gpu_source(settings: Settings) -> GpuSource:
    """The GPUs of this machine as a local worker started with `settings` reads them."""
    own = settings.of(LocalSettings)
    return FakeGpuSource(own.fake_gpus) if own.fake_gpus else detect_gpu_source()


# KEYS: the machines hash. ARGV: machine, record, ...: each deleted only if it still holds the record read, so a
# machine whose worker renewed it meanwhile keeps its new one.
_FORGET_UNCHANGED = """
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then redis.call('HDEL', KEYS[1], ARGV[i]) end
end
"""


def record(client: redis.Redis, machine_id: str, indices: list[int], ttl_s: float) -> None:
    """This machine's GPUs (`indices`), for the checks of experiments started elsewhere, counted for `ttl_s` from
    now on Redis's clock (the machines' own clocks may disagree). The records that lapsed go meanwhile: workers come
    and go with hosts (a container's name is its host's), and the hash is read whole."""
    seconds, recorded = _read(client)
    lapsed = [part for machine, raw in recorded.items() if _live_gpus(raw, seconds) is None for part in (machine, raw)]
    with client.pipeline(transaction=False) as pipe:
        pipe.hset(MACHINES, machine_id, json.dumps({"gpus": indices, "until": seconds + ttl_s}))
        if lapsed:
            client.register_script(_FORGET_UNCHANGED)(keys=[MACHINES], args=lapsed, client=pipe)
        pipe.execute()


def live_machines(client: redis.Redis) -> dict[str, list[int]]:
    """Each machine with a live local worker (its record not lapsed): its GPU indices."""
    seconds, recorded = _read(client)
    return {str(machine): gpus for machine, raw in recorded.items() if (gpus := _live_gpus(raw, seconds)) is not None}


def _read(client: redis.Redis) -> tuple[int, dict[str, str]]:
    """Redis's clock (seconds) and every machine's record."""
    with client.pipeline(transaction=False) as pipe:
        pipe.time()
        pipe.hgetall(MACHINES)
        (seconds, _), recorded = pipe.execute()
    return int(seconds), recorded


def _live_gpus(raw: str, seconds: int) -> list[int] | None:
    """A record's GPU indices while it has not lapsed; None once it has, or for a bare list: an earlier version's,
    never renewed."""
    entry = json.loads(raw)
    if isinstance(entry, dict) and entry["until"] > seconds:
        return [int(index) for index in entry["gpus"]]
    return None


def usable(gpus: list[int], listed: list[int] | None) -> int:
    """How many GPUs a trial may be given on a machine with `gpus`, by `choose_gpus`'s rules: those gpuIndices lists,
    and none where it lists one the machine lacks."""
    if listed is None:
        return len(gpus)
    return len(set(listed)) if set(listed) <= set(gpus) else 0


def handed_back(client: redis.Redis, machine_id: str, impossible: str, wanted: int, listed: list[int] | None) -> str:
    """Why a trial that this machine can never run waits (its message): given back to the queue for a worker of
    another machine that has the GPUs it asks for, or, while none with a live worker has, until one serves."""
    here = f"host {socket.gethostname()}: {impossible}"  # not the machine id: machine-id(5) keeps it private
    others = [usable(gpus, listed) for machine, gpus in live_machines(client).items() if machine != machine_id]
    if max(others, default=0) >= wanted:
        return f"{here}; handed back for a worker of a machine with enough"
    return f"{here}; no other machine with a live local worker has enough: waiting for a worker of one that has"


def gpu_problems(config: LocalConfig, experiment: ExperimentConfig, settings: Settings) -> dict[str, str]:
    """What to change when no machine a trial could run on has the GPUs it asks for: key path -> why and the fix.
    Nothing when the machines are not known (no live worker serves the shared Redis): trials wait for one."""
    wanted = experiment.trial_gpu_number or 0
    if wanted == 0:
        return {}
    machines = _machines(settings)
    if machines is None:
        return {}
    listed = config.gpu_indices
    most = max(usable(gpus, listed) for gpus in machines.values())
    if most >= wanted:
        return {}
    asked = f"{wanted} GPU" + ("" if wanted == 1 else "s")
    found = _found(machines, settings)
    if listed is not None and max(len(gpus) for gpus in machines.values()) >= wanted:  # gpuIndices is in the way
        return {
            "trainingService.gpuIndices": f"{','.join(str(index) for index in listed)} leaves at most {most} of"
            f" the GPUs found ({found}) for a trial asking for {asked} (trialGpuNumber): list GPUs that exist, or"
            " lower trialGpuNumber"
        }
    return {
        "trialGpuNumber": f"each trial asks for {asked}, but {found}: lower trialGpuNumber to {most}"
        + (" (or remove it) to run trials without a GPU" if most == 0 else "")
        + ", or run the trials where there are enough GPUs"
    }


def _machines(settings: Settings) -> dict[str, list[int]] | None:
    """Each machine's GPU indices, None when unknown: this machine's where trials would run here, else those of
    the machines with a live worker on the shared Redis."""
    if settings.redis_url is None:
        try:
            return {"this machine": [gpu.index for gpu in gpu_source(settings).gpus()]}
        except GpuQueryError:
            return None
    client = connect(settings.redis_url, options=settings.redis_options())
    try:
        return live_machines(client) or None
    finally:
        client.close()


def _found(machines: dict[str, list[int]], settings: Settings) -> str:
    """What was found, in words: this machine's GPUs, or those of the shared Redis's workers' machines."""
    if settings.redis_url is None:
        gpus = machines["this machine"]
        return f"this machine has {_gpus(gpus)}" if gpus else f"this machine has no GPU ({NONE_FOUND})"
    counts = sorted(len(gpus) for gpus in machines.values())
    if len(counts) == 1:
        return f"the one machine with a live local worker on this Redis has {_gpus(next(iter(machines.values())))}"
    return f"the {len(counts)} machines with a live local worker on this Redis have at most {counts[-1]} GPUs each"


def _gpus(indices: list[int]) -> str:
    if not indices:
        return "no GPU"
    return f"{len(indices)} GPU{'' if len(indices) == 1 else 's'} ({','.join(str(index) for index in indices)})"
