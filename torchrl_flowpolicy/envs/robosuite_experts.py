"""Scripted experts for the robosuite tasks, as policies and as demonstrations.

:class:`LiftExpert` picks up Lift's cube from the flat observation alone (no simulator
access, no memory); :class:`RobosuiteExpertPolicy` runs it in a TorchRL environment from
:func:`~torchrl_flowpolicy.envs.robosuite_tasks.make_robosuite_env`, and
:func:`collect_robosuite_demos` rolls it out with action noise to make demonstrations in the
layout of :func:`~torchrl_flowpolicy.envs.collect_demos`.

Measured (LiftExpert, robosuite 1.5.2, 100 episodes with reset seeds 1000-1099, which were
not used for tuning; Gaussian noise added to all 7 action entries, then clipped; success ends
an episode; one core):

| action noise | success within 60 / 200 steps | successful episodes' length: mean, median, p90, max |
| --- | --- | --- |
| 0 (clean) | 100 % / 100 % | 23.9, 24, 25, 29 |
| 0.3 | 100 % / 100 % | 29.2, 27, 39, 51 |
| 0.5 | 72 % / 100 % | 50.2, 42, 85, 132 |
| 1.0 | 20 % / 61 % | 99.6, 91, 181, 197 |
| uniform random actions | 0 % / - (30 episodes) | - |

Success within other limits: noise 0.3: 94 % (40 steps), 98 % (50); noise 0.5: 46 % (40),
60 % (50), 87 % (80), 95 % (100), 100 % (150). The noise hurts mostly through the rotation
entries: a large rotation command drags the grip site by centimetres per step (20 episodes at
noise 1.0 on one group only: translation 33 steps, rotation 82, gripper 25 on average). The
expert's own cost is about 0.1 ms per call, small next to a 3.5 ms environment step.

Choice of Lift's horizon,
:data:`~torchrl_flowpolicy.envs.robosuite_tasks.DEFAULT_MAX_EPISODE_STEPS` = 60 steps (3 s,
15 decisions of ``H' = 4`` executed actions): the clean expert succeeds in every episode with
a 2x margin (longest 29 steps), and so does the 0.3-noise expert (longest 51), but the
time limit counts: an imprecise policy, like the 0.5-noise expert, loses a quarter of its
episodes to the clock (60 steps: 72 %, against 87 % at 80 and 95 % at 100), which is where
behaviour cloning from a few noisy demonstrations run as open-loop chunks is expected to
start, leaving reinforcement learning room to raise both success and speed. A shorter limit
(40-50 steps) would already fail some episodes of the 0.3-noise expert; a longer one makes
each failed episode, the common case early in RL, cost more of a budget of a few hundred
thousand environment steps (about 260 steps/s per core here).
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

from torchrl_flowpolicy.envs.robosuite_tasks import (
    DEFAULT_MAX_EPISODE_STEPS,
    OBSERVATION_SLICES,
    RewardMode,
    RobosuiteGymEnv,
)

__all__ = ["LiftExpert", "RobosuiteExpertPolicy", "collect_robosuite_demos"]

_LIFT = OBSERVATION_SLICES["Lift"]
ACTION_DIM = 7


def _quaternion_to_matrix(quaternion: np.ndarray) -> np.ndarray:
    """``[..., 4]`` (x, y, z, w) quaternions to ``[..., 3, 3]`` rotation matrices."""
    quaternion = quaternion / np.linalg.norm(quaternion, axis=-1, keepdims=True)
    x, y, z, w = np.moveaxis(quaternion, -1, 0)
    rows = [
        [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
        [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
        [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
    ]
    return np.stack([np.stack(row, axis=-1) for row in rows], axis=-2)


def _wrap_quarter_turn(angle: np.ndarray) -> np.ndarray:
    """Angles wrapped to ``[-pi/4, pi/4)`` (a square's yaw is defined modulo 90 degrees)."""
    return np.mod(angle + np.pi / 4, np.pi / 2) - np.pi / 4


class LiftExpert:
    """A scripted, stateless grasp-and-lift controller for robosuite Lift (Panda, OSC_POSE).

    Each action is a function of the current observation only, so one expert serves a whole
    batch of environments (any leading dimensions) and needs no reset. From the observation
    (:data:`~torchrl_flowpolicy.envs.robosuite_tasks.OBSERVATION_SLICES`) it reads the cube's
    position and yaw, the grip site's position, the hand's orientation and the fingers'
    positions and velocities, and decides what to do:

    - orientation, always: the hand points down and its finger axis (the hand's y axis) lies
      along a face normal of the cube, the cube's yaw modulo 90 degrees nearest to the hand's;
    - approach: with the gripper opening, move the grip site towards the cube's centre, but
      ``hover_height`` above it while misaligned: the target height rises linearly from 0 at
      ``align_tolerance`` (horizontal) or ``yaw_tolerance`` (yaw) to ``hover_height`` at twice
      those; fingers not yet open wider than ``open_width`` also keep it at hover height;
    - grasp: once the grip site is within ``grasp_tolerance`` of the cube's centre
      horizontally and ``grasp_height_tolerance`` vertically, close the gripper;
    - hold and lift: while the fingers are neither open (``open_width``) nor shut on nothing
      (``shut_width``) and the cube is within ``hold_tolerance`` of the grip site, the cube is
      between the fingers: keep closing, and once the fingers have stopped closing (their
      closing speed, the difference of the two finger joint velocities, below
      ``still_speed``; a jolt of the hand moves both fingers alike and cancels there) move up
      at full speed.

    A lost cube (it slips out while lifting, or the fingers shut beside it) leaves the hold
    condition, the gripper opens and the approach starts again: nothing needs remembering.
    Translation and rotation are proportional (``position_gain`` per metre, ``rotation_gain``
    per radian of the orientation error as robosuite's OSC computes it, clipped to
    ``[-1, 1]``); the gripper entry is ``-1`` or ``+1``. Its success rates and episode lengths
    are in the module docstring.

    Noise. With ``action_noise > 0``, :meth:`act` adds ``N(0, action_noise^2)`` to every
    action entry (from the expert's own generator, seeded with ``seed``) and clips to
    ``[-1, 1]``; :attr:`last_clean_action` keeps the noise-free action.

    Keyword Args:
        action_noise: standard deviation of the Gaussian action noise (0: the clean expert).
        seed: seed of the noise generator.
        hover_height: height of the grip site above the cube's centre while misaligned, m.
        align_tolerance: horizontal grip-cube distance below which the hand goes all the way
            down, m.
        yaw_tolerance: yaw error below which the hand goes all the way down, rad.
        grasp_tolerance: horizontal grip-site-to-cube-centre distance within which the
            gripper closes, m.
        grasp_height_tolerance: the same, vertically, m.
        hold_tolerance: grip-site-to-cube-centre distance (horizontal and vertical) within
            which closed fingers are taken to hold the cube, m.
        shut_width: finger opening below which the fingers hold nothing, m.
        open_width: finger opening (the difference of the two finger joints) that separates
            open from closed, m (the cube is 0.040-0.044 m wide; fully open is about 0.08).
        still_speed: closing speed of the fingers below which closing has finished, m/s.
        position_gain: translation action per metre of position error.
        rotation_gain: rotation action per radian of orientation error.

    Examples:
        >>> from torchrl_flowpolicy.envs.robosuite_tasks import RobosuiteGymEnv
        >>> env = RobosuiteGymEnv("Lift", max_episode_steps=60)
        >>> observation, info = env.reset(seed=0)
        >>> expert = LiftExpert()
        >>> for step in range(60):
        ...     observation, reward, terminated, truncated, info = env.step(expert.act(observation))
        ...     if terminated or truncated:
        ...         break
        >>> info["success"]
        True
    """

    def __init__(
        self,
        *,
        action_noise: float = 0.0,
        seed: int | None = None,
        hover_height: float = 0.04,
        align_tolerance: float = 0.02,
        yaw_tolerance: float = 0.5,
        grasp_tolerance: float = 0.03,
        grasp_height_tolerance: float = 0.02,
        hold_tolerance: float = 0.03,
        shut_width: float = 0.03,
        open_width: float = 0.06,
        still_speed: float = 0.02,
        position_gain: float = 150.0,
        rotation_gain: float = 4.0,
    ):
        if action_noise < 0:
            raise ValueError(f"action_noise must be >= 0, got {action_noise}.")
        for name, value in {
            "hover_height": hover_height,
            "align_tolerance": align_tolerance,
            "yaw_tolerance": yaw_tolerance,
            "grasp_tolerance": grasp_tolerance,
            "grasp_height_tolerance": grasp_height_tolerance,
            "hold_tolerance": hold_tolerance,
            "shut_width": shut_width,
            "open_width": open_width,
            "still_speed": still_speed,
            "position_gain": position_gain,
            "rotation_gain": rotation_gain,
        }.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}.")
        self.action_noise = float(action_noise)
        self.generator = np.random.default_rng(seed)
        self.hover_height = hover_height
        self.align_tolerance = align_tolerance
        self.yaw_tolerance = yaw_tolerance
        self.grasp_tolerance = grasp_tolerance
        self.grasp_height_tolerance = grasp_height_tolerance
        self.hold_tolerance = hold_tolerance
        self.shut_width = shut_width
        self.open_width = open_width
        self.still_speed = still_speed
        self.position_gain = position_gain
        self.rotation_gain = rotation_gain
        self.observation_dim = max(s.stop for s in _LIFT.values())
        self.last_clean_action = np.zeros(ACTION_DIM)

    def clean_action(self, observation: np.ndarray) -> np.ndarray:
        """The noise-free actions, ``[..., 7]`` float64, for ``[..., 60]`` Lift observations."""
        observation = np.asarray(observation, dtype=np.float64)
        if observation.shape[-1:] != (self.observation_dim,):
            raise ValueError(
                f"LiftExpert needs Lift observations of {self.observation_dim} features in "
                f"the last dimension, got shape {observation.shape}."
            )
        cube = observation[..., _LIFT["cube_pos"]]
        grip = observation[..., _LIFT["eef_pos"]]
        cube_rotation = _quaternion_to_matrix(observation[..., _LIFT["cube_quat"]])
        hand_rotation = _quaternion_to_matrix(observation[..., _LIFT["eef_quat"]])
        fingers = observation[..., _LIFT["gripper_qpos"]]
        finger_velocity = observation[..., _LIFT["gripper_qvel"]]
        opening = fingers[..., 0] - fingers[..., 1]
        # The rate at which the fingers close: a sideways jolt of the hand moves both fingers
        # the same way (it cancels here), squeezing moves them against each other.
        closing_speed = finger_velocity[..., 1] - finger_velocity[..., 0]

        # Target orientation: hand z axis down, finger axis (hand y) along a cube face normal.
        cube_yaw = np.arctan2(cube_rotation[..., 1, 0], cube_rotation[..., 0, 0])
        finger_axis = hand_rotation[..., :, 1]
        hand_yaw = np.arctan2(finger_axis[..., 1], finger_axis[..., 0])
        yaw_error = _wrap_quarter_turn(cube_yaw - hand_yaw)
        target_yaw = hand_yaw + yaw_error
        zeros, ones = np.zeros_like(target_yaw), np.ones_like(target_yaw)
        target_y = np.stack([np.cos(target_yaw), np.sin(target_yaw), zeros], -1)
        target_z = np.stack([zeros, zeros, -ones], -1)
        target_x = np.cross(target_y, target_z)
        target_rotation = np.stack([target_x, target_y, target_z], -1)
        # Small-angle orientation error, as robosuite's OSC computes it (world frame).
        rotation_error = 0.5 * np.cross(hand_rotation, target_rotation, axis=-2).sum(-1)

        offset = cube - grip
        horizontal = np.linalg.norm(offset[..., :2], axis=-1)
        in_grasp = (horizontal < self.grasp_tolerance) & (
            np.abs(offset[..., 2]) < self.grasp_height_tolerance
        )
        # The cube is between the fingers: they closed on something (neither open nor shut)
        # and it is still near the grip site.
        holding = (
            (opening > self.shut_width)
            & (opening < self.open_width)
            & (horizontal < self.hold_tolerance)
            & (np.abs(offset[..., 2]) < self.hold_tolerance)
        )
        closing = in_grasp | holding
        lifting = holding & (closing_speed < self.still_speed)
        # A funnel: the target height rises from the cube's centre (aligned) to hover_height
        # (misaligned by twice the tolerance or more); closed fingers outside the grasp hover.
        misalignment = np.maximum(
            horizontal / self.align_tolerance, np.abs(yaw_error) / self.yaw_tolerance
        )
        height = self.hover_height * np.clip(misalignment - 1.0, 0.0, 1.0)
        height = np.where((opening > self.open_width) | closing, height, self.hover_height)
        target = cube.copy()
        target[..., 2] += height
        translation = np.clip(self.position_gain * (target - grip), -1.0, 1.0)
        translation[..., 2] = np.where(lifting, 1.0, translation[..., 2])
        rotation = np.clip(self.rotation_gain * rotation_error, -1.0, 1.0)
        gripper = np.where(closing, 1.0, -1.0)[..., None]
        return np.concatenate([translation, rotation, gripper], axis=-1)

    def act(self, observation: np.ndarray) -> np.ndarray:
        """The actions to execute: the clean actions plus the Gaussian noise, clipped."""
        action = self.clean_action(observation)
        self.last_clean_action = action
        if self.action_noise > 0:
            noise = self.generator.normal(0.0, self.action_noise, size=action.shape)
            action = np.clip(action + noise, -1.0, 1.0)
        return action

    __call__ = act


EXPERTS: dict[str, Callable[..., LiftExpert]] = {"Lift": LiftExpert}


class RobosuiteExpertPolicy(TensorDictModuleBase):
    """A scripted expert (e.g. :class:`LiftExpert`) as a TorchRL policy, one action per step.

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
        >>> from torchrl_flowpolicy.envs.robosuite_tasks import make_robosuite_env
        >>> env = make_robosuite_env(2, max_episode_steps=5)
        >>> env.rollout(5, RobosuiteExpertPolicy(env, LiftExpert()))["action"].shape
        torch.Size([2, 5, 7])
    """

    def __init__(self, env: EnvBase, expert: LiftExpert):
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
    max_episode_steps: int = DEFAULT_MAX_EPISODE_STEPS,
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
        max_episode_steps: the time limit of an episode.

    Keyword Args:
        task: the robosuite task (an expert exists for ``"Lift"``).
        reward: the stored reward, as for :class:`~torchrl_flowpolicy.envs.robosuite_tasks.RobosuiteGymEnv`.
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
        :func:`~torchrl_flowpolicy.envs.collect_demos`, with lengths instead of final distances.

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
    env = RobosuiteGymEnv(
        task,
        max_episode_steps=max_episode_steps,
        reward=reward,
        terminate_on_success=terminate_on_success,
    )
    expert = EXPERTS[task](action_noise=action_noise, seed=seed)
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
