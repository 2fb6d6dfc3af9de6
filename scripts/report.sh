#!/usr/bin/env bash
# The main job: install, then run the accuracy report of every recipe (and, on a GPU,
# the kernels and their speed). Results land in results/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh plot,cuda  # cuda: NVRTC for the CUDA C++ Hopper forward (compiled at first use)
.venv/bin/fp4attn report --out results "$@"
