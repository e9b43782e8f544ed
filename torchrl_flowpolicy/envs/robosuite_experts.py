"""Scripted experts for the robosuite tasks, as policies and as demonstrations.

:class:`LiftExpert` picks up Lift's cube and :class:`CanExpert` puts PickPlaceCan's can into
its compartment of bin 2, each from the flat observation alone (no simulator access, no
memory; the can's target, fixed per environment, is given at construction);
:class:`RobosuiteExpertPolicy` runs one in a TorchRL environment from
:func:`~torchrl_flowpolicy.envs.robosuite_tasks.make_robosuite_env`, and
:func:`collect_robosuite_demos` rolls it out with action noise to make demonstrations in the
layout of :func:`~torchrl_flowpolicy.envs.collect_demos`.

Measured (LiftExpert, robosuite 1.5.2, 100 episodes with reset seeds 1000-1099, which were
not used for tuning; Gaussian noise added to all 7 action entries, then clipped; success ends
an episode; one core; ``benchmarks/expert_episodes.py --task Lift --action_noise A``):

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

Measured (CanExpert, the same conditions: robosuite 1.5.2, 100 episodes with reset seeds
1000-1099, not used for tuning, which used seeds 0-99; episodes run up to 400 steps;
``benchmarks/expert_episodes.py --task PickPlaceCan --action_noise A``):

| action noise | success within 250 / 400 steps | successful episodes' length: mean, median, p90, max |
| --- | --- | --- |
| 0 (clean) | 100 % / 100 % | 96.1, 97, 112, 120 |
| 0.3 | 99 % / 99 % | 115.0, 113, 141, 177 |
| 0.5 | 82 % / 89 % | 167.2, 157, 237, 338 |
| 1.0 | 11 % / 25 % | 269.0, 270, 356, 394 |
| uniform random actions | 0 % / - (30 episodes, 250 steps) | - |

Success within other limits: clean: 60 % (100 steps), 100 % (120); noise 0.3: 67 % (120),
93 % (150), 99 % (200); noise 0.5: 42 % (150), 70 % (200), 85 % (300). Most of an episode is
the carry: about 0.6 m from bin 1 to the drop point at the held hand's top speed (about
0.012 m per step), so the clean expert needs four times Lift's steps. What fails under noise:
the can knocked over during a grasp (it is then grasped across its body, which the wrist's
joint limits sometimes forbid), or the arm stretched to its full reach near bin 1's far side,
a singular posture (elbow straight) that robosuite's OSC does not leave; such episodes run
into the time limit. The expert's own cost is about 0.13 ms per call.

Choice of the can's horizon,
:data:`~torchrl_flowpolicy.envs.robosuite_tasks.CAN_MAX_EPISODE_STEPS` = 250 steps (12.5 s),
by Lift's reasoning: a 2x margin over the clean expert's longest episode (120 steps), which
the 0.3-noise expert also meets (99 %, as without a limit), while the time limit still counts
for an imprecise policy: the 0.5-noise expert loses 7 points to it (82 % against 89 % at 400
steps; 70 % at 200), the 1.0-noise one more than half of its successes (11 % against 25 %).
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
    OBSERVATION_SLICES,
    TASKS,
    RewardMode,
    RobosuiteGymEnv,
)

__all__ = ["CanExpert", "LiftExpert", "RobosuiteExpertPolicy", "collect_robosuite_demos"]

_LIFT = OBSERVATION_SLICES["Lift"]
_CAN = OBSERVATION_SLICES["PickPlaceCan"]
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


class _ScriptedExpert:
    """What the scripted experts share: validated positive settings, the action noise and
    :meth:`act`. A subclass sets ``observation_slices`` and defines ``clean_action``."""

    observation_slices: dict[str, slice]

    def __init__(self, action_noise: float, seed: int | None, **settings: float):
        if action_noise < 0:
            raise ValueError(f"action_noise must be >= 0, got {action_noise}.")
        for name, value in settings.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}.")
            setattr(self, name, value)
        self.action_noise = float(action_noise)
        self.generator = np.random.default_rng(seed)
        self.observation_dim = max(s.stop for s in self.observation_slices.values())
        self.last_clean_action = np.zeros(ACTION_DIM)

    def clean_action(self, observation: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def act(self, observation: np.ndarray) -> np.ndarray:
        """The actions to execute: the clean actions plus the Gaussian noise, clipped."""
        action = self.clean_action(observation)
        self.last_clean_action = action
        if self.action_noise > 0:
            noise = self.generator.normal(0.0, self.action_noise, size=action.shape)
            action = np.clip(action + noise, -1.0, 1.0)
        return action

    __call__ = act


class LiftExpert(_ScriptedExpert):
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

    observation_slices = _LIFT

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
        super().__init__(
            action_noise,
            seed,
            hover_height=hover_height,
            align_tolerance=align_tolerance,
            yaw_tolerance=yaw_tolerance,
            grasp_tolerance=grasp_tolerance,
            grasp_height_tolerance=grasp_height_tolerance,
            hold_tolerance=hold_tolerance,
            shut_width=shut_width,
            open_width=open_width,
            still_speed=still_speed,
            position_gain=position_gain,
            rotation_gain=rotation_gain,
        )

    @classmethod
    def from_env(cls, env: Any, **kwargs: Any) -> LiftExpert:
        """The expert for ``env`` (as :meth:`CanExpert.from_env`; Lift needs nothing from it)."""
        del env
        return cls(**kwargs)

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


def _wrap_half_turn(angle: np.ndarray) -> np.ndarray:
    """Angles wrapped to ``[-pi/2, pi/2)`` (the gripper's yaw is defined modulo 180 degrees)."""
    return np.mod(angle + np.pi / 2, np.pi) - np.pi / 2


#: The can's compartment of bin 2 as robosuite 1.5.2's PickPlaceCan defines success there
#: (``bin2_pos = (0.1, 0.28, 0.8)``, bins of 0.39 x 0.49 m): ``(x_low, x_high, y_low,
#: y_high)``, m; the can's centre must also lie between the bin's height (0.8 m) and 0.1 m
#: above it. :meth:`CanExpert.from_env` reads the same numbers from an environment.
CAN_COMPARTMENT: tuple[float, float, float, float] = (0.1, 0.295, 0.28, 0.525)
CAN_BIN_HEIGHT = 0.8
#: Where :class:`CanExpert` puts the can down, relative to the compartment's corner nearest
#: the robot (``x_low``, ``y_low``), m: 2.5 cm (x) and 3.5 cm (y) between the dividers' faces
#: (1 cm from their centres) and the can's side, and within the Panda's reach with the hand
#: pointing down (the compartment's centre is not).
CAN_DROP_INSET: tuple[float, float] = (0.06, 0.07)
# The can (robosuite's CanObject): radius 0.025 m, centre 0.04 m above its bottom; it stands
# with its centre 0.06 m above bin 2's height (the floor's top is 0.02 m above it).
_UPRIGHT_COS = 0.7  # |cos| of the can axis' tilt above which it counts as standing (45 deg)
_MARGIN = 0.01  # the compartment, shrunk by this, is where a low can counts as placed, m
_RAMP = 0.05  # height over which the carry's horizontal speed ramps up, m
_RETREAT = 0.15  # height of the grip site above the released can that it rises to, m


class CanExpert(_ScriptedExpert):
    """A scripted, stateless pick-and-place controller for robosuite PickPlaceCan (Panda).

    Like :class:`LiftExpert`, each action is a function of the current observation only
    (any leading dimensions, no reset), here the 64 features of
    :data:`~torchrl_flowpolicy.envs.robosuite_tasks.OBSERVATION_SLICES` ``["PickPlaceCan"]``:
    the can's absolute position and orientation (``can_pos``, ``can_quat``; the relative
    ``can_to_eef_*`` entries read 0 in a reset's observation and are not used), the grip
    site's position (``eef_pos``), the hand's orientation and the fingers' positions and
    velocities. The target is fixed per environment and given at construction: the
    compartment of bin 2 where the can counts as placed (``compartment``, ``bin_height``) and
    the point above which the can is put down (``drop_point``); the defaults are robosuite
    1.5.2's default layout, and :meth:`from_env` reads them from an environment instead
    (``target_bin_placements`` and ``bin_size`` of the robosuite environment).

    Decisions, in order of priority:

    - orientation, always: the hand points down; its finger axis (the hand's y axis) lies
      along the world's y axis while the can stands, across the can's axis once it lies on
      its side (its tilt above 45 degrees), in both cases the nearest of the two yaws;
    - release: the can is inside the compartment (shrunk by 1 cm) and its centre less than
      ``release_height`` above ``bin_height``: open the gripper, keep lowering the hand to
      ``place_height`` until the fingers are open wider than ``release_width``, then rise;
      the can drops the last centimetres, and robosuite's success (the can in the
      compartment, its centre below 0.1 m, the grip site more than 0.042 m from it) follows;
    - carry: the can is between the fingers (they are neither open, ``open_width``, nor
      shut, ``shut_width``, and the can is within ``hold_tolerance`` of where it is
      grasped) and they have stopped closing (``still_speed``, as in :class:`LiftExpert`):
      move the can to ``carry_height`` above the bin's height (its bottom then clears the bins'
      walls, 0.1 m), horizontally towards ``drop_point`` at a speed that ramps up with the
      can's height from ``clearance_height`` to 5 cm above it, and lower it to
      ``place_height`` once it is within ``place_tolerance`` of the drop point (a funnel:
      the height target falls from ``carry_height`` at twice that distance);
    - grasp and approach, otherwise, as in :class:`LiftExpert`: the grip site moves to the
      grasp point, ``grasp_offset`` above a standing can's centre (at the centre of a lying
      one), but ``hover_height`` above it while misaligned (horizontally by more than
      ``align_tolerance``, or by more than ``yaw_tolerance`` in yaw for a lying can, with the
      same linear funnel) or while the fingers are not yet open; within ``grasp_tolerance``
      of the grasp point, or while holding, the gripper closes.

    A can that slips out or falls over is approached again from where it lies: nothing needs
    remembering. Translation and rotation are proportional (``position_gain`` per metre,
    ``rotation_gain`` per radian, clipped to ``[-1, 1]``); the gripper entry is ``-1`` or
    ``+1``. Its success rates and episode lengths are in the module docstring.

    Noise. As for :class:`LiftExpert`: with ``action_noise > 0``, :meth:`act` adds
    ``N(0, action_noise^2)`` to every entry (from the expert's generator, seeded with
    ``seed``) and clips to ``[-1, 1]``; :attr:`last_clean_action` keeps the noise-free action.

    Keyword Args:
        action_noise: standard deviation of the Gaussian action noise (0: the clean expert).
        seed: seed of the noise generator.
        compartment: ``(x_low, x_high, y_low, y_high)`` of the can's compartment of bin 2, m.
        bin_height: bin 2's height (robosuite's ``bin2_pos[2]``), m: the can's centre must be
            within 0.1 m above it.
        drop_point: ``(x, y)`` above which the can is put down, m (default: the
            compartment's corner nearest the robot plus :data:`CAN_DROP_INSET`).
        hover_height: height of the grip site above the grasp point while misaligned, m.
        align_tolerance: horizontal grip-site-to-grasp-point distance below which the hand
            goes all the way down, m.
        yaw_tolerance: yaw error below which the hand goes down onto a lying can, rad.
        grasp_offset: height of the grasp point above a standing can's centre, m.
        grasp_tolerance: distance (horizontal and vertical) of the grip site from the grasp
            point within which the gripper closes, m.
        hold_tolerance: the same within which closed fingers are taken to hold the can, m.
        shut_width: finger opening below which the fingers hold nothing, m.
        open_width: finger opening that separates open from closed, m (the can is 0.05 m
            wide; fully open is about 0.08).
        release_width: finger opening beyond which the released hand rises, m.
        still_speed: closing speed of the fingers below which closing has finished, m/s.
        carry_height: height of the carried can's centre above ``bin_height``, m.
        clearance_height: height of the can's centre above ``bin_height`` from which it
            starts moving sideways, m.
        place_height: height above ``bin_height`` to which the can's centre is lowered, m.
        release_height: height above ``bin_height`` below which a can inside the
            compartment is let go, m.
        place_tolerance: horizontal distance from the drop point within which the can is
            lowered all the way, m.
        position_gain: translation action per metre of position error.
        rotation_gain: rotation action per radian of orientation error.

    Examples:
        >>> from torchrl_flowpolicy.envs.robosuite_tasks import RobosuiteGymEnv
        >>> env = RobosuiteGymEnv("PickPlaceCan")
        >>> observation, info = env.reset(seed=0)
        >>> expert = CanExpert.from_env(env)
        >>> for step in range(env.max_episode_steps):
        ...     observation, reward, terminated, truncated, info = env.step(expert.act(observation))
        ...     if terminated or truncated:
        ...         break
        >>> info["success"]
        True
    """

    observation_slices = _CAN

    def __init__(
        self,
        *,
        action_noise: float = 0.0,
        seed: int | None = None,
        compartment: tuple[float, float, float, float] = CAN_COMPARTMENT,
        bin_height: float = CAN_BIN_HEIGHT,
        drop_point: tuple[float, float] | None = None,
        hover_height: float = 0.07,
        align_tolerance: float = 0.015,
        yaw_tolerance: float = 0.3,
        grasp_offset: float = 0.02,
        grasp_tolerance: float = 0.02,
        hold_tolerance: float = 0.03,
        shut_width: float = 0.03,
        open_width: float = 0.065,
        release_width: float = 0.055,
        still_speed: float = 0.02,
        carry_height: float = 0.18,
        clearance_height: float = 0.10,
        place_height: float = 0.08,
        release_height: float = 0.12,
        place_tolerance: float = 0.02,
        position_gain: float = 150.0,
        rotation_gain: float = 4.0,
    ):
        super().__init__(
            action_noise,
            seed,
            hover_height=hover_height,
            align_tolerance=align_tolerance,
            yaw_tolerance=yaw_tolerance,
            grasp_offset=grasp_offset,
            grasp_tolerance=grasp_tolerance,
            hold_tolerance=hold_tolerance,
            shut_width=shut_width,
            open_width=open_width,
            release_width=release_width,
            still_speed=still_speed,
            carry_height=carry_height,
            clearance_height=clearance_height,
            place_height=place_height,
            release_height=release_height,
            place_tolerance=place_tolerance,
            position_gain=position_gain,
            rotation_gain=rotation_gain,
        )
        x_low, x_high, y_low, y_high = (float(bound) for bound in compartment)
        if not (x_low < x_high and y_low < y_high):
            raise ValueError(
                f"compartment must be (x_low, x_high, y_low, y_high), got {compartment}."
            )
        if drop_point is None:
            drop_point = (x_low + CAN_DROP_INSET[0], y_low + CAN_DROP_INSET[1])
        if not (x_low < drop_point[0] < x_high and y_low < drop_point[1] < y_high):
            raise ValueError(f"drop_point {drop_point} is not inside compartment {compartment}.")
        self.compartment = (x_low, x_high, y_low, y_high)
        self.bin_height = float(bin_height)
        self.drop_point = np.array(drop_point, dtype=np.float64)

    @classmethod
    def from_env(cls, env: Any, **kwargs: Any) -> CanExpert:
        """The expert for one environment's layout, read once from it.

        ``env`` is a :class:`~torchrl_flowpolicy.envs.robosuite_tasks.RobosuiteGymEnv` or a
        robosuite PickPlace environment. The compartment is robosuite's
        ``target_bin_placements[object_id]`` (its centre, at bin 2's height) plus and minus a
        quarter of ``bin_size``: the box robosuite's ``_check_success`` tests.
        """
        robosuite_env = getattr(env, "robosuite_env", env)
        centre = np.asarray(robosuite_env.target_bin_placements[robosuite_env.object_id])
        quarter = np.asarray(robosuite_env.bin_size[:2], dtype=np.float64) / 4
        low, high = centre[:2] - quarter, centre[:2] + quarter
        compartment = (float(low[0]), float(high[0]), float(low[1]), float(high[1]))
        return cls(compartment=compartment, bin_height=float(centre[2]), **kwargs)

    def clean_action(self, observation: np.ndarray) -> np.ndarray:
        """The noise-free actions, ``[..., 7]`` float64, for ``[..., 64]`` observations."""
        observation = np.asarray(observation, dtype=np.float64)
        if observation.shape[-1:] != (self.observation_dim,):
            raise ValueError(
                f"CanExpert needs PickPlaceCan observations of {self.observation_dim} features "
                f"in the last dimension, got shape {observation.shape}."
            )
        can = observation[..., _CAN["can_pos"]]
        grip = observation[..., _CAN["eef_pos"]]
        can_axis = _quaternion_to_matrix(observation[..., _CAN["can_quat"]])[..., :, 2]
        hand_rotation = _quaternion_to_matrix(observation[..., _CAN["eef_quat"]])
        fingers = observation[..., _CAN["gripper_qpos"]]
        finger_velocity = observation[..., _CAN["gripper_qvel"]]
        opening = fingers[..., 0] - fingers[..., 1]
        closing_speed = finger_velocity[..., 1] - finger_velocity[..., 0]

        # Target orientation: hand z axis down; finger axis along y, or across a lying can.
        lying = np.abs(can_axis[..., 2]) < _UPRIGHT_COS
        finger_axis = hand_rotation[..., :, 1]
        hand_yaw = np.arctan2(finger_axis[..., 1], finger_axis[..., 0])
        can_yaw = np.arctan2(can_axis[..., 1], can_axis[..., 0])
        wanted_yaw = np.where(lying, can_yaw, 0.0) + np.pi / 2
        yaw_error = _wrap_half_turn(wanted_yaw - hand_yaw)
        target_yaw = hand_yaw + yaw_error
        zeros, ones = np.zeros_like(target_yaw), np.ones_like(target_yaw)
        target_y = np.stack([np.cos(target_yaw), np.sin(target_yaw), zeros], -1)
        target_z = np.stack([zeros, zeros, -ones], -1)
        target_x = np.cross(target_y, target_z)
        target_rotation = np.stack([target_x, target_y, target_z], -1)
        rotation_error = 0.5 * np.cross(hand_rotation, target_rotation, axis=-2).sum(-1)

        # Grasp and hold, relative to the grasp point.
        grasp_point = can.copy()
        grasp_point[..., 2] += np.where(lying, 0.0, self.grasp_offset)
        offset = grasp_point - grip
        horizontal = np.linalg.norm(offset[..., :2], axis=-1)
        in_grasp = (horizontal < self.grasp_tolerance) & (
            np.abs(offset[..., 2]) < self.grasp_tolerance
        )
        holding = (
            (opening > self.shut_width)
            & (opening < self.open_width)
            & (horizontal < self.hold_tolerance)
            & (np.abs(offset[..., 2]) < self.hold_tolerance)
        )
        x_low, x_high, y_low, y_high = self.compartment
        height = can[..., 2] - self.bin_height
        placed = (
            (can[..., 0] > x_low + _MARGIN)
            & (can[..., 0] < x_high - _MARGIN)
            & (can[..., 1] > y_low + _MARGIN)
            & (can[..., 1] < y_high - _MARGIN)
            & (height < self.release_height)
        )
        closing = (in_grasp | holding) & ~placed
        carrying = holding & (closing_speed < self.still_speed) & ~placed

        # Approach: the funnel of LiftExpert above the grasp point (yaw counts for a lying can).
        misalignment = np.maximum(
            horizontal / self.align_tolerance,
            np.where(lying, np.abs(yaw_error) / self.yaw_tolerance, 0.0),
        )
        hover = self.hover_height * np.clip(misalignment - 1.0, 0.0, 1.0)
        hover = np.where((opening > self.open_width) | closing, hover, self.hover_height)
        approach_target = grasp_point.copy()
        approach_target[..., 2] += hover
        approach = np.clip(self.position_gain * (approach_target - grip), -1.0, 1.0)

        # Carry: up, over (faster as the can rises), and down into the funnel at the drop point.
        to_drop = self.drop_point - can[..., :2]
        drop_distance = np.linalg.norm(to_drop, axis=-1)
        descent = np.clip(drop_distance / self.place_tolerance - 1.0, 0.0, 1.0)
        target_height = self.place_height + (self.carry_height - self.place_height) * descent
        sideways = np.clip((height - self.clearance_height) / _RAMP, 0.0, 1.0)
        sideways = np.where(drop_distance < 2 * self.place_tolerance, 1.0, sideways)
        carry = np.empty_like(approach)
        carry[..., :2] = np.clip(self.position_gain * to_drop, -1.0, 1.0) * sideways[..., None]
        carry[..., 2] = np.clip(self.position_gain * (target_height - height), -1.0, 1.0)

        # Release: keep lowering while the fingers open, then rise above the can.
        release = np.zeros_like(approach)
        lower = np.clip(self.position_gain * (self.place_height - height), -1.0, 0.0)
        rise = np.clip(self.position_gain * (can[..., 2] + _RETREAT - grip[..., 2]), -1.0, 1.0)
        release[..., 2] = np.where(opening > self.release_width, rise, lower)

        translation = np.where(carrying[..., None], carry, approach)
        translation = np.where(placed[..., None], release, translation)
        rotation = np.clip(self.rotation_gain * rotation_error, -1.0, 1.0)
        gripper = np.where(closing, 1.0, -1.0)[..., None]
        return np.concatenate([translation, rotation, gripper], axis=-1)


# Each has from_env(env, **kwargs): the expert for one environment.
EXPERTS: dict[str, type[LiftExpert] | type[CanExpert]] = {
    "Lift": LiftExpert,
    "PickPlaceCan": CanExpert,
}


class RobosuiteExpertPolicy(TensorDictModuleBase):
    """A scripted expert (:class:`LiftExpert`, :class:`CanExpert`) as a TorchRL policy.

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

    def __init__(self, env: EnvBase, expert: LiftExpert | CanExpert):
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
            :attr:`~torchrl_flowpolicy.envs.robosuite_tasks.RobosuiteTask.max_episode_steps`).

    Keyword Args:
        task: the robosuite task: ``"Lift"`` (:class:`LiftExpert`) or ``"PickPlaceCan"``
            (:class:`CanExpert`, for the environment's layout: :meth:`CanExpert.from_env`).
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
