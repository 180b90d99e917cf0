"""A DLTS job of one trial attempt: its name, and its command, which carries the code inline with a bootstrap
that unpacks it and the pod keeper (docs/platforms.md, DLTS)."""

from __future__ import annotations

import base64
import json
import shlex
import zlib
from collections.abc import Mapping

from core.platform import (
    TrialAssignment,
)
from workers.platforms.dlts.config import DltsConfig
from workers.platforms.shared import pod_keeper
from workers.platforms.shared.code_package import CodePackage

MAX_COMMAND_BYTES = 120 * 1024  # DLTS_LAUNCH_CMD is one environment value: Linux takes at most 128 KiB
COMMAND_MARGIN_BYTES = 8 * 1024  # the trial's command, parameters and NNI's variables, beside the code

# Runs in the job (python3, standard library only): unpacks the keeper and the code, runs the keeper, and
# says how it ended in the log's last line. argv[1]: base64 of the zlib'd JSON payload (shell-safe).
BOOTSTRAP = """\
import base64, json, os, signal, subprocess, sys, tempfile, zlib
p = json.loads(zlib.decompress(base64.b64decode(sys.argv[1])))
work = os.path.join(tempfile.gettempdir(), p["dir"])
archive = os.path.join(work, "archive")
os.makedirs(archive, exist_ok=True)
for name, source in p["keeper"].items():
    open(os.path.join(archive, name), "w").write(source)
open(os.path.join(archive, "code-000"), "wb").write(base64.b64decode(p["code"]))
env = dict(os.environ)
env.update(p["env"])
keeper = subprocess.Popen([sys.executable, os.path.join(archive, p["run"])], cwd=work, env=env)


def forward(signum, frame):
    try:
        keeper.send_signal(signum)
    except OSError:
        pass
signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)
code = keeper.wait()
code = code if code >= 0 else 128 - code
try:
    tail = open(os.path.join(work, "termination-log"), errors="replace").read()
except OSError:
    tail = ""
print("NNI_DLTS_EXIT " + json.dumps({"exitCode": code, "stderr": tail}), flush=True)
sys.exit(code)
"""


def job_name(trial: TrialAssignment[DltsConfig]) -> str:
    """NNI's job name; a later attempt of the same trial is its own job."""
    name = f"nni_exp_{trial.experiment_id}_trial_{trial.trial_id}"
    return name if trial.attempt == 1 else f"{name}_attempt_{trial.attempt}"


def work_dir_name(trial: TrialAssignment[DltsConfig]) -> str:
    return f"nni-{trial.experiment_id}-{trial.trial_id}-{trial.attempt}"


def job_command(code: bytes, environment: Mapping[str, str], work_dir: str) -> str:
    """The job's `cmd`: the bootstrap, and everything it unpacks (the keeper's files, the code), in one
    shell-safe argument."""
    payload = {
        "keeper": pod_keeper.keeper_files(),
        "run": pod_keeper.KEEPER,
        "code": base64.b64encode(code).decode(),
        "env": dict(environment),
        "dir": work_dir,
    }
    packed = base64.b64encode(zlib.compress(json.dumps(payload).encode(), 9)).decode()
    return f"python3 -c {shlex.quote(BOOTSTRAP)} {packed}"


def code_problem(package: CodePackage) -> str | None:
    size = len(job_command(package.path.read_bytes(), {}, "")) + COMMAND_MARGIN_BYTES
    if size <= MAX_COMMAND_BYTES:
        return None
    return (
        f"packed, it makes a DLTS job command of {size // 1024} KiB; DLTS hands the command to the job as one "
        f"environment value, at most {MAX_COMMAND_BYTES // 1024} KiB here: exclude data with .nniignore, or put it "
        "in the image"
    )
