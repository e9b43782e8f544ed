"""The robosuite scripted experts as TorchRL policies and as demonstrations.

:data:`EXPERTS` maps each robosuite task to its scripted expert:
:class:`~torchrl_flowpolicy.tasks.robosuite.lift_expert.LiftExpert` picks up Lift's cube and
:class:`~torchrl_flowpolicy.tasks.robosuite.can_expert.CanExpert` puts PickPlaceCan's can
into its compartment of bin 2 and
:class:`~torchrl_flowpolicy.tasks.robosuite.square_expert.SquareExpert` puts
NutAssemblySquare's nut on its peg (all re-exported here; their success rates and episode
lengths, and the choice of each task's horizon, are in their modules' docstrings).
:class:`RobosuiteExpertPolicy` runs one in a TorchRL environment from
:func:`~torchrl_flowpolicy.tasks.robosuite.env.make_robosuite_env`, and
:func:`collect_robosuite_demos` rolls it out with action noise to make demonstrations in the
layout of :func:`~torchrl_flowpolicy.tasks.collect_demos`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torchrl.envs import EnvBase

from torchrl_flowpolicy.tasks.robosuite.can_expert import (
    CAN_BIN_HEIGHT,
    CAN_COMPARTMENT,
    CAN_DROP_INSET,
    CanExpert,
)
from torchrl_flowpolicy.tasks.robosuite.env import RobosuiteGymEnv
from torchrl_flowpolicy.tasks.robosuite.expert_base import ACTION_DIM
from torchrl_flowpolicy.tasks.robosuite.layout import TASKS, RewardMode
from torchrl_flowpolicy.tasks.robosuite.lift_expert import LiftExpert
from torchrl_flowpolicy.tasks.robosuite.square_expert import SQUARE_PEG_POSITION, SquareExpert

__all__ = [
    "ACTION_DIM",
    "CAN_BIN_HEIGHT",
    "CAN_COMPARTMENT",
    "CAN_DROP_INSET",
    "EXPERTS",
    "CanExpert",
    "LiftExpert",
    "RobosuiteExpertPolicy",
    "SQUARE_PEG_POSITION",
    "SquareExpert",
    "collect_robosuite_demos",
]


# Each has from_env(env, **kwargs): the expert for one environment.
EXPERTS: dict[str, type[LiftExpert] | type[CanExpert] | type[SquareExpert]] = {
    "Lift": LiftExpert,
    "PickPlaceCan": CanExpert,
    "NutAssemblySquare": SquareExpert,
}


class RobosuiteExpertPolicy(TensorDictModuleBase):
    """A scripted expert (:class:`LiftExpert`, :class:`CanExpert`, :class:`SquareExpert`) as a
    TorchRL policy.

    Reads ``"observation"`` (``[*B, O]``) and writes ``"action"`` (``[*B, 7]``, the expert's
    noisy clipped action, in the observation's dtype and device). The expert is stateless, so
    one call serves the whole batch (no Python loop over sub-environments) and resets need no
    care. Only unchunked environments (one action per step) are supported: a chunked
    environment's action is ``[*B, H', 7]`` and an expert that replays one action for ``H'``
    steps is no longer the expert.

    Args:
        env: the environment the policy acts in (``make_robosuite_env(N)``, unchunked); used
            to check the action and observation shapes.
        expert: the expert; its ``act(observation)`` maps ``[..., O]`` arrays to ``[..., 7]``.

    Examples:
        >>> from torchrl_flowpolicy.tasks.robosuite.env import make_robosuite_env
        >>> env = make_robosuite_env(2, max_episode_steps=5)
        >>> env.rollout(5, RobosuiteExpertPolicy(env, LiftExpert()))["action"].shape
        torch.Size([2, 5, 7])
    """

    def __init__(self, env: EnvBase, expert: LiftExpert | CanExpert | SquareExpert):
        super().__init__()
        batch = tuple(env.batch_size)
        action_shape = tuple(env.action_spec.shape)
        if action_shape != (*batch, ACTION_DIM):
            raise ValueError(
                f"RobosuiteExpertPolicy acts one step at a time: the environment's action spec "
                f"must be {(*batch, ACTION_DIM)}, got {action_shape} (a chunked environment? "
                f"build it with executed_chunk_length=None)."
            )
        observation_shape = tuple(env.observation_spec["observation"].shape)
        expected = getattr(expert, "observation_dim", observation_shape[-1])
        if observation_shape[-1] != expected:
            raise ValueError(
                f"{type(expert).__name__} reads observations of {expected} features, the "
                f"environment's have {observation_shape[-1]} (another task?)."
            )
        self.expert = expert
        self.in_keys = ["observation"]
        self.out_keys = ["action"]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        observation = tensordict.get("observation")
        action = self.expert.act(observation.detach().cpu().numpy())
        tensordict.set(
            "action",
            torch.as_tensor(action, dtype=observation.dtype, device=observation.device),
        )
        return tensordict


def collect_robosuite_demos(
    num_episodes: int,
    action_noise: float,
    seed: int = 0,
    max_episode_steps: int | None = None,
    *,
    task: str = "Lift",
    reward: RewardMode = "success",
    terminate_on_success: bool = True,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Roll out the task's noisy scripted expert for ``num_episodes`` episodes.

    Episode ``i`` resets the environment with seed ``seed * 1_000_003 + i`` (so the first
    ``n`` episodes do not depend on ``num_episodes``); the expert's noise generator is seeded
    with ``seed``. An episode ends at the time limit or, with ``terminate_on_success``, at its
    first successful step, so episodes differ in length.

    Args:
        num_episodes: number of episodes.
        action_noise: standard deviation of the Gaussian noise added to the expert's actions
            (then clipped to ``[-1, 1]``).
        seed: seed of the environment resets and of the noise.
        max_episode_steps: the time limit of an episode (``None``: the task's,
            :attr:`~torchrl_flowpolicy.tasks.robosuite.env.RobosuiteTask.max_episode_steps`).

    Keyword Args:
        task: the robosuite task: ``"Lift"`` (:class:`LiftExpert`), ``"PickPlaceCan"``
            (:class:`CanExpert`) or ``"NutAssemblySquare"`` (:class:`SquareExpert`), each for
            the environment's layout (``from_env``).
        reward: the stored reward, as for
            :class:`~torchrl_flowpolicy.tasks.robosuite.env.RobosuiteGymEnv`.
        terminate_on_success: whether an episode ends at its first success.
        progress: called with 1 after every episode (e.g. a tqdm ``update``).

    Returns:
        A dict of tensors with ``T`` (the sum of the episode lengths) rows in episode order:
        ``"observation"`` ``[T, O]`` float32 (before the action), ``"action"`` ``[T, 7]``
        float32 (executed: noisy and clipped), ``"expert_action"`` ``[T, 7]`` (clean),
        ``"reward"`` ``[T]``, ``"episode"`` ``[T]`` int64, ``"step"`` ``[T]`` int64; per
        episode ``"episode_seed"`` ``[N]``, ``"success"`` ``[N]`` bool (the task's success at
        the episode's last step) and ``"episode_length"`` ``[N]`` int64; and ``"config"``, a
        dict of the arguments plus ``"wall_time_s"``. The layout of
        :func:`~torchrl_flowpolicy.tasks.collect_demos`, with lengths instead of final distances.

    Examples:
        >>> demos = collect_robosuite_demos(2, action_noise=0.3, max_episode_steps=60)
        >>> demos["observation"].shape[1], bool(demos["success"].all())
        (60, True)
        >>> int(demos["episode_length"].sum()) == demos["action"].shape[0]
        True
    """
    if num_episodes < 1:
        raise ValueError(f"num_episodes must be >= 1, got {num_episodes}.")
    if action_noise < 0:
        raise ValueError(f"action_noise must be >= 0, got {action_noise}.")
    if task not in EXPERTS:
        raise ValueError(f"no scripted expert for task {task!r}: use one of {sorted(EXPERTS)}.")
    if max_episode_steps is None:
        max_episode_steps = TASKS[task].max_episode_steps
    env = RobosuiteGymEnv(
        task,
        max_episode_steps=max_episode_steps,
        reward=reward,
        terminate_on_success=terminate_on_success,
    )
    expert = EXPERTS[task].from_env(env, action_noise=action_noise, seed=seed)
    observations, actions, expert_actions, rewards, steps = [], [], [], [], []
    episode_seeds = np.zeros(num_episodes, dtype=np.int64)
    successes = np.zeros(num_episodes, dtype=bool)
    lengths = np.zeros(num_episodes, dtype=np.int64)
    start = time.perf_counter()
    for episode in range(num_episodes):
        episode_seed = seed * 1_000_003 + episode
        episode_seeds[episode] = episode_seed
        observation, info = env.reset(seed=episode_seed)
        for step in range(max_episode_steps):
            action = expert.act(observation)
            observations.append(observation)
            actions.append(action)
            expert_actions.append(expert.last_clean_action)
            observation, reward_value, terminated, truncated, info = env.step(action)
            rewards.append(reward_value)
            steps.append(step)
            if terminated or truncated:
                break
        lengths[episode] = step + 1
        successes[episode] = info["success"]
        if progress is not None:
            progress(1)
    env.close()
    return {
        "observation": torch.from_numpy(np.stack(observations).astype(np.float32)),
        "action": torch.from_numpy(np.stack(actions).astype(np.float32)),
        "expert_action": torch.from_numpy(np.stack(expert_actions).astype(np.float32)),
        "reward": torch.tensor(rewards, dtype=torch.float32),
        "episode": torch.arange(num_episodes).repeat_interleave(torch.from_numpy(lengths)),
        "step": torch.tensor(steps, dtype=torch.int64),
        "episode_seed": torch.from_numpy(episode_seeds),
        "success": torch.from_numpy(successes),
        "episode_length": torch.from_numpy(lengths),
        "config": {
            "task": task,
            "num_episodes": int(num_episodes),
            "action_noise": float(action_noise),
            "seed": int(seed),
            "max_episode_steps": int(max_episode_steps),
            "reward": reward,
            "terminate_on_success": bool(terminate_on_success),
            "wall_time_s": float(time.perf_counter() - start),
        },
    }
