"""No run destroys another run's results, and every option is checked before any work.

The examples refuse an output that holds results they did not make (without ``--resume`` or
``--overwrite``) or that is one of their inputs, refuse a missing or misspelled input path
naming its option, compare a resumed run's identity (pretrained start, seed, sampler), check
every option and list item before the first evaluation and warn about settings in which the
actor cannot learn. The library's setters and transforms check what their constructors
check. Each test here failed on the code before these checks (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import subprocess
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch
from examples_loader import load_example
from tensordict import TensorDict

from torchrl_flowpolicy.networks import ObservationNormalizer
from torchrl_flowpolicy.training import reports, runs
from torchrl_flowpolicy.training.models import (
    ModelConfig,
    build_noise_head,
    build_policy,
    load_policy,
    load_policy_checkpoint,
    save_policy,
)
from torchrl_flowpolicy.training.run_checks import weights_digest

ROOT = Path(__file__).resolve().parents[1]


class Stop(Exception):
    """Raised by a patched step: the run got past the checks under test."""


def stop(*args, **kwargs):
    raise Stop


def tiny_policy(path: Path, *, noise_head: bool = False, seed: int = 0) -> ModelConfig:
    """An untrained small Pusher policy checkpoint (with a learned noise head if asked)."""
    torch.manual_seed(seed)
    model_config = ModelConfig(model_dim=16, num_heads=2, num_layers=1)
    size = model_config.observation_dim
    policy = build_policy(model_config, ObservationNormalizer(torch.zeros(size), torch.ones(size)))
    if noise_head:
        policy.noise_head = build_noise_head(model_config, 0.02, 0.3, 0.08)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_policy(path, policy, model_config, task="pusher")
    return model_config


def run_argv(tmp_path: Path, *options: str) -> list[str]:
    """A ``--quick`` fine-tuning command line writing into ``tmp_path/run`` from ``bc.pt``."""
    return ["--quick", "--output_dir", str(tmp_path / "run"), "--loggers", "",
            "--pretrained_checkpoint", str(tmp_path / "bc.pt"), *options]  # fmt: skip


@pytest.fixture
def no_work(monkeypatch):
    """The first steps of a run's work (pretraining, evaluation envs) stop it."""
    pretrain = load_example("pretrain")
    monkeypatch.setattr(pretrain, "main", stop)
    monkeypatch.setattr(pretrain, "load_or_collect_demos", stop)
    monkeypatch.setattr(reports, "make_eval_env", stop)


# ----------------------------------------------------------------------------- 1. outputs
@pytest.mark.parametrize("script", ["ppo", "dsrl"])
@pytest.mark.parametrize("result", ["checkpoint.pt", "summary.json"])
def test_a_folder_holding_a_runs_results_is_refused_without_resume_or_overwrite(
    script, result, tmp_path, no_work
):
    module = load_example(script)
    tiny_policy(tmp_path / "bc.pt")
    saved = tmp_path / "run" / result
    saved.parent.mkdir()
    saved.write_bytes(b"a finished run's result")
    with pytest.raises(FileExistsError, match=r"--resume to continue .* --overwrite") as error:
        module.main(module.parse_args(run_argv(tmp_path)))
    assert str(saved.parent) in str(error.value) and result in str(error.value)
    assert saved.read_bytes() == b"a finished run's result"
    with pytest.raises(Stop):  # --overwrite: past the check, into the work
        module.main(module.parse_args(run_argv(tmp_path, "--overwrite")))


@pytest.mark.parametrize("script", ["ppo", "dsrl"])
def test_resume_and_overwrite_together_are_refused(script, capsys):
    with pytest.raises(SystemExit):
        load_example(script).parse_args(["--resume", "--overwrite"])
    assert "--resume --overwrite: continue the run in output_dir, or replace it" in (
        capsys.readouterr().err
    )


def test_pretraining_refuses_a_folder_holding_another_pretraining(tmp_path, monkeypatch):
    pretrain = load_example("pretrain")
    monkeypatch.setattr(pretrain, "load_or_collect_demos", stop)  # its first work
    tiny_policy(tmp_path / "bc" / "policy.pt")
    config = pretrain.PretrainConfig(output_dir=str(tmp_path / "bc"))
    with pytest.raises(FileExistsError, match="policy.pt"):
        pretrain.main(config)
    with pytest.raises(ValueError, match="--checkpoint_name 'summary.json'"):
        pretrain.main(dataclasses.replace(config, checkpoint_name="summary.json", overwrite=True))
    with pytest.raises(Stop):
        pretrain.main(dataclasses.replace(config, overwrite=True))


def test_sampler_demo_refuses_a_folder_holding_a_summary(tmp_path, monkeypatch):
    demo = load_example("sampler_demo")
    (tmp_path / "summary.json").write_text("{}")  # another run's
    monkeypatch.setattr(demo, "SerialEnv", stop)  # its first work
    config = demo.SamplerDemoConfig(output_dir=str(tmp_path))
    with pytest.raises(FileExistsError, match="summary.json.*--overwrite"):
        demo.main(config)
    assert (tmp_path / "summary.json").read_text() == "{}"
    with pytest.raises(Stop):  # --overwrite: on to the work
        demo.main(dataclasses.replace(config, overwrite=True))


def test_a_runs_pretraining_never_writes_over_another_pretrainings_summary(tmp_path, no_work):
    ppo = load_example("ppo")
    (tmp_path / "bc").mkdir()
    (tmp_path / "bc" / "summary.json").write_text("{}")  # another pretraining's
    argv = run_argv(tmp_path, "--pretrain_if_missing", "--pretrained_checkpoint")
    with pytest.raises(FileExistsError, match="the pretraining's folder"):
        ppo.main(ppo.parse_args([*argv, str(tmp_path / "bc" / "new.pt")]))
    with pytest.raises(ValueError, match="into --output_dir"):  # the run's own summary.json
        ppo.main(ppo.parse_args([*argv, str(tmp_path / "run" / "bc.pt")]))


@pytest.mark.parametrize("script", ["ppo", "dsrl"])
def test_a_run_never_writes_over_its_own_pretrained_checkpoint(script, tmp_path, no_work):
    module = load_example(script)
    start = tmp_path / "run" / "checkpoint.pt"
    tiny_policy(start)
    argv = run_argv(tmp_path, "--overwrite", "--pretrained_checkpoint", str(start))
    with pytest.raises(ValueError, match="never writes over its own inputs"):
        module.main(module.parse_args(argv))


def summary_file(path: Path) -> Path:
    history = [{"env_steps": 100, "success_rate": 0.5, "wall_seconds": 1.0}]
    summary = {"bc_success": 0.2, "rl_success": 0.5, "env_steps": 100, "wall_seconds": 1.0}
    path.write_text(json.dumps({**summary, "history": history}))
    return path


def test_compare_runs_never_writes_over_an_input_and_asks_before_replacing(tmp_path):
    compare = load_example("compare_runs")
    summary = summary_file(tmp_path / "summary.json")
    before = summary.read_bytes()
    config = compare.CompareConfig(runs=[f"A={summary}"], output=str(summary))
    with pytest.raises(ValueError, match="never writes over its own inputs"):
        compare.main(config)
    assert summary.read_bytes() == before
    figure = tmp_path / "figure.png"
    figure.write_bytes(b"an earlier figure")
    with pytest.raises(FileExistsError, match="--overwrite"):
        compare.main(dataclasses.replace(config, output=str(figure)))
    assert figure.read_bytes() == b"an earlier figure"
    compare.main(dataclasses.replace(config, output=str(figure), overwrite=True))
    assert figure.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("options", "raised", "message"),
    [
        (["--runs", "A=missing.json"], FileNotFoundError, "--runs missing.json: no such file"),
        (["--runs", "nolabel"], ValueError, "--runs: expected LABEL=PATH"),
        (["--held_out", "--baseline", "B"], ValueError, "--baseline 'B' is not a label"),
    ],
)
def test_compare_runs_checks_its_inputs_before_drawing(options, raised, message, tmp_path):
    compare = load_example("compare_runs")
    summary = summary_file(tmp_path / "summary.json")
    argv = ["--output", str(tmp_path / "out.png"), "--runs", f"A={summary}", *options]
    with pytest.raises(raised, match=message):
        compare.main(compare.parse_config(compare.CompareConfig, argv))
    assert not (tmp_path / "out.png").exists()


def test_compare_runs_baseline_without_held_out_is_refused(capsys):
    compare = load_example("compare_runs")
    with pytest.raises(SystemExit):
        compare.parse_config(compare.CompareConfig, ["--output", "o.png", "--runs", "A=a.json",
                                                     "--baseline", "A"])  # fmt: skip
    assert "--baseline A: only with --held_out" in capsys.readouterr().err


# ----------------------------------------------------------------------------- benchmarks
#: The benchmarks that write their results to ``--output`` (bench_lerobot.py's check runs
#: before anything needs lerobot, so it is here too).
BENCHMARKS = ["bench_collectors", "bench_ddp", "bench_dropin", "bench_envs", "bench_lerobot",
              "bench_loss", "bench_sampler", "profile_main_job"]  # fmt: skip


def load_benchmark(name: str, monkeypatch) -> ModuleType:
    """``benchmarks/{name}.py`` as a module, its folder on ``sys.path`` as when it runs."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module(name)


@contextlib.contextmanager
def no_measuring():
    """Timing (``time.perf_counter``) or starting the processes of a configuration
    (``torch.multiprocessing.spawn``) raises :class:`Stop`: the benchmark began to measure."""
    saved = time.perf_counter, torch.multiprocessing.spawn, torch.get_num_threads()
    time.perf_counter = torch.multiprocessing.spawn = stop
    try:
        yield
    finally:
        time.perf_counter, torch.multiprocessing.spawn = saved[:2]
        torch.set_num_threads(saved[2])


@pytest.mark.parametrize("script", BENCHMARKS)
def test_a_benchmark_refuses_an_existing_output_before_measuring(
    script, tmp_path, monkeypatch, capsys
):
    module = load_benchmark(script, monkeypatch)
    output = tmp_path / "results.json"
    output.write_text("{}")  # an earlier run's results
    with no_measuring(), pytest.raises(SystemExit) as exited:
        module.main(["--quick", "--output", str(output)])
    assert exited.value.code == 2  # a command-line error, before any measurement
    error = capsys.readouterr().err
    assert f"--output {output} exists: pass --overwrite to replace it" in error
    assert output.read_text() == "{}"


def test_a_benchmark_refuses_a_folder_as_output_and_goes_on_with_overwrite(
    tmp_path, monkeypatch, capsys
):
    sampler = load_benchmark("bench_sampler", monkeypatch)
    with no_measuring(), pytest.raises(SystemExit):
        sampler.main(["--quick", "--output", str(tmp_path)])
    assert f"--output {tmp_path}: a folder, not a file" in capsys.readouterr().err
    output = tmp_path / "results.json"
    output.write_text("{}")
    with no_measuring(), pytest.raises(Stop):  # --overwrite: on to the measurements
        sampler.main(["--quick", "--output", str(output), "--overwrite"])
    assert output.read_text() == "{}"  # written (atomically) only once measured


def test_gpu_lerobot_refuses_a_folder_holding_an_earlier_run_before_running(tmp_path):
    (tmp_path / "float32.json").write_text("{}")  # an earlier run's results
    script = ROOT / "benchmarks" / "gpu_lerobot.sh"
    done = subprocess.run(["bash", script, tmp_path], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"{tmp_path} holds the results of an earlier run (float32.json)" in done.stderr
    assert "--overwrite" in done.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["float32.json"]  # no new log
    assert (tmp_path / "float32.json").read_text() == "{}"


# ----------------------------------------------------------------------------- 2. identity
def saved_run(tmp_path: Path, script: str, model_config: ModelConfig, **changes) -> None:
    """The run checkpoint ``script`` saves in ``tmp_path/run`` from ``bc.pt`` (``--quick``,
    seed 0), with ``changes`` to its identity."""
    policy = load_policy(tmp_path / "bc.pt")
    identity = {
        "task": "pusher",
        "model_config": dataclasses.asdict(model_config),
        "seed": 0,
        "pretrained_weights": weights_digest(policy.state_dict()),
        "sampler": policy.options.to_dict(),
    }
    if script == "ppo":
        sampler = load_example("ppo").parse_args(["--quick"]).sampler
        identity |= {"advantage": "gae", "noise": {"kind": "fixed"}, "sampler": sampler.to_dict()}
    else:
        identity["networks"] = {"hidden_dim": 64, "num_layers": 3}
    path = tmp_path / "run" / "checkpoint.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    runs.save_run(path, {}, iteration=1, **{**identity, **changes})


@pytest.mark.parametrize("script", ["ppo", "dsrl"])
@pytest.mark.parametrize(
    ("options", "another_start", "named"),
    [
        (["--seed", "1"], False, "seed: saved 0, this run 1"),
        ([], True, "pretrained_weights: saved"),
    ],
)
def test_resume_refuses_another_seed_or_pretrained_start(
    script, options, another_start, named, tmp_path, no_work
):
    module = load_example(script)
    model_config = tiny_policy(tmp_path / "bc.pt")
    saved_run(tmp_path, script, model_config)
    if another_start:  # the same architecture, other weights
        tiny_policy(tmp_path / "bc.pt", seed=1)
    with pytest.raises(ValueError, match="saved by another run") as error:
        module.main(module.parse_args(run_argv(tmp_path, "--resume", *options)))
    assert named in str(error.value)


@pytest.mark.parametrize(
    ("script", "options", "named"),
    [
        ("ppo", ["--sampler.noise_level", "0.3"], "sampler.noise_level: saved 0.5, this run 0.3"),
        ("dsrl", ["--eval_num_denoising_steps", "4"], "sampler.eval_num_denoising_steps: saved 20"),
    ],
)
def test_resume_refuses_other_sampler_settings(script, options, named, tmp_path, no_work):
    module = load_example(script)
    model_config = tiny_policy(tmp_path / "bc.pt")
    saved_run(tmp_path, script, model_config)
    with pytest.raises(ValueError, match="saved by another run") as error:
        module.main(module.parse_args(run_argv(tmp_path, "--resume", *options)))
    assert named in str(error.value)
    with pytest.raises(Stop):  # the settings it was saved with: resumed
        module.main(module.parse_args(run_argv(tmp_path, "--resume")))


def test_a_learned_noise_start_of_a_fixed_noise_run_is_dropped_with_a_warning(
    tmp_path, no_work, monkeypatch
):
    ppo = load_example("ppo")
    tiny_policy(tmp_path / "bc.pt", noise_head=True)  # a --noise learned run's policy
    recorded = []

    def record(task, model_config, **entries):
        recorded.append(entries["noise"])
        raise Stop

    monkeypatch.setattr(runs, "run_identity", record)
    with pytest.warns(UserWarning, match="holds a learned noise head") as warned:
        with pytest.raises(Stop):
            ppo.main(ppo.parse_args(run_argv(tmp_path)))
    assert "--noise fixed run explores with the fixed Flow-SDE noise" in str(warned[0].message)
    assert recorded == [{"kind": "fixed"}]  # what the summary says is what it trains


# ----------------------------------------------------------------------------- 3. options
@pytest.mark.parametrize("script", ["ppo", "dsrl"])
def test_a_misspelled_pretrained_checkpoint_is_an_error_not_a_fresh_start(
    script, tmp_path, no_work
):
    module = load_example(script)
    argv = run_argv(tmp_path, "--pretrained_checkpoint", str(tmp_path / "polcy.pt"))
    with pytest.raises(FileNotFoundError, match="--pretrained_checkpoint .*polcy.pt: no such"):
        module.main(module.parse_args(argv))
    with pytest.raises(Stop):  # asked for: pretrained there
        module.main(module.parse_args([*argv, "--pretrain_if_missing"]))


@pytest.mark.parametrize("script", ["ppo", "dsrl"])
def test_the_default_pretrained_checkpoint_is_still_pretrained_when_missing(
    script, tmp_path, no_work, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # outputs/pretrain/policy.pt is missing here
    module = load_example(script)
    with pytest.raises(Stop):
        module.main(module.parse_args(["--quick", "--loggers", ""]))


@pytest.mark.parametrize("script", ["ppo", "dsrl"])
def test_quick_runs_never_touch_a_full_runs_files(script, tmp_path, no_work, monkeypatch):
    # A --quick run used to write its 150-step pretraining at the default checkpoint (where
    # the full run then started from it) and, after a full run, was refused its folder.
    monkeypatch.chdir(tmp_path)
    module = load_example(script)
    full = module.parse_args([])
    Path(full.output_dir).mkdir(parents=True)
    (Path(full.output_dir) / "summary.json").write_text("{}")  # a finished full run
    quick = module.parse_args(["--quick", "--loggers", ""])
    assert Path(quick.output_dir) == Path("outputs/quick") / Path(full.output_dir).name
    assert quick.pretrained_checkpoint == "outputs/quick/pretrain/policy.pt"
    with pytest.raises(Stop):  # its pretraining runs into the quick folder
        module.main(quick)
    assert (Path(full.output_dir) / "summary.json").read_text() == "{}"
    assert not Path(full.pretrained_checkpoint).exists()
    Path(quick.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(quick.output_dir) / "summary.json").write_text("{}")  # an earlier quick run
    with pytest.raises(Stop):  # replaced: the quick folder holds quick runs only
        module.main(module.parse_args(["--quick", "--loggers", ""]))
    with pytest.raises(FileExistsError, match="--overwrite"):  # a folder named by the user
        module.main(
            module.parse_args(["--quick", "--loggers", "", "--output_dir", quick.output_dir])
        )


@pytest.mark.parametrize("script", ["ppo", "dsrl"])
def test_a_folder_given_as_pretrained_checkpoint_is_an_error_naming_the_option(
    script, tmp_path, no_work
):
    module = load_example(script)
    argv = run_argv(tmp_path, "--pretrain_if_missing", "--pretrained_checkpoint", str(tmp_path))
    with pytest.raises(IsADirectoryError, match="--pretrained_checkpoint .*a folder"):
        module.main(module.parse_args(argv))


@pytest.mark.parametrize(
    ("script", "option"),
    [("ppo", "--held_out_episodes"), ("ppo", "--eval_episodes"), ("dsrl", "--held_out_episodes")],
)
def test_split_sizes_are_bounds_of_the_options(script, option, capsys):
    with pytest.raises(SystemExit):
        load_example(script).parse_args([option, "10001"])
    assert f"{option} 10001: must be <= 10000" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["ppo", "dsrl"])
def test_an_unknown_logger_is_refused_before_any_work(script, tmp_path, no_work):
    module = load_example(script)
    tiny_policy(tmp_path / "bc.pt")
    argv = [*run_argv(tmp_path), "--loggers", "csv,tensorbord"]
    with pytest.raises(ValueError, match=r"--loggers csv,tensorbord: \['tensorbord'\]"):
        module.main(module.parse_args(argv))


@pytest.mark.parametrize(
    ("script", "options", "warned"),
    [
        ("ppo", ["--sampler.noise_level", "0"], "--sampler.noise_level 0: the fixed noise"),
        ("ppo", ["--critic_warmup_iterations", "4"], "the actor is never updated"),
        ("dsrl", ["--random_env_steps", "1200"], "no SAC update is made"),
        ("dsrl", ["--critic_warmup_updates", "500"], "the actor is never updated"),
    ],
)
def test_settings_in_which_the_actor_cannot_learn_warn_before_any_work(
    script, options, warned, tmp_path, no_work
):
    module = load_example(script)
    tiny_policy(tmp_path / "bc.pt")
    with pytest.warns(UserWarning, match=warned):
        with pytest.raises(Stop):
            module.main(module.parse_args(run_argv(tmp_path, *options)))


@pytest.mark.parametrize("script", ["ppo", "dsrl"])
@pytest.mark.parametrize("argv", [[], ["--quick"], ["--task", "lift"], ["--task", "can"]])
def test_the_defaults_warn_about_nothing(script, argv):
    assert load_example(script).parse_args(argv).option_warnings() == []


# ----------------------------------------------------------------------------- evaluate.py
@pytest.fixture
def evaluation(tmp_path, monkeypatch):
    """``examples/evaluate.py`` with a tiny checkpoint; any evaluation stops it."""
    evaluate = load_example("evaluate")
    for name in ("make_eval_env", "evaluate_task_expert", "evaluate_episodes"):
        monkeypatch.setattr(evaluate, name, stop)
    tiny_policy(tmp_path / "bc.pt")
    return evaluate


def evaluate_argv(tmp_path: Path, *options: str) -> list[str]:
    return ["--checkpoints", str(tmp_path / "bc.pt"), "--output_json",
            str(tmp_path / "evaluation.json"), *options]  # fmt: skip


@pytest.mark.parametrize(
    ("options", "raised", "message"),
    [
        (["--eval_noise_scales", "1,abc"], ValueError, "--eval_noise_scales '1,abc': 'abc' is not"),
        (["--eval_noise_scales", "nan"], ValueError, "--eval_noise_scales nan: nan is not >= 0"),
        (["--uniform_noise_bounds", "0.3,-1"], ValueError, "--uniform_noise_bounds 0.3,-1: -1.0"),
        (["--checkpoints", ""], ValueError, "--checkpoints '': no checkpoint to evaluate"),
        (["--checkpoints", "missing.pt"], FileNotFoundError, "--checkpoints missing.pt: no such"),
        (["--baseline", "."], IsADirectoryError, "--baseline .: a folder"),
        (["--video_episodes", "1", "--video_camera", "topview"], ValueError, "--video_camera"),
    ],
)
def test_evaluate_checks_its_inputs_before_evaluating(
    options, raised, message, evaluation, tmp_path
):
    config = evaluation.parse_config(evaluation.EvaluateConfig, evaluate_argv(tmp_path, *options))
    with pytest.raises(raised, match=message):
        evaluation.main(config)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--eval_episodes", "-1"], "--eval_episodes -1: must be >= 1"),
        (["--eval_episodes", "10001"], "--eval_episodes 10001: must be <= 10000"),
        (["--video_episodes", "-1"], "--video_episodes -1: must be >= 0"),
        (["--video_camera", "agentview"], "--video_camera agentview: only with --video_episodes"),
        (["--reported_decoding", "noise_free"], "--reported_decoding noise_free: only with"),
        (
            ["--failure_kinds"],
            "--failure_kinds: --task pusher does not sort its episodes (tasks that do: ['can'])",
        ),
    ],
)
def test_evaluate_options_out_of_bounds_exit_with_an_error(options, message, evaluation, capsys):
    with pytest.raises(SystemExit):
        evaluation.parse_config(evaluation.EvaluateConfig, options)
    assert message in capsys.readouterr().err


def test_evaluate_never_writes_over_an_input_or_an_earlier_evaluation(evaluation, tmp_path):
    before = (tmp_path / "bc.pt").read_bytes()
    argv = evaluate_argv(tmp_path)[:2] + ["--output_json", str(tmp_path / "bc.pt"), "--overwrite"]
    with pytest.raises(ValueError, match="never writes over its own inputs"):
        evaluation.main(evaluation.parse_config(evaluation.EvaluateConfig, argv))
    assert (tmp_path / "bc.pt").read_bytes() == before
    (tmp_path / "evaluation.json").write_text("{}")
    config = evaluation.parse_config(evaluation.EvaluateConfig, evaluate_argv(tmp_path))
    with pytest.raises(FileExistsError, match="--output_json .*--overwrite"):
        evaluation.main(config)
    with pytest.raises(Stop):
        evaluation.main(dataclasses.replace(config, overwrite=True))


def test_evaluate_loads_every_checkpoint_before_the_first_evaluation(evaluation, tmp_path):
    other = tmp_path / "dsrl.pt"
    runs.save_run(other, {}, loss_module={}, replay_buffer={}, task="pusher")
    argv = evaluate_argv(tmp_path)
    argv[1] = f"{tmp_path / 'bc.pt'},{other}"
    config = evaluation.parse_config(evaluation.EvaluateConfig, [*argv, "--expert"])
    with pytest.raises(ValueError, match="a DSRL run's checkpoint"):
        evaluation.main(config)  # not after the expert's and the first checkpoint's


# ----------------------------------------------------------------------------- 4. library
def test_loading_a_checkpoint_of_another_kind_names_the_file_and_what_it_holds(tmp_path):
    dsrl_run = tmp_path / "checkpoint.pt"
    runs.save_run(dsrl_run, {}, loss_module={}, replay_buffer={}, task="pusher")
    with pytest.raises(ValueError, match=f"{dsrl_run} holds a DSRL run's checkpoint"):
        load_policy_checkpoint(dsrl_run, task="pusher")
    demos = tmp_path / "demos.pt"
    torch.save({"observation": torch.zeros(2), "action": torch.zeros(2), "episode": 0}, demos)
    with pytest.raises(ValueError, match="holds demonstrations"):
        load_policy(demos)


def test_chunked_action_setter_checks_like_the_constructor():
    from torchrl.envs import TransformedEnv
    from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv

    from torchrl_flowpolicy.envs import ChunkedAction

    transform = ChunkedAction(2)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="executed_chunk_length must be an integer >= 1"):
            transform.executed_chunk_length = bad
    with pytest.raises(ValueError, match="executed_chunk_length must be an integer >= 1"):
        ChunkedAction(1.5)
    transform.executed_chunk_length = 3  # before it joins an environment: fine
    env = TransformedEnv(ContinuousActionVecMockEnv(), transform)
    assert env.action_spec.shape[-2] == 3
    with pytest.raises(ValueError, match="already belongs to an environment"):
        transform.executed_chunk_length = 4
    assert transform.executed_chunk_length == 3


def test_noise_action_transform_setter_checks_like_the_constructor(tmp_path):
    from torchrl_flowpolicy.dsrl import NoiseActionTransform

    tiny_policy(tmp_path / "bc.pt")
    transform = NoiseActionTransform(load_policy(tmp_path / "bc.pt"), noise_bound=0.3)
    for bad in (float("nan"), -1.0, 0.0, float("inf")):
        with pytest.raises(ValueError, match="noise_bound must be a finite positive number"):
            transform.noise_bound = bad
    assert transform.noise_bound == 0.3


@pytest.mark.parametrize(
    ("low", "high", "message"),
    [
        (float("nan"), 1.0, "finite bounds; low"),
        (-1.0, float("inf"), "finite bounds; high"),
        (torch.tensor([-1.0, float("nan")]), torch.ones(2), "finite bounds; low"),
    ],
)
def test_clamp_action_refuses_non_finite_bounds(low, high, message):
    from torchrl_flowpolicy.envs import ClampAction

    with pytest.raises(ValueError, match=message):
        ClampAction(low=low, high=high)


def test_clamp_action_refuses_bounds_of_another_shape_when_the_env_is_built():
    from torchrl.data import Unbounded
    from torchrl.envs import TransformedEnv
    from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv

    from torchrl_flowpolicy.envs import ClampAction

    base = ContinuousActionVecMockEnv(action_spec=Unbounded((7,)))
    clamp = ClampAction(low=-torch.ones(3), high=torch.ones(3))
    with pytest.raises(ValueError, match=r"low has shape \(3,\), which does not broadcast"):
        TransformedEnv(base, clamp).action_spec  # noqa: B018 (the specs are built lazily)
    wider = ClampAction(low=-torch.ones(2, 7), high=torch.ones(2, 7))
    with pytest.raises(ValueError, match="to a larger one"):
        TransformedEnv(ContinuousActionVecMockEnv(action_spec=Unbounded((7,))), wider).action_spec  # noqa: B018
    fits = ClampAction(low=-torch.ones(7), high=torch.ones(7))
    assert (
        TransformedEnv(
            ContinuousActionVecMockEnv(action_spec=Unbounded((7,))), fits
        ).action_spec.shape[-1]
        == 7
    )


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_group_relative_advantages_are_floating_for_integer_rewards(dtype):
    from torchrl_flowpolicy.objectives import GroupRelativeAdvantage, group_relative_advantage

    returns = torch.tensor([1, 0, 1, 1]).to(dtype)
    advantage = group_relative_advantage(returns, torch.tensor([0, 0, 1, 1]))
    assert advantage.is_floating_point()
    assert advantage[0] > 0.7 and advantage[1] < -0.7 and advantage[2:].eq(0).all()
    reward = torch.tensor([[1], [0]], dtype=dtype).unsqueeze(-1)  # one decision per episode
    batch = TensorDict(
        {"group_id": torch.zeros(2, 1, dtype=torch.long), ("next", "reward"): reward,
         ("next", "done"): torch.ones(2, 1, 1, dtype=torch.bool)},
        batch_size=[2, 1],
    )  # fmt: skip
    written = GroupRelativeAdvantage()(batch)["advantage"]
    assert written.is_floating_point() and written[0].item() > 0.7


@pytest.mark.parametrize("eps", [float("nan"), float("inf"), -1e-6])
def test_group_relative_advantages_refuse_a_non_finite_eps(eps):
    from torchrl_flowpolicy.objectives import GroupRelativeAdvantage, group_relative_advantage

    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        group_relative_advantage(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), eps=eps)
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        GroupRelativeAdvantage(eps=eps)
