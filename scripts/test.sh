#!/usr/bin/env bash
# Install with the test extras, then run the test suite (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
# the slowest tests listed last: CI runs this on 2 cores and must stay under 15 minutes
.venv/bin/python -m pytest -q --durations=15 "$@"
