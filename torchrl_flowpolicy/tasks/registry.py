"""The task registry: every task the examples train on, with all that differs between tasks.

A :class:`Task` holds, in one place, what a script needs to know about a task without
knowing which one it is: the sizes of its observation and action, its horizon, what counts
as a success, the keyword options its environment factory takes and their defaults, three
factories (the environment, its scripted expert as a policy, the expert's demonstrations),
how its demonstrations are cached and how many a pretraining clones
(:class:`DemoSettings`), the examples' per-task defaults, its default output paths, how an
evaluation batches it and how a video renders it. :func:`get_task` returns one by name;
:meth:`Task.check_checkpoint` refuses a checkpoint of another task. Scripts read these
attributes and never compare task names, so adding a task is one entry of :data:`TASKS`
(plus its environment and expert modules).

| name | environment | expert | observation | action | horizon |
| --- | --- | --- | --- | --- | --- |
| ``"pusher"`` | :func:`~torchrl_flowpolicy.tasks.make_pusher_env` | :class:`~torchrl_flowpolicy.tasks.PusherExpertPolicy` | 23 | 7 joint torques | 150 |
| ``"lift"`` | ``make_robosuite_env(task="Lift")`` | ``LiftExpert`` | 60 | 7 (OSC pose delta + gripper) | 60 |
| ``"can"`` | ``make_robosuite_env(task="PickPlaceCan")`` | ``CanExpert`` | 64 | 7 (OSC pose delta + gripper) | 250 |
| ``"square"`` | ``make_robosuite_env(task="NutAssemblySquare")`` | ``SquareExpert`` | 64 | 7 (OSC pose delta + gripper) | 288 |

**Default output paths.** Each example writes under ``outputs/<script>`` for the default
task (``outputs/pretrain/policy.pt``, ``outputs/ppo``, ``outputs/dsrl``,
``outputs/evaluation.json``) and under ``outputs/<script>_<task>`` for every other one
(``outputs/pretrain_lift/policy.pt``, ``outputs/ppo_lift``, ``outputs/evaluation_lift.json``):
:meth:`Task.output_dir` and :attr:`Task.pretrained_checkpoint`. A fine-tuning run of a task
therefore never picks up another task's pretrained policy by default.

The robosuite tasks are imported only when one of their factories runs
(:mod:`~torchrl_flowpolicy.tasks.robosuite.registry`), so ``import torchrl_flowpolicy`` never
needs robosuite.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from tensordict.nn import TensorDictModuleBase
from torchrl.envs import EnvBase

from torchrl_flowpolicy.tasks.pusher.demos import collect_task_demos, rescore_success
from torchrl_flowpolicy.tasks.pusher.env import (
    DEFAULT_MAX_EPISODE_STEPS,
    DEFAULT_SUCCESS_THRESHOLD,
    make_pusher_env,
    render_options,
)
from torchrl_flowpolicy.tasks.pusher.expert import PusherExpertPolicy
from torchrl_flowpolicy.tasks.robosuite.can_outcomes import CAN_OUTCOMES, can_rollout_outcomes
from torchrl_flowpolicy.tasks.robosuite.layout import SQUARE_MAX_EPISODE_STEPS
from torchrl_flowpolicy.tasks.robosuite.registry import (
    ROBOSUITE_CACHED,
    ROBOSUITE_OPTIONS,
    robosuite_factories,
)

__all__ = ["DemoSettings", "EpisodeKinds", "Task", "TASKS", "get_task", "script_defaults"]


# The sampler of Lift's recipe (docs/robosuite.md): K = 8 rollouts from x_0 ~ N(0, I), the
# last 4 steps stochastic, the evaluation ODE at K = 20, the learning curve sampled. Can and
# Square run the main job's (ppo.py's defaults).
ROBOSUITE_SAMPLER = {
    "sampler.num_denoising_steps": 8,
    "sampler.eval_num_denoising_steps": 20,
    "sampler.num_sde_steps": 4,
    "sampler.rollout_noise_scale": 1.0,
    "sampler.eval_noise_scale": 1.0,
}


class EpisodeKinds(NamedTuple):
    """A task's kinds of episode: their ``names`` and ``classify(rollout, outcomes)``, which
    returns ``{"kind": [N]}`` indices into ``names`` (the ``details`` of
    :func:`~torchrl_flowpolicy.training.evaluation.evaluate_episodes`)."""

    names: tuple[str, ...]
    classify: Callable[[Any, Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class DemoSettings:
    """How a task's demonstrations are cached and how many a pretraining clones.

    Attributes:
        num_episodes: the noisy expert's episodes a pretraining clones by default
            (``examples/pretrain.py --demo_episodes``).
        action_noise: the std of the Gaussian noise on the expert's actions by default
            (``--demo_action_noise``).
        cached_options: the task options a demonstration set depends on: stored in its
            ``"config"`` and compared with the requested ones when a cached set is loaded
            (:func:`~torchrl_flowpolicy.tasks.load_or_collect_demos`).
        rescore: ``rescore(demos, options)`` sets the per-episode ``"success"`` flags of a
            loaded set for the requested ``options`` (Pusher: from the stored final distances
            and ``success_threshold``); ``None``: the stored flags stand.
    """

    num_episodes: int
    action_noise: float
    cached_options: tuple[str, ...]
    rescore: Callable[[dict[str, Any], Mapping[str, Any]], None] | None = None


@dataclass(frozen=True)
class Task:
    """Everything that differs between the tasks the examples run.

    Attributes:
        name: the task's name on the command line (``--task``).
        title: how plots and logs name it.
        observation_dim: the size of the flat ``"observation"`` vector.
        action_dim: the size of one action (a chunk is ``[H', action_dim]``).
        max_episode_steps: the horizon, in environment steps (the default of the
            ``max_episode_steps`` option; an evaluation of ``H'``-step chunks takes
            ``ceil(max_episode_steps / H')`` decisions).
        success: what counts as a success. Every environment writes ``"success"`` on every
            step; an episode's success is its value at the episode's last step.
        option_defaults: the keyword options of ``make_env`` (and of ``collect_demos``)
            besides ``max_episode_steps`` that a run's config sets, with their defaults.
        make_env: ``make_env(num_envs, executed_chunk_length, **options)``: the TorchRL
            environment (``num_envs=None``: unbatched; ``executed_chunk_length=None``: one
            action per step). It also takes ``device`` and ``group_size`` (a batch's
            sub-environments that ``set_seed`` seeds alike,
            :class:`~torchrl_flowpolicy.envs.BatchedGymEnv`).
        make_expert: ``make_expert(env, *, action_noise=0.0, seed=0)``: the scripted expert as a
            policy of ``make_env(N, None, **options)`` (one action per step).
        collect_demos: ``collect_demos(num_episodes, action_noise, seed, *, progress=None,
            **options)``: the noisy expert's demonstrations, the dict layout of
            :func:`~torchrl_flowpolicy.tasks.collect_demos`.
        demos: how the demonstrations are cached and cloned (:class:`DemoSettings`).
        render_options: ``render_options(height, width, camera)``: the options of
            ``make_env`` that render ``height x width`` frames offscreen from ``camera``
            (``None``: the task's default view).
        run_defaults: per example script (``"pretrain"``, ``"ppo"``, ``"dsrl"``,
            ``"evaluate"``), the options whose defaults this task changes, e.g. Lift's
            ``{"ppo": {"num_envs": 48, ...}}``.
        output_suffix: what the default output paths append to the script's name
            (:meth:`output_dir`): ``""`` for the default task, ``"_<name>"`` for the others.
        max_eval_envs: the most sub-environments an evaluation should hold at once (``None``:
            one per episode); more episodes run in rounds. A robosuite simulator takes about
            0.1 GB, so 200 held-out Lift episodes at once would need 20 GB.
        episode_kinds: how the task sorts its episodes by why they failed
            (``examples/evaluate.py --failure_kinds``), or ``None``.

    Examples:
        >>> task = get_task("lift")
        >>> task.max_episode_steps, task.option_names
        (60, ('max_episode_steps', 'reward', 'terminate_on_success'))
        >>> task.output_dir("ppo"), task.pretrained_checkpoint
        ('outputs/ppo_lift', 'outputs/pretrain_lift/policy.pt')
    """

    name: str
    title: str
    observation_dim: int
    action_dim: int
    max_episode_steps: int
    success: str
    option_defaults: Mapping[str, Any]
    make_env: Callable[..., EnvBase]
    make_expert: Callable[..., TensorDictModuleBase]
    collect_demos: Callable[..., dict[str, Any]]
    demos: DemoSettings
    render_options: Callable[[int, int, str | None], dict[str, Any]]
    run_defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    output_suffix: str = ""
    max_eval_envs: int | None = None
    episode_kinds: EpisodeKinds | None = None

    @property
    def defaults(self) -> dict[str, Any]:
        """Every option of :attr:`option_names` with the value a run of this task starts from."""
        return {"max_episode_steps": self.max_episode_steps, **self.option_defaults}

    @property
    def option_names(self) -> tuple[str, ...]:
        """The keyword options of ``make_env`` that a run's config sets."""
        return tuple(self.defaults)

    def eval_envs(self, num_episodes: int) -> int:
        """How many sub-environments an evaluation of ``num_episodes`` episodes uses."""
        return min(num_episodes, self.max_eval_envs or num_episodes)

    def options(self, config: Any) -> dict[str, Any]:
        """The task's options read from a run config (an object with those attributes)."""
        return {name: getattr(config, name) for name in self.option_names}

    def output_dir(self, script: str) -> str:
        """The default output folder of an example script for this task:
        ``outputs/<script><output_suffix>``, e.g. ``outputs/ppo`` or ``outputs/ppo_lift``."""
        return f"outputs/{script}{self.output_suffix}"

    @property
    def pretrained_checkpoint(self) -> str:
        """Where ``examples/pretrain.py`` writes this task's policy by default, and where the
        fine-tuning examples look for it."""
        return f"{self.output_dir('pretrain')}/policy.pt"

    def checkpoint_identity(self) -> dict[str, Any]:
        """What a checkpoint of a policy of this task records about it: the task's name and
        the observation layout (the entry the policy reads, its size)."""
        return {
            "task": self.name,
            "observation": {"key": "observation", "dim": self.observation_dim},
        }

    def check_checkpoint(self, state: Mapping[str, Any], source: str = "the checkpoint") -> None:
        """Refuse a checkpoint (a loaded dict) of another task, naming both tasks.

        The checkpoint's task is its ``"task"`` entry (:meth:`checkpoint_identity`); a
        checkpoint saved before that entry existed is told by its observation size (its
        ``"model_config"``'s ``observation_dim``), the one thing that differs between the
        tasks of that time.

        Raises:
            ValueError: the checkpoint is another task's, or records no task and an
                observation size of no task, or has this task's name but another
                observation size.

        Examples:
            >>> get_task("lift").check_checkpoint({"task": "lift"})
            >>> get_task("lift").check_checkpoint({"task": "pusher"})
            Traceback (most recent call last):
            ...
            ValueError: the checkpoint holds a policy of task 'pusher' (Pusher-v5, 23 observation features), not of this run's task 'lift' (robosuite Lift (Panda), 60 observation features): ...
        """
        observation = state.get("observation") or {}
        dim = observation.get("dim", (state.get("model_config") or {}).get("observation_dim"))
        saved = state.get("task")
        wanted = (
            f"this run's task {self.name!r} ({self.title}, {self.observation_dim} observation "
            "features)"
        )
        fix = (
            f"load a checkpoint of {self.name!r} (its pretraining writes "
            f"{self.pretrained_checkpoint} by default) or run the checkpoint's task."
        )
        if saved is None:
            if dim is None or dim == self.observation_dim:
                return  # nothing tells it apart from this task's
            matching = [task.name for task in TASKS.values() if task.observation_dim == dim]
            if not matching:
                sizes = ", ".join(f"{t.name} {t.observation_dim}" for t in TASKS.values())
                raise ValueError(
                    f"{source} records no task, and its {dim} observation features are those "
                    f"of no task ({sizes}); {wanted} cannot use it: {fix}"
                )
            raise ValueError(
                f"{source} records no task; its {dim} observation features are those of task "
                f"{' or '.join(map(repr, matching))}, not of {wanted}: {fix}"
            )
        if saved != self.name:
            known = TASKS.get(saved)
            what = f"{known.title}, {known.observation_dim}" if known else f"unknown here, {dim}"
            raise ValueError(
                f"{source} holds a policy of task {saved!r} ({what} observation features), "
                f"not of {wanted}: {fix}"
            )
        if dim is not None and dim != self.observation_dim:
            raise ValueError(
                f"{source} is of task {saved!r} but has {dim} observation features, {wanted} "
                f"has {self.observation_dim} (another version of its simulator?)."
            )


# ----------------------------------------------------------------------------- robosuite
# Their factories and shared options: tasks.robosuite.registry. PickPlaceCan's PPO recipe
# (docs/robosuite.md, Can's second round), which NutAssemblySquare runs too: 24 envs x 63
# decisions = 1,512 decisions a batch in minibatches of 504, Lift's self-imitation and actor
# step, the main job's sampler (ppo.py's: K = 4 from x_0 = 0, the last 2 steps stochastic,
# the evaluation ODE at K = 4 from x_0 = 0) and 120 iterations (725,760 env steps on Can),
# read off seed 0's validation states: 93.5 % noise-free at 60 iterations, 96.5 % at 120.
# Can's full recipe continues such a run with --resume to 1,088,640 env steps, 48 envs,
# minibatches of 1,008 and the actor's learning rate decaying to 0 over those 362,880 env
# steps (docs/robosuite.md, "Can's recipe"): two phases, which one set of defaults cannot say.
_CAN_PPO = types.MappingProxyType(
    {
        "num_envs": 24,
        "minibatch_size": 504,
        "bc_coeff": 1.0,
        "actor_learning_rate": 1e-4,
        "reward_scale": 1.0,
        "total_env_steps": 725_760,
        "eval_every": 10,
        "checkpoint_every": 5,
        "context_grad": False,  # the encoder keeps its cloned weights, as the recipe was run
    }
)

TASKS: dict[str, Task] = {
    "pusher": Task(
        name="pusher",
        title="Pusher-v5",
        observation_dim=23,
        action_dim=7,
        max_episode_steps=DEFAULT_MAX_EPISODE_STEPS,
        success="the object's final horizontal distance to the goal is below "
        "success_threshold (0.05 m)",
        option_defaults={"success_threshold": DEFAULT_SUCCESS_THRESHOLD, "reward": "progress"},
        make_env=make_pusher_env,
        make_expert=PusherExpertPolicy,
        collect_demos=collect_task_demos,
        # Five demonstrations at noise 0.3: a start that leaves RL real work (docs/results.md).
        demos=DemoSettings(
            num_episodes=5,
            action_noise=0.3,
            cached_options=("max_episode_steps",),
            rescore=rescore_success,
        ),
        render_options=render_options,
        # PPO trains the observation encoder too (--context_grad), chosen on the validation
        # states against TorchRL's Gaussian actor (docs/experiments/pusher_gaussian.md).
        run_defaults={"ppo": {"context_grad": True}},
    ),
    "lift": Task(
        name="lift",
        title="robosuite Lift (Panda)",
        observation_dim=60,
        action_dim=7,
        max_episode_steps=60,
        success="robosuite's _check_success(): the cube's centre more than 0.04 m above the "
        "table; the episode ends there (terminate_on_success)",
        option_defaults=ROBOSUITE_OPTIONS,
        **robosuite_factories("Lift"),
        # 25 demonstrations at action noise 0.3 clone to 60.5-72 % noise-free on the held-out
        # states, the start PPO's Lift defaults fine-tune (15: about 40 %, 40: 70 % sampled
        # on the learning-curve episodes; docs/robosuite.md).
        demos=DemoSettings(num_episodes=25, action_noise=0.3, cached_options=ROBOSUITE_CACHED),
        run_defaults={
            # The recipe of docs/robosuite.md (from 25 demonstrations to 93.5-98 % noise-free
            # on the held-out states in 600k env steps): 48 envs x 15 decisions = 720
            # decisions a batch, two minibatches; strong self-imitation and a larger actor
            # step than Pusher's; the sparse success reward (1 at success) is used as is.
            "ppo": {
                "num_envs": 48,
                "minibatch_size": 360,
                "bc_coeff": 1.0,
                "actor_learning_rate": 1e-4,
                "reward_scale": 1.0,
                "total_env_steps": 600_000,
                "eval_every": 10,
                "checkpoint_every": 10,
                "context_grad": False,  # the recipe's encoder keeps its cloned weights
                **ROBOSUITE_SAMPLER,
            },
        },
        output_suffix="_lift",
        max_eval_envs=25,
    ),
    "can": Task(
        name="can",
        title="robosuite PickPlaceCan (Panda)",
        observation_dim=64,
        action_dim=7,
        max_episode_steps=250,
        success="robosuite's _check_success(): the can in its compartment of the second bin, "
        "let go; the episode ends there (terminate_on_success)",
        option_defaults=ROBOSUITE_OPTIONS,
        **robosuite_factories("PickPlaceCan"),
        # 20 demonstrations at action noise 0.3, chosen on seed 0's validation states (15: 46 %,
        # 20: 62 %, 25: 70 % noise-free at K = 4); each seed draws its own, so the start varies:
        # 61.0 / 69.0 / 72.5 % (best decoding) on the held-out states for seeds 0-2
        # (docs/robosuite.md).
        demos=DemoSettings(num_episodes=20, action_noise=0.3, cached_options=ROBOSUITE_CACHED),
        run_defaults={"ppo": _CAN_PPO},
        output_suffix="_can",
        max_eval_envs=25,
        episode_kinds=EpisodeKinds(CAN_OUTCOMES, can_rollout_outcomes),
    ),
    "square": Task(
        name="square",
        title="robosuite NutAssemblySquare (Panda)",
        observation_dim=64,
        action_dim=7,
        max_episode_steps=SQUARE_MAX_EPISODE_STEPS,
        success="robosuite's _check_success(): the square nut around the square peg, down on "
        "the table, the grip site off its centre; the episode ends there (terminate_on_success)",
        option_defaults=ROBOSUITE_OPTIONS,
        **robosuite_factories("NutAssemblySquare"),
        # 25 demonstrations: the few-shot regime's count, not yet chosen by cloning (seed 0
        # clones them to 5-7 % on the validation states, 100 to 19 / 38 % sampled / noise-free,
        # docs/robosuite.md); PPO runs Can's
        # recipe, not tuned here (24 envs x 72 decisions = 1,728 decisions a batch).
        demos=DemoSettings(num_episodes=25, action_noise=0.3, cached_options=ROBOSUITE_CACHED),
        run_defaults={"ppo": _CAN_PPO},
        output_suffix="_square",
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


def script_defaults(
    script: Literal["pretrain", "ppo", "dsrl", "evaluate"],
) -> dict[str, dict[str, Any]]:
    """What ``--task NAME`` changes in the config of ``examples/<script>.py``, all read from the
    task's registry entry (:class:`~torchrl_flowpolicy.tasks.registry.Task`): its environment
    options (``defaults``), its demonstrations (``demos``: pretrain's ``demo_*``, the
    ``pretrain.demo_*`` of a fine-tuning run, which pretrains when its checkpoint is
    missing), its default paths (``output_dir``, ``pretrained_checkpoint``) and its
    ``run_defaults[script]``."""
    defaults = {}
    for name, task in TASKS.items():
        demos = {
            "demo_episodes": task.demos.num_episodes,
            "demo_action_noise": task.demos.action_noise,
        }
        if script == "pretrain":
            paths = {"output_dir": task.output_dir("pretrain"), **demos}
        elif script == "evaluate":
            paths = {
                "checkpoints": task.pretrained_checkpoint,
                "output_json": f"{task.output_dir('evaluation')}.json",
            }
        else:
            paths = {
                "output_dir": task.output_dir(script),
                "pretrained_checkpoint": task.pretrained_checkpoint,
                **{f"pretrain.{option}": value for option, value in demos.items()},
            }
        defaults[name] = {**task.defaults, **paths, **task.run_defaults.get(script, {})}
    return defaults
