#!/usr/bin/env bash
# One device call for the KV cache and decode kernels: the GPU tests (compiled in
# parallel processes), then the decode benchmark, then where a short call's host time
# goes; logs and results under $OUT, a short table last.
# Usage: [FORMATS=fp8,nvfp4] bash tools/gpu_decode.sh [tests|bench|host|all] [bench shapes] [launches]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/gpu_decode}
mkdir -p "$OUT"
WHAT=${1:-all}
SHAPES=${2:-all}
LAUNCHES=${3:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
git log -1 --format='commit %H' 2>/dev/null | tee -a "$OUT/gpu.txt"
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
    timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_decode_hopper.py 2>&1 | tee "$OUT/tests.txt" | tail -25
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
    timeout "${BENCH_TIMEOUT:-160}" python3 -m fp4attn.cli.main bench --decode --shapes "$SHAPES" --warm-processes 8 \
        ${FORMATS:+--formats "$FORMATS"} ${LAUNCHES:+--launches "$LAUNCHES"} --json "$OUT/h200-decode.json" 2>&1 \
        | tee "$OUT/bench.txt" | tail -40
fi
if [ "$WHAT" = host ] || [ "$WHAT" = all ]; then
    timeout 60 python3 tools/profile_decode_host.py 8,32,8,2048,128 nvfp4 12 2>&1 | tee "$OUT/host.txt" | sed -n 1,8p
fi
