"""The Gaussian baseline: TorchRL's stock actor and loss, its behaviour cloning, and the
``examples/gaussian_ppo.py`` chain."""

from __future__ import annotations

import json

import pytest
import torch
from examples_loader import load_example
from tensordict import TensorDict
from torchrl.data import Bounded
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import ProbabilisticActor, TanhNormal, ValueOperator
from torchrl.objectives import ClipPPOLoss

from torchrl_flowpolicy.training.gaussian_baseline import (
    behaviour_clone,
    clamp_inside,
    demonstration_log_likelihood,
    make_gaussian_actor,
    make_value_network,
)

SPEC = Bounded(-2.0, 2.0, shape=(1, 3))


def toy_demonstrations(num_steps: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Observations [N, 4] and actions [N, 1, 3] = 1.5 tanh(W obs): a smooth target inside
    the bounds."""
    generator = torch.Generator().manual_seed(7)
    observations = torch.randn(num_steps, 4, generator=generator)
    weights = torch.randn(4, 3, generator=generator) / 2
    return observations, (1.5 * torch.tanh(observations @ weights)).unsqueeze(1)


def deterministic_actions(actor: ProbabilisticActor, observations: torch.Tensor) -> torch.Tensor:
    tensordict = TensorDict({"observation": observations}, batch_size=[observations.shape[0]])
    with torch.no_grad(), set_exploration_type(ExplorationType.DETERMINISTIC):
        return actor(tensordict)["action"]


def test_the_actor_is_a_stock_probabilistic_actor_with_a_tanh_normal():
    torch.manual_seed(0)
    actor = make_gaussian_actor(4, SPEC)
    assert isinstance(actor, ProbabilisticActor)
    distribution = actor.get_dist(TensorDict({"observation": torch.randn(5, 4)}, [5]))
    assert isinstance(distribution, TanhNormal)
    sample = actor(TensorDict({"observation": torch.randn(5, 4)}, [5]))
    assert sample["action"].shape == (5, 1, 3)
    assert bool((sample["action"].abs() <= 2).all())
    assert sample["action_log_prob"].shape == (5,)  # summed over the [1, 3] action
    assert isinstance(make_value_network(4), ValueOperator)


def test_the_loss_is_torchrl_clip_ppo_loss():
    gaussian_ppo = load_example("gaussian_ppo")
    torch.manual_seed(0)
    actor, critic = make_gaussian_actor(4, SPEC), make_value_network(4)
    loss_module = ClipPPOLoss(actor, critic, loss_critic_type="l2", entropy_bonus=False)
    assert type(loss_module) is ClipPPOLoss
    # The example builds exactly this class: no subclass of ours in between.
    assert gaussian_ppo.ClipPPOLoss is ClipPPOLoss


def test_clamp_inside_moves_only_actions_on_the_bounds():
    low, high = torch.tensor(-2.0), torch.tensor(2.0)
    actions = torch.tensor([-2.0, -1.0, 0.0, 2.0])
    inside = clamp_inside(actions, low, high, 0.01)
    torch.testing.assert_close(inside, torch.tensor([-1.98, -1.0, 0.0, 1.98]))
    with pytest.raises(ValueError, match="epsilon"):
        clamp_inside(actions, low, high, 0.0)


def test_behaviour_cloning_raises_the_likelihood_and_approaches_the_demo_actions():
    observations, actions = toy_demonstrations()
    torch.manual_seed(0)
    actor = make_gaussian_actor(4, SPEC)
    with torch.no_grad():
        before = demonstration_log_likelihood(actor, observations, actions).item()
        error_before = (deterministic_actions(actor, observations) - actions).abs().mean().item()
    generator = torch.Generator().manual_seed(0)
    losses = behaviour_clone(
        actor,
        observations,
        actions,
        steps=600,
        batch_size=64,
        learning_rate=3e-3,
        generator=generator,
    )
    with torch.no_grad():
        after = demonstration_log_likelihood(actor, observations, actions).item()
        error_after = (deterministic_actions(actor, observations) - actions).abs().mean().item()
    assert after > before + 3, (before, after)
    assert losses[-1] < losses[0]
    assert error_after < 0.1 < error_before, (error_before, error_after)


def test_behaviour_cloning_is_seeded():
    observations, actions = toy_demonstrations(64)

    def cloned(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        actor = make_gaussian_actor(4, SPEC)
        generator = torch.Generator().manual_seed(seed)
        behaviour_clone(actor, observations, actions, steps=20, batch_size=16, generator=generator)
        return actor.state_dict()

    first, again, other = cloned(0), cloned(0), cloned(1)
    for name in first:
        torch.testing.assert_close(first[name], again[name], rtol=0, atol=0)
    assert any(not torch.equal(first[name], other[name]) for name in first)


def test_the_likelihood_refuses_a_wrong_action_shape():
    actor = make_gaussian_actor(4, SPEC)
    with pytest.raises(ValueError, match="action shape"):
        demonstration_log_likelihood(actor, torch.randn(3, 4), torch.zeros(3, 3))


def test_quick_options_and_task_defaults():
    gaussian_ppo = load_example("gaussian_ppo")
    quick = gaussian_ppo.parse_args(["--quick"])
    assert quick.output_dir.startswith("outputs/quick") and quick.threads == 1
    assert quick.split == "held_out"  # the reported states unless asked otherwise
    assert gaussian_ppo.parse_args([]) == gaussian_ppo.GaussianPPOConfig()
    lift = gaussian_ppo.parse_args(["--task", "lift"])
    assert (lift.max_episode_steps, lift.demo_episodes, lift.reward_scale) == (60, 25, 1.0)
    assert lift.output_dir == "outputs/gaussian_ppo_lift"


@pytest.mark.slow
def test_quick_run_writes_the_protocol_on_the_states_asked_for(tmp_path):
    gaussian_ppo = load_example("gaussian_ppo")
    output_dir = tmp_path / "run"
    options = ["--output_dir", str(output_dir), "--demo_dir", str(tmp_path / "demos")]
    # --split validation: the protocol on the validation states (where settings are chosen);
    # two collector processes (TorchRL's MultiSyncCollector) step the training envs.
    argv = ["--quick", "--split", "validation", "--collector_workers", "2", *options]
    config = gaussian_ppo.parse_args(argv)
    gaussian_ppo.main(config)
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["config"]["collector_workers"] == 2
    held_out = summary["held_out"]
    assert (held_out["split"], held_out["seed"]) == ("validation", 20_000)
    assert held_out["num_episodes"] == config.held_out_episodes
    for policy in ("bc", "rl"):
        for decoding in ("sampled", "noise_free"):
            assert 0 <= held_out["success"][policy][decoding]["rate"] <= 1
            assert len(held_out["episode_success"][policy][decoding]) == config.held_out_episodes
        assert set(held_out["rl_minus_bc_best"]) == {"sampled", "noise_free"}
    assert len(held_out["episode_success"]["expert"]) == config.held_out_episodes
    assert summary["env_steps"] >= config.total_env_steps
    assert summary["history"][-1]["env_steps"] == summary["env_steps"]
    assert (
        summary["pretrained"]["log_likelihood_after"]
        > summary["pretrained"]["log_likelihood_before"]
    )
    assert (output_dir / "checkpoint.pt").is_file()


def test_collector_workers_must_divide_the_environments(tmp_path):
    gaussian_ppo = load_example("gaussian_ppo")
    config = gaussian_ppo.parse_args(
        ["--quick", "--collector_workers", "3", "--output_dir", str(tmp_path / "run")]
    )
    with pytest.raises(ValueError, match="--num_envs 4: must be a multiple of --collector_w"):
        gaussian_ppo.check_config(config)


def test_the_demonstrations_are_those_of_the_pretraining():
    gaussian_ppo, pretrain = load_example("gaussian_ppo"), load_example("pretrain")
    pretrain_defaults = pretrain.PretrainConfig()
    for task, defaults in pretrain.script_defaults("pretrain").items():
        config = gaussian_ppo.parse_args(["--task", task])
        for name in ("demo_dir", "demo_episodes", "demo_action_noise", "demo_seed"):
            expected = defaults.get(name, getattr(pretrain_defaults, name))
            assert getattr(config, name) == expected, (task, name)
    # The seed rule: --demo_seed -1 takes the run's seed, as pretrain.py does.
    config = gaussian_ppo.parse_args(["--seed", "3"])
    assert pretrain.demonstration_seed(config) == 3
    config = gaussian_ppo.parse_args(["--seed", "3", "--demo_seed", "5"])
    assert pretrain.demonstration_seed(config) == 5


@pytest.mark.slow
def test_a_stopped_run_resumed_gives_the_uninterrupted_runs_numbers(tmp_path):
    # The quick run takes 3 iterations of 600 env steps (checkpoints every 2); one run
    # stopped after 2 iterations and resumed to 3 must log and learn exactly the same.
    gaussian_ppo = load_example("gaussian_ppo")
    demos = ["--demo_dir", str(tmp_path / "demos"), "--held_out_episodes", "2"]
    whole, pieces = tmp_path / "whole", tmp_path / "pieces"
    gaussian_ppo.main(gaussian_ppo.parse_args(["--quick", "--output_dir", str(whole), *demos]))
    stopped = ["--quick", "--output_dir", str(pieces), *demos]
    gaussian_ppo.main(gaussian_ppo.parse_args([*stopped, "--total_env_steps", "1200"]))
    first = json.loads((pieces / "summary.json").read_text())
    assert first["env_steps"] == 1200
    gaussian_ppo.main(gaussian_ppo.parse_args([*stopped, "--resume"]))

    def numbers(folder):
        summary = json.loads((folder / "summary.json").read_text())
        timing = ("wall_seconds", "seconds")
        rows = [{k: v for k, v in row.items() if k not in timing} for row in summary["history"]]
        actor = torch.load(folder / "checkpoint.pt", weights_only=True)["actor"]
        return summary["env_steps"], rows, actor

    steps, rows, actor = numbers(whole)
    resumed_steps, resumed_rows, resumed_actor = numbers(pieces)
    assert (resumed_steps, resumed_rows) == (steps, rows) and steps == 1800
    assert actor.keys() == resumed_actor.keys()
    for name in actor:
        assert torch.equal(actor[name], resumed_actor[name]), name
    # Another run's checkpoint is refused, naming what differs.
    with pytest.raises(ValueError, match="seed: saved 0, this run 1"):
        gaussian_ppo.main(gaussian_ppo.parse_args([*stopped, "--resume", "--seed", "1"]))
