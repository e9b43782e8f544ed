"""The examples' command line: one config dataclass per script, parsed and checked.

Everything else the examples share (the run lifecycle, the policy's checkpoint, the
collectors, the logger, the reports) lives in the package: ``torchrl_flowpolicy.runs``,
``.models``, ``.collectors``, ``.loggers``, ``.reports``.

**The command line.** Each script's settings are one dataclass whose fields are declared with
:func:`option` (a default and one line of help). :func:`parse_config` turns the dataclass
into an ``argparse`` parser: ``--name`` per field (underscores, as in the field),
``--group.name`` for a field of a nested dataclass, ``--name`` / ``--no-name`` for booleans,
the allowed values of a ``Literal`` type as choices, ``--name A B`` for a ``list``; a field
without a default is a required option. ``--help`` prints every field's help text and
default. A script that passes ``quick=`` also gets ``--quick``: its values replace
the defaults, and options typed on the command line win over them. A number's bounds
(``option(..., minimum=1)``) are checked on the resulting config, before any work: a value
out of bounds exits with argparse's error naming the option. So does an option given a
value other than its default without the setting it ``requires``
(``option(..., requires=("noise", "learned"))``), and options that contradict each other,
which a config lists in its ``option_conflicts()`` method (e.g. ``--num_envs`` not a
multiple of ``--group_size``).

Why this small builder rather than ``tyro``: tyro would read the same dataclasses, but
adds a dependency whose defaults (kebab-case flags, its own boolean and nested-option
spelling) must be turned off to keep the flags above, and ``--quick`` (defaults that never
override typed options) needs the same pre-parse either way. Plain ``argparse`` is what
every reader already knows.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

from torchrl_flowpolicy import run_checks, runs
from torchrl_flowpolicy.envs import TASKS, get_task
from torchrl_flowpolicy.sampler import check_options
from torchrl_flowpolicy.sampler_options import SamplerOptions

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
    requires: tuple[str, Any] | None = None,
) -> Any:
    """A config field: its default (or ``default_factory``), the line ``--help`` prints,
    the bounds of a number (``minimum <= value``, ``above < value``, ``value <= maximum``)
    and the ``(option, value)`` it ``requires`` to be given another value than its default
    (``--help`` says so), which :func:`validate_config` checks."""
    if not help:
        raise ValueError("every option needs a help text.")
    if requires is not None:
        help = f"{help} (only with --{requires[0]} {requires[1]})"
    bounds = {"minimum": minimum, "above": above, "maximum": maximum, "requires": requires}
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
    too; NaN is outside any bound), one line per setting that options given without it
    require, naming them, then the lines of the config's ``option_conflicts()`` method, if
    it has one (options that contradict each other, each line naming them)."""
    errors, unmet = [], {}
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
        required = item.metadata.get("requires")
        if required and value != item.default and getattr(config, required[0]) != required[1]:
            unmet.setdefault(required, []).append(f"--{name} {value}")
    for (required, wanted), given in unmet.items():
        errors.append(f"{' '.join(given)}: only with --{required} {wanted}")
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


def warn_config(config: Any) -> None:
    """Warn (``UserWarning``), before any work, about each line of the config's
    ``option_warnings()`` method, if it has one: settings that are valid but in which the
    run cannot learn (an objective that stays 0, an actor never updated)."""
    for line in getattr(config, "option_warnings", list)():
        warnings.warn(line, UserWarning, stacklevel=3)


def split_list(text: str, option: str, kind: Callable[[str], Any] = str) -> list[Any]:
    """The comma-separated values of a list option (``"1.0,0.0"``), each converted by
    ``kind``; empty items are dropped.

    Raises:
        ValueError: naming ``option`` and the item that ``kind`` refuses.
    """
    values = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            values.append(kind(item))
        except ValueError:
            raise ValueError(
                f"{option} {text!r}: {item!r} is not a {getattr(kind, '__name__', kind)}."
            ) from None
    return values


# The TorchRL loggers a run may name in --loggers (torchrl_flowpolicy.loggers.MetricLogger).
LOGGERS = ("wandb", "csv")

# What a fine-tuning run writes into its --output_dir besides its logs.
RUN_FILES = (*run_checks.RUN_RESULTS, "learning_curve.png")


def check_pretrained_checkpoint(config: Any) -> None:
    """Refuse, before any work, a fine-tuning run's ``--pretrained_checkpoint`` that it could
    not read, or that its pretraining would write over another run's results.

    A missing checkpoint is pretrained (``examples/pretrain.py``) only at the task's default
    path or with ``--pretrain_if_missing``: a misspelled path is an error, not a fresh start.

    Raises:
        IsADirectoryError: the path is a folder.
        FileNotFoundError: a missing checkpoint that is not pretrained here (or that a
            ``--resume`` needs: the run started from it).
        ValueError: the run's own outputs include it, or its pretraining would write into
            the run's ``--output_dir``.
        FileExistsError: its pretraining would replace another pretraining's summary.
    """
    path, output_dir = Path(config.pretrained_checkpoint), Path(config.output_dir)
    written = {"--output_dir": [output_dir / name for name in RUN_FILES]}
    run_checks.check_not_an_input(written, {"--pretrained_checkpoint": [path]})
    if path.is_dir() or path.is_file() or config.resume:
        hint = "the run to resume started from it: give the checkpoint it was started with."
        run_checks.check_input_file(path, "--pretrained_checkpoint", hint)
        return
    default = get_task(config.task).pretrained_checkpoint
    defaults = (Path(default), Path(quick_path(default)))  # --quick's own (parse_config)
    if not config.pretrain_if_missing and path not in defaults:
        raise FileNotFoundError(
            f"--pretrained_checkpoint {path}: no such file. Only the task's default "
            f"({default}) is pretrained when missing: fix the path, or pass "
            "--pretrain_if_missing to pretrain a policy there first."
        )
    if path.parent.resolve() == output_dir.resolve():
        raise ValueError(
            f"--pretrained_checkpoint {path}: its pretraining would write its summary.json into "
            f"--output_dir {output_dir}, where this run writes its own; put it in another folder."
        )
    run_checks.check_output_dir(
        path.parent,
        (path.name, "summary.json"),
        resume=False,
        overwrite=config.overwrite,
        option="the pretraining's folder (--pretrained_checkpoint's)",
        resumable=False,
    )


def check_run_config(config: Any) -> torch.device:
    """Refuse, before any work, a fine-tuning config (``examples/ppo.py``, ``dsrl.py``) that
    the run could not carry out, and warn about settings in which it cannot learn
    (:func:`warn_config`); returns the run's device.

    Raises:
        ValueError: options out of bounds or contradicting each other
            (:func:`validate_config`), ``--sampler.*`` settings the sampler refuses
            (:func:`~torchrl_flowpolicy.sampler.check_options`), an unavailable ``--device``,
            a ``--loggers`` name that is not a logger.
        FileNotFoundError: ``--resume`` without a checkpoint in ``output_dir``; a missing
            ``--pretrained_checkpoint`` (:func:`check_pretrained_checkpoint`).
        FileExistsError: an ``output_dir`` that holds a run's results, without ``--resume``
            or ``--overwrite`` (:func:`~torchrl_flowpolicy.run_checks.check_output_dir`).
    """
    validate_config(config)
    if isinstance(getattr(config, "sampler", None), SamplerOptions):
        check_options(config.sampler, "--sampler.*")
    device = runs.resolve_device(config.device)
    unknown = [name for name in split_list(config.loggers, "--loggers") if name not in LOGGERS]
    if unknown:
        raise ValueError(f"--loggers {config.loggers}: {unknown} not among {list(LOGGERS)}.")
    if config.resume:
        runs.require_run_checkpoint(Path(config.output_dir) / "checkpoint.pt")
    run_checks.check_output_dir(config.output_dir, resume=config.resume, overwrite=config.overwrite)
    check_pretrained_checkpoint(config)
    warn_config(config)
    return device


def _add_options(
    parser: argparse.ArgumentParser,
    group: Any,
    config_class: type,
    prefix: str,
    quick: Mapping[str, Any],
    exclude: Collection[str],
    task_defaults: Mapping[str, Mapping[str, Any]],
    defaults: Any = None,
) -> None:
    """Add one option per field of ``config_class`` to ``group``; one more group per nested
    dataclass (argparse shows groups of the parser only, hence both). ``defaults``: the
    nested dataclass's default value, whose fields are the defaults shown."""
    hints = typing.get_type_hints(config_class)
    for item in dataclasses.fields(config_class):
        name, kind = f"{prefix}{item.name}", hints[item.name]
        if name in exclude:
            continue
        help_text = item.metadata["help"].replace("%", "%%")
        if dataclasses.is_dataclass(kind):
            nested = parser.add_argument_group(f"--{name}.*", help_text)
            value = item.default_factory() if item.default_factory is not MISSING else item.default
            _add_options(parser, nested, kind, f"{name}.", quick, exclude, task_defaults, value)
            continue
        required = item.default is MISSING and item.default_factory is MISSING
        default = item.default_factory() if item.default_factory is not MISSING else item.default
        if defaults is not None:
            default = getattr(defaults, item.name)
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


def _with_option(config: Any, name: str, value: Any) -> Any:
    """``config`` with its (nested) option ``name`` (``"sampler.noise_level"``) set to
    ``value``; a frozen dataclass (``SamplerOptions``) is replaced, not changed."""
    head, _, rest = name.partition(".")
    value = _with_option(getattr(config, head), rest, value) if rest else value
    if config.__dataclass_params__.frozen:
        return dataclasses.replace(config, **{head: value})
    setattr(config, head, value)
    return config


#: Where ``--quick`` puts a script's default outputs and pretrained start.
QUICK_FOLDER = "outputs/quick"
# The path options that --quick moves under QUICK_FOLDER when the command line names none.
_QUICK_PATH_OPTIONS = ("output_dir", "pretrained_checkpoint")


def quick_path(path: str) -> str:
    """A default path of a full run as ``--quick`` uses it, under :data:`QUICK_FOLDER`: a
    quick run never writes over a full run's results, nor starts a full run from its short
    pretraining.

    Example:
        >>> quick_path("outputs/pretrain_lift/policy.pt")
        'outputs/quick/pretrain_lift/policy.pt'
    """
    parts = Path(path).parts
    return str(Path(QUICK_FOLDER, *(parts[1:] if parts[:1] == ("outputs",) else parts)))


def _quick_paths(
    config_class: type, values: Mapping[str, Any], typed: Mapping[str, Any]
) -> dict[str, Any]:
    """``--quick``'s paths: each default of :data:`_QUICK_PATH_OPTIONS` under
    :data:`QUICK_FOLDER`; a quick run in the quick folder replaces an earlier quick run's
    results (``overwrite``) unless it resumes one. Paths on the command line are kept."""
    fields = {field.name: field for field in dataclasses.fields(config_class)}
    moved = {}
    for name in _QUICK_PATH_OPTIONS:
        if name in fields and name not in typed:
            moved[name] = quick_path(values.get(name, fields[name].default))
    if "output_dir" in moved and "overwrite" in fields and "overwrite" not in typed:
        moved["overwrite"] = not values.get("resume", False)
    return moved


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
    ``--task``, then ``--quick`` (its default paths under :data:`QUICK_FOLDER`), then
    ``argv``.

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
    is_quick = typed.pop("quick", False)
    values = {
        **(task_defaults or {}).get(task, {}),
        **(quick if is_quick else {}),
        **typed,
    }
    if is_quick:
        values.update(_quick_paths(config_class, values, typed))
    config = config_class(**{name: value for name, value in values.items() if "." not in name})
    for name, value in values.items():
        if "." in name:
            config = _with_option(config, name, value)
    errors = config_errors(config)
    if errors:  # argparse's way: usage, the errors, exit status 2
        parser.error("\n  ".join(["invalid options:", *errors]))
    return config


# ----------------------------------------------------------------------------- task
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
        "pusher: potential-based progress or gymnasium's own; lift, can, square: 1 at success or "
        "robosuite's shaped reward",
    )
    terminate_on_success: bool = option(
        True, "lift, can, square: the episode ends at the first success"
    )
