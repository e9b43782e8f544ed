"""``examples/ppo.py --advantage grpo`` in process: every batch starts each group from one
seeded state, the advantage of each environment's first episode, the critic-free iteration
and its checkpoint."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict

from torchrl_flowpolicy import FlowSDEPolicy, SamplerOptions
from torchrl_flowpolicy.networks import ObservationNormalizer
from torchrl_flowpolicy.training.checkpoint import load_checkpoint
from torchrl_flowpolicy.training.collectors import first_reset_seed, make_collector, seed_batch
from torchrl_flowpolicy.training.episodes import group_relative_episodes, group_statistics
from torchrl_flowpolicy.training.models import ModelConfig, build_policy
from torchrl_flowpolicy.training.runs import RunProgress, load_run, resume_run, run_identity

CHUNK_LENGTH, EXECUTED = 4, 2
MAX_EPISODE_STEPS = 6  # 3 decisions of 2 steps


@pytest.fixture
def ppo(example):
    """``examples/ppo.py``, loaded from its path."""
    return example("ppo")


def model_config():
    return ModelConfig(
        chunk_length=CHUNK_LENGTH, executed_chunk_length=EXECUTED, model_dim=16, num_layers=1
    )


def example_policy() -> FlowSDEPolicy:
    torch.manual_seed(0)
    normalizer = ObservationNormalizer(torch.zeros(23), torch.ones(23))
    sampler = SamplerOptions(num_denoising_steps=4, sde_mode="all")
    return build_policy(model_config(), normalizer, sampler)


def grpo_config(ppo, **changes):
    options = {
        "advantage": "grpo",
        "group_size": 2,
        "num_envs": 4,
        "max_episode_steps": MAX_EPISODE_STEPS,
        "minibatch_size": 5,
        "epochs": 2,
        "threads": 1,
        **changes,
    }
    return ppo.PPOConfig(**options)


def batch_seed(config, iteration: int, **ranks) -> int:
    """The example's reset seed of a batch: groups of ``group_size`` count once."""
    return first_reset_seed(
        config.seed, iteration, config.num_envs, group_size=config.group_size, **ranks
    )


def collect_batches(ppo, config, policy, iterations: int) -> list[TensorDict]:
    """What ``main`` does before each batch: seed the groups, then collect."""
    make_env, options = ppo.training_envs(config, EXECUTED), ppo.collector_options(config)
    assert make_env.group_size == config.group_size  # grpo: the groups are seeded alike
    frames = config.num_envs * 3
    collector = make_collector(policy, make_env, options, frames_per_batch=frames, seed=0)
    try:
        batches = iter(collector)
        collected = []
        for iteration in range(1, iterations + 1):
            seed_batch(collector, options, batch_seed(config, iteration))
            collected.append(next(batches))
        return collected
    finally:
        collector.shutdown()


def test_each_batch_starts_every_group_from_one_seeded_state(ppo):
    config = grpo_config(ppo, num_envs=6)
    batches = collect_batches(ppo, config, example_policy(), iterations=3)
    for iteration, batch in enumerate(batches, start=1):
        assert batch.batch_size == (6, 3)
        assert (batch["step_count"][:, 0] == 0).all()  # every environment starts an episode
        first = batch_seed(config, iteration)
        states = [gym.make("Pusher-v5").reset(seed=first + group)[0] for group in range(3)]
        np.testing.assert_allclose(
            batch["observation"][:, 0].numpy(), np.repeat(np.stack(states), 2, 0), rtol=1e-6
        )
    # Seeds count groups (3 of them): training_seed(0, n, 3).
    assert [batch_seed(config, n) for n in (1, 2, 3)] == [0, 40_000, 70_000]
    # The members of a group draw their own noise: the chunks differ.
    assert not torch.equal(batches[0]["action"][0, 0], batches[0]["action"][1, 0])
    # Under torchrun, rank r's groups follow those of ranks 0 .. r - 1.
    assert batch_seed(config, 1, rank=1, world_size=2) == 3


def test_group_relative_batch_keeps_each_environments_first_episode(ppo):
    config = grpo_config(ppo)
    done = torch.zeros(4, 3, 1, dtype=torch.bool)
    done[:, 2] = True
    done[1, 0] = True  # environment 1 ends at once (a success) and starts another episode
    reward = torch.tensor([[1.0, 1, 1], [5.0, 9, 9], [0.0, 0, 0], [0.0, 0, 0]]).unsqueeze(-1)
    batch = TensorDict({"next": {"done": done, "reward": reward}}, batch_size=[4, 3])
    episodes = group_relative_episodes(batch, config.group_size)
    assert episodes.batch_size == (10,)
    assert episodes["group_id"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    # group 0: returns 3 and 5; group 1: 0 and 0 (no spread: advantage 0)
    half = 2**-0.5
    expected = [-half] * 3 + [half] + [0.0] * 6
    torch.testing.assert_close(episodes["advantage"].squeeze(-1), torch.tensor(expected))
    statistics = group_statistics(episodes, config.group_size, collected_decisions=12)
    assert statistics["grpo/zero_std_groups"] == 0.5
    assert statistics["grpo/kept_decisions"] == 10 / 12
    assert statistics["grpo/episode_return"] == 2.0


def test_critic_free_iteration_trains_the_actor_and_checkpoints_no_critic(ppo, tmp_path):
    config = grpo_config(ppo)
    policy = example_policy()
    learner = ppo.make_learner(policy, config, EXECUTED)
    assert learner.critic is None and learner.loss_module.critic_network is None
    assert set(learner.trained()) == {"policy", "actor_optimizer"}
    (batch,) = collect_batches(ppo, config, policy, iterations=1)
    before = [parameter.detach().clone() for parameter in policy.parameters()]
    replay_buffer = ppo.make_replay_buffer(config, batch.numel())
    row = ppo.ppo_iteration(learner, batch, replay_buffer, config, train_actor=True)
    assert "loss_critic" not in row and "explained_variance" not in row
    assert row["grpo/kept_decisions"] == 1.0  # Pusher episodes end at the time limit only
    assert row["grpo/group_return_std"] > 0
    assert all(np.isfinite(value) for value in row.values())
    moved = [
        not torch.equal(old, new) for old, new in zip(before, policy.parameters(), strict=True)
    ]
    assert any(moved)

    path = tmp_path / "checkpoint.pt"
    ppo.save_ppo_run(path, learner, model_config(), config, RunProgress(1, 24))
    state = load_checkpoint(path)
    assert state["advantage"] == "grpo" and "critic" not in state
    resumed = ppo.make_learner(example_policy(), config, EXECUTED)
    noise = {"kind": "fixed"}
    identity = run_identity(config.task, model_config(), advantage="grpo", noise=noise)
    resume_run(load_run(path, identity), resumed.trained())
    for saved, loaded in zip(policy.parameters(), resumed.policy.parameters(), strict=True):
        torch.testing.assert_close(saved, loaded)
    gae = ppo.PPOConfig(max_episode_steps=MAX_EPISODE_STEPS)
    with pytest.raises(ValueError, match="advantage: saved 'grpo', this run 'gae'"):
        load_run(path, run_identity(gae.task, model_config(), advantage=gae.advantage, noise=noise))
