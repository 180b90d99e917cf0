#!/usr/bin/env bash
# Sets up (see setup.sh) and runs the whole test suite against real redis-server processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
python3 -m pytest -q "$@"
