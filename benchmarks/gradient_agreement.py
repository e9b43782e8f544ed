"""How much direction does a batch's policy gradient carry? Two independent halves compared.

Rolls out ``2 x episodes`` episodes of a flow policy with its Flow-SDE sampler (RANDOM
exploration) on a task, the two halves from the same initial states (reset seeds
``seed .. seed + episodes - 1``) with independent sampler noise, and computes in each half the
REINFORCE gradient of the chains' log-probabilities (``policy.log_prob``) weighted by the
advantage: for ``--reward success`` the episode's success minus the half's mean success on
every decision of the episode; for another reward (Lift's ``shaped``, Pusher's ``progress``)
the decision's discounted reward-to-go
minus the half's mean at the same decision index. The cosine between the two halves'
gradients is near 1 when a batch of that size points a consistent way and near 0 when its
direction is noise; PPO's update follows that direction, so a cosine near 0 at the batch
size of a run means its updates are random steps. Repeated ``--repeats`` times with fresh
noise; prints one JSON line per setting.

Run (robosuite extra; one thread)::

    MUJOCO_GL=egl python benchmarks/gradient_agreement.py --task lift \\
        --checkpoint outputs/pretrain_lift/policy.pt --episodes 96 --repeats 3 \\
        --settings "0.5,last,4,1.0" "1.0,last,1,0.0" "1.0,all,8,0.0"

A setting is ``noise_level,sde_mode,num_sde_steps,rollout_noise_scale``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from torchrl.envs.utils import ExplorationType, set_exploration_type

from torchrl_flowpolicy import SamplerOptions
from torchrl_flowpolicy.tasks import get_task
from torchrl_flowpolicy.training.models import load_policy_checkpoint


def episode_mask(done: torch.Tensor) -> torch.Tensor:
    """``[N, T]``: the decisions up to and including each episode's first ``done``."""
    done = done.float()
    return (done.cumsum(-1) - done) == 0


def advantages(batch, valid: torch.Tensor, reward: str, discount: float) -> torch.Tensor:
    """Per-decision advantages ``[N, T]`` (zero outside the episode)."""
    if reward == "success":
        success = (batch["next", "success"].squeeze(-1) & valid).any(-1).float()
        return (success - success.mean())[:, None] * valid
    rewards = batch["next", "reward"].squeeze(-1) * valid
    to_go = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for step in reversed(range(rewards.shape[1])):
        running = rewards[:, step] + discount * running
        to_go[:, step] = running
    return (to_go - to_go.mean(0, keepdim=True)) * valid


def half_gradient(policy, env, args, noise_seed: int) -> tuple[torch.Tensor, float]:
    """One half's REINFORCE gradient (flattened) and its success rate."""
    env.set_seed(args.seed)
    torch.manual_seed(noise_seed)
    with set_exploration_type(ExplorationType.RANDOM), torch.no_grad():
        batch = env.rollout(args.decisions, policy, break_when_any_done=False)
    valid = episode_mask(batch["next", "done"].squeeze(-1))
    advantage = advantages(batch, valid, args.reward, args.discount)
    policy.zero_grad(set_to_none=True)
    log_prob = policy.log_prob(batch[valid]).sum(-1)
    (-(log_prob * advantage[valid]).sum() / args.episodes).backward()
    gradient = torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])
    success = (batch["next", "success"].squeeze(-1) & valid).any(-1).float().mean().item()
    return gradient, success


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="lift")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--episodes", type=int, default=96, help="episodes per half")
    parser.add_argument(
        "--decisions", type=int, default=0, help="decisions per episode (0: the task's horizon)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=20_000, help="first reset seed")
    parser.add_argument(
        "--reward",
        default="success",
        help="success: the episode's success (sparse); any other reward of the task (lift: "
        "shaped; pusher: progress) is used as the decisions' discounted reward-to-go",
    )
    parser.add_argument("--discount", type=float, default=0.99**4, help="per decision")
    parser.add_argument("--settings", nargs="+", default=["0.5,last,4,1.0"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = get_task(args.task)
    horizon = args.decisions
    options = {"reward": args.reward}
    if "terminate_on_success" in task.option_names:
        options["terminate_on_success"] = args.reward == "success"
    if "max_episode_steps" in task.option_names:
        options["max_episode_steps"] = task.max_episode_steps
    for setting in args.settings:
        noise_level, sde_mode, num_sde_steps, rollout_noise_scale = setting.split(",")
        sampler = SamplerOptions(
            noise_level=float(noise_level),
            sde_mode=sde_mode,
            num_sde_steps=int(num_sde_steps),
            rollout_noise_scale=float(rollout_noise_scale),
        )
        policy, model_config, _, _ = load_policy_checkpoint(
            Path(args.checkpoint), sampler=sampler, task=task.name
        )
        executed = model_config.executed_chunk_length
        args.decisions = horizon or math.ceil(task.max_episode_steps / executed)
        env = task.make_env(args.episodes, executed, **options)
        cosines, successes = [], []
        for repeat in range(args.repeats):
            first, success_first = half_gradient(policy, env, args, 2 * repeat)
            second, success_second = half_gradient(policy, env, args, 2 * repeat + 1)
            cosines.append(torch.nn.functional.cosine_similarity(first, second, dim=0).item())
            successes += [success_first, success_second]
        env.close()
        print(
            json.dumps(
                {
                    **sampler,
                    "reward": args.reward,
                    "episodes_per_half": args.episodes,
                    "cosines": [round(c, 3) for c in cosines],
                    "mean_cosine": round(sum(cosines) / len(cosines), 3),
                    "success": round(sum(successes) / len(successes), 3),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
