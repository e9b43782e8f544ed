#!/usr/bin/env bash
# The package as a user installs it: build the wheel, install it with its core dependencies
# only into a fresh virtual environment (no simulator, no extra), and run scripts/wheel_smoke.py
# there (core imports, a sampled chunk, one PPO update).
#
# torch is installed first, pinned by scripts/constraints.txt (an unpinned torch resolves to a
# multi-GB CUDA build; TORCH_INDEX_URL chooses the index, as in setup_env.sh); torchrl and
# tensordict then resolve from the ranges pyproject.toml declares. PYTHON chooses the
# interpreter (default: python3.11, else python3). Usage: bash scripts/wheel_smoke.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root="$PWD"

export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_NO_INPUT=1
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON="$(command -v python3.11 || command -v python3 || true)"
fi
if [[ -z "$PYTHON" ]]; then
    echo "[wheel] no python3 found: set PYTHON=/path/to/python" >&2
    exit 1
fi

start=$SECONDS
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# Build from a copy of the package's files, so that the build leaves nothing in the clone.
mkdir "$work/src"
cp -r pyproject.toml setup.cfg README.md torchrl_flowpolicy "$work/src/"
find "$work/src" -name __pycache__ -prune -exec rm -rf {} +
"$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$work/dist" "$work/src"
wheel=("$work"/dist/torchrl_flowpolicy-*.whl)
echo "[wheel] built $(basename "${wheel[0]}") in $((SECONDS - start)) s"

"$PYTHON" -m venv "$work/venv"
python="$work/venv/bin/python"
# --no-compile: no byte-compiling of torch's thousands of files (the smoke imports few of them).
"$python" -m pip install --quiet --no-compile -c scripts/constraints.txt torch \
    ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"$python" -m pip install --quiet --no-compile "${wheel[0]}"
echo "[wheel] installed with core dependencies only in $((SECONDS - start)) s"

# From outside the clone, so that the installed package is the one imported.
(cd "$work" && OMP_NUM_THREADS=1 "$python" "$root/scripts/wheel_smoke.py")
echo "[wheel] smoke test passed in $((SECONDS - start)) s"
