#!/usr/bin/env bash
# The main job, set-up included: bash scripts/run_main.sh [options of the example]
# Until the PPO example lands it is the Flow-SDE sampler demo (examples/sampler_demo.py).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"

python examples/sampler_demo.py "$@"
