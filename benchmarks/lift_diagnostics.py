"""Why a few-shot Lift policy fails, and how much of its rollouts' randomness PPO can credit.

1. Closest approach: the noise-free policy (``x_0 = 0``, the deterministic ODE) on
   ``--episodes`` validation states (reset seeds 20000+); per episode, success and the
   smallest distance between the grip site and the cube's centre.
2. Action spread: on the first validation state's observation, the standard deviation of
   the first executed action's 7 entries over 512 chains, for the deterministic ODE from
   ``x_0 ~ N(0, I)`` and for Flow-SDE rollouts under the given sampler settings
   (``noise_level,sde_mode,num_sde_steps,rollout_noise_scale``).

Run (robosuite extra)::

    MUJOCO_GL=egl python benchmarks/lift_diagnostics.py \\
        --checkpoint outputs/pretrain_lift/policy.pt --episodes 30 \\
        --settings "0.5,last,4,1.0" "0.5,last,4,0.0" "1.0,last,1,0.0"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tensordict import TensorDict
from torchrl.envs.utils import ExplorationType, set_exploration_type

from torchrl_flowpolicy import SamplerOptions, load_policy
from torchrl_flowpolicy.tasks.robosuite.env import OBSERVATION_SLICES, RobosuiteGymEnv

VALIDATION_SEED = 20_000
GAP = OBSERVATION_SLICES["Lift"]["gripper_to_cube_pos"]


def closest_approach(policy, env: RobosuiteGymEnv, seed: int) -> dict[str, float]:
    """One noise-free episode: its success and the grip site's closest approach (m)."""
    observation, _ = env.reset(seed=seed)
    closest, success, done = float("inf"), False, False
    while not done:
        tensordict = TensorDict({"observation": torch.as_tensor(observation)[None]}, [1])
        chunk = policy.decode(tensordict, torch.zeros(1, *policy.action_shape))[0]
        for action in chunk.numpy():
            observation, _, terminated, truncated, info = env.step(action)
            closest = min(closest, float((observation[GAP] ** 2).sum() ** 0.5))
            success = success or bool(info["success"])
            done = terminated or truncated
            if done:
                break
    return {"seed": seed, "success": success, "closest_cm": round(100 * closest, 1)}


def action_spread(path: Path, observation, setting: str) -> dict[str, object]:
    """Per-entry std of the first executed action over 512 rollout chains."""
    noise_level, sde_mode, num_sde_steps, rollout_noise_scale = setting.split(",")
    sampler = SamplerOptions(
        noise_level=float(noise_level),
        sde_mode=sde_mode,
        num_sde_steps=int(num_sde_steps),
        rollout_noise_scale=float(rollout_noise_scale),
        eval_noise_scale=1.0,  # the ODE from x_0 ~ N(0, I): the model's own spread
    )
    policy = load_policy(path, sampler=sampler)
    batch = TensorDict({"observation": torch.as_tensor(observation).expand(512, -1)}, [512])
    torch.manual_seed(0)
    with set_exploration_type(ExplorationType.RANDOM), torch.no_grad():
        rollout = policy(batch.clone())["action"][:, 0]
    with set_exploration_type(ExplorationType.DETERMINISTIC), torch.no_grad():
        ode = policy(batch.clone())["action"][:, 0]
    return {
        "setting": setting,
        "rollout_std": [round(v, 3) for v in rollout.std(0).tolist()],
        "ode_from_gaussian_std": [round(v, 3) for v in ode.std(0).tolist()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--episodes", type=int, default=30)
    parser.add_argument("--settings", nargs="+", default=["0.5,last,4,1.0"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = Path(args.checkpoint)
    policy = load_policy(path)
    env = RobosuiteGymEnv("Lift")
    episodes = [
        closest_approach(policy, env, VALIDATION_SEED + index) for index in range(args.episodes)
    ]
    for episode in episodes:
        print(json.dumps(episode))
    for success in (True, False):
        group = [e["closest_cm"] for e in episodes if e["success"] is success]
        if group:
            label = "successes" if success else "failures"
            print(f"{label}: {len(group)}, closest approach {min(group)}-{max(group)} cm")
    observation, _ = env.reset(seed=VALIDATION_SEED)
    env.close()
    for setting in args.settings:
        print(json.dumps(action_spread(path, observation, setting)))


if __name__ == "__main__":
    main()
