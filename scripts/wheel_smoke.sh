#!/usr/bin/env bash
# The wheel as a user installs it: build it from a copy of the checkout, install it into a
# fresh virtual environment outside the checkout and run scripts/wheel_smoke.py and the CLI there.
# torch, Triton and cuda-bindings come from .venv: its site-packages as a path entry (none of
# its .pth files run, so not fp4attn's editable install), and among site.getsitepackages(),
# where cuda-pathfinder looks for NVRTC's library.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
python=.venv/bin/python
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/src"
cp -r pyproject.toml README.md LICENSE fp4attn "$work/src/"
find "$work/src" -name __pycache__ -prune -exec rm -rf {} +
# no build isolation: .venv's setuptools builds it, without an index
"$python" -m pip wheel "$work/src" --no-deps --no-build-isolation -q -w "$work/dist"
"$python" -m venv "$work/venv"
site=$("$work/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
deps=$("$python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
printf '%s\nimport site; site.PREFIXES.append(%s)\n' "$deps" "'$repo/.venv'" > "$site/fp4attn_smoke_deps.pth"
"$work/venv/bin/python" -m pip install -q --no-deps --no-index "$work"/dist/fp4attn-*.whl
cd "$work"  # nothing of the checkout on the path
FP4ATTN_CACHE_DIR="$work/cache" "$work/venv/bin/python" "$repo/scripts/wheel_smoke.py" "$work/venv"
"$work/venv/bin/fp4attn" --help > "$work/help.txt"  # the console script
test -s "$work/help.txt"
echo "wheel smoke test passed"
