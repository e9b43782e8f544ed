"""A LeRobot pi0-architecture policy, cloned with LeRobot's own loss, fine-tuned with PPO.

Runs in ``.venv-lerobot`` (``bash scripts/setup_lerobot_env.sh``), offline. Top to bottom:

1. config (``--help``), seeding;
2. the scripted expert's noisy demonstrations of Pusher-v5 (this package's task and expert),
   as chunks, with LeRobot's MEAN_STD statistics of the state and the actions;
3. a small pi0 (LeRobot's ``PI0Policy``, random initialisation) whose inputs are the
   normalised state, a constant black camera and a constant one-token prompt: pi0 feeds the
   state to its action expert, so the VLM's prefix is constant here and stays frozen
   (``train_expert_only``); an environment transform (:class:`LeRobotInputs`) writes these
   inputs and un-normalises the actions, where LeRobot's pre- and post-processors would;
4. behaviour cloning with LeRobot's own flow-matching loss, ``policy.forward(batch)``; a
   copy of the result is the protocol's start (BC);
5. PPO with ``DenoisingClipPPOLoss`` through the bridge (``flow_policy_from_lerobot``: the
   same LeRobot object as a ``FlowSDEPolicy``), GAE over decisions, a value network on
   the normalised state; as in ``examples/ppo.py``, the last denoising steps explore
   (``--sde_mode last``) and the episodes that succeeded are imitated (``--bc_coeff``);
6. the held-out protocol (``reports.held_out_protocol``): BC and PPO under both decodings
   beside the clean expert on the same episodes, with Wilson and paired bootstrap intervals
   (``--split validation``: the same protocol on the validation states, to choose settings);
7. LeRobot's ``save_pretrained`` of the fine-tuned policy (with the normalisation
   statistics), reloaded with its ``from_pretrained``; its ``predict_action_chunk`` from
   the same noise is compared with the bridge's chunk.

Run::

    .venv-lerobot/bin/python examples/lerobot_finetune.py --quick     # a smoke run
    .venv-lerobot/bin/python examples/lerobot_finetune.py --seed 0    # the full run

Actions: LeRobot's pi0 pads them to ``max_action_dim``; here ``max_action_dim`` is the
Pusher's 7, so nothing is padded, and the chunk's rows are (normalised) torques that the
environment transform below un-normalises, as LeRobot's post-processor would.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MUJOCO_GL", "egl")

import copy  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Literal  # noqa: E402

import torch  # noqa: E402
from tensordict import TensorDict, TensorDictBase  # noqa: E402
from tensordict.nn import TensorDictModule  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torchrl.data import Composite, Unbounded  # noqa: E402
from torchrl.envs import Transform  # noqa: E402
from torchrl.envs.utils import ExplorationType, set_exploration_type  # noqa: E402
from torchrl.objectives import ValueEstimators  # noqa: E402

from torchrl_flowpolicy.envs import decision_discount  # noqa: E402
from torchrl_flowpolicy.integrations.lerobot import flow_policy_from_lerobot  # noqa: E402
from torchrl_flowpolicy.integrations.lerobot_models import (  # noqa: E402
    ModelSizes,
    lerobot_sizes,
    random_lerobot_policy,
)
from torchrl_flowpolicy.objectives import DenoisingClipPPOLoss  # noqa: E402
from torchrl_flowpolicy.sampler import SamplerOptions  # noqa: E402
from torchrl_flowpolicy.tasks import get_task  # noqa: E402
from torchrl_flowpolicy.training.collectors import make_task_env  # noqa: E402
from torchrl_flowpolicy.training.data import make_chunk_dataset  # noqa: E402
from torchrl_flowpolicy.training.episodes import episode_success_flags  # noqa: E402
from torchrl_flowpolicy.training.protocol import training_seed  # noqa: E402
from torchrl_flowpolicy.training.reports import (  # noqa: E402
    decisions_per_episode,
    held_out_protocol,
    task_options,
)
from torchrl_flowpolicy.training.run_checks import check_output_dir  # noqa: E402
from torchrl_flowpolicy.training.runs import write_json  # noqa: E402

from common import TaskOptions, option, parse_config  # noqa: E402

CAMERA = "observation.images.top"
# What a run leaves in its --output_dir (refused there without --overwrite).
RESULTS = ("summary.json", "lerobot_policy")
# Where the environment transform writes LeRobot's inputs (the env's own "observation" is
# the flat Pusher state, so LeRobot's dotted names go under "lerobot").
KEYS = {
    "observation.state": ("lerobot", "state"),
    CAMERA: ("lerobot", "image"),
    "observation.language.tokens": ("lerobot", "tokens"),
    "observation.language.attention_mask": ("lerobot", "token_mask"),
}


@dataclass
class FinetuneConfig(TaskOptions):
    """Every field is a command-line option (``--help``)."""

    seed: int = option(
        0,
        "seeds torch (initialisation, minibatches, noise), the demonstrations, training resets",
        minimum=0,
    )
    output_dir: str = option("outputs/lerobot_finetune", "summary and LeRobot checkpoint")
    overwrite: bool = option(False, "replace the summary and checkpoint that output_dir holds")
    demo_episodes: int = option(20, "noisy scripted-expert episodes to clone", minimum=1)
    demo_action_noise: float = option(0.3, "std of the noise on the expert's torques", minimum=0)
    chunk_length: int = option(8, "H: LeRobot's chunk_size", minimum=1)
    executed_chunk_length: int = option(4, "H': LeRobot's n_action_steps", minimum=1)
    expert_width: int = option(64, "width of pi0's action expert (its VLM: 32)", minimum=8)
    depth: int = option(2, "layers of the VLM and of the expert (pi0 pairs them)", minimum=1)
    num_denoising_steps: int = option(10, "K of rollouts and evaluation (pi0's default)", minimum=2)
    pretrain_steps: int = option(3000, "steps of LeRobot's flow-matching loss", minimum=1)
    pretrain_batch_size: int = option(256, "chunks per behaviour-cloning minibatch", minimum=1)
    pretrain_learning_rate: float = option(3e-4, "AdamW, cosine decay", above=0)
    iterations: int = option(60, "PPO iterations (one episode per environment each)", minimum=1)
    num_envs: int = option(16, "training environments", minimum=1)
    epochs: int = option(4, "passes over each batch", minimum=1)
    minibatch_size: int = option(304, "decisions per minibatch", minimum=1)
    noise_level: float = option(0.5, "a: the Flow-SDE's exploration noise", minimum=0)
    sde_mode: Literal["mixed", "last"] = option(
        "last", "stochastic steps: one random step (mixed) or the last num_sde_steps"
    )
    num_sde_steps: int = option(4, "how many steps sde_mode last makes stochastic", minimum=1)
    rollout_noise_scale: float = option(
        0.0, "std of a rollout's x_0 (0: explore around the noise-free chunk)", minimum=0
    )
    bc_coeff: float = option(0.1, "self-imitation on successful episodes (0: off)", minimum=0)
    actor_learning_rate: float = option(3e-5, "Adam on the LeRobot policy", above=0)
    critic_learning_rate: float = option(1e-3, "Adam on the value network", above=0)
    critic_warmup_iterations: int = option(3, "first iterations train the critic only", minimum=0)
    reward_scale: float = option(0.1, "multiplies the summed chunk reward", above=0)
    gamma: float = option(0.99, "discount per environment step", minimum=0, maximum=1)
    gae_lambda: float = option(0.95, "GAE lambda over decisions", minimum=0, maximum=1)
    held_out_episodes: int = option(100, "final protocol episodes (held-out seeds)", minimum=1)
    split: Literal["held_out", "validation"] = option(
        "held_out", "the protocol's states: validation to choose settings on, held_out to report"
    )
    reported_decoding: Literal["sampled", "noise_free"] = option(
        "noise_free", "PPO's decoding reported on the held-out states (as examples/ppo.py)"
    )
    threads: int = option(1, "torch CPU threads", minimum=1)


QUICK = {
    "demo_episodes": 2,
    "pretrain_steps": 30,
    "pretrain_batch_size": 32,
    "iterations": 2,
    "num_envs": 4,
    "epochs": 1,
    "minibatch_size": 64,
    "critic_warmup_iterations": 1,
    "held_out_episodes": 4,
    "num_denoising_steps": 4,
}


class LeRobotInputs(Transform):
    """Pusher's state as LeRobot's inputs, and LeRobot's actions back as Pusher's torques.

    Forward (every reset and step): ``"observation"`` ``[*B, 23]`` to the entries of
    :data:`KEYS`: the state normalised with the demonstrations' mean and std (LeRobot's
    MEAN_STD), a constant black ``uint8`` camera and a constant one-token prompt. Inverse
    (every action): the chunk ``[*B, H', 7]``, normalised, to torques (``* std + mean``).
    """

    def __init__(self, stats: dict[str, Tensor], image_size: int):
        super().__init__(in_keys=["observation"], out_keys=list(KEYS.values()))
        self.in_keys_inv, self.out_keys_inv = ["action"], ["action"]
        for name, value in stats.items():
            self.register_buffer(name, value)
        self.image_size = image_size

    def _lerobot_inputs(self, tensordict: TensorDictBase) -> TensorDictBase:
        observation = tensordict["observation"]
        batch, device = observation.shape[:-1], observation.device
        size = self.image_size
        tensordict[KEYS["observation.state"]] = (observation - self.state_mean) / self.state_std
        tensordict[KEYS[CAMERA]] = torch.zeros(
            *batch, 3, size, size, dtype=torch.uint8, device=device
        )
        tensordict[KEYS["observation.language.tokens"]] = torch.full((*batch, 1), 6, device=device)
        tensordict[KEYS["observation.language.attention_mask"]] = torch.ones(
            *batch, 1, dtype=torch.bool, device=device
        )
        return tensordict

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        return self._lerobot_inputs(next_tensordict)

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase):
        return self._lerobot_inputs(tensordict_reset)

    def _inv_apply_transform(self, action: Tensor) -> Tensor:
        return action * self.action_std + self.action_mean

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        batch = observation_spec["observation"].shape[:-1]
        state_dim = observation_spec["observation"].shape[-1]
        size, device = self.image_size, observation_spec.device
        observation_spec[KEYS["observation.state"]] = Unbounded((*batch, state_dim), device=device)
        observation_spec[KEYS[CAMERA]] = Unbounded(
            (*batch, 3, size, size), dtype=torch.uint8, device=device
        )
        observation_spec[KEYS["observation.language.tokens"]] = Unbounded(
            (*batch, 1), dtype=torch.int64, device=device
        )
        observation_spec[KEYS["observation.language.attention_mask"]] = Unbounded(
            (*batch, 1), dtype=torch.bool, device=device
        )
        return observation_spec


def make_env(config: FinetuneConfig, num_envs: int, stats: dict[str, Tensor], image_size: int):
    """The task with ``H'``-step chunks (``common.make_task_env``), then :class:`LeRobotInputs`."""
    options = task_options(config)
    env = make_task_env(config.task, num_envs, config.executed_chunk_length, task_options=options)
    env.append_transform(LeRobotInputs(stats, image_size))
    return env


def lerobot_batch(states: Tensor, image_size: int) -> dict[str, Tensor]:
    """LeRobot's training batch for normalised states ``[B, O]`` (the camera in [0, 1])."""
    size = states.shape[0]
    return {
        "observation.state": states,
        CAMERA: torch.zeros(size, 3, image_size, image_size),
        "observation.language.tokens": torch.full((size, 1), 6),
        "observation.language.attention_mask": torch.ones(size, 1, dtype=torch.bool),
    }


def pretrain(lerobot_policy, dataset, stats, config: FinetuneConfig, image_size: int) -> float:
    """LeRobot's own flow-matching loss (``policy.forward(batch)``) on the demonstrations;
    returns the mean loss of the last 100 steps."""
    parameters = [p for p in lerobot_policy.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(parameters, lr=config.pretrain_learning_rate, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, config.pretrain_steps)
    lerobot_policy.train()
    losses = []
    for step in range(config.pretrain_steps):
        minibatch = dataset[torch.randint(dataset.shape[0], (config.pretrain_batch_size,))]
        states = (minibatch["observation"] - stats["state_mean"]) / stats["state_std"]
        batch = lerobot_batch(states, image_size)
        batch["action"] = (minibatch["action"] - stats["action_mean"]) / stats["action_std"]
        loss, _ = lerobot_policy.forward(batch)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimiser.step()
        schedule.step()
        losses.append(loss.item())
        if step % 500 == 0 or step == config.pretrain_steps - 1:
            recent = losses[-100:]
            print(f"[pretrain] step {step}: LeRobot's loss {sum(recent) / len(recent):.4f}")
    lerobot_policy.eval()
    return sum(losses[-100:]) / len(losses[-100:])


def main(config: FinetuneConfig) -> dict:
    # Before any work: never replace another run's results without --overwrite.
    check_output_dir(
        config.output_dir, RESULTS, resume=False, overwrite=config.overwrite, resumable=False
    )
    torch.manual_seed(config.seed)
    torch.set_num_threads(config.threads)
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    task = get_task(config.task)

    # 1. Demonstrations (the noisy scripted expert) as chunks; LeRobot's MEAN_STD statistics.
    demos = task.collect_demos(
        config.demo_episodes, config.demo_action_noise, seed=config.seed, **task_options(config)
    )
    dataset = make_chunk_dataset(
        demos["observation"], demos["action"], demos["episode"], config.chunk_length
    )
    dataset = dataset[dataset["action_row_mask"].all(-1)]  # pi0's loss scores every row
    stats = {
        "state_mean": demos["observation"].mean(0),
        "state_std": demos["observation"].std(0).clamp_min(1e-2),
        "action_mean": demos["action"].mean(0),
        "action_std": demos["action"].std(0).clamp_min(1e-2),
    }
    print(
        f"demonstrations: {config.demo_episodes} episodes, {dataset.shape[0]} chunks, "
        f"expert success {demos['success'].float().mean().item():.0%}"
    )

    # 2. A small pi0: LeRobot's own classes at small sizes, random initialisation.
    sizes = ModelSizes(
        width=32,
        expert_width=config.expert_width,
        depth=config.depth,
        mlp_dim=128,
        num_heads=8,
        num_kv_heads=1,
        head_dim=8,
        vocab_size=16,
    )
    image_size = 32
    lerobot_policy = random_lerobot_policy(
        "pi0",
        sizes=sizes,
        action_dim=task.action_dim,
        state_dim=task.observation_dim,
        image_size=image_size,
        camera=CAMERA,
        chunk_size=config.chunk_length,
        n_action_steps=config.executed_chunk_length,
        max_action_dim=task.action_dim,
        max_state_dim=32,
        num_inference_steps=config.num_denoising_steps,
        train_expert_only=True,
        tokenizer_max_length=8,
    )
    trainable = sum(p.numel() for p in lerobot_policy.parameters() if p.requires_grad)
    total = sum(p.numel() for p in lerobot_policy.parameters())
    print(f"pi0: {total} parameters, {trainable} trainable (the expert and its projections)")

    # 3. Behaviour cloning with LeRobot's loss; a frozen copy is the protocol's start (BC).
    final_bc_loss = pretrain(lerobot_policy, dataset, stats, config, image_size)
    steps = config.num_denoising_steps
    options = SamplerOptions(
        num_denoising_steps=steps,
        eval_num_denoising_steps=steps,
        noise_level=config.noise_level,
        sde_mode=config.sde_mode,
        num_sde_steps=min(config.num_sde_steps, steps - 1),
        rollout_noise_scale=config.rollout_noise_scale,
    )
    bc_policy = flow_policy_from_lerobot(
        copy.deepcopy(lerobot_policy), options=options, observation_keys=KEYS
    ).policy

    # 4. PPO through the bridge: the same LeRobot object as a FlowSDEPolicy.
    policy = flow_policy_from_lerobot(lerobot_policy, options=options, observation_keys=KEYS).policy
    critic = TensorDictModule(
        nn.Sequential(
            nn.Linear(task.observation_dim, 256),
            nn.Tanh(),
            nn.Linear(256, 256),
            nn.Tanh(),
            nn.Linear(256, 1),
        ),
        in_keys=[KEYS["observation.state"]],
        out_keys=["state_value"],
    )
    loss_module = DenoisingClipPPOLoss(
        policy,
        critic,
        clip_epsilon=(0.2, 0.28),
        normalize_advantage=True,
        loss_critic_type="l2",
        bc_coeff=config.bc_coeff,
    )
    loss_module.make_value_estimator(
        ValueEstimators.GAE,
        lmbda=config.gae_lambda,
        gamma=decision_discount(config.gamma, config.executed_chunk_length),
    )
    actor_parameters = [p for p in policy.parameters() if p.requires_grad]
    actor_optimiser = torch.optim.Adam(actor_parameters, lr=config.actor_learning_rate)
    critic_optimiser = torch.optim.Adam(critic.parameters(), lr=config.critic_learning_rate)
    env = make_env(config, config.num_envs, stats, image_size)
    decisions = decisions_per_episode(config.max_episode_steps, config.executed_chunk_length)
    history = []
    for iteration in range(1, config.iterations + 1):
        env.set_seed(training_seed(config.seed, iteration, config.num_envs))
        with set_exploration_type(ExplorationType.RANDOM), torch.no_grad():
            batch = env.rollout(decisions, policy, break_when_any_done=False)
        batch["next", "reward"] = batch["next", "reward"] * config.reward_scale
        if config.bc_coeff > 0:  # every decision of an episode that ended in success
            batch["success"] = episode_success_flags(batch)
        with torch.no_grad():
            loss_module.value_estimator(batch)
        flat = batch.reshape(-1)
        train_actor = iteration > config.critic_warmup_iterations
        drifts, clip_fractions = [], []
        for _ in range(config.epochs):
            for index in torch.randperm(flat.shape[0]).split(config.minibatch_size):
                losses = loss_module(flat[index])
                drifts.append(losses["log_prob_drift"].item())
                clip_fractions.append(losses["clip_fraction"].item())
                actor_optimiser.zero_grad(set_to_none=True)
                critic_optimiser.zero_grad(set_to_none=True)
                actor_loss = losses["loss_objective"] + losses.get("loss_bc", 0.0)
                actor_loss = actor_loss if train_actor else 0.0
                (losses["loss_critic"] + actor_loss).backward()
                torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
                critic_optimiser.step()
                if train_actor:
                    torch.nn.utils.clip_grad_norm_(actor_parameters, 1.0)
                    actor_optimiser.step()
        done = batch["next", "done"]
        row = {
            "iteration": iteration,
            "train_success": batch["next", "success"][done].float().mean().item(),
            "log_prob_drift_before_update": drifts[0],
            "clip_fraction": sum(clip_fractions) / len(clip_fractions),
        }
        history.append(row)
        print(
            f"[ppo] iteration {iteration}: training success {row['train_success']:.0%}, "
            f"drift before the update {drifts[0]:.1e}, clip fraction {row['clip_fraction']:.3f}"
        )
    env.close()

    # 5. Held-out protocol: BC and PPO under both decodings, the expert, paired intervals.
    eval_env = make_env(config, task.eval_envs(config.held_out_episodes), stats, image_size)
    protocol = held_out_protocol(
        bc_policy,
        policy,
        config,
        config.executed_chunk_length,
        name="PPO",
        env=eval_env,
        split=config.split,
    )
    eval_env.close()
    print(protocol["line"])

    # 6. LeRobot's checkpoint of the fine-tuned policy, reloaded by LeRobot and compared.
    checkpoint = output_dir / "lerobot_policy"
    lerobot_policy.save_pretrained(checkpoint)
    statistics = {name: value.tolist() for name, value in stats.items()}
    (checkpoint / "normalisation_stats.json").write_text(json.dumps(statistics, indent=1))
    with lerobot_sizes(sizes):  # the saved configuration names the variants, not these sizes
        reloaded = type(lerobot_policy).from_pretrained(checkpoint).eval()
    batch = lerobot_batch(torch.randn(3, task.observation_dim), image_size)
    noise = torch.randn(3, config.chunk_length, task.action_dim)
    observation = TensorDict({KEYS[name]: value for name, value in batch.items()}, [3])
    ours = policy.decode(observation, noise)
    theirs = reloaded.predict_action_chunk(dict(batch), noise=noise)
    reload_error = (ours - theirs[:, : config.executed_chunk_length]).abs().max().item()
    print(f"saved {checkpoint}; LeRobot's reload samples the same chunk to {reload_error:.1e}")

    result = {
        "config": dataclasses.asdict(config),
        "final_bc_loss": final_bc_loss,
        "parameters": total,
        "trainable_parameters": trainable,
        "protocol": protocol,
        "history": history,
        "reload_max_abs_error": reload_error,
        "seconds": time.perf_counter() - start,
    }
    write_json(output_dir / "summary.json", result)
    return result


if __name__ == "__main__":
    main(parse_config(FinetuneConfig, description=__doc__, quick=QUICK))
