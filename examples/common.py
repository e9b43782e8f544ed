"""What the examples share: the command line, the model, checkpoints, loggers and
the evaluation protocol (its baselines, its held-out numbers and their plot).

Kept small on purpose: every example script still reads top to bottom; this module only
spares them from writing the same thing twice.

**The command line.** Each script's settings are one dataclass whose fields are declared with
:func:`option` (a default and one line of help). :func:`parse_config` turns the dataclass
into an ``argparse`` parser: ``--name`` per field (underscores, as in the field),
``--group.name`` for a field of a nested dataclass, ``--name`` / ``--no-name`` for booleans,
the allowed values of a ``Literal`` type as choices, ``--name A B`` for a ``list``; a field
without a default is a required option. ``--help`` prints every field's help text and
default. A script that passes ``quick=`` also gets ``--quick``: its values replace
the defaults, and options typed on the command line win over them. A number's bounds
(``option(..., minimum=1)``) are checked on the resulting config, before any work: a value
out of bounds exits with argparse's error naming the option. So do options that contradict
each other, which a config lists in its ``option_conflicts()`` method (e.g. ``--num_envs``
not a multiple of ``--group_size``).

Why this small builder rather than ``tyro``: tyro would read the same dataclasses, but
adds a dependency whose defaults (kebab-case flags, its own boolean and nested-option
spelling) must be turned off to keep the flags above, and ``--quick`` (defaults that never
override typed options) needs the same pre-parse either way. Plain ``argparse`` is what
every reader already knows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import typing
from collections.abc import Collection, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import Tensor, nn
from torchrl.envs import EnvBase, StepCounter
from torchrl.record.loggers import CSVLogger, WandbLogger

from torchrl_flowpolicy import FlowSDEPolicy
from torchrl_flowpolicy.checkpoint import atomic_write, load_checkpoint, save_checkpoint
from torchrl_flowpolicy.envs import TASKS, Task, get_task, make_chunked_env
from torchrl_flowpolicy.evaluation import evaluate_decodings
from torchrl_flowpolicy.networks import (
    ActionExpertTransformer,
    NoiseHead,
    ObservationEncoder,
    ObservationNormalizer,
)
from torchrl_flowpolicy.protocol import (
    CURVE_SEED,
    evaluate_expert,
    format_protocol,
    protocol_summary,
    split_seed,
)
from torchrl_flowpolicy.sampler import SamplerOptions
from torchrl_flowpolicy.statistics import wilson_interval

Config = TypeVar("Config")


# ----------------------------------------------------------------------------- command line
def option(
    default: Any = MISSING,
    help: str = "",
    *,
    default_factory: Any = MISSING,
    minimum: float | None = None,
    above: float | None = None,
    maximum: float | None = None,
) -> Any:
    """A config field: its default (or ``default_factory``), the line ``--help`` prints and
    the bounds of a number (``minimum <= value``, ``above < value``, ``value <= maximum``),
    which :func:`validate_config` checks."""
    if not help:
        raise ValueError("every option needs a help text.")
    bounds = {"minimum": minimum, "above": above, "maximum": maximum}
    return dataclasses.field(
        default=default,
        default_factory=default_factory,
        metadata={
            "help": help,
            **{name: value for name, value in bounds.items() if value is not None},
        },
    )


def config_errors(config: Any, prefix: str = "") -> list[str]:
    """What is wrong with ``config``'s options: one line per value outside the bounds of its
    :func:`option`, naming the option as the command line spells it (nested dataclasses
    too; NaN is outside any bound), then the lines of the config's ``option_conflicts()``
    method, if it has one (options that contradict each other, each line naming them)."""
    errors = []
    for item in dataclasses.fields(config):
        name, value = f"{prefix}{item.name}", getattr(config, item.name)
        if dataclasses.is_dataclass(value):
            errors += config_errors(value, f"{name}.")
            continue
        expected = []
        if "minimum" in item.metadata and not value >= item.metadata["minimum"]:
            expected.append(f">= {item.metadata['minimum']}")
        if "above" in item.metadata and not value > item.metadata["above"]:
            expected.append(f"> {item.metadata['above']}")
        if "maximum" in item.metadata and not value <= item.metadata["maximum"]:
            expected.append(f"<= {item.metadata['maximum']}")
        if expected:
            errors.append(
                f"--{name} {value}: must be {' and '.join(expected)} ({item.metadata['help']})"
            )
    conflicts = getattr(config, "option_conflicts", None)
    if callable(conflicts):
        errors += list(conflicts())
    return errors


def validate_config(config: Any) -> None:
    """Refuse a config with a number outside the bounds of its :func:`option`.

    :func:`parse_config` calls it on every parsed config (after the task's and ``--quick``'s
    defaults); the scripts' ``main`` calls it too, for configs built in code.

    Raises:
        ValueError: one line per option out of bounds, naming it and its bounds.
    """
    errors = config_errors(config)
    if errors:
        raise ValueError("invalid options:\n  " + "\n  ".join(errors))


def _add_options(
    parser: argparse.ArgumentParser,
    group: Any,
    config_class: type,
    prefix: str,
    quick: Mapping[str, Any],
    exclude: Collection[str],
    task_defaults: Mapping[str, Mapping[str, Any]],
) -> None:
    """Add one option per field of ``config_class`` to ``group``; one more group per nested
    dataclass (argparse shows groups of the parser only, hence both)."""
    hints = typing.get_type_hints(config_class)
    for item in dataclasses.fields(config_class):
        name, kind = f"{prefix}{item.name}", hints[item.name]
        if name in exclude:
            continue
        help_text = item.metadata["help"].replace("%", "%%")
        if dataclasses.is_dataclass(kind):
            nested = parser.add_argument_group(f"--{name}.*", help_text)
            _add_options(parser, nested, kind, f"{name}.", quick, exclude, task_defaults)
            continue
        required = item.default is MISSING and item.default_factory is MISSING
        default = item.default_factory() if item.default_factory is not MISSING else item.default
        shown = "required" if required else f"default: {default}"
        for task, values in task_defaults.items():
            shown += f"; --task {task}: {values[name]}" if name in values else ""
        shown += f"; --quick: {quick[name]}" if name in quick else ""
        extra: dict[str, Any] = {"type": kind, "metavar": kind.__name__.upper()}
        if kind is bool:
            extra = {"action": argparse.BooleanOptionalAction}
        elif typing.get_origin(kind) is Literal:
            choices = typing.get_args(kind)
            extra = {"type": type(choices[0]), "choices": choices}
        elif typing.get_origin(kind) is list:
            (element,) = typing.get_args(kind)
            extra = {"type": element, "nargs": "+", "metavar": element.__name__.upper()}
        group.add_argument(
            f"--{name}",
            default=argparse.SUPPRESS,
            required=required,
            help=f"{help_text} ({shown})",
            **extra,
        )


def parse_config(
    config_class: type[Config],
    argv: Sequence[str] | None = None,
    *,
    description: str | None = None,
    quick: Mapping[str, Any] | None = None,
    task_defaults: Mapping[str, Mapping[str, Any]] | None = None,
    exclude: Collection[str] = (),
) -> Config:
    """The config of one run: ``config_class``'s defaults, then those of the chosen
    ``--task``, then ``--quick``, then ``argv``.

    Args:
        config_class: a dataclass whose fields (nested dataclasses too) are :func:`option`.
        argv: the command line (default: ``sys.argv[1:]``).
        description: what ``--help`` prints first.
        quick: option name (``"epochs"``, ``"pretrain.train_steps"``) -> value of a short run;
            adds ``--quick``, which applies them where the command line names no value.
        task_defaults: task name -> {option name -> value}: the defaults of a task other
            than the config's default one (``--task lift`` applies ``task_defaults["lift"]``).
        exclude: option names left off the command line (they keep their defaults), e.g.
            the nested settings that a script sets itself.
    """
    parser = argparse.ArgumentParser(
        usage="%(prog)s [-h] "
        + ("[--quick] " if quick is not None else "")
        + "[--OPTION VALUE ...]",
        description=description,
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=100),
    )
    if quick is not None:
        parser.add_argument(
            "--quick",
            action="store_true",
            help="a short run of the whole chain (tests, smoke checks): smaller defaults, "
            "shown as '--quick: value'; options given on the command line are kept",
        )
    _add_options(parser, parser, config_class, "", quick or {}, exclude, task_defaults or {})
    typed = vars(parser.parse_args(argv))  # only the options on the command line
    task = typed.get("task", getattr(config_class, "task", None))
    values = {
        **(task_defaults or {}).get(task, {}),
        **(quick if typed.pop("quick", False) else {}),
        **typed,
    }
    config = config_class(**{name: value for name, value in values.items() if "." not in name})
    for name, value in values.items():
        *parents, leaf = name.split(".")
        target = config
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, leaf, value)
    errors = config_errors(config)
    if errors:  # argparse's way: usage, the errors, exit status 2
        parser.error("\n  ".join(["invalid options:", *errors]))
    return config


# ----------------------------------------------------------------------------- task and model
# The registry's task names, as the choices of --task.
TaskName = Literal[tuple(TASKS)]  # type: ignore[valid-type]


@dataclass
class TaskOptions:
    """The task and its settings, shared by every example's config (its first options)."""

    task: TaskName = option(
        "pusher",
        "the task (envs.tasks): " + ", ".join(f"{name}: {t.title}" for name, t in TASKS.items()),
    )
    max_episode_steps: int = option(150, "horizon (env steps)", minimum=1)
    success_threshold: float = option(
        0.05, "pusher: final object-goal distance that counts as success, m", above=0
    )
    reward: Literal["progress", "gymnasium", "success", "shaped"] = option(
        "progress",
        "pusher: potential-based progress or gymnasium's own; lift, can: 1 at success or "
        "robosuite's shaped reward",
    )
    terminate_on_success: bool = option(True, "lift, can: the episode ends at the first success")


def task_options(config: Any) -> dict[str, Any]:
    """The task settings of a config (``config.task`` names the task), as keyword arguments
    of the task's environment factory (:class:`~torchrl_flowpolicy.envs.tasks.Task`)."""
    return get_task(config.task).options(config)


def task_defaults(
    script: Literal["pretrain", "ppo", "dsrl", "evaluate"],
) -> dict[str, dict[str, Any]]:
    """What ``--task NAME`` changes in ``examples/<script>.py``'s config, all read from the
    task's registry entry (:class:`~torchrl_flowpolicy.envs.tasks.Task`): its environment
    options (``defaults``), its demonstrations (``demos``: pretrain's ``demo_*``, the
    ``pretrain.demo_*`` of a fine-tuning run, which pretrains when its checkpoint is
    missing), its default paths (``output_dir``, ``pretrained_checkpoint``) and its
    ``run_defaults[script]``."""
    defaults = {}
    for name, task in TASKS.items():
        demos = {
            "demo_episodes": task.demos.num_episodes,
            "demo_action_noise": task.demos.action_noise,
        }
        if script == "pretrain":
            paths = {"output_dir": task.output_dir("pretrain"), **demos}
        elif script == "evaluate":
            paths = {
                "checkpoints": task.pretrained_checkpoint,
                "output_json": f"{task.output_dir('evaluation')}.json",
            }
        else:
            paths = {
                "output_dir": task.output_dir(script),
                "pretrained_checkpoint": task.pretrained_checkpoint,
                **{f"pretrain.{option}": value for option, value in demos.items()},
            }
        defaults[name] = {**task.defaults, **paths, **task.run_defaults.get(script, {})}
    return defaults


def resolve_device(name: str) -> torch.device:
    """The ``--device`` of a run as a :class:`torch.device`, checked up front.

    ``"cuda"`` becomes the current CUDA device with its index (under ``torchrun``, the
    process's ``LOCAL_RANK`` GPU, which :func:`~torchrl_flowpolicy.distributed.init_distributed`
    selects), so that collector worker processes use the same GPU as their learner.

    Raises:
        ValueError: for a name torch does not know, or a device this machine does not have
            (``--device cuda`` without a CUDA GPU, or a GPU index past the last one).
    """
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"--device {name!r} is not a torch device ({error}).") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {name}: this machine has no CUDA GPU that torch can use "
                "(torch.cuda.is_available() is False); run with --device cpu."
            )
        count = torch.cuda.device_count()
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= count:
            raise ValueError(
                f"--device {name}: this machine has {count} CUDA device(s), cuda:0 to "
                f"cuda:{count - 1}."
            )
        return device
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:
        raise ValueError(f"--device {name}: not usable here ({error}).") from None
    return device


def make_task_env(
    config: Any,
    num_envs: int | None,
    executed_chunk_length: int | None = None,
    *,
    count_steps: bool = False,
    device: torch.device | str | None = None,
    group_size: int = 1,
) -> EnvBase:
    """The environment of ``config.task`` with the config's task settings.

    With ``count_steps``, TorchRL's :class:`~torchrl.envs.StepCounter` runs on every
    environment step (before the chunking): a decision's ``("next", "step_count") -
    "step_count"`` is the number of env steps it executed (:func:`env_steps`). ``device``
    is the TorchRL device of the environment: the simulators run on the CPU, and TorchRL
    moves their tensors there (default: the CPU). ``group_size``: the sub-environments
    that ``env.set_seed`` seeds alike (:class:`~torchrl_flowpolicy.envs.BatchedGymEnv`).
    """
    options = task_options(config)
    make_env = get_task(config.task).make_env
    env = make_env(num_envs, None, device=device, group_size=group_size, **options)
    if count_steps:
        env.append_transform(StepCounter())
    if executed_chunk_length is None:
        return env
    return make_chunked_env(env, executed_chunk_length)


def env_steps(batch: TensorDictBase) -> int:
    """The environment steps a batch of decisions executed (needs :func:`make_task_env`'s
    ``count_steps``)."""
    return int((batch["next", "step_count"] - batch["step_count"]).sum())


def make_eval_env(
    config: Any,
    num_episodes: int,
    executed_chunk_length: int,
    device: torch.device | str | None = None,
) -> EnvBase:
    """The chunked task environment for an evaluation of ``num_episodes`` episodes: one
    sub-environment per episode, or the task's ``max_eval_envs`` (the episodes then run in
    rounds; pass ``num_episodes`` to the evaluation). ``device`` is the evaluated policy's:
    ``env.rollout`` hands the policy the environment's tensors as they are."""
    num_envs = get_task(config.task).eval_envs(num_episodes)
    return make_task_env(config, num_envs, executed_chunk_length, device=device)


def evaluate_task_expert(config: Any, num_episodes: int, seed: int) -> dict[str, Tensor]:
    """The clean scripted expert of ``config.task`` on ``num_episodes`` seeded episodes."""
    return evaluate_expert(num_episodes, seed=seed, task=config.task, **task_options(config))


def decisions_per_episode(max_episode_steps: int, executed_chunk_length: int) -> int:
    """How many decisions cover one episode."""
    return math.ceil(max_episode_steps / executed_chunk_length)


@dataclass
class ModelConfig:
    """The flow policy's architecture (saved with every checkpoint)."""

    chunk_length: int = option(8, "H: rows predicted per decision", minimum=1)
    executed_chunk_length: int = option(
        4, "H': rows executed per decision (closed-loop pushing)", minimum=1
    )
    model_dim: int = option(64, "token width of the action expert and the context", minimum=1)
    num_heads: int = option(4, "attention heads", minimum=1)
    num_layers: int = option(2, "decoder layers of the action expert", minimum=1)
    num_context_tokens: int = option(4, "context tokens computed once per decision", minimum=1)
    # Set from the task by the pretraining (not command-line options).
    observation_dim: int = option(
        23, "size of the task's observation (set from the task)", minimum=1
    )
    action_dim: int = option(7, "size of one action (set from the task)", minimum=1)


# The ModelConfig fields that come from the task, not from the command line.
TASK_MODEL_FIELDS = ("observation_dim", "action_dim")


def build_policy(
    model_config: ModelConfig,
    normalizer: ObservationNormalizer,
    options: SamplerOptions | None = None,
) -> FlowSDEPolicy:
    """The reference transformer action expert with an observation encoder."""
    encoder = nn.Sequential(
        normalizer,
        ObservationEncoder(
            model_config.observation_dim,
            model_dim=model_config.model_dim,
            num_tokens=model_config.num_context_tokens,
        ),
    )
    expert = ActionExpertTransformer(
        (model_config.chunk_length, model_config.action_dim),
        model_dim=model_config.model_dim,
        num_heads=model_config.num_heads,
        num_layers=model_config.num_layers,
    )
    return FlowSDEPolicy(
        expert,
        action_shape=(model_config.chunk_length, model_config.action_dim),
        encoder=encoder,
        executed_chunk_length=model_config.executed_chunk_length,
        options=options,
    )


def build_noise_head(
    model_config: ModelConfig, min_std: float, max_std: float, initial_std: float | None = None
) -> NoiseHead:
    """The learned exploration noise of :func:`build_policy`'s policy: a
    :class:`~torchrl_flowpolicy.networks.NoiseHead` on the encoder's context tokens
    (``num_context_tokens * model_dim`` features), std in ``[min_std, max_std]``."""
    return NoiseHead(
        model_config.num_context_tokens * model_config.model_dim,
        (model_config.chunk_length, model_config.action_dim),
        min_std=min_std,
        max_std=max_std,
        initial_std=initial_std,
    )


# ----------------------------------------------------------------------------- checkpoints
def save_policy(
    path: Path,
    policy: FlowSDEPolicy,
    model_config: ModelConfig,
    *,
    task: Task | None = None,
    **extra,
) -> None:
    """An atomic policy checkpoint: architecture, weights (with normaliser) and ``extra``;
    with ``task``, the task and observation layout it was trained on
    (:meth:`~torchrl_flowpolicy.envs.tasks.Task.checkpoint_identity`)."""
    identity = task.checkpoint_identity() if task is not None else {}
    save_checkpoint(
        {"model_config": asdict(model_config), "policy": policy.state_dict(), **identity, **extra},
        path,
    )


def write_json(path: str | Path, value: Any) -> Path:
    """``value`` as indented JSON at ``path``, atomically: a run killed while writing leaves the
    previous file whole (:func:`~torchrl_flowpolicy.checkpoint.atomic_write`)."""
    return atomic_write(path, lambda file: file.write(json.dumps(value, indent=2).encode()))


def save_figure(figure: Any, path: str | Path) -> Path:
    """A matplotlib figure as a PNG at ``path``, atomically, like :func:`write_json`."""
    return atomic_write(path, lambda file: figure.savefig(file, format="png", dpi=120))


def load_policy(
    path: Path, options: SamplerOptions | None = None, *, task: Task | None = None
) -> tuple[FlowSDEPolicy, ModelConfig, dict]:
    """Rebuild a policy saved by :func:`save_policy` (or :func:`save_run` with a ``"policy"``
    and a ``"model_config"``); returns it, its config and the whole checkpoint.

    A checkpoint whose ``"noise"`` entry is ``{"kind": "learned", "min_std", "max_std"}`` (a
    PPO run with ``--noise learned``) gets its noise head back (:func:`build_noise_head`).
    With ``task``, a checkpoint of another task is refused first, naming both tasks
    (:meth:`~torchrl_flowpolicy.envs.tasks.Task.check_checkpoint`)."""
    state = load_checkpoint(path)
    if task is not None:
        task.check_checkpoint(state, f"the checkpoint at {path}")
    model_config = ModelConfig(**state["model_config"])
    size = model_config.observation_dim
    normalizer = ObservationNormalizer(torch.zeros(size), torch.ones(size))
    policy = build_policy(model_config, normalizer, options)
    noise = state.get("noise", {})
    if noise.get("kind") == "learned":
        policy.noise_head = build_noise_head(model_config, noise["min_std"], noise["max_std"])
    policy.load_state_dict(state["policy"])
    return policy, model_config, state


def seed_random_generators(seed: int) -> None:
    """Seed every random generator of :func:`random_state` (torch's on every device, NumPy's
    global one, Python's ``random``) with ``seed``."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def random_state() -> dict[str, Any]:
    """The state of every random generator a run draws from, as plain tensors and numbers
    (what ``torch.load(weights_only=True)`` reads): torch's CPU generator, the CUDA
    generators once CUDA is in use, NumPy's global generator and Python's ``random``.

    The environments' own generators are not here, nor the simulators' states:
    ``examples/ppo.py`` starts every batch from fresh resets whose seeds depend on the
    iteration alone (:func:`~torchrl_flowpolicy.protocol.training_seed`).
    """
    numpy_state = np.random.get_state(legacy=False)
    version, internal, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": numpy_state["state"]["pos"],
            "has_gauss": numpy_state["has_gauss"],
            "gauss": numpy_state["gauss"],
        },
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_random_state(state: Mapping[str, Any]) -> None:
    """Put every generator of :func:`random_state` back where ``state`` found it (the CUDA
    generators only on a machine with CUDA; a state without them leaves them alone)."""
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        numpy_state = state["numpy"]
        np.random.set_state(
            {
                "bit_generator": "MT19937",
                "state": {
                    "key": numpy_state["key"].numpy().astype(np.uint32),
                    "pos": numpy_state["pos"],
                },
                "has_gauss": numpy_state["has_gauss"],
                "gauss": numpy_state["gauss"],
            }
        )
    if "python" in state:
        python_state = state["python"]
        random.setstate(
            (python_state["version"], tuple(python_state["internal"]), python_state["gauss_next"])
        )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_run(path: Path, trained: Mapping[str, Any], **progress: Any) -> None:
    """An atomic run checkpoint, for ``--resume``.

    Holds ``trained[name].state_dict()`` for every entry (networks, optimisers, loss
    modules), the ``progress`` values as given (counters, history, replay-buffer content:
    what ``torch.load(weights_only=True)`` reads) and, as ``"random_state"``, every random
    generator's state (:func:`random_state`), so that a resumed run continues the random
    streams where they stopped (:func:`restore_random_state`).
    """
    states = {name: item.state_dict() for name, item in trained.items()}
    save_checkpoint({**states, **progress, "random_state": random_state()}, path)


def require_run_checkpoint(path: Path) -> None:
    """Refuse ``--resume`` without a run checkpoint at ``path`` (called before any work).

    Raises:
        FileNotFoundError: naming ``path`` and how to start a new run instead.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"--resume: no run checkpoint at {path} (output_dir/checkpoint.pt) to resume from; "
            "drop --resume to start a new run, or pass the --output_dir of the run to resume."
        )


def _mismatches(saved: Any, expected: Any, name: str) -> list[str]:
    """``name: saved X, this run Y`` for every leaf of ``expected`` that ``saved`` differs in
    (nested dicts compared field by field)."""
    if isinstance(saved, Mapping) and isinstance(expected, Mapping):
        return [
            line
            for key, value in expected.items()
            for line in _mismatches(saved.get(key), value, f"{name}.{key}")
        ]
    return [] if saved == expected else [f"{name}: saved {saved!r}, this run {expected!r}"]


def load_run(
    path: Path, expected: Mapping[str, Any], implied: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Load a :func:`save_run` checkpoint for ``--resume``, refusing that of another run.

    ``expected`` maps checkpoint entries (``"task"``, ``"model_config"``: a dict compared
    field by field) to this run's values. An entry the checkpoint does not hold (one saved
    before it was recorded) is compared with its value in ``implied`` (what every run of
    that time had, e.g. the fixed noise before the learned one existed), and not compared
    when ``implied`` has none.

    Raises:
        FileNotFoundError: no checkpoint at ``path`` (:func:`require_run_checkpoint`).
        ValueError: ``"checkpoint at PATH is corrupt"`` (:func:`~torchrl_flowpolicy.checkpoint.load_checkpoint`),
            or a checkpoint saved with another task or architecture, naming each field that
            differs.
    """
    require_run_checkpoint(path)
    state = load_checkpoint(path)
    implied = implied or {}
    differences = [
        line
        for key, value in expected.items()
        if key in state or key in implied
        for line in _mismatches(state.get(key, implied.get(key)), value, key)
    ]
    if differences:
        raise ValueError(
            f"--resume: the checkpoint at {path} was saved by another run:\n  "
            + "\n  ".join(differences)
            + "\nresume with the settings (and pretrained checkpoint) it was saved with, or "
            "drop --resume and choose another --output_dir to start a new run."
        )
    return state


def resume_run(checkpoint: Path | Mapping[str, Any], trained: Mapping[str, Any]) -> dict[str, Any]:
    """Load a :func:`save_run` checkpoint (a path, or what :func:`load_run` returned) into
    ``trained``.

    The random generators are left alone: pass the returned ``"random_state"`` to
    :func:`restore_random_state` where the uninterrupted run stood when it saved, just
    before the first resumed iteration (after the set-up, whose draws the uninterrupted run
    made before its first iteration). A checkpoint written before ``"random_state"`` existed
    holds torch's state alone (``"rng_state"``); it is returned as ``{"torch": ...}``.

    Returns:
        The ``progress`` values that :func:`save_run` was given, and ``"random_state"``.
    """
    state = dict(checkpoint) if isinstance(checkpoint, Mapping) else load_checkpoint(checkpoint)
    for name, item in trained.items():
        item.load_state_dict(state.pop(name))
    if "rng_state" in state:
        state["random_state"] = {"torch": state.pop("rng_state")}
    return state


# ----------------------------------------------------------------------------- logging
class MetricLogger:
    """TorchRL loggers named in ``names`` ("wandb" runs offline, "csv"), behind one ``log``.

    ``resume_step``: the logged step (env steps) of the checkpoint a resumed run starts
    from. The rows that the CSV logger wrote after it, which the killed run logged after its
    last checkpoint and the resumed run logs again, are removed first
    (:func:`drop_rows_after`), so that the CSV files hold the rows of an uninterrupted run.
    wandb writes a new offline run for the resumed one.
    """

    def __init__(
        self,
        names: str,
        experiment: str,
        output_dir: Path,
        config: Any,
        resume_step: int | None = None,
    ):
        self.loggers = []
        for name in filter(None, names.split(",")):
            if name == "wandb":
                self.loggers.append(
                    WandbLogger(
                        experiment,
                        offline=True,
                        save_dir=str(output_dir),
                        project="torchrl_flowpolicy",
                        config=dataclasses.asdict(config),
                    )
                )
            elif name == "csv":
                directory = output_dir / "csv"
                if resume_step is not None:
                    drop_rows_after(directory / experiment / "scalars", resume_step)
                self.loggers.append(CSVLogger(experiment, log_dir=str(directory)))
            else:
                raise ValueError(f"unknown logger {name!r}: use 'wandb' and/or 'csv'.")

    def log(self, metrics: dict[str, float], step: int) -> None:
        for logger in self.loggers:
            for name, value in metrics.items():
                logger.log_scalar(name, value, step=step)


def drop_rows_after(scalars: Path, step: int) -> list[Path]:
    """Remove the rows logged after ``step`` from the CSV logger's files under ``scalars``.

    Each file holds one ``step,value`` line per logged value. A last line without its line
    break (a write cut short by a kill) is removed too. Files are rewritten atomically.

    Returns:
        The files that changed.
    """
    changed = []
    for path in sorted(Path(scalars).rglob("*.csv")):
        lines = path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if line.endswith("\n") and int(line.split(",")[0]) <= step]
        if kept != lines:
            atomic_write(path, lambda file, kept=kept: file.write("".join(kept).encode()))
            changed.append(path)
    return changed


# ----------------------------------------------------------------------------- protocol
def outcome_summary(outcomes: Mapping[str, Tensor]) -> dict[str, float]:
    """Success rate (with its Wilson 95 % interval), mean return and count of an evaluation."""
    successes, trials = int(outcomes["success"].sum()), outcomes["success"].numel()
    low, high = wilson_interval(successes, trials)
    return {
        "success_rate": successes / trials,
        "success_low": low,
        "success_high": high,
        "mean_return": outcomes["return"].float().mean().item(),
        "num_episodes": trials,
    }


def curve_baselines(
    bc_policy: FlowSDEPolicy, env: EnvBase, max_decisions: int, config: Any
) -> dict[str, dict[str, float]]:
    """The lines of the learning-curve plot, on the curve seeds: BC under both decodings and
    the clean expert (:func:`outcome_summary` each), printed. Leaves torch's RNG alone."""
    options = {"max_decisions": max_decisions, "num_episodes": config.eval_episodes}
    bc = evaluate_decodings(bc_policy, env, seed=CURVE_SEED, **options)
    expert = evaluate_task_expert(config, config.eval_episodes, CURVE_SEED)
    baselines = {
        "BC (sampled)": outcome_summary(bc["sampled"]),
        "BC (noise-free)": outcome_summary(bc["noise_free"]),
        "expert": outcome_summary(expert),
    }
    print(
        "curve seeds: "
        + "; ".join(f"{name} {row['success_rate']:.1%}" for name, row in baselines.items())
    )
    return baselines


def held_out_protocol(
    bc_policy: FlowSDEPolicy,
    rl_policy: TensorDictModuleBase,
    config: Any,
    executed_chunk_length: int,
    rl_env: EnvBase | None = None,
    name: str = "RL",
    device: torch.device | str | None = None,
    env: EnvBase | None = None,
) -> dict[str, Any]:
    """The evaluation protocol on ``config.held_out_episodes`` held-out episodes.

    BC and RL under both decodings (:func:`~torchrl_flowpolicy.evaluation.evaluate_decodings`)
    and the clean expert, all on the same states and the same initial noise;
    :func:`~torchrl_flowpolicy.protocol.protocol_summary` with ``config.reported_decoding``.
    ``rl_env`` is RL's environment with as many sub-environments as :func:`make_eval_env`
    gives (default: the chunked task, as BC's). ``"line"`` holds :func:`~torchrl_flowpolicy.protocol.format_protocol`'s
    sentence about ``name``. ``device``: the policies' device (that of BC's environment).
    ``env``: BC's environment (default: :func:`make_eval_env`'s; one passed here is the
    caller's to close). Leaves torch's RNG alone.
    """
    seed = split_seed("held_out", config.held_out_episodes)
    max_decisions = decisions_per_episode(config.max_episode_steps, executed_chunk_length)
    own_env = env is None
    if env is None:
        env = make_eval_env(config, config.held_out_episodes, executed_chunk_length, device)
    options = {
        "max_decisions": max_decisions,
        "seed": seed,
        "num_episodes": config.held_out_episodes,
    }
    bc = evaluate_decodings(bc_policy, env, **options)
    rl = evaluate_decodings(rl_policy, env if rl_env is None else rl_env, **options)
    if own_env:
        env.close()
    expert = evaluate_task_expert(config, config.held_out_episodes, seed)
    summary = protocol_summary(bc, rl, expert, reported_decoding=config.reported_decoding)
    return {"split": "held_out", "seed": seed, "line": format_protocol(summary, name), **summary}


def plot_success_band(axis: Any, x: Sequence[float], rows: Sequence[Mapping], **style) -> None:
    """A success curve (percent) of evaluation rows with the band of their Wilson intervals."""
    intervals = [
        wilson_interval(round(row["success_rate"] * row["num_episodes"]), row["num_episodes"])
        for row in rows
    ]
    (line,) = axis.plot(x, [100 * row["success_rate"] for row in rows], "o-", **style)
    low, high = zip(*intervals, strict=True)
    axis.fill_between(
        x, [100 * v for v in low], [100 * v for v in high], alpha=0.2, color=line.get_color()
    )


def plot_baselines(axis: Any, baselines: Mapping[str, Mapping[str, float]]) -> None:
    """Each baseline's success as a horizontal line (percent) with its Wilson band."""
    for (label, row), color in zip(
        baselines.items(), ("tab:gray", "tab:olive", "tab:green"), strict=False
    ):
        axis.axhline(100 * row["success_rate"], color=color, linestyle="--", label=label)
        axis.axhspan(100 * row["success_low"], 100 * row["success_high"], color=color, alpha=0.12)
