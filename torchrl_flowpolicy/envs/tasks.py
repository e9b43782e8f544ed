"""The tasks the examples train on, by name: ``"pusher"`` (the default), ``"lift"``, ``"can"``.

A :class:`Task` gathers what a script needs to know about a task without knowing which one
it is: the sizes of its observation and action, the keyword options its environment factory
takes, and three factories (the environment, its scripted expert as a policy, the expert's
demonstrations). :func:`get_task` returns one by name. The robosuite tasks are imported only
when one of their factories runs, so ``import torchrl_flowpolicy`` never needs robosuite.

| name | environment | expert | observation | action |
| --- | --- | --- | --- | --- |
| ``"pusher"`` | :func:`~torchrl_flowpolicy.envs.make_pusher_env` | :class:`~torchrl_flowpolicy.envs.PusherExpertPolicy` | 23 | 7 joint torques |
| ``"lift"`` | ``make_robosuite_env(task="Lift")`` | ``LiftExpert`` | 60 | 7 (OSC pose delta + gripper) |
| ``"can"`` | ``make_robosuite_env(task="PickPlaceCan")`` | ``CanExpert`` | 64 | 7 (OSC pose delta + gripper) |
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tensordict.nn import TensorDictModuleBase
from torchrl.envs import EnvBase

from torchrl_flowpolicy.envs.demonstrations import collect_demos
from torchrl_flowpolicy.envs.pusher import make_pusher_env
from torchrl_flowpolicy.envs.pusher_expert import PusherExpertPolicy

__all__ = ["Task", "TASKS", "get_task"]


@dataclass(frozen=True)
class Task:
    """What the example scripts need to know about a task.

    Attributes:
        name: the task's name on the command line (``--task``).
        title: how plots and logs name it.
        observation_dim: the size of the flat ``"observation"`` vector.
        action_dim: the size of one action (a chunk is ``[H', action_dim]``).
        option_names: the keyword options of ``make_env`` (and of ``collect_demos``) that a
            run's config sets, e.g. ``("max_episode_steps", "success_threshold", "reward")``.
        make_env: ``make_env(num_envs, executed_chunk_length, **options)``: the TorchRL
            environment (``num_envs=None``: unbatched; ``executed_chunk_length=None``: one
            action per step). It writes ``"success"`` on every step. It also takes
            ``device`` and ``group_size`` (a batch's sub-environments that ``set_seed`` seeds
            alike, :class:`~torchrl_flowpolicy.envs.BatchedGymEnv`).
        make_expert: ``make_expert(env, action_noise=0.0, seed=0)``: the scripted expert as a
            policy of ``make_env(N, None, **options)`` (one action per step).
        collect_demos: ``collect_demos(num_episodes, action_noise, seed, *, progress=None,
            **options)``: the noisy expert's demonstrations, the dict layout of
            :func:`~torchrl_flowpolicy.envs.collect_demos`.
        defaults: the values of ``option_names`` that a run of this task starts from.
        max_eval_envs: the most sub-environments an evaluation should hold at once (``None``:
            one per episode); more episodes run in rounds. A robosuite simulator takes about
            0.1 GB, so 200 held-out Lift episodes at once would need 20 GB.
    """

    name: str
    title: str
    observation_dim: int
    action_dim: int
    option_names: tuple[str, ...]
    make_env: Callable[..., EnvBase]
    make_expert: Callable[..., TensorDictModuleBase]
    collect_demos: Callable[..., dict[str, Any]]
    defaults: dict[str, Any] = field(default_factory=dict)
    max_eval_envs: int | None = None

    def eval_envs(self, num_episodes: int) -> int:
        """How many sub-environments an evaluation of ``num_episodes`` episodes uses."""
        return min(num_episodes, self.max_eval_envs or num_episodes)

    def options(self, config: Any) -> dict[str, Any]:
        """The task's options read from a run config (an object with those attributes)."""
        return {name: getattr(config, name) for name in self.option_names}


# ----------------------------------------------------------------------------- pusher
def _pusher_expert(env: EnvBase, action_noise: float = 0.0, seed: int = 0) -> TensorDictModuleBase:
    return PusherExpertPolicy(env, action_noise=action_noise, seed=seed)


def _pusher_demos(
    num_episodes: int,
    action_noise: float,
    seed: int = 0,
    *,
    progress: Callable[[int], None] | None = None,
    max_episode_steps: int,
    success_threshold: float,
    reward: str = "progress",
) -> dict[str, Any]:
    # The demonstrations store gymnasium's reward; the task's reward is recomputed by the env.
    del reward
    return collect_demos(
        num_episodes,
        action_noise,
        seed,
        max_episode_steps,
        success_threshold,
        progress=progress,
    )


# ----------------------------------------------------------------------------- robosuite
def _robosuite_env(
    task: str,
    num_envs: int | None = None,
    executed_chunk_length: int | None = None,
    **options: Any,
) -> EnvBase:
    from torchrl_flowpolicy.envs.robosuite_tasks import make_robosuite_env

    return make_robosuite_env(num_envs, executed_chunk_length, task=task, **options)


def _robosuite_expert(
    task: str, env: EnvBase, action_noise: float = 0.0, seed: int = 0
) -> TensorDictModuleBase:
    # The expert's default settings match the layout make_robosuite_env builds (CanExpert's
    # target is robosuite's default compartment; tests compare it with CanExpert.from_env).
    from torchrl_flowpolicy.envs.robosuite_experts import EXPERTS, RobosuiteExpertPolicy

    return RobosuiteExpertPolicy(env, EXPERTS[task](action_noise=action_noise, seed=seed))


def _robosuite_demos(
    task: str,
    num_episodes: int,
    action_noise: float,
    seed: int = 0,
    *,
    progress: Callable[[int], None] | None = None,
    **options: Any,
) -> dict[str, Any]:
    from torchrl_flowpolicy.envs.robosuite_experts import collect_robosuite_demos

    return collect_robosuite_demos(
        num_episodes, action_noise, seed, task=task, progress=progress, **options
    )


def _robosuite_factories(task: str) -> dict[str, Callable[..., Any]]:
    """``make_env``, ``make_expert`` and ``collect_demos`` of a robosuite task (picklable:
    partials of module functions, so that collector processes can build the environment)."""
    return {
        "make_env": functools.partial(_robosuite_env, task),
        "make_expert": functools.partial(_robosuite_expert, task),
        "collect_demos": functools.partial(_robosuite_demos, task),
    }


TASKS: dict[str, Task] = {
    "pusher": Task(
        name="pusher",
        title="Pusher-v5",
        observation_dim=23,
        action_dim=7,
        option_names=("max_episode_steps", "success_threshold", "reward"),
        make_env=make_pusher_env,
        make_expert=_pusher_expert,
        collect_demos=_pusher_demos,
        defaults={"max_episode_steps": 150, "success_threshold": 0.05, "reward": "progress"},
    ),
    "lift": Task(
        name="lift",
        title="robosuite Lift (Panda)",
        observation_dim=60,
        action_dim=7,
        option_names=("max_episode_steps", "reward", "terminate_on_success"),
        **_robosuite_factories("Lift"),
        defaults={"max_episode_steps": 60, "reward": "success", "terminate_on_success": True},
        max_eval_envs=25,
    ),
    "can": Task(
        name="can",
        title="robosuite PickPlaceCan (Panda)",
        observation_dim=64,
        action_dim=7,
        option_names=("max_episode_steps", "reward", "terminate_on_success"),
        **_robosuite_factories("PickPlaceCan"),
        defaults={"max_episode_steps": 250, "reward": "success", "terminate_on_success": True},
        max_eval_envs=25,
    ),
}


def get_task(name: str) -> Task:
    """The :class:`Task` called ``name`` (one of :data:`TASKS`).

    Examples:
        >>> get_task("pusher").observation_dim
        23
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: use one of {sorted(TASKS)}.")
    return TASKS[name]
