"""A trial that reports COUNT intermediate metrics, INTERVAL seconds apart (0: as fast as it can), then a final one.

Each value carries the wall-clock time it was reported at (`sent`), so a benchmark can measure how long
a metric takes to become visible.
"""

import sys
import time

import trialstream_sdk as nni

count, interval = int(sys.argv[1]), float(sys.argv[2])
nni.get_next_parameter()
for step in range(count):
    nni.report_intermediate_result({"default": float(step), "sent": time.time()})
    if interval:
        time.sleep(interval)
nni.report_final_result({"default": float(count), "sent": time.time()})
