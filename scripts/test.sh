#!/usr/bin/env bash
# Install with the test extras, then run the test suite (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
.venv/bin/python -m pytest -q "$@"
