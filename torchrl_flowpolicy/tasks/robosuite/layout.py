"""The robosuite tasks' specifications and flat observation layout, without the simulator.

:data:`TASKS` holds one :class:`RobosuiteTask` per task (robosuite's environment name, its
``object-state`` entries, its default horizon); :data:`OBSERVATION_SLICES` names the slices
of the flat observation (``object-state`` then the Panda's ``robot0_proprio-state``,
:data:`PROPRIO_SLICES`) that :class:`~torchrl_flowpolicy.tasks.robosuite.env.RobosuiteGymEnv`
builds and the scripted experts read. Nothing here imports robosuite or gymnasium; the
controller's facts (the action) are in :mod:`~torchrl_flowpolicy.tasks.robosuite.env`.

Task facts (robosuite 1.5.2, MuJoCo 3.9.0, robot ``"Panda"``):

- Lift: a cube with half-sizes drawn once per environment in ``[0.020, 0.022]`` m (from
  ``model_seed``; no hard reset, so they stay), placed uniformly in ``+-3`` cm around the
  table centre with a uniform yaw; the arm starts at the same posture plus 0.02 rad Gaussian
  joint noise, the grip site 0.17-0.20 m above the cube. Success (``_check_success``): the cube's
  centre is more than 0.04 m above the table top (z = 0.8 m), i.e. lifted by about 2 cm.
- PickPlaceCan: a can (radius 0.025 m, 0.08 m tall, 16 g) stands in bin 1 (centred at
  ``(0.1, -0.25)``, floor top at z = 0.82 m, walls up to z = 0.9 m), its centre uniform in
  ``x in [-0.02, 0.22]``, ``y in [-0.42, -0.08]`` with a uniform yaw, the other three objects
  of PickPlace moved out of the scene. It must go into its compartment of bin 2, the quarter
  ``x in (0.1, 0.295)``, ``y in (0.28, 0.525)`` behind dividers 0.02 m thick. Success
  (``_check_success``): the can's centre in that compartment less than 0.1 m above the bin
  (z < 0.9 m) and the grip site more than 0.042 m from it (let go). The robot's base is at
  ``(-0.5, -0.1)``: with the hand pointing down the compartment's centre is out of reach (the
  hand stops about 9 cm short of it at z = 0.9 m), its corner nearest the robot is not. The
  can's relative entries (``can_to_eef_*``, its pose in the hand frame) read 0 in a reset's
  observation (robosuite computes them from a cache that is empty then); the absolute ones
  are right.
- NutAssemblySquare: a square nut (a square ring 0.0875 m wide outside with a 0.0455 m hole,
  0.02 m thick, about 16 g, and a handle 0.032 m wide along its x axis from 0.029 to 0.079 m
  off its centre) lies flat on the table, its centre uniform in ``x in [-0.115, -0.11]``,
  ``y in [0.11, 0.225]`` with a uniform yaw (the round nut is placed too, from the same
  generator, then moved out of the scene). The square peg (``peg1``, 0.032 m square, 0.2 m
  tall: its top at z = 0.95 m) stands at ``(0.23, 0.1)``, the table top at z = 0.82 m.
  Success (``_check_success``): the nut's centre within 0.03 m of the peg's axis in x and y
  and less than 0.05 m above the table (so around the peg), and the grip site more than
  0.042 m from it (the handle's middle is 0.054 m away, so a nut still held counts). The
  robot's base is at ``(-0.56, 0)``: with the handle pointing away from the robot, the hand
  above the peg is out of reach. The relative entries (``nut_to_eef_*``) read 0 in a reset's
  observation, as Can's.

Examples:
    >>> OBSERVATION_SLICES["Lift"]["cube_pos"], OBSERVATION_SLICES["Lift"]["eef_pos"]
    (slice(0, 3, None), slice(45, 48, None))
    >>> get_robosuite_task("PickPlaceCan").observation_dim, TASKS["Lift"].max_episode_steps
    (64, 60)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "CAN_MAX_EPISODE_STEPS",
    "DEFAULT_MAX_EPISODE_STEPS",
    "OBSERVATION_SLICES",
    "PROPRIO_SLICES",
    "REWARD_MODES",
    "SQUARE_MAX_EPISODE_STEPS",
    "TASKS",
    "RewardMode",
    "RobosuiteTask",
    "get_robosuite_task",
]

RewardMode = Literal["success", "shaped"]
REWARD_MODES: tuple[RewardMode, ...] = ("success", "shaped")

# Lift's horizon (the default task's), PickPlaceCan's and NutAssemblySquare's, chosen from
# their experts' measured episode lengths: see the docstrings of lift_expert, can_expert and
# square_expert. Each task has its own (RobosuiteTask.max_episode_steps). NutAssemblySquare's:
# about twice the clean expert's longest episode on the unseen seeds (143 steps), a multiple
# of 4 (72 decisions of H' = 4 executed actions).
DEFAULT_MAX_EPISODE_STEPS = 60
CAN_MAX_EPISODE_STEPS = 250
SQUARE_MAX_EPISODE_STEPS = 288

#: ``robot0_proprio-state`` of the Panda (50 features), relative to its start.
PROPRIO_SLICES: dict[str, slice] = {
    "joint_pos": slice(0, 7),  # arm joint angles, rad
    "joint_pos_cos": slice(7, 14),
    "joint_pos_sin": slice(14, 21),
    "joint_vel": slice(21, 28),  # rad/s
    "joint_acc": slice(28, 35),  # rad/s^2
    "eef_pos": slice(35, 38),  # grip site (between the finger pads), world frame, m
    # Hand orientation, (x, y, z, w): its z axis points along the fingers, y between them.
    "eef_quat": slice(38, 42),
    "eef_quat_site": slice(42, 46),  # grip site orientation, (x, y, z, w)
    "gripper_qpos": slice(46, 48),  # finger joints, m (about +-0.04 open, +-0.001 shut)
    "gripper_qvel": slice(48, 50),  # finger joint velocities, m/s
}


def _shifted(slices: Mapping[str, slice], offset: int) -> dict[str, slice]:
    return {name: slice(s.start + offset, s.stop + offset) for name, s in slices.items()}


@dataclass(frozen=True)
class RobosuiteTask:
    """One robosuite task as this module builds it.

    Attributes:
        env_name: robosuite's environment name (``robosuite.make``'s first argument).
        object_slices: the ``object-state`` entries, in robosuite's order, and their slices.
        make_kwargs: further fixed arguments of ``robosuite.make``.
        max_episode_steps: the task's default time limit, in environment steps (chosen from
            its scripted expert's episode lengths: see
            :mod:`~torchrl_flowpolicy.tasks.robosuite.lift_expert`,
            :mod:`~torchrl_flowpolicy.tasks.robosuite.can_expert` and
            :mod:`~torchrl_flowpolicy.tasks.robosuite.square_expert`).
    """

    env_name: str
    object_slices: dict[str, slice]
    make_kwargs: dict[str, Any] = field(default_factory=dict)
    max_episode_steps: int = DEFAULT_MAX_EPISODE_STEPS

    @property
    def object_dim(self) -> int:
        return max(s.stop for s in self.object_slices.values())

    @property
    def observation_slices(self) -> dict[str, slice]:
        """The flat observation's slices: ``object-state`` then ``robot0_proprio-state``."""
        return {**self.object_slices, **_shifted(PROPRIO_SLICES, self.object_dim)}

    @property
    def observation_dim(self) -> int:
        return self.object_dim + 50


TASKS: dict[str, RobosuiteTask] = {
    "Lift": RobosuiteTask(
        env_name="Lift",
        object_slices={
            "cube_pos": slice(0, 3),  # cube centre, world frame, m
            "cube_quat": slice(3, 7),  # (x, y, z, w)
            "gripper_to_cube_pos": slice(7, 10),  # cube_pos - eef_pos, m
        },
    ),
    # robosuite's PickPlaceCan is PickPlace(single_object_mode=2, object_type="can").
    "PickPlaceCan": RobosuiteTask(
        env_name="PickPlaceCan",
        object_slices={
            "can_to_eef_pos": slice(0, 3),  # the can's position in the hand frame (0 at reset)
            "can_to_eef_quat": slice(3, 7),  # its orientation in the hand frame (0 at reset)
            "can_pos": slice(7, 10),  # world frame, m
            "can_quat": slice(10, 14),  # (x, y, z, w)
        },
        max_episode_steps=CAN_MAX_EPISODE_STEPS,
    ),
    # robosuite's NutAssemblySquare is NutAssembly(single_object_mode=2, nut_type="square").
    "NutAssemblySquare": RobosuiteTask(
        env_name="NutAssemblySquare",
        object_slices={
            "nut_to_eef_pos": slice(0, 3),  # the nut's position in the hand frame (0 at reset)
            "nut_to_eef_quat": slice(3, 7),  # its orientation in the hand frame (0 at reset)
            "nut_pos": slice(7, 10),  # the ring's centre, world frame, m
            "nut_quat": slice(10, 14),  # (x, y, z, w); the handle along the nut's x axis
        },
        max_episode_steps=SQUARE_MAX_EPISODE_STEPS,
    ),
}

#: The flat observation's slices per task (``TASKS[task].observation_slices``). Lift's 60:
#: ``cube_pos [0:3]``, ``cube_quat [3:7]``, ``gripper_to_cube_pos [7:10]``, then the
#: proprio-state shifted by 10: ``joint_pos [10:17]``, ``joint_pos_cos [17:24]``,
#: ``joint_pos_sin [24:31]``, ``joint_vel [31:38]``, ``joint_acc [38:45]``,
#: ``eef_pos [45:48]``, ``eef_quat [48:52]``, ``eef_quat_site [52:56]``,
#: ``gripper_qpos [56:58]``, ``gripper_qvel [58:60]``.
OBSERVATION_SLICES: dict[str, dict[str, slice]] = {
    name: task.observation_slices for name, task in TASKS.items()
}


def get_robosuite_task(task: str) -> RobosuiteTask:
    """The :class:`RobosuiteTask` named ``task`` (a key of :data:`TASKS`), or a clear error.

    Examples:
        >>> get_robosuite_task("Lift").env_name
        'Lift'
    """
    if task not in TASKS:
        raise ValueError(f"unknown robosuite task {task!r}: use one of {sorted(TASKS)}.")
    return TASKS[task]
