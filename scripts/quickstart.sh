#!/usr/bin/env bash
# Sets up (see setup.sh) and runs the quickstart experiment to completion on the local platform.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
trialstream run examples/quickstart/config.yml "$@"
