#!/usr/bin/env bash
# Creates (or updates) .venv-lerobot: Python 3.12 with lerobot[pi,smolvla]==0.6.1, this
# package's core (no extra) and gymnasium[mujoco], at the exact versions of
# scripts/constraints-lerobot.txt. Usage: bash scripts/setup_lerobot_env.sh
#
# A separate environment because LeRobot 0.6.1 needs Python >= 3.12, torch < 2.12 and
# numpy >= 2, while the main environment (.venv, scripts/constraints.txt) runs Python 3.11,
# torch 2.13 and numpy < 2 (robosuite). The package's core runs in both.
#
# torch: without TORCH_INDEX_URL, torch 2.11.0 comes from the default index, which on x86_64
# Linux is the CUDA build with its CUDA libraries (several GB, see docs/lerobot.md). To take
# the much smaller CPU build from another index, set TORCH_INDEX_URL, e.g.
#   TORCH_INDEX_URL=<your CPU wheel index> bash scripts/setup_lerobot_env.sh
# LEROBOT_PYTHON chooses the interpreter (default: python3.12, else pyenv's newest 3.12).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_NO_INPUT=1
VENV=".venv-lerobot"
CONSTRAINTS="scripts/constraints-lerobot.txt"

find_python() {
    if [[ -n "${LEROBOT_PYTHON:-}" ]]; then
        echo "$LEROBOT_PYTHON"
        return
    fi
    if command -v python3.12 >/dev/null && python3.12 --version >/dev/null 2>&1; then
        command -v python3.12
        return
    fi
    if command -v pyenv >/dev/null; then
        local version
        version="$(pyenv versions --bare | grep -E '^3\.12(\.[0-9]+)?$' | sort -V | tail -n 1)"
        if [[ -n "$version" ]]; then
            echo "$(pyenv root)/versions/$version/bin/python3.12"
            return
        fi
    fi
}

if [[ ! -x "$VENV/bin/python" ]]; then
    PYTHON="$(find_python)"
    if [[ -z "$PYTHON" ]] || ! "$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 12)'; then
        echo "[lerobot-setup] no Python 3.12 found: install it or set LEROBOT_PYTHON=/path/to/python3.12" >&2
        exit 1
    fi
    echo "[lerobot-setup] creating $VENV with $("$PYTHON" --version 2>&1) ($PYTHON)"
    "$PYTHON" -m venv "$VENV"
fi

# Reinstall only when the package metadata, the pins or this script changed.
stamp="$VENV/.installed-$(cat pyproject.toml "$CONSTRAINTS" scripts/setup_lerobot_env.sh | sha256sum | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
    start=$SECONDS
    pip=("$VENV/bin/python" -m pip install --quiet -c "$CONSTRAINTS")
    if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
        echo "[lerobot-setup] installing torch and torchvision from TORCH_INDEX_URL"
        "${pip[@]}" --index-url "$TORCH_INDEX_URL" torch torchvision
    fi
    echo "[lerobot-setup] installing the package with [lerobot] (lerobot[pi,smolvla]), gymnasium[mujoco] and pytest (pins: $CONSTRAINTS)"
    "${pip[@]}" -e ".[lerobot]" "gymnasium[mujoco]" pytest
    "$VENV/bin/python" -m pip check
    rm -f "$VENV"/.installed-*
    touch "$stamp"
    echo "[lerobot-setup] installed in $((SECONDS - start)) s ($(du -sh "$VENV" | cut -f1))"
fi
"$VENV/bin/python" -c "import lerobot, torch, torchrl, numpy; print(f'[lerobot-setup] lerobot {lerobot.__version__}, torch {torch.__version__}, torchrl {torchrl.__version__}, numpy {numpy.__version__}')"
