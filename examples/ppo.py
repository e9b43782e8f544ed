"""PPO fine-tuning of a pretrained flow policy on Pusher-v5: the library's main job.

Pipeline: scripted-expert demonstrations -> flow-matching behaviour cloning (made by
``examples/pretrain.py`` if its checkpoint is missing) -> PPO with the Flow-SDE sampler
(K = 8, a = 0.5, mixed ODE/SDE) and ``DenoisingClipPPOLoss`` -> deterministic evaluation at
K = 20 on fixed seeds -> learning-curve PNG and JSON summary.

Reads top to bottom: config, seed, pretrained policy, env + collector, critic + loss,
training loop (collect, GAE, epochs of minibatch updates, evaluate, log, checkpoint),
final evaluation, plot, summary. ``python examples/ppo.py --help`` lists every option;
``--quick`` runs the whole chain in under two minutes; ``--resume`` continues a killed run.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDictBase  # noqa: E402
from tensordict.nn import TensorDictModule  # noqa: E402
from torch import nn  # noqa: E402
from torchrl.collectors import Collector  # noqa: E402
from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement  # noqa: E402
from torchrl.envs.utils import ExplorationType  # noqa: E402
from torchrl.objectives import ValueEstimators  # noqa: E402
from tqdm import tqdm  # noqa: E402

from torchrl_flowpolicy.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from torchrl_flowpolicy.envs.chunking import decision_discount  # noqa: E402
from torchrl_flowpolicy.evaluation import evaluate_policy  # noqa: E402
from torchrl_flowpolicy.objectives import DenoisingClipPPOLoss  # noqa: E402

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
class PPOConfig:
    """PPO fine-tuning settings; every field is a command-line option."""

    seed: int = 0  # seeds torch, the environments and the pretraining when it runs
    output_dir: str = "outputs/ppo"  # checkpoints, logs, plot and summary
    pretrained_checkpoint: str = "outputs/pretrain/policy.pt"  # made by pretrain.py if missing
    max_episode_steps: int = 150  # Pusher-v5 horizon (env steps)
    success_threshold: float = 0.05  # final object-goal distance that counts as success, m
    reward: str = "progress"  # Pusher reward: "progress" (potential-based) or "gymnasium"
    num_envs: int = 16  # environments stepped in the collector's process
    episodes_per_batch: int = 1  # episodes per environment per PPO iteration
    total_env_steps: int = 400_000  # environment steps of fine-tuning
    # Flow-SDE sampler (rollouts) and the evaluation ODE.
    noise_level: float = 0.5  # a: exploration noise of the stochastic step
    num_denoising_steps: int = 8  # K for rollouts and the learner
    eval_num_denoising_steps: int = 20  # K of the deterministic evaluation
    sde_mode: str = "mixed"  # "mixed" (one random stochastic step), "last", "all"
    num_sde_steps: int = 4  # stochastic steps for sde_mode="last"
    # PPO.
    epochs: int = 4  # passes over each batch
    minibatch_size: int = 304  # decisions per minibatch
    actor_learning_rate: float = 3e-5  # Adam on the flow policy
    critic_learning_rate: float = 1e-3  # Adam on the value network
    clip_epsilon_low: float = 0.2  # ratio clip below 1
    clip_epsilon_high: float = 0.28  # ratio clip above 1 (clip-higher)
    kl_coeff: float = 0.0  # KL to the pretrained policy (0: off)
    bc_coeff: float = 0.1  # self-imitation: flow matching on successful episodes (0: off)
    gamma: float = 0.99  # per env step; the decision discount is gamma ** executed rows
    gae_lambda: float = 0.95  # GAE lambda over decisions
    reward_scale: float = 0.1  # multiplies the summed chunk reward
    max_grad_norm: float = 1.0  # gradient clipping
    critic_warmup_iterations: int = 3  # iterations training only the critic at the start
    # Evaluation, logging, checkpoints.
    eval_every: int = 20  # iterations between deterministic evaluations
    eval_episodes: int = 50  # fixed evaluation episodes
    eval_seed: int = 10_000  # seed of the evaluation episodes (the same for BC and RL)
    checkpoint_every: int = 20  # iterations between checkpoints
    loggers: str = "wandb,csv"  # TorchRL loggers ("wandb" runs offline), comma-separated
    resume: bool = False  # continue from output_dir/checkpoint.pt
    quick: bool = False  # a two-minute run of the whole chain (tests, smoke checks)
    threads: int = 1  # torch CPU threads (1 is fastest for these small networks)
    pretrain: pretrain.PretrainConfig = field(default_factory=pretrain.PretrainConfig)


def apply_quick(config: PPOConfig) -> None:
    """Shrink every budget so that the whole chain runs in under two minutes."""
    config.num_envs = 4
    config.total_env_steps = 4 * 150 * 4
    config.epochs = 2
    config.minibatch_size = 76
    config.eval_every = 2
    config.checkpoint_every = 2
    config.eval_episodes = 8
    config.critic_warmup_iterations = 1
    config.pretrain.demo_episodes = 12
    config.pretrain.train_steps = 150
    config.pretrain.eval_episodes = 8


def make_critic(policy) -> TensorDictModule:
    """Value network on the observation, normalised with the policy's statistics."""
    normalizer = copy.deepcopy(policy.encoder[0])
    network = nn.Sequential(
        normalizer,
        nn.Linear(OBSERVATION_DIM, 256),
        nn.Tanh(),
        nn.Linear(256, 256),
        nn.Tanh(),
        nn.Linear(256, 1),
    )
    return TensorDictModule(network, in_keys=["observation"], out_keys=["state_value"])


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


def plot_curves(history: list[dict], bc_success: float, bc_return: float, path: Path) -> None:
    """Success and return against environment steps, with the BC level as a line."""
    steps = [row["env_steps"] for row in history]
    figure, (success_axis, return_axis) = plt.subplots(1, 2, figsize=(11, 4))
    success_axis.plot(steps, [100 * row["success_rate"] for row in history], "o-", label="PPO")
    success_axis.axhline(100 * bc_success, color="gray", linestyle="--", label="BC")
    success_axis.set(xlabel="environment steps", ylabel="success (%)", ylim=(-2, 102))
    return_axis.plot(steps, [row["mean_return"] for row in history], "o-", label="PPO")
    return_axis.axhline(bc_return, color="gray", linestyle="--", label="BC")
    return_axis.set(xlabel="environment steps", ylabel="episode return")
    for axis in (success_axis, return_axis):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle("Pusher-v5: deterministic evaluation (ODE, K = 20)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(config: PPOConfig) -> dict:
    if config.quick:
        apply_quick(config)
    torch.manual_seed(config.seed)
    torch.set_num_threads(config.threads)
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    # Pretrained policy (behaviour cloning), made here when missing.
    sampler = {
        "num_steps": config.num_denoising_steps,
        "eval_num_steps": config.eval_num_denoising_steps,
        "noise_level": config.noise_level,
        "sde_mode": config.sde_mode,
        "num_sde_steps": config.num_sde_steps,
    }
    policy, model_config, pretrained_state = load_or_pretrain(config, **sampler)
    executed = model_config.executed_chunk_length
    task = {
        "max_episode_steps": config.max_episode_steps,
        "success_threshold": config.success_threshold,
        "reward": config.reward,
    }
    max_decisions = decisions_per_episode(config.max_episode_steps, executed)

    # Evaluation env (fixed seeds) and the BC level.
    eval_env = make_env(config.eval_episodes, executed, **task)
    bc = evaluate_policy(policy, eval_env, max_decisions=max_decisions, seed=config.eval_seed)
    print(f"BC: success {bc['success_rate']:.1%}, return {bc['mean_return']:.1f}")

    # Critic, loss (GAE at the decision level), optimisers.
    critic = make_critic(policy)
    loss_module = DenoisingClipPPOLoss(
        policy,
        critic,
        clip_epsilon=(config.clip_epsilon_low, config.clip_epsilon_high),
        kl_coeff=config.kl_coeff,
        bc_coeff=config.bc_coeff,
        normalize_advantage=True,
        loss_critic_type="l2",
    )
    loss_module.make_value_estimator(
        ValueEstimators.GAE,
        gamma=decision_discount(config.gamma, executed),
        lmbda=config.gae_lambda,
    )
    actor_optimizer = torch.optim.Adam(policy.parameters(), lr=config.actor_learning_rate)
    critic_optimizer = torch.optim.Adam(critic.parameters(), lr=config.critic_learning_rate)

    # Resume: weights, optimisers, counters, history and RNG state.
    iteration, env_steps, history = 0, 0, []
    run_checkpoint = output_dir / "checkpoint.pt"
    if config.resume and run_checkpoint.is_file():
        state = load_checkpoint(run_checkpoint)
        policy.load_state_dict(state["policy"])
        critic.load_state_dict(state["critic"])
        actor_optimizer.load_state_dict(state["actor_optimizer"])
        critic_optimizer.load_state_dict(state["critic_optimizer"])
        iteration, env_steps = state["iteration"], state["env_steps"]
        history = json.loads(state["history"])
        torch.set_rng_state(state["rng_state"])
        print(f"resumed from iteration {iteration} ({env_steps} env steps)")

    # Collector: RANDOM exploration, i.e. the Flow-SDE sampler with K = 8.
    decisions_per_batch = config.num_envs * config.episodes_per_batch * max_decisions
    steps_per_decision_batch = (
        config.num_envs * config.episodes_per_batch * config.max_episode_steps
    )
    remaining_iterations = max((config.total_env_steps - env_steps) // steps_per_decision_batch, 0)
    last_iteration = iteration + remaining_iterations
    # The collector resets its env when it is built: seed the env first.
    train_env = make_env(config.num_envs, executed, **task)
    train_env.set_seed(config.seed + 1000 * iteration)
    collector = Collector(
        train_env,
        policy,
        frames_per_batch=decisions_per_batch,
        total_frames=remaining_iterations * decisions_per_batch,
        exploration_type=ExplorationType.RANDOM,
    )
    replay_buffer = ReplayBuffer(
        storage=LazyTensorStorage(decisions_per_batch),
        sampler=SamplerWithoutReplacement(),
        batch_size=config.minibatch_size,
    )
    log = MetricLogger(config.loggers, f"ppo_seed{config.seed}", output_dir, config).log

    def checkpoint() -> None:
        save_checkpoint(
            {
                "policy": policy.state_dict(),
                "critic": critic.state_dict(),
                "actor_optimizer": actor_optimizer.state_dict(),
                "critic_optimizer": critic_optimizer.state_dict(),
                "iteration": iteration,
                "env_steps": env_steps,
                "history": json.dumps(history),
                "rng_state": torch.get_rng_state(),
                "model_config": dataclasses.asdict(model_config),
            },
            run_checkpoint,
        )

    # Training loop.
    progress = tqdm(total=config.total_env_steps, initial=env_steps, desc="PPO env steps")
    for batch in collector:
        iteration += 1
        batch_env_steps = steps_per_decision_batch
        env_steps += batch_env_steps
        batch["next", "reward"] = batch["next", "reward"] * config.reward_scale
        if config.bc_coeff > 0:
            batch["success"] = episode_success_flags(batch)
        with torch.no_grad():
            loss_module.value_estimator(batch)
        replay_buffer.empty()
        replay_buffer.extend(batch.reshape(-1))
        train_actor = iteration > config.critic_warmup_iterations
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
                critic_optimizer.zero_grad(set_to_none=True)
                actor_optimizer.zero_grad(set_to_none=True)
                (losses["loss_critic"] + (actor_loss if train_actor else 0.0)).backward()
                torch.nn.utils.clip_grad_norm_(critic.parameters(), config.max_grad_norm)
                critic_optimizer.step()
                if train_actor:
                    torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm)
                    actor_optimizer.step()
                for name, value in losses.items():
                    metrics.setdefault(name, []).append(float(value.detach()))
        collector.update_policy_weights_()

        done = batch["next", "done"].squeeze(-1)
        train_success = batch["next", "success"].squeeze(-1)[done].float()
        row = {name: sum(values) / len(values) for name, values in metrics.items()}
        row.update(
            {
                "train/episode_success": train_success.mean().item() if done.any() else 0.0,
                "train/chunk_reward": batch["next", "reward"].mean().item(),
                "log_prob_drift_before_update": fresh_drift,
                "iteration": iteration,
            }
        )
        if iteration % config.eval_every == 0 or iteration == last_iteration:
            evaluation = evaluate_policy(
                policy, eval_env, max_decisions=max_decisions, seed=config.eval_seed
            )
            history.append(
                {
                    "env_steps": env_steps,
                    "iteration": iteration,
                    "wall_seconds": time.perf_counter() - start,
                    **evaluation,
                }
            )
            row["eval/success_rate"] = evaluation["success_rate"]
            row["eval/mean_return"] = evaluation["mean_return"]
            progress.set_postfix(success=f"{evaluation['success_rate']:.0%}")
        log({name.replace("loss_", "loss/"): value for name, value in row.items()}, env_steps)
        if iteration % config.checkpoint_every == 0:
            checkpoint()
        progress.update(batch_env_steps)
    progress.close()
    collector.shutdown()
    checkpoint()

    # Final evaluation, plot and summary.
    final = evaluate_policy(policy, eval_env, max_decisions=max_decisions, seed=config.eval_seed)
    eval_env.close()
    if not history or history[-1]["env_steps"] != env_steps:
        history.append(
            {
                "env_steps": env_steps,
                "iteration": iteration,
                "wall_seconds": time.perf_counter() - start,
                **final,
            }
        )
    plot_curves(history, bc["success_rate"], bc["mean_return"], output_dir / "learning_curve.png")
    summary = {
        "seed": config.seed,
        "bc_success": bc["success_rate"],
        "rl_success": final["success_rate"],
        "bc_return": bc["mean_return"],
        "rl_return": final["mean_return"],
        "env_steps": env_steps,
        "iterations": iteration,
        "eval_episodes": config.eval_episodes,
        "wall_seconds": time.perf_counter() - start,
        "history": history,
        "config": dataclasses.asdict(config),
        "pretrained": json.loads(pretrained_state.get("summary", "{}")),
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"BC success {bc['success_rate']:.1%} -> RL success {final['success_rate']:.1%} "
        f"after {env_steps} env steps ({summary['wall_seconds'] / 60:.1f} min)"
    )
    return summary


if __name__ == "__main__":
    main(parse_config(PPOConfig, description=__doc__))
