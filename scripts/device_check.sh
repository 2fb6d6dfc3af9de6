#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, then a short benchmark. Logs go to $OUT.
#   bash scripts/device_check.sh [bench args...]
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-results}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -n 8 -m gpu --tb=line tests/test_hopper_forward.py > "$OUT/gpu-tests.log" 2>&1
grep -E "^(/|E |FAILED)" "$OUT/gpu-tests.log" | cut -c1-300 | head -30; tail -2 "$OUT/gpu-tests.log"
if [ "$#" -gt 0 ]; then
  python3 -m fp4attn.cli.main bench "$@" --json "$OUT/bench.json" 2>&1 | grep -v "it/s\]" | tee "$OUT/bench.log"
fi
