"""What the robosuite scripted experts share: the hand's geometry and the noisy action.

:class:`ScriptedExpert` is the base of
:class:`~torchrl_flowpolicy.tasks.robosuite.lift_expert.LiftExpert` and
:class:`~torchrl_flowpolicy.tasks.robosuite.can_expert.CanExpert`: validated positive
settings, the Gaussian action noise and :meth:`ScriptedExpert.act`. The functions are the
geometry both use on the flat observation
(:data:`~torchrl_flowpolicy.tasks.robosuite.layout.OBSERVATION_SLICES`),
on arrays with any leading dimensions: quaternions to rotation matrices, the yaw of the
fingers' axis, yaw wrapping, and the orientation error towards a hand pointing down, as
robosuite's OSC controller computes it.

Examples:
    >>> import numpy as np
    >>> down = np.array([1.0, 0.0, 0.0, 0.0])  # a half turn about x: the hand's z axis down
    >>> rotation = quaternion_to_matrix(down)
    >>> rotation[:, 2].tolist(), float(finger_yaw(rotation))  # z axis, y axis' yaw
    ([0.0, 0.0, -1.0], -1.5707963267948966)
    >>> error = downward_rotation_error(rotation, finger_yaw(rotation))  # already there
    >>> bool(np.abs(error).max() < 1e-12)
    True
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "ACTION_DIM",
    "ScriptedExpert",
    "downward_rotation_error",
    "finger_yaw",
    "quaternion_to_matrix",
    "wrap_half_turn",
    "wrap_quarter_turn",
]

#: The Panda's OSC_POSE action: translation (3), rotation (3), gripper (1).
ACTION_DIM = 7


def quaternion_to_matrix(quaternion: np.ndarray) -> np.ndarray:
    """``[..., 4]`` (x, y, z, w) quaternions to ``[..., 3, 3]`` rotation matrices."""
    quaternion = quaternion / np.linalg.norm(quaternion, axis=-1, keepdims=True)
    x, y, z, w = np.moveaxis(quaternion, -1, 0)
    rows = [
        [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
        [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
        [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
    ]
    return np.stack([np.stack(row, axis=-1) for row in rows], axis=-2)


def wrap_quarter_turn(angle: np.ndarray) -> np.ndarray:
    """Angles wrapped to ``[-pi/4, pi/4)`` (a square's yaw is defined modulo 90 degrees)."""
    return np.mod(angle + np.pi / 4, np.pi / 2) - np.pi / 4


def wrap_half_turn(angle: np.ndarray) -> np.ndarray:
    """Angles wrapped to ``[-pi/2, pi/2)`` (the gripper's yaw is defined modulo 180 degrees)."""
    return np.mod(angle + np.pi / 2, np.pi) - np.pi / 2


def finger_yaw(hand_rotation: np.ndarray) -> np.ndarray:
    """The world yaw of the fingers' axis (the hand's y axis), ``[...]``, of ``[..., 3, 3]``
    hand rotations."""
    finger_axis = hand_rotation[..., :, 1]
    return np.arctan2(finger_axis[..., 1], finger_axis[..., 0])


def downward_rotation_error(hand_rotation: np.ndarray, target_yaw: np.ndarray) -> np.ndarray:
    """The orientation error ``[..., 3]`` from ``[..., 3, 3]`` hand rotations to the hand
    pointing down (its z axis along the world's -z) with its fingers' axis at ``target_yaw``.

    The small-angle error robosuite's OSC computes (world frame): half the sum of the cross
    products of the current and target axes.
    """
    zeros, ones = np.zeros_like(target_yaw), np.ones_like(target_yaw)
    target_y = np.stack([np.cos(target_yaw), np.sin(target_yaw), zeros], -1)
    target_z = np.stack([zeros, zeros, -ones], -1)
    target_x = np.cross(target_y, target_z)
    target_rotation = np.stack([target_x, target_y, target_z], -1)
    return 0.5 * np.cross(hand_rotation, target_rotation, axis=-2).sum(-1)


class ScriptedExpert:
    """What the scripted experts share: validated positive settings, the action noise and
    :meth:`act`.

    A subclass sets ``observation_slices`` (its task's entry of
    :data:`~torchrl_flowpolicy.tasks.robosuite.layout.OBSERVATION_SLICES`) and defines
    :meth:`clean_action`; its keyword settings become attributes of the same names.

    Args:
        action_noise: standard deviation of the Gaussian action noise (0: the clean expert).
        seed: seed of the noise generator.
        **settings: the subclass's settings (tolerances, gains, ...), each positive.
    """

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
        """The noise-free actions, ``[..., 7]``, for ``[..., O]`` observations (a subclass's)."""
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
