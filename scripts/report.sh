#!/usr/bin/env bash
# The main job: install, then run the accuracy report of every recipe (and, on a GPU,
# the kernels and their speed). Results land in results/.
set -euo pipefail
cd "$(dirname "$0")/.."
# cuda (NVRTC for the CUDA C++ Hopper forward, compiled at first use; a 218 MB wheel) only
# where an NVIDIA GPU answers: a CPU-only machine never runs it
extras=plot
if nvidia-smi -L >/dev/null 2>&1; then
  extras=plot,cuda
fi
if [ "${FP4ATTN_REPORT_PRINT_EXTRAS:-0}" = 1 ]; then  # what it would install (tests/cli/test_details.py)
  echo "$extras"
  exit 0
fi
bash scripts/setup_env.sh "$extras"
.venv/bin/fp4attn report --out results "$@"
