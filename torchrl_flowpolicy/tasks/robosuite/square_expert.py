"""The scripted expert of robosuite NutAssemblySquare: :class:`SquareExpert` puts the nut
on its peg.

It picks the square nut up by its handle and lowers it over the square peg from the flat
observation alone (no simulator access, no memory; the peg, fixed in robosuite 1.5's
NutAssemblySquare, is given at construction or read by :meth:`SquareExpert.from_env`), on
any batch of observations;
:class:`~torchrl_flowpolicy.tasks.robosuite.experts.RobosuiteExpertPolicy` runs it in a
TorchRL environment and
:func:`~torchrl_flowpolicy.tasks.robosuite.experts.collect_robosuite_demos` rolls it out into
demonstrations. It shares its grasp geometry and noisy action with
:class:`~torchrl_flowpolicy.tasks.robosuite.can_expert.CanExpert`
(:mod:`~torchrl_flowpolicy.tasks.robosuite.expert_base`).

Measured (SquareExpert, robosuite 1.5.2, 100 episodes with reset seeds 1000-1099, not used
for tuning, which used seeds 0-99; episodes run up to 400 steps; success ends an episode;
``benchmarks/expert_episodes.py --task NutAssemblySquare --action_noise A``):

| action noise | success within 288 / 400 steps | successful episodes' length: mean, median, p90, max |
| --- | --- | --- |
| 0 (clean) | 97 % / 97 % | 89.6, 84, 124, 143 |
| 0.3 | 85 % / 87 % | 145.8, 133, 234, 375 |

Success within other limits: clean: 76 % (100 steps), 84 % (120), 97 % (150); noise 0.3:
18 % (100), 55 % (150), 75 % (200), 85 % (250 and 300; so also at 288). On the tuning seeds
0-99 the clean expert succeeded in all 100 episodes (at most 149 steps), the 0.3-noise one
in 90. The clean failures (3) and most noisy ones run into the time limit with the nut on
the table: dropped beside the peg, leaning on it, or knocked out of reach (a finger landing
on the ring during a noisy approach can hook the nut and drag it). Under noise most of the
extra time goes to the two precise steps: closing on the handle and holding the hole within
6 mm and 0.1 rad of the peg for the few steps of the descent. Noise 0.5 was not measured.

Choice of the horizon,
:data:`~torchrl_flowpolicy.tasks.robosuite.layout.SQUARE_MAX_EPISODE_STEPS` = 288 steps
(14.4 s, 72 decisions of ``H' = 4``), by Lift's and Can's reasoning: about twice the clean
expert's longest episode (143 steps), a multiple of 4; the 0.3-noise expert loses 2 of its
87 successes to it.
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

__all__ = ["SQUARE_PEG_POSITION", "SQUARE_TABLE_HEIGHT", "SquareExpert"]

_SQUARE = OBSERVATION_SLICES["NutAssemblySquare"]

#: The square peg's centre in robosuite 1.5.2's NutAssemblySquare (``peg1`` of its
#: ``PegsArena``: a box of half-sizes 0.016 x 0.016 x 0.1 m, so its top is at z = 0.95 m),
#: world frame, m. :meth:`SquareExpert.from_env` reads it from an environment instead.
SQUARE_PEG_POSITION: tuple[float, float, float] = (0.23, 0.1, 0.85)
#: The table top's height (robosuite's ``table_offset[2]``), m: the nut counts as on the peg
#: with its centre less than 0.05 m above it.
SQUARE_TABLE_HEIGHT = 0.82
# The square nut (robosuite's SquareNutObject): a square ring 0.0875 m wide outside, its hole
# 0.0455 m wide, 0.02 m thick, and a handle 0.032 m wide along the nut's x axis from 0.029 to
# 0.079 m off its centre. The ring's centre is the nut's position.
_RAMP = 0.03  # height over which the carry's horizontal speed ramps up, m
_CLEAR_DISTANCE = 0.12  # horizontal distance from the peg beyond which the nut may move low, m
_RETREAT = 0.12  # height of the grip site above the released nut that it rises to, m
# The nut's yaws (its handle's direction) in which it is put on the peg: towards the robot
# or sideways; pointing away (yaw 0), the hand would be beyond the Panda's reach.
_PLACE_HANDLE_YAWS = (np.pi, np.pi / 2, -np.pi / 2)
# The wrist joint's (joint 7's) range is +-2.8973 rad; a turn of the hand by +a about the
# world's z axis moves it by about -a. Turns that would bring it within this margin of its
# ends are avoided.
_WRIST_LIMIT = 2.8973 - 0.35
# The Panda's base in NutAssemblySquare (x, y), m: moving the hand around it turns the base
# joint, and the wrist joint by as much for a fixed hand yaw.
_ROBOT_BASE = (-0.56, 0.0)


def _wrap_full_turn(angle: np.ndarray) -> np.ndarray:
    """Angles wrapped to ``[-pi, pi)``."""
    return np.mod(angle + np.pi, 2 * np.pi) - np.pi


def _azimuth(position: np.ndarray) -> np.ndarray:
    """The direction ``[...]`` of ``[..., 3]`` positions seen from the robot's base, rad: the
    base joint's angle there, which the wrist joint follows for a fixed hand yaw."""
    return np.arctan2(position[..., 1] - _ROBOT_BASE[1], position[..., 0] - _ROBOT_BASE[0])


def _wrist_feasible_turn(turns: np.ndarray, wrist: np.ndarray) -> np.ndarray:
    """The smallest of the candidate yaw turns ``[..., n]`` that keeps the wrist joint inside
    :data:`_WRIST_LIMIT`, ``wrist`` (``[...]``, rad) being its predicted angle at the target
    without a turn; the one that keeps it farthest inside when none does."""
    after = np.abs(wrist[..., None] - turns)
    cost = np.where(after < _WRIST_LIMIT, np.abs(turns), 10.0 + after)
    return np.take_along_axis(turns, cost.argmin(-1)[..., None], -1)[..., 0]


class SquareExpert(ScriptedExpert):
    """A scripted, stateless pick-and-place controller for robosuite NutAssemblySquare (Panda).

    Like :class:`~torchrl_flowpolicy.tasks.robosuite.can_expert.CanExpert`, each action is a
    function of the current observation only (any leading dimensions, no reset), here the 64 features of
    :data:`~torchrl_flowpolicy.tasks.robosuite.layout.OBSERVATION_SLICES`
    ``["NutAssemblySquare"]``: the nut's absolute position and orientation (``nut_pos``,
    ``nut_quat``; the handle's grasp point is ``handle_offset`` along the nut's x axis; the
    relative ``nut_to_eef_*`` entries read 0 in a reset's observation and are not used), the
    grip site's position, the hand's orientation, the wrist joint's angle and the fingers'
    positions and velocities. The peg is fixed and given at construction (``peg_position``,
    ``table_height``); the defaults are robosuite 1.5.2's, and :meth:`from_env` reads them
    from an environment instead.

    Decisions, in order of priority:

    - orientation, always: the hand points down. Before the nut is carried, the fingers' axis
      lies across the handle (along the nut's y axis; two yaws, half a turn apart). While it
      is carried, the hand turns the nut so that its square hole is square to the peg with
      the handle pointing towards the robot or to either side (the square's symmetry gives
      four yaws; with the handle pointing away the hand would be out of the Panda's reach
      above the peg). Of the candidate turns it takes the smallest one that keeps the wrist
      joint (range +-2.9 rad) 0.35 rad inside its limits at the target, predicting the
      wrist's angle there from the base joint's turn between the hand and the target;
    - release: the nut is around the peg (its centre within ``engage_tolerance`` of the
      peg's axis and less than ``release_height`` above the table, so its hole is below the
      peg's top): open the gripper, then rise; the nut slides down the peg to the table, and
      robosuite's success (the nut's centre within 0.03 m of the peg's axis in x and y, less
      than 0.05 m above the table, the grip site more than 0.042 m from it) follows;
    - carry: the handle is between the fingers (they are neither open, ``open_width``, nor
      shut, ``shut_width``, and the grasp point is within ``hold_tolerance`` of the grip
      site) and they have stopped closing (``still_speed``): lift the nut's centre to
      ``carry_height`` above the table (its bottom then clears the peg's top, 0.13 m), move
      it horizontally towards the peg (gain ``place_gain``, at a speed that ramps up with
      its height from ``clearance_height`` while it is within 0.12 m of the peg), hold it
      ``hover_height_over_peg`` above the table within twice ``place_tolerance`` of the peg,
      and lower it to ``place_height`` once it is within ``place_tolerance`` of the peg's
      axis and ``place_yaw_tolerance`` of square, or once it is around the peg's top (within
      ``engage_tolerance`` and below ``engage_height``);
    - grasp and approach, otherwise, as in
      :class:`~torchrl_flowpolicy.tasks.robosuite.lift_expert.LiftExpert`: the grip site moves
      to the grasp point on the handle (``grasp_offset`` above the nut's centre), but
      ``hover_height`` above it while misaligned (a steep funnel: fully up at 1.5 times
      ``align_tolerance`` horizontally or ``yaw_tolerance`` in yaw, so that no finger lands
      on the ring) or while the fingers are not yet open; within ``grasp_tolerance`` of the
      grasp point, or while holding, the gripper closes.

    A nut that slips out or drops is approached again from where it lies: nothing needs
    remembering. Translation and rotation are proportional (``position_gain``, or
    ``place_gain`` while carrying, per metre; ``rotation_gain`` per radian; clipped to
    ``[-1, 1]``); the gripper entry is ``-1`` or ``+1``. Its success rates and episode
    lengths are in the module docstring.

    Noise. As for :class:`~torchrl_flowpolicy.tasks.robosuite.lift_expert.LiftExpert`: with
    ``action_noise > 0``, :meth:`act` adds ``N(0, action_noise^2)`` to every entry (from the
    expert's generator, seeded with ``seed``) and clips to ``[-1, 1]``;
    :attr:`last_clean_action` keeps the noise-free action.

    Keyword Args:
        action_noise: standard deviation of the Gaussian action noise (0: the clean expert).
        seed: seed of the noise generator.
        peg_position: the square peg's centre ``(x, y, z)``, world frame, m.
        table_height: the table top's height, m.
        handle_offset: distance of the grasp point from the nut's centre along its handle, m
            (the handle runs from 0.029 to 0.079 m; further out than its middle, the fingers
            keep clear of the ring).
        hover_height: height of the grip site above the grasp point while misaligned, m.
        align_tolerance: horizontal grip-site-to-grasp-point distance below which the hand
            goes all the way down, m.
        yaw_tolerance: the same for the fingers' yaw error, rad.
        grasp_offset: height of the grasp point above the nut's centre, m.
        grasp_tolerance: distance (horizontal and vertical) of the grip site from the grasp
            point within which the gripper closes, m.
        hold_tolerance: the same within which closed fingers are taken to hold the handle, m.
        shut_width: finger opening below which the fingers hold nothing, m.
        open_width: finger opening that separates open from closed, m (the handle is 0.032 m
            wide; fully open is about 0.08).
        release_width: finger opening beyond which the released hand rises, m.
        still_speed: closing speed of the fingers below which closing has finished, m/s.
        carry_height: height of the carried nut's centre above the table, m.
        clearance_height: height of the nut's centre above the table from which it starts
            moving sideways near the peg, m.
        place_height: height above the table to which the nut's centre is lowered, m.
        release_height: height above the table below which a nut around the peg is let go, m.
        engage_tolerance: horizontal distance from the peg's axis within which a low nut is
            around the peg, m.
        hover_height_over_peg: height of the nut's centre above the table while it is being
            aligned over the peg, m.
        engage_height: height above the table below which a nut near the peg's axis is around
            its top, m.
        place_tolerance: horizontal distance from the peg's axis within which the nut is
            lowered, m (the hole leaves 6.75 mm on each side of the peg).
        place_yaw_tolerance: the same for the nut's yaw from square, rad.
        place_gain: horizontal carry action per metre of the nut's distance to the peg.
        position_gain: translation action per metre of position error (approach).
        rotation_gain: rotation action per radian of orientation error.

    Examples:
        >>> from torchrl_flowpolicy.tasks.robosuite.env import RobosuiteGymEnv
        >>> env = RobosuiteGymEnv("NutAssemblySquare")
        >>> observation, info = env.reset(seed=0)
        >>> expert = SquareExpert.from_env(env)
        >>> for step in range(env.max_episode_steps):
        ...     observation, reward, terminated, truncated, info = env.step(expert.act(observation))
        ...     if terminated or truncated:
        ...         break
        >>> info["success"]
        True
    """

    observation_slices = _SQUARE

    def __init__(
        self,
        *,
        action_noise: float = 0.0,
        seed: int | None = None,
        peg_position: tuple[float, float, float] = SQUARE_PEG_POSITION,
        table_height: float = SQUARE_TABLE_HEIGHT,
        handle_offset: float = 0.066,
        hover_height: float = 0.06,
        align_tolerance: float = 0.015,
        yaw_tolerance: float = 0.15,
        grasp_offset: float = 0.005,
        grasp_tolerance: float = 0.015,
        hold_tolerance: float = 0.03,
        shut_width: float = 0.015,
        open_width: float = 0.05,
        release_width: float = 0.045,
        still_speed: float = 0.02,
        carry_height: float = 0.17,
        clearance_height: float = 0.13,
        place_height: float = 0.02,
        release_height: float = 0.10,
        engage_tolerance: float = 0.02,
        hover_height_over_peg: float = 0.15,
        place_gain: float = 60.0,
        engage_height: float = 0.135,
        place_tolerance: float = 0.006,
        place_yaw_tolerance: float = 0.1,
        position_gain: float = 150.0,
        rotation_gain: float = 4.0,
    ):
        super().__init__(
            action_noise,
            seed,
            handle_offset=handle_offset,
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
            engage_tolerance=engage_tolerance,
            hover_height_over_peg=hover_height_over_peg,
            place_gain=place_gain,
            engage_height=engage_height,
            place_tolerance=place_tolerance,
            place_yaw_tolerance=place_yaw_tolerance,
            position_gain=position_gain,
            rotation_gain=rotation_gain,
        )
        self.peg_position = np.array(peg_position, dtype=np.float64)
        self.table_height = float(table_height)

    @classmethod
    def from_env(cls, env: Any, **kwargs: Any) -> SquareExpert:
        """The expert for one environment's layout, read once from it.

        ``env`` is a :class:`~torchrl_flowpolicy.tasks.robosuite.env.RobosuiteGymEnv` or a
        robosuite NutAssembly environment: the peg is the simulator's ``peg1`` body (the
        square peg, whose position robosuite's ``on_peg`` tests), the table's height
        ``table_offset[2]``.
        """
        robosuite_env = getattr(env, "robosuite_env", env)
        peg = robosuite_env.sim.data.body_xpos[robosuite_env.peg1_body_id]
        return cls(
            peg_position=tuple(float(value) for value in peg),
            table_height=float(robosuite_env.table_offset[2]),
            **kwargs,
        )

    def clean_action(self, observation: np.ndarray) -> np.ndarray:
        """The noise-free actions, ``[..., 7]`` float64, for ``[..., 64]`` observations."""
        observation = np.asarray(observation, dtype=np.float64)
        if observation.shape[-1:] != (self.observation_dim,):
            raise ValueError(
                f"SquareExpert needs NutAssemblySquare observations of {self.observation_dim} "
                f"features in the last dimension, got shape {observation.shape}."
            )
        nut = observation[..., _SQUARE["nut_pos"]]
        grip = observation[..., _SQUARE["eef_pos"]]
        nut_rotation = quaternion_to_matrix(observation[..., _SQUARE["nut_quat"]])
        hand_rotation = quaternion_to_matrix(observation[..., _SQUARE["eef_quat"]])
        fingers = observation[..., _SQUARE["gripper_qpos"]]
        finger_velocity = observation[..., _SQUARE["gripper_qvel"]]
        opening = fingers[..., 0] - fingers[..., 1]
        closing_speed = finger_velocity[..., 1] - finger_velocity[..., 0]

        handle_axis = nut_rotation[..., :, 0]
        nut_yaw = np.arctan2(handle_axis[..., 1], handle_axis[..., 0])
        grasp_point = nut + self.handle_offset * handle_axis
        grasp_point[..., 2] = nut[..., 2] + self.grasp_offset
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
        to_peg = self.peg_position[:2] - nut[..., :2]
        peg_distance = np.linalg.norm(to_peg, axis=-1)
        height = nut[..., 2] - self.table_height
        placed = (peg_distance < self.engage_tolerance) & (height < self.release_height)
        closing = (in_grasp | holding) & ~placed
        carrying = holding & (closing_speed < self.still_speed) & ~placed

        # Orientation: hand down; fingers across the handle, then the hole square to the peg
        # with the handle towards the robot or sideways (the yaws the arm reaches above the
        # peg), each by the smallest turn that keeps the wrist joint inside its range.
        hand_yaw = finger_yaw(hand_rotation)
        wrist = observation[..., _SQUARE["joint_pos"]][..., 6]
        grasp_turn = wrap_half_turn(nut_yaw + np.pi / 2 - hand_yaw)
        grasp_yaw_error = _wrist_feasible_turn(
            grasp_turn[..., None] + np.pi * np.arange(-2, 3),
            wrist + _azimuth(grasp_point) - _azimuth(grip),
        )
        place_turns = np.stack(
            [_wrap_full_turn(handle_yaw - nut_yaw) for handle_yaw in _PLACE_HANDLE_YAWS], -1
        )
        place_yaw_error = _wrist_feasible_turn(
            (place_turns[..., None] + 2 * np.pi * np.arange(-1, 2)).reshape(
                *place_turns.shape[:-1], -1
            ),
            wrist + _azimuth(self.peg_position) - _azimuth(grip),
        )
        yaw_error = np.where(carrying, place_yaw_error, grasp_yaw_error)
        rotation_error = downward_rotation_error(hand_rotation, hand_yaw + yaw_error)

        # Approach: the funnel above the grasp point.
        misalignment = np.maximum(
            horizontal / self.align_tolerance, np.abs(grasp_yaw_error) / self.yaw_tolerance
        )
        hover = self.hover_height * np.clip(2.0 * (misalignment - 1.0), 0.0, 1.0)
        hover = np.where((opening > self.open_width) | closing, hover, self.hover_height)
        approach_target = grasp_point.copy()
        approach_target[..., 2] += hover
        approach = np.clip(self.position_gain * (approach_target - grip), -1.0, 1.0)

        # Carry: up, over the peg, and down once the hole is over the peg and square to it,
        # or once the nut is around the peg's top.
        aligned = (peg_distance < self.place_tolerance) & (
            np.abs(place_yaw_error) < self.place_yaw_tolerance
        )
        engaged = (peg_distance < self.engage_tolerance) & (height < self.engage_height)
        near = peg_distance < 2 * self.place_tolerance
        target_height = np.where(near, self.hover_height_over_peg, self.carry_height)
        target_height = np.where(aligned | engaged, self.place_height, target_height)
        sideways = np.clip((height - self.clearance_height) / _RAMP, 0.0, 1.0)
        sideways = np.where(
            (peg_distance < 2 * self.place_tolerance) | (peg_distance > _CLEAR_DISTANCE),
            1.0,
            sideways,
        )
        carry = np.empty_like(approach)
        carry[..., :2] = np.clip(self.place_gain * to_peg, -1.0, 1.0) * sideways[..., None]
        carry[..., 2] = np.clip(self.position_gain * (target_height - height), -1.0, 1.0)

        # Release: open, then rise above the nut.
        release = np.zeros_like(approach)
        rise = np.clip(self.position_gain * (nut[..., 2] + _RETREAT - grip[..., 2]), -1.0, 1.0)
        release[..., 2] = np.where(opening > self.release_width, rise, 0.0)

        translation = np.where(carrying[..., None], carry, approach)
        translation = np.where(placed[..., None], release, translation)
        rotation = np.clip(self.rotation_gain * rotation_error, -1.0, 1.0)
        gripper = np.where(closing, 1.0, -1.0)[..., None]
        return np.concatenate([translation, rotation, gripper], axis=-1)
