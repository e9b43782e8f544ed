"""End-to-end runs of the examples at a tiny budget (marked ``slow``)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import random
import re
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from examples_loader import load_example

from torchrl_flowpolicy import SamplerOptions
from torchrl_flowpolicy.networks import ObservationNormalizer
from torchrl_flowpolicy.training.checkpoint import save_checkpoint
from torchrl_flowpolicy.training.loggers import MetricLogger
from torchrl_flowpolicy.training.models import (
    ModelConfig,
    build_noise_head,
    build_policy,
    load_policy_checkpoint,
    noise_record,
    save_policy,
)
from torchrl_flowpolicy.training.runs import (
    RunProgress,
    load_run,
    restore_random_state,
    resume_run,
    run_identity,
    save_figure,
    save_run,
    seed_random_generators,
    write_json,
)

ROOT = Path(__file__).resolve().parents[1]

TINY = [
    "--num_envs", "2",
    "--frames_per_batch", "8",
    "--total_decisions", "16",
    "--model_dim", "16",
    "--num_heads", "2",
    "--num_layers", "1",
    "--eval_num_denoising_steps", "4",
    "--eval_max_decisions", "3",
]  # fmt: skip


def run_sampler_demo(tmp_path: Path, *options: str) -> tuple[str, dict]:
    command = [sys.executable, str(ROOT / "examples" / "sampler_demo.py"), *TINY, *options]
    command += ["--output_dir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout, json.loads((tmp_path / "summary.json").read_text())


@pytest.mark.slow
def test_sampler_demo_mixed(tmp_path):
    stdout, summary = run_sampler_demo(tmp_path)

    # Pusher-v5 episodes last 100 steps = 25 decisions of 4 rows: no episode ends here.
    assert summary["decisions"] == 16
    assert summary["env_steps"] == 16 * 4
    assert len(summary["batches"]) == 2
    # "mixed": exactly one stochastic step per decision, never step 0.
    counts = [row["count"] for row in summary["stochastic_step_histogram"]]
    assert len(counts) == 8 and counts[0] == 0 and sum(counts) == 16
    # The learner's recomputation matches what the rollout stored.
    assert summary["recompute_max_abs_diff"] < 1e-3
    for value in summary["log_prob"].values():
        assert value == value and abs(value) < 1e4  # finite
    evaluation = summary["evaluation"]
    assert evaluation["decisions"] == 3 and evaluation["env_steps"] == 12
    assert evaluation["num_denoising_steps"] == 4
    assert "evaluation (deterministic ODE, K=4)" in stdout
    assert "stochastic steps (sde_mode=mixed, K=8)" in stdout


@pytest.mark.slow
def test_sampler_demo_last_steps(tmp_path):
    _, summary = run_sampler_demo(tmp_path, "--sde_mode", "last", "--num_sde_steps", "2")

    counts = [row["count"] for row in summary["stochastic_step_histogram"]]
    assert counts == [0] * 6 + [16, 16]
    assert summary["recompute_max_abs_diff"] < 1e-3


@pytest.mark.slow
def test_evaluate_checkpoints_at_several_noise_scales(tmp_path):
    torch.manual_seed(0)
    model_config = ModelConfig(model_dim=16, num_heads=2, num_layers=1)
    size = model_config.observation_dim
    normalizer = ObservationNormalizer(torch.zeros(size), torch.ones(size))
    save_policy(tmp_path / "policy.pt", build_policy(model_config, normalizer), model_config)
    output = tmp_path / "evaluation.json"
    command = [
        sys.executable,
        str(ROOT / "examples" / "evaluate.py"),
        "--checkpoints", f"{tmp_path / 'policy.pt'},{tmp_path / 'policy.pt'}",
        "--eval_noise_scales", "1.0,0.0",
        "--uniform_noise_bounds", "0.3",
        "--eval_episodes", "3",
        "--split", "curve",
        "--expert",
        "--max_episode_steps", "12",
        "--eval_num_denoising_steps", "2",
        "--output_json", str(output),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    written = json.loads(output.read_text())
    assert written["seed"] == 10_000  # the curve split
    expert, *rows = written["rows"]
    assert expert["checkpoint"] == "expert" and len(expert["episode_success"]) == 3
    scales = [row.get("eval_noise_scale") for row in rows]
    assert scales == [1.0, 0.0, None, 1.0, 0.0, None]
    assert [row.get("uniform_noise_bound") for row in rows] == [None, None, 0.3] * 2
    assert all(row["num_episodes"] == 3 for row in rows)
    # Same checkpoint, same seed: the same episodes; the two scales give different returns.
    for first, second in zip(rows[:3], rows[3:], strict=True):
        assert first["mean_return"] == second["mean_return"]
    assert len({row["mean_return"] for row in rows[:3]}) == 3
    assert all(row["success_low"] <= row["success_rate"] <= row["success_high"] for row in rows)
    assert "clean scripted expert: success" in result.stdout
    assert re.search(r"scale 0: success [\d.]+% \[[\d.]+, [\d.]+\]", result.stdout)
    assert "uniform noise in [-0.3, 0.3]: success" in result.stdout
    assert written["comparisons"] == []

    # --baseline: the protocol against a pretrained checkpoint; against itself, every paired
    # difference is exactly zero (same states, same noise), and the expert is the same run.
    baseline = [*command, "--baseline", str(tmp_path / "policy.pt"), "--uniform_noise_bounds", ""]
    baseline.append("--overwrite")  # the same --output_json as the first evaluation
    result = subprocess.run(baseline, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    comparisons = json.loads(output.read_text())["comparisons"]
    assert len(comparisons) == 2 and "vs BC best" in result.stdout
    for comparison in comparisons:
        for difference in comparison["rl_minus_bc_best"].values():
            assert (difference["difference"], difference["low"], difference["high"]) == (0, 0, 0)
        assert comparison["success"]["expert"]["rate"] == expert["success_rate"]


def test_compare_runs_table_and_plot(tmp_path):
    def summary(history_steps: list[int], **extra) -> dict:
        history = [
            {"env_steps": step, "success_rate": 0.5, "wall_seconds": 60.0 * index}
            for index, step in enumerate(history_steps)
        ]
        return {
            "bc_success": 0.25,
            "rl_success": 0.5,
            "env_steps": history_steps[-1],
            "wall_seconds": 120.0,
            "history": history,
            **extra,
        }

    ppo, dsrl = tmp_path / "ppo.json", tmp_path / "dsrl.json"
    ppo.write_text(json.dumps(summary([1000, 2000])))
    dsrl.write_text(json.dumps(summary([0, 1000], bc_noise_free_success=0.75)))
    output = tmp_path / "plot.png"
    command = [
        sys.executable,
        str(ROOT / "examples" / "compare_runs.py"),
        "--output", str(output),
        "--wall_time",
        "--runs",
        f"PPO={ppo}",
        f"DSRL={dsrl}",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert output.stat().st_size > 0
    assert "| PPO | 25 % | 50 % | 2,000 | 2.0 |" in result.stdout
    assert "| DSRL | 25 % | 50 % | 1,000 | 2.0 |" in result.stdout


def test_compare_runs_titles_the_figure_with_the_runs_task():
    default_title = load_example("compare_runs").default_title

    lift = {"config": {"task": "lift", "eval_num_denoising_steps": 20}}
    assert default_title([lift, lift]) == "robosuite Lift (Panda): evaluation success (ODE, K = 20)"
    assert default_title([{}]) == "Pusher-v5: evaluation success (ODE, K = 20)"  # older summaries
    mixed = [lift, {"config": {"task": "pusher", "eval_num_denoising_steps": 10}}]
    assert default_title(mixed) == (
        "robosuite Lift (Panda) / Pusher-v5: evaluation success (ODE, K = 10 / 20)"
    )


def _method_summary(seed: int, curve: float, final: float, episodes: list[int]) -> dict:
    """A ``summary.json`` of ``examples/ppo.py`` with a held-out protocol on 20 episodes."""
    rate = {"rate": sum(episodes) / len(episodes), "low": 0.0, "high": 1.0}
    return {
        "seed": seed,
        "bc_success": 0.25,
        "rl_success": final,
        "env_steps": 2000,
        "wall_seconds": 60.0 * (seed + 1),
        "history": [
            {"env_steps": step, "success_rate": curve, "wall_seconds": 30.0 * (seed + 1) * i}
            for i, step in enumerate((1000, 2000), start=1)
        ],
        "held_out": {
            "seed": 30000,
            "reported_decoding": "noise_free",
            "bc_best_decoding": "noise_free",
            "success": {
                "bc": {"sampled": rate, "noise_free": rate},
                "rl": {"sampled": rate, "noise_free": rate},
                "expert": {"rate": 1.0, "low": 0.9, "high": 1.0},
            },
            "episode_success": {"rl": {"sampled": episodes, "noise_free": episodes}},
        },
    }


def test_compare_runs_averages_a_label_over_seeds_and_pairs_held_out_episodes(tmp_path):
    runs = {
        "A0": _method_summary(0, 0.4, 0.4, [1, 0, 0, 0] * 5),
        "A1": _method_summary(1, 0.6, 0.6, [1, 1, 0, 0] * 5),
        "B0": _method_summary(0, 0.5, 0.5, [1, 1, 0, 0] * 5),
        "B1": _method_summary(1, 0.5, 0.5, [1, 1, 0, 0] * 5),
    }
    for name, summary in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(summary))
    specifications = [f"{name[0]}={tmp_path / name}.json" for name in runs]
    command = [
        sys.executable, str(ROOT / "examples" / "compare_runs.py"),
        "--output", str(tmp_path / "methods.png"), "--wall_time", "--held_out",
        "--baseline", "A", "--runs", *specifications,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "methods.png").stat().st_size > 0
    # One row per label: the mean final success, then each seed's; the mean wall time.
    assert "| A | 25 % | 50 % (40 / 60) | 2,000 | 1.5 |" in result.stdout
    assert "| B | 25 % | 50 % (50 / 50) | 2,000 | 1.5 |" in result.stdout
    # B against A on the same episodes: seed 0 wins 5 of 20 pairs, seed 1 ties every pair.
    rows = [line for line in result.stdout.splitlines() if line.startswith("| B | ")]
    assert rows[1].startswith("| B | 0 | 50.0 % | 50.0 % | 50.0 % | 100.0 % | +25.0 [")
    assert rows[2].endswith("| +0.0 [+0.0, +0.0] |")
    assert rows[3].startswith("| B | pooled |") and " +12.5 [" in rows[3]
    low = float(rows[1].split("[")[1].split(",")[0])
    assert 0 < low < 25

    # Runs of one label must share their evaluation steps; the baseline must be a label.
    shifted = _method_summary(1, 0.6, 0.6, [1] * 20)
    shifted["history"][0]["env_steps"] = 1500
    (tmp_path / "shifted.json").write_text(json.dumps(shifted))
    bad = command[: command.index("--runs")] + [
        "--overwrite",
        "--runs",
        f"A={tmp_path / 'A0.json'}",
        f"A={tmp_path / 'shifted.json'}",
    ]
    result = subprocess.run(bad, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode != 0 and "different env steps" in result.stderr
    missing = [
        *command[: command.index("--baseline")],
        "--baseline",
        "C",
        "--runs",
        *specifications,
    ]
    result = subprocess.run(missing, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode != 0 and "is not a label of --runs" in result.stderr


def test_dsrl_target_entropy_follows_the_box_and_refuses_unreachable_targets(example):
    from torchrl_flowpolicy.dsrl_networks import target_entropy_per_dim

    # nan (the example's default): SAC's -1 per dimension of [-1, 1] carried to [-m, m].
    assert math.isnan(example("dsrl").DSRLConfig().target_entropy_per_dim)
    assert target_entropy_per_dim(1.0) == -1.0
    assert target_entropy_per_dim(0.3) == pytest.approx(-2.2040, abs=1e-4)
    assert target_entropy_per_dim(1.5, -2.0) == -2.0
    # At or above log(2m), the entropy of the uniform noise over the box: refused.
    with pytest.raises(ValueError, match="log\\(2 m\\) = -1.204"):
        target_entropy_per_dim(0.15, -1.0)


# ----------------------------------------------------------------------------- command line
# The example scripts; the modules they share (no command line of their own) left out.
SHARED_MODULES = ("common.py", "run_settings.py", "ppo_learner.py", "dsrl_runs.py")
SCRIPTS = sorted(
    path.name for path in (ROOT / "examples").glob("*.py") if path.name not in SHARED_MODULES
)


@pytest.fixture
def example_modules():
    """A script run in this process (``runpy``) imports ``common`` as from its own folder:
    the examples loaded from their paths first (``sys.path`` untouched)."""
    load_example("pretrain")


def help_entries(help_text: str) -> dict[str, str]:
    """``--option`` -> its help text, from an argparse ``--help`` output (``-h`` left out)."""
    entries = {}
    for entry in re.split(r"\n(?=  -)", help_text.split("\noptions:\n", 1)[1]):
        entry = entry.split("\n\n")[0].strip()  # a group title may follow
        invocation, _, description = entry.partition("  ")
        flag = invocation.split()[0].rstrip(",")
        if flag != "-h":
            entries[flag] = " ".join(description.split())
    return entries


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_describes_every_option(script, example_modules, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(ROOT / "examples" / script), run_name="__main__")
    assert stop.value.code == 0
    entries = help_entries(capsys.readouterr().out)
    assert len(entries) >= 4, entries
    for flag, description in entries.items():
        assert flag.startswith("--") and "-" not in flag[2:], f"{script}: {flag} is not snake_case"
        text = description.split("(default:")[0].split("(required")[0].strip()
        assert text, f"{script}: {flag} has no description"


def test_ppo_options_use_the_library_names(example_modules, capsys):
    ppo = load_example("ppo")

    with pytest.raises(SystemExit):
        ppo.parse_args(["--help"])
    entries = help_entries(capsys.readouterr().out)
    for flag in ("--total_env_steps", "--quick"):
        assert flag in entries
    # The sampler's settings are one group, --sampler.*: every SamplerOptions field, once.
    fields = [field.name for field in dataclasses.fields(SamplerOptions)]
    assert {f"--sampler.{name}" for name in fields} <= set(entries)
    assert "--pretrain.demo_action_noise" in entries
    assert "--pretrain.model.executed_chunk_length" in entries
    # The sampler's settings once, under the library's names: no other spelling, no copy in a group.
    denoising = {flag for flag in entries if "denoising" in flag}
    assert denoising == {"--sampler.num_denoising_steps", "--sampler.eval_num_denoising_steps"}
    assert [flag for flag in entries if "noise_level" in flag] == ["--sampler.noise_level"]
    # Set from the run's own options when the pretraining runs: not offered twice.
    assert "--pretrain.seed" not in entries and "--pretrain.reward" not in entries


def test_quick_sets_defaults_and_keeps_explicit_options(example_modules):
    dsrl = load_example("dsrl")

    ppo = load_example("ppo")

    quick = ppo.parse_args(["--quick"])
    assert (quick.epochs, quick.total_env_steps, quick.pretrain.train_steps) == (2, 2400, 150)
    explicit = ppo.parse_args(["--quick", "--epochs", "3", "--pretrain.train_steps", "7"])
    assert (explicit.epochs, explicit.pretrain.train_steps) == (3, 7)
    assert explicit.minibatch_size == 76 and explicit.pretrain.demo_episodes == 5  # default
    assert ppo.parse_args(["--quick", "--total_env_steps", "3000"]).total_env_steps == 3000
    # The same value as the full default, typed: kept too.
    assert ppo.parse_args(["--total_env_steps", "400000", "--quick"]).total_env_steps == 400_000
    assert ppo.parse_args([]) == ppo.PPOConfig()
    assert dsrl.parse_args(["--quick", "--num_envs", "2"]).num_envs == 2
    assert dsrl.parse_args(["--quick"]).num_envs == 4
    assert dsrl.parse_args(["--no-zero_mean_init"]).zero_mean_init is False


@pytest.mark.parametrize("script", ["ppo", "dsrl"])
def test_pretraining_is_an_explicit_call_that_leaves_the_config_alone(
    script, example_modules, monkeypatch, tmp_path
):
    pretrain = load_example("pretrain")

    module = load_example(script)
    config = module.parse_args(
        ["--quick", "--seed", "5", "--reward", "gymnasium", "--output_dir", str(tmp_path / "run"),
         "--pretrained_checkpoint", str(tmp_path / "bc" / "bc_seed5.pt"), "--pretrain_if_missing"]
    )  # fmt: skip
    before = copy.deepcopy(config)
    called = []

    class Stop(Exception):
        pass

    def fake_pretrain(pretrain_config):
        called.append(pretrain_config)
        raise Stop

    monkeypatch.setattr(pretrain, "main", fake_pretrain)
    with pytest.raises(Stop):
        module.main(config)
    assert config == before
    (pretrain_config,) = called
    assert pretrain_config.seed == 5 and pretrain_config.reward == "gymnasium"
    assert pretrain_config.output_dir == str(tmp_path / "bc")
    assert pretrain_config.checkpoint_name == "bc_seed5.pt"  # writes pretrained_checkpoint
    assert pretrain_config.train_steps == 150  # --quick's, from config.pretrain
    assert pretrain_config == pretrain.config_for_run(config)


@pytest.mark.parametrize(
    ("argv", "expected"), [(["--seed", "3"], 3), (["--seed", "3", "--demo_seed", "0"], 0)]
)
def test_pretraining_demonstrations_follow_the_seed_unless_given(
    monkeypatch, tmp_path, argv, expected
):
    # A seed redraws everything random: the demonstrations too, unless --demo_seed pins them.
    pretrain = load_example("pretrain")
    config = pretrain.parse_config(pretrain.PretrainConfig, [*argv, "--output_dir", str(tmp_path)])
    seeds = []

    class Stop(Exception):
        pass

    def fake_collect(**options):
        seeds.append(options["seed"])
        raise Stop

    monkeypatch.setattr(pretrain, "load_or_collect_demos", fake_collect)
    with pytest.raises(Stop):
        pretrain.main(config)
    assert seeds == [expected] == [pretrain.demonstration_seed(config)]


def test_run_checkpoint_round_trip_restores_state_and_random_streams(example_modules, tmp_path):
    seed_random_generators(0)
    network = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(network.parameters())
    network(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    save_run(tmp_path / "run.pt", {"net": network, "opt": optimizer}, iteration=7, history="[]")
    expected_draws = (torch.rand(3), np.random.rand(3), random.random())

    seed_random_generators(1)
    other = torch.nn.Linear(3, 2)
    other_optimizer = torch.optim.Adam(other.parameters())
    progress = resume_run(tmp_path / "run.pt", {"net": other, "opt": other_optimizer})
    random_state = progress.pop("random_state")
    assert progress == {"iteration": 7, "history": "[]"}
    torch.testing.assert_close(other.weight, network.weight, rtol=0, atol=0)
    assert other_optimizer.state_dict()["state"][0]["step"] == 1
    # resume_run leaves the streams alone; restore_random_state puts all three back.
    assert not torch.equal(torch.rand(3), expected_draws[0])
    restore_random_state(random_state)
    torch.testing.assert_close(torch.rand(3), expected_draws[0], rtol=0, atol=0)
    np.testing.assert_array_equal(np.random.rand(3), expected_draws[1])
    assert random.random() == expected_draws[2]


def test_learned_noise_head_is_saved_with_the_run_and_rebuilt_on_load(example_modules, tmp_path):
    # --noise learned: the fresh head trains at its own learning rate, is saved with the run,
    # comes back with examples/evaluate.py's load_policy and with --resume's resume_run.
    ppo = load_example("ppo")
    config = ppo.parse_args(
        ["--quick", "--noise", "learned", "--min_noise_std", "0.01", "--max_noise_std", "0.4",
         "--noise_learning_rate", "1e-3"]
    )  # fmt: skip
    model_config = ModelConfig(model_dim=16, num_heads=2, num_layers=1)
    size = model_config.observation_dim
    normalizer = ObservationNormalizer(torch.zeros(size), torch.ones(size))

    def make_learner(seed: int, noise: bool = True):
        torch.manual_seed(seed)
        policy = build_policy(model_config, normalizer)
        if noise:
            policy.noise_head = build_noise_head(
                model_config, config.min_noise_std, config.max_noise_std, config.initial_noise_std
            )
        return ppo.make_learner(policy, config, model_config.executed_chunk_length)

    fixed = make_learner(0, noise=False)  # the default: one group, every policy parameter
    (group,) = fixed.actor_optimizer.param_groups
    assert len(group["params"]) == len(list(fixed.policy.parameters()))
    learner = make_learner(0)
    flow_group, head_group = learner.actor_optimizer.param_groups
    assert (flow_group["lr"], head_group["lr"]) == (config.actor_learning_rate, 1e-3)
    head = learner.policy.noise_head
    assert {id(p) for p in head_group["params"]} == {id(p) for p in head.parameters()}
    assert len(flow_group["params"]) + len(head_group["params"]) == len(
        list(learner.policy.parameters())
    )
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.add_(torch.randn_like(parameter))
    path = tmp_path / "checkpoint.pt"
    ppo.save_ppo_run(path, learner, model_config, config, RunProgress(3, 100))

    loaded, _, _, state = load_policy_checkpoint(path)
    noise = noise_record(learner.policy)  # the identity's noise, as main records it
    identity = run_identity(config.task, model_config, advantage=config.advantage, noise=noise)
    assert state["noise"] == identity["noise"]
    assert state["noise"] == {"kind": "learned", "min_std": 0.01, "max_std": 0.4}
    assert (loaded.noise_head.min_std, loaded.noise_head.max_std) == (0.01, 0.4)
    for name, value in head.state_dict().items():
        assert torch.equal(loaded.noise_head.state_dict()[name], value), name

    resumed = make_learner(1)
    resume_run(load_run(path, identity), resumed.trained())
    for name, value in head.state_dict().items():
        assert torch.equal(resumed.policy.noise_head.state_dict()[name], value), name
    assert resumed.actor_optimizer.param_groups[1]["lr"] == 1e-3


def test_context_grad_option_reaches_the_loss(example_modules):
    # --context_grad hands the policy gradient to the encoder (the loss's own option, whose
    # effect tests/test_ppo_loss.py checks): Pusher's default; the robosuite recipes keep it off.
    ppo = load_example("ppo")
    model_config = ModelConfig(model_dim=16, num_heads=2, num_layers=1)
    size = model_config.observation_dim
    normalizer = ObservationNormalizer(torch.zeros(size), torch.ones(size))
    cases = [([], True), (["--no-context_grad"], False), (["--task", "lift"], False)]
    for arguments, expected in cases:
        config = ppo.parse_args(["--quick", *arguments])
        policy = build_policy(model_config, normalizer)
        learner = ppo.make_learner(policy, config, model_config.executed_chunk_length)
        assert learner.loss_module.context_grad is expected
        encoder = {id(p) for p in policy.encoder.parameters()}
        (group,) = learner.actor_optimizer.param_groups
        assert encoder <= {id(p) for p in group["params"]}


def test_a_checkpoint_of_the_earlier_format_resumes_torchs_stream(example_modules, tmp_path):
    # Checkpoints written before "random_state" held torch's state alone, as "rng_state".
    torch.manual_seed(0)
    save_checkpoint(
        {"net": torch.nn.Linear(3, 2).state_dict(), "rng_state": torch.get_rng_state()},
        tmp_path / "old.pt",
    )
    expected = torch.rand(3)
    progress = resume_run(tmp_path / "old.pt", {"net": torch.nn.Linear(3, 2)})
    restore_random_state(progress["random_state"])
    torch.testing.assert_close(torch.rand(3), expected, rtol=0, atol=0)


def test_a_resumed_runs_csv_files_lose_the_rows_logged_after_its_checkpoint(
    example_modules, tmp_path
):
    config = argparse.Namespace(seed=0)
    logger = MetricLogger("csv", "ppo_seed0", tmp_path, config)
    for step in (600, 1200, 1800):  # the checkpoint holds step 1200
        logger.log({"train/chunk_reward": step / 1000, "iteration": step // 600}, step)
    scalars = tmp_path / "csv" / "ppo_seed0" / "scalars"
    with (scalars / "iteration.csv").open("a") as file:
        file.write("24")  # a write cut short by the kill
    resumed = MetricLogger("csv", "ppo_seed0", tmp_path, config, resume_step=1200)
    resumed.log({"train/chunk_reward": 1.9, "iteration": 3}, 1800)
    assert (scalars / "train" / "chunk_reward.csv").read_text().splitlines() == [
        "600,0.6",
        "1200,1.2",
        "1800,1.9",
    ]
    assert (scalars / "iteration.csv").read_text().splitlines() == [
        "600,1.0",
        "1200,2.0",
        "1800,3.0",
    ]
    assert not list(scalars.rglob(".*.tmp"))


def test_summaries_and_plots_are_written_atomically(tmp_path):
    import matplotlib.pyplot as plt

    path = tmp_path / "summary.json"
    write_json(path, {"success": 0.5})
    with pytest.raises(TypeError):  # fails half-way through the serialisation
        write_json(path, {"success": 0.75, "policy": object()})
    assert json.loads(path.read_text()) == {"success": 0.5}
    figure = plt.figure()
    png = save_figure(figure, tmp_path / "plots" / "curve.png")
    plt.close(figure)
    assert png.read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["curve.png", "plots", "summary.json"]


def test_the_pretraining_parity_check_compares_k20_with_the_runs_rollout_steps():
    # A fine-tuning run's pretraining checks the ODE at K = 20 against the run's own rollout
    # K; a run without a sampler (DSRL) keeps the pretraining's default.
    ppo, dsrl, pretrain = (load_example(name) for name in ("ppo", "dsrl", "pretrain"))
    config = ppo.parse_args(["--sampler.num_denoising_steps", "6"])
    assert pretrain.config_for_run(config).rollout_denoising_steps == 6
    assert pretrain.config_for_run(ppo.parse_args([])).rollout_denoising_steps == 4
    default = pretrain.PretrainConfig().rollout_denoising_steps
    assert pretrain.config_for_run(dsrl.parse_args([])).rollout_denoising_steps == default


def test_compare_runs_diagnostics_read_the_runs_csv_log(tmp_path):
    compare = load_example("compare_runs")
    scalars = tmp_path / "run" / "csv" / "ppo_seed0" / "scalars"
    scalars.mkdir(parents=True)
    (scalars / "clip_fraction.csv").write_text("4800,0.1\n9600,0.3\n14400,0.5\n")
    (scalars / "kl_approx.csv").write_text("4800,0.02\n9600,0.04\n")
    summary = {"config": {"output_dir": str(tmp_path / "run")}, "wall_seconds": 90.0}
    assert compare.logged_mean(summary, "clip_fraction") == pytest.approx(0.3)
    assert compare.logged_mean(summary, "kl_approx") == pytest.approx(0.03)
    assert compare.diagnostics_cells(summary) == " 0.300 | 0.0300 | 1.5 |"
    # A run that logged no CSV gets "n/a", not a number.
    unlogged = {"config": {"output_dir": str(tmp_path / "other")}, "wall_seconds": 60.0}
    assert compare.logged_mean(unlogged, "clip_fraction") is None
    assert compare.diagnostics_cells(unlogged) == " n/a | n/a | 1.0 |"
    # --diagnostics needs the held-out table it adds columns to.
    config = compare.CompareConfig(runs=["a=x.json"], output="o.png", diagnostics=True)
    assert config.option_conflicts() == ["--diagnostics: only with --held_out"]
