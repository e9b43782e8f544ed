"""The reference flow policy of the tasks and its checkpoint.

:class:`ModelConfig` is the architecture (the reference transformer action expert of
:mod:`~torchrl_flowpolicy.networks` with an observation encoder), :func:`build_policy` makes
the :class:`~torchrl_flowpolicy.FlowSDEPolicy` from it and a
:class:`~torchrl_flowpolicy.sampler.SamplerOptions`. :func:`save_policy` writes a policy
checkpoint that holds everything needed to rebuild the policy: the architecture, the
weights (observation normaliser included), the sampler settings, the task and the
observation layout; :func:`save_policy_run` writes a fine-tuning run's checkpoint with the
same record beside the run's own state. :func:`load_policy` reads either back::

    from torchrl_flowpolicy import load_policy

    policy = load_policy("outputs/pretrain/policy.pt")  # with its saved sampler settings

A checkpoint saved before the sampler settings were recorded loads with the
``SamplerOptions()`` defaults (what every loader used then), with a warning saying so;
pass ``sampler=`` to choose them.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> import torch
    >>> from torchrl_flowpolicy.networks import ObservationNormalizer
    >>> from torchrl_flowpolicy.sampler import SamplerOptions
    >>> config = ModelConfig(model_dim=16, num_heads=2, num_layers=1)
    >>> normalizer = ObservationNormalizer(torch.zeros(23), torch.ones(23))
    >>> policy = build_policy(config, normalizer, SamplerOptions(num_denoising_steps=4))
    >>> path = Path(tempfile.mkdtemp()) / "policy.pt"
    >>> save_policy(path, policy, config, task="pusher")
    >>> load_policy(path).num_denoising_steps
    4
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tensordict.nn import TensorDictModule
from torch import nn

from torchrl_flowpolicy.networks import (
    ActionExpertTransformer,
    NoiseHead,
    ObservationEncoder,
    ObservationNormalizer,
)
from torchrl_flowpolicy.policy import FlowSDEPolicy
from torchrl_flowpolicy.sampler import SamplerOptions
from torchrl_flowpolicy.training.checkpoint import load_checkpoint, save_checkpoint
from torchrl_flowpolicy.training.runs import save_run

__all__ = [
    "ModelConfig",
    "TASK_MODEL_FIELDS",
    "build_policy",
    "build_noise_head",
    "build_value_network",
    "save_policy",
    "save_policy_run",
    "load_policy",
    "load_policy_checkpoint",
    "SavedPolicy",
    "policy_record",
    "noise_record",
    "checkpoint_contents",
]


def _field(default: int, help: str) -> Any:
    """A positive integer field with its ``--help`` line (``metadata``: ``"help"``,
    ``"minimum"``, as the examples' command line reads them)."""
    return dataclasses.field(default=default, metadata={"help": help, "minimum": 1})


@dataclass
class ModelConfig:
    """The reference flow policy's architecture (saved with every checkpoint).

    Each field's metadata holds its help line and its lower bound (``"help"``,
    ``"minimum"``), which the examples' command line shows and checks.
    """

    chunk_length: int = _field(8, "H: rows predicted per decision")
    executed_chunk_length: int = _field(4, "H': rows executed per decision (closed-loop pushing)")
    model_dim: int = _field(64, "token width of the action expert and the context")
    num_heads: int = _field(4, "attention heads")
    num_layers: int = _field(2, "decoder layers of the action expert")
    num_context_tokens: int = _field(4, "context tokens computed once per decision")
    # Set from the task by the pretraining (not command-line options).
    observation_dim: int = _field(23, "size of the task's observation (set from the task)")
    action_dim: int = _field(7, "size of one action (set from the task)")


# The ModelConfig fields that come from the task, not from the command line.
TASK_MODEL_FIELDS = ("observation_dim", "action_dim")


def build_policy(
    model_config: ModelConfig,
    normalizer: ObservationNormalizer,
    sampler: SamplerOptions | None = None,
) -> FlowSDEPolicy:
    """The reference transformer action expert with an observation encoder (``normalizer``
    first), sampling with ``sampler`` (default: ``SamplerOptions()``)."""
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
        options=sampler,
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


def build_value_network(policy: FlowSDEPolicy, hidden_dim: int = 256) -> TensorDictModule:
    """The reference critic of :func:`build_policy`'s policy: a copy of its observation
    normaliser, then a two-layer tanh MLP of ``hidden_dim`` units, reading ``"observation"``
    and writing ``"state_value"``, on the policy's device."""
    normalizer = copy.deepcopy(policy.encoder[0])
    size = normalizer.loc.numel()
    network = nn.Sequential(
        normalizer,
        nn.Linear(size, hidden_dim),
        nn.Tanh(),
        nn.Linear(hidden_dim, hidden_dim),
        nn.Tanh(),
        nn.Linear(hidden_dim, 1),
    )
    critic = TensorDictModule(network, in_keys=["observation"], out_keys=["state_value"])
    return critic.to(normalizer.loc.device)


def noise_record(policy: FlowSDEPolicy) -> dict[str, Any]:
    """The policy's exploration noise as a checkpoint records it: ``{"kind": "fixed"}``, or
    ``{"kind": "learned", "min_std", "max_std"}`` with a noise head (rebuilt on load)."""
    head = policy.noise_head
    if head is None:
        return {"kind": "fixed"}
    return {"kind": "learned", "min_std": head.min_std, "max_std": head.max_std}


def policy_record(
    policy: FlowSDEPolicy, model_config: ModelConfig, task: str | None = None
) -> dict[str, Any]:
    """What a checkpoint records beside the weights (``"policy"``) to rebuild ``policy``
    (:func:`load_policy`): the architecture, the sampler settings, the exploration noise, the
    observation layout and (with ``task``) the task it was trained on."""
    keys = [key if isinstance(key, str) else list(key) for key in policy.in_keys]
    record = {
        "model_config": asdict(model_config),
        "sampler": policy.options.to_dict(),
        "noise": noise_record(policy),
        # The entries the policy reads and the observation size (Task.checkpoint_identity).
        "observation": {
            "key": keys[0] if len(keys) == 1 else keys,
            "dim": model_config.observation_dim,
        },
    }
    return record if task is None else {**record, "task": task}


def save_policy(
    path: str | Path,
    policy: FlowSDEPolicy,
    model_config: ModelConfig,
    *,
    task: str | None = None,
    **extra: Any,
) -> None:
    """An atomic policy checkpoint: the weights (``"policy"``), :func:`policy_record` and the
    ``extra`` entries."""
    record = policy_record(policy, model_config, task)
    save_checkpoint({**record, "policy": policy.state_dict(), **extra}, path)


def save_policy_run(
    path: str | Path,
    trained: Mapping[str, Any],
    policy: FlowSDEPolicy,
    model_config: ModelConfig,
    *,
    task: str,
    **progress: Any,
) -> None:
    """A run checkpoint (:func:`~torchrl_flowpolicy.training.runs.save_run`: the state dicts of
    ``trained``, ``"policy"`` among them, the ``progress`` entries, the random generators)
    that also holds :func:`policy_record`, with which :func:`load_policy` rebuilds the
    fine-tuned policy (learned noise head included) and ``runs.load_run`` checks the
    run's identity (task, architecture, noise)."""
    save_run(path, trained, **progress, **policy_record(policy, model_config, task))


class SavedPolicy(NamedTuple):
    """A policy checkpoint, rebuilt (:func:`load_policy_checkpoint`)."""

    policy: FlowSDEPolicy
    model_config: ModelConfig
    sampler: SamplerOptions
    checkpoint: dict[str, Any]


def load_policy_checkpoint(
    path: str | Path, *, sampler: SamplerOptions | None = None, task: str | None = None
) -> SavedPolicy:
    """Rebuild the policy saved by :func:`save_policy` (or by a run checkpoint holding its
    weights as ``"policy"`` and a :func:`policy_record`), with its config and checkpoint.

    Args:
        path: the checkpoint.
        sampler: the sampler settings to use instead of the saved ones. A checkpoint saved
            before they were recorded gets ``SamplerOptions()`` unless this is given (with
            a warning).
        task: the task the policy must have been trained on (checked when given).

    Raises:
        ValueError: ``task`` differs from the checkpoint's (naming both), a file that holds
            no flow policy (a DSRL run's checkpoint, demonstrations: naming the file and
            what it holds, :func:`checkpoint_contents`), or a corrupt file.
    """
    state = load_checkpoint(path)
    if not isinstance(state, Mapping) or not {"policy", "model_config"} <= set(state):
        raise ValueError(
            f"the checkpoint at {path} holds {checkpoint_contents(state)}, not a flow policy "
            '(its weights, "policy", and architecture, "model_config", as save_policy, '
            "examples/pretrain.py's policy.pt and examples/ppo.py's checkpoint.pt hold them)."
        )
    if task is not None:
        from torchrl_flowpolicy.tasks.registry import get_task  # the task registry, only when asked

        get_task(task).check_checkpoint(state, f"the checkpoint at {path}")
    model_config = ModelConfig(**state["model_config"])
    if sampler is None and "sampler" in state:
        sampler = SamplerOptions.from_dict(state["sampler"])
    elif sampler is None:
        warnings.warn(
            f"the policy checkpoint at {path} holds no sampler settings (it was saved before "
            "they were recorded): the policy samples with the SamplerOptions() defaults; pass "
            "sampler=SamplerOptions(...) to choose them.",
            stacklevel=2,
        )
        sampler = SamplerOptions()
    size = model_config.observation_dim
    normalizer = ObservationNormalizer(torch.zeros(size), torch.ones(size))
    policy = build_policy(model_config, normalizer, sampler)
    noise = state.get("noise", {})
    if noise.get("kind") == "learned":
        policy.noise_head = build_noise_head(model_config, noise["min_std"], noise["max_std"])
    policy.load_state_dict(state["policy"])
    return SavedPolicy(policy, model_config, sampler, state)


def checkpoint_contents(state: Any) -> str:
    """What a loaded checkpoint holds, in words, for an error about a file of another kind.

    Example:
        >>> checkpoint_contents({"loss_module": {}, "replay_buffer": {}, "task": "pusher"})
        "a DSRL run's checkpoint (examples/dsrl.py: SAC's noise actor and critics, its replay buffer)"
    """
    if not isinstance(state, Mapping):
        return f"a {type(state).__name__}"
    keys = set(state)
    if "loss_module" in keys:
        return (
            "a DSRL run's checkpoint (examples/dsrl.py: SAC's noise actor and critics, its "
            "replay buffer)"
        )
    if {"observation", "action", "episode"} <= keys:
        return "demonstrations (observations, actions and episodes of a scripted expert)"
    names = sorted(map(str, keys))
    return "the entries " + ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")


def load_policy(
    path: str | Path, *, sampler: SamplerOptions | None = None, task: str | None = None
) -> FlowSDEPolicy:
    """The policy saved at ``path``, with its saved sampler settings (or ``sampler``); see
    :func:`load_policy_checkpoint`."""
    return load_policy_checkpoint(path, sampler=sampler, task=task).policy
