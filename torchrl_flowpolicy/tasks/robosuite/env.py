"""robosuite manipulation tasks (Lift, PickPlaceCan, NutAssemblySquare) as gymnasium and
TorchRL environments.

:class:`RobosuiteGymEnv` adapts one robosuite task to gymnasium; :func:`make_robosuite_env`
batches it (:class:`~torchrl_flowpolicy.envs.BatchedGymEnv`) and optionally chunks it, like
:func:`~torchrl_flowpolicy.tasks.make_pusher_env`. The tasks' specifications and the
observation layout (:data:`TASKS`, :data:`OBSERVATION_SLICES`, re-exported here) live in
:mod:`~torchrl_flowpolicy.tasks.robosuite.layout`, the scripted experts in
:mod:`~torchrl_flowpolicy.tasks.robosuite.lift_expert`,
:mod:`~torchrl_flowpolicy.tasks.robosuite.can_expert` and
:mod:`~torchrl_flowpolicy.tasks.robosuite.square_expert`, and running them as policies and
demonstrations in :mod:`~torchrl_flowpolicy.tasks.robosuite.experts`. robosuite is an
optional dependency
(``pip install torchrl_flowpolicy[robosuite]``), imported only when an environment is built.

Why not robosuite's ``GymWrapper`` behind TorchRL's ``GymWrapper``: there the horizon ends an
episode as *terminated* (GAE must bootstrap there: it is a *truncation*), ``reset(seed=...)``
only seeds ``np.random``, which robosuite 1.5 never reads (its initial states come from the
environment's own ``env.rng`` and the placement sampler's ``rng``), and no step reports
success. Here robosuite never ends an episode (``ignore_done=True``); our own step counter
truncates it, the task's own ``_check_success()`` terminates it, and ``reset(seed=s)``
installs ``np.random.default_rng(s)`` (gymnasium's ``self.np_random``) as ``env.rng`` and as
the ``rng`` of every placement sampler, so the same seed gives the same initial state, bit
for bit (robot joint noise, object position and yaw; NutAssemblySquare's
``SequentialCompositeSampler`` holds one sampler per nut, both get it, and it draws the
round nut's placement too before moving that nut out of the scene).

Task facts (robosuite 1.5.2, MuJoCo 3.9.0, robot ``"Panda"``, the default controller):

- Action: 7 numbers in ``[-1, 1]`` (robosuite clips). ``[0:3]`` end-effector translation and
  ``[3:6]`` rotation (axis-angle), deltas in the robot base frame (aligned with the world),
  scaled by 0.05 m and 0.5 rad per step (OSC_POSE, kp 150: a held full action moves the hand
  about 0.012 m per step, 0.23 m/s); ``[6]`` the gripper by its sign only: each step moves an
  internal command by 0.2 towards closed (``> 0``) or open (``< 0``), so opening or closing
  fully takes 5-10 steps and this command is state that the observation does not show
  (only the fingers' positions and velocities). Control at 20 Hz (25 physics steps of 2 ms).
- Lift, PickPlaceCan and NutAssemblySquare: their objects, initial states and success tests
  are in :mod:`~torchrl_flowpolicy.tasks.robosuite.layout`.

Rewards (``reward``): ``"success"`` gives 1.0 on the step where ``_check_success()`` first
holds, else 0 (an episode's return is its success). ``"shaped"`` is robosuite's own staged
reward (``reward_shaping=True``, ``reward_scale=1``): for Lift, ``(1 - tanh(10 d) + 0.25
grasping) / 2.25`` before success (``d`` the gripper-cube distance; at most 0.56) and 1.0 on
every step where the cube is lifted.

Measured here (Lift, one process on one core, no rendering): an environment step costs
3.3-3.8 ms, about 270 steps/s for the bare simulator and 264 (``N = 1``) to 280 (``N = 8``,
chunked or not) environment steps/s through :func:`make_robosuite_env` with random actions; a
reset costs about 1 ms (a hard reset, which rebuilds the simulation, about 90 ms); building
an environment about 1 s the first time in a process, 0.1 s after; an offscreen 256x256 frame
40-45 ms. The default horizons (:data:`DEFAULT_MAX_EPISODE_STEPS` = 60 steps, 3 s, for Lift;
:data:`CAN_MAX_EPISODE_STEPS` = 250 steps, 12.5 s, for PickPlaceCan;
:data:`SQUARE_MAX_EPISODE_STEPS` = 288 steps, 14.4 s, for NutAssemblySquare) and the scripted
experts' success rates and episode lengths are in
:mod:`~torchrl_flowpolicy.tasks.robosuite.lift_expert`,
:mod:`~torchrl_flowpolicy.tasks.robosuite.can_expert` and
:mod:`~torchrl_flowpolicy.tasks.robosuite.square_expert`: the clean experts lift the cube in 24 steps on average (at most 29), place the can in 96
(at most 120) and put the nut on its peg in 90 (at most 143, in 97 % of the episodes);
uniform random actions never lift the cube or place the can (not measured for the nut).

robosuite's own log (its import's warnings about macros and optional robot models, one
"Loading controller configuration" per simulator) is quiet: only its errors are shown. Set
the environment variable ``TORCHRL_FLOWPOLICY_ROBOSUITE_LOG_LEVEL`` to a level name (e.g.
``INFO`` or ``WARNING``) to see its records from that level up
(:mod:`~torchrl_flowpolicy.tasks.robosuite.quiet_logging`; collector processes inherit it).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDictBase
from torchrl.data import Binary, Composite
from torchrl.envs import GymWrapper, TransformedEnv
from torchrl.envs.gym_like import BaseInfoDictReader

from torchrl_flowpolicy.envs.batched import BatchedGymEnv
from torchrl_flowpolicy.envs.chunking import make_chunked_env
from torchrl_flowpolicy.tasks.robosuite.layout import (
    CAN_MAX_EPISODE_STEPS,
    DEFAULT_MAX_EPISODE_STEPS,
    OBSERVATION_SLICES,
    PROPRIO_SLICES,
    REWARD_MODES,
    SQUARE_MAX_EPISODE_STEPS,
    TASKS,
    RewardMode,
    RobosuiteTask,
    get_robosuite_task,
)
from torchrl_flowpolicy.tasks.robosuite.quiet_logging import quiet_robosuite_logging

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
    "RobosuiteGymEnv",
    "make_robosuite_env",
]

# Arguments this module sets itself; passing them through **robosuite_kwargs is an error.
_RESERVED = {
    "env_name": "task",
    "robots": "(Panda only)",
    "horizon": "max_episode_steps",
    "ignore_done": "max_episode_steps",
    "reward_shaping": "reward",
    "use_camera_obs": "(state observations only)",
    "has_renderer": "render_mode",
    "has_offscreen_renderer": "render_mode",
    "seed": "reset(seed=...) and model_seed",
}


class RobosuiteGymEnv(gym.Env):
    """One robosuite task as a gymnasium environment with a flat float32 observation.

    Observation: ``object-state`` then ``robot0_proprio-state``, float32 (60 features for
    Lift; :data:`OBSERVATION_SLICES`). Action: the 7 inputs of the default Panda controller in
    ``[-1, 1]`` (module docstring). ``info["success"]`` is the task's ``_check_success()``
    after every step (and at the reset).

    Episodes: ``terminated`` is set on the first successful step when
    ``terminate_on_success``, never otherwise; ``truncated`` when the ``max_episode_steps``-th
    step ends an episode that did not terminate. robosuite itself never ends one. Stepping
    after the end (without a reset) is an error.

    Seeding: ``reset(seed=s)`` makes gymnasium's ``self.np_random`` from ``s`` and hands that
    generator to robosuite (the environment's ``rng`` and every placement sampler's), so equal
    seeds give bit-identical initial states; later resets without a seed continue the stream.
    The first reset without a seed draws fresh entropy (as gymnasium does). ``model_seed``
    fixes the random properties of the model drawn once at construction (the cube's size).

    Args:
        task: ``"Lift"``, ``"PickPlaceCan"`` or ``"NutAssemblySquare"`` (:data:`TASKS`).

    Keyword Args:
        max_episode_steps: the time limit, in steps of 0.05 s (``None``: the task's,
            :attr:`RobosuiteTask.max_episode_steps`: 60 for Lift, 250 for PickPlaceCan,
            :data:`SQUARE_MAX_EPISODE_STEPS` for NutAssemblySquare).
        reward: ``"success"`` (1.0 on the first successful step) or ``"shaped"``
            (robosuite's staged reward; module docstring).
        terminate_on_success: whether success ends the episode (``terminated=True``).
        render_mode: ``None`` or ``"rgb_array"`` (offscreen, e.g. ``MUJOCO_GL=egl``).
        camera_name: the camera :meth:`render` uses (e.g. ``"frontview"``, ``"agentview"``).
        render_height: frame height, pixels.
        render_width: frame width, pixels.
        hard_reset: robosuite's ``hard_reset`` (rebuild the simulation at every reset, which
            also redraws Lift's cube size: about 90 ms instead of 1 ms; off by default).
        model_seed: seed of robosuite's generator at construction (the model's sizes).
        **robosuite_kwargs: further ``robosuite.make`` arguments (e.g. ``reward_scale``,
            ``controller_configs``, ``initialization_noise``).

    Examples:
        >>> env = RobosuiteGymEnv("Lift", max_episode_steps=3)
        >>> observation, info = env.reset(seed=0)
        >>> observation.shape, observation.dtype, info["success"]
        ((60,), dtype('float32'), False)
        >>> for _ in range(3):
        ...     observation, reward, terminated, truncated, info = env.step(env.action_space.sample())
        >>> terminated, truncated
        (False, True)
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 20}

    def __init__(
        self,
        task: str = "Lift",
        *,
        max_episode_steps: int | None = None,
        reward: RewardMode = "success",
        terminate_on_success: bool = True,
        render_mode: Literal["rgb_array"] | None = None,
        camera_name: str = "frontview",
        render_height: int = 256,
        render_width: int = 256,
        hard_reset: bool = False,
        model_seed: int = 0,
        **robosuite_kwargs: Any,
    ):
        spec = get_robosuite_task(task)
        if max_episode_steps is None:
            max_episode_steps = spec.max_episode_steps
        if reward not in REWARD_MODES:
            raise ValueError(f"reward must be one of {REWARD_MODES}, got {reward!r}.")
        if max_episode_steps < 1:
            raise ValueError(f"max_episode_steps must be >= 1, got {max_episode_steps}.")
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode must be None or 'rgb_array', got {render_mode!r}.")
        if render_height < 1 or render_width < 1:
            raise ValueError(
                f"render_height and render_width must be >= 1, got {render_height}, {render_width}."
            )
        reserved = sorted(set(robosuite_kwargs) & set(_RESERVED))
        if reserved:
            raise ValueError(
                f"robosuite arguments {reserved} are set by RobosuiteGymEnv; use "
                f"{[_RESERVED[name] for name in reserved]} instead."
            )
        quiet_robosuite_logging()
        try:
            import robosuite
        except ImportError as error:  # pragma: no cover - depends on the installation
            raise ImportError(
                "RobosuiteGymEnv needs robosuite: pip install 'torchrl_flowpolicy[robosuite]'."
            ) from error

        self.task = task
        self.max_episode_steps = int(max_episode_steps)
        self.reward_mode = reward
        self.terminate_on_success = bool(terminate_on_success)
        self.render_mode = render_mode
        self.camera_name = camera_name
        self.render_height = int(render_height)
        self.render_width = int(render_width)
        self.observation_slices = spec.observation_slices

        self.robosuite_env = robosuite.make(
            spec.env_name,
            robots="Panda",
            use_camera_obs=False,
            has_renderer=False,
            has_offscreen_renderer=render_mode == "rgb_array",
            reward_shaping=reward == "shaped",
            horizon=10**9,
            ignore_done=True,
            hard_reset=hard_reset,
            control_freq=robosuite_kwargs.pop("control_freq", 20),
            seed=model_seed,
            **spec.make_kwargs,
            **robosuite_kwargs,
        )
        if render_mode == "rgb_array":
            cameras = self.robosuite_env.sim.model.camera_names
            if camera_name not in cameras:
                raise ValueError(f"unknown camera_name {camera_name!r}: use one of {cameras}.")
        low, high = self.robosuite_env.action_spec
        self.action_space = gym.spaces.Box(
            low.astype(np.float32), high.astype(np.float32), dtype=np.float32
        )
        observation = self._flatten(self.robosuite_env._get_observations(force_update=True))
        if observation.shape != (spec.observation_dim,):
            raise RuntimeError(
                f"robosuite's {task} observation has {observation.shape[0]} features, this "
                f"module's layout {spec.observation_dim}: a different robosuite version?"
            )
        self.observation_space = gym.spaces.Box(
            -np.inf, np.inf, shape=observation.shape, dtype=np.float32
        )
        self._steps = 0
        self._succeeded = False
        self._episode_over = True  # until the first reset
        self._seeded = False

    # ------------------------------------------------------------------ gymnasium API
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        if seed is not None or not self._seeded:
            self._install_generator(self.np_random)
            self._seeded = True
        observation = self._flatten(self.robosuite_env.reset())
        self._steps = 0
        self._succeeded = bool(self.robosuite_env._check_success())
        self._episode_over = False
        return observation, {"success": self._succeeded}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self._episode_over:
            raise RuntimeError(
                "RobosuiteGymEnv.step called after the episode ended (or before the first "
                "reset): call reset() first."
            )
        action = np.asarray(action, dtype=np.float64)
        if action.shape != self.action_space.shape:
            raise ValueError(
                f"action must have shape {self.action_space.shape}, got {action.shape}."
            )
        if not np.isfinite(action).all():
            raise ValueError(f"action must be finite, got {action}.")
        observation, robosuite_reward, _, _ = self.robosuite_env.step(action)
        self._steps += 1
        success = bool(self.robosuite_env._check_success())
        if self.reward_mode == "success":
            reward = 1.0 if success and not self._succeeded else 0.0
        else:
            reward = float(robosuite_reward)
        self._succeeded = self._succeeded or success
        terminated = success and self.terminate_on_success
        truncated = not terminated and self._steps >= self.max_episode_steps
        self._episode_over = terminated or truncated
        return self._flatten(observation), reward, terminated, truncated, {"success": success}

    def render(self) -> np.ndarray:
        """The current frame, ``[render_height, render_width, 3]`` uint8, upright."""
        if self.render_mode != "rgb_array":
            raise RuntimeError(
                "RobosuiteGymEnv.render needs render_mode='rgb_array' at construction."
            )
        frame = self.robosuite_env.sim.render(
            camera_name=self.camera_name, width=self.render_width, height=self.render_height
        )
        # MuJoCo's offscreen buffer starts at the bottom row (OpenGL): flip it upright.
        return np.ascontiguousarray(frame[::-1])

    def close(self) -> None:
        self.robosuite_env.close()

    # ------------------------------------------------------------------ helpers
    def check_success(self) -> bool:
        """The task's own success test on the current state (``_check_success()``)."""
        return bool(self.robosuite_env._check_success())

    def _flatten(self, observations: Mapping[str, np.ndarray]) -> np.ndarray:
        return np.concatenate(
            [observations["object-state"], observations["robot0_proprio-state"]]
        ).astype(np.float32)

    def _install_generator(self, generator: np.random.Generator) -> None:
        """Make robosuite draw its initial states from ``generator``.

        robosuite 1.5 draws the robot's joint noise from ``env.rng`` at each reset (read
        there) and object placements from the placement sampler's ``rng`` (a reference to
        ``env.rng`` taken when the sampler was made; a ``SequentialCompositeSampler`` holds
        one per sub-sampler).
        """
        env = self.robosuite_env
        env.rng = generator
        pending = [getattr(env, "placement_initializer", None)]
        while pending:
            sampler = pending.pop()
            if sampler is None:
                continue
            sampler.rng = generator
            pending.extend(getattr(sampler, "samplers", {}).values())


class _SuccessReader(BaseInfoDictReader):
    """Writes ``info["success"]`` as a ``[1]`` bool entry (False when absent, e.g. at reset)."""

    def __call__(self, info_dict: dict[str, Any], tensordict: TensorDictBase) -> TensorDictBase:
        success = bool(info_dict.get("success", False))
        tensordict.set("success", torch.tensor([success], device=tensordict.device))
        return tensordict

    @property
    def info_spec(self) -> Composite:
        return Composite(success=Binary(n=1, shape=(1,), dtype=torch.bool), shape=())


def make_robosuite_env(
    num_envs: int | None = None,
    executed_chunk_length: int | None = None,
    *,
    task: str = "Lift",
    max_episode_steps: int | None = None,
    reward: RewardMode = "success",
    terminate_on_success: bool = True,
    device: str | torch.device | None = None,
    group_size: int = 1,
    **robosuite_kwargs: Any,
) -> TransformedEnv:
    """A robosuite task as a TorchRL environment: one, or a batch, chunked or not.

    - ``num_envs=None``: one :class:`RobosuiteGymEnv` behind TorchRL's
      :class:`~torchrl.envs.GymWrapper` (``"success"`` read from ``info``); batch shape ``[]``.
    - ``num_envs=N``: :class:`~torchrl_flowpolicy.envs.BatchedGymEnv` of ``N`` of them (built
      from a picklable factory, ``info_keys=("success",)``); batch shape ``[N]``.

    Entries: ``"observation"`` (float32, :data:`OBSERVATION_SLICES`), ``"success"`` (``[*B,
    1]`` bool), ``"reward"``, ``"done"`` / ``"terminated"`` / ``"truncated"``. With
    ``executed_chunk_length`` given, :func:`~torchrl_flowpolicy.envs.make_chunked_env` is
    appended: each step executes ``H'`` actions (``"action"`` ``[*B, H', 7]``), the reward is
    their sum, and a chunk stops at the first done, so ``"success"`` is the last executed
    step's.

    Args:
        num_envs: ``None`` for one environment, or the batch size ``N``.
        executed_chunk_length: ``H'``, the number of actions executed per step, or ``None``
            for one action per step.

    Keyword Args:
        task: ``"Lift"``, ``"PickPlaceCan"`` or ``"NutAssemblySquare"``.
        max_episode_steps: the time limit (truncation), in environment steps (``None``: the
            task's, :attr:`RobosuiteTask.max_episode_steps`).
        reward: ``"success"`` or ``"shaped"`` (:class:`RobosuiteGymEnv`).
        terminate_on_success: whether success ends the episode (``terminated``).
        device: the TorchRL device of the environment.
        group_size: a batch's sub-environments per seeding group
            (:class:`~torchrl_flowpolicy.envs.BatchedGymEnv`; default 1).
        **robosuite_kwargs: forwarded to :class:`RobosuiteGymEnv` (``render_mode``,
            ``camera_name``, robosuite arguments, ...).

    Returns:
        The transformed environment; seed it with ``env.set_seed(seed)`` (a batch seeds
        sub-environment ``i`` with ``seed + i // group_size``).

    Examples:
        >>> env = make_robosuite_env(2, executed_chunk_length=4, max_episode_steps=8)
        >>> rollout = env.rollout(3)  # the time limit ends it after 2 decisions
        >>> rollout["action"].shape, rollout["next", "success"].shape
        (torch.Size([2, 2, 4, 7]), torch.Size([2, 2, 1]))
    """
    spec = get_robosuite_task(task)
    if max_episode_steps is None:
        max_episode_steps = spec.max_episode_steps
    if reward not in REWARD_MODES:
        raise ValueError(f"reward must be one of {REWARD_MODES}, got {reward!r}.")
    if max_episode_steps < 1:
        raise ValueError(f"max_episode_steps must be >= 1, got {max_episode_steps}.")
    factory = functools.partial(
        RobosuiteGymEnv,
        task,
        max_episode_steps=max_episode_steps,
        reward=reward,
        terminate_on_success=terminate_on_success,
        **robosuite_kwargs,
    )
    if num_envs is None and group_size != 1:
        raise ValueError(f"group_size={group_size} needs a batch (num_envs); got num_envs=None.")
    if num_envs is None:
        base = GymWrapper(factory(), device=device)
        base.set_info_dict_reader(_SuccessReader())
    else:
        base = BatchedGymEnv(
            factory, num_envs, info_keys=("success",), device=device, group_size=group_size
        )
    env = TransformedEnv(base)
    if executed_chunk_length is not None:
        env = make_chunked_env(env, executed_chunk_length)
    return env
