"""A scripted expert for the default task: cage the object in the wrist's U, then push it.

:class:`PusherExpert` reads the MuJoCo state of a gymnasium ``Pusher-v5`` environment and
returns joint torques; :mod:`torchrl_flowpolicy.tasks.demonstrations` rolls it out (with
Gaussian action noise) to make the demonstrations the examples pretrain on, and
:class:`PusherExpertPolicy` runs one expert per sub-environment of a batched TorchRL
environment (the expert row of the evaluation protocol). Its measured success rates are in
:mod:`torchrl_flowpolicy.tasks.pusher.env`.
"""

from __future__ import annotations

import math

import gymnasium as gym
import mujoco
import numpy as np
import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torchrl.envs import EnvBase

from torchrl_flowpolicy.envs.batched import BatchedGymEnv
from torchrl_flowpolicy.tasks.pusher.env import ACTION_HIGH, ACTION_LOW

__all__ = ["PusherExpert", "PusherExpertPolicy"]


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

    Noise. With ``action_noise > 0``, :meth:`act` adds ``N(0, action_noise^2)`` to every
    torque (drawn from the expert's own generator) and clips to ``[-2, 2]``;
    :attr:`last_clean_action` keeps the noise-free action.

    Args:
        env: a gymnasium ``Pusher-v5`` environment (any wrappers; ``env.unwrapped`` is read).

    Keyword Args:
        action_noise: standard deviation of the Gaussian action noise (0: the clean expert).
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
        >>> from torchrl_flowpolicy.tasks.pusher.env import is_success
        >>> env = gym.make("Pusher-v5", max_episode_steps=150)
        >>> observation, _ = env.reset(seed=0)
        >>> expert = PusherExpert(env, action_noise=0.0)
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
        action_noise: float = 0.0,
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
        if action_noise < 0:
            raise ValueError(f"action_noise must be >= 0, got {action_noise}.")
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
        self.action_noise = float(action_noise)
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
        if self.action_noise > 0:
            noise = self.generator.normal(0.0, self.action_noise, size=action.shape)
            action = np.clip(action + noise, ACTION_LOW, ACTION_HIGH)
        return action

    __call__ = act


class PusherExpertPolicy(TensorDictModuleBase):
    """One :class:`PusherExpert` per sub-environment of a batched Pusher-v5 env, as a policy.

    The experts read the simulators of ``env``'s :class:`~torchrl_flowpolicy.envs.BatchedGymEnv`
    (not the observation), so this policy acts only in the environment it was built for:
    ``make_pusher_env(N)`` without chunking (one action per step). Each expert restarts its
    episode when its simulator's time goes back (a reset). A Python loop over the
    sub-environments: the expert is a per-simulator controller, for evaluation only.

    Args:
        env: the batched environment whose base is a ``BatchedGymEnv`` of Pusher-v5.

    Keyword Args:
        action_noise: as for :class:`PusherExpert` (0, the default: the clean expert).
        seed: seed of the noise generators (sub-environment ``i``: ``seed + i``).

    Examples:
        >>> from torchrl_flowpolicy.tasks import make_pusher_env
        >>> env = make_pusher_env(2, max_episode_steps=5)
        >>> env.rollout(5, PusherExpertPolicy(env))["action"].shape
        torch.Size([2, 5, 7])
    """

    def __init__(self, env: EnvBase, *, action_noise: float = 0.0, seed: int = 0):
        super().__init__()
        base = getattr(env, "base_env", env)
        if not isinstance(base, BatchedGymEnv):
            raise TypeError(
                f"PusherExpertPolicy needs a BatchedGymEnv-based environment (make_pusher_env(N)), "
                f"got {type(base).__name__}."
            )
        if env.action_spec.shape != (*env.batch_size, 7):
            raise ValueError(
                f"PusherExpertPolicy acts one step at a time: the action spec must be "
                f"{(*env.batch_size, 7)}, got {tuple(env.action_spec.shape)} (a chunked env?)."
            )
        self.experts = [
            PusherExpert(sub_env, action_noise=action_noise, seed=seed + index)
            for index, sub_env in enumerate(base.envs)
        ]
        self.in_keys = ["observation"]
        self.out_keys = ["action"]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        actions = np.stack([expert.act() for expert in self.experts])
        observation = tensordict.get("observation")
        action = torch.as_tensor(actions, dtype=observation.dtype, device=observation.device)
        tensordict.set("action", action.reshape(observation.shape[:-1] + (7,)))
        return tensordict
