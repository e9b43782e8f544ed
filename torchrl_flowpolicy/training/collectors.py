"""Rollout collection behind one call: one process, collector processes or Ray actors,
every batch from seeded fresh resets.

:func:`make_collector` builds TorchRL's collector for a run from a small
:class:`CollectorOptions`: a ``Collector`` in this process (one worker), a
``MultiSyncCollector`` (``workers`` processes) or a ``RayCollector`` (``backend="ray"``, one
Ray actor per worker). Worker ``w`` steps ``num_envs / workers`` environments made by a
picklable :class:`TaskEnvFactory`; the batches are ``[num_envs, T]`` on ``options.device``
whatever the backend, and the policy's weights reach the workers with
``collector.update_policy_weights_(weights)``.

Seeding, the piece that makes a run resume exactly: every batch starts from fresh resets of
all environments (TorchRL's ``reset_at_each_iter``), seeded before the batch by
:func:`seed_batch` with the :func:`first_reset_seed` of its iteration, so that a batch's
initial states depend on the run seed and the iteration alone (over all workers and, under
``torchrun``, all ranks). With ``group_size > 1`` (group-relative advantages) the seeds
count groups: the ``group_size`` environments of a group start from one state.

An off-policy run (DSRL's SAC) collects with :func:`make_replay_collector` instead: one
``Collector`` whose environments keep stepping across batches, uniform random actions for
a warm-up, and as many batches as the run's env-step budget has left.

Example:
    >>> from torchrl_flowpolicy import FlowSDEPolicy, SamplerOptions
    >>> from torchrl_flowpolicy.networks import MLPVelocityNetwork
    >>> policy = FlowSDEPolicy(
    ...     MLPVelocityNetwork(23, (4, 7), hidden_dim=16), action_shape=(4, 7),
    ...     options=SamplerOptions(num_denoising_steps=4), executed_chunk_length=2,
    ... )
    >>> make_env = TaskEnvFactory("pusher", 2, {"max_episode_steps": 6})
    >>> options = CollectorOptions(num_envs=2)
    >>> seed = first_reset_seed(0, 1, 2)
    >>> collector = make_collector(policy, make_env, options, frames_per_batch=6, seed=seed)
    >>> seed_batch(collector, options, seed)
    >>> next(iter(collector)).batch_size
    torch.Size([2, 3])
    >>> shutdown_collector(collector, options)
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torchrl.collectors import Collector, MultiSyncCollector
from torchrl.envs import EnvBase, StepCounter
from torchrl.envs.utils import ExplorationType

from torchrl_flowpolicy.envs import make_chunked_env
from torchrl_flowpolicy.tasks.registry import get_task
from torchrl_flowpolicy.training.protocol import training_seed

__all__ = [
    "make_task_env",
    "env_steps",
    "TaskEnvFactory",
    "CollectorOptions",
    "make_collector",
    "make_replay_collector",
    "first_reset_seed",
    "seed_batch",
    "merge_worker_batches",
    "shutdown_collector",
]

AnyCollector = Any  # Collector | MultiSyncCollector | RayCollector (Ray is optional)


def make_task_env(
    task: str,
    num_envs: int | None,
    executed_chunk_length: int | None = None,
    *,
    task_options: Mapping[str, Any] | None = None,
    count_steps: bool = False,
    device: torch.device | str | None = None,
    group_size: int = 1,
) -> EnvBase:
    """The environment of ``task`` with its settings ``task_options`` (the keyword
    arguments of the task's factory, :meth:`~torchrl_flowpolicy.tasks.registry.Task.options`),
    chunked when ``executed_chunk_length`` is given.

    With ``count_steps``, TorchRL's :class:`~torchrl.envs.StepCounter` runs on every
    environment step (before the chunking): a decision's ``("next", "step_count") -
    "step_count"`` is the number of env steps it executed (:func:`env_steps`). ``device``
    is the TorchRL device of the environment's tensors (the simulators run on the CPU).
    ``group_size``: the sub-environments that ``env.set_seed`` seeds alike
    (:class:`~torchrl_flowpolicy.envs.BatchedGymEnv`).
    """
    make_env = get_task(task).make_env
    env = make_env(num_envs, None, device=device, group_size=group_size, **(task_options or {}))
    if count_steps:
        env.append_transform(StepCounter())
    if executed_chunk_length is None:
        return env
    return make_chunked_env(env, executed_chunk_length)


def env_steps(batch: TensorDictBase) -> int:
    """The environment steps a batch of decisions executed (needs :func:`make_task_env`'s
    ``count_steps``)."""
    return int((batch["next", "step_count"] - batch["step_count"]).sum())


@dataclass(frozen=True)
class TaskEnvFactory:
    """The training environments of a task, as a picklable recipe (what collector worker
    processes and Ray actors build their environments with).

    ``factory(num_envs, seed)``: ``num_envs`` chunked sub-environments counting env steps,
    sub-environment ``i`` reset first with ``seed + i // group_size``.

    Attributes:
        task: the task's name (:data:`~torchrl_flowpolicy.tasks.TASKS`).
        executed_chunk_length: rows executed per decision.
        task_options: the task factory's keyword arguments (horizon, reward, ...).
        group_size: sub-environments seeded alike (group-relative advantages).
    """

    task: str
    executed_chunk_length: int
    task_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    group_size: int = 1

    def __call__(self, num_envs: int, seed: int) -> EnvBase:
        env = make_task_env(
            self.task,
            num_envs,
            self.executed_chunk_length,
            task_options=dict(self.task_options),
            count_steps=True,
            group_size=self.group_size,
        )
        env.set_seed(seed)
        return env


@dataclass(frozen=True)
class CollectorOptions:
    """How a run collects its batches.

    Attributes:
        num_envs: environments over all workers (a multiple of ``workers``).
        workers: 1: collection in this process; more: worker processes or Ray actors.
        backend: ``"process"`` (TorchRL's ``Collector`` / ``MultiSyncCollector``) or
            ``"ray"`` (TorchRL's ``RayCollector``; needs the ``ray`` extra).
        worker_threads: torch threads of the collector worker processes.
        ray_address: the Ray cluster (empty: ``RAY_ADDRESS``, the cluster of ``ray start``
            on this machine, else a new local instance; ``"auto"``: an existing one).
        device: the policy's and the stored batches' device (the simulators stay on the CPU).
    """

    num_envs: int
    workers: int = 1
    backend: Literal["process", "ray"] = "process"
    worker_threads: int = 1
    ray_address: str = ""
    device: torch.device | str = "cpu"

    def __post_init__(self):
        if self.workers < 1 or self.num_envs % self.workers:
            raise ValueError(
                f"num_envs={self.num_envs} must be a positive multiple of workers="
                f"{self.workers} (each worker steps num_envs / workers environments)."
            )
        if self.backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ImportError(
                "the ray backend needs Ray: pip install 'torchrl_flowpolicy[ray]' (or collect "
                "with the process backend)."
            )

    @property
    def envs_per_worker(self) -> int:
        return self.num_envs // self.workers


def _worker_env_factories(make_env: TaskEnvFactory, options: CollectorOptions, seed: int):
    """One env factory per worker: worker ``w`` steps ``num_envs / workers`` environments
    seeded from ``seed + w * num_envs / workers`` (one process's initial states)."""
    per_worker = options.envs_per_worker
    return [
        functools.partial(make_env, per_worker, seed + w * per_worker)
        for w in range(options.workers)
    ]


def make_collector(
    policy: nn.Module,
    make_env: TaskEnvFactory,
    options: CollectorOptions,
    *,
    frames_per_batch: int,
    seed: int,
) -> AnyCollector:
    """An endless collector of ``frames_per_batch`` decisions per batch, under
    RANDOM exploration, every batch from fresh resets (seed them with :func:`seed_batch`).

    Environment ``i`` (over all workers) is also seeded with ``seed + i`` when it is built,
    before the collector's own first reset. The policy passed must be on ``options.device``.
    Ray: see :func:`_make_ray_collector`.
    """
    if options.backend == "ray":
        return _make_ray_collector(policy, make_env, options, frames_per_batch, seed)
    settings = {
        "frames_per_batch": frames_per_batch,
        "total_frames": -1,
        "exploration_type": ExplorationType.RANDOM,
        "reset_at_each_iter": True,  # a batch starts from the resets that seed_batch seeds
        "auto_register_policy_transforms": False,  # not recurrent: no InitTracker needed
        "policy_device": options.device,
        "env_device": "cpu",
        "storing_device": options.device,
    }
    if options.workers == 1:
        return Collector(make_env(options.num_envs, seed), policy, **settings)
    return MultiSyncCollector(
        _worker_env_factories(make_env, options, seed),
        policy,
        cat_results=0,
        num_threads=options.worker_threads,
        num_sub_threads=1,
        **settings,
    )


def make_replay_collector(
    actor: nn.Module,
    env: EnvBase,
    *,
    decisions_per_batch: int,
    executed_chunk_length: int,
    random_env_steps: int,
    remaining_env_steps: int,
    buffered_decisions: int,
    seed: int,
) -> Collector:
    """An off-policy run's collector: TorchRL's ``Collector`` in this process, RANDOM
    exploration (actions sampled from ``actor``), uniform random actions for the first
    ``random_env_steps`` (less the ``buffered_decisions`` a resumed run's buffer already
    holds), and batches of ``decisions_per_batch`` until ``remaining_env_steps`` are spent
    (counting ``executed_chunk_length`` env steps per decision: an upper bound).

    The collector resets ``env`` when it is built, so the env is seeded first with ``seed``
    (that of the first batch it collects); its later resets continue each environment's
    stream. Its batches are on ``env.device`` (the actor's, the env's tensors').
    """
    steps_per_batch = decisions_per_batch * executed_chunk_length
    random_decisions = max(random_env_steps // executed_chunk_length - buffered_decisions, 0)
    random_decisions = -(-random_decisions // decisions_per_batch) * decisions_per_batch
    remaining_batches = -(-max(remaining_env_steps, 0) // steps_per_batch)
    env.set_seed(seed)
    return Collector(
        env,
        actor,
        frames_per_batch=decisions_per_batch,
        total_frames=remaining_batches * decisions_per_batch,  # 0: a finished run
        init_random_frames=random_decisions,
        exploration_type=ExplorationType.RANDOM,
        auto_register_policy_transforms=False,  # the actor is not recurrent
        device=env.device,
    )


def first_reset_seed(
    seed: int,
    iteration: int,
    num_envs: int,
    *,
    group_size: int = 1,
    rank: int = 0,
    world_size: int = 1,
) -> int:
    """The reset seed of this process's first environment in the batch of iteration
    ``iteration`` of a run seeded with ``seed``:
    :func:`~torchrl_flowpolicy.training.protocol.training_seed` over the environments of all
    ``world_size`` processes, in which rank ``r``'s follow those of ranks ``0 .. r - 1``.
    With ``group_size > 1`` the seeds count groups (group ``g`` resets with this seed ``+ g``).

    Example:
        >>> first_reset_seed(0, 1, 16), first_reset_seed(0, 1, 16, rank=1, world_size=2)
        (0, 16)
    """
    units = num_envs // group_size
    return training_seed(seed, iteration, world_size * units) + rank * units


def seed_batch(collector: AnyCollector, options: CollectorOptions, seed: int) -> None:
    """Seed the resets that start the collector's next batch: environment ``i`` (worker
    ``w``'s environment ``j`` is ``i = w * num_envs / workers + j``) resets with ``seed + i``.

    Call it before each batch with the :func:`first_reset_seed` of the iteration that the
    batch starts: a resumed run then starts each batch from the states of the uninterrupted
    run. TorchRL's ``map_fn`` calls each worker's ``env.set_seed`` (in this process for a
    ``Collector``).
    """
    workers = 1 if isinstance(collector, Collector) else options.workers
    per_worker = options.num_envs // workers
    collector.map_fn("env.set_seed", [(seed + worker * per_worker,) for worker in range(workers)])


def merge_worker_batches(batch: TensorDictBase, device: torch.device | str) -> TensorDictBase:
    """A ``RayCollector`` batch ``[W, num_envs / W, T]`` (the workers' batches stacked) as
    ``[num_envs, T]`` on the learner's ``device``."""
    return batch.flatten(0, 1).to(device)


def _make_ray_collector(
    policy: nn.Module,
    make_env: TaskEnvFactory,
    options: CollectorOptions,
    frames_per_batch: int,
    seed: int,
) -> AnyCollector:
    """TorchRL's ``RayCollector``: ``workers`` Ray actors, each a ``Collector`` of
    ``num_envs / workers`` environments seeded and reset as in :func:`make_collector`,
    synchronous (a batch holds every worker's share).

    Ray: joins the cluster at ``ray_address``, or starts a local instance, unless this
    process is connected already. Each actor reserves one CPU (and, with a CUDA ``device``,
    TorchRL's default GPU share, 0.2, on which its policy runs).

    Weights: the actors receive a CPU copy of ``policy`` (pickled by Ray), then only what
    ``collector.update_policy_weights_(weights)`` sends (TorchRL's ``RayWeightSyncScheme``:
    a gloo process group between this process and the actors). The current weights are
    sent once here, which sets that process group up. The actors return CPU batches, moved
    to ``device`` (:func:`merge_worker_batches`).

    Raises:
        ValueError: the cluster has fewer CPUs than ``workers`` (the actors would wait).
    """
    import ray  # the `ray` extra
    from torchrl.collectors.distributed import RayCollector

    if not ray.is_initialized():
        # The actors' output stays in Ray's logs (/tmp/ray/session_latest/logs): their
        # errors still reach this process, as exceptions.
        ray.init(address=options.ray_address or None, include_dashboard=False, log_to_driver=False)
    cpus = ray.cluster_resources().get("CPU", 0)
    if cpus < options.workers:
        raise ValueError(
            f"--collector_workers {options.workers} needs {options.workers} CPUs of the Ray "
            f"cluster, which has {cpus:g}: use fewer workers or a larger cluster (--ray_address)."
        )
    on_gpu = torch.device(options.device).type == "cuda"
    collector = RayCollector(
        _worker_env_factories(make_env, options, seed),
        copy.deepcopy(policy).cpu(),
        frames_per_batch=frames_per_batch,
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
        postproc=functools.partial(merge_worker_batches, device=options.device),
    )
    collector.update_policy_weights_(TensorDict.from_module(policy))
    return collector


def shutdown_collector(
    collector: AnyCollector, options: CollectorOptions, num_threads: int | None = None
) -> None:
    """Stop the collector and its workers; with Ray, a local Ray instance too (a cluster
    at ``ray_address`` keeps running). A multi-process collector's shutdown raises torch's
    thread count by its worker count: ``num_threads`` sets it back."""
    collector.shutdown()
    if options.backend == "ray":
        import ray

        ray.shutdown()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
