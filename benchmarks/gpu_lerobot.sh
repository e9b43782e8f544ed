#!/usr/bin/env bash
# The LeRobot bridge's cost and bf16 rescoring drift on a CUDA GPU (not run here: written for
# a machine with one). In .venv-lerobot (bash scripts/setup_lerobot_env.sh; its default torch
# is the CUDA build), offline, random weights at real size (benchmarks/bench_lerobot.py):
#   1. float32 on the GPU: the rollout / sample_actions and learner / expert ratios, bytes;
#   2. the backbone in bf16 (pi0's dtype="bfloat16", SmolVLA's VLM in bf16): the same
#      ratios and the rescoring drift of the stored log-probs (float32 log-probs over a bf16
#      backbone: the chain is float32, denoise_step runs in float32 as LeRobot's sampler).
# Usage: bash benchmarks/gpu_lerobot.sh [output folder]   (about 2 minutes on one GPU)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-outputs/gpu_lerobot}"
mkdir -p "$out"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python=.venv-lerobot/bin/python
"$python" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name())'
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv || true
"$python" benchmarks/bench_lerobot.py --device cuda --rounds 20 --output "$out/float32.json" | tee "$out/float32.log"
"$python" benchmarks/bench_lerobot.py --device cuda --bf16 --rounds 20 --output "$out/bf16.json" | tee "$out/bf16.log"
echo "[gpu_lerobot] results in $out"
