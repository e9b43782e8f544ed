"""The examples refuse bad command-line values and foreign or broken checkpoints before any
work, with an error that names the option, the path or the fields that differ."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from examples_loader import load_example

from torchrl_flowpolicy.tasks import script_defaults
from torchrl_flowpolicy.training import reports
from torchrl_flowpolicy.training.models import ModelConfig, build_policy, save_policy
from torchrl_flowpolicy.training.runs import IMPLIED_IDENTITY, load_run, run_identity, save_run

ROOT = Path(__file__).resolve().parents[1]


class Stop(Exception):
    """Raised by a patched step: the run got past the checks under test."""


def stop(*args, **kwargs):
    raise Stop


def stop_at_the_evaluation_env(module, monkeypatch) -> None:
    """Stop a script's ``main`` at its first step after the checks: the evaluation env."""
    monkeypatch.setattr(reports, "make_eval_env", stop)
    if hasattr(module, "make_eval_env"):  # a script that imported it by name
        monkeypatch.setattr(module, "make_eval_env", stop)


# ----------------------------------------------------------------------------- option bounds
@pytest.mark.parametrize(
    ("script", "argv", "flag"),
    [
        ("ppo", ["--total_env_steps", "-100"], "--total_env_steps -100"),
        ("ppo", ["--eval_every", "0"], "--eval_every 0"),
        ("ppo", ["--num_envs", "0"], "--num_envs 0"),
        ("ppo", ["--minibatch_size", "0"], "--minibatch_size 0"),
        ("ppo", ["--checkpoint_every", "0"], "--checkpoint_every 0"),
        ("ppo", ["--quick", "--epochs", "0"], "--epochs 0"),
        ("ppo", ["--actor_learning_rate=-3e-5"], "--actor_learning_rate -3e-05"),
        ("ppo", ["--gamma", "nan"], "--gamma nan"),
        ("ppo", ["--pretrain.train_steps", "0"], "--pretrain.train_steps 0"),
        ("ppo", ["--pretrain.model.executed_chunk_length", "0"], "executed_chunk_length 0"),
        ("ppo", ["--min_noise_std", "0"], "--min_noise_std 0.0"),
        ("ppo", ["--max_noise_std=-0.3"], "--max_noise_std -0.3"),
        ("ppo", ["--initial_noise_std", "nan"], "--initial_noise_std nan"),
        ("ppo", ["--noise_learning_rate", "0"], "--noise_learning_rate 0.0"),
        ("ppo", ["--entropy_coeff=-0.01"], "--entropy_coeff -0.01"),
        ("dsrl", ["--batch_size", "0"], "--batch_size 0"),
        ("dsrl", ["--critic_learning_rate", "-1"], "--critic_learning_rate -1.0"),
        ("dsrl", ["--tau", "1.5"], "--tau 1.5"),
        ("dsrl", ["--eval_every_env_steps", "0"], "--eval_every_env_steps 0"),
        ("dsrl", ["--total_env_steps", "-100"], "--total_env_steps -100"),
    ],
)
def test_out_of_bounds_options_exit_with_an_error_naming_the_option(
    script, argv, flag, example, capsys
):
    module = example(script)
    with pytest.raises(SystemExit) as exit_:
        module.parse_args(argv)
    assert exit_.value.code == 2  # argparse's usage error
    error = capsys.readouterr().err
    assert flag in error and "must be" in error, error


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (
            ["--num_envs", "10", "--group_size", "4"],
            "--num_envs 10: must be a multiple of --group_size 4",
        ),
        (["--group_size", "1"], "--group_size 1: must be >= 2"),
        (["--episodes_per_batch", "2"], "--episodes_per_batch 2: must be 1 with --advantage grpo"),
        (
            ["--collector_workers", "2"],
            "--collector_workers 2 --collector_backend process: must be 1",
        ),
        (["--collector_backend", "ray"], "--collector_backend ray: must be 1 and process"),
    ],
)
def test_grpo_options_that_contradict_each_other_exit_with_an_error_naming_them(
    argv, named, example, capsys
):
    ppo = example("ppo")

    with pytest.raises(SystemExit) as exit_:
        ppo.parse_args(["--advantage", "grpo", *argv])
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err


def test_grpo_options_are_checked_in_grpo_mode_only(example):
    ppo = example("ppo")

    gae = ppo.parse_args(["--num_envs", "10", "--group_size", "4", "--collector_workers", "2"])
    assert (gae.advantage, gae.num_envs) == ("gae", 10)
    quick = ppo.parse_args(["--quick", "--advantage", "grpo"])
    assert (quick.num_envs, quick.group_size) == (4, 2)
    lift = ppo.parse_args(["--task", "lift", "--advantage", "grpo"])
    assert lift.num_envs % lift.group_size == 0


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--min_noise_std", "0.01"], "--min_noise_std 0.01: only with --noise learned"),
        (
            ["--initial_noise_std", "0.1", "--noise_learning_rate", "1e-3"],
            "--initial_noise_std 0.1 --noise_learning_rate 0.001: only with --noise learned",
        ),
        (["--entropy_coeff", "0.01"], "--entropy_coeff 0.01: needs --noise learned"),
    ],
)
def test_noise_head_options_without_a_noise_head_exit_with_an_error_naming_them(
    argv, named, example, capsys
):
    ppo = example("ppo")

    with pytest.raises(SystemExit) as exit_:
        ppo.parse_args(argv)
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err
    learned = ppo.parse_args(["--noise", "learned", *argv])  # the same options, with a head
    assert learned.noise == "learned"


def test_main_refuses_contradicting_grpo_options_built_in_code(example, monkeypatch, tmp_path):
    ppo = example("ppo")
    pretrain = example("pretrain")

    monkeypatch.setattr(pretrain, "main", stop)  # no work may start
    config = ppo.PPOConfig(
        advantage="grpo",
        num_envs=6,
        group_size=4,
        output_dir=str(tmp_path / "out"),
        pretrained_checkpoint=str(tmp_path / "bc.pt"),
    )
    with pytest.raises(ValueError, match="--num_envs 6: must be a multiple of --group_size 4"):
        ppo.main(config)
    assert not (tmp_path / "out").exists()


def test_pretrain_command_line_is_validated(example, capsys):
    pretrain = example("pretrain")
    parse_config = example("common").parse_config

    with pytest.raises(SystemExit):
        parse_config(pretrain.PretrainConfig, ["--learning_rate", "0"], exclude=pretrain.EXCLUDE)
    assert "--learning_rate 0.0: must be > 0" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["ppo", "dsrl"])
@pytest.mark.parametrize("argv", [[], ["--quick"], ["--task", "lift"], ["--task", "can"]])
def test_defaults_quick_and_task_defaults_are_within_bounds(script, argv, example):
    example(script).parse_args(argv)


@pytest.mark.parametrize(
    ("script", "config_class", "field", "value"),
    [
        ("ppo", "PPOConfig", "num_envs", 0),
        ("dsrl", "DSRLConfig", "utd_ratio", 0.0),
        ("pretrain", "PretrainConfig", "train_steps", 0),
    ],
)
def test_main_refuses_an_out_of_bounds_config_built_in_code(
    script, config_class, field, value, example, monkeypatch, tmp_path
):
    pretrain = example("pretrain")

    module = example(script)
    monkeypatch.setattr(pretrain, "load_or_collect_demos", stop)  # no work may start
    config = getattr(module, config_class)(output_dir=str(tmp_path / "out"), **{field: value})
    if script != "pretrain":
        config.pretrained_checkpoint = str(tmp_path / "bc.pt")
        monkeypatch.setattr(pretrain, "main", stop)
    with pytest.raises(ValueError, match=f"--{field} {value}: must be"):
        module.main(config)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("options", "shown"),
    [
        (["--min_noise_std", "0.5"], "got 0.5 < 0.08 < 0.3"),
        (["--max_noise_std", "0.05"], "got 0.02 < 0.08 < 0.05"),
        (["--initial_noise_std", "0.3"], "got 0.02 < 0.3 < 0.3"),
    ],
)
def test_learned_noise_bounds_that_do_not_nest_are_refused_before_any_work(
    options, shown, example, monkeypatch, tmp_path, capsys
):
    ppo = example("ppo")
    pretrain = example("pretrain")

    monkeypatch.setattr(pretrain, "main", stop)  # no work may start
    argv = ["--quick", "--noise", "learned", "--output_dir", str(tmp_path / "out"),
            "--pretrained_checkpoint", str(tmp_path / "bc.pt")]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:  # on the command line: argparse's error
        ppo.parse_args([*argv, *options])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "--min_noise_std < --initial_noise_std < --max_noise_std" in error and shown in error
    # A config built in code: refused by main and check_config.
    bounds = {
        option[2:]: float(value) for option, value in zip(options[::2], options[1::2], strict=True)
    }
    config = dataclasses.replace(ppo.parse_args(argv), **bounds)
    with pytest.raises(ValueError, match="--min_noise_std < --initial_noise_std < --max_noise_std"):
        ppo.main(config)
    with pytest.raises(ValueError, match=shown):
        ppo.check_config(config, world_size=1)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- resume
def run_config(script: str, tmp_path: Path, *options: str):
    """A ``--resume`` config of ``script`` whose pretrained checkpoint is ``tmp_path/bc.pt``."""
    module = load_example(script)
    return module, module.parse_args(
        ["--quick", "--resume", "--output_dir", str(tmp_path / "run"),
         "--pretrained_checkpoint", str(tmp_path / "bc.pt"), "--loggers", "", *options]
    )  # fmt: skip


def save_tiny_pretrained(path: Path):
    """An untrained small pusher policy checkpoint (what load_policy reads); its config."""
    import torch

    from torchrl_flowpolicy.networks import ObservationNormalizer

    model_config = ModelConfig(model_dim=16, num_heads=2, num_layers=1)
    size = model_config.observation_dim
    policy = build_policy(model_config, ObservationNormalizer(torch.zeros(size), torch.ones(size)))
    save_policy(path, policy, model_config)
    return model_config


@pytest.mark.parametrize("script", ["ppo", "dsrl"])
def test_resume_without_a_checkpoint_is_an_error_naming_the_path(
    script, example, monkeypatch, tmp_path
):
    pretrain = example("pretrain")

    monkeypatch.setattr(pretrain, "main", stop)  # refused before the pretraining
    module, config = run_config(script, tmp_path)
    expected = str(tmp_path / "run" / "checkpoint.pt")
    with pytest.raises(FileNotFoundError, match="drop --resume") as error:
        module.main(config)
    assert expected in str(error.value)


def foreign_checkpoint(path: Path, model_config, **changes):
    """A run checkpoint saved with ``changes`` to this run's identity."""
    identity = {
        "task": "pusher",
        "advantage": "gae",
        "model_config": dataclasses.asdict(model_config),
        "networks": {"hidden_dim": 64, "num_layers": 3},
    }
    for name, value in changes.items():
        if name in identity:
            identity[name] = value
        else:
            key, field = (
                ("networks", name) if name in identity["networks"] else ("model_config", name)
            )
            identity[key] = {**identity[key], field: value}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_run(path, {}, iteration=1, **identity)


@pytest.mark.parametrize("script", ["ppo", "dsrl"])
@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"executed_chunk_length": 2}, "model_config.executed_chunk_length: saved 2, this run 4"),
        ({"chunk_length": 16}, "model_config.chunk_length: saved 16, this run 8"),
        ({"model_dim": 32}, "model_config.model_dim: saved 32, this run 16"),
        ({"task": "lift"}, "task: saved 'lift', this run 'pusher'"),
    ],
)
def test_resuming_another_runs_checkpoint_names_the_fields_that_differ(
    script, changes, named, example, monkeypatch, tmp_path
):
    module, config = run_config(script, tmp_path)
    model_config = save_tiny_pretrained(tmp_path / "bc.pt")
    foreign_checkpoint(tmp_path / "run" / "checkpoint.pt", model_config, **changes)
    stop_at_the_evaluation_env(module, monkeypatch)
    with pytest.raises(ValueError, match="saved by another run") as error:
        module.main(config)
    assert named in str(error.value)


@pytest.mark.parametrize(("saved", "this_run"), [("grpo", "gae"), ("gae", "grpo")])
def test_ppo_resume_with_the_other_advantage_names_it(
    saved, this_run, example, monkeypatch, tmp_path
):
    # A GAE checkpoint holds a critic, a GRPO one none: resuming across them is refused.
    module, config = run_config("ppo", tmp_path, "--advantage", this_run)
    model_config = save_tiny_pretrained(tmp_path / "bc.pt")
    foreign_checkpoint(tmp_path / "run" / "checkpoint.pt", model_config, advantage=saved)
    stop_at_the_evaluation_env(module, monkeypatch)
    with pytest.raises(ValueError, match=f"advantage: saved '{saved}', this run '{this_run}'"):
        module.main(config)


@pytest.mark.parametrize(
    ("saved_noise", "options", "named"),
    [
        (
            {"kind": "fixed"},
            ["--noise", "learned"],
            "noise.kind: saved 'fixed', this run 'learned'",
        ),
        (
            {"kind": "learned", "min_std": 0.02, "max_std": 0.3},
            [],
            "noise.kind: saved 'learned', this run 'fixed'",
        ),
        (
            {"kind": "learned", "min_std": 0.01, "max_std": 0.3},
            ["--noise", "learned"],
            "noise.min_std: saved 0.01, this run 0.02",
        ),
    ],
)
def test_ppo_resume_with_another_exploration_noise_names_it(
    saved_noise, options, named, example, monkeypatch, tmp_path
):
    module, config = run_config("ppo", tmp_path, *options)
    model_config = save_tiny_pretrained(tmp_path / "bc.pt")
    path = tmp_path / "run" / "checkpoint.pt"
    path.parent.mkdir(parents=True)
    identity = {
        "task": "pusher",
        "model_config": dataclasses.asdict(model_config),
        "advantage": "gae",
    }
    save_run(path, {}, iteration=1, noise=saved_noise, **identity)
    stop_at_the_evaluation_env(module, monkeypatch)
    with pytest.raises(ValueError, match="saved by another run") as error:
        module.main(config)
    assert named in str(error.value)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--noise", "learned"], "noise.kind: saved 'fixed', this run 'learned'"),
        (["--advantage", "grpo"], "advantage: saved 'gae', this run 'grpo'"),
    ],
)
def test_ppo_resume_of_a_checkpoint_older_than_grpo_and_the_noise_head_names_what_differs(
    options, named, example, monkeypatch, tmp_path
):
    # Saved before "advantage" and "noise" were recorded: it had a critic and the fixed noise.
    module, config = run_config("ppo", tmp_path, *options)
    model_config = save_tiny_pretrained(tmp_path / "bc.pt")
    path = tmp_path / "run" / "checkpoint.pt"
    path.parent.mkdir(parents=True)
    save_run(path, {}, iteration=1, task="pusher", model_config=dataclasses.asdict(model_config))
    stop_at_the_evaluation_env(module, monkeypatch)
    with pytest.raises(ValueError, match="saved by another run") as error:
        module.main(config)
    assert named in str(error.value)
    _, defaults = run_config("ppo", tmp_path)  # a GAE run with the fixed noise resumes it
    noise = {"kind": defaults.noise}
    identity = run_identity(defaults.task, model_config, advantage=defaults.advantage, noise=noise)
    assert load_run(path, identity, IMPLIED_IDENTITY)["iteration"] == 1


def test_dsrl_resume_with_other_sac_network_sizes_names_them(example, monkeypatch, tmp_path):
    module, config = run_config("dsrl", tmp_path)
    model_config = save_tiny_pretrained(tmp_path / "bc.pt")
    foreign_checkpoint(tmp_path / "run" / "checkpoint.pt", model_config, hidden_dim=256)
    stop_at_the_evaluation_env(module, monkeypatch)
    with pytest.raises(ValueError, match="networks.hidden_dim: saved 256, this run 64"):
        module.main(config)


@pytest.mark.parametrize("script", ["ppo", "dsrl"])
def test_resuming_a_matching_checkpoint_passes_the_checks(script, example, monkeypatch, tmp_path):
    module, config = run_config(script, tmp_path)
    model_config = save_tiny_pretrained(tmp_path / "bc.pt")
    foreign_checkpoint(tmp_path / "run" / "checkpoint.pt", model_config)
    stop_at_the_evaluation_env(module, monkeypatch)
    with pytest.raises(Stop):
        module.main(config)


@pytest.mark.parametrize("script", ["ppo", "dsrl"])
def test_resuming_a_corrupt_checkpoint_says_it_is_corrupt(script, example, monkeypatch, tmp_path):
    module, config = run_config(script, tmp_path)
    save_tiny_pretrained(tmp_path / "bc.pt")
    path = tmp_path / "run" / "checkpoint.pt"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"PK\x03\x04 cut short")
    stop_at_the_evaluation_env(module, monkeypatch)
    with pytest.raises(ValueError, match=f"checkpoint at {re.escape(str(path))} is corrupt"):
        module.main(config)


def test_robosuite_defaults_are_the_fine_tuning_recipes(example):
    # --task lift runs the recipe of docs/robosuite.md (25 demonstrations, 48 envs, strong
    # self-imitation, lr 1e-4, 600k env steps) in every script that clones demonstrations,
    # --task can its second-round recipe; --quick and the command line still win over them.
    dsrl = example("dsrl")
    ppo = example("ppo")
    pretrain = example("pretrain")
    common = example("common")
    parse_config = common.parse_config

    config = ppo.parse_args(["--task", "lift"])
    recipe = (48, 360, 1.0, 1e-4, 600_000, 200, 25, 0.3)
    assert (
        config.num_envs,
        config.minibatch_size,
        config.bc_coeff,
        config.actor_learning_rate,
        config.total_env_steps,
        config.held_out_episodes,
        config.pretrain.demo_episodes,
        config.pretrain.demo_action_noise,
    ) == recipe
    # Lift keeps the sampler its recipe was published with (K = 8 from x_0 ~ N(0, I), the
    # last 4 steps stochastic); Can's second-round recipe runs the main job's sampler.
    sampler = config.sampler
    assert (sampler.num_denoising_steps, sampler.num_sde_steps) == (8, 4)
    assert sampler.eval_num_denoising_steps == 20
    assert (sampler.rollout_noise_scale, sampler.eval_noise_scale) == (1.0, 1.0)
    can = ppo.parse_args(["--task", "can"])
    main_job = ppo.parse_args([]).sampler
    assert can.sampler == main_job
    can_recipe = (24, 504, 1.0, 1e-4, 725_760, 20, 0.3)
    assert (
        can.num_envs,
        can.minibatch_size,
        can.bc_coeff,
        can.actor_learning_rate,
        can.total_env_steps,
        can.pretrain.demo_episodes,
        can.pretrain.demo_action_noise,
    ) == can_recipe
    pusher = ppo.parse_args([])
    assert (pusher.num_envs, pusher.sampler.num_denoising_steps) == (32, 4)
    assert pusher.sampler.eval_num_denoising_steps == 4
    assert pusher.sampler.rollout_noise_scale == 0.0
    assert dsrl.parse_args(["--task", "lift"]).pretrain.demo_episodes == 25
    standalone = parse_config(
        pretrain.PretrainConfig,
        ["--task", "lift"],
        task_defaults=script_defaults("pretrain"),
        exclude=pretrain.EXCLUDE,
    )
    assert standalone.demo_episodes == 25
    quick = ppo.parse_args(["--task", "lift", "--quick", "--bc_coeff", "0.5"])
    assert (quick.num_envs, quick.bc_coeff, quick.actor_learning_rate) == (4, 0.5, 1e-4)
