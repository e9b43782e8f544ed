"""The task registry: every task sets every field, callers read attributes instead of
comparing names, default paths are per task, checkpoints carry their task.

Covers :mod:`torchrl_flowpolicy.tasks.registry`, the task parts of
:mod:`~torchrl_flowpolicy.tasks.demonstrations` and :func:`~torchrl_flowpolicy.training.protocol.evaluate_expert`,
and the examples' ``--task`` defaults and checkpoint checks (``examples/common.py``).
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest
import torch
from examples_loader import load_example

from torchrl_flowpolicy.networks import ObservationNormalizer
from torchrl_flowpolicy.tasks import load_or_collect_demos
from torchrl_flowpolicy.tasks.registry import TASKS, DemoSettings, Task, get_task, script_defaults
from torchrl_flowpolicy.training.models import (
    ModelConfig,
    build_policy,
    load_policy,
    load_policy_checkpoint,
    save_policy,
)
from torchrl_flowpolicy.training.protocol import evaluate_expert
from torchrl_flowpolicy.training.video import render_options

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("pretrain", "ppo", "dsrl", "evaluate")


@pytest.fixture
def examples_on_path():
    """The example scripts loaded from their paths and registered under their names, as the
    scripts import each other (``common``, ``pretrain``); ``sys.path`` untouched."""
    for script in SCRIPTS:
        load_example(script)


def stop(*args, **kwargs):
    raise AssertionError("no work may start before the checkpoint is checked")


# ----------------------------------------------------------------------------- the registry
def test_every_task_sets_every_field():
    fields = {item.name for item in dataclasses.fields(Task)}
    # The differences the registry owns: horizon, success, demonstrations, run defaults, paths.
    assert {"max_episode_steps", "success", "demos", "run_defaults", "output_suffix"} <= fields
    for name, task in TASKS.items():
        assert task.name == name and task.title and task.success
        # None: one sub-environment per episode; no kinds of episode (only Can sorts them).
        for field in fields - {"max_eval_envs", "episode_kinds"}:
            assert getattr(task, field) is not None, (name, field)
        if task.episode_kinds is not None:
            assert task.episode_kinds.names[0] == "success" and callable(
                task.episode_kinds.classify
            )
        assert task.observation_dim > 0 and task.action_dim > 0 and task.max_episode_steps >= 1
        assert task.option_names[0] == "max_episode_steps"
        assert task.defaults["max_episode_steps"] == task.max_episode_steps
        assert "max_episode_steps" not in task.option_defaults
        for factory in (task.make_env, task.make_expert, task.collect_demos, task.render_options):
            assert callable(factory), name
        assert isinstance(task.demos, DemoSettings)
        assert task.demos.num_episodes >= 1 and task.demos.action_noise >= 0
        assert "max_episode_steps" in task.demos.cached_options
        assert set(task.demos.cached_options) <= set(task.option_names)
        assert set(task.run_defaults) <= set(SCRIPTS), name
        assert task.max_eval_envs is None or task.max_eval_envs >= 1
        assert task.output_suffix in ("", f"_{name}")  # the documented path scheme
    suffixes = [task.output_suffix for task in TASKS.values()]
    assert suffixes.count("") == 1 and len(set(suffixes)) == len(suffixes)
    checkpoints = {task.pretrained_checkpoint for task in TASKS.values()}
    assert len(checkpoints) == len(TASKS)  # no task picks up another's policy by default


def test_square_entry():
    square, can = get_task("square"), get_task("can")
    assert (square.observation_dim, square.action_dim) == (64, 7)
    assert square.max_episode_steps % 4 == 0  # whole decisions of H' = 4
    assert (square.demos.num_episodes, square.demos.action_noise) == (25, 0.3)
    assert square.output_suffix == "_square" and square.max_eval_envs == 25
    assert square.pretrained_checkpoint == "outputs/pretrain_square/policy.pt"
    assert square.run_defaults == can.run_defaults  # Can's recipe, copied
    assert square.option_defaults == can.option_defaults
    assert square.make_env.args == ("NutAssemblySquare",)  # the robosuite task it builds


def test_unknown_task_is_an_error_listing_the_tasks():
    with pytest.raises(
        ValueError, match=r"unknown task 'push'.*\['can', 'lift', 'pusher', 'square'\]"
    ):
        get_task("push")


def test_no_caller_compares_task_names():
    # The behaviour is tested below (a task added to the registry only); this keeps the
    # name comparisons from coming back.
    pattern = re.compile(r"""(==|!=)\s*["'](pusher|lift|can|square)["']|\btask\s*(==|!=)""")
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for folder in ("torchrl_flowpolicy", "examples", "benchmarks")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, "\n".join(found)


@pytest.fixture
def short_task(monkeypatch) -> Task:
    """A task added by one registry entry: Pusher with a 6-step horizon and its own paths."""
    pusher = get_task("pusher")
    task = dataclasses.replace(
        pusher,
        name="short",
        title="Pusher-v5, 6 steps",
        max_episode_steps=6,
        demos=dataclasses.replace(pusher.demos, num_episodes=2),
        run_defaults={"ppo": {"num_envs": 3}},
        output_suffix="_short",
    )
    monkeypatch.setitem(TASKS, "short", task)
    return task


def test_evaluate_expert_runs_the_tasks_own_horizon(short_task):
    # Pusher never ends an episode early: its length is the horizon.
    assert evaluate_expert(2, seed=0, task="short")["length"].tolist() == [6, 6]
    assert evaluate_expert(1, seed=0, task="short", max_episode_steps=4)["length"].tolist() == [4]
    assert evaluate_expert(1, seed=0, task="pusher")["length"].tolist() == [150]


def test_a_task_added_to_the_registry_reaches_demos_defaults_and_rendering(
    short_task, tmp_path, examples_on_path
):
    demos, path, loaded = load_or_collect_demos(1, 0.0, task="short", directory=tmp_path)
    assert not loaded and path.name == "short_T6_action_noise0_n1_seed0.pt"
    assert demos["observation"].shape == (6, 23) and demos["config"]["task"] == "short"
    again, _, loaded = load_or_collect_demos(
        1, 0.0, task="short", directory=tmp_path, success_threshold=10.0
    )
    assert loaded and again["success"].all()  # Pusher's success follows the threshold
    with pytest.raises(ValueError, match=r"takes the options .*not \['terminate_on_success'\]"):
        load_or_collect_demos(1, 0.0, task="short", terminate_on_success=True)

    ppo = script_defaults("ppo")["short"]
    assert ppo["max_episode_steps"] == 6 and ppo["num_envs"] == 3
    assert ppo["output_dir"] == "outputs/ppo_short"
    assert ppo["pretrained_checkpoint"] == "outputs/pretrain_short/policy.pt"
    assert ppo["pretrain.demo_episodes"] == 2
    assert script_defaults("pretrain")["short"]["output_dir"] == "outputs/pretrain_short"
    assert "num_envs" not in script_defaults("dsrl")["short"]  # ppo's own defaults only
    assert render_options("short", height=8, width=8) == render_options("pusher", height=8, width=8)


# ----------------------------------------------------------------------------- defaults
def _script_config(script: str, argv: list[str]):
    """``examples/<script>.py``'s config for ``argv``, parsed as the script parses it."""
    module = importlib.import_module(script)
    if hasattr(module, "parse_args"):
        return module.parse_args(argv)
    from common import parse_config

    config_class = {"pretrain": "PretrainConfig", "evaluate": "EvaluateConfig"}[script]
    return parse_config(
        getattr(module, config_class),
        argv,
        task_defaults=script_defaults(script),
        exclude=getattr(module, "EXCLUDE", ()),
    )


def _option(config, name: str):
    for part in name.split("."):
        config = getattr(config, part)
    return config


@pytest.mark.parametrize("script", SCRIPTS)
def test_task_defaults_name_real_options_and_reach_the_config(script, examples_on_path):

    for name, values in script_defaults(script).items():
        config = _script_config(script, ["--task", name])
        for option, value in values.items():
            target = config
            *parents, leaf = option.split(".")
            for parent in parents:
                target = getattr(target, parent)
            assert leaf in {item.name for item in dataclasses.fields(target)}, (script, option)
            assert _option(config, option) == value, (script, name, option)


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_configs_own_defaults_are_the_default_tasks(script, examples_on_path):
    # A config built in code (no --task) starts from the default task's registry values.

    names = {"pretrain": "Pretrain", "ppo": "PPO", "dsrl": "DSRL", "evaluate": "Evaluate"}
    config = getattr(importlib.import_module(script), f"{names[script]}Config")()
    for option, value in script_defaults(script)[config.task].items():
        assert _option(config, option) == value, (script, option)


def test_default_paths_are_per_task(examples_on_path):
    import pretrain

    for name, task in TASKS.items():
        for script in ("ppo", "dsrl"):
            run = _script_config(script, ["--task", name])
            assert run.output_dir == task.output_dir(script)
            assert run.pretrained_checkpoint == task.pretrained_checkpoint
            # A missing checkpoint is pretrained where the run looks for it.
            made = pretrain.config_for_run(run)
            assert str(Path(made.output_dir) / made.checkpoint_name) == task.pretrained_checkpoint
        standalone = _script_config("pretrain", ["--task", name])
        assert str(Path(standalone.output_dir) / standalone.checkpoint_name) == (
            task.pretrained_checkpoint
        )
        evaluation = _script_config("evaluate", ["--task", name])
        assert evaluation.checkpoints == task.pretrained_checkpoint
        assert evaluation.output_json == f"{task.output_dir('evaluation')}.json"
    lift = _script_config("ppo", ["--task", "lift"])
    assert (lift.output_dir, lift.pretrained_checkpoint) == (
        "outputs/ppo_lift",
        "outputs/pretrain_lift/policy.pt",
    )
    pusher = _script_config("ppo", [])
    assert (pusher.output_dir, pusher.pretrained_checkpoint) == (
        "outputs/ppo",
        "outputs/pretrain/policy.pt",
    )
    typed = _script_config("ppo", ["--task", "lift", "--pretrained_checkpoint", "mine.pt"])
    assert typed.pretrained_checkpoint == "mine.pt"  # the command line still wins


# ----------------------------------------------------------------------------- checkpoints
def save_tiny_policy(path: Path, task: Task | None) -> None:
    """An untrained small policy of ``task``'s observation size (``None``: Pusher's, saved
    without a task entry, as checkpoints were before it existed)."""
    size = (task or get_task("pusher")).observation_dim
    model_config = ModelConfig(model_dim=16, num_heads=2, num_layers=1, observation_dim=size)
    normalizer = ObservationNormalizer(torch.zeros(size), torch.ones(size))
    policy = build_policy(model_config, normalizer)
    save_policy(path, policy, model_config, task=None if task is None else task.name)


def test_a_checkpoint_records_its_task_and_observation_layout(tmp_path, examples_on_path):
    path = tmp_path / "lift.pt"
    save_tiny_policy(path, get_task("lift"))
    state = torch.load(path, weights_only=True)
    assert state["task"] == "lift"
    assert state["observation"] == {"key": "observation", "dim": 60}
    assert load_policy_checkpoint(path, task="lift").model_config.observation_dim == 60


@pytest.mark.parametrize(
    ("recorded", "message"),
    [
        (True, r"holds a policy of task 'pusher' \(Pusher-v5, 23 observation features\)"),
        (False, r"records no task; its 23 observation features are those of task 'pusher'"),
    ],
)
def test_a_pusher_checkpoint_given_to_lift_names_both_tasks(
    recorded, message, tmp_path, examples_on_path
):
    path = tmp_path / "pusher.pt"
    save_tiny_policy(path, get_task("pusher") if recorded else None)
    expected = (
        rf"the checkpoint at {re.escape(str(path))} .*{message}.*this run's task 'lift' "
        r"\(robosuite Lift \(Panda\), 60 observation features\).*outputs/pretrain_lift/policy.pt"
    )
    with pytest.raises(ValueError, match=expected):
        load_policy(path, task="lift")
    load_policy(path, task="pusher")  # its own task loads it, recorded or told


def test_check_checkpoint_refuses_layouts_no_task_has():
    lift = get_task("lift")
    lift.check_checkpoint({"task": "lift", "observation": {"key": "observation", "dim": 60}})
    with pytest.raises(ValueError, match=r"of task 'lift' but has 61 observation features"):
        lift.check_checkpoint({"task": "lift", "model_config": {"observation_dim": 61}})
    with pytest.raises(ValueError, match=r"records no task, and its 5 observation features"):
        lift.check_checkpoint({"model_config": {"observation_dim": 5}})
    with pytest.raises(ValueError, match=r"task 'stack' \(unknown here, 70 .*task 'lift'"):
        lift.check_checkpoint({"task": "stack", "observation": {"dim": 70}})


@pytest.mark.parametrize("script", ["ppo", "dsrl", "evaluate"])
def test_the_scripts_refuse_another_tasks_checkpoint_before_any_work(
    script, tmp_path, monkeypatch, examples_on_path
):
    import pretrain

    path = tmp_path / "pusher.pt"
    save_tiny_policy(path, get_task("pusher"))
    module = importlib.import_module(script)
    monkeypatch.setattr(pretrain, "main", stop)
    if script == "evaluate":
        argv = ["--checkpoints", str(path), "--output_json", str(tmp_path / "out.json")]
    else:
        argv = ["--quick", "--pretrained_checkpoint", str(path), "--loggers", ""]
        argv += ["--output_dir", str(tmp_path / "out")]
    config = _script_config(script, ["--task", "lift", *argv])
    with pytest.raises(ValueError, match=r"task 'pusher' .*this run's task 'lift'"):
        module.main(config)
    assert not (tmp_path / "out.json").exists()
