"""BatchedGymEnv: N gymnasium environments behind one batch-locked TorchRL env."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from torchrl_flowpolicy.envs import make_chunked_env
from torchrl_flowpolicy.envs.batched import BatchedGymEnv

ENV_ID = "Pusher-v5"


def test_specs_and_check_env_specs():
    env = BatchedGymEnv(ENV_ID, 3, max_episode_steps=10)
    assert env.batch_size == (3,)
    assert env.observation_spec["observation"].shape == (3, 23)
    assert env.action_spec.shape == (3, 7)
    assert env.observation_spec["observation"].dtype == torch.float32
    env.check_env_specs()


def test_matches_gymnasium_step_by_step():
    env = BatchedGymEnv(ENV_ID, 2, max_episode_steps=10)
    env.set_seed(5)
    actions = torch.rand(6, 2, 7) * 4 - 2
    td = env.reset()
    references = [gym.make(ENV_ID, max_episode_steps=10) for _ in range(2)]
    observations = [
        reference.reset(seed=5 + index)[0] for index, reference in enumerate(references)
    ]
    np.testing.assert_allclose(td["observation"].numpy(), np.stack(observations), rtol=1e-6)
    for action in actions:
        td["action"] = action
        td = env.step(td)
        for index, reference in enumerate(references):
            observation, reward, *_ = reference.step(action[index].numpy())
            np.testing.assert_allclose(
                td["next", "observation"][index].numpy(), observation, rtol=1e-5
            )
            assert td["next", "reward"][index].item() == pytest.approx(reward, rel=1e-5)
        td = env.step_mdp(td)


def test_partial_step_and_partial_reset():
    env = BatchedGymEnv(ENV_ID, 2, max_episode_steps=10)
    env.set_seed(0)
    td = env.reset()
    before = td["observation"].clone()
    td["action"] = torch.ones(2, 7)
    td["_step"] = torch.tensor([True, False])
    out = env.step(td)
    assert not torch.equal(out["next", "observation"][0], before[0])
    torch.testing.assert_close(out["next", "observation"][1], before[1])
    assert out["next", "reward"][1].item() == 0.0
    stepped = out["next", "observation"].clone()
    carried = out["next"].clone().set("_reset", torch.tensor([[False], [True]]))
    reset = env.reset(carried)
    assert not torch.equal(reset["observation"][1], stepped[1])
    torch.testing.assert_close(reset["observation"][0], stepped[0])


def test_time_limit_and_same_seed_same_states():
    env = make_chunked_env(BatchedGymEnv(ENV_ID, 2, max_episode_steps=6), executed_chunk_length=4)
    env.set_seed(1)
    first = env.rollout(4, break_when_any_done=False)
    assert first["next", "truncated"].squeeze(-1).tolist() == [[False, True, False, True]] * 2
    env.set_seed(1)
    second = env.rollout(1, break_when_any_done=False)
    torch.testing.assert_close(first["observation"][:, 0], second["observation"][:, 0])
    env.set_seed(2)
    third = env.rollout(1, break_when_any_done=False)
    assert not torch.equal(first["observation"][:, 0], third["observation"][:, 0])


def test_rejects_non_box_spaces():
    with pytest.raises(TypeError, match="Box"):
        BatchedGymEnv("CartPole-v1", 2)
    with pytest.raises(ValueError, match="num_envs"):
        BatchedGymEnv(ENV_ID, 0)


def test_a_skipped_sub_environment_reports_its_last_done_flags():
    # Sub-environment 0 reaches its time limit one step before sub-environment 1 (which
    # skipped the first step); skipped afterwards, it still reports done, as TorchRL's
    # batched environments do. A chunk or a rollout stops stepping it on that flag.
    env = BatchedGymEnv("Pusher-v5", 2, max_episode_steps=2)
    td = env.reset()
    for mask, expected_done in (([1, 0], [0, 0]), ([1, 1], [1, 0]), ([0, 1], [1, 1])):
        td["action"] = torch.zeros(2, 7)
        td["_step"] = torch.tensor(mask, dtype=torch.bool)
        out = env.step(td)
        assert out["next", "done"].squeeze(-1).tolist() == [bool(v) for v in expected_done]
        assert torch.equal(out["next", "done"], out["next", "truncated"])
        td = env.step_mdp(out)
    assert not env.reset()["done"].any()


def test_groups_of_sub_environments_start_from_the_same_state():
    env = make_chunked_env(
        BatchedGymEnv(ENV_ID, 6, group_size=3, max_episode_steps=6), executed_chunk_length=4
    )
    env.set_seed(7)
    first = env.reset()["observation"]
    references = [gym.make(ENV_ID).reset(seed=seed)[0] for seed in (7, 8)]
    np.testing.assert_allclose(first.numpy(), np.repeat(np.stack(references), 3, 0), rtol=1e-6)
    assert not torch.equal(first[0], first[3])
    env.set_seed(7)  # seeded again: the same groups
    torch.testing.assert_close(env.reset()["observation"], first)
    env.set_seed(9)  # another seed: other states, still grouped
    other = env.reset()["observation"]
    assert torch.equal(other[0], other[2]) and not torch.equal(other[0], first[0])
    reference = torch.as_tensor(gym.make(ENV_ID).reset(seed=10)[0], dtype=torch.float32)
    torch.testing.assert_close(other[3], reference)


def test_group_size_must_divide_num_envs():
    with pytest.raises(ValueError, match="positive divisor of num_envs 4"):
        BatchedGymEnv(ENV_ID, 4, group_size=3)
    with pytest.raises(ValueError, match="positive divisor"):
        BatchedGymEnv(ENV_ID, 4, group_size=0)
