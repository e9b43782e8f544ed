"""The fine-tuning examples' checks of their settings, before any work.

``examples/ppo.py`` and ``examples/dsrl.py`` call these from their configs'
``option_conflicts()`` (options that contradict each other: exit 2 on the command line,
``ValueError`` in ``main``) and ``option_warnings()`` (valid settings in which the actor
cannot learn: a ``UserWarning`` before any work; ``common.check_run_config``). Each returns
one line per problem, naming the options. :func:`start_noise_head` is what a PPO run does
with a pretrained checkpoint that holds a learned noise head.

Example:
    >>> from types import SimpleNamespace
    >>> resume_or_overwrite(SimpleNamespace(resume=True, overwrite=True))
    ['--resume --overwrite: continue the run in output_dir, or replace it; not both']
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from torchrl_flowpolicy import FlowSDEPolicy
from torchrl_flowpolicy.checkpoint import load_checkpoint


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
