"""The examples' command line: one config dataclass per script, parsed and checked.

The checks of the settings (their bounds, a fine-tuning run's files and device) are in
``run_settings.py``; everything else the examples share (the run lifecycle, the policy's
checkpoint, the collectors, the logger, the reports) lives in the package:
``torchrl_flowpolicy.training.runs``, ``.models``, ``.collectors``, ``.loggers``, ``.reports``.

**The command line.** Each script's settings are one dataclass whose fields are declared with
:func:`option` (a default and one line of help). :func:`parse_config` turns the dataclass
into an ``argparse`` parser: ``--name`` per field (underscores, as in the field),
``--group.name`` for a field of a nested dataclass, ``--name`` / ``--no-name`` for booleans,
the allowed values of a ``Literal`` type as choices, ``--name A B`` for a ``list``; a field
without a default is a required option. ``--help`` prints every field's help text and
default. A script that passes ``quick=`` also gets ``--quick``: its values replace
the defaults, and options typed on the command line win over them. A number's bounds
(``option(..., minimum=1)``) are checked on the resulting config, before any work
(``run_settings.config_errors``): a value out of bounds exits with argparse's error naming
the option. So does an option given a value other than its default without the setting it
``requires`` (``option(..., requires=("noise", "learned"))``), and options that contradict
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
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import MISSING, dataclass
from typing import Any, Literal, TypeVar

from torchrl_flowpolicy.tasks import TASKS

from run_settings import config_errors, quick_path

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
    (``--help`` says so), which :func:`run_settings.validate_config` checks."""
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


# The path options that --quick moves under run_settings.QUICK_FOLDER when the command line
# names none.
_QUICK_PATH_OPTIONS = ("output_dir", "pretrained_checkpoint")


def _quick_paths(
    config_class: type, values: Mapping[str, Any], typed: Mapping[str, Any]
) -> dict[str, Any]:
    """``--quick``'s paths: each default of :data:`_QUICK_PATH_OPTIONS` under
    :data:`run_settings.QUICK_FOLDER`; a quick run in the quick folder replaces an earlier
    quick run's results (``overwrite``) unless it resumes one. Paths on the command line are
    kept."""
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
    ``--task``, then ``--quick`` (its default paths under :data:`run_settings.QUICK_FOLDER`),
    then ``argv``.

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
        "the task (tasks.registry): "
        + ", ".join(f"{name}: {t.title}" for name, t in TASKS.items()),
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
