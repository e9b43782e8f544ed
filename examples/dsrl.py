"""DSRL on Pusher-v5: stock TorchRL SAC in the initial-noise space of a frozen flow policy.

Pipeline: the pretrained flow policy (made by ``examples/pretrain.py`` if its checkpoint is
missing) is frozen; :class:`~torchrl_flowpolicy.dsrl.NoiseActionTransform` appended to the
chunked Pusher-v5 environment makes the action the policy's initial noise
``x_0 in [-m, m]^(H x D)`` and executes the chunk that the policy's deterministic ODE
(K = 20) decodes from it; TorchRL's ``SACLoss`` (two critics, automatic temperature) trains
a tanh-Gaussian noise actor on it; the deterministic evaluation decodes the actor's mean
noise on the learning-curve seeds of ``examples/ppo.py`` and compares it with the
pretrained policy's own ODE from random noise (BC) and from ``x_0 = 0`` (noise-free BC) and
with the clean scripted expert -> the evaluation protocol on held-out seeds (BC and DSRL
under both decodings, the expert, 95 % intervals; see ``torchrl_flowpolicy.protocol``; DSRL's
decodings: its actor's sampled noise, ``"sampled"``, and its mean noise, ``"noise_free"``)
-> learning-curve PNG and JSON summary.

The defaults are tuned to this policy, whose good chunks lie near ``x_0 = 0``: a small box
(m = 0.3 instead of DSRL's 1.5), the actor's mean starting at ``x_0 = 0``, critics trained
alone for the first updates; ``docs/dsrl.md`` shows the runs behind each choice.

``main`` reads top to bottom: seed, frozen pretrained policy, baselines (BC under both
decodings, the expert), noise envs, SAC learner (noise actor, critics, loss, optimisers),
replay buffer, resume, collector, training loop (collect, ``utd_ratio`` updates per decision,
log, evaluate, checkpoint), final evaluation, held-out protocol, plot, summary. ``python examples/dsrl.py --help`` lists every option;
``--quick`` runs the whole chain in under a minute; ``--resume`` continues a killed run
(replay buffer and random generators included). A resumed run is not bit-identical to an
uninterrupted one: the episodes in progress at the checkpoint are lost, and its
environments start anew from other reset seeds (``examples/ppo.py``, whose every batch
starts from fresh resets, resumes exactly). ``--device cuda`` puts the frozen policy, the
SAC networks, the loss, the environments' tensors and the replay buffer on the GPU; the
simulators stay on the CPU.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict, TensorDictBase  # noqa: E402
from tensordict.nn import TensorDictModule  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torchrl.collectors import Collector  # noqa: E402
from torchrl.data import Composite, LazyTensorStorage, RandomSampler, ReplayBuffer  # noqa: E402
from torchrl.envs import EnvBase  # noqa: E402
from torchrl.envs.utils import ExplorationType  # noqa: E402
from torchrl.modules import (  # noqa: E402
    MLP,
    NormalParamExtractor,
    ProbabilisticActor,
    TanhNormal,
    ValueOperator,
)
from torchrl.objectives import SACLoss, SoftUpdate  # noqa: E402
from tqdm import tqdm  # noqa: E402

from torchrl_flowpolicy import FlowSDEPolicy  # noqa: E402
from torchrl_flowpolicy.dsrl import DECODED_ACTION_KEY, NoiseActionTransform  # noqa: E402
from torchrl_flowpolicy.envs import decision_discount, get_task  # noqa: E402
from torchrl_flowpolicy.evaluation import evaluate_policy  # noqa: E402
from torchrl_flowpolicy.protocol import CURVE_SEED, training_seed  # noqa: E402
from torchrl_flowpolicy.sampler import SamplerOptions  # noqa: E402

import pretrain  # noqa: E402
from common import (
    MetricLogger,
    ModelConfig,
    TaskOptions,  # noqa: E402
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


@dataclass
class DSRLConfig(TaskOptions):
    """DSRL (SAC on the noise) settings; every field is a command-line option."""

    seed: int = option(
        0, "seeds torch, the environments and the pretraining when it runs", minimum=0
    )
    output_dir: str = option("outputs/dsrl", "checkpoints, logs, plot and summary")
    pretrained_checkpoint: str = option(
        "outputs/pretrain/policy.pt", "the behaviour-cloned policy (pretrained here if missing)"
    )
    num_envs: int = option(16, "environments stepped in the collector's process", minimum=1)
    decisions_per_batch: int = option(
        2, "decisions per environment between two rounds of updates", minimum=1
    )
    total_env_steps: int = option(300_000, "environment steps of fine-tuning", minimum=1)
    random_env_steps: int = option(
        5_000, "first env steps act with uniform noise (no updates before)", minimum=0
    )
    eval_num_denoising_steps: int = option(
        20, "K of the decoding ODE (training, evaluation and BC)", minimum=1
    )
    # DSRL noise space and SAC.
    noise_bound: float = option(
        0.3, "m: the noise action lies in [-m, m]^(H x D) (DSRL: 1.5)", above=0
    )
    utd_ratio: float = option(
        0.25, "gradient updates per collected decision (DSRL goes up to 20)", above=0
    )
    batch_size: int = option(256, "decisions per update", minimum=1)
    buffer_size: int = option(
        0, "replay capacity in decisions (0: every decision of the run)", minimum=0
    )
    hidden_dim: int = option(256, "width of the actor's and critics' LayerNorm MLPs", minimum=1)
    num_layers: int = option(3, "hidden layers of the actor and of each critic", minimum=0)
    actor_learning_rate: float = option(1e-4, "Adam on the noise actor", above=0)
    critic_learning_rate: float = option(3e-4, "Adam on the two critics", above=0)
    alpha_learning_rate: float = option(
        3e-4, "Adam on log(alpha), the entropy temperature", above=0
    )
    alpha_init: float = option(
        0.01, "initial entropy temperature (the noise has H * D = 56 dims)", above=0
    )
    zero_mean_init: bool = option(True, "start the actor's mean at x_0 = 0 (the noise-free chunk)")
    critic_warmup_updates: int = option(
        2_000, "first updates train the critics only (actor and alpha wait)", minimum=0
    )
    target_entropy_per_dim: float = option(
        float("nan"),
        "SAC target entropy per noise dimension; nan: log(m) - 1, SAC's -1 of the box "
        "[-1, 1] carried to [-m, m] (must stay below log(2m), the uniform noise's entropy)",
    )
    gamma: float = option(
        0.99, "discount per env step; per decision: gamma ** executed rows", minimum=0, maximum=1
    )
    tau: float = option(0.005, "Polyak rate of the target critics", above=0, maximum=1)
    reward_scale: float = option(
        10.0, "multiplies the summed chunk reward (about 0.1 per decision)", above=0
    )
    # Evaluation, logging, checkpoints.
    eval_every_env_steps: int = option(
        20_000, "env steps between deterministic evaluations", minimum=1
    )
    eval_episodes: int = option(
        50, "learning-curve episodes (curve seeds 10000+, as BC's)", minimum=1
    )
    held_out_episodes: int = option(
        200, "final protocol episodes (held-out seeds 30000+: used by nothing else)", minimum=1
    )
    reported_decoding: Literal["sampled", "noise_free"] = option(
        "noise_free",
        "DSRL's decoding reported on the held-out states: the actor's mean noise (noise_free, "
        "DSRL's deterministic policy) or sampled noise; fixed before looking at held-out numbers",
    )
    log_every_env_steps: int = option(2_000, "env steps between logged training metrics", minimum=1)
    checkpoint_every_env_steps: int = option(20_000, "env steps between checkpoints", minimum=1)
    loggers: str = option("wandb,csv", "TorchRL loggers, comma-separated (wandb runs offline)")
    resume: bool = option(False, "continue from output_dir/checkpoint.pt")
    threads: int = option(1, "torch CPU threads (1 is fastest for these small networks)", minimum=1)
    device: str = option(
        "cpu", "torch device of the policies, SAC networks, loss, env tensors and replay buffer"
    )
    pretrain: pretrain.PretrainConfig = option(
        default_factory=pretrain.PretrainConfig,
        help="behaviour cloning, run when pretrained_checkpoint is missing (with this run's "
        "seed and task settings; it writes pretrained_checkpoint)",
    )


# What --quick changes: the whole chain in under a minute.
QUICK = {
    "num_envs": 4,
    "total_env_steps": 4 * 150 * 2,
    "random_env_steps": 4 * 150 // 2,
    "utd_ratio": 1.0,
    "critic_warmup_updates": 50,
    "batch_size": 64,
    "hidden_dim": 64,
    "eval_every_env_steps": 600,
    "log_every_env_steps": 300,
    "checkpoint_every_env_steps": 600,
    "eval_episodes": 8,
    "held_out_episodes": 8,
    "pretrain.train_steps": 150,
    "pretrain.eval_episodes": 8,
}


def parse_args(argv: list[str] | None = None) -> DSRLConfig:
    """The command line (``--help``) as a :class:`DSRLConfig`."""
    exclude = [f"pretrain.{name}" for name in (*pretrain.RUN_SETTINGS, *pretrain.EXCLUDE)]
    return parse_config(
        DSRLConfig,
        argv,
        description=__doc__,
        quick=QUICK,
        task_defaults=task_defaults("dsrl"),  # the task's defaults: envs.tasks.TASKS
        exclude=exclude,
    )


def target_entropy_per_dim(config: DSRLConfig) -> float:
    """The SAC target entropy per noise dimension (see ``DSRLConfig.target_entropy_per_dim``)."""
    target = config.target_entropy_per_dim
    if math.isnan(target):
        target = math.log(config.noise_bound) - 1.0
    if target >= math.log(2 * config.noise_bound):
        raise ValueError(
            f"target_entropy_per_dim={target} is not below log(2 m) = "
            f"{math.log(2 * config.noise_bound):.3f}, the entropy of the uniform noise over "
            f"[-m, m] (m = noise_bound = {config.noise_bound}): the temperature would grow "
            "without bound. Leave it at nan (log(m) - 1) or lower it."
        )
    return target


def layer_norm_mlp(in_features: int, out_features: int, config: DSRLConfig) -> MLP:
    """``num_layers`` hidden layers of ``hidden_dim`` units, each Linear -> LayerNorm -> ReLU."""
    return MLP(
        in_features=in_features,
        out_features=out_features,
        num_cells=[config.hidden_dim] * config.num_layers,
        norm_class=nn.LayerNorm,
        norm_kwargs={"normalized_shape": config.hidden_dim},
        activation_class=nn.ReLU,
    )


def make_actor(
    policy: FlowSDEPolicy, noise_spec: Composite, config: DSRLConfig
) -> ProbabilisticActor:
    """Tanh-Gaussian over the noise box ``[-m, m]^(H x D)``, conditioned on the observation,
    on the policy's device."""
    chunk_length, action_dim = policy.action_shape
    network = nn.Sequential(
        copy.deepcopy(policy.encoder[0]),  # the pretrained policy's observation normaliser
        layer_norm_mlp(policy.encoder[0].loc.numel(), 2 * chunk_length * action_dim, config),
        nn.Unflatten(-1, (chunk_length, 2 * action_dim)),
        NormalParamExtractor(),  # [.., H, 2D] -> loc [.., H, D], scale [.., H, D]
    )
    if config.zero_mean_init:
        # The output layer's loc half of every row -> 0: the actor's mean noise starts at 0.
        output_layer = [module for module in network.modules() if isinstance(module, nn.Linear)][-1]
        is_loc = (torch.arange(output_layer.out_features) % (2 * action_dim)) < action_dim
        with torch.no_grad():
            output_layer.weight[is_loc] = 0.0
            output_layer.bias[is_loc] = 0.0
    network.to(policy.encoder[0].loc.device)
    return ProbabilisticActor(
        TensorDictModule(network, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"],
        spec=noise_spec,
        distribution_class=TanhNormal,
        distribution_kwargs={
            "low": -config.noise_bound,
            "high": config.noise_bound,
            "event_dims": 2,  # one log-probability per [H, D] noise
        },
    )


class NoiseQNetwork(nn.Module):
    """``Q(observation, noise)``: a LayerNorm MLP on the normalised observation and the noise."""

    def __init__(self, normalizer: nn.Module, noise_numel: int, config: DSRLConfig):
        super().__init__()
        self.normalizer = normalizer
        self.mlp = layer_norm_mlp(normalizer.loc.numel() + noise_numel, 1, config)

    def forward(self, observation: Tensor, noise: Tensor) -> Tensor:
        features = torch.cat([self.normalizer(observation), noise.flatten(-2)], dim=-1)
        return self.mlp(features)


def make_critic(policy: FlowSDEPolicy, config: DSRLConfig) -> ValueOperator:
    """One critic ``Q(observation, noise)`` on the policy's device; ``SACLoss`` makes two with
    separate weights."""
    network = NoiseQNetwork(copy.deepcopy(policy.encoder[0]), policy.action_shape.numel(), config)
    network.to(policy.encoder[0].loc.device)
    return ValueOperator(network, in_keys=["observation", "action"])


def plot_curves(history: list[dict], baselines: dict[str, dict], path: Path, title: str) -> None:
    """Success and return against environment steps, success against wall time, on the
    curve seeds; the baselines (BC under both decodings, the expert) as lines; success with
    Wilson 95 % bands."""
    steps = [row["env_steps"] for row in history]
    minutes = [row["wall_seconds"] / 60 for row in history]
    figure, (success_axis, return_axis, time_axis) = plt.subplots(1, 3, figsize=(16, 4))
    for axis, x in ((success_axis, steps), (time_axis, minutes)):
        plot_success_band(axis, x, history, label="DSRL (mean noise)")
        plot_baselines(axis, baselines)
    success_axis.set(xlabel="environment steps", ylabel="success (%)", ylim=(-2, 102))
    return_axis.plot(steps, [row["mean_return"] for row in history], "o-", label="DSRL")
    return_axis.set(xlabel="environment steps", ylabel="episode return")
    time_axis.set(xlabel="training wall time (min)", ylabel="success (%)", ylim=(-2, 102))
    for (label, baseline), style in zip(baselines.items(), ("--", ":", "-."), strict=False):
        return_axis.axhline(baseline["mean_return"], color="gray", linestyle=style, label=label)
    for axis in (success_axis, return_axis, time_axis):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(
        f"{title} DSRL: deterministic evaluation (mean noise, ODE K = 20) on "
        f"{history[-1]['num_episodes']} curve episodes (seeds {CURVE_SEED}+), 95 % Wilson bands"
    )
    figure.tight_layout()
    save_figure(figure, path)
    plt.close(figure)


def make_noise_env(
    policy: FlowSDEPolicy, config: DSRLConfig, num_envs: int, executed_chunk_length: int
) -> EnvBase:
    """``num_envs`` chunked task envs whose action is the frozen policy's noise (counting
    env steps), their tensors on the policy's device (the simulators run on the CPU)."""
    device = policy.encoder[0].loc.device
    env = make_task_env(config, num_envs, executed_chunk_length, count_steps=True, device=device)
    return env.append_transform(NoiseActionTransform(policy, noise_bound=config.noise_bound))


@dataclass
class Learner:
    """SAC on the noise: the loss (actor, two critics, temperature), its target updates and
    one Adam per part; :meth:`trained` is what a run checkpoint holds."""

    loss_module: SACLoss
    target_updater: SoftUpdate
    actor_optimizer: torch.optim.Optimizer
    critic_optimizer: torch.optim.Optimizer
    alpha_optimizer: torch.optim.Optimizer

    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        return (self.actor_optimizer, self.critic_optimizer, self.alpha_optimizer)

    def trained(self) -> dict[str, Any]:
        return {
            "loss_module": self.loss_module,
            "actor_optimizer": self.actor_optimizer,
            "critic_optimizer": self.critic_optimizer,
            "alpha_optimizer": self.alpha_optimizer,
        }


def make_learner(
    policy: FlowSDEPolicy, noise_spec: Composite, config: DSRLConfig, executed_chunk_length: int
) -> tuple[ProbabilisticActor, Learner]:
    """The noise actor and its SAC learner (automatic temperature, decision discount)."""
    actor = make_actor(policy, noise_spec, config)
    critic = make_critic(policy, config)
    loss_module = SACLoss(
        actor,
        critic,
        num_qvalue_nets=2,
        loss_function="l2",
        alpha_init=config.alpha_init,
        action_spec=noise_spec,
        target_entropy=target_entropy_per_dim(config) * policy.action_shape.numel(),
    )
    loss_module.make_value_estimator(gamma=decision_discount(config.gamma, executed_chunk_length))
    target_updater = SoftUpdate(loss_module, tau=config.tau)
    actor_optimizer = torch.optim.Adam(
        loss_module.actor_network_params.values(True, True), lr=config.actor_learning_rate
    )
    critic_optimizer = torch.optim.Adam(
        loss_module.qvalue_network_params.values(True, True), lr=config.critic_learning_rate
    )
    alpha_optimizer = torch.optim.Adam([loss_module.log_alpha], lr=config.alpha_learning_rate)
    learner = Learner(
        loss_module, target_updater, actor_optimizer, critic_optimizer, alpha_optimizer
    )
    return actor, learner


@dataclass
class Progress:
    """The counters and evaluation history of a run (saved in its checkpoint)."""

    iteration: int = 0
    env_steps: int = 0
    updates: int = 0
    update_credit: float = 0.0  # updates owed: utd_ratio per collected decision
    wall_seconds: float = 0.0  # training wall time at the last checkpoint
    history: list[dict] = field(default_factory=list)


@dataclass
class LogWindow:
    """Training metrics and timings gathered between two logged rows."""

    metrics: dict[str, list[float]] = field(default_factory=dict)
    collect_seconds: float = 0.0
    update_seconds: float = 0.0
    env_steps: int = 0
    updates: int = 0

    def add(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(value)

    def row(self, updates: int) -> dict[str, float]:
        """The means, the throughput and the update count, with ``loss_*`` as ``loss/*``."""
        row = {name: sum(values) / len(values) for name, values in self.metrics.items()}
        row["perf/env_steps_per_second"] = self.env_steps / max(self.collect_seconds, 1e-9)
        if self.updates:
            row["perf/updates_per_second"] = self.updates / max(self.update_seconds, 1e-9)
        row["updates"] = updates
        return {name.replace("loss_", "loss/"): value for name, value in row.items()}


def dsrl_iteration(
    batch: TensorDictBase,
    learner: Learner,
    replay_buffer: ReplayBuffer,
    run: Progress,
    window: LogWindow,
    config: DSRLConfig,
    executed_chunk_length: int,
) -> None:
    """Count and record a collected batch, store it, then make the updates it pays for.

    ``utd_ratio`` updates per collected decision (the fraction carried over in
    ``run.update_credit``), once the buffer holds the uniform-noise warm-up.
    """
    done = batch["next", "done"].squeeze(-1)
    new_env_steps = count_env_steps(batch)
    run.iteration += 1
    run.env_steps += new_env_steps
    window.env_steps += new_env_steps
    if done.any():
        window.add(
            "train/episode_success",
            batch["next", "success"].squeeze(-1)[done].float().mean().item(),
        )
    window.add("train/chunk_reward", batch["next", "reward"].mean().item())
    window.add("train/noise_abs", batch["action"].abs().mean().item())
    window.add("train/chunk_abs", batch[("next", *DECODED_ACTION_KEY)].abs().mean().item())
    batch["next", "reward"] = batch["next", "reward"] * config.reward_scale
    # The decoded chunks are logged above; the learner never needs them.
    decoded = DECODED_ACTION_KEY[0]
    replay_buffer.extend(batch.exclude(decoded, ("next", decoded)).reshape(-1))

    update_start = time.perf_counter()
    if len(replay_buffer) >= max(
        config.random_env_steps // executed_chunk_length, config.batch_size
    ):
        run.update_credit += config.utd_ratio * batch.numel()
        while run.update_credit >= 1.0:
            run.update_credit -= 1.0
            sac_update(learner, replay_buffer.sample(), run, window, config)
    window.update_seconds += time.perf_counter() - update_start


def sac_update(
    learner: Learner,
    minibatch: TensorDictBase,
    run: Progress,
    window: LogWindow,
    config: DSRLConfig,
) -> None:
    """One gradient step of SAC (of the critics only during ``critic_warmup_updates``)."""
    losses = learner.loss_module(minibatch)
    if run.updates < config.critic_warmup_updates:
        # The critics learn first: the actor would follow an untrained Q.
        loss, stepped = losses["loss_qvalue"], (learner.critic_optimizer,)
    else:
        loss = losses["loss_actor"] + losses["loss_qvalue"] + losses["loss_alpha"]
        stepped = learner.optimizers()
    for optimizer in learner.optimizers():
        optimizer.zero_grad(set_to_none=True)
    loss.backward()
    for optimizer in stepped:
        optimizer.step()
    learner.target_updater.step()
    run.updates += 1
    window.updates += 1
    for name in ("loss_actor", "loss_qvalue", "loss_alpha", "alpha", "entropy"):
        window.add(name, losses[name].item())


@dataclass
class Evaluator:
    """Deterministic evaluation of the noise actor (its mean noise, decoded by the frozen
    ODE) on the fixed seeds: a row of the run's history, logged."""

    actor: ProbabilisticActor
    env: EnvBase
    max_decisions: int
    seed: int
    num_episodes: int
    log: Any

    def __call__(self, run: Progress, wall_seconds: float) -> dict[str, float]:
        evaluation = evaluate_policy(
            self.actor,
            self.env,
            max_decisions=self.max_decisions,
            seed=self.seed,
            num_episodes=self.num_episodes,
        )
        row = {"env_steps": run.env_steps, "iteration": run.iteration, "updates": run.updates}
        run.history.append({**row, "wall_seconds": wall_seconds, **evaluation})
        metrics = {f"eval/{name}": evaluation[name] for name in ("success_rate", "mean_return")}
        self.log(metrics, run.env_steps)
        return evaluation


def make_collector(
    actor: ProbabilisticActor,
    train_env: EnvBase,
    config: DSRLConfig,
    executed_chunk_length: int,
    buffered: int,
    run: Progress,
) -> Collector:
    """RANDOM exploration (noise sampled from the actor), uniform noise for the first
    ``random_env_steps`` (less what the buffer already holds, ``buffered`` decisions).

    The collector resets its env when it is built, so the env is seeded first, with the
    seeds of the first batch it collects (:func:`~torchrl_flowpolicy.protocol.training_seed`
    of iteration ``run.iteration + 1``); its later resets continue each environment's stream.
    """
    decisions_per_batch = config.num_envs * config.decisions_per_batch
    steps_per_batch = decisions_per_batch * executed_chunk_length  # an upper bound
    random_decisions = max(config.random_env_steps // executed_chunk_length - buffered, 0)
    random_decisions = -(-random_decisions // decisions_per_batch) * decisions_per_batch
    remaining_batches = -(-max(config.total_env_steps - run.env_steps, 0) // steps_per_batch)
    train_env.set_seed(training_seed(config.seed, run.iteration + 1, config.num_envs))
    return Collector(
        train_env,
        actor,
        frames_per_batch=decisions_per_batch,
        total_frames=remaining_batches * decisions_per_batch,  # 0: a finished run
        init_random_frames=random_decisions,
        exploration_type=ExplorationType.RANDOM,
        auto_register_policy_transforms=False,  # the actor is not recurrent
        device=train_env.device,  # the actor's, the env's tensors' and the batches' device
    )


def save_dsrl_run(
    path: Path,
    learner: Learner,
    replay_buffer: ReplayBuffer,
    run: Progress,
    identity: dict[str, Any],
) -> None:
    """The run checkpoint ``--resume`` reads: learner, stored decisions, counters and the
    run's :func:`run_identity` (task, pretrained architecture, SAC networks)."""
    save_run(
        path,
        learner.trained(),
        # The stored decisions only (not the empty capacity), as plain tensors.
        replay_buffer=replay_buffer[: len(replay_buffer)].to_dict(),
        buffer_length=len(replay_buffer),
        **{**dataclasses.asdict(run), "history": json.dumps(run.history)},
        **identity,
    )


def run_identity(config: DSRLConfig, model_config: ModelConfig) -> dict[str, Any]:
    """What a resumed checkpoint must share with this run: the task, the architecture
    (chunking included) of the pretrained policy and the sizes of the SAC networks."""
    return {
        "task": config.task,
        "model_config": dataclasses.asdict(model_config),
        "networks": {"hidden_dim": config.hidden_dim, "num_layers": config.num_layers},
    }


def resume_dsrl_run(
    saved: dict[str, Any], learner: Learner, replay_buffer: ReplayBuffer
) -> tuple[Progress, dict[str, Any]]:
    """Load a :func:`save_dsrl_run` checkpoint, as :func:`common.load_run` returned it, into
    ``learner`` and ``replay_buffer``; returns the counters and the random generators' state
    (for :func:`common.restore_random_state`)."""
    saved = resume_run(saved, learner.trained())
    stored, length = saved.pop("replay_buffer"), saved.pop("buffer_length")
    replay_buffer.extend(TensorDict(stored, batch_size=[length]))
    for name in ("task", "model_config", "networks"):
        saved.pop(name, None)
    random_state = saved.pop("random_state")
    return Progress(**{**saved, "history": json.loads(saved["history"])}), random_state


def make_replay_buffer(
    config: DSRLConfig, executed_chunk_length: int, device: torch.device | str = "cpu"
) -> ReplayBuffer:
    """Uniform sampling of ``batch_size`` decisions, stored on ``device``; by default it holds
    the whole run."""
    decisions_per_batch = config.num_envs * config.decisions_per_batch
    buffer_size = config.buffer_size or (
        config.total_env_steps // executed_chunk_length + decisions_per_batch
    )
    return ReplayBuffer(
        storage=LazyTensorStorage(buffer_size, device=device),
        sampler=RandomSampler(),
        batch_size=config.batch_size,
    )


def next_multiple(value: int, every: int) -> int:
    """The first multiple of ``every`` above ``value``."""
    return (value // every + 1) * every


def write_summary(
    config: DSRLConfig,
    baselines: dict[str, dict[str, float]],
    run: Progress,
    held_out: dict[str, Any],
    pretrained_state: dict[str, Any],
    start: float,
) -> dict[str, Any]:
    """``summary.json``: the baselines on the curve seeds (BC under both decodings, the
    expert), the final evaluation (the history's last row), counters, the held-out protocol."""
    bc, bc_noise_free = baselines["BC (sampled)"], baselines["BC (noise-free)"]
    final = run.history[-1]
    summary = {
        "seed": config.seed,
        "bc_success": bc["success_rate"],
        "rl_success": final["success_rate"],
        "bc_return": bc["mean_return"],
        "bc_noise_free_success": bc_noise_free["success_rate"],
        "bc_noise_free_return": bc_noise_free["mean_return"],
        "rl_return": final["mean_return"],
        "expert_success": baselines["expert"]["success_rate"],
        "curve_baselines": baselines,
        "held_out": held_out,
        "env_steps": run.env_steps,
        "iterations": run.iteration,
        "updates": run.updates,
        "eval_episodes": config.eval_episodes,
        "training_wall_seconds": run.wall_seconds,
        "wall_seconds": time.perf_counter() - start,
        "history": run.history,
        "config": dataclasses.asdict(config),
        "pretrained": json.loads(pretrained_state.get("summary", "{}")),
    }
    write_json(Path(config.output_dir) / "summary.json", summary)
    return summary


def main(config: DSRLConfig) -> dict:
    validate_config(config)  # a number out of bounds fails here, before any work
    device = resolve_device(config.device)  # an unavailable device fails here, not later
    run_checkpoint = Path(config.output_dir) / "checkpoint.pt"
    if config.resume:
        require_run_checkpoint(run_checkpoint)
    seed_random_generators(config.seed)
    torch.set_num_threads(config.threads)
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    # Pretrained policy (behaviour cloning), made first when missing; frozen from here on.
    pretrained = Path(config.pretrained_checkpoint)
    if not pretrained.is_file():
        pretrain.main(pretrain.config_for_run(config))
    policy, model_config, pretrained_state = load_policy(
        pretrained,
        options=SamplerOptions(eval_num_denoising_steps=config.eval_num_denoising_steps),
        task=get_task(config.task),
    )
    policy.to(device)
    # --resume: the run checkpoint, refused now if corrupt or of another task or architecture.
    identity = run_identity(config, model_config)
    saved = load_run(run_checkpoint, identity) if config.resume else None
    executed = model_config.executed_chunk_length
    max_decisions = decisions_per_episode(config.max_episode_steps, executed)

    # Baselines on the curve seeds (BC under both decodings, the expert); the noise envs.
    bc_env = make_eval_env(config, config.eval_episodes, executed, device)
    baselines = curve_baselines(policy, bc_env, max_decisions, config)
    bc_env.close()
    task = get_task(config.task)
    eval_env = make_noise_env(policy, config, task.eval_envs(config.eval_episodes), executed)
    train_env = make_noise_env(policy, config, config.num_envs, executed)

    # Noise actor and SAC learner; a replay buffer that by default holds the whole run.
    actor, learner = make_learner(policy, train_env.full_action_spec_unbatched, config, executed)
    replay_buffer = make_replay_buffer(config, executed, device)

    # Resume: networks, optimisers, buffer, counters and history.
    run, random_state = Progress(), None
    if saved is not None:
        run, random_state = resume_dsrl_run(saved, learner, replay_buffer)
        del saved  # the stored decisions now live in the replay buffer
        print(f"resumed from iteration {run.iteration} ({run.env_steps} env steps)")

    # Collector, logger (a resumed run's CSV files lose the rows logged after its
    # checkpoint, which it logs again), evaluation; the random streams where the checkpoint
    # left them.
    collector = make_collector(actor, train_env, config, executed, len(replay_buffer), run)
    experiment, resume_step = (
        f"dsrl_seed{config.seed}",
        run.env_steps if random_state is not None else None,
    )
    log = MetricLogger(config.loggers, experiment, output_dir, config, resume_step).log
    evaluate = Evaluator(actor, eval_env, max_decisions, CURVE_SEED, config.eval_episodes, log)
    if random_state is not None:
        restore_random_state(random_state)

    # Training loop (after evaluating the actor's starting point).
    training_start = time.perf_counter() - run.wall_seconds  # a resumed run goes on counting
    next_eval = next_multiple(run.env_steps, config.eval_every_env_steps)
    next_log = next_multiple(run.env_steps, config.log_every_env_steps)
    next_checkpoint = next_multiple(run.env_steps, config.checkpoint_every_env_steps)
    window = LogWindow()
    progress = tqdm(total=config.total_env_steps, initial=run.env_steps, desc="DSRL env steps")
    if not run.history:
        evaluate(run, time.perf_counter() - training_start)
    collect_start = time.perf_counter()
    for batch in collector:
        window.collect_seconds += time.perf_counter() - collect_start
        env_steps_before = run.env_steps
        dsrl_iteration(batch, learner, replay_buffer, run, window, config, executed)
        if run.env_steps >= next_log:
            next_log += config.log_every_env_steps
            log(window.row(run.updates), run.env_steps)
            window = LogWindow()
        if run.env_steps >= next_eval:
            next_eval += config.eval_every_env_steps
            evaluation = evaluate(run, time.perf_counter() - training_start)
            progress.set_postfix(success=f"{evaluation['success_rate']:.0%}")
        if run.env_steps >= next_checkpoint:
            next_checkpoint += config.checkpoint_every_env_steps
            run.wall_seconds = time.perf_counter() - training_start
            save_dsrl_run(run_checkpoint, learner, replay_buffer, run, identity)
        progress.update(run.env_steps - env_steps_before)
        collect_start = time.perf_counter()
    progress.close()
    collector.shutdown()

    # Final evaluation, checkpoint, held-out protocol (BC and DSRL under both decodings, the
    # expert), plot and summary.
    if not run.history or run.history[-1]["env_steps"] != run.env_steps:
        evaluate(run, time.perf_counter() - training_start)
    run.wall_seconds = time.perf_counter() - training_start
    save_dsrl_run(run_checkpoint, learner, replay_buffer, run, identity)
    eval_env.close()
    held_out_env = make_noise_env(
        policy, config, task.eval_envs(config.held_out_episodes), executed
    )
    held_out = held_out_protocol(
        policy, actor, config, executed, held_out_env, name="DSRL", device=device
    )
    held_out_env.close()
    plot_curves(
        run.history, baselines, output_dir / "learning_curve.png", get_task(config.task).title
    )
    summary = write_summary(config, baselines, run, held_out, pretrained_state, start)
    bc, final = baselines["BC (sampled)"], run.history[-1]
    print(
        f"curve seeds: BC success {bc['success_rate']:.1%} -> DSRL success "
        f"{final['success_rate']:.1%} after {run.env_steps} env steps, {run.updates} updates "
        f"({summary['wall_seconds'] / 60:.1f} min)"
    )
    print(f"held-out seeds: {held_out['line']}")
    return summary


if __name__ == "__main__":
    main(parse_args())
