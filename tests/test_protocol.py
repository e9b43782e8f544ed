"""The evaluation protocol: seed ranges, paired decodings, the expert's states, the summary."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torchrl.envs.utils import ExplorationType, exploration_type

from torchrl_flowpolicy import FlowSDEPolicy
from torchrl_flowpolicy.networks import MLPVelocityNetwork
from torchrl_flowpolicy.sampler import SamplerOptions
from torchrl_flowpolicy.tasks import (
    PusherExpert,
    PusherExpertPolicy,
    collect_demos,
    is_success,
    make_pusher_env,
)
from torchrl_flowpolicy.training.evaluation import (
    DECODINGS,
    decoding,
    decoding_label,
    evaluate_decodings,
    evaluate_episodes,
)
from torchrl_flowpolicy.training.protocol import (
    CURVE_SEED,
    HELD_OUT_SEED,
    SPLIT_SEEDS,
    SPLIT_SIZE,
    VALIDATION_SEED,
    evaluate_expert,
    format_protocol,
    protocol_summary,
    split_seed,
    training_seed,
)
from torchrl_flowpolicy.training.statistics import paired_bootstrap_interval, wilson_interval

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- seed ranges
def test_splits_are_the_documented_disjoint_ranges():
    assert SPLIT_SEEDS == {"curve": 10_000, "validation": 20_000, "held_out": 30_000}
    assert (CURVE_SEED, VALIDATION_SEED, HELD_OUT_SEED) == (10_000, 20_000, 30_000)
    ranges = [range(seed, seed + SPLIT_SIZE) for seed in SPLIT_SEEDS.values()]
    for first, second in zip(ranges, ranges[1:], strict=False):
        assert first[-1] < second[0]
    assert split_seed("held_out", SPLIT_SIZE) == HELD_OUT_SEED
    with pytest.raises(ValueError, match="1 to 10000 episodes"):
        split_seed("curve", SPLIT_SIZE + 1)
    with pytest.raises(ValueError, match="unknown split"):
        split_seed("test", 10)


def test_training_and_demonstration_seeds_stay_outside_every_split():
    evaluation = range(CURVE_SEED, HELD_OUT_SEED + SPLIT_SIZE)
    for seed, iteration, num_envs in [(0, 1, 16), (9_984, 1, 16), (0, 2, 16), (5, 400, 64)]:
        first = training_seed(seed, iteration, num_envs)
        assert not set(range(first, first + num_envs)) & set(evaluation)
    assert training_seed(3, 1, 16) == 3  # a run's first batch: seed + i, as before
    # One block of num_envs seeds per (run seed, iteration): no two batches share a state.
    blocks = [
        range(training_seed(seed, iteration, 16), training_seed(seed, iteration, 16) + 16)
        for seed in (0, 1, 2, 9_984)
        for iteration in range(2, 40)
    ]
    assert len(set().union(*blocks)) == 16 * len(blocks)
    assert min(block[0] for block in blocks) >= HELD_OUT_SEED + SPLIT_SIZE
    with pytest.raises(ValueError, match="evaluation seed"):
        training_seed(9_990, 1, 16)
    with pytest.raises(ValueError, match="from 1"):
        training_seed(0, 0, 16)
    # Demonstrations reset episode i with demo_seed * 1_000_003 + i.
    for demo_seed, expected in [(0, [0, 1]), (1, [1_000_003, 1_000_004])]:
        demos = collect_demos(2, 0.0, demo_seed, max_episode_steps=1)
        assert demos["episode_seed"].tolist() == expected


def test_only_the_protocol_helper_uses_the_held_out_split():
    sources = {path.name: path.read_text() for path in (ROOT / "examples").glob("*.py")}
    sources["reports.py"] = (ROOT / "torchrl_flowpolicy" / "training" / "reports.py").read_text()
    uses = {
        name: len(re.findall(r"split_seed\(\s*\"held_out\"", text))
        for name, text in sources.items()
    }
    # reports.held_out_protocol: its split is "held_out" unless the caller asks for validation.
    protocol_split = re.findall(r"split_seed\(\s*split\b", sources["reports.py"])
    assert uses.pop("reports.py") + len(protocol_split) == 1 and not any(uses.values())
    assert not any("HELD_OUT_SEED" in text or "30_000" in text for text in sources.values())


# ----------------------------------------------------------------------------- decodings
def tiny_policy(seed: int = 0) -> FlowSDEPolicy:
    torch.manual_seed(seed)
    network = MLPVelocityNetwork(observation_dim=23, action_shape=(4, 7), hidden_dim=16)
    return FlowSDEPolicy(
        network,
        action_shape=(4, 7),
        executed_chunk_length=2,
        options=SamplerOptions(eval_num_denoising_steps=2),
    )


def test_both_decodings_are_seeded_restored_and_leave_the_random_stream_alone():
    policy = tiny_policy()
    policy.options = policy.options.replace(eval_noise_scale=0.5)
    env = make_pusher_env(3, executed_chunk_length=2, max_episode_steps=8)
    options = {"max_decisions": 4, "seed": VALIDATION_SEED}
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = evaluate_decodings(policy, env, **options)
    assert torch.equal(torch.get_rng_state(), state)
    assert policy.options.eval_noise_scale == 0.5
    second = evaluate_decodings(policy, env, **options)
    for name in DECODINGS:
        for key in ("return", "success", "length"):
            assert torch.equal(first[name][key], second[name][key])
    # Each decoding is the ODE from x_0 = scale * N(0, I) with the evaluation's seed.
    for name, scale in (("sampled", 1.0), ("noise_free", 0.0)):
        policy.options = policy.options.replace(eval_noise_scale=scale)
        by_hand = evaluate_episodes(policy, env, **options)
        torch.testing.assert_close(by_hand["return"], first[name]["return"], rtol=0, atol=0)
    assert not torch.equal(first["sampled"]["return"], first["noise_free"]["return"])
    with pytest.raises(ValueError, match="unknown decoding"):
        with decoding(policy, "mean"):
            pass


class ExplorationRecorder(TensorDictModuleBase):
    """Zero chunks; records the exploration type of every call."""

    def __init__(self):
        super().__init__()
        self.in_keys, self.out_keys, self.calls = ["observation"], ["action"], []

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        self.calls.append(exploration_type())
        return tensordict.set("action", torch.zeros(*tensordict.batch_size, 2, 7))


def test_episodes_in_rounds_start_from_the_same_states_as_one_batch():
    # 5 episodes on 2 sub-environments run in 3 rounds (seeds s, s + 2, s + 4): the
    # noise-free decoding (no policy noise) then gives exactly the 5-env batch's outcomes.
    policy = tiny_policy()
    options = {"max_decisions": 4, "seed": VALIDATION_SEED}
    whole = make_pusher_env(5, executed_chunk_length=2, max_episode_steps=8)
    rounds = make_pusher_env(2, executed_chunk_length=2, max_episode_steps=8)
    with decoding(policy, "noise_free"):
        expected = evaluate_episodes(policy, whole, **options)
        outcomes = evaluate_episodes(policy, rounds, num_episodes=5, **options)
    for key in ("return", "success", "length"):
        assert outcomes[key].shape == (5,)
        torch.testing.assert_close(outcomes[key], expected[key], rtol=1e-5, atol=1e-5)
    expert = evaluate_expert(5, seed=VALIDATION_SEED, max_envs=2, max_episode_steps=8)
    torch.testing.assert_close(
        expert["return"], evaluate_expert(5, seed=VALIDATION_SEED, max_episode_steps=8)["return"]
    )
    with pytest.raises(ValueError, match="num_episodes"):
        evaluate_episodes(policy, rounds, num_episodes=0, **options)


def test_a_non_flow_policy_samples_under_random_and_takes_its_mean_under_deterministic():
    recorder = ExplorationRecorder()
    env = make_pusher_env(2, executed_chunk_length=2, max_episode_steps=4)
    evaluate_decodings(recorder, env, max_decisions=2, seed=CURVE_SEED)
    random, deterministic = ExplorationType.RANDOM, ExplorationType.DETERMINISTIC
    assert recorder.calls == [random, random, deterministic, deterministic]


# ----------------------------------------------------------------------------- the expert
def test_the_expert_starts_from_the_states_of_the_batched_chunked_env():
    seed, num_episodes = HELD_OUT_SEED + 7, 3
    chunked = make_pusher_env(num_episodes, executed_chunk_length=4)
    chunked.set_seed(seed)
    policy_start = chunked.reset()["observation"]
    stepwise = make_pusher_env(num_episodes)  # the expert's environment
    stepwise.set_seed(seed)
    expert_start = stepwise.reset()["observation"]
    raw = gym.make("Pusher-v5")
    by_hand = np.stack([raw.reset(seed=seed + index)[0] for index in range(num_episodes)])
    torch.testing.assert_close(policy_start, expert_start, rtol=0, atol=0)
    torch.testing.assert_close(policy_start, torch.from_numpy(by_hand).float(), rtol=0, atol=0)
    assert len({tuple(row.tolist()) for row in policy_start}) == num_episodes


def test_evaluate_expert_is_the_clean_expert_on_raw_gymnasium_episodes():
    seed, steps, threshold = VALIDATION_SEED + 3, 20, 0.25
    outcomes = evaluate_expert(
        3, seed=seed, max_episode_steps=steps, success_threshold=threshold, reward="gymnasium"
    )
    env = gym.make("Pusher-v5", max_episode_steps=steps)
    returns, successes = [], []
    for index in range(3):
        observation, _ = env.reset(seed=seed + index)
        expert, total = PusherExpert(env, action_noise=0.0), 0.0
        for _ in range(steps):
            observation, reward, *_ = env.step(expert.act())
            total += reward
        returns.append(total)
        successes.append(bool(is_success(observation, threshold)))
    torch.testing.assert_close(
        outcomes["return"].double(), torch.tensor(returns), rtol=1e-5, atol=1e-4
    )
    assert outcomes["success"].tolist() == successes
    assert outcomes["length"].tolist() == [steps] * 3


def test_the_expert_policy_refuses_environments_it_cannot_drive():
    with pytest.raises(ValueError, match="one step at a time"):
        PusherExpertPolicy(make_pusher_env(2, executed_chunk_length=4))
    with pytest.raises(TypeError, match="BatchedGymEnv"):
        PusherExpertPolicy(make_pusher_env())


# ----------------------------------------------------------------------------- summary
def outcomes(successes: list[int], returns: list[float] | None = None) -> dict[str, torch.Tensor]:
    success = torch.tensor(successes, dtype=torch.bool)
    ret = success.float() if returns is None else torch.tensor(returns)
    return {"success": success, "return": ret, "length": torch.full_like(ret, 8)}


N = 10
BC = {"sampled": outcomes([1] * 2 + [0] * 8), "noise_free": outcomes([1] * 6 + [0] * 4)}
RL = {"sampled": outcomes([1] * 8 + [0] * 2), "noise_free": outcomes([1] * 6 + [0] * 4)}
EXPERT = outcomes([1] * 9 + [0])


def test_summary_rates_intervals_and_best_decoding():
    summary = protocol_summary(BC, RL, EXPERT, reported_decoding="sampled")
    assert summary["num_episodes"] == N and summary["confidence"] == 0.95
    assert summary["bc_best_decoding"] == "noise_free"
    assert summary["reported_decoding"] == "sampled"
    success = summary["success"]
    assert success["bc"]["sampled"] == pytest.approx(
        dict(zip(("rate", "low", "high"), (0.2, *wilson_interval(2, N)), strict=True))
    )
    assert (success["rl"]["sampled"]["rate"], success["expert"]["rate"]) == (0.8, 0.9)
    # Wilson at 95 %, worked by hand for 6/10: center 0.7921 / 1.3841 = 0.5722,
    # half-width 1.9600 / 1.3841 * sqrt(0.024 + 0.0096) = 0.2596.
    assert success["bc"]["noise_free"]["low"] == pytest.approx(0.3127, abs=1e-4)
    assert success["bc"]["noise_free"]["high"] == pytest.approx(0.8318, abs=1e-4)
    assert summary["mean_return"]["bc"]["noise_free"] == pytest.approx(0.6)
    assert summary["episode_success"]["expert"] == [1] * 9 + [0]
    json.dumps(summary)  # JSON-able as it is


def test_summary_differences_are_paired_by_episode():
    summary = protocol_summary(BC, RL, EXPERT, reported_decoding="sampled")
    # RL noise-free succeeds on exactly BC best's episodes: the paired difference is 0 with
    # a zero-width interval, where two independent 6/10 intervals would overlap widely.
    assert summary["rl_minus_bc_best"]["noise_free"] == {"difference": 0.0, "low": 0.0, "high": 0.0}
    # RL sampled adds episodes 6 and 7 to BC best's: every difference is >= 0.
    sampled = summary["rl_minus_bc_best"]["sampled"]
    expected = paired_bootstrap_interval(RL["sampled"]["success"], BC["noise_free"]["success"])
    assert (sampled["difference"], sampled["low"], sampled["high"]) == pytest.approx(expected)
    assert sampled["difference"] == pytest.approx(0.2) and sampled["low"] >= 0.0
    # Against the expert: one episode lost (9), none gained.
    against_expert = summary["rl_minus_expert"]["sampled"]
    assert against_expert["difference"] == pytest.approx(-0.1) and against_expert["high"] <= 0.0
    # The same rate on other episodes is not a zero difference.
    shifted = {**RL, "noise_free": outcomes([0] * 4 + [1] * 6)}
    unpaired = protocol_summary(BC, shifted, EXPERT, reported_decoding="noise_free")
    interval = unpaired["rl_minus_bc_best"]["noise_free"]
    assert interval["difference"] == pytest.approx(0.0)
    assert interval["low"] < -0.2 and interval["high"] > 0.2
    line = format_protocol(summary, "PPO")
    assert line.startswith("PPO (sampled) 80.0% [") and "BC best (noise-free) 60.0%" in line
    assert "+20.0 points" in line and "expert 90.0%" in line and "-10.0 points" in line


def test_best_decoding_ties_go_to_the_higher_return_then_sampled():
    half = [1] * 5 + [0] * 5
    higher = {"sampled": outcomes(half), "noise_free": outcomes(half, [2.0] * N)}
    assert (
        protocol_summary(higher, higher, EXPERT, reported_decoding="sampled")["bc_best_decoding"]
        == "noise_free"
    )
    same = {"sampled": outcomes(half), "noise_free": outcomes(half)}
    assert (
        protocol_summary(same, same, EXPERT, reported_decoding="sampled")["bc_best_decoding"]
        == "sampled"
    )


def test_summary_rejects_unpaired_evaluations_and_unknown_decodings():
    with pytest.raises(ValueError, match="same episodes"):
        protocol_summary(BC, RL, outcomes([1] * 11), reported_decoding="sampled")
    with pytest.raises(ValueError, match="unknown decoding"):
        protocol_summary(BC, RL, EXPERT, reported_decoding="mean")


# ----------------------------------------------------------------------------- examples
def test_examples_protocol_helpers_leave_the_random_stream_alone(example):
    from torchrl_flowpolicy.training.reports import curve_baselines, held_out_protocol

    config = example("ppo").PPOConfig(
        max_episode_steps=8, eval_episodes=2, held_out_episodes=3, reported_decoding="noise_free"
    )
    bc, rl = tiny_policy(0), tiny_policy(1)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    env = make_pusher_env(2, executed_chunk_length=2, max_episode_steps=8)
    baselines = curve_baselines(bc, env, 4, config)
    held_out = held_out_protocol(bc, rl, config, 2, name="PPO")
    assert torch.equal(torch.get_rng_state(), state)
    assert list(baselines) == ["BC (sampled)", "BC (noise-free)", "expert"]
    assert all(row["num_episodes"] == 2 for row in baselines.values())
    assert (held_out["split"], held_out["seed"], held_out["num_episodes"]) == (
        "held_out",
        30_000,
        3,
    )
    assert held_out["reported_decoding"] == "noise_free"
    assert held_out["line"].startswith("PPO (noise-free)")
    # The same protocol on the validation states (to choose settings on), seeded there.
    validation = held_out_protocol(bc, rl, config, 2, name="PPO", split="validation")
    assert (validation["split"], validation["seed"]) == ("validation", 20_000)
    assert validation["episode_success"]["expert"] != held_out["episode_success"]["expert"] or (
        validation["mean_return"]["expert"] != held_out["mean_return"]["expert"]
    )


def test_decoding_label_names_the_curves_decoding():
    assert decoding_label(0.0) == "noise-free"
    assert decoding_label(0) == "noise-free"
    assert decoding_label(1.0) == "sampled"
    assert decoding_label(0.25) == "x_0 = 0.25 N(0, I)"
    with pytest.raises(ValueError, match="eval_noise_scale"):
        decoding_label(-1.0)
