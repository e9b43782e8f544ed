"""The run lifecycle in the package: policy checkpoints with their sampler settings and task,
run progress, collector options and seeds, and an import of the core that pulls in no
simulator or logger."""

from __future__ import annotations

import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from torchrl_flowpolicy import SamplerOptions, load_policy
from torchrl_flowpolicy.networks import ObservationNormalizer
from torchrl_flowpolicy.training.checkpoint import load_checkpoint, save_checkpoint
from torchrl_flowpolicy.training.collectors import CollectorOptions, first_reset_seed
from torchrl_flowpolicy.training.models import (
    ModelConfig,
    build_policy,
    load_policy_checkpoint,
    save_policy,
)
from torchrl_flowpolicy.training.protocol import training_seed
from torchrl_flowpolicy.training.runs import RunProgress, learning_rate_factor

ROOT = Path(__file__).resolve().parents[1]
SAMPLER = SamplerOptions(
    num_denoising_steps=4,
    eval_num_denoising_steps=6,
    noise_level=0.3,
    sde_mode="last",
    num_sde_steps=2,
    rollout_noise_scale=0.5,
    eval_noise_scale=0.5,
)


def tiny_policy(sampler: SamplerOptions | None = None, observation_dim: int = 23):
    torch.manual_seed(0)
    config = ModelConfig(model_dim=16, num_heads=2, num_layers=1, observation_dim=observation_dim)
    normalizer = ObservationNormalizer(
        torch.randn(observation_dim), torch.rand(observation_dim) + 1
    )
    return build_policy(config, normalizer, sampler), config


def sampler_of(policy) -> tuple:
    options = policy.options
    return (
        options.num_denoising_steps,
        options.eval_num_denoising_steps,
        options.noise_level,
        options.sde_mode,
        options.num_sde_steps,
        options.rollout_noise_scale,
        options.eval_noise_scale,
    )


def test_a_saved_policy_comes_back_with_its_sampler_settings_weights_and_task(tmp_path):
    policy, config = tiny_policy(SAMPLER)
    save_policy(tmp_path / "policy.pt", policy, config, task="pusher", summary="{}")
    state = load_checkpoint(tmp_path / "policy.pt")
    assert state["sampler"] == SAMPLER.to_dict() and state["task"] == "pusher"
    assert state["observation"] == {"key": "observation", "dim": 23}
    assert state["noise"] == {"kind": "fixed"} and state["summary"] == "{}"

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a checkpoint with its settings: no warning
        loaded = load_policy(tmp_path / "policy.pt")
    assert sampler_of(loaded) == (4, 6, 0.3, "last", 2, 0.5, 0.5)
    for name, value in policy.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    # Other settings on request; the saved ones are reported beside the policy.
    other = SamplerOptions(num_denoising_steps=2)
    saved = load_policy_checkpoint(tmp_path / "policy.pt", sampler=other)
    assert saved.policy.num_denoising_steps == 2 and saved.sampler == other
    assert saved.model_config == config


def test_a_checkpoint_saved_before_the_sampler_settings_loads_with_the_defaults_and_says_so(
    tmp_path,
):
    policy, config = tiny_policy(SAMPLER)
    save_policy(tmp_path / "policy.pt", policy, config)
    state = load_checkpoint(tmp_path / "policy.pt")
    for name in ("sampler", "noise", "observation"):
        del state[name]
    save_checkpoint(state, tmp_path / "old.pt")
    with pytest.warns(
        UserWarning, match="holds no sampler settings.*SamplerOptions\\(\\) defaults"
    ):
        loaded = load_policy(tmp_path / "old.pt")
    assert sampler_of(loaded) == sampler_of(tiny_policy()[0])  # FlowSDEPolicy's defaults
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # chosen settings: nothing to warn about
        assert load_policy(tmp_path / "old.pt", sampler=SAMPLER).num_denoising_steps == 4


def test_a_checkpoint_of_another_task_is_refused_naming_both_tasks(tmp_path):
    policy, config = tiny_policy()
    save_policy(tmp_path / "pusher.pt", policy, config, task="pusher")
    with pytest.raises(
        ValueError, match="holds a policy of task 'pusher' .*not of this run's task 'lift'"
    ):
        load_policy(tmp_path / "pusher.pt", task="lift")
    assert load_policy(tmp_path / "pusher.pt", task="pusher").num_denoising_steps == 8
    # Saved before tasks were recorded: told apart by the observation size.
    save_policy(tmp_path / "untagged.pt", policy, config)
    with pytest.raises(
        ValueError,
        match=r"records no task; its 23 observation features are those of task 'pusher'.*'lift'",
    ):
        load_policy(tmp_path / "untagged.pt", task="lift")
    load_policy(tmp_path / "untagged.pt", task="pusher")


def test_run_progress_round_trips_through_a_checkpoint_and_keeps_the_clock():
    run = RunProgress(iteration=3, env_steps=1800, start=time.perf_counter() - 100.0)
    row = run.record({"success_rate": 0.25})
    assert (row["env_steps"], row["iteration"], row["success_rate"]) == (1800, 3, 0.25)
    resumed = RunProgress.from_state(run.state())
    assert (resumed.iteration, resumed.env_steps, resumed.history) == (3, 1800, run.history)
    assert 100.0 <= resumed.wall_seconds() < 110.0
    older = {**run.state(), "history": '[{"wall_seconds": 42.0}]'}
    del older["wall_seconds"]  # saved before the wall time was: that of the last row
    assert 42.0 <= RunProgress.from_state(older).wall_seconds() < 52.0


def test_the_learning_rate_factor_is_one_then_falls_linearly_to_zero_at_the_budget():
    total, decay = 1_088_640, 362_880  # Can's extension: 725,760 constant, then the decay
    assert learning_rate_factor(0, total, decay) == 1.0
    assert learning_rate_factor(725_760, total, decay) == 1.0
    assert learning_rate_factor(725_760 + decay // 4, total, decay) == pytest.approx(0.75)
    assert learning_rate_factor(total, total, decay) == 0.0
    assert learning_rate_factor(total + 6_048, total, decay) == 0.0  # a last batch past it
    assert all(learning_rate_factor(steps, total, 0) == 1.0 for steps in (0, total, 2 * total))
    with pytest.raises(ValueError, match="decay_env_steps must be >= 0, got -1"):
        learning_rate_factor(0, total, -1)


def test_batch_seeds_count_environments_groups_and_ranks():
    assert first_reset_seed(0, 1, 16) == training_seed(0, 1, 16) == 0
    assert first_reset_seed(3, 5, 16) == training_seed(3, 5, 16)
    assert first_reset_seed(0, 2, 8, group_size=4) == training_seed(0, 2, 2)
    assert first_reset_seed(0, 2, 8, rank=1, world_size=2) == training_seed(0, 2, 16) + 8
    assert first_reset_seed(0, 2, 8, group_size=4, rank=1, world_size=2) == (
        training_seed(0, 2, 4) + 2
    )


def test_collector_options_refuse_an_uneven_split():
    assert CollectorOptions(num_envs=6, workers=3).envs_per_worker == 2
    with pytest.raises(ValueError, match="num_envs=5 must be a positive multiple of workers=2"):
        CollectorOptions(num_envs=5, workers=2)
    with pytest.raises(ValueError, match="workers=0"):
        CollectorOptions(num_envs=4, workers=0)


def test_importing_the_core_loads_no_simulator_wrapper_or_logger():
    code = (
        "import sys, torchrl_flowpolicy\n"
        "from torchrl_flowpolicy import load_policy\n"
        "loaded = {name.split('.')[0] for name in sys.modules}\n"
        "print(sorted(loaded & {'gymnasium', 'robosuite', 'wandb', 'matplotlib'}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
