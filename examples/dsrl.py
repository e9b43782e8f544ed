"""DSRL on Pusher-v5: stock TorchRL SAC in the initial-noise space of a frozen flow policy.

Pipeline: the pretrained flow policy (made by ``examples/pretrain.py`` if its checkpoint is
missing) is frozen; :class:`~torchrl_flowpolicy.dsrl.NoiseActionTransform` appended to the
chunked Pusher-v5 environment makes the action the policy's initial noise
``x_0 in [-m, m]^(H x D)`` and executes the chunk that the policy's deterministic ODE
(K = 20) decodes from it; TorchRL's ``SACLoss`` (two critics, automatic temperature) trains
a tanh-Gaussian noise actor on it; the deterministic evaluation decodes the actor's mean
noise on the fixed evaluation seeds of ``examples/ppo.py`` and compares it with the
pretrained policy's own ODE from random noise (BC) and from ``x_0 = 0`` (noise-free BC)
-> learning-curve PNG and JSON summary.

The defaults are tuned to this policy, whose good chunks lie near ``x_0 = 0``: a small box
(m = 0.3 instead of DSRL's 1.5), the actor's mean starting at ``x_0 = 0``, critics trained
alone for the first updates; ``docs/dsrl.md`` shows the runs behind each choice.

Reads top to bottom: config, seed, frozen pretrained policy, envs, noise actor and critics,
loss, collector and replay buffer, training loop (collect, ``utd_ratio`` updates per
decision, evaluate, log, checkpoint), final evaluation, plot, summary.
``python examples/dsrl.py --help`` lists every option; ``--quick`` runs the whole chain in
under a minute; ``--resume`` continues a killed run (replay buffer included).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from tensordict.nn import TensorDictModule  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torchrl.collectors import Collector  # noqa: E402
from torchrl.data import Composite, LazyTensorStorage, RandomSampler, ReplayBuffer  # noqa: E402
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
from torchrl_flowpolicy.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from torchrl_flowpolicy.dsrl import DECODED_ACTION_KEY, NoiseActionTransform  # noqa: E402
from torchrl_flowpolicy.envs.chunking import decision_discount  # noqa: E402
from torchrl_flowpolicy.evaluation import evaluate_policy  # noqa: E402

import pretrain  # noqa: E402
from common import (  # noqa: E402
    OBSERVATION_DIM,
    MetricLogger,
    decisions_per_episode,
    load_or_pretrain,
    make_env,
    parse_config,
)


@dataclass
class DSRLConfig:
    """DSRL (SAC on the noise) settings; every field is a command-line option."""

    seed: int = 0  # seeds torch, the environments and the pretraining when it runs
    output_dir: str = "outputs/dsrl"  # checkpoints, logs, plot and summary
    pretrained_checkpoint: str = "outputs/pretrain/policy.pt"  # made by pretrain.py if missing
    max_episode_steps: int = 150  # Pusher-v5 horizon (env steps)
    success_threshold: float = 0.05  # final object-goal distance that counts as success, m
    reward: str = "progress"  # Pusher reward: "progress" (potential-based) or "gymnasium"
    num_envs: int = 16  # environments stepped in the collector's process
    decisions_per_batch: int = 2  # decisions per environment between two rounds of updates
    total_env_steps: int = 300_000  # environment steps of fine-tuning
    random_env_steps: int = 5_000  # first env steps act with uniform noise (no updates before)
    eval_num_denoising_steps: int = 20  # K of the decoding ODE (training, evaluation and BC)
    # DSRL noise space and SAC.
    noise_bound: float = 0.3  # m: the noise action lies in [-m, m]^(H x D) (DSRL: 1.5)
    utd_ratio: float = 0.25  # gradient updates per collected decision (DSRL goes up to 20)
    batch_size: int = 256  # decisions per update
    buffer_size: int = 0  # replay capacity in decisions (0: every decision of the run)
    hidden_dim: int = 256  # width of the actor's and critics' LayerNorm MLPs
    num_layers: int = 3  # hidden layers of the actor and of each critic
    actor_learning_rate: float = 1e-4  # Adam on the noise actor
    critic_learning_rate: float = 3e-4  # Adam on the two critics
    alpha_learning_rate: float = 3e-4  # Adam on log(alpha), the entropy temperature
    alpha_init: float = 0.01  # initial entropy temperature (the noise has H * D = 56 dims)
    zero_mean_init: bool = True  # start the actor's mean at x_0 = 0 (the noise-free chunk)
    critic_warmup_updates: int = 2_000  # first updates train the critics only (actor, alpha wait)
    # Target entropy per noise dimension; nan: log(m) - 1, SAC's -1 of the box [-1, 1] carried
    # to [-m, m] (must stay below log(2m), the entropy of the uniform noise over the box).
    target_entropy_per_dim: float = float("nan")
    gamma: float = 0.99  # per env step; the decision discount is gamma ** executed rows
    tau: float = 0.005  # Polyak rate of the target critics
    reward_scale: float = 10.0  # multiplies the summed chunk reward (about 0.1 per decision)
    # Evaluation, logging, checkpoints.
    eval_every_env_steps: int = 20_000  # env steps between deterministic evaluations
    eval_episodes: int = 50  # fixed evaluation episodes
    eval_seed: int = 10_000  # seed of the evaluation episodes (the same for BC and RL)
    log_every_env_steps: int = 2_000  # env steps between logged training metrics
    checkpoint_every_env_steps: int = 20_000  # env steps between checkpoints
    loggers: str = "wandb,csv"  # TorchRL loggers ("wandb" runs offline), comma-separated
    resume: bool = False  # continue from output_dir/checkpoint.pt
    quick: bool = False  # a run of the whole chain in under a minute (tests, smoke checks)
    threads: int = 1  # torch CPU threads (1 is fastest for these small networks)
    pretrain: pretrain.PretrainConfig = field(default_factory=pretrain.PretrainConfig)


def apply_quick(config: DSRLConfig) -> None:
    """Shrink the budgets so that the whole chain runs in under a minute.

    Options given on the command line (values other than the defaults) are kept.
    """
    quick = {
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
    }
    quick_pretrain = {"demo_episodes": 12, "train_steps": 150, "eval_episodes": 8}
    defaults = DSRLConfig()
    for target, default, values in (
        (config, defaults, quick),
        (config.pretrain, defaults.pretrain, quick_pretrain),
    ):
        for name, value in values.items():
            if getattr(target, name) == getattr(default, name):
                setattr(target, name, value)


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
    """Tanh-Gaussian over the noise box ``[-m, m]^(H x D)``, conditioned on the observation."""
    chunk_length, action_dim = policy.action_shape
    network = nn.Sequential(
        copy.deepcopy(policy.encoder[0]),  # the pretrained policy's observation normaliser
        layer_norm_mlp(OBSERVATION_DIM, 2 * chunk_length * action_dim, config),
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
        self.mlp = layer_norm_mlp(OBSERVATION_DIM + noise_numel, 1, config)

    def forward(self, observation: Tensor, noise: Tensor) -> Tensor:
        features = torch.cat([self.normalizer(observation), noise.flatten(-2)], dim=-1)
        return self.mlp(features)


def make_critic(policy: FlowSDEPolicy, config: DSRLConfig) -> ValueOperator:
    """One critic ``Q(observation, noise)``; ``SACLoss`` makes two with separate weights."""
    network = NoiseQNetwork(copy.deepcopy(policy.encoder[0]), policy.action_shape.numel(), config)
    return ValueOperator(network, in_keys=["observation", "action"])


def plot_curves(history: list[dict], baselines: dict[str, dict], path: Path) -> None:
    """Success and return against environment steps, success against wall time.

    ``baselines`` maps a label to an evaluation of the frozen policy, drawn as a line.
    """
    steps = [row["env_steps"] for row in history]
    minutes = [row["wall_seconds"] / 60 for row in history]
    success = [100 * row["success_rate"] for row in history]
    figure, (success_axis, return_axis, time_axis) = plt.subplots(1, 3, figsize=(16, 4))
    success_axis.plot(steps, success, "o-", label="DSRL")
    success_axis.set(xlabel="environment steps", ylabel="success (%)", ylim=(-2, 102))
    return_axis.plot(steps, [row["mean_return"] for row in history], "o-", label="DSRL")
    return_axis.set(xlabel="environment steps", ylabel="episode return")
    time_axis.plot(minutes, success, "o-", label="DSRL")
    time_axis.set(xlabel="training wall time (min)", ylabel="success (%)", ylim=(-2, 102))
    for (label, baseline), style in zip(baselines.items(), ("--", ":"), strict=False):
        for axis in (success_axis, time_axis):
            axis.axhline(100 * baseline["success_rate"], color="gray", linestyle=style, label=label)
        return_axis.axhline(baseline["mean_return"], color="gray", linestyle=style, label=label)
    for axis in (success_axis, return_axis, time_axis):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle("Pusher-v5 DSRL: deterministic evaluation (mean noise, ODE K = 20)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(config: DSRLConfig) -> dict:
    if config.quick:
        apply_quick(config)
    torch.manual_seed(config.seed)
    torch.set_num_threads(config.threads)
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    # Pretrained policy (behaviour cloning), made here when missing; frozen from here on.
    policy, model_config, pretrained_state = load_or_pretrain(
        config, eval_num_steps=config.eval_num_denoising_steps
    )
    executed = model_config.executed_chunk_length
    task = {
        "max_episode_steps": config.max_episode_steps,
        "success_threshold": config.success_threshold,
        "reward": config.reward,
    }
    max_decisions = decisions_per_episode(config.max_episode_steps, executed)
    # The last decision of an episode executes only the rows left before the time limit.
    last_decision_shortfall = max_decisions * executed - config.max_episode_steps

    def noise_env(num_envs: int):
        env = make_env(num_envs, executed, **task)
        return env.append_transform(NoiseActionTransform(policy, noise_bound=config.noise_bound))

    # Evaluation envs (fixed seeds) and two BC levels: the frozen policy's ODE from
    # x_0 ~ N(0, I) (the protocol of every example) and from x_0 = 0 (the noise-free chunk).
    bc_eval_env = make_env(config.eval_episodes, executed, **task)
    bc = evaluate_policy(policy, bc_eval_env, max_decisions=max_decisions, seed=config.eval_seed)
    policy.eval_noise_scale = 0.0
    bc_noise_free = evaluate_policy(
        policy, bc_eval_env, max_decisions=max_decisions, seed=config.eval_seed
    )
    policy.eval_noise_scale = 1.0
    bc_eval_env.close()
    print(
        f"BC: success {bc['success_rate']:.1%}, return {bc['mean_return']:.2f}; "
        f"noise-free (x_0 = 0): success {bc_noise_free['success_rate']:.1%}, "
        f"return {bc_noise_free['mean_return']:.2f}"
    )
    eval_env = noise_env(config.eval_episodes)
    train_env = noise_env(config.num_envs)

    # Noise actor, two critics, SAC loss (automatic temperature), optimisers, target updates.
    noise_spec = train_env.full_action_spec_unbatched
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
    loss_module.make_value_estimator(gamma=decision_discount(config.gamma, executed))
    target_updater = SoftUpdate(loss_module, tau=config.tau)
    actor_optimizer = torch.optim.Adam(
        loss_module.actor_network_params.values(True, True), lr=config.actor_learning_rate
    )
    critic_optimizer = torch.optim.Adam(
        loss_module.qvalue_network_params.values(True, True), lr=config.critic_learning_rate
    )
    alpha_optimizer = torch.optim.Adam([loss_module.log_alpha], lr=config.alpha_learning_rate)
    optimizers = (actor_optimizer, critic_optimizer, alpha_optimizer)

    # Replay buffer: by default it holds every decision of the run.
    decisions_per_batch = config.num_envs * config.decisions_per_batch
    steps_per_batch = decisions_per_batch * executed  # an upper bound (short last decisions)
    buffer_size = config.buffer_size or (config.total_env_steps // executed + decisions_per_batch)
    replay_buffer = ReplayBuffer(
        storage=LazyTensorStorage(buffer_size),
        sampler=RandomSampler(),
        batch_size=config.batch_size,
    )

    # Resume: networks, optimisers, buffer, counters, history and RNG state.
    iteration, env_steps, updates, history = 0, 0, 0, []
    update_credit, wall_offset = 0.0, 0.0
    run_checkpoint = output_dir / "checkpoint.pt"
    if config.resume and run_checkpoint.is_file():
        state = load_checkpoint(run_checkpoint)
        loss_module.load_state_dict(state["loss_module"])
        for optimizer, optimizer_state in zip(optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(optimizer_state)
        stored = state["replay_buffer"]
        replay_buffer.extend(TensorDict(stored, batch_size=[state["buffer_length"]]))
        iteration, env_steps, updates = state["iteration"], state["env_steps"], state["updates"]
        update_credit, wall_offset = state["update_credit"], state["wall_seconds"]
        history = json.loads(state["history"])
        torch.set_rng_state(state["rng_state"])
        print(f"resumed from iteration {iteration} ({env_steps} env steps)")

    # Collector: RANDOM exploration (noise sampled from the actor); uniform noise at first.
    random_decisions = max(config.random_env_steps // executed - len(replay_buffer), 0)
    random_decisions = -(-random_decisions // decisions_per_batch) * decisions_per_batch
    remaining_batches = -(-max(config.total_env_steps - env_steps, 0) // steps_per_batch)
    # The collector resets its env when it is built: seed the env first.
    train_env.set_seed(config.seed + 1000 * iteration)
    collector = Collector(
        train_env,
        actor,
        frames_per_batch=decisions_per_batch,
        total_frames=remaining_batches * decisions_per_batch,  # 0: a finished run
        init_random_frames=random_decisions,
        exploration_type=ExplorationType.RANDOM,
        auto_register_policy_transforms=False,  # the actor is not recurrent
    )
    log = MetricLogger(config.loggers, f"dsrl_seed{config.seed}", output_dir, config).log

    training_start = time.perf_counter()

    def wall_seconds() -> float:
        return wall_offset + time.perf_counter() - training_start

    def checkpoint() -> None:
        save_checkpoint(
            {
                "loss_module": loss_module.state_dict(),
                "optimizers": [optimizer.state_dict() for optimizer in optimizers],
                # The stored decisions only (not the empty capacity), as plain tensors.
                "replay_buffer": replay_buffer[: len(replay_buffer)].to_dict(),
                "buffer_length": len(replay_buffer),
                "iteration": iteration,
                "env_steps": env_steps,
                "updates": updates,
                "update_credit": update_credit,
                "wall_seconds": wall_seconds(),
                "history": json.dumps(history),
                "rng_state": torch.get_rng_state(),
                "model_config": dataclasses.asdict(model_config),
            },
            run_checkpoint,
        )

    def evaluate() -> dict[str, float]:
        # Deterministic: the actor's mean noise, decoded by the frozen ODE (K = 20).
        evaluation = evaluate_policy(
            actor, eval_env, max_decisions=max_decisions, seed=config.eval_seed
        )
        row = {"env_steps": env_steps, "iteration": iteration, "updates": updates}
        history.append({**row, "wall_seconds": wall_seconds(), **evaluation})
        log(
            {
                "eval/success_rate": evaluation["success_rate"],
                "eval/mean_return": evaluation["mean_return"],
            },
            env_steps,
        )
        progress.set_postfix(success=f"{evaluation['success_rate']:.0%}")
        return evaluation

    # Training loop (after evaluating the actor's starting point).
    next_eval = (env_steps // config.eval_every_env_steps + 1) * config.eval_every_env_steps
    next_log = (env_steps // config.log_every_env_steps + 1) * config.log_every_env_steps
    next_checkpoint = (
        env_steps // config.checkpoint_every_env_steps + 1
    ) * config.checkpoint_every_env_steps
    metrics: dict[str, list[float]] = {}
    collect_seconds = update_seconds = 0.0
    batch_env_steps = batch_updates = 0
    progress = tqdm(total=config.total_env_steps, initial=env_steps, desc="DSRL env steps")
    if not history:
        evaluate()
    collect_start = time.perf_counter()
    for batch in collector:
        collect_seconds += time.perf_counter() - collect_start
        iteration += 1
        done = batch["next", "done"].squeeze(-1)
        new_env_steps = batch.numel() * executed - int(done.sum()) * last_decision_shortfall
        env_steps += new_env_steps
        batch_env_steps += new_env_steps
        if done.any():
            success = batch["next", "success"].squeeze(-1)[done].float().mean().item()
            metrics.setdefault("train/episode_success", []).append(success)
        metrics.setdefault("train/chunk_reward", []).append(batch["next", "reward"].mean().item())
        metrics.setdefault("train/noise_abs", []).append(batch["action"].abs().mean().item())
        metrics.setdefault("train/chunk_abs", []).append(
            batch[("next", *DECODED_ACTION_KEY)].abs().mean().item()
        )
        batch["next", "reward"] = batch["next", "reward"] * config.reward_scale
        # The decoded chunks are logged above; the learner never needs them.
        replay_buffer.extend(
            batch.exclude(DECODED_ACTION_KEY[0], ("next", DECODED_ACTION_KEY[0])).reshape(-1)
        )

        # utd_ratio updates per collected decision, once the uniform-noise warm-up is over.
        update_start = time.perf_counter()
        if len(replay_buffer) >= max(config.random_env_steps // executed, config.batch_size):
            update_credit += config.utd_ratio * batch.numel()
            while update_credit >= 1.0:
                update_credit -= 1.0
                losses = loss_module(replay_buffer.sample())
                if updates < config.critic_warmup_updates:
                    # The critics learn first: the actor would follow an untrained Q.
                    loss, stepped = losses["loss_qvalue"], (critic_optimizer,)
                else:
                    loss = losses["loss_actor"] + losses["loss_qvalue"] + losses["loss_alpha"]
                    stepped = optimizers
                for optimizer in optimizers:
                    optimizer.zero_grad(set_to_none=True)
                loss.backward()
                for optimizer in stepped:
                    optimizer.step()
                target_updater.step()
                updates += 1
                batch_updates += 1
                for name in ("loss_actor", "loss_qvalue", "loss_alpha", "alpha", "entropy"):
                    metrics.setdefault(name, []).append(losses[name].item())
        update_seconds += time.perf_counter() - update_start

        if env_steps >= next_log:
            next_log += config.log_every_env_steps
            row = {name: sum(values) / len(values) for name, values in metrics.items()}
            row["perf/env_steps_per_second"] = batch_env_steps / max(collect_seconds, 1e-9)
            if batch_updates:
                row["perf/updates_per_second"] = batch_updates / max(update_seconds, 1e-9)
            row["updates"] = updates
            log({name.replace("loss_", "loss/"): value for name, value in row.items()}, env_steps)
            metrics.clear()
            collect_seconds = update_seconds = 0.0
            batch_env_steps = batch_updates = 0
        if env_steps >= next_eval:
            next_eval += config.eval_every_env_steps
            evaluate()
        if env_steps >= next_checkpoint:
            next_checkpoint += config.checkpoint_every_env_steps
            checkpoint()
        progress.update(new_env_steps)
        collect_start = time.perf_counter()
    progress.close()
    collector.shutdown()

    # Final evaluation, checkpoint, plot and summary.
    if not history or history[-1]["env_steps"] != env_steps:
        evaluate()
    final = history[-1]
    checkpoint()
    eval_env.close()
    baselines = {"BC (x_0 ~ N(0, I))": bc, "BC (x_0 = 0)": bc_noise_free}
    plot_curves(history, baselines, output_dir / "learning_curve.png")
    summary = {
        "seed": config.seed,
        "bc_success": bc["success_rate"],
        "rl_success": final["success_rate"],
        "bc_return": bc["mean_return"],
        "bc_noise_free_success": bc_noise_free["success_rate"],
        "bc_noise_free_return": bc_noise_free["mean_return"],
        "rl_return": final["mean_return"],
        "env_steps": env_steps,
        "iterations": iteration,
        "updates": updates,
        "eval_episodes": config.eval_episodes,
        "training_wall_seconds": wall_seconds(),
        "wall_seconds": time.perf_counter() - start,
        "history": history,
        "config": dataclasses.asdict(config),
        "pretrained": json.loads(pretrained_state.get("summary", "{}")),
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"BC success {bc['success_rate']:.1%} -> DSRL success {final['success_rate']:.1%} "
        f"after {env_steps} env steps, {updates} updates "
        f"({summary['wall_seconds'] / 60:.1f} min)"
    )
    return summary


if __name__ == "__main__":
    main(parse_config(DSRLConfig, description=__doc__))
