"""The default task: success criterion, scripted expert, TorchRL env and cached demos.

Covers :mod:`torchrl_flowpolicy.tasks.pusher.env`, :mod:`~torchrl_flowpolicy.tasks.pusher.expert`
and :mod:`~torchrl_flowpolicy.tasks.demonstrations` (with
:mod:`~torchrl_flowpolicy.tasks.pusher.demos`).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from torchrl.collectors import Collector
from torchrl.envs import Compose, DoubleToFloat, GymEnv, TransformedEnv
from torchrl.envs.utils import check_env_specs

from torchrl_flowpolicy.envs import BatchedGymEnv, make_chunked_env
from torchrl_flowpolicy.tasks.demonstrations import demos_path, load_or_collect_demos
from torchrl_flowpolicy.tasks.pusher.demos import collect_demos
from torchrl_flowpolicy.tasks.pusher.env import (
    DEFAULT_SUCCESS_THRESHOLD,
    PUSHER_ENV_ID,
    PusherTask,
    is_success,
    make_pusher_env,
    object_goal_distance,
)
from torchrl_flowpolicy.tasks.pusher.expert import PusherExpert


def synthetic_observation(object_xyz, goal_xyz, wrist_xyz=(0.0, 0.0, 0.0)) -> torch.Tensor:
    observation = torch.zeros(23)
    observation[14:17] = torch.tensor(wrist_xyz)
    observation[17:20] = torch.tensor(object_xyz)
    observation[20:23] = torch.tensor(goal_xyz)
    return observation


# ----------------------------------------------------------------------------- success
def test_distance_is_horizontal_and_batched():
    # 3-4-5 triangle in the plane; the heights differ as in Pusher-v5 and are ignored.
    observation = synthetic_observation((0.45 + 0.03, -0.05 + 0.04, -0.275), (0.45, -0.05, -0.323))
    assert object_goal_distance(observation).item() == pytest.approx(0.05, abs=1e-6)
    batch = torch.stack([observation, synthetic_observation((1, 1, 0), (1, 1, 5))]).expand(3, 2, 23)
    distance = object_goal_distance(batch)
    assert distance.shape == (3, 2)
    assert torch.allclose(distance[:, 1], torch.zeros(3))
    numpy_distance = object_goal_distance(batch.numpy())
    assert isinstance(numpy_distance, np.ndarray)
    np.testing.assert_allclose(numpy_distance, distance.numpy(), atol=1e-7)


def test_success_threshold_is_strict():
    inside = synthetic_observation((0.449, 0.0, 0.0), (0.45, 0.0, 0.0))
    outside = synthetic_observation((0.45 + 0.06, 0.0, 0.0), (0.45, 0.0, 0.0))
    assert bool(is_success(inside)) and not bool(is_success(outside))
    assert bool(is_success(outside, threshold=0.061))
    at_threshold = synthetic_observation((0.5, 0.0, 0.0), (0.0, 0.0, 0.0))
    assert not bool(is_success(at_threshold, threshold=0.5))
    with pytest.raises(ValueError, match="threshold"):
        is_success(inside, threshold=0.0)
    with pytest.raises(ValueError, match="23 features"):
        object_goal_distance(torch.zeros(4, 20))


# ----------------------------------------------------------------------------- expert
def run_episode(env, act, seed: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    observation, _ = env.reset(seed=seed)
    first = observation
    for _ in range(steps):
        observation, *_ = env.step(act())
    return first, observation


def test_expert_pushes_the_object_to_the_goal():
    env = gym.make("Pusher-v5", max_episode_steps=150)
    expert = PusherExpert(env)
    successes = 0
    for seed in range(8):
        expert.reset()
        first, last = run_episode(env, expert.act, seed, 150)
        assert object_goal_distance(last) < object_goal_distance(first)
        successes += bool(is_success(last))
    # Measured: 8 of 8 on these seeds (about 90 % over 100 other seeds).
    assert successes >= 7


def test_random_torques_do_not_push_the_object():
    env = gym.make("Pusher-v5", max_episode_steps=150)
    generator = np.random.default_rng(0)
    for seed in range(3):
        first, last = run_episode(env, lambda: generator.uniform(-2, 2, 7), seed, 150)
        assert np.linalg.norm(last[17:19] - first[17:19]) < 0.03
        assert not bool(is_success(last))


def test_noisy_expert_is_reproducible_and_keeps_the_clean_action():
    env = gym.make("Pusher-v5", max_episode_steps=20)
    actions = []
    for _ in range(2):
        expert = PusherExpert(env, action_noise=0.5, seed=3)
        env.reset(seed=1)
        run = []
        for _ in range(20):
            action = expert.act()
            assert np.all(np.abs(action) <= 2.0)
            run.append((action, expert.last_clean_action))
            env.step(action)
        actions.append(run)
    for (noisy, clean), (noisy_again, clean_again) in zip(*actions, strict=True):
        np.testing.assert_array_equal(noisy, noisy_again)
        np.testing.assert_array_equal(clean, clean_again)
    differences = np.stack([noisy - clean for noisy, clean in actions[0]])
    assert 0.2 < differences.std() < 0.6  # noise of std 0.5, shrunk a little by clipping


def test_expert_resets_itself_on_a_new_episode():
    env = gym.make("Pusher-v5", max_episode_steps=30)
    expert = PusherExpert(env)
    env.reset(seed=5)
    first = [expert.act() for _ in range(1)]
    for _ in range(30):
        env.step(expert.act())
    env.reset(seed=5)  # simulation time goes back: the expert forgets the old episode
    np.testing.assert_allclose(expert.act(), first[0])


def test_expert_rejects_bad_arguments():
    env = gym.make("Pusher-v5")
    with pytest.raises(ValueError, match="action_noise"):
        PusherExpert(env, action_noise=-0.1)
    with pytest.raises(ValueError, match="Pusher-v5"):
        PusherExpert(gym.make("Reacher-v5"))


# ----------------------------------------------------------------------------- TorchRL env
@pytest.mark.parametrize("reward", ["progress", "gymnasium"])
def test_env_specs(reward):
    env = make_pusher_env(max_episode_steps=12, reward=reward)
    env.set_seed(0)
    check_env_specs(env)
    chunked = make_chunked_env(make_pusher_env(max_episode_steps=12, reward=reward), 4)
    chunked.set_seed(0)
    check_env_specs(chunked)


def test_chunked_env_reports_the_final_outcome():
    env = make_pusher_env(max_episode_steps=10, executed_chunk_length=4)
    env.set_seed(0)
    rollout = env.rollout(10)
    # 10 steps in chunks of 4: two full decisions and one of 2 rows that hits the time limit.
    assert rollout.shape == (3,) and rollout["action"].shape == (3, 4, 7)
    assert rollout["next", "done"].squeeze(-1).tolist() == [False, False, True]
    last = rollout["next"][-1]
    distance = object_goal_distance(last["observation"])
    assert last["object_goal_distance"].item() == pytest.approx(distance.item(), abs=1e-6)
    assert last["success"].item() == bool(distance < DEFAULT_SUCCESS_THRESHOLD)
    assert last["success"].dtype == torch.bool


def test_progress_reward_telescopes_and_survives_chunking():
    actions = torch.from_numpy(np.random.default_rng(0).uniform(-2, 2, (12, 7))).float()
    plain = make_pusher_env(max_episode_steps=12)
    plain.set_seed(7)
    td = plain.reset()
    first = td["observation"]
    rewards = []
    for action in actions:
        td = plain.step(td.set("action", action))
        rewards.append(td["next", "reward"])
        td = plain.step_mdp(td)
    last = td["observation"]

    def wrist_object(observation):
        return torch.linalg.vector_norm(observation[17:20] - observation[14:17])

    expected = 10.0 * (
        object_goal_distance(first)
        - object_goal_distance(last)
        + 0.5 * (wrist_object(first) - wrist_object(last))
    )
    total = torch.stack(rewards).sum()
    assert total.item() == pytest.approx(expected.item(), abs=1e-4)

    chunked = make_pusher_env(max_episode_steps=12, executed_chunk_length=4)
    chunked.set_seed(7)
    td = chunked.reset()
    chunked_total = 0.0
    for chunk in actions.view(3, 4, 7):
        td = chunked.step(td.set("action", chunk))
        chunked_total += td["next", "reward"].item()
        td = chunked.step_mdp(td)
    assert chunked_total == pytest.approx(total.item(), abs=1e-4)
    torch.testing.assert_close(td["observation"], last)


def test_env_runs_under_a_collector():
    collector = Collector(
        lambda: make_pusher_env(max_episode_steps=8, executed_chunk_length=4),
        None,
        frames_per_batch=4,
        total_frames=4,
    )
    batch = next(iter(collector))
    collector.shutdown()
    assert batch["action"].shape == (4, 4, 7)
    assert batch["next", "success"].shape == (4, 1)
    assert batch["next", "done"].sum() == 2


@pytest.mark.parametrize("num_envs", [None, 3])
def test_factory_is_bit_identical_to_the_composition_it_replaces(num_envs):
    # num_envs=None: GymEnv + DoubleToFloat + PusherTask (the old make_pusher_env); an int:
    # BatchedGymEnv + PusherTask (the examples' old make_env); both then chunked.
    task = {"success_threshold": 0.3, "reward": "progress"}
    if num_envs is None:
        base = GymEnv(PUSHER_ENV_ID, max_episode_steps=10)
        composed = TransformedEnv(base, Compose(DoubleToFloat(), PusherTask(**task)))
    else:
        base = BatchedGymEnv(PUSHER_ENV_ID, num_envs, max_episode_steps=10)
        composed = TransformedEnv(base, PusherTask(**task))
    composed = make_chunked_env(composed, 4)
    factory = make_pusher_env(num_envs, executed_chunk_length=4, max_episode_steps=10, **task)
    assert [type(t) for t in factory.transform] == [type(t) for t in composed.transform]
    batch = () if num_envs is None else (num_envs,)
    generator = torch.Generator().manual_seed(0)
    chunks = torch.rand(3, *batch, 4, 7, generator=generator) * 4 - 2
    runs = []
    for env in (composed, factory):
        env.set_seed(5)
        td = env.reset()
        outputs = [td.clone()]
        for chunk in chunks:  # 10 steps in chunks of 4: the last decision hits the time limit
            td = env.step(td.set("action", chunk))
            outputs.append(td["next"].clone())
            td = env.step_mdp(td)
        runs.append(outputs)
    for composed_out, factory_out in zip(*runs, strict=True):
        assert set(factory_out.keys(True, True)) == set(composed_out.keys(True, True))
        for key in composed_out.keys(True, True):
            assert torch.equal(factory_out[key], composed_out[key]), key
    assert runs[1][-1]["done"].all()


def test_bad_env_arguments():
    with pytest.raises(ValueError, match="reward"):
        make_pusher_env(reward="shaped")
    with pytest.raises(ValueError, match="success_threshold"):
        make_pusher_env(success_threshold=-1.0)
    with pytest.raises(ValueError, match="max_episode_steps"):
        make_pusher_env(2, max_episode_steps=0)
    with pytest.raises(ValueError, match="num_envs"):
        make_pusher_env(0)


# ----------------------------------------------------------------------------- demos
def test_demos_round_trip(tmp_path):
    demos, path, loaded = load_or_collect_demos(
        2, 0.5, seed=1, max_episode_steps=15, directory=tmp_path
    )
    assert not loaded and path == demos_path(tmp_path, 2, 0.5, 1, 15) and path.exists()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    assert demos["observation"].shape == (30, 23) and demos["observation"].dtype == torch.float32
    assert demos["action"].shape == (30, 7) and demos["expert_action"].shape == (30, 7)
    assert demos["episode"].tolist() == [0] * 15 + [1] * 15
    assert demos["step"].tolist() == list(range(15)) * 2
    assert demos["success"].shape == (2,) and demos["success"].dtype == torch.bool

    stored = torch.load(path, weights_only=True)
    for key in ("observation", "action", "expert_action", "final_distance", "success"):
        torch.testing.assert_close(stored[key], demos[key])
    assert stored["config"]["action_noise"] == 0.5

    again, _, loaded = load_or_collect_demos(
        2, 0.5, seed=1, max_episode_steps=15, directory=tmp_path
    )
    assert loaded
    torch.testing.assert_close(again["action"], demos["action"])
    # The success flags follow the requested threshold.
    loose, _, _ = load_or_collect_demos(
        2, 0.5, seed=1, max_episode_steps=15, success_threshold=10.0, directory=tmp_path
    )
    assert loose["success"].all()

    # The first episodes do not depend on how many are collected.
    longer = collect_demos(3, 0.5, seed=1, max_episode_steps=15)
    torch.testing.assert_close(longer["action"][:30], demos["action"])


def test_cached_demos_with_other_settings_are_refused(tmp_path):
    demos = collect_demos(1, 0.0, seed=0, max_episode_steps=5)
    demos["config"]["action_noise"] = 0.3
    path = demos_path(tmp_path, 1, 0.0, 0, 5)
    torch.save(demos, path)
    with pytest.raises(ValueError, match="other settings"):
        load_or_collect_demos(1, 0.0, seed=0, max_episode_steps=5, directory=tmp_path)


def test_demos_cache_is_written_atomically(tmp_path, monkeypatch):
    def failing_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        load_or_collect_demos(1, 0.0, seed=0, max_episode_steps=5, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []  # neither a partial cache file nor a temporary one


def test_collect_demos_script(tmp_path, capsys, example):
    script = example("collect_demos")  # loaded from its path, with the examples' common.py
    argv = ["--num_episodes", "2", "--max_episode_steps", "10", "--output_dir", str(tmp_path)]
    first = script.main(script.parse_config(script.CollectConfig, argv))
    second = script.main(script.parse_config(script.CollectConfig, argv))
    assert not first["loaded_from_cache"] and second["loaded_from_cache"]
    assert first["success_rate"] == second["success_rate"] and first["steps"] == 20
    assert "success rate" in capsys.readouterr().out
    demos = torch.load(demos_path(tmp_path, 2, 0.7, 0, 10), weights_only=True)
    assert demos["observation"].shape == (20, 23)
