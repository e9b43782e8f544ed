"""Evaluate flow-policy checkpoints on Pusher-v5 at several initial-noise scales.

Loads each checkpoint (``examples/pretrain.py``'s ``policy.pt`` or ``examples/ppo.py``'s
``checkpoint.pt``: both store ``"policy"`` and ``"model_config"``), and runs the evaluation
protocol of the examples (``eval_episodes`` fixed episodes from ``eval_seed``, the
deterministic ODE with ``eval_num_denoising_steps``) once per scale in
``eval_noise_scales``: the ODE starts from ``x_0 = scale * N(0, I)``. Scale 1 is the
protocol of every learning curve (the model's own chunk distribution); scale 0 decodes the
noise-free chunk ``x_0 = 0``. With ``uniform_noise_bounds`` it also decodes noise drawn
uniformly from ``[-m, m]^(H x D)`` for each bound ``m`` (through DSRL's
:class:`~torchrl_flowpolicy.dsrl.NoiseActionTransform`): how good the frozen policy is
anywhere in a DSRL noise box, before any training. Prints one line per evaluation and
writes them to ``output_json``.

Example::

    python examples/evaluate.py --checkpoints outputs/pretrain_seed0/policy.pt,outputs/ppo_seed0/checkpoint.pt
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torchrl.modules import RandomPolicy
from tqdm import tqdm

from torchrl_flowpolicy.dsrl import NoiseActionTransform
from torchrl_flowpolicy.evaluation import evaluate_policy

from common import decisions_per_episode, load_policy, make_env, parse_config


@dataclass
class EvaluateConfig:
    """Evaluation settings; every field is a command-line option."""

    checkpoints: str = "outputs/pretrain/policy.pt"  # comma-separated checkpoint paths
    eval_noise_scales: str = "1.0,0.0"  # comma-separated initial-noise scales
    uniform_noise_bounds: str = ""  # comma-separated m: also decode uniform noise in [-m, m]
    eval_num_denoising_steps: int = 20  # K of the deterministic ODE
    eval_episodes: int = 50  # fixed evaluation episodes
    eval_seed: int = 10_000  # seed of the evaluation episodes (that of the examples)
    max_episode_steps: int = 150  # Pusher-v5 horizon (env steps)
    success_threshold: float = 0.05  # final object-goal distance that counts as success, m
    reward: str = "progress"  # Pusher reward: "progress" (potential-based) or "gymnasium"
    output_json: str = "outputs/evaluation.json"  # where the rows are written
    threads: int = 1  # torch CPU threads


def main(config: EvaluateConfig) -> list[dict]:
    torch.set_num_threads(config.threads)
    checkpoints = [path for path in config.checkpoints.split(",") if path]
    scales = [float(scale) for scale in config.eval_noise_scales.split(",") if scale]
    bounds = [float(bound) for bound in config.uniform_noise_bounds.split(",") if bound]
    task = {
        "max_episode_steps": config.max_episode_steps,
        "success_threshold": config.success_threshold,
        "reward": config.reward,
    }
    rows = []
    progress = tqdm(total=len(checkpoints) * (len(scales) + len(bounds)), desc="evaluations")

    def run(path: str, label: str, actor, env, max_decisions: int, **row) -> None:
        result = evaluate_policy(actor, env, max_decisions=max_decisions, seed=config.eval_seed)
        rows.append({"checkpoint": path, **row, **result})
        tqdm.write(
            f"{path}  {label}: success {result['success_rate']:.1%}, "
            f"return {result['mean_return']:.2f} ({result['num_episodes']} episodes)"
        )
        progress.update(1)

    for path in checkpoints:
        policy, model_config, _ = load_policy(
            Path(path), eval_num_steps=config.eval_num_denoising_steps
        )
        executed = model_config.executed_chunk_length
        max_decisions = decisions_per_episode(config.max_episode_steps, executed)
        env = make_env(config.eval_episodes, executed, **task)
        for scale in scales:
            policy.eval_noise_scale = scale
            run(path, f"scale {scale:g}", policy, env, max_decisions, eval_noise_scale=scale)
        env.close()
        policy.eval_noise_scale = 1.0
        for bound in bounds:
            noise_env = make_env(config.eval_episodes, executed, **task)
            noise_env.append_transform(NoiseActionTransform(policy, noise_bound=bound))
            uniform = RandomPolicy(noise_env.full_action_spec)  # uniform over the box
            label = f"uniform noise in [-{bound:g}, {bound:g}]"
            run(path, label, uniform, noise_env, max_decisions, uniform_noise_bound=bound)
            noise_env.close()
    progress.close()
    output = Path(config.output_json)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"config": asdict(config), "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main(parse_config(EvaluateConfig, description=__doc__))
