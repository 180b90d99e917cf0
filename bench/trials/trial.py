"""The benchmarks' trial: read the parameters, report a final metric derived from them, record what it ran with.

`python3 trial.py nni` imports the real `nni` and exits normally; `python3 trial.py trialstream_sdk` uses
the dependency-free SDK and leaves with `os._exit(0)` right after its record, so that the moment it records
is the moment it exits (a normal exit spends another ~15 ms tearing the interpreter down).

The record (`bench.json` in the output directory) lets a benchmark check that the service attributed to
each trial the parameters it really received.
"""

import importlib
import json
import os
import sys
import time

nni = importlib.import_module(sys.argv[1] if len(sys.argv) > 1 else "nni")
parameters = nni.get_next_parameter()
nni.report_final_result(float(parameters.get("x", 0.0)) * 2)
record = {"trial": nni.get_trial_id(), "parameters": parameters, "exit": time.time()}
with open(os.path.join(os.environ.get("NNI_OUTPUT_DIR", "."), "bench.json"), "w") as file:
    json.dump(record, file)
if nni.__name__ == "trialstream_sdk":
    os._exit(0)
