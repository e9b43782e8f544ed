#!/usr/bin/env bash
# The LeRobot bridge's cost and bf16 rescoring drift on a CUDA GPU (not run here: written for
# a machine with one). In .venv-lerobot (bash scripts/setup_lerobot_env.sh; its default torch
# is the CUDA build), offline, random weights at real size (benchmarks/bench_lerobot.py):
#   1. float32 on the GPU: the rollout / sample_actions and learner / expert ratios, bytes;
#   2. the backbone in bf16 (pi0's dtype="bfloat16", SmolVLA's VLM in bf16): the same
#      ratios and the rescoring drift of the stored log-probs (float32 log-probs over a bf16
#      backbone: the chain is float32, denoise_step runs in float32 as LeRobot's sampler).
# Usage: bash benchmarks/gpu_lerobot.sh [output folder] [--overwrite]   (about 2 minutes on one GPU)
# A folder that holds the results of an earlier run (float32.json, bf16.json or their logs) is
# refused before anything runs, unless --overwrite is given.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-outputs/gpu_lerobot}"
overwrite=()
if [[ "${2:-}" == "--overwrite" ]]; then
  overwrite=(--overwrite)
elif [[ -n "${2:-}" ]]; then
  echo "[gpu_lerobot] unknown option ${2}: the second argument can only be --overwrite" >&2
  exit 2
fi
if [[ ${#overwrite[@]} -eq 0 ]]; then
  for name in float32.json float32.log bf16.json bf16.log; do
    if [[ -e "$out/$name" ]]; then
      echo "[gpu_lerobot] $out holds the results of an earlier run ($name): pass --overwrite" \
        "as the second argument to replace them, or another output folder." >&2
      exit 2
    fi
  done
fi
mkdir -p "$out"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python=.venv-lerobot/bin/python
"$python" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name())'
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv || true
"$python" benchmarks/bench_lerobot.py --device cuda --rounds 20 --output "$out/float32.json" "${overwrite[@]}" | tee "$out/float32.log"
"$python" benchmarks/bench_lerobot.py --device cuda --bf16 --rounds 20 --output "$out/bf16.json" "${overwrite[@]}" | tee "$out/bf16.log"
echo "[gpu_lerobot] results in $out"
