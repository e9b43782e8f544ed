"""robosuite Lift, PickPlaceCan and NutAssemblySquare: the gymnasium adapter, the TorchRL
environments, the experts and their demos.

Covers :mod:`torchrl_flowpolicy.tasks.robosuite.env` (and its layout,
:mod:`~torchrl_flowpolicy.tasks.robosuite.layout`), the experts of
:mod:`~torchrl_flowpolicy.tasks.robosuite.lift_expert`, :mod:`~torchrl_flowpolicy.tasks.robosuite.can_expert` and
:mod:`~torchrl_flowpolicy.tasks.robosuite.square_expert`,
and :mod:`~torchrl_flowpolicy.tasks.robosuite.experts`. Skipped when robosuite is not installed.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("robosuite")

from torchrl.envs.utils import check_env_specs  # noqa: E402

from torchrl_flowpolicy.envs.batched import BatchedGymEnv  # noqa: E402
from torchrl_flowpolicy.tasks.registry import get_task  # noqa: E402
from torchrl_flowpolicy.tasks.robosuite.can_expert import CAN_COMPARTMENT, CanExpert  # noqa: E402
from torchrl_flowpolicy.tasks.robosuite.env import (  # noqa: E402
    CAN_MAX_EPISODE_STEPS,
    DEFAULT_MAX_EPISODE_STEPS,
    OBSERVATION_SLICES,
    SQUARE_MAX_EPISODE_STEPS,
    RobosuiteGymEnv,
    make_robosuite_env,
)
from torchrl_flowpolicy.tasks.robosuite.experts import (  # noqa: E402
    RobosuiteExpertPolicy,
    collect_robosuite_demos,
)
from torchrl_flowpolicy.tasks.robosuite.lift_expert import LiftExpert  # noqa: E402
from torchrl_flowpolicy.tasks.robosuite.quiet_logging import LOG_LEVEL_VARIABLE  # noqa: E402
from torchrl_flowpolicy.tasks.robosuite.square_expert import (  # noqa: E402
    SQUARE_PEG_POSITION,
    SQUARE_TABLE_HEIGHT,
    SquareExpert,
)
from torchrl_flowpolicy.training.protocol import evaluate_expert  # noqa: E402

LIFT = OBSERVATION_SLICES["Lift"]
CAN = OBSERVATION_SLICES["PickPlaceCan"]
SQUARE = OBSERVATION_SLICES["NutAssemblySquare"]
# Lift's success: the cube's centre more than 0.04 m above the table top (z = 0.8 m).
LIFTED_HEIGHT = 0.84


def run_expert(
    env: RobosuiteGymEnv,
    seed: int,
    steps: int,
    expert: LiftExpert | CanExpert | SquareExpert | None = None,
):
    """Reset with ``seed`` and run the expert; returns the per-step transitions."""
    expert = expert or LiftExpert()
    observation, _ = env.reset(seed=seed)
    transitions = []
    for _ in range(steps):
        observation, reward, terminated, truncated, info = env.step(expert.act(observation))
        transitions.append((observation, reward, terminated, truncated, info))
        if terminated or truncated:
            break
    return transitions


@pytest.fixture(scope="module")
def lift_env() -> RobosuiteGymEnv:
    return RobosuiteGymEnv("Lift", max_episode_steps=DEFAULT_MAX_EPISODE_STEPS)


# ----------------------------------------------------------------------------- gymnasium adapter
def test_observation_layout_matches_robosuite(lift_env):
    observation, info = lift_env.reset(seed=0)
    assert observation.shape == (60,) and observation.dtype == np.float32
    assert info == {"success": False}
    raw = lift_env.robosuite_env._get_observations()
    for name in ("cube_pos", "cube_quat", "gripper_to_cube_pos"):
        np.testing.assert_array_equal(observation[LIFT[name]], raw[name].astype(np.float32))
    for name in ("joint_pos", "joint_vel", "eef_pos", "eef_quat", "gripper_qpos", "gripper_qvel"):
        np.testing.assert_array_equal(
            observation[LIFT[name]], raw[f"robot0_{name}"].astype(np.float32)
        )
    assert lift_env.action_space.shape == (7,)


def test_pick_place_can_layout():
    env = RobosuiteGymEnv("PickPlaceCan")
    layout = OBSERVATION_SLICES["PickPlaceCan"]
    observation, _ = env.reset(seed=0)
    assert observation.shape == (64,)
    assert not observation[layout["can_to_eef_pos"]].any()  # robosuite's reset quirk
    observation = env.step(np.zeros(7))[0]
    raw = env.robosuite_env._get_observations()
    for name, key in (("can_pos", "Can_pos"), ("can_to_eef_pos", "Can_to_robot0_eef_pos")):
        np.testing.assert_array_equal(observation[layout[name]], raw[key].astype(np.float32))
    np.testing.assert_array_equal(
        observation[layout["gripper_qvel"]], raw["robot0_gripper_qvel"].astype(np.float32)
    )


def test_horizon_end_is_truncated_not_terminated():
    env = RobosuiteGymEnv("Lift", max_episode_steps=4)
    env.reset(seed=0)
    outcomes = [env.step(np.zeros(7))[2:4] for _ in range(4)]
    assert outcomes == [(False, False)] * 3 + [(False, True)]
    with pytest.raises(RuntimeError, match="reset"):
        env.step(np.zeros(7))
    # The same through TorchRL: done and truncated, not terminated, at the 4th step.
    batched = make_robosuite_env(2, max_episode_steps=4)
    rollout = batched.rollout(4, break_when_any_done=False)
    assert rollout["next", "truncated"].squeeze(-1).tolist() == [[False] * 3 + [True]] * 2
    assert torch.equal(rollout["next", "done"], rollout["next", "truncated"])
    assert not rollout["next", "terminated"].any()


def test_terminates_on_success_only_when_asked(lift_env):
    transitions = run_expert(lift_env, seed=0, steps=DEFAULT_MAX_EPISODE_STEPS)
    *before, last = transitions
    assert last[2] and not last[3] and last[4]["success"] and last[1] == 1.0
    assert not any(t[2] or t[3] or t[4]["success"] or t[1] for t in before)

    env = RobosuiteGymEnv(
        "Lift", max_episode_steps=len(transitions) + 5, terminate_on_success=False
    )
    transitions = run_expert(env, seed=0, steps=len(transitions) + 5)
    assert len(transitions) == len(before) + 6
    assert not any(t[2] for t in transitions) and transitions[-1][3]
    successes = [t[4]["success"] for t in transitions]
    assert successes[len(before)] and sum(successes) >= 2
    # reward="success": 1 on the first successful step only.
    assert [t[1] for t in transitions] == [float(i == len(before)) for i in range(len(transitions))]


def test_shaped_reward_is_robosuites_staged_reward():
    env = RobosuiteGymEnv("Lift", reward="shaped")
    transitions = run_expert(env, seed=0, steps=DEFAULT_MAX_EPISODE_STEPS)
    rewards = np.array([t[1] for t in transitions])
    assert transitions[-1][2] and rewards[-1] == 1.0
    # Before success: (reaching in [0, 1] + 0.25 when grasping) / 2.25, rising as it reaches.
    assert (rewards[:-1] > 0).all() and (rewards[:-1] <= 1.25 / 2.25).all()
    assert rewards[-2] > rewards[0]


def test_success_entry_is_the_tasks_own_check():
    env = RobosuiteGymEnv("Lift", max_episode_steps=40, terminate_on_success=False)
    expert = LiftExpert()
    observation, _ = env.reset(seed=3)
    flags = []
    for _ in range(40):
        observation, _, _, _, info = env.step(expert.act(observation))
        assert info["success"] == bool(env.robosuite_env._check_success())
        assert info["success"] == (observation[LIFT["cube_pos"]][2] > LIFTED_HEIGHT)
        flags.append(info["success"])
    assert not flags[0] and flags[-1]


def test_same_seed_same_initial_state_bit_for_bit(lift_env):
    first, _ = lift_env.reset(seed=5)
    actions = np.random.default_rng(0).uniform(-1, 1, size=(5, 7))
    trajectory = [lift_env.step(action)[0] for action in actions]
    # Another instance, whose robosuite generators have moved on, reset with the same seed.
    other = RobosuiteGymEnv("Lift")
    run_expert(other, seed=11, steps=10)
    other.reset()
    again, _ = other.reset(seed=5)
    np.testing.assert_array_equal(again, first)
    np.testing.assert_array_equal(np.stack([other.step(a)[0] for a in actions]), trajectory)
    # Different seeds: different cube positions (and robot noise); reseeding repeats.
    positions = [lift_env.reset(seed=seed)[0][LIFT["cube_pos"]][:2] for seed in (5, 6, 7, 5)]
    assert (
        np.abs(positions[0] - positions[1]).min() > 0
        and np.abs(positions[1] - positions[2]).min() > 0
    )
    np.testing.assert_array_equal(positions[3], positions[0])


def test_batched_env_seeds_and_pickles():
    env = make_robosuite_env(2, max_episode_steps=6)
    env.set_seed(3)
    first = env.reset()["observation"]
    env.rollout(3, break_when_any_done=False)
    env.set_seed(3)
    torch.testing.assert_close(env.reset()["observation"], first, rtol=0, atol=0)
    assert not torch.equal(first[0], first[1])
    # The factory that BatchedGymEnv calls pickles (multi-process collectors need it).
    factory = pickle.loads(pickle.dumps(functools.partial(RobosuiteGymEnv, "Lift")))
    assert factory().observation_space.shape == (60,)


def test_specs_single_batched_and_chunked():
    for num_envs, chunk in ((None, None), (2, None), (2, 4)):
        env = make_robosuite_env(num_envs, chunk, max_episode_steps=10)
        check_env_specs(env)
        batch = () if num_envs is None else (num_envs,)
        assert env.observation_spec["observation"].shape == (*batch, 60)
        assert env.observation_spec["success"].shape == (*batch, 1)
        assert env.observation_spec["success"].dtype == torch.bool
        assert env.action_spec.shape == ((*batch, 7) if chunk is None else (*batch, chunk, 7))


def test_batched_info_keys_are_read_from_info():
    env = BatchedGymEnv(functools.partial(RobosuiteGymEnv, "Lift"), 1, info_keys=("success",))
    env.set_seed(2)
    policy = RobosuiteExpertPolicy(env, LiftExpert())
    rollout = env.rollout(DEFAULT_MAX_EPISODE_STEPS, policy)
    success = rollout["next", "success"].squeeze(-1)
    lifted = rollout["next", "observation"][..., LIFT["cube_pos"]][..., 2] > LIFTED_HEIGHT
    assert torch.equal(success, lifted) and success[0, -1]
    assert torch.equal(rollout["next", "terminated"].squeeze(-1), success)
    assert not rollout["success"].any()  # at the reset and before the last step
    with pytest.raises(ValueError, match="make_kwargs"):
        BatchedGymEnv(functools.partial(RobosuiteGymEnv, "Lift"), 1, max_episode_steps=3)
    with pytest.raises(TypeError, match="sequence"):
        BatchedGymEnv("Pusher-v5", 1, info_keys="success")


# ----------------------------------------------------------------------------- expert and demos
def test_expert_lifts_the_cube_clean(lift_env):
    lengths = []
    for seed in (100, 101, 102):
        transitions = run_expert(lift_env, seed=seed, steps=DEFAULT_MAX_EPISODE_STEPS)
        assert transitions[-1][4]["success"], f"seed {seed}"
        lengths.append(len(transitions))
    assert max(lengths) <= 35  # measured: 24 steps on average, at most 29


def test_expert_is_batched_and_stateless():
    env = RobosuiteGymEnv("Lift")
    observations = np.stack([env.reset(seed=seed)[0] for seed in range(3)])
    batched = LiftExpert().clean_action(observations.reshape(3, 1, 60))
    assert batched.shape == (3, 1, 7)
    for index in range(3):
        np.testing.assert_allclose(
            batched[index, 0], LiftExpert().clean_action(observations[index])
        )
    noisy = LiftExpert(action_noise=0.5, seed=0)
    action = noisy.act(observations)
    assert np.abs(action).max() <= 1 and not np.allclose(action, noisy.last_clean_action)
    with pytest.raises(ValueError, match="60 features"):
        LiftExpert().clean_action(np.zeros((2, 23)))
    with pytest.raises(ValueError, match="action_noise"):
        LiftExpert(action_noise=-0.1)


def test_demo_collection_layout():
    demos = collect_robosuite_demos(3, action_noise=0.3, seed=2, max_episode_steps=50)
    lengths = demos["episode_length"]
    total = int(lengths.sum())
    assert demos["observation"].shape == (total, 60) and demos["observation"].dtype == torch.float32
    for key in ("action", "expert_action"):
        assert demos[key].shape == (total, 7) and demos[key].dtype == torch.float32
    assert demos["action"].abs().max() <= 1 and not torch.equal(
        demos["action"], demos["expert_action"]
    )
    assert demos["reward"].shape == demos["episode"].shape == demos["step"].shape == (total,)
    assert torch.equal(demos["episode"], torch.arange(3).repeat_interleave(lengths))
    assert torch.equal(demos["step"], torch.cat([torch.arange(int(n)) for n in lengths]))
    assert demos["episode_seed"].tolist() == [2 * 1_000_003 + i for i in range(3)]
    assert demos["success"].dtype == torch.bool and demos["success"].all()
    assert lengths.max() < 50  # success ended every episode before the time limit
    # reward="success": each episode's return is its success.
    returns = torch.zeros(3).index_add_(0, demos["episode"], demos["reward"])
    assert torch.equal(returns, demos["success"].float())
    assert demos["config"]["action_noise"] == 0.3 and demos["config"]["wall_time_s"] > 0
    # The first observation of an episode is its seeded reset.
    env = RobosuiteGymEnv("Lift")
    first = env.reset(seed=2 * 1_000_003 + 1)[0]
    start = int(lengths[0])
    np.testing.assert_array_equal(demos["observation"][start].numpy(), first)


def test_expert_policy_in_batched_env():
    env = make_robosuite_env(2)
    env.set_seed(0)
    policy = RobosuiteExpertPolicy(env, LiftExpert())
    rollout = env.rollout(40, policy, break_when_any_done=False)
    assert rollout["action"].shape == (2, 40, 7)
    # Each sub-environment succeeds within 40 steps; the rollout resets it and it goes on.
    success = rollout["next", "success"].squeeze(-1)
    assert success.any(-1).all()
    assert torch.equal(rollout["next", "terminated"].squeeze(-1), success)


# ----------------------------------------------------------------------------- PickPlaceCan
@pytest.fixture(scope="module")
def can_env() -> RobosuiteGymEnv:
    return RobosuiteGymEnv("PickPlaceCan")


def test_can_default_horizon_is_the_tasks(can_env):
    assert can_env.max_episode_steps == CAN_MAX_EPISODE_STEPS == 250
    assert RobosuiteGymEnv("Lift").max_episode_steps == DEFAULT_MAX_EPISODE_STEPS == 60
    assert get_task("can").max_episode_steps == CAN_MAX_EPISODE_STEPS
    assert get_task("lift").max_episode_steps == DEFAULT_MAX_EPISODE_STEPS


@pytest.mark.parametrize(("task", "horizon"), [("can", 250), ("lift", 60)])
def test_evaluate_expert_defaults_to_the_tasks_horizon(task, horizon):
    # Without terminate_on_success an episode lasts the horizon (Pusher's is 150).
    outcomes = evaluate_expert(1, seed=20_000, task=task, terminate_on_success=False)
    assert outcomes["length"].tolist() == [horizon] and outcomes["success"].all()


def test_can_expert_places_the_can_clean(can_env):
    expert = CanExpert.from_env(can_env)
    x_low, x_high, y_low, y_high = CAN_COMPARTMENT
    lengths = []
    for seed in (100, 101, 102):
        transitions = run_expert(can_env, seed=seed, steps=CAN_MAX_EPISODE_STEPS, expert=expert)
        observation, reward, terminated, truncated, info = transitions[-1]
        assert terminated and info["success"] and reward == 1.0, f"seed {seed}"
        assert can_env.check_success()  # robosuite's own test, on the final state
        can = observation[CAN["can_pos"]]
        assert x_low < can[0] < x_high and y_low < can[1] < y_high and can[2] < 0.9
        assert np.linalg.norm(observation[CAN["eef_pos"]] - can) > 0.042  # let go
        lengths.append(len(transitions))
    assert max(lengths) <= 140  # measured: 96 steps on average, at most 120


def test_can_expert_reads_its_target_from_the_env(can_env):
    expert = CanExpert.from_env(can_env)
    default = CanExpert()
    np.testing.assert_allclose(expert.compartment, CAN_COMPARTMENT, atol=1e-12)
    np.testing.assert_allclose(expert.compartment, default.compartment, atol=1e-12)
    assert expert.bin_height == default.bin_height == 0.8
    np.testing.assert_allclose(expert.drop_point, [0.16, 0.35])
    robosuite_env = can_env.robosuite_env
    np.testing.assert_allclose(
        np.mean(np.reshape(expert.compartment, (2, 2)), axis=1),
        robosuite_env.target_bin_placements[robosuite_env.object_id][:2],
    )
    with pytest.raises(ValueError, match="drop_point"):
        CanExpert(drop_point=(0.0, 0.0))


def test_can_expert_is_batched_and_stateless(can_env):
    observations = np.stack([can_env.reset(seed=seed)[0] for seed in range(3)])
    batched = CanExpert().clean_action(observations.reshape(3, 1, 64))
    assert batched.shape == (3, 1, 7)
    for index in range(3):
        np.testing.assert_allclose(batched[index, 0], CanExpert().clean_action(observations[index]))
    noisy = CanExpert(action_noise=0.5, seed=0)
    action = noisy.act(observations)
    assert np.abs(action).max() <= 1 and not np.allclose(action, noisy.last_clean_action)
    with pytest.raises(ValueError, match="64 features"):
        CanExpert().clean_action(np.zeros((2, 60)))
    with pytest.raises(ValueError, match="action_noise"):
        CanExpert(action_noise=-0.1)


def test_can_task_builds_a_batched_chunked_env():
    task = get_task("can")
    assert task.observation_dim == max(s.stop for s in CAN.values()) == 64
    assert task.action_dim == 7 and task.max_eval_envs == 25
    env = task.make_env(2, 4, **task.defaults)
    assert env.observation_spec["observation"].shape == (2, task.observation_dim)
    assert env.action_spec.shape == (2, 4, task.action_dim)
    rollout = env.rollout(2)
    assert rollout["next", "observation"].shape == (2, 2, task.observation_dim)
    assert rollout["action"].shape == (2, 2, 4, 7)


def test_can_expert_policy_in_batched_env():
    task = get_task("can")
    env = task.make_env(2, None, **task.defaults)
    env.set_seed(0)
    rollout = env.rollout(140, task.make_expert(env), break_when_any_done=False)
    success = rollout["next", "success"].squeeze(-1)
    assert success.any(-1).all()  # each sub-environment places its can within 140 steps
    assert torch.equal(rollout["next", "terminated"].squeeze(-1), success)


def test_can_demo_collection_layout():
    demos = get_task("can").collect_demos(2, 0.3, 1, **get_task("can").defaults)
    lengths = demos["episode_length"]
    total = int(lengths.sum())
    assert demos["observation"].shape == (total, 64) and demos["observation"].dtype == torch.float32
    for key in ("action", "expert_action"):
        assert demos[key].shape == (total, 7) and demos[key].dtype == torch.float32
    assert not torch.equal(demos["action"], demos["expert_action"])
    assert demos["reward"].shape == demos["episode"].shape == demos["step"].shape == (total,)
    assert torch.equal(demos["episode"], torch.arange(2).repeat_interleave(lengths))
    assert demos["episode_seed"].tolist() == [1_000_003, 1_000_004]
    assert demos["success"].all() and lengths.max() < CAN_MAX_EPISODE_STEPS
    returns = torch.zeros(2).index_add_(0, demos["episode"], demos["reward"])
    assert torch.equal(returns, demos["success"].float())
    assert demos["config"]["task"] == "PickPlaceCan"
    assert demos["config"]["max_episode_steps"] == CAN_MAX_EPISODE_STEPS


# ----------------------------------------------------------------------------- NutAssemblySquare
@pytest.fixture(scope="module")
def square_env() -> RobosuiteGymEnv:
    return RobosuiteGymEnv("NutAssemblySquare")


def test_square_layout_matches_robosuite(square_env):
    assert square_env.max_episode_steps == SQUARE_MAX_EPISODE_STEPS
    observation, _ = square_env.reset(seed=0)
    assert observation.shape == (64,) and observation.dtype == np.float32
    assert not observation[SQUARE["nut_to_eef_pos"]].any()  # robosuite's reset quirk
    observation = square_env.step(np.zeros(7))[0]
    raw = square_env.robosuite_env._get_observations()
    for name, key in (
        ("nut_pos", "SquareNut_pos"),
        ("nut_quat", "SquareNut_quat"),
        ("nut_to_eef_pos", "SquareNut_to_robot0_eef_pos"),
    ):
        np.testing.assert_array_equal(observation[SQUARE[name]], raw[key].astype(np.float32))
    np.testing.assert_array_equal(
        observation[SQUARE["eef_pos"]], raw["robot0_eef_pos"].astype(np.float32)
    )


def test_square_same_seed_same_initial_state_bit_for_bit(square_env):
    # Both placement samplers (square and round nut) draw from the installed generator.
    first, _ = square_env.reset(seed=7)
    robosuite_env = square_env.robosuite_env
    samplers = robosuite_env.placement_initializer.samplers.values()
    assert all(sampler.rng is robosuite_env.rng for sampler in samplers)
    actions = np.random.default_rng(0).uniform(-1, 1, size=(5, 7))
    trajectory = [square_env.step(action)[0] for action in actions]
    other = RobosuiteGymEnv("NutAssemblySquare")
    other.reset(seed=3)
    other.step(np.ones(7))
    again, _ = other.reset(seed=7)
    np.testing.assert_array_equal(again, first)
    np.testing.assert_array_equal(np.stack([other.step(a)[0] for a in actions]), trajectory)
    # Different seeds: different nut placements; reseeding repeats.
    poses = [square_env.reset(seed=seed)[0][SQUARE["nut_pos"]][:2] for seed in (7, 8, 7)]
    assert np.abs(poses[0] - poses[1]).max() > 1e-3
    np.testing.assert_array_equal(poses[2], poses[0])


def test_square_peg_default_is_the_simulators(square_env):
    expert = SquareExpert.from_env(square_env)
    robosuite_env = square_env.robosuite_env
    peg = robosuite_env.sim.data.body_xpos[robosuite_env.peg1_body_id]
    np.testing.assert_allclose(expert.peg_position, peg, atol=1e-12)
    np.testing.assert_allclose(SquareExpert().peg_position, SQUARE_PEG_POSITION, atol=0)
    np.testing.assert_allclose(peg, SQUARE_PEG_POSITION, atol=1e-12)
    assert expert.table_height == SquareExpert().table_height == SQUARE_TABLE_HEIGHT
    # robosuite's success tests the nut against this peg.
    assert robosuite_env.on_peg(np.array([*SQUARE_PEG_POSITION[:2], 0.84]), 0)
    assert not robosuite_env.on_peg(np.array([*SQUARE_PEG_POSITION[:2], 0.84]), 1)


def test_square_expert_puts_the_nut_on_the_peg_clean(square_env):
    # Reset seeds 100-102: outside the seeds 0-99 that the expert was tuned on.
    expert = SquareExpert.from_env(square_env)
    lengths = []
    for seed in (100, 101, 102):
        transitions = run_expert(square_env, seed, SQUARE_MAX_EPISODE_STEPS, expert=expert)
        observation, reward, terminated, truncated, info = transitions[-1]
        assert terminated and info["success"] and reward == 1.0, f"seed {seed}"
        assert square_env.check_success()
        nut = observation[SQUARE["nut_pos"]]
        assert np.abs(nut[:2] - np.array(SQUARE_PEG_POSITION[:2])).max() < 0.03
        assert nut[2] < SQUARE_TABLE_HEIGHT + 0.05  # down the peg
        lengths.append(len(transitions))
    assert max(lengths) <= 180  # measured on seeds 1000-1099: see square_expert


def test_square_expert_is_batched_and_stateless(square_env):
    observations = np.stack([square_env.reset(seed=seed)[0] for seed in range(3)])
    batched = SquareExpert().clean_action(observations.reshape(3, 1, 64))
    assert batched.shape == (3, 1, 7)
    for index in range(3):
        np.testing.assert_allclose(
            batched[index, 0], SquareExpert().clean_action(observations[index])
        )
    assert np.abs(batched).max() <= 1
    with pytest.raises(ValueError, match="64 features"):
        SquareExpert().clean_action(np.zeros((2, 60)))
    with pytest.raises(ValueError, match="positive"):
        SquareExpert(place_tolerance=0.0)


def test_square_task_builds_a_batched_chunked_env():
    task = get_task("square")
    assert task.observation_dim == max(s.stop for s in SQUARE.values()) == 64
    assert task.max_episode_steps == SQUARE_MAX_EPISODE_STEPS and task.max_eval_envs == 25
    env = task.make_env(2, 4, **task.defaults)
    assert env.observation_spec["observation"].shape == (2, 64)
    assert env.action_spec.shape == (2, 4, 7)
    assert env.rollout(2)["next", "observation"].shape == (2, 2, 64)
    policy_env = task.make_env(2, None, **task.defaults)
    policy = task.make_expert(policy_env)
    assert isinstance(policy.expert, SquareExpert)
    np.testing.assert_allclose(policy.expert.peg_position, SQUARE_PEG_POSITION)


# ----------------------------------------------------------------------------- errors
def test_clear_errors():
    with pytest.raises(ValueError, match="unknown robosuite task"):
        RobosuiteGymEnv("Stack")
    with pytest.raises(ValueError, match="unknown robosuite task"):
        make_robosuite_env(2, task="lift")
    with pytest.raises(ValueError, match="reward"):
        RobosuiteGymEnv("Lift", reward="dense")
    with pytest.raises(ValueError, match="reward"):
        make_robosuite_env(2, reward="sparse")
    with pytest.raises(ValueError, match="max_episode_steps"):
        RobosuiteGymEnv("Lift", horizon=100)
    with pytest.raises(ValueError, match="render_mode"):
        RobosuiteGymEnv("Lift", render_mode="human")
    with pytest.raises(ValueError, match="no scripted expert"):
        collect_robosuite_demos(1, 0.0, task="Stack")
    chunked = make_robosuite_env(2, executed_chunk_length=4, max_episode_steps=8)
    with pytest.raises(ValueError, match="chunked"):
        RobosuiteExpertPolicy(chunked, LiftExpert())
    env = RobosuiteGymEnv("Lift")
    env.reset(seed=0)
    with pytest.raises(ValueError, match="shape"):
        env.step(np.zeros(6))
    with pytest.raises(ValueError, match="finite"):
        env.step(np.full(7, np.nan))
    with pytest.raises(RuntimeError, match="render_mode"):
        env.render()


# ----------------------------------------------------------------------------- rendering
def test_rendering_is_upright_rgb():
    try:
        env = RobosuiteGymEnv(
            "Lift",
            render_mode="rgb_array",
            camera_name="frontview",
            render_height=96,
            render_width=128,
        )
        env.reset(seed=0)
        frame = env.render()
    except Exception as error:  # no EGL / OpenGL on this machine
        pytest.skip(f"offscreen rendering unavailable: {error!r}")
    from robosuite.utils.camera_utils import (
        get_camera_transform_matrix,
        project_points_from_world_to_camera,
    )

    assert frame.shape == (96, 128, 3) and frame.dtype == np.uint8
    assert frame.std() > 10
    # The red cube is where the camera model projects it in an upright image, and not at
    # the mirrored row (a vertically flipped frame would fail here).
    sim = env.robosuite_env.sim
    transform = get_camera_transform_matrix(sim, "frontview", 96, 128)
    cube = env.robosuite_env.sim.data.body_xpos[env.robosuite_env.cube_body_id]
    row, column = project_points_from_world_to_camera(cube, transform, 96, 128)

    def is_red(pixel: np.ndarray) -> bool:
        red, green, blue = pixel.astype(int)
        return red > 80 and red > 2 * green and red > 2 * blue

    assert is_red(frame[row, column])
    assert not is_red(frame[96 - 1 - row, column])
    # Rendering keeps working after resets (no hard reset).
    env.reset(seed=1)
    assert env.render().std() > 10


# ----------------------------------------------------------------------------- logging
def robosuite_records(caplog) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == "robosuite_logs"]


def test_robosuite_logging_is_quiet_unless_asked_for(caplog, monkeypatch):
    monkeypatch.delenv(LOG_LEVEL_VARIABLE, raising=False)
    with caplog.at_level(logging.DEBUG):
        RobosuiteGymEnv("Lift").close()
    assert robosuite_records(caplog) == []
    monkeypatch.setenv(LOG_LEVEL_VARIABLE, "INFO")
    with caplog.at_level(logging.DEBUG):
        RobosuiteGymEnv("Lift").close()
    messages = [record.getMessage() for record in robosuite_records(caplog)]
    assert any("Loading controller configuration" in message for message in messages)
    monkeypatch.setenv(LOG_LEVEL_VARIABLE, "loud")
    with pytest.raises(ValueError, match=f"{LOG_LEVEL_VARIABLE}='loud' is not a logging level"):
        RobosuiteGymEnv("Lift")


def test_a_fresh_process_building_lift_envs_prints_nothing_of_robosuites():
    # robosuite's import warnings and its per-simulator line, in a process of its own.
    code = (
        "from torchrl_flowpolicy.tasks.robosuite.env import make_robosuite_env\n"
        "make_robosuite_env(2).close()\n"
        "print('built')\n"
    )
    environment = {key: value for key, value in os.environ.items() if key != LOG_LEVEL_VARIABLE}
    root = str(Path(__file__).resolve().parents[1])
    environment["PYTHONPATH"] = os.pathsep.join([root, environment.get("PYTHONPATH", "")])

    def run(**extra: str) -> str:
        result = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={**environment, **extra},
            timeout=300,
        )
        assert result.returncode == 0 and result.stdout.endswith("built\n"), result.stderr
        return result.stdout + result.stderr

    assert "robosuite" not in run()
    loud = run(**{LOG_LEVEL_VARIABLE: "INFO"})
    assert loud.count("Loading controller configuration") == 2  # one per simulator
    assert "[robosuite WARNING]" in loud  # and its import's warnings
