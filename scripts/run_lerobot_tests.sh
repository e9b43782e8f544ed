#!/usr/bin/env bash
# The real-LeRobot leg: create or update .venv-lerobot (scripts/setup_lerobot_env.sh), then run
# there, offline, the bridge's tests on tiny random pi0, pi0.5 and SmolVLA models
# (tests/lerobot_bridge) and its contract test. Usage: bash scripts/run_lerobot_tests.sh [pytest args]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

start=$SECONDS
bash scripts/setup_lerobot_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export MUJOCO_GL="${MUJOCO_GL:-egl}"
.venv-lerobot/bin/python -m pytest tests/lerobot_bridge tests/test_lerobot_contract.py -p no:cacheprovider "$@"
echo "[lerobot] the LeRobot leg passed in $((SECONDS - start)) s"
