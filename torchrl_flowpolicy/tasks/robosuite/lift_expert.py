"""The scripted expert of robosuite Lift: :class:`LiftExpert` picks up the cube.

It acts from the flat observation alone (no simulator access, no memory), on any batch of
observations; :class:`~torchrl_flowpolicy.tasks.robosuite.experts.RobosuiteExpertPolicy` runs
it in a TorchRL environment and
:func:`~torchrl_flowpolicy.tasks.robosuite.experts.collect_robosuite_demos` rolls it out into
demonstrations.

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
:data:`~torchrl_flowpolicy.tasks.robosuite.layout.DEFAULT_MAX_EPISODE_STEPS` = 60 steps (3 s,
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

from typing import Any

import numpy as np

from torchrl_flowpolicy.tasks.robosuite.expert_base import (
    ScriptedExpert,
    downward_rotation_error,
    finger_yaw,
    quaternion_to_matrix,
    wrap_quarter_turn,
)
from torchrl_flowpolicy.tasks.robosuite.layout import OBSERVATION_SLICES

__all__ = ["LiftExpert"]

_LIFT = OBSERVATION_SLICES["Lift"]


class LiftExpert(ScriptedExpert):
    """A scripted, stateless grasp-and-lift controller for robosuite Lift (Panda, OSC_POSE).

    Each action is a function of the current observation only, so one expert serves a whole
    batch of environments (any leading dimensions) and needs no reset. From the observation
    (:data:`~torchrl_flowpolicy.tasks.robosuite.layout.OBSERVATION_SLICES`) it reads the cube's
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
        >>> from torchrl_flowpolicy.tasks.robosuite.env import RobosuiteGymEnv
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
        """The expert for ``env``: Lift needs nothing from it (the interface of
        :meth:`~torchrl_flowpolicy.tasks.robosuite.can_expert.CanExpert.from_env`)."""
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
        cube_rotation = quaternion_to_matrix(observation[..., _LIFT["cube_quat"]])
        hand_rotation = quaternion_to_matrix(observation[..., _LIFT["eef_quat"]])
        fingers = observation[..., _LIFT["gripper_qpos"]]
        finger_velocity = observation[..., _LIFT["gripper_qvel"]]
        opening = fingers[..., 0] - fingers[..., 1]
        # The rate at which the fingers close: a sideways jolt of the hand moves both fingers
        # the same way (it cancels here), squeezing moves them against each other.
        closing_speed = finger_velocity[..., 1] - finger_velocity[..., 0]

        # Target orientation: hand z axis down, finger axis (hand y) along a cube face normal.
        cube_yaw = np.arctan2(cube_rotation[..., 1, 0], cube_rotation[..., 0, 0])
        hand_yaw = finger_yaw(hand_rotation)
        yaw_error = wrap_quarter_turn(cube_yaw - hand_yaw)
        rotation_error = downward_rotation_error(hand_rotation, hand_yaw + yaw_error)

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
