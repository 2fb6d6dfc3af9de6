#!/usr/bin/env bash
# Install with the test extras, then run the test suite (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
# two workers (CI has 2 cores; the interpreter tests each hold one), the slowest tests
# listed last (the interpreter and compile tests run last: tests/conftest.py) and the
# durations of the slowest printed: CI must stay under 15 minutes. Each worker's torch takes half the cores:
# two workers of two threads each on CI's two cores spun on each other (the CPU tests of
# the reference ran 4x slower). Arguments go to pytest: a folder (tests/kernels/hopper) or
# a marker expression (-m "not gpu and not interpreter and not compile", the quick CPU set)
threads=$(( $(nproc) / 2 ))
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}"
.venv/bin/python -m pytest -q -n 2 --durations=15 "$@"
