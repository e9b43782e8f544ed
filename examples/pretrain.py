"""Behaviour cloning of a flow policy on scripted-expert demonstrations (Pusher-v5 by
default, robosuite Lift with ``--task lift``).

Reads top to bottom: config, seed, demonstrations, model, loss, training loop, evaluation
(deterministic ODE at K = 20 and at the RL rollouts' step count, ``--rollout_denoising_steps``:
the parity check before RL),
checkpoint. Run ``python examples/pretrain.py --help`` for the options. The fine-tuning
examples run :func:`main` with :func:`config_for_run` when their pretrained checkpoint is
missing.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tensordict import TensorDictBase
from tqdm import tqdm

from torchrl_flowpolicy import FlowSDEPolicy
from torchrl_flowpolicy.networks import ObservationNormalizer
from torchrl_flowpolicy.objectives import FlowMatchingLoss
from torchrl_flowpolicy.sampler import SamplerOptions
from torchrl_flowpolicy.tasks import get_task, load_or_collect_demos
from torchrl_flowpolicy.tasks.registry import script_defaults
from torchrl_flowpolicy.training import distributed
from torchrl_flowpolicy.training.data import make_chunk_dataset
from torchrl_flowpolicy.training.evaluation import evaluate_policy
from torchrl_flowpolicy.training.models import (
    TASK_MODEL_FIELDS,
    ModelConfig,
    SavedPolicy,
    build_policy,
    load_policy_checkpoint,
    save_policy,
)
from torchrl_flowpolicy.training.reports import decisions_per_episode, make_eval_env, task_options
from torchrl_flowpolicy.training.run_checks import check_output_dir
from torchrl_flowpolicy.training.runs import write_json

from common import Config, TaskOptions, option, parse_config
from run_settings import validate_config


@dataclass
class PretrainConfig(TaskOptions):
    """Behaviour-cloning settings; every field is a command-line option."""

    seed: int = option(
        0, "seeds torch (initialisation, minibatches, flow-matching noise)", minimum=0
    )
    output_dir: str = option("outputs/pretrain", "where the checkpoint and summary go")
    checkpoint_name: str = option("policy.pt", "file name of the checkpoint in output_dir")
    overwrite: bool = option(False, "replace the checkpoint and summary that output_dir holds")
    demo_dir: str = option("outputs/demos", "demonstration cache (made by the scripted expert)")
    demo_episodes: int = option(
        5, "scripted-expert episodes to clone (few-shot: the start leaves RL real work)", minimum=1
    )
    demo_action_noise: float = option(
        0.3, "std of the Gaussian noise on the expert's torques (imperfect demos)", minimum=0
    )
    demo_seed: int = option(
        -1, "seed of the demonstration episodes (-1: --seed, so a seed redraws them)", minimum=-1
    )
    train_steps: int = option(3000, "optimiser steps", minimum=1)
    batch_size: int = option(256, "decisions per minibatch", minimum=1)
    learning_rate: float = option(3e-4, "AdamW learning rate", above=0)
    weight_decay: float = option(1e-4, "AdamW weight decay", minimum=0)
    sigma_distribution: Literal["uniform", "logit_normal", "beta"] = option(
        "beta", "distribution of the flow-matching noise level sigma"
    )
    eval_episodes: int = option(50, "fixed evaluation episodes (one batched rollout)", minimum=1)
    eval_seed: int = option(10_000, "seed of the evaluation episodes", minimum=0)
    rollout_denoising_steps: int = option(
        4, "K of the RL rollouts, which the parity check compares with K = 20", minimum=1
    )
    threads: int = option(1, "torch CPU threads", minimum=1)
    model: ModelConfig = option(default_factory=ModelConfig, help="the policy's architecture")


# The settings config_for_run takes from the fine-tuning run (not options of that run).
RUN_SETTINGS = (
    "seed",
    "threads",
    "task",
    "output_dir",
    "checkpoint_name",
    "overwrite",
    "max_episode_steps",
    "success_threshold",
    "reward",
    "terminate_on_success",
    "rollout_denoising_steps",
)

# The model fields that come from the task are not command-line options.
EXCLUDE = tuple(f"model.{name}" for name in TASK_MODEL_FIELDS)


def config_for_run(run: Any) -> PretrainConfig:
    """``run.pretrain`` with the seed, task, checkpoint folder and ``overwrite`` of a
    fine-tuning run.

    ``run`` is the config of ``examples/ppo.py`` or ``examples/dsrl.py``; the result makes
    the checkpoint at ``run.pretrained_checkpoint``, its parity check at the run's rollout
    ``K`` (``run.sampler``; a run without one keeps ``run.pretrain``'s). ``run`` is not
    changed.
    """
    sampler = getattr(run, "sampler", None)
    rollout_steps = getattr(sampler, "num_denoising_steps", run.pretrain.rollout_denoising_steps)
    return dataclasses.replace(
        run.pretrain,
        seed=run.seed,
        threads=run.threads,
        task=run.task,
        output_dir=str(Path(run.pretrained_checkpoint).parent),
        checkpoint_name=Path(run.pretrained_checkpoint).name,
        overwrite=run.overwrite,
        max_episode_steps=run.max_episode_steps,
        success_threshold=run.success_threshold,
        reward=run.reward,
        terminate_on_success=run.terminate_on_success,
        rollout_denoising_steps=rollout_steps,
    )


def demonstration_seed(config: PretrainConfig) -> int:
    """The seed of the demonstrations: ``--demo_seed``, or the run's ``--seed`` when it is
    -1 (the default), so that a seed redraws everything random, the demonstrations too."""
    return config.seed if config.demo_seed < 0 else config.demo_seed


def run_option() -> Any:
    """The ``pretrain`` field of a fine-tuning config (``examples/ppo.py``, ``dsrl.py``):
    the behaviour cloning :func:`config_for_run` makes from it when the run's pretrained
    checkpoint is missing."""
    return option(
        default_factory=PretrainConfig,
        help="behaviour cloning, run when pretrained_checkpoint is missing (with this run's "
        "seed and task settings; it writes pretrained_checkpoint)",
    )


def load_or_pretrain(
    run: Any,
    sampler: SamplerOptions | None,
    device: torch.device | str,
    *,
    pretrain_here: bool = True,
) -> SavedPolicy:
    """A fine-tuning run's pretrained policy (``run.pretrained_checkpoint``, checked against
    ``run.task``) with the run's ``sampler`` settings (``None``: those the checkpoint saved),
    on ``device``; made first by
    :func:`main` with :func:`config_for_run` when the checkpoint is missing. Under
    ``torchrun`` only rank 0 has ``pretrain_here``; every rank waits for it."""
    path = Path(run.pretrained_checkpoint)
    if pretrain_here and not path.is_file():
        main(config_for_run(run))
    distributed.barrier()
    saved = load_policy_checkpoint(path, sampler=sampler, task=run.task)
    saved.policy.to(device)
    return saved


def parse_run_args(
    config_class: type[Config],
    argv: list[str] | None,
    script: Literal["ppo", "dsrl"],
    *,
    description: str | None,
    quick: dict[str, Any],
) -> Config:
    """The command line of a fine-tuning script (``--help``) as its ``config_class``:
    :func:`~common.parse_config` with the task's defaults for ``script``
    (:func:`~torchrl_flowpolicy.tasks.registry.script_defaults`, read from
    ``tasks.registry.TASKS``) and ``--quick``; the pretraining options that
    :func:`config_for_run` takes from the run are left off."""
    exclude = [f"pretrain.{name}" for name in (*RUN_SETTINGS, *EXCLUDE)]
    return parse_config(
        config_class,
        argv,
        description=description,
        quick=quick,
        task_defaults=script_defaults(script),
        exclude=exclude,
    )


def train(policy: FlowSDEPolicy, dataset: TensorDictBase, config: PretrainConfig) -> list[float]:
    """Flow matching on random minibatches of ``dataset``; returns the loss of every step."""
    loss_module = FlowMatchingLoss(policy, sigma_distribution=config.sigma_distribution)
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, config.train_steps)
    progress = tqdm(range(config.train_steps), desc="flow matching")
    losses = []
    for step in progress:
        batch = dataset[torch.randint(dataset.shape[0], (config.batch_size,))]
        loss = loss_module(batch)["loss_flow_matching"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if step % 100 == 0:
            progress.set_postfix(loss=f"{sum(losses[-100:]) / len(losses[-100:]):.4f}")
    return losses


def evaluate_parity(policy: FlowSDEPolicy, config: PretrainConfig) -> dict[int, dict]:
    """Deterministic ODE on the fixed seeds at K = 20 (reported) and at the RL rollouts' K."""
    executed = config.model.executed_chunk_length
    env = make_eval_env(config, config.eval_episodes, executed)
    max_decisions = decisions_per_episode(config.max_episode_steps, executed)
    results = {}
    rollout_steps = config.rollout_denoising_steps
    for steps in dict.fromkeys((20, rollout_steps)):
        policy.options = policy.options.replace(eval_num_denoising_steps=steps)
        results[steps] = evaluate_policy(
            policy,
            env,
            max_decisions=max_decisions,
            seed=config.eval_seed,
            num_episodes=config.eval_episodes,
        )
        print(
            f"BC success at K={steps}: {results[steps]['success_rate']:.1%} "
            f"(return {results[steps]['mean_return']:.1f}, {config.eval_episodes} episodes)"
        )
    env.close()
    policy.options = policy.options.replace(eval_num_denoising_steps=20)
    gap = abs(results[20]["success_rate"] - results[rollout_steps]["success_rate"])
    if gap > 0.01:
        print(
            f"Parity check: success at K={rollout_steps} differs from K=20 by {gap:.1%} (more "
            f"than one point); RL rollouts at K={rollout_steps} do not behave like the K=20 "
            "evaluation policy."
        )
    else:
        print(f"Parity check: K={rollout_steps} and K=20 agree within one point.")
    return results


def check_outputs(config: PretrainConfig) -> None:
    """Refuse, before any work, outputs that would replace results this run did not make
    (an output folder holding a checkpoint or summary, without ``--overwrite``) or that
    collide (a checkpoint named like the summary, or not a plain file name)."""
    name = config.checkpoint_name
    if Path(name).name != name or name in ("", ".", "..", "summary.json"):
        raise ValueError(
            f"--checkpoint_name {name!r}: a plain file name other than summary.json "
            "(the folder is --output_dir)."
        )
    results = (name, "summary.json")
    check_output_dir(
        config.output_dir, results, resume=False, overwrite=config.overwrite, resumable=False
    )


def main(config: PretrainConfig) -> dict:
    validate_config(config)  # a number out of bounds fails here, before any work
    check_outputs(config)  # so does an output folder holding another run's results
    torch.manual_seed(config.seed)
    torch.set_num_threads(config.threads)
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    # Demonstrations: cached on disk, collected by the scripted expert when missing.
    with tqdm(total=config.demo_episodes, desc="demonstrations") as demo_progress:
        demos, demo_file, cached = load_or_collect_demos(
            num_episodes=config.demo_episodes,
            action_noise=config.demo_action_noise,
            seed=demonstration_seed(config),
            directory=config.demo_dir,
            progress=demo_progress.update,
            task=config.task,
            **task_options(config),
        )
    print(f"demonstrations {'loaded from' if cached else 'written to'} {demo_file}")
    dataset = make_chunk_dataset(
        demos["observation"], demos["action"], demos["episode"], config.model.chunk_length
    )
    print(
        f"demonstrations: {config.demo_episodes} episodes, {dataset.shape[0]} steps, "
        f"expert success {demos['success'].float().mean().item():.1%}"
    )

    # Model (sized for the task; observation statistics from the demonstrations), training.
    task = get_task(config.task)
    config.model = dataclasses.replace(
        config.model, observation_dim=task.observation_dim, action_dim=task.action_dim
    )
    normalizer = ObservationNormalizer.from_data(dataset["observation"])
    # The parity check below evaluates the model's distribution (x_0 ~ N(0, I)).
    policy = build_policy(config.model, normalizer, SamplerOptions(eval_noise_scale=1.0))
    losses = train(policy, dataset, config)
    train_seconds = time.perf_counter() - start

    # Evaluation at K = 20 and the rollouts' K, checkpoint and summary.
    policy.eval()
    results = evaluate_parity(policy, config)
    summary = {
        "config": dataclasses.asdict(config),
        "bc_success_k20": results[20]["success_rate"],
        "bc_success_rollout_k": results[config.rollout_denoising_steps]["success_rate"],
        "bc_return_k20": results[20]["mean_return"],
        "demo_seed": demonstration_seed(config),
        "demo_success": demos["success"].float().mean().item(),
        "final_loss": sum(losses[-100:]) / len(losses[-100:]),
        "train_seconds": train_seconds,
        "total_seconds": time.perf_counter() - start,
    }
    checkpoint = output_dir / config.checkpoint_name
    save_policy(checkpoint, policy, config.model, task=config.task, summary=json.dumps(summary))
    write_json(output_dir / "summary.json", summary)
    print(f"saved {checkpoint} ({summary['total_seconds']:.0f} s)")
    return summary


if __name__ == "__main__":
    main(
        parse_config(
            PretrainConfig,
            description=__doc__,
            task_defaults=script_defaults("pretrain"),
            exclude=EXCLUDE,
        )
    )
