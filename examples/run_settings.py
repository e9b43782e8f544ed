"""The examples' checks of their settings, before any work.

- :func:`config_errors` / :func:`validate_config`: every config's numbers outside the
  bounds of their :func:`~common.option`, options given without the setting they require,
  and the config's own ``option_conflicts()``; :func:`~common.parse_config` exits with them
  (status 2), a script's ``main`` raises ``ValueError``.
- :func:`check_run_config`: what a fine-tuning run (``examples/ppo.py``,
  ``examples/dsrl.py``) refuses before any work (its device, loggers, output folder and
  pretrained start), then the ``UserWarning`` of its ``option_warnings()``
  (:func:`warn_config`).
- The fine-tuning configs' ``option_conflicts()`` (options that contradict each other) and
  ``option_warnings()`` (valid settings in which the actor cannot learn): each returns one
  line per problem, naming the options. :func:`start_noise_head` is what a PPO run does
  with a pretrained checkpoint that holds a learned noise head.
- :func:`quick_path`: where ``--quick`` puts a default path, so that a quick run never
  writes over a full run's results.

Example:
    >>> from types import SimpleNamespace
    >>> resume_or_overwrite(SimpleNamespace(resume=True, overwrite=True))
    ['--resume --overwrite: continue the run in output_dir, or replace it; not both']
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import torch

from torchrl_flowpolicy import FlowSDEPolicy
from torchrl_flowpolicy.sampler import check_options
from torchrl_flowpolicy.sampler_options import SamplerOptions
from torchrl_flowpolicy.tasks import get_task
from torchrl_flowpolicy.training import run_checks, runs
from torchrl_flowpolicy.training.checkpoint import load_checkpoint
from torchrl_flowpolicy.training.loggers import LOGGERS, unknown_loggers


# ----------------------------------------------------------------------------- every config
def config_errors(config: Any, prefix: str = "") -> list[str]:
    """What is wrong with ``config``'s options: one line per value outside the bounds of its
    :func:`~common.option`, naming the option as the command line spells it (nested dataclasses
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
    """Refuse a config with a number outside the bounds of its :func:`~common.option`.

    :func:`~common.parse_config` calls it on every parsed config (after the task's and ``--quick``'s
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


# ----------------------------------------------------------------------------- paths
#: Where ``--quick`` puts a script's default outputs and pretrained start.
QUICK_FOLDER = "outputs/quick"


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


# ----------------------------------------------------------------------------- fine-tuning runs
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
    defaults = (Path(default), Path(quick_path(default)))  # --quick's own (common.parse_config)
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
            or ``--overwrite`` (:func:`~torchrl_flowpolicy.training.run_checks.check_output_dir`).
    """
    validate_config(config)
    if isinstance(getattr(config, "sampler", None), SamplerOptions):
        check_options(config.sampler, "--sampler.*")
    device = runs.resolve_device(config.device)
    unknown = unknown_loggers(config.loggers)
    if unknown:
        raise ValueError(f"--loggers {config.loggers}: {unknown} not among {list(LOGGERS)}.")
    if config.resume:
        runs.require_run_checkpoint(Path(config.output_dir) / "checkpoint.pt")
    run_checks.check_output_dir(config.output_dir, resume=config.resume, overwrite=config.overwrite)
    check_pretrained_checkpoint(config)
    warn_config(config)
    return device


# ----------------------------------------------------------------------------- conflicts, warnings
def resume_or_overwrite(config: Any) -> list[str]:
    """``--resume`` and ``--overwrite`` together: continue a run or replace it, not both."""
    if config.resume and config.overwrite:
        return ["--resume --overwrite: continue the run in output_dir, or replace it; not both"]
    return []


def ppo_conflicts(config: Any) -> list[str]:
    """The options of ``examples/ppo.py`` that contradict each other."""
    fixed, grpo = config.noise == "fixed", config.advantage == "grpo"
    bounds = (config.min_noise_std, config.initial_noise_std, config.max_noise_std)
    workers = f"--collector_workers {config.collector_workers} --collector_backend "
    rules = [
        (
            not fixed and not bounds[0] < bounds[1] < bounds[2],
            "--noise learned needs --min_noise_std < --initial_noise_std < --max_noise_std, "
            "got {} < {} < {}: the std starts strictly inside its bounds".format(*bounds),
        ),
        (
            fixed and config.entropy_coeff > 0,
            f"--entropy_coeff {config.entropy_coeff}: needs --noise learned "
            "(the fixed schedule's entropy has no gradient)",
        ),
        (
            config.num_envs % config.collector_workers,
            f"--num_envs {config.num_envs}: must be a multiple of --collector_workers "
            f"{config.collector_workers} (envs per worker)",
        ),
        (
            grpo and config.num_envs % config.group_size,
            f"--num_envs {config.num_envs}: must be a multiple of --group_size "
            f"{config.group_size} with --advantage grpo",
        ),
        (
            grpo and config.episodes_per_batch != 1,
            f"--episodes_per_batch {config.episodes_per_batch}: must be 1 with --advantage "
            "grpo (one episode per env)",
        ),
        (
            grpo and (config.collector_workers != 1 or config.collector_backend != "process"),
            f"{workers}{config.collector_backend}: must be 1 and process with --advantage grpo "
            "(the groups are reseeded from this process)",
        ),
    ]
    return resume_or_overwrite(config) + [message for broken, message in rules if broken]


def ppo_warnings(config: Any) -> list[str]:
    """Valid settings of ``examples/ppo.py`` in which the actor cannot learn."""
    per_batch = config.num_envs * config.episodes_per_batch * config.max_episode_steps
    iterations = -(-config.total_env_steps // per_batch)
    rules = [
        (
            config.noise == "fixed" and config.sampler.noise_level == 0,
            "--sampler.noise_level 0: the fixed noise makes no denoising step stochastic; "
            "every rollout is the ODE's, its log-probabilities are constant and the PPO "
            "objective stays 0 (only --bc_coeff and --kl_coeff move the actor)",
        ),
        (
            config.advantage == "gae" and config.critic_warmup_iterations >= iterations,
            f"--critic_warmup_iterations {config.critic_warmup_iterations}: a run of "
            f"full-length episodes makes {iterations} iteration(s) (--total_env_steps "
            f"{config.total_env_steps} / {per_batch} per batch), all of them the critic's "
            "warm-up: the actor is never updated",
        ),
    ]
    return [message for broken, message in rules if broken]


def planned_executed_chunk_length(config: Any) -> int:
    """``H'`` of a run's policy: the pretrained checkpoint's, or that of the pretraining
    that will make it."""
    path = Path(config.pretrained_checkpoint)
    if path.is_file():
        try:
            return load_checkpoint(path)["model_config"]["executed_chunk_length"]
        except (KeyError, TypeError, ValueError):
            pass  # not a policy checkpoint: loading it says so
    return config.pretrain.model.executed_chunk_length


def dsrl_warnings(config: Any) -> list[str]:
    """Valid settings of ``examples/dsrl.py`` in which SAC cannot learn."""
    if config.random_env_steps >= config.total_env_steps:
        return [
            f"--random_env_steps {config.random_env_steps}: not below --total_env_steps "
            f"{config.total_env_steps}; every step acts with uniform noise and no SAC update "
            "is made: the actor stays at its start"
        ]
    executed = planned_executed_chunk_length(config)
    decisions = config.total_env_steps // executed
    first = max(config.random_env_steps // executed, config.batch_size)  # updates start there
    updates = int(config.utd_ratio * max(decisions - first, 0))
    if config.critic_warmup_updates >= updates:
        return [
            f"--critic_warmup_updates {config.critic_warmup_updates}: the run makes about "
            f"{updates} SAC updates ({decisions} decisions of {executed} steps, from the "
            f"{first}th on, --utd_ratio {config.utd_ratio}), all of them the critics' "
            "warm-up: the actor is never updated"
        ]
    return []


def start_noise_head(policy: FlowSDEPolicy, config: Any) -> None:
    """Drop the noise head of a pretrained checkpoint that has one (a ``--noise learned``
    run's policy taken as a start), saying so: ``--noise fixed`` explores with the fixed
    Flow-SDE noise (as its summary says), ``--noise learned`` with a fresh head."""
    if policy.noise_head is None:
        return
    kept = (
        "this --noise fixed run explores with the fixed Flow-SDE noise (--sampler.noise_level)"
        if config.noise == "fixed"
        else "this --noise learned run trains a fresh head (--initial_noise_std)"
    )
    warnings.warn(
        f"--pretrained_checkpoint {config.pretrained_checkpoint} holds a learned noise head "
        f"(a --noise learned run's policy); its flow is the start, its noise head is dropped: "
        f"{kept}.",
        UserWarning,
        stacklevel=2,
    )
    policy.noise_head = None
