#!/usr/bin/env bash
# Sets up (see setup.sh) and runs the whole test suite against real redis-server processes, four pytest
# workers at once (pytest-xdist; groups that share one heavy part run on one worker). Arguments go to pytest:
# `-m "not slow"` is the fast tier, `-n 0` runs the tests one at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
# The suite starts ~2,000 Python processes: each would compile trialstream's modules (and pytest its test
# modules) anew if bytecode were not written, ~0.2 s of CPU a process.
unset PYTHONDONTWRITEBYTECODE
# --durations: every run names its 25 slowest tests, where to look when the suite nears its time budget.
python3 -m pytest -q -n 4 --dist loadgroup --durations=25 "$@"
