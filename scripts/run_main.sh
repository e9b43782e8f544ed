#!/usr/bin/env bash
# The main job, set-up included: bash scripts/run_main.sh [options of examples/ppo.py]
# Scripted-expert demonstrations -> flow-matching behaviour cloning -> PPO fine-tuning with the
# Flow-SDE sampler -> deterministic evaluation -> learning curve; prints BC vs RL success.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"

python examples/ppo.py "$@"
