"""The default task: gymnasium ``Pusher-v5``, its success criterion and its TorchRL environment.

This module holds the task's facts, the success test (:func:`object_goal_distance`,
:func:`is_success`), the :class:`PusherTask` transform and the one environment factory,
:func:`make_pusher_env`. The scripted expert is
:class:`~torchrl_flowpolicy.tasks.pusher.expert.PusherExpert`; its demonstrations are made
and cached by :mod:`torchrl_flowpolicy.tasks.demonstrations`.

Task facts (gymnasium 1.4.0, MuJoCo 3.9.0, ``pusher_v5.xml``):

- Observation (23 features): ``[0:7]`` arm joint angles (rad), ``[7:14]`` joint velocities
  (rad/s), ``[14:17]`` position of the ``tips_arm`` body (the centre of the wrist's cross-bar,
  not the fingertip spheres), ``[17:20]`` object position, ``[20:23]`` goal position (m).
  Action: 7 joint torques in ``[-2, 2]``. One step is 5 physics steps of 0.01 s (0.05 s).
- The goal is fixed at ``(0.45, -0.05)``; the object starts uniformly in
  ``x in [0.25, 0.65]``, ``y in [-0.35, -0.05]``, at least 0.17 m from the goal (at most
  0.36 m). The object slides on two joints, so its height (-0.275) never changes; the goal
  body sits lower (-0.323), which puts a constant 0.048 m into any 3-D object-goal distance.
  Success is therefore measured in the horizontal plane (:func:`object_goal_distance`).
- Only the three wrist capsules (the cross-bar and two 0.1 m prongs, a U open along the
  wrist's local x axis) collide with the object; the rest of the arm passes through it.
- The object weighs 8e-6 kg, its joints have 0.5 N s/m damping, and its contact with the
  light wrist is very soft: pressed 2-3 cm deep it moves at about 0.045 m/s, and pressing
  deeper squeezes it out of the U. Pushing 0.2-0.3 m therefore takes 100-150 steps, so the
  100-step default episode is time-limited; this module's default is 150 steps.

Measured with :class:`~torchrl_flowpolicy.tasks.pusher.expert.PusherExpert` (clean expert, reset seeds 100-199, 100 episodes): at 150 steps
the final horizontal object-goal distance is below 0.05 m in 90 % of the episodes (below
0.10 m: 96 %, median 0.019 m); at 100 steps in 56 % (72 %, median 0.044 m). With Gaussian
action noise at 150 steps: 85 % (noise 0.5), 55 % (0.7), 22 % (1.0, 50 episodes). Uniform
random torques move the object less than 1 cm (0 % success). Hence the defaults: 150 steps
(the 100-step task is mostly a race against the push speed) and a 0.05 m threshold (the
object's radius; the expert's median final distance is 0.02 m).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from tensordict import TensorDictBase
from torch import Tensor
from torchrl.data import Binary, Composite, Unbounded
from torchrl.envs import Compose, DoubleToFloat, GymEnv, Transform, TransformedEnv

from torchrl_flowpolicy.envs.batched import BatchedGymEnv
from torchrl_flowpolicy.envs.chunking import make_chunked_env

__all__ = [
    "PUSHER_ENV_ID",
    "DEFAULT_MAX_EPISODE_STEPS",
    "DEFAULT_SUCCESS_THRESHOLD",
    "OBSERVATION_SLICES",
    "object_goal_distance",
    "is_success",
    "PusherTask",
    "make_pusher_env",
    "PUSHER_CAMERA",
    "render_options",
]

PUSHER_ENV_ID = "Pusher-v5"
DEFAULT_MAX_EPISODE_STEPS = 150
DEFAULT_SUCCESS_THRESHOLD = 0.05

OBSERVATION_SLICES: dict[str, slice] = {
    "joint_angles": slice(0, 7),
    "joint_velocities": slice(7, 14),
    "wrist": slice(14, 17),
    "object": slice(17, 20),
    "goal": slice(20, 23),
}

ACTION_LOW, ACTION_HIGH = -2.0, 2.0


# ----------------------------------------------------------------------------- success
def object_goal_distance(observation: Tensor | np.ndarray) -> Tensor | np.ndarray:
    """Horizontal distance between the object and the goal, ``|obs[17:19] - obs[20:22]|``.

    The heights are left out: the object's height is fixed at -0.275 and the goal body's at
    -0.323, so the 3-D distance only adds a constant 0.048 m.

    Args:
        observation: ``[..., 23]`` Pusher observations (tensor or array).

    Returns:
        ``[...]`` distances, same type as the input.
    """
    if observation.shape[-1] != 23:
        raise ValueError(
            f"observation must have 23 features in its last dimension (Pusher-v5), got shape "
            f"{tuple(observation.shape)}."
        )
    offset = observation[..., 17:19] - observation[..., 20:22]
    if isinstance(observation, Tensor):
        return torch.linalg.vector_norm(offset, dim=-1)
    return np.linalg.norm(offset, axis=-1)


def is_success(
    observation: Tensor | np.ndarray, threshold: float = DEFAULT_SUCCESS_THRESHOLD
) -> Tensor | np.ndarray:
    """Whether the object lies within ``threshold`` metres of the goal (horizontally).

    Applied to the last observation of an episode this is the task's success criterion.

    Args:
        observation: ``[..., 23]`` Pusher observations.
        threshold: the largest distance that counts as a success, in metres.

    Returns:
        ``[...]`` booleans, same type as the input.
    """
    if threshold <= 0:
        raise ValueError(f"threshold must be positive, got {threshold}.")
    return object_goal_distance(observation) < threshold


# ----------------------------------------------------------------------------- TorchRL env
RewardMode = Literal["progress", "gymnasium"]
REWARD_MODES: tuple[RewardMode, ...] = ("progress", "gymnasium")


class PusherTask(Transform):
    """Writes the task's outcome into every step and optionally replaces the reward.

    Adds ``"object_goal_distance"`` (``[*B, 1]`` float, metres, :func:`object_goal_distance`)
    and ``"success"`` (``[*B, 1]`` bool, distance below ``success_threshold``) to the reset
    and step outputs. The episode's success is ``"success"`` at its last step (where
    ``("next", "done")`` is set): the episodes end on the time limit only.

    Rewards (``reward``):

    - ``"progress"`` (default): a potential-based reward, ``progress_scale * [(d_t - d_{t+1})
      + near_weight * (n_t - n_{t+1})]`` with ``d`` the horizontal object-goal distance and
      ``n`` the wrist-object distance. An episode's return telescopes to
      ``progress_scale * [(d_0 - d_T) + near_weight * (n_0 - n_T)]``: it measures how much
      closer to the goal the object ended, with no action cost.
    - ``"gymnasium"``: Pusher-v5's own reward, ``-(|object - goal| + 0.5 |object - wrist|
      + 0.1 |action|^2)`` with 3-D distances, left unchanged. Its action cost dominates:
      over 150 steps (40 episodes) the zero policy scores -81 (0 % success), the clean
      expert -52 (85 %), the expert with 0.5 action noise -100 (85 %) and uniform random
      torques -224, so it ranks doing nothing above a noisy but successful policy. With
      ``"progress"`` the same policies score 0, 4.7, 4.7 and -0.5.

    Args:
        success_threshold: the largest final distance that counts as a success, m.
        reward: ``"progress"`` or ``"gymnasium"``.
        progress_scale: multiplier of the progress reward.
        near_weight: weight of the wrist-object progress in the progress reward.
        observation_key: the key of the 23-feature observation.
    """

    def __init__(
        self,
        success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
        reward: RewardMode = "progress",
        *,
        progress_scale: float = 10.0,
        near_weight: float = 0.5,
        observation_key: str = "observation",
    ):
        if success_threshold <= 0:
            raise ValueError(f"success_threshold must be positive, got {success_threshold}.")
        if reward not in REWARD_MODES:
            raise ValueError(f"reward must be one of {REWARD_MODES}, got {reward!r}.")
        super().__init__(in_keys=[observation_key], out_keys=["object_goal_distance", "success"])
        self.success_threshold = float(success_threshold)
        self.reward = reward
        self.progress_scale = float(progress_scale)
        self.near_weight = float(near_weight)
        self.observation_key = observation_key

    def _write(self, tensordict: TensorDictBase) -> TensorDictBase:
        observation = tensordict.get(self.observation_key)
        distance = object_goal_distance(observation).unsqueeze(-1)
        tensordict.set("object_goal_distance", distance.to(torch.float32))
        tensordict.set("success", distance < self.success_threshold)
        return tensordict

    def _reset(
        self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase
    ) -> TensorDictBase:
        return self._write(tensordict_reset)

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        next_tensordict = self._write(next_tensordict)
        if self.reward == "progress":
            before = tensordict.get(self.observation_key)
            after = next_tensordict.get(self.observation_key)
            goal_progress = object_goal_distance(before) - object_goal_distance(after)
            near_progress = _wrist_object_distance(before) - _wrist_object_distance(after)
            reward = self.progress_scale * (goal_progress + self.near_weight * near_progress)
            key = self.parent.reward_key if self.parent is not None else "reward"
            previous = next_tensordict.get(key)
            next_tensordict.set(key, reward.unsqueeze(-1).to(previous.dtype))
        return next_tensordict

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        shape = (*observation_spec.shape, 1)
        observation_spec["object_goal_distance"] = Unbounded(
            shape=shape, dtype=torch.float32, device=observation_spec.device
        )
        observation_spec["success"] = Binary(
            n=1, shape=shape, dtype=torch.bool, device=observation_spec.device
        )
        return observation_spec


def _wrist_object_distance(observation: Tensor) -> Tensor:
    return torch.linalg.vector_norm(observation[..., 17:20] - observation[..., 14:17], dim=-1)


def make_pusher_env(
    num_envs: int | None = None,
    executed_chunk_length: int | None = None,
    *,
    max_episode_steps: int = DEFAULT_MAX_EPISODE_STEPS,
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
    reward: RewardMode = "progress",
    device: str | torch.device | None = None,
    group_size: int = 1,
    **gym_kwargs: Any,
) -> TransformedEnv:
    """The library's default task as a TorchRL environment: one, or a batch, chunked or not.

    - ``num_envs=None``: one environment, ``GymEnv("Pusher-v5", max_episode_steps=...)``
      with :class:`~torchrl.envs.DoubleToFloat` (float32 observations and rewards) and
      :class:`PusherTask`; batch shape ``[]``.
    - ``num_envs=N``: :class:`~torchrl_flowpolicy.envs.BatchedGymEnv` (``N`` gymnasium
      environments stepped in one loop, float32 already) with :class:`PusherTask`; batch
      shape ``[N]``. This is what the examples train and evaluate on.

    :class:`PusherTask` adds the ``"success"`` and ``"object_goal_distance"`` entries and
    chooses the reward. The observation stays the raw 23-feature vector (see the module
    docstring for its layout). With ``executed_chunk_length`` given,
    :func:`~torchrl_flowpolicy.envs.make_chunked_env` is appended: each step then executes
    ``H'`` actions (``"action"`` of shape ``[*B, H', 7]``), the reward is their sum and
    ``"success"`` / ``"object_goal_distance"`` are those of the last executed step.

    Args:
        num_envs: ``None`` for one environment, or the batch size ``N``.
        executed_chunk_length: ``H'``, the number of actions executed per step, or ``None``
            for one action per step.

    Keyword Args:
        max_episode_steps: the time limit (episodes end by truncation only).
        success_threshold: the final horizontal object-goal distance that counts as a
            success, m.
        reward: ``"progress"`` (default) or ``"gymnasium"`` (see :class:`PusherTask`).
        device: the TorchRL device of the environment.
        group_size: a batch's sub-environments per seeding group
            (:class:`~torchrl_flowpolicy.envs.BatchedGymEnv`; default 1).
        **gym_kwargs: forwarded to ``gymnasium.make`` (e.g. ``reward_control_weight``).

    Returns:
        The transformed environment; seed it with ``env.set_seed(seed)`` (a batch seeds
        sub-environment ``i`` with ``seed + i // group_size``).

    Examples:
        >>> env = make_pusher_env(max_episode_steps=10)
        >>> env.rollout(3)["next", "success"].shape
        torch.Size([3, 1])
        >>> env = make_pusher_env(4, executed_chunk_length=5, max_episode_steps=10)
        >>> rollout = env.rollout(3)  # stops after 2 decisions: the time limit
        >>> rollout["action"].shape, rollout["next", "reward"].shape
        (torch.Size([4, 2, 5, 7]), torch.Size([4, 2, 1]))
    """
    if max_episode_steps < 1:
        raise ValueError(f"max_episode_steps must be >= 1, got {max_episode_steps}.")
    if num_envs is None and group_size != 1:
        raise ValueError(f"group_size={group_size} needs a batch (num_envs); got num_envs=None.")
    if num_envs is None:
        if device is not None:
            gym_kwargs["device"] = device
        base = GymEnv(PUSHER_ENV_ID, max_episode_steps=max_episode_steps, **gym_kwargs)
        task = PusherTask(success_threshold=success_threshold, reward=reward)
        env = TransformedEnv(base, Compose(DoubleToFloat(), task))
    else:
        base = BatchedGymEnv(
            PUSHER_ENV_ID,
            num_envs,
            device=device,
            group_size=group_size,
            max_episode_steps=max_episode_steps,
            **gym_kwargs,
        )
        task = PusherTask(success_threshold=success_threshold, reward=reward)
        env = TransformedEnv(base, task)
    if "camera_name" in gym_kwargs:  # gymnasium renders an unknown name from a free camera
        first = base.envs[0] if num_envs is not None else base._env
        _check_camera(first.unwrapped.model, gym_kwargs["camera_name"])
    if executed_chunk_length is not None:
        env = make_chunked_env(env, executed_chunk_length)
    return env


def _check_camera(model: Any, name: str | None) -> None:
    """Refuse a ``camera_name`` that the MuJoCo ``model`` does not define, naming those it
    does (gymnasium's renderer would silently show a free camera instead)."""
    cameras = [model.camera(index).name for index in range(model.ncam)]
    if name is not None and name not in cameras:
        raise ValueError(
            f"unknown camera_name {name!r}: Pusher-v5's model defines {cameras or 'no camera'} "
            "(camera=None renders the library's default view)."
        )


# ----------------------------------------------------------------------------- rendering
# Pusher-v5's default camera shows the table from 4 m away; this one looks down on the arm,
# the object and the goal from behind the shoulder.
PUSHER_CAMERA = {
    "trackbodyid": -1,
    "distance": 2.0,
    "elevation": -55.0,
    "azimuth": 180.0,
    "lookat": np.array([0.25, -0.25, -0.3]),
}


def render_options(height: int, width: int, camera: str | None = None) -> dict[str, Any]:
    """The options of :func:`make_pusher_env` (gymnasium MuJoCo's) that render
    ``height x width`` frames offscreen from the named ``camera``, or from
    :data:`PUSHER_CAMERA` (``camera=None``).

    Examples:
        >>> sorted(render_options(64, 96))
        ['default_camera_config', 'height', 'render_mode', 'width']
    """
    options: dict[str, Any] = {"render_mode": "rgb_array", "height": height, "width": width}
    if camera is None:
        options["default_camera_config"] = PUSHER_CAMERA
    else:
        options["camera_name"] = camera
    return options
