"""The scripted expert of robosuite PickPlaceCan: :class:`CanExpert` puts the can away.

It puts PickPlaceCan's can into its compartment of bin 2 from the flat observation alone
(no simulator access, no memory; the can's target, fixed per environment, is given at
construction or read by :meth:`CanExpert.from_env`), on any batch of observations;
:class:`~torchrl_flowpolicy.tasks.robosuite.experts.RobosuiteExpertPolicy` runs it in a
TorchRL environment and
:func:`~torchrl_flowpolicy.tasks.robosuite.experts.collect_robosuite_demos` rolls it out into
demonstrations. It shares its grasp geometry and noisy action with
:class:`~torchrl_flowpolicy.tasks.robosuite.lift_expert.LiftExpert`
(:mod:`~torchrl_flowpolicy.tasks.robosuite.expert_base`).

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
:data:`~torchrl_flowpolicy.tasks.robosuite.layout.CAN_MAX_EPISODE_STEPS` = 250 steps (12.5 s),
by Lift's reasoning: a 2x margin over the clean expert's longest episode (120 steps), which
the 0.3-noise expert also meets (99 %, as without a limit), while the time limit still counts
for an imprecise policy: the 0.5-noise expert loses 7 points to it (82 % against 89 % at 400
steps; 70 % at 200), the 1.0-noise one more than half of its successes (11 % against 25 %).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torchrl_flowpolicy.tasks.robosuite.expert_base import (
    ScriptedExpert,
    downward_rotation_error,
    finger_yaw,
    quaternion_to_matrix,
    wrap_half_turn,
)
from torchrl_flowpolicy.tasks.robosuite.layout import OBSERVATION_SLICES

__all__ = ["CAN_BIN_HEIGHT", "CAN_COMPARTMENT", "CAN_DROP_INSET", "CanExpert"]

_CAN = OBSERVATION_SLICES["PickPlaceCan"]


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


class CanExpert(ScriptedExpert):
    """A scripted, stateless pick-and-place controller for robosuite PickPlaceCan (Panda).

    Like :class:`~torchrl_flowpolicy.tasks.robosuite.lift_expert.LiftExpert`, each action is a function of the current observation only
    (any leading dimensions, no reset), here the 64 features of
    :data:`~torchrl_flowpolicy.tasks.robosuite.layout.OBSERVATION_SLICES` ``["PickPlaceCan"]``:
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
      grasped) and they have stopped closing (``still_speed``, as in :class:`~torchrl_flowpolicy.tasks.robosuite.lift_expert.LiftExpert`):
      move the can to ``carry_height`` above the bin's height (its bottom then clears the bins'
      walls, 0.1 m), horizontally towards ``drop_point`` at a speed that ramps up with the
      can's height from ``clearance_height`` to 5 cm above it, and lower it to
      ``place_height`` once it is within ``place_tolerance`` of the drop point (a funnel:
      the height target falls from ``carry_height`` at twice that distance);
    - grasp and approach, otherwise, as in :class:`~torchrl_flowpolicy.tasks.robosuite.lift_expert.LiftExpert`: the grip site moves to the
      grasp point, ``grasp_offset`` above a standing can's centre (at the centre of a lying
      one), but ``hover_height`` above it while misaligned (horizontally by more than
      ``align_tolerance``, or by more than ``yaw_tolerance`` in yaw for a lying can, with the
      same linear funnel) or while the fingers are not yet open; within ``grasp_tolerance``
      of the grasp point, or while holding, the gripper closes.

    A can that slips out or falls over is approached again from where it lies: nothing needs
    remembering. Translation and rotation are proportional (``position_gain`` per metre,
    ``rotation_gain`` per radian, clipped to ``[-1, 1]``); the gripper entry is ``-1`` or
    ``+1``. Its success rates and episode lengths are in the module docstring.

    Noise. As for :class:`~torchrl_flowpolicy.tasks.robosuite.lift_expert.LiftExpert`: with ``action_noise > 0``, :meth:`act` adds
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
        >>> from torchrl_flowpolicy.tasks.robosuite.env import RobosuiteGymEnv
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

        ``env`` is a :class:`~torchrl_flowpolicy.tasks.robosuite.env.RobosuiteGymEnv` or a
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
        can_axis = quaternion_to_matrix(observation[..., _CAN["can_quat"]])[..., :, 2]
        hand_rotation = quaternion_to_matrix(observation[..., _CAN["eef_quat"]])
        fingers = observation[..., _CAN["gripper_qpos"]]
        finger_velocity = observation[..., _CAN["gripper_qvel"]]
        opening = fingers[..., 0] - fingers[..., 1]
        closing_speed = finger_velocity[..., 1] - finger_velocity[..., 0]

        # Target orientation: hand z axis down; finger axis along y, or across a lying can.
        lying = np.abs(can_axis[..., 2]) < _UPRIGHT_COS
        hand_yaw = finger_yaw(hand_rotation)
        can_yaw = np.arctan2(can_axis[..., 1], can_axis[..., 0])
        wanted_yaw = np.where(lying, can_yaw, 0.0) + np.pi / 2
        yaw_error = wrap_half_turn(wanted_yaw - hand_yaw)
        rotation_error = downward_rotation_error(hand_rotation, hand_yaw + yaw_error)

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
