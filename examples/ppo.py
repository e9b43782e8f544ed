"""PPO fine-tuning of a pretrained flow policy: the library's main job (Pusher-v5; robosuite
Lift with ``--task lift``).

Pipeline: scripted-expert demonstrations -> flow-matching behaviour cloning
(``examples/pretrain.py``, run first when its checkpoint is missing) -> PPO with the Flow-SDE
sampler (K = 8, a = 0.5, the last 4 steps stochastic) and ``DenoisingClipPPOLoss`` -> deterministic
evaluation at K = 20 on the learning-curve seeds -> the evaluation protocol on held-out
seeds (BC and PPO under both decodings, the clean scripted expert, 95 % intervals; see
``torchrl_flowpolicy.protocol``) -> learning-curve PNG and JSON summary.

With ``--collector_workers N`` the rollouts run in ``N`` processes (TorchRL's
``MultiSyncCollector``, ``num_envs / N`` environments each, the policy's weights sent to
them after every update). With ``--collector_backend ray`` they run in ``N`` Ray actors
(TorchRL's ``RayCollector``) on a local Ray instance or on the cluster at ``--ray_address``
(``pip install "torchrl_flowpolicy[ray]"``). ``--device cuda`` puts the policy, the critic,
the loss, the batches and the replay buffer on the GPU; the simulators stay on the CPU.

Under ``torchrun --nproc_per_node N`` the learner is data-parallel
(``torchrl_flowpolicy.distributed``): rank ``r`` seeds torch with ``seed + r`` and collects
``num_envs`` environments of its own (in each batch's reset seeds, rank ``r``'s environments
follow those of ranks ``0 .. r - 1``), every rank starts from rank 0's weights, and each
minibatch's gradients are averaged over the ranks before clipping, so that the ranks keep
identical weights. A batch is then ``N`` times larger and ``total_env_steps`` counts the steps
of all ranks. Advantages are standardised per rank and minibatch, and self-imitation averages
over each rank's own successes. Rank 0 alone pretrains (the others wait), evaluates, logs its
own diagnostics, checkpoints and writes the protocol, plot and summary.

With ``--advantage grpo`` there is no critic (group-relative PPO, as Flow-GRPO and pi-RL
fine-tune flow policies): the ``num_envs`` environments form groups of ``group_size`` that
start every batch from one initial state per group (``BatchedGymEnv(group_size=...)``, one seed
per group and batch, :func:`~torchrl_flowpolicy.protocol.training_seed`), a batch holds one
episode per environment (the decisions after an early end, which the collector starts anew, are
dropped), and each episode's return is scored against its group's
(:class:`~torchrl_flowpolicy.objectives.GroupRelativeAdvantage`) before
``DenoisingClipPPOLoss`` without a critic. It needs the in-process collector (one worker): the
groups are reseeded from this process before every batch.

``main`` reads top to bottom: seed, pretrained policy, evaluation env and baselines (BC under
both decodings, the expert), learner (critic, loss, optimisers), resume, collector, training
loop (one PPO iteration per batch, evaluate, log, checkpoint), final evaluation, held-out
protocol, plot, summary. ``--quick`` runs the whole chain in about a minute; ``--resume``
continues a killed run.

``--noise learned`` replaces the fixed Flow-SDE noise with a learned one (pi-RL's Flow-Noise,
ReinFlow): a noise head, created fresh at the start of RL (the pretrained checkpoint has
none), predicts the std of every stochastic step on the Euler ODE mean, bounded in
``[min_noise_std, max_noise_std]``; it is trained with the policy (its own learning rate),
``--entropy_coeff`` gives the entropy bonus a gradient, and the head is saved in the run
checkpoint (``docs/learned_noise.md``).

Exact resume: every batch starts from fresh resets of all environments, seeded from the run
seed and the iteration (``torchrl_flowpolicy.protocol.training_seed``), and a checkpoint
holds every random generator's state (torch, NumPy, Python's ``random``; CUDA's when in
use) besides the weights and optimisers. A run killed at any moment and resumed with
``--resume`` therefore logs the numbers of the uninterrupted run, bit for bit, on the same
machine with one collector process (``tests/test_main_job.py``). With collector workers,
Ray or ``torchrun`` a resumed run starts each batch from the same states but its sampling
noise comes from streams the checkpoint does not hold, so its numbers differ.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict, TensorDictBase  # noqa: E402
from tensordict.nn import TensorDictModule  # noqa: E402
from torch import nn  # noqa: E402
from torchrl.collectors import Collector, MultiSyncCollector  # noqa: E402
from torchrl.collectors.distributed import RayCollector  # noqa: E402
from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement  # noqa: E402
from torchrl.envs.utils import ExplorationType  # noqa: E402
from torchrl.objectives import ValueEstimators  # noqa: E402
from tqdm import tqdm  # noqa: E402

from torchrl_flowpolicy import FlowSDEPolicy  # noqa: E402
from torchrl_flowpolicy.distributed import (  # noqa: E402
    average_gradients,
    barrier,
    broadcast_parameters,
    close_distributed,
    init_distributed,
    sum_over_processes,
)
from torchrl_flowpolicy.envs import decision_discount, get_task  # noqa: E402
from torchrl_flowpolicy.evaluation import evaluate_policy  # noqa: E402
from torchrl_flowpolicy.objectives import (  # noqa: E402
    DenoisingClipPPOLoss,
    GroupRelativeAdvantage,
)
from torchrl_flowpolicy.protocol import (  # noqa: E402
    CURVE_SEED,
    training_seed,
)
from torchrl_flowpolicy.sampler import SamplerOptions  # noqa: E402

import pretrain  # noqa: E402
from common import (
    MetricLogger,
    ModelConfig,
    TaskOptions,  # noqa: E402
    build_noise_head,
    curve_baselines,
    decisions_per_episode,
    held_out_protocol,
    load_policy,
    load_run,
    make_eval_env,
    make_task_env,
    option,
    parse_config,
    plot_baselines,
    plot_success_band,
    require_run_checkpoint,
    resolve_device,
    restore_random_state,
    resume_run,
    save_figure,
    save_run,
    seed_random_generators,
    task_defaults,
    validate_config,
    write_json,
)
from common import (
    env_steps as count_env_steps,
)

# The options that configure the noise head: refused with --noise fixed, where nothing reads them.
LEARNED_NOISE_OPTIONS = (
    "min_noise_std",
    "max_noise_std",
    "initial_noise_std",
    "noise_learning_rate",
)


@dataclass
class PPOConfig(TaskOptions):
    """PPO fine-tuning settings; every field is a command-line option."""

    seed: int = option(
        0, "seeds torch, the environments and the pretraining when it runs", minimum=0
    )
    output_dir: str = option("outputs/ppo", "checkpoints, logs, plot and summary")
    pretrained_checkpoint: str = option(
        "outputs/pretrain/policy.pt", "the behaviour-cloned policy (pretrained here if missing)"
    )
    num_envs: int = option(
        16, "training environments (split evenly over the collector workers)", minimum=1
    )
    collector_workers: int = option(
        1,
        "collector processes (> 1: TorchRL's MultiSyncCollector, weights synced per update)",
        minimum=1,
    )
    collector_backend: Literal["process", "ray"] = option(
        "process",
        "process: collection in this process (1 worker) or in worker processes; ray: "
        "TorchRL's RayCollector, one Ray actor per worker (needs the ray extra)",
    )
    ray_address: str = option(
        "",
        "collector_backend=ray: the Ray cluster (empty: RAY_ADDRESS or the cluster started "
        "on this machine by `ray start`, else a new local Ray instance; auto: an existing one)",
    )
    device: str = option(
        "cpu", "torch device of the policy, critic, loss, batches and replay buffer (cpu, cuda)"
    )
    episodes_per_batch: int = option(1, "episodes per environment per PPO iteration", minimum=1)
    total_env_steps: int = option(1_200_000, "environment steps of fine-tuning", minimum=1)
    # Flow-SDE sampler (rollouts) and the evaluation ODE.
    noise_level: float = option(0.5, "a: exploration noise of the Flow-SDE step", minimum=0)
    rollout_noise_scale: float = option(
        1.0,
        "std of the rollouts' x_0 (0: chains start at x_0 = 0, exploration from the stochastic "
        "steps alone); the learning curve decodes with the same x_0 std",
        minimum=0,
    )
    num_denoising_steps: int = option(
        8, "K: denoising steps of rollouts and of the learner", minimum=1
    )
    eval_num_denoising_steps: int = option(20, "K of the deterministic evaluation ODE", minimum=1)
    sde_mode: Literal["mixed", "last", "all"] = option(
        "last", "stochastic steps: one random step (mixed), the last num_sde_steps, all"
    )
    num_sde_steps: int = option(4, "stochastic steps for sde_mode=last", minimum=0)
    noise: Literal["fixed", "learned"] = option(
        "fixed",
        "noise of the stochastic steps: fixed (Flow-SDE, g = a sqrt(sigma / (1 - sigma))) or "
        "learned (a fresh noise head's std on the Euler ODE mean: Flow-Noise, ReinFlow)",
    )
    min_noise_std: float = option(0.02, "noise=learned: lower bound of the step std", above=0)
    max_noise_std: float = option(0.3, "noise=learned: upper bound of the step std", above=0)
    initial_noise_std: float = option(
        0.08, "noise=learned: the fresh head's std, everywhere (inside the bounds)", above=0
    )
    noise_learning_rate: float = option(3e-4, "noise=learned: Adam on the noise head", above=0)
    entropy_coeff: float = option(
        0.0, "entropy bonus (0: off; it has a gradient with noise=learned only)", minimum=0
    )
    # PPO.
    advantage: Literal["gae", "grpo"] = option(
        "gae",
        "gae: a value network and GAE over decisions; grpo: no critic, each episode's return "
        "against those of its group (docs/grpo.md)",
    )
    group_size: int = option(
        4,
        "advantage=grpo: environments per group, reset from one initial state at every batch "
        "(num_envs must be a multiple)",
        minimum=2,
    )
    epochs: int = option(4, "passes over each batch", minimum=1)
    minibatch_size: int = option(304, "decisions per minibatch", minimum=1)
    actor_learning_rate: float = option(3e-5, "Adam on the flow policy", above=0)
    critic_learning_rate: float = option(1e-3, "Adam on the value network", above=0)
    clip_epsilon_low: float = option(0.2, "ratio clip below 1", above=0, maximum=1)
    clip_epsilon_high: float = option(0.28, "ratio clip above 1 (clip-higher)", above=0)
    kl_coeff: float = option(0.0, "KL to the pretrained policy (0: off)", minimum=0)
    bc_coeff: float = option(
        0.1, "self-imitation: flow matching on successful episodes (0: off)", minimum=0
    )
    gamma: float = option(
        0.99,
        "discount per env step; per decision: gamma ** executed rows (gae; grpo: returns are "
        "undiscounted)",
        minimum=0,
        maximum=1,
    )
    gae_lambda: float = option(0.95, "GAE lambda over decisions", minimum=0, maximum=1)
    reward_scale: float = option(0.1, "multiplies the summed chunk reward", above=0)
    max_grad_norm: float = option(1.0, "gradient clipping", above=0)
    critic_warmup_iterations: int = option(
        3, "first iterations train only the critic (grpo: no critic, ignored)", minimum=0
    )
    # Evaluation, logging, checkpoints.
    eval_every: int = option(20, "iterations between deterministic evaluations", minimum=1)
    eval_episodes: int = option(
        50, "learning-curve episodes (curve seeds 10000+, as BC's)", minimum=1
    )
    held_out_episodes: int = option(
        200, "final protocol episodes (held-out seeds 30000+: used by nothing else)", minimum=1
    )
    reported_decoding: Literal["sampled", "noise_free"] = option(
        "noise_free",
        "PPO's decoding reported on the held-out states (chosen on validation states, "
        "before looking at held-out numbers)",
    )
    checkpoint_every: int = option(20, "iterations between checkpoints", minimum=1)
    loggers: str = option("wandb,csv", "TorchRL loggers, comma-separated (wandb runs offline)")
    resume: bool = option(False, "continue from output_dir/checkpoint.pt")
    threads: int = option(
        2,
        "torch CPU threads (2 on 2 cores: updates 1.8x faster than 1; rollouts the same)",
        minimum=1,
    )
    pretrain: pretrain.PretrainConfig = option(
        default_factory=pretrain.PretrainConfig,
        help="behaviour cloning, run when pretrained_checkpoint is missing (with this run's "
        "seed and task settings; it writes pretrained_checkpoint)",
    )

    def option_conflicts(self) -> list[str]:
        """Options that contradict each other: checked with the bounds (exit 2 on the command
        line; ``ValueError`` in ``main``)."""
        conflicts = []
        if self.noise == "fixed":
            defaults = {field.name: field.default for field in dataclasses.fields(self)}
            changed = [
                name for name in LEARNED_NOISE_OPTIONS if getattr(self, name) != defaults[name]
            ]
            if changed:
                given = " ".join(f"--{name} {getattr(self, name)}" for name in changed)
                conflicts.append(
                    f"{given}: only with --noise learned (the fixed Flow-SDE schedule's std is "
                    f"set by --noise_level and the grid)"
                )
            if self.entropy_coeff > 0:
                conflicts.append(
                    f"--entropy_coeff {self.entropy_coeff}: needs --noise learned (the fixed "
                    f"schedule's entropy does not depend on the parameters: no gradient)"
                )
        if self.advantage != "grpo":
            return conflicts
        if self.num_envs % self.group_size:
            conflicts.append(
                f"--num_envs {self.num_envs}: must be a multiple of --group_size "
                f"{self.group_size} with --advantage grpo (groups of group_size environments "
                f"start from one initial state)"
            )
        if self.episodes_per_batch != 1:
            conflicts.append(
                f"--episodes_per_batch {self.episodes_per_batch}: must be 1 with --advantage grpo "
                f"(a batch holds one episode per environment; more groups: --num_envs)"
            )
        if self.collector_workers != 1 or self.collector_backend != "process":
            conflicts.append(
                f"--collector_workers {self.collector_workers} --collector_backend "
                f"{self.collector_backend}: must be 1 and process with --advantage grpo (the "
                f"groups are reseeded from this process before every batch)"
            )
        return conflicts


# What --quick changes: the whole chain in about a minute.
QUICK = {
    "num_envs": 4,
    "total_env_steps": 4 * 150 * 4,
    "epochs": 2,
    "minibatch_size": 76,
    "eval_every": 2,
    "checkpoint_every": 2,
    "eval_episodes": 8,
    "held_out_episodes": 8,
    "critic_warmup_iterations": 1,
    "group_size": 2,
    "pretrain.train_steps": 150,
    "pretrain.eval_episodes": 8,
    "threads": 1,
}


def parse_args(argv: list[str] | None = None) -> PPOConfig:
    """The command line (``--help``) as a :class:`PPOConfig`."""
    exclude = [f"pretrain.{name}" for name in pretrain.RUN_SETTINGS] + [
        f"pretrain.{name}" for name in pretrain.EXCLUDE
    ]
    return parse_config(
        PPOConfig,
        argv,
        description=__doc__,
        quick=QUICK,
        task_defaults=task_defaults("ppo"),  # the task's defaults: envs.tasks.TASKS
        exclude=exclude,
    )


def sampler_options(config: PPOConfig) -> SamplerOptions:
    """The flow policy's sampler settings (rollouts, learner, evaluation)."""
    return SamplerOptions(
        num_denoising_steps=config.num_denoising_steps,
        eval_num_denoising_steps=config.eval_num_denoising_steps,
        noise_level=config.noise_level,
        rollout_noise_scale=config.rollout_noise_scale,
        eval_noise_scale=config.rollout_noise_scale,
        sde_mode=config.sde_mode,
        num_sde_steps=config.num_sde_steps,
    )


def make_critic(policy: FlowSDEPolicy) -> TensorDictModule:
    """Value network on the observation, normalised with the policy's statistics, on the
    policy's device."""
    normalizer = copy.deepcopy(policy.encoder[0])
    network = nn.Sequential(
        normalizer,
        nn.Linear(normalizer.loc.numel(), 256),
        nn.Tanh(),
        nn.Linear(256, 256),
        nn.Tanh(),
        nn.Linear(256, 1),
    )
    critic = TensorDictModule(network, in_keys=["observation"], out_keys=["state_value"])
    return critic.to(normalizer.loc.device)


@dataclass
class Learner:
    """What PPO trains, and what a run checkpoint holds (:meth:`trained`); no critic (``None``)
    with ``--advantage grpo``."""

    policy: FlowSDEPolicy
    critic: TensorDictModule | None
    loss_module: DenoisingClipPPOLoss
    actor_optimizer: torch.optim.Optimizer
    critic_optimizer: torch.optim.Optimizer | None

    def trained(self) -> dict[str, Any]:
        trained = {
            "policy": self.policy,
            "critic": self.critic,
            "actor_optimizer": self.actor_optimizer,
            "critic_optimizer": self.critic_optimizer,
        }
        return {name: item for name, item in trained.items() if item is not None}


def actor_optimizer_for(policy: FlowSDEPolicy, config: PPOConfig) -> torch.optim.Optimizer:
    """Adam on the flow policy; a learned noise head (``--noise learned``) is fresh and gets
    its own learning rate."""
    actor_parameters: Any = policy.parameters()
    if policy.noise_head is not None:
        head = list(policy.noise_head.parameters())
        flow_parameters = [p for p in policy.parameters() if all(p is not h for h in head)]
        actor_parameters = [
            {"params": flow_parameters},
            {"params": head, "lr": config.noise_learning_rate},
        ]
    return torch.optim.Adam(actor_parameters, lr=config.actor_learning_rate)


def make_learner(policy: FlowSDEPolicy, config: PPOConfig, executed_chunk_length: int) -> Learner:
    """Critic, ``DenoisingClipPPOLoss`` with GAE over decisions, one Adam for each network.

    ``--advantage grpo``: no critic; the loss reads the group-relative advantage that
    :func:`group_relative_batch` writes, unnormalised (it is normalised per group already).
    """
    actor_options = {
        "clip_epsilon": (config.clip_epsilon_low, config.clip_epsilon_high),
        "kl_coeff": config.kl_coeff,
        "bc_coeff": config.bc_coeff,
        "entropy_bonus": config.entropy_coeff > 0,
        "entropy_coeff": config.entropy_coeff,
    }
    actor_optimizer = actor_optimizer_for(policy, config)
    if config.advantage == "grpo":
        loss_module = DenoisingClipPPOLoss(policy, **actor_options, normalize_advantage=False)
        return Learner(policy, None, loss_module, actor_optimizer, None)
    critic = make_critic(policy)
    loss_module = DenoisingClipPPOLoss(
        policy, critic, **actor_options, normalize_advantage=True, loss_critic_type="l2"
    )
    loss_module.make_value_estimator(
        ValueEstimators.GAE,
        gamma=decision_discount(config.gamma, executed_chunk_length),
        lmbda=config.gae_lambda,
    )
    critic_optimizer = torch.optim.Adam(critic.parameters(), lr=config.critic_learning_rate)
    return Learner(policy, critic, loss_module, actor_optimizer, critic_optimizer)


def check_config(config: PPOConfig, world_size: int) -> torch.device:
    """Refuse, before any work, what the run could not do; returns the run's device.

    Raises:
        ValueError: a number outside its option's bounds, or options that contradict each
            other (:meth:`PPOConfig.option_conflicts`; :func:`common.validate_config`);
            an unavailable ``--device``; ``num_envs`` not a multiple of
            ``collector_workers``; the Ray backend under ``torchrun``.
        ImportError: ``--collector_backend ray`` without ``ray`` installed.
        FileNotFoundError: ``--resume`` without a checkpoint in ``output_dir``.
    """
    validate_config(config)
    if config.noise == "learned" and not (
        config.min_noise_std < config.initial_noise_std < config.max_noise_std
    ):
        raise ValueError(
            f"--noise learned needs --min_noise_std < --initial_noise_std < --max_noise_std, "
            f"got {config.min_noise_std} < {config.initial_noise_std} < {config.max_noise_std}: "
            f"the std is squashed into [min, max] and starts strictly inside."
        )
    device = resolve_device(config.device)
    workers = config.collector_workers
    if workers < 1 or config.num_envs % workers:
        raise ValueError(
            f"--num_envs {config.num_envs} must be a positive multiple of --collector_workers "
            f"{workers} (each worker steps num_envs / collector_workers environments)."
        )
    if config.collector_backend == "ray" and world_size > 1:
        raise ValueError(
            "--collector_backend ray under torchrun is not supported (one RayCollector per "
            "learner rank is untested): use one learner process with Ray workers, or torchrun "
            "with --collector_backend process."
        )
    if config.collector_backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ImportError(
            "--collector_backend ray needs Ray: pip install 'torchrl_flowpolicy[ray]' (or use "
            "--collector_backend process)."
        )
    if config.resume:
        require_run_checkpoint(Path(config.output_dir) / "checkpoint.pt")
    return device


def seeded_env(config: PPOConfig, num_envs: int, executed_chunk_length: int, seed: int):
    """The chunked training env with ``num_envs`` sub-environments, seeded with ``seed``
    (sub-environment ``i`` resets first with ``seed + i``; ``seed + i // group_size`` with
    ``--advantage grpo``) and counting env steps."""
    group_size = config.group_size if config.advantage == "grpo" else 1
    env = make_task_env(
        config, num_envs, executed_chunk_length, count_steps=True, group_size=group_size
    )
    env.set_seed(seed)
    return env


def worker_env_factories(
    config: PPOConfig, workers: int, executed_chunk_length: int, seed: int
) -> list[functools.partial]:
    """One env factory per collector worker: worker ``w`` steps ``num_envs / workers``
    environments seeded from ``seed + w * num_envs / workers`` (one process's initial states)."""
    envs_per_worker = config.num_envs // workers
    return [
        functools.partial(
            seeded_env, config, envs_per_worker, executed_chunk_length, seed + w * envs_per_worker
        )
        for w in range(workers)
    ]


def make_collector(
    policy: FlowSDEPolicy,
    config: PPOConfig,
    executed_chunk_length: int,
    decisions_per_batch: int,
    seed: int,
    device: torch.device | str = "cpu",
) -> Collector | MultiSyncCollector | RayCollector:
    """An endless collector of ``decisions_per_batch`` decisions per batch on ``num_envs`` envs.

    RANDOM exploration: the Flow-SDE sampler with K = ``num_denoising_steps``. With one worker, a
    ``Collector`` in this process; with ``collector_workers = W``, a ``MultiSyncCollector``
    (or a ``RayCollector`` with ``collector_backend="ray"``, see :func:`make_ray_collector`)
    whose worker ``w`` steps ``num_envs / W`` environments: batches concatenated along the
    environment dimension, ``[num_envs, T]`` either way.

    Every batch starts from fresh resets of all environments (TorchRL's
    ``reset_at_each_iter``): no episode runs on from one batch into the next. Seed them
    before each batch with :func:`seed_batch`; environment ``i`` (over all workers) is also
    seeded with ``seed + i`` before the collector's own first reset, when it is built.

    Devices: the policy runs on ``device`` (the policy passed must be there), the simulators
    on the CPU (``env_device``), and the batches are stored on ``device``.

    ``--advantage grpo``: :func:`seed_batch` then seeds groups of ``group_size``
    environments alike (:func:`seeded_env`), so that each group starts a batch from one
    initial state.
    """
    if config.collector_backend == "ray":
        return make_ray_collector(
            policy, config, executed_chunk_length, decisions_per_batch, seed, device
        )
    workers = config.collector_workers
    options = {
        "frames_per_batch": decisions_per_batch,
        "total_frames": -1,
        "exploration_type": ExplorationType.RANDOM,
        "reset_at_each_iter": True,  # a batch starts from the resets that seed_batch seeds
        "auto_register_policy_transforms": False,  # not recurrent: no InitTracker needed
        "policy_device": device,
        "env_device": "cpu",
        "storing_device": device,
    }
    if workers == 1:
        env = seeded_env(config, config.num_envs, executed_chunk_length, seed)
        return Collector(env, policy, **options)
    return MultiSyncCollector(
        worker_env_factories(config, workers, executed_chunk_length, seed),
        policy,
        cat_results=0,
        num_threads=config.threads,
        num_sub_threads=1,
        **options,
    )


def first_reset_seed(config: PPOConfig, iteration: int, rank: int = 0, world_size: int = 1) -> int:
    """The reset seed of this process's first environment in the batch of PPO iteration
    ``iteration``: :func:`~torchrl_flowpolicy.protocol.training_seed` over the environments
    of all ``world_size`` processes, in which rank ``r``'s follow those of ranks
    ``0 .. r - 1``. With ``--advantage grpo`` the seeds count groups: group ``g`` resets
    with this seed ``+ g``."""
    units = config.num_envs  # --advantage grpo: groups, each reset with one seed
    if config.advantage == "grpo":
        units = config.num_envs // config.group_size
    first = training_seed(config.seed, iteration, world_size * units)
    return first + rank * units


def seed_batch(
    collector: Collector | MultiSyncCollector | RayCollector, config: PPOConfig, seed: int
) -> None:
    """Seed the resets that start the collector's next batch: environment ``i`` (worker
    ``w``'s environment ``j`` is ``i = w * num_envs / W + j``) resets with ``seed + i``.

    Call it before each batch with the :func:`first_reset_seed` of the iteration that the
    batch starts: a batch's initial states are then a function of the run seed and the
    iteration alone, and a resumed run starts each batch from the states of the
    uninterrupted run. TorchRL's ``map_fn`` calls each worker's
    ``env.set_seed`` (in this process for a ``Collector``).
    """
    workers = 1 if isinstance(collector, Collector) else config.collector_workers
    envs_per_worker = config.num_envs // workers
    collector.map_fn(
        "env.set_seed", [(seed + worker * envs_per_worker,) for worker in range(workers)]
    )


def merge_worker_batches(batch: TensorDictBase, device: torch.device | str) -> TensorDictBase:
    """A ``RayCollector`` batch ``[W, num_envs / W, T]`` (the workers' batches stacked) as
    ``[num_envs, T]`` on the learner's ``device``."""
    return batch.flatten(0, 1).to(device)


def make_ray_collector(
    policy: FlowSDEPolicy,
    config: PPOConfig,
    executed_chunk_length: int,
    decisions_per_batch: int,
    seed: int,
    device: torch.device | str = "cpu",
) -> RayCollector:
    """TorchRL's ``RayCollector``: ``collector_workers`` Ray actors, each a ``Collector`` of
    ``num_envs / W`` environments seeded and reset as in :func:`make_collector`, synchronous
    (a batch holds every worker's share).

    Ray: joins the cluster at ``ray_address`` (see :class:`PPOConfig`), or starts a local
    instance, unless this process is connected already. Each actor reserves one CPU (and,
    with a CUDA ``device``, TorchRL's default GPU share, 0.2, on which its policy runs).

    Weights: the actors receive a CPU copy of ``policy`` (pickled by Ray), then only what
    ``collector.update_policy_weights_(weights)`` sends (TorchRL's ``RayWeightSyncScheme``:
    a gloo process group between this process and the actors). This function sends the
    learner's current weights once, which sets that process group up; the training loop
    sends them after every update. The actors return CPU batches, moved to ``device`` here.
    """
    import ray  # the `ray` extra

    workers = config.collector_workers
    if not ray.is_initialized():
        # The actors' output stays in Ray's logs (/tmp/ray/session_latest/logs): their
        # errors still reach this process, as exceptions.
        ray.init(address=config.ray_address or None, include_dashboard=False, log_to_driver=False)
    cpus = ray.cluster_resources().get("CPU", 0)
    if cpus < workers:  # the actors would wait for CPUs forever
        raise ValueError(
            f"--collector_workers {workers} needs {workers} CPUs of the Ray cluster, which "
            f"has {cpus:g}: use fewer workers or a larger cluster (--ray_address)."
        )
    on_gpu = torch.device(device).type == "cuda"
    collector = RayCollector(
        worker_env_factories(config, workers, executed_chunk_length, seed),
        copy.deepcopy(policy).cpu(),
        frames_per_batch=decisions_per_batch,
        # RayCollector compares collected frames with total_frames: -1 would end it at once.
        total_frames=2**62,
        exploration_type=ExplorationType.RANDOM,
        collector_class=Collector,
        collector_kwargs={"auto_register_policy_transforms": False, "reset_at_each_iter": True},
        # "cuda" without an index: each actor's own GPU (Ray sets CUDA_VISIBLE_DEVICES).
        policy_device="cuda" if on_gpu else "cpu",
        env_device="cpu",
        storing_device="cpu",
        sync=True,
        remote_configs={"num_cpus": 1, "num_gpus": 0.2 if on_gpu else 0},
        postproc=functools.partial(merge_worker_batches, device=device),
    )
    collector.update_policy_weights_(TensorDict.from_module(policy))
    return collector


def make_replay_buffer(
    config: PPOConfig, decisions_per_batch: int, device: torch.device | str = "cpu"
) -> ReplayBuffer:
    """One batch of decisions on ``device``, served in ``minibatch_size`` minibatches without
    replacement (one epoch per pass)."""
    return ReplayBuffer(
        storage=LazyTensorStorage(decisions_per_batch, device=device),
        sampler=SamplerWithoutReplacement(),
        batch_size=config.minibatch_size,
    )


def episode_success_flags(batch: TensorDictBase) -> torch.Tensor:
    """Flag every decision of an episode that ended in success, ``[num_envs, T]``.

    Episodes that have not ended within the batch are not flagged.
    """
    done = batch["next", "done"].squeeze(-1)
    success = batch["next", "success"].squeeze(-1) & done
    flags = torch.zeros_like(done)
    carry = torch.zeros_like(done[:, 0])
    for step in reversed(range(done.shape[1])):
        carry = torch.where(done[:, step], success[:, step], carry)
        flags[:, step] = carry
    return flags


def group_relative_batch(batch: TensorDictBase, config: PPOConfig) -> TensorDictBase:
    """``--advantage grpo``: the decisions of each environment's first episode, ``[M]``, with
    its group-relative advantage.

    Environment ``i`` of the ``[num_envs, T]`` batch belongs to group ``i // group_size``
    (``"group_id"``, stamped on every decision); :class:`GroupRelativeAdvantage` scores the
    return of its first episode (every environment started one at the batch's reset, and
    ``T`` covers a whole episode) against its group's; the decisions after an early end (the
    next episode, which the collector started) are dropped.
    """
    environment = torch.arange(batch.shape[0], device=batch.device)
    batch["group_id"] = (environment // config.group_size).unsqueeze(-1).expand(batch.shape)
    batch = GroupRelativeAdvantage()(batch)
    return batch[batch["episode_mask"]]


def group_statistics(
    episodes: TensorDictBase, config: PPOConfig, collected_decisions: int
) -> dict[str, float]:
    """``--advantage grpo`` diagnostics of a :func:`group_relative_batch` (whose episodes end
    in the order of their environments)."""
    done = episodes["next", "done"].squeeze(-1)
    returns = episodes["episode_return"][done].reshape(-1, config.group_size)
    no_spread = returns.amax(-1) == returns.amin(-1)
    return {
        "grpo/episode_return": returns.mean().item(),
        "grpo/group_return_std": returns.std(-1).mean().item(),
        "grpo/zero_std_groups": no_spread.float().mean().item(),
        "grpo/kept_decisions": episodes.numel() / collected_decisions,
    }


def ppo_iteration(
    learner: Learner,
    batch: TensorDictBase,
    replay_buffer: ReplayBuffer,
    config: PPOConfig,
    train_actor: bool,
) -> dict[str, float]:
    """Scale rewards, flag successes, GAE, then ``epochs`` passes of minibatch updates.

    The critic is always trained, the actor only with ``train_actor``. Returns the loss
    entries averaged over the minibatches and the batch's training statistics.
    ``--advantage grpo``: the group-relative advantage of each environment's first episode
    (:func:`group_relative_batch`) instead of GAE, and the actor alone is trained.
    """
    policy, critic, loss_module = learner.policy, learner.critic, learner.loss_module
    batch["next", "reward"] = batch["next", "reward"] * config.reward_scale
    if config.bc_coeff > 0:
        batch["success"] = episode_success_flags(batch)
    collected_decisions = batch.numel()
    if critic is None:  # grpo
        batch = group_relative_batch(batch, config)
    else:
        with torch.no_grad():
            loss_module.value_estimator(batch)
    replay_buffer.empty()
    replay_buffer.extend(batch.reshape(-1))
    metrics: dict[str, list[float]] = {}
    fresh_drift = None
    for _ in range(config.epochs):
        for minibatch in replay_buffer:
            losses = loss_module(minibatch)
            if fresh_drift is None:  # before any update: the rollout/learner mismatch alarm
                fresh_drift = losses["log_prob_drift"].item()
            actor_loss = losses["loss_objective"]
            for name in ("loss_kl", "loss_bc"):
                if name in losses.keys():
                    actor_loss = actor_loss + losses[name]
            if config.entropy_coeff > 0:
                actor_loss = actor_loss + losses["loss_entropy"]
            if critic is None:  # grpo: the actor alone
                learner.actor_optimizer.zero_grad(set_to_none=True)
                actor_loss.backward()
                average_gradients(list(policy.parameters()))  # over the ranks
                torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm)
                learner.actor_optimizer.step()
            else:
                learner.critic_optimizer.zero_grad(set_to_none=True)
                learner.actor_optimizer.zero_grad(set_to_none=True)
                (losses["loss_critic"] + (actor_loss if train_actor else 0.0)).backward()
                average_gradients([*critic.parameters(), *policy.parameters()])  # over the ranks
                torch.nn.utils.clip_grad_norm_(critic.parameters(), config.max_grad_norm)
                learner.critic_optimizer.step()
                if train_actor:
                    torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm)
                    learner.actor_optimizer.step()
            for name, value in losses.items():
                metrics.setdefault(name, []).append(float(value.detach()))

    done = batch["next", "done"].squeeze(-1)
    train_success = batch["next", "success"].squeeze(-1)[done].float()
    row = {name: sum(values) / len(values) for name, values in metrics.items()}
    row["train/episode_success"] = train_success.mean().item() if done.any() else 0.0
    row["train/chunk_reward"] = batch["next", "reward"].mean().item()
    row["log_prob_drift_before_update"] = fresh_drift
    if critic is None:
        row.update(group_statistics(batch, config, collected_decisions))
    if ("flow", "step_std") in batch.keys(True):  # the rollouts' learned std
        row["train/noise_std"] = batch["flow", "step_std"][batch["flow", "sde_mask"]].mean().item()
    return row


def save_ppo_run(
    path: Path,
    learner: Learner,
    model_config: ModelConfig,
    iteration: int,
    env_steps: int,
    history: list[dict],
    task: str,
    advantage: str = "gae",
    wall_seconds: float = 0.0,
) -> None:
    """The run checkpoint ``--resume`` reads (``examples/evaluate.py`` reads its policy);
    ``task``, ``model_config``, ``advantage`` and the policy's ``noise``
    (:func:`noise_identity`) are what :func:`run_identity` compares on resume; ``noise`` also
    tells ``common.load_policy`` to rebuild the noise head. With ``--advantage grpo`` it holds
    no critic. ``wall_seconds``, the run's wall time so far, is where a resumed run's clock
    (its curve's ``wall_seconds`` and the summary's) goes on from."""
    head = learner.policy.noise_head
    noise = {"kind": "fixed"}
    if head is not None:
        noise = {"kind": "learned", "min_std": head.min_std, "max_std": head.max_std}
    save_run(
        path,
        learner.trained(),
        iteration=iteration,
        env_steps=env_steps,
        history=json.dumps(history),
        model_config=dataclasses.asdict(model_config),
        **get_task(task).checkpoint_identity(),  # the task and its observation layout
        advantage=advantage,
        noise=noise,
        wall_seconds=wall_seconds,
    )


def noise_identity(config: PPOConfig) -> dict[str, Any]:
    """The exploration noise of the run: its kind, and the learned std's bounds (as
    :func:`save_ppo_run` records them from the policy)."""
    if config.noise == "fixed":
        return {"kind": "fixed"}
    return {"kind": "learned", "min_std": config.min_noise_std, "max_std": config.max_noise_std}


# What a run checkpoint saved before an entry of run_identity was recorded implies: every run
# had a critic before GRPO and the fixed Flow-SDE noise before the noise head.
IMPLIED_IDENTITY = {"advantage": "gae", "noise": {"kind": "fixed"}}


def run_identity(config: PPOConfig, model_config: ModelConfig) -> dict[str, Any]:
    """What a resumed checkpoint must share with this run: the task, the architecture
    (chunking included) of the pretrained policy, the advantage (a critic or none) and the
    kind of exploration noise."""
    return {
        "task": config.task,
        "model_config": dataclasses.asdict(model_config),
        "advantage": config.advantage,
        "noise": noise_identity(config),
    }


def evaluation_record(
    evaluation: dict[str, float], env_steps: int, iteration: int, start: float
) -> dict[str, Any]:
    """One row of the evaluation history (``wall_seconds`` since ``start``)."""
    wall_seconds = time.perf_counter() - start
    return {
        "env_steps": env_steps,
        "iteration": iteration,
        "wall_seconds": wall_seconds,
        **evaluation,
    }


def write_summary(
    config: PPOConfig,
    baselines: dict[str, dict[str, float]],
    final: dict[str, float],
    history: list[dict],
    held_out: dict[str, Any],
    pretrained_state: dict[str, Any],
    start: float,
) -> dict[str, Any]:
    """``summary.json``: on the curve seeds the baselines (BC under both decodings, the expert)
    and the final level, the evaluation history (whose last row is the final one); the
    held-out protocol; this run's config and the pretraining summary."""
    bc = baselines["BC (sampled)"]
    summary = {
        "seed": config.seed,
        "bc_success": bc["success_rate"],
        "rl_success": final["success_rate"],
        "bc_return": bc["mean_return"],
        "rl_return": final["mean_return"],
        "bc_noise_free_success": baselines["BC (noise-free)"]["success_rate"],
        "expert_success": baselines["expert"]["success_rate"],
        "curve_baselines": baselines,
        "held_out": held_out,
        "env_steps": history[-1]["env_steps"],
        "iterations": history[-1]["iteration"],
        "eval_episodes": config.eval_episodes,
        "wall_seconds": time.perf_counter() - start,
        "history": history,
        "config": dataclasses.asdict(config),
        "pretrained": json.loads(pretrained_state.get("summary", "{}")),
    }
    write_json(Path(config.output_dir) / "summary.json", summary)
    return summary


def plot_curves(
    history: list[dict], baselines: dict[str, dict[str, float]], path: Path, title: str
) -> None:
    """Success and return against environment steps on the curve seeds; the baselines (BC
    under both decodings, the expert) as lines; success with Wilson 95 % bands."""
    steps = [row["env_steps"] for row in history]
    figure, (success_axis, return_axis) = plt.subplots(1, 2, figsize=(11, 4))
    plot_success_band(success_axis, steps, history, label="PPO (sampled)")
    plot_baselines(success_axis, baselines)
    success_axis.set(xlabel="environment steps", ylabel="success (%)", ylim=(-2, 102))
    return_axis.plot(steps, [row["mean_return"] for row in history], "o-", label="PPO (sampled)")
    for (label, row), style in zip(baselines.items(), ("--", ":", "-."), strict=False):
        return_axis.axhline(row["mean_return"], color="gray", linestyle=style, label=label)
    return_axis.set(xlabel="environment steps", ylabel="episode return")
    for axis in (success_axis, return_axis):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(
        f"{title}: deterministic evaluation (ODE, K = 20) on {history[-1]['num_episodes']} "
        f"curve episodes (seeds {CURVE_SEED}+), 95 % Wilson bands"
    )
    figure.tight_layout()
    save_figure(figure, path)
    plt.close(figure)


def main(config: PPOConfig) -> dict:
    rank, world_size = init_distributed()  # (0, 1) unless launched by torchrun
    device = check_config(config, world_size)  # unavailable device, bad split: fail now
    main_process = rank == 0
    seed_random_generators(config.seed + rank)
    torch.set_num_threads(config.threads)
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    # Pretrained policy (behaviour cloning), made first when missing (by rank 0).
    pretrained = Path(config.pretrained_checkpoint)
    if main_process and not pretrained.is_file():
        pretrain.main(pretrain.config_for_run(config))
    barrier()
    policy, model_config, pretrained_state = load_policy(
        pretrained, sampler_options(config), task=get_task(config.task)
    )
    policy.to(device)
    # --resume: the run checkpoint, refused now if corrupt or of another task or architecture.
    run_checkpoint = output_dir / "checkpoint.pt"
    saved = (
        load_run(run_checkpoint, run_identity(config, model_config), IMPLIED_IDENTITY)
        if config.resume
        else None
    )
    bc_policy = copy.deepcopy(policy)  # the pretrained policy, for the held-out protocol
    if config.noise == "learned":  # the pretrained policy has none: a fresh head for RL
        policy.noise_head = build_noise_head(
            model_config, config.min_noise_std, config.max_noise_std, config.initial_noise_std
        ).to(device)
    executed = model_config.executed_chunk_length
    max_decisions = decisions_per_episode(config.max_episode_steps, executed)

    # Evaluation env (curve seeds), the baselines: BC under both decodings, the expert.
    if main_process:
        eval_env = make_eval_env(config, config.eval_episodes, executed, device)
        baselines = curve_baselines(policy, eval_env, max_decisions, config)

    # Critic, loss, optimisers; resumed with the counters and history if asked.
    learner = make_learner(policy, config, executed)
    iteration, env_steps, history = 0, 0, []
    if saved is not None:
        saved = resume_run(saved, learner.trained())
        iteration, env_steps = saved["iteration"], saved["env_steps"]
        history = json.loads(saved["history"])
        # The wall clock goes on from the checkpoint's (older checkpoints: the last curve row).
        elapsed = saved.get("wall_seconds", history[-1]["wall_seconds"] if history else 0.0)
        start = time.perf_counter() - elapsed
        print(f"resumed from iteration {iteration} ({env_steps} env steps)")
    broadcast_parameters(learner.policy)  # every rank starts from rank 0's weights
    if learner.critic is not None:
        broadcast_parameters(learner.critic)

    # Collector (a batch: episodes_per_batch full-length episodes' decisions per env, from
    # fresh resets seeded per iteration), minibatch sampler, logger (a resumed run's CSV
    # files lose the rows logged after its checkpoint, which it logs again).
    decisions_per_batch = config.num_envs * config.episodes_per_batch * max_decisions
    seed = first_reset_seed(config, iteration + 1, rank, world_size)
    collector = make_collector(policy, config, executed, decisions_per_batch, seed, device)
    replay_buffer = make_replay_buffer(config, decisions_per_batch, device)
    if main_process:
        experiment, resume_step = f"ppo_seed{config.seed}", env_steps if saved else None
        log = MetricLogger(config.loggers, experiment, output_dir, config, resume_step).log
    # The random streams where the checkpoint left them, just before the first iteration.
    if saved is not None and world_size == 1:
        restore_random_state(saved["random_state"])
    elif saved is not None:  # the checkpoint holds rank 0's streams: one stream per rank
        seed_random_generators(config.seed + rank + 1000 * iteration)

    # Training loop: one PPO iteration per batch, evaluation, logging, checkpoints; until
    # the env-step budget is spent (a batch's env steps: its decisions' executed rows).
    progress = tqdm(
        total=config.total_env_steps,
        initial=env_steps,
        desc="PPO env steps",
        disable=not main_process,
    )
    batches = iter(collector)
    policy_weights = TensorDict.from_module(policy)  # a view: always the current weights
    while env_steps < config.total_env_steps:
        collected = time.perf_counter()
        seed = first_reset_seed(config, iteration + 1, rank, world_size)
        seed_batch(collector, config, seed)  # the batch's initial states
        batch = next(batches)
        collect_seconds = time.perf_counter() - collected
        iteration += 1
        batch_steps = sum_over_processes(count_env_steps(batch))  # of all ranks
        env_steps += batch_steps
        train_actor = config.advantage == "grpo" or iteration > config.critic_warmup_iterations
        row = ppo_iteration(learner, batch, replay_buffer, config, train_actor)
        collector.update_policy_weights_(policy_weights)  # the workers sample with them next
        row["iteration"] = iteration
        row["time/collect_seconds"] = collect_seconds
        row["time/update_seconds"] = time.perf_counter() - collected - collect_seconds
        last_iteration = env_steps >= config.total_env_steps
        if main_process and (iteration % config.eval_every == 0 or last_iteration):
            evaluation = evaluate_policy(
                policy,
                eval_env,
                max_decisions=max_decisions,
                seed=CURVE_SEED,
                num_episodes=config.eval_episodes,
            )
            history.append(evaluation_record(evaluation, env_steps, iteration, start))
            row["eval/success_rate"] = evaluation["success_rate"]
            row["eval/mean_return"] = evaluation["mean_return"]
            progress.set_postfix(success=f"{evaluation['success_rate']:.0%}")
        if main_process:  # rank 0's own diagnostics
            log({name.replace("loss_", "loss/"): value for name, value in row.items()}, env_steps)
        if main_process and iteration % config.checkpoint_every == 0:
            save_ppo_run(
                run_checkpoint,
                learner,
                model_config,
                iteration,
                env_steps,
                history,
                config.task,
                config.advantage,
                time.perf_counter() - start,
            )
        progress.update(batch_steps)
    progress.close()
    collector.shutdown()
    if config.collector_backend == "ray":
        import ray

        ray.shutdown()  # stops a local Ray instance; a cluster at --ray_address keeps running
    # A multi-process collector's shutdown raises torch's thread count by its worker count.
    torch.set_num_threads(config.threads)
    close_distributed()  # no collective call follows: rank 0 alone finishes the run
    if not main_process:
        return {}
    save_ppo_run(
        run_checkpoint,
        learner,
        model_config,
        iteration,
        env_steps,
        history,
        config.task,
        config.advantage,
        time.perf_counter() - start,
    )

    # Final evaluation (a history row unless the last iteration had one), held-out protocol
    # (BC and PPO under both decodings, the expert), plot, summary.
    final = evaluate_policy(
        policy,
        eval_env,
        max_decisions=max_decisions,
        seed=CURVE_SEED,
        num_episodes=config.eval_episodes,
    )
    eval_env.close()
    if not history or history[-1]["env_steps"] != env_steps:
        history.append(evaluation_record(final, env_steps, iteration, start))
    held_out = held_out_protocol(bc_policy, policy, config, executed, name="PPO", device=device)
    plot_curves(history, baselines, output_dir / "learning_curve.png", get_task(config.task).title)
    summary = write_summary(config, baselines, final, history, held_out, pretrained_state, start)
    bc = baselines["BC (sampled)"]
    print(
        f"curve seeds: BC success {bc['success_rate']:.1%} -> RL success "
        f"{final['success_rate']:.1%} after {env_steps} env steps "
        f"({summary['wall_seconds'] / 60:.1f} min)"
    )
    print(f"held-out seeds: {held_out['line']}")
    return summary


if __name__ == "__main__":
    main(parse_args())
