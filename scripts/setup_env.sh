# Sourced by run_main.sh and run_tests.sh: create .venv if missing, install the project with
# all its extras, activate it, and set the environment the jobs run under.
#
# Every install takes the exact versions of scripts/constraints.txt (pyproject.toml declares
# ranges). torch is installed first, pinned there (an unpinned torch resolves to a multi-GB
# CUDA build). To take the CPU build from a specific index, set TORCH_INDEX_URL, e.g.
#   TORCH_INDEX_URL=<your CPU wheel index> bash scripts/run_tests.sh
# PYTHON chooses the interpreter that creates .venv (default: python3.11, else python3).

cd "$(dirname "${BASH_SOURCE[0]}")/.."

export MUJOCO_GL="${MUJOCO_GL:-egl}"
export WANDB_MODE="${WANDB_MODE:-offline}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_NO_INPUT=1
export NO_MKDOCS_2_WARNING=1

CONSTRAINTS="scripts/constraints.txt"
TORCH_VERSION="$(sed -n 's/^torch==//p' "$CONSTRAINTS")"

if [[ ! -x .venv/bin/python ]]; then
    if [[ -z "${PYTHON:-}" ]]; then
        PYTHON="$(command -v python3.11 || command -v python3 || true)"
    fi
    if [[ -z "$PYTHON" ]]; then
        echo "[setup] no python3 found: install Python >= 3.10 or set PYTHON=/path/to/python" >&2
        exit 1
    fi
    echo "[setup] creating .venv with $("$PYTHON" --version 2>&1) ($PYTHON)"
    "$PYTHON" -m venv .venv || {
        echo "[setup] 'python -m venv' failed; using virtualenv instead"
        "$PYTHON" -m pip install --quiet virtualenv
        "$PYTHON" -m virtualenv .venv
    }
fi
# shellcheck disable=SC1091
source .venv/bin/activate

# Reinstall only when the package metadata, the pins or this script changed since the last
# install.
stamp=".venv/.installed-$(cat pyproject.toml "$CONSTRAINTS" scripts/setup_env.sh | sha256sum | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
    echo "[setup] installing torch==${TORCH_VERSION} and the project with [examples,robosuite,ray,dev,docs] (pins: $CONSTRAINTS)"
    start=$SECONDS
    python -m pip install --quiet -c "$CONSTRAINTS" torch \
        ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    python -m pip install --quiet -c "$CONSTRAINTS" -e ".[examples,robosuite,ray,dev,docs]"
    rm -f .venv/.installed-*
    touch "$stamp"
    echo "[setup] installed in $((SECONDS - start)) s"
fi
python -c "import torch, torchrl, tensordict; print(f'[setup] torch {torch.__version__}, torchrl {torchrl.__version__}, tensordict {tensordict.__version__}')"
