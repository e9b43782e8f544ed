"""The default task: gymnasium ``Pusher-v5`` with a scripted expert and a success criterion.

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

Measured with this module (clean expert, reset seeds 100-199, 100 episodes): at 150 steps
the final horizontal object-goal distance is below 0.05 m in 90 % of the episodes (below
0.10 m: 96 %, median 0.019 m); at 100 steps in 56 % (72 %, median 0.044 m). With Gaussian
action noise at 150 steps: 85 % (noise 0.5), 55 % (0.7), 22 % (1.0, 50 episodes). Uniform
random torques move the object less than 1 cm (0 % success). Hence the defaults: 150 steps
(the 100-step task is mostly a race against the push speed) and a 0.05 m threshold (the
object's radius; the expert's median final distance is 0.02 m).
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import mujoco
import numpy as np
import torch
from tensordict import TensorDictBase
from torch import Tensor
from torchrl.data import Binary, Composite, Unbounded
from torchrl.envs import Compose, DoubleToFloat, GymEnv, Transform, TransformedEnv

__all__ = [
    "PUSHER_ENV_ID",
    "DEFAULT_MAX_EPISODE_STEPS",
    "DEFAULT_SUCCESS_THRESHOLD",
    "OBSERVATION_SLICES",
    "object_goal_distance",
    "is_success",
    "PusherExpert",
    "PusherTask",
    "make_pusher_env",
    "collect_demos",
    "load_or_collect_demos",
    "demos_path",
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


# ----------------------------------------------------------------------------- expert
def _cross(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.array(
        [a[1] * b[2] - a[2] * b[1], a[2] * b[0] - a[0] * b[2], a[0] * b[1] - a[1] * b[0]]
    )


class PusherExpert:
    """A scripted pushing expert for gymnasium ``Pusher-v5``: cage the object, then push.

    Strategy. The wrist's three capsules form a U (cross-bar plus two prongs); its *cage
    centre* is the point 0.08 m along the wrist's x axis from ``tips_arm``, inside the U.
    The expert (1) moves the cage centre above the object (``hover`` metres up), (2) lowers
    it around the object, and (3) pushes: it drives the cage centre ``push_depth`` metres past
    the object towards the goal, so the U's wall behind the object presses into it, easing
    off linearly within ``ease_distance`` of the goal. If the object leaves the U
    (``escape_distance``) it starts again from (1). The U stays horizontal (its normal
    vertical, either sign) and its opening points along the object->goal direction rotated by
    a fixed yaw offset; pushing sideways with a prong works too, so at the start of an episode
    the expert chooses the smallest offset (0, +-45, +-90 degrees) for which inverse
    kinematics reaches both the hover and the pushing pose, trying a fixed set of start
    postures, which makes the choice a deterministic function of the initial state.

    Control. Each step a few damped-least-squares inverse-kinematics iterations, warm-started
    from the previous solution and run on a scratch ``MjData``, update a joint-space target
    (a weighted least-squares fit of the cage position, weight 1, and of the U's tilt and yaw,
    weights ``tilt_weight`` and ``yaw_weight``); the torque is a joint PD law towards that
    target, clipped to ``[-2, 2]``.

    What it reads from the simulator (``env.unwrapped.model`` / ``.data``): the arm's joint
    angles and velocities (``qpos[:7]``, ``qvel[:7]``), the positions of the ``tips_arm``,
    ``object`` and ``goal`` bodies (``xpos``) and the orientation of ``tips_arm`` (``xmat``,
    a function of the joint angles). All of it is determined by the observation; the expert
    also keeps an internal state (its phase, the inverse-kinematics warm start and the chosen
    yaw offset and U side), reset by :meth:`reset` or automatically when the simulation time
    goes back.

    Noise. With ``noise_level > 0``, :meth:`act` adds ``N(0, noise_level^2)`` to every torque
    (drawn from the expert's own generator) and clips to ``[-2, 2]``; :attr:`last_clean_action`
    keeps the noise-free action.

    Args:
        env: a gymnasium ``Pusher-v5`` environment (any wrappers; ``env.unwrapped`` is read).

    Keyword Args:
        noise_level: standard deviation of the Gaussian action noise (0: the clean expert).
        seed: seed of the noise generator.
        hover: height of the cage above the object during the approach, m.
        push_depth: how far past the object the cage centre is driven while pushing, m.
        ease_distance: object-goal distance below which the push depth shrinks linearly, m.
        capture_tolerance: horizontal cage-object distance that starts the descent and the push, m.
        escape_distance: horizontal cage-object distance at which a push is abandoned, m.
        position_gain: joint PD stiffness, N m / rad.
        velocity_gains: joint PD damping per joint, N m s / rad.
        tilt_weight: inverse-kinematics weight of keeping the U horizontal.
        yaw_weight: inverse-kinematics weight of the U's yaw.
        damping: damped-least-squares regulariser.
        iterations: inverse-kinematics iterations per step.

    Examples:
        >>> env = gym.make("Pusher-v5", max_episode_steps=150)
        >>> observation, _ = env.reset(seed=0)
        >>> expert = PusherExpert(env, noise_level=0.0)
        >>> for _ in range(150):
        ...     observation, *_ = env.step(expert.act())
        >>> bool(is_success(observation))
        True
    """

    cage_offset = 0.08
    yaw_offsets_deg = (0.0, 45.0, -45.0, 90.0, -90.0)
    plan_iterations = 30
    plan_tolerance = 1.5
    max_joint_step = 0.2

    def __init__(
        self,
        env: gym.Env,
        *,
        noise_level: float = 0.0,
        seed: int | None = None,
        hover: float = 0.08,
        push_depth: float = 0.06,
        ease_distance: float = 0.05,
        capture_tolerance: float = 0.03,
        escape_distance: float = 0.07,
        position_gain: float = 10.0,
        velocity_gains: tuple[float, ...] = (2.0, 2.0, 1.0, 1.0, 0.5, 0.5, 0.5),
        tilt_weight: float = 0.5,
        yaw_weight: float = 0.2,
        damping: float = 3e-2,
        iterations: int = 3,
    ):
        if noise_level < 0:
            raise ValueError(f"noise_level must be >= 0, got {noise_level}.")
        if len(velocity_gains) != 7:
            raise ValueError(f"velocity_gains needs 7 entries, got {len(velocity_gains)}.")
        unwrapped = env.unwrapped
        self.model: mujoco.MjModel = unwrapped.model
        self.data: mujoco.MjData = unwrapped.data
        try:
            self._wrist = self.model.body("tips_arm").id
            self._object = self.model.body("object").id
            self._goal = self.model.body("goal").id
        except KeyError as error:
            raise ValueError("PusherExpert needs a Pusher-v5 environment.") from error
        self.noise_level = float(noise_level)
        self.generator = np.random.default_rng(seed)
        self.hover = hover
        self.push_depth = push_depth
        self.ease_distance = ease_distance
        self.capture_tolerance = capture_tolerance
        self.escape_distance = escape_distance
        self.position_gain = position_gain
        self.velocity_gains = np.asarray(velocity_gains, dtype=np.float64)
        self.tilt_weight = tilt_weight
        self.yaw_weight = yaw_weight
        self.damping = damping
        self.iterations = iterations

        self._scratch = mujoco.MjData(self.model)
        self._lower = self.model.jnt_range[:7, 0].copy()
        self._upper = self.model.jnt_range[:7, 1].copy()
        self._jacobian_position = np.zeros((3, self.model.nv))
        self._jacobian_rotation = np.zeros((3, self.model.nv))
        self._regulariser = damping * np.eye(9)
        self._weights = np.array([1.0] * 3 + [tilt_weight] * 3 + [yaw_weight] * 3)
        # Deterministic start postures for the plan: the zero posture and four drawn once.
        self._start_postures = np.concatenate(
            [
                np.zeros((1, 7)),
                np.random.default_rng(0).uniform(self._lower, self._upper, size=(4, 7)),
            ]
        )
        self.last_clean_action = np.zeros(7)
        self.reset()

    # ------------------------------------------------------------------------- state
    def reset(self) -> None:
        """Forget the episode: phase, inverse-kinematics warm start, yaw offset, U side."""
        self.phase = "approach"
        self._joint_target: np.ndarray | None = None
        self._yaw_offset = 0.0
        self._up_sign = 1.0
        self._last_time = -math.inf

    # ------------------------------------------------------------------------- kinematics
    def _forward(self, joints: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Cage centre and wrist rotation matrix for the joint angles (scratch data)."""
        scratch = self._scratch
        scratch.qpos[:7] = joints
        mujoco.mj_kinematics(self.model, scratch)
        mujoco.mj_comPos(self.model, scratch)
        rotation = scratch.xmat[self._wrist].reshape(3, 3)
        return scratch.xpos[self._wrist] + self.cage_offset * rotation[:, 0], rotation

    def _solve(
        self,
        joints: np.ndarray,
        target: np.ndarray,
        yaw_axis: np.ndarray,
        up_axis: np.ndarray,
        iterations: int,
    ) -> tuple[np.ndarray, float]:
        """Damped-least-squares IK; returns the joints and a cost (cm + deg/10 + deg/30)."""
        for _ in range(iterations):
            cage, rotation = self._forward(joints)
            error = np.concatenate(
                [
                    target - cage,
                    self.tilt_weight * _cross(rotation[:, 2], up_axis),
                    self.yaw_weight * _cross(rotation[:, 0], yaw_axis),
                ]
            )
            mujoco.mj_jac(
                self.model,
                self._scratch,
                self._jacobian_position,
                self._jacobian_rotation,
                cage,
                self._wrist,
            )
            rotation_jacobian = self._jacobian_rotation[:, :7]
            jacobian = np.concatenate(
                [self._jacobian_position[:, :7], rotation_jacobian, rotation_jacobian]
            )
            jacobian *= self._weights[:, None]
            normal = jacobian @ jacobian.T + self._regulariser
            mujoco.mju_cholFactor(normal, 0.0)
            solution = np.empty(9)
            mujoco.mju_cholSolve(solution, normal, error)
            step = jacobian.T @ solution
            largest = np.abs(step).max()
            if largest > self.max_joint_step:
                step *= self.max_joint_step / largest
            joints = np.clip(joints + step, self._lower, self._upper)
        cage, rotation = self._forward(joints)
        cost = (
            100.0 * np.linalg.norm(target - cage)
            + math.degrees(math.acos(min(1.0, max(-1.0, rotation[:, 2] @ up_axis)))) / 10.0
            + math.degrees(math.acos(min(1.0, max(-1.0, rotation[:, 0] @ yaw_axis)))) / 30.0
        )
        return joints, cost

    def _yaw_axis(self, direction: np.ndarray, offset: float) -> np.ndarray:
        cosine, sine = math.cos(offset), math.sin(offset)
        return np.array(
            [
                cosine * direction[0] - sine * direction[1],
                sine * direction[0] + cosine * direction[1],
                0.0,
            ]
        )

    def _scene(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """Cage centre, object position, unit object->goal direction (xy), distance."""
        data = self.data
        rotation = data.xmat[self._wrist].reshape(3, 3)
        cage = data.xpos[self._wrist] + self.cage_offset * rotation[:, 0]
        position = data.xpos[self._object].copy()
        offset = data.xpos[self._goal][:2] - position[:2]
        distance = float(np.hypot(offset[0], offset[1]))
        direction = offset / max(distance, 1e-6)
        return cage, position, direction, distance

    def _plan(self) -> None:
        """Choose the yaw offset, the U side and an initial joint target for the episode."""
        _, position, direction, _ = self._scene()
        pushing = position + np.array([*(0.03 * direction), 0.0])
        hovering = position + np.array([0.0, 0.0, self.hover])
        best = (math.inf, np.zeros(7), 0.0, 1.0)
        for offset_deg in self.yaw_offsets_deg:
            offset = math.radians(offset_deg)
            yaw_axis = self._yaw_axis(direction, offset)
            for up_sign in (1.0, -1.0):
                up_axis = np.array([0.0, 0.0, up_sign])
                for start in self._start_postures:
                    joints, cost_push = self._solve(
                        start, pushing, yaw_axis, up_axis, self.plan_iterations
                    )
                    joints, cost_hover = self._solve(
                        joints, hovering, yaw_axis, up_axis, self.plan_iterations
                    )
                    cost = max(cost_push, cost_hover)
                    if cost < best[0]:
                        best = (cost, joints, offset, up_sign)
                    if best[0] < self.plan_tolerance:
                        break
                if best[0] < self.plan_tolerance:
                    break
            if best[0] < self.plan_tolerance:
                break
        _, self._joint_target, self._yaw_offset, self._up_sign = best

    # ------------------------------------------------------------------------- acting
    def clean_action(self) -> np.ndarray:
        """The noise-free torques for the current simulator state (advances the phase)."""
        data = self.data
        if data.time < self._last_time:
            self.reset()
        self._last_time = data.time
        if self._joint_target is None:
            self._plan()
        cage, position, direction, distance = self._scene()
        horizontal_error = float(np.hypot(cage[0] - position[0], cage[1] - position[1]))
        if self.phase == "push" and horizontal_error > self.escape_distance:
            self.phase = "approach"
        if (
            self.phase == "approach"
            and horizontal_error < self.capture_tolerance
            and abs(cage[2] - position[2]) < 0.02
        ):
            self.phase = "push"
        if self.phase == "push":
            depth = self.push_depth * min(1.0, distance / self.ease_distance)
            target = position + np.array([*(depth * direction), 0.0])
        else:
            lift = self.hover if horizontal_error > self.capture_tolerance else 0.0
            target = position + np.array([0.0, 0.0, lift])
        self._joint_target, _ = self._solve(
            self._joint_target,
            target,
            self._yaw_axis(direction, self._yaw_offset),
            np.array([0.0, 0.0, self._up_sign]),
            self.iterations,
        )
        torque = self.position_gain * (self._joint_target - data.qpos[:7])
        torque -= self.velocity_gains * data.qvel[:7]
        return np.clip(torque, ACTION_LOW, ACTION_HIGH)

    def act(self) -> np.ndarray:
        """The action to execute now: the clean action plus the Gaussian noise, clipped."""
        action = self.clean_action()
        self.last_clean_action = action
        if self.noise_level > 0:
            noise = self.generator.normal(0.0, self.noise_level, size=action.shape)
            action = np.clip(action + noise, ACTION_LOW, ACTION_HIGH)
        return action

    __call__ = act


# ----------------------------------------------------------------------------- TorchRL env
REWARD_MODES = ("progress", "gymnasium")


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
        reward: str = "progress",
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
    max_episode_steps: int = DEFAULT_MAX_EPISODE_STEPS,
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
    reward: str = "progress",
    *,
    executed_chunk_length: int | None = None,
    device: str | torch.device | None = None,
    **gym_kwargs: Any,
) -> TransformedEnv:
    """The library's default task as a TorchRL environment.

    ``GymEnv("Pusher-v5", max_episode_steps=...)`` with :class:`DoubleToFloat` (float32
    observations and rewards) and :class:`PusherTask` (``"success"`` and
    ``"object_goal_distance"`` entries, the reward choice). The observation stays the raw
    23-feature vector (see the module docstring for its layout).

    Args:
        max_episode_steps: the time limit (episodes end by truncation only).
        success_threshold: the final horizontal object-goal distance that counts as a
            success, m.
        reward: ``"progress"`` (default) or ``"gymnasium"`` (see :class:`PusherTask`).

    Keyword Args:
        executed_chunk_length: if given, append
            :func:`~torchrl_flowpolicy.envs.make_chunked_env` with this ``H'``: each step then
            executes ``H'`` actions (``"action"`` of shape ``[*B, H', 7]``), the reward is their
            sum and ``"success"`` / ``"object_goal_distance"`` are those of the last executed
            step.
        device: the TorchRL device of the environment.
        **gym_kwargs: forwarded to ``gymnasium.make`` (e.g. ``reward_control_weight``).

    Returns:
        The transformed environment; seed it with ``env.set_seed(seed)``.
    """
    if max_episode_steps < 1:
        raise ValueError(f"max_episode_steps must be >= 1, got {max_episode_steps}.")
    kwargs: dict[str, Any] = dict(gym_kwargs)
    if device is not None:
        kwargs["device"] = device
    base = GymEnv(PUSHER_ENV_ID, max_episode_steps=max_episode_steps, **kwargs)
    env = TransformedEnv(
        base,
        Compose(
            DoubleToFloat(),
            PusherTask(success_threshold=success_threshold, reward=reward),
        ),
    )
    if executed_chunk_length is not None:
        from torchrl_flowpolicy.envs.chunking import make_chunked_env

        env = make_chunked_env(env, executed_chunk_length)
    return env


# ----------------------------------------------------------------------------- demonstrations
def collect_demos(
    num_episodes: int,
    noise_level: float,
    seed: int = 0,
    max_episode_steps: int = DEFAULT_MAX_EPISODE_STEPS,
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
    *,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Roll out the noisy :class:`PusherExpert` for ``num_episodes`` episodes.

    Episode ``i`` resets the environment with seed ``seed * 1_000_003 + i`` (so the first
    ``n`` episodes do not depend on ``num_episodes``); the expert's noise generator is seeded
    with ``seed``.

    Args:
        num_episodes: number of episodes, each ``max_episode_steps`` steps long.
        noise_level: standard deviation of the Gaussian noise added to the expert's torques.
        seed: seed of the environment resets and of the noise.
        max_episode_steps: the episode length.
        success_threshold: the threshold of the stored per-episode success flags.

    Keyword Args:
        progress: called with 1 after every episode (e.g. a tqdm ``update``).

    Returns:
        A dict of tensors with ``T = num_episodes * max_episode_steps`` rows, in episode
        order: ``"observation"`` ``[T, 23]`` float32 (before the action), ``"action"``
        ``[T, 7]`` float32 (the executed, noisy and clipped torques), ``"expert_action"``
        ``[T, 7]`` (the clean torques), ``"reward"`` ``[T]`` (gymnasium's own reward), ``"episode"``
        ``[T]`` int64, ``"step"`` ``[T]`` int64; per episode ``"episode_seed"`` ``[N]``,
        ``"final_distance"`` ``[N]`` float32, ``"success"`` ``[N]`` bool; and ``"config"``, a
        dict of the arguments plus ``"wall_time_s"``.
    """
    if num_episodes < 1:
        raise ValueError(f"num_episodes must be >= 1, got {num_episodes}.")
    env = gym.make(PUSHER_ENV_ID, max_episode_steps=max_episode_steps)
    expert = PusherExpert(env, noise_level=noise_level, seed=seed)
    steps = num_episodes * max_episode_steps
    observations = np.zeros((steps, 23), dtype=np.float32)
    actions = np.zeros((steps, 7), dtype=np.float32)
    expert_actions = np.zeros((steps, 7), dtype=np.float32)
    rewards = np.zeros(steps, dtype=np.float32)
    episode_seeds = np.zeros(num_episodes, dtype=np.int64)
    final_distances = np.zeros(num_episodes, dtype=np.float32)
    start = time.perf_counter()
    row = 0
    for episode in range(num_episodes):
        episode_seed = seed * 1_000_003 + episode
        episode_seeds[episode] = episode_seed
        observation, _ = env.reset(seed=episode_seed)
        expert.reset()
        for _ in range(max_episode_steps):
            action = expert.act()
            observations[row] = observation
            actions[row] = action
            expert_actions[row] = expert.last_clean_action
            observation, reward, terminated, truncated, _ = env.step(action)
            rewards[row] = reward
            row += 1
            if terminated:
                raise RuntimeError(
                    "Pusher-v5 terminated early; demos assume fixed-length episodes."
                )
        final_distances[episode] = object_goal_distance(observation)
        if progress is not None:
            progress(1)
    env.close()
    final_distance = torch.from_numpy(final_distances)
    return {
        "observation": torch.from_numpy(observations),
        "action": torch.from_numpy(actions),
        "expert_action": torch.from_numpy(expert_actions),
        "reward": torch.from_numpy(rewards),
        "episode": torch.arange(num_episodes).repeat_interleave(max_episode_steps),
        "step": torch.arange(max_episode_steps).repeat(num_episodes),
        "episode_seed": torch.from_numpy(episode_seeds),
        "final_distance": final_distance,
        "success": final_distance < success_threshold,
        "config": {
            "num_episodes": int(num_episodes),
            "noise_level": float(noise_level),
            "seed": int(seed),
            "max_episode_steps": int(max_episode_steps),
            "success_threshold": float(success_threshold),
            "wall_time_s": float(time.perf_counter() - start),
        },
    }


def demos_path(
    directory: str | os.PathLike,
    num_episodes: int,
    noise_level: float,
    seed: int = 0,
    max_episode_steps: int = DEFAULT_MAX_EPISODE_STEPS,
) -> Path:
    """Where :func:`load_or_collect_demos` caches a demonstration set.

    ``{directory}/pusher_T{max_episode_steps}_noise{noise_level}_n{num_episodes}_seed{seed}.pt``
    """
    return Path(directory) / (
        f"pusher_T{max_episode_steps}_noise{noise_level:g}_n{num_episodes}_seed{seed}.pt"
    )


def load_or_collect_demos(
    num_episodes: int,
    noise_level: float,
    seed: int = 0,
    max_episode_steps: int = DEFAULT_MAX_EPISODE_STEPS,
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
    *,
    directory: str | os.PathLike = "outputs/demos",
    progress: Callable[[int], None] | None = None,
) -> tuple[dict[str, Any], Path, bool]:
    """Load a cached demonstration set, or collect it and cache it atomically.

    The file (see :func:`demos_path`) is written to a temporary file in the same folder and
    moved into place with ``os.replace``, and read with ``torch.load(weights_only=True)``.
    A cached file whose stored configuration does not match is an error (delete it or pick
    another folder). The per-episode ``"success"`` flags are recomputed for
    ``success_threshold`` from the stored final distances.

    Args:
        num_episodes: as for :func:`collect_demos`.
        noise_level: as for :func:`collect_demos`.
        seed: as for :func:`collect_demos`.
        max_episode_steps: as for :func:`collect_demos`.
        success_threshold: as for :func:`collect_demos`.

    Keyword Args:
        directory: the cache folder.
        progress: forwarded to :func:`collect_demos` when collecting.

    Returns:
        ``(demos, path, loaded)``: the dict described in :func:`collect_demos`, its file, and
        whether it came from the cache.
    """
    path = demos_path(directory, num_episodes, noise_level, seed, max_episode_steps)
    if path.exists():
        demos = torch.load(path, weights_only=True)
        stored = demos["config"]
        expected = {
            "num_episodes": num_episodes,
            "noise_level": float(noise_level),
            "seed": seed,
            "max_episode_steps": max_episode_steps,
        }
        mismatched = {k: (stored.get(k), v) for k, v in expected.items() if stored.get(k) != v}
        if mismatched:
            raise ValueError(
                f"cached demos at {path} were collected with other settings "
                f"(stored, requested): {mismatched}; delete the file or use another directory."
            )
        demos["success"] = demos["final_distance"] < success_threshold
        demos["config"]["success_threshold"] = float(success_threshold)
        return demos, path, True
    demos = collect_demos(
        num_episodes,
        noise_level,
        seed,
        max_episode_steps,
        success_threshold,
        progress=progress,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(demos, file)
        os.chmod(temporary, 0o644)  # mkstemp creates it private
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    return demos, path, False
