"""What the Pusher-v5 examples share: the model, its checkpoint format and the evaluation env.

Kept small on purpose: every example script still reads top to bottom; this module only
spares them from defining the same network twice.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchrl.envs import TransformedEnv
from torchrl.record.loggers import CSVLogger, WandbLogger

from torchrl_flowpolicy import FlowSDEPolicy
from torchrl_flowpolicy.checkpoint import load_checkpoint, save_checkpoint
from torchrl_flowpolicy.envs.batched import BatchedGymEnv
from torchrl_flowpolicy.envs.chunking import make_chunked_env
from torchrl_flowpolicy.envs.pusher import PUSHER_ENV_ID, PusherTask
from torchrl_flowpolicy.networks import (
    ActionExpertTransformer,
    ObservationEncoder,
    ObservationNormalizer,
)

OBSERVATION_DIM = 23
ACTION_DIM = 7


@dataclass
class ModelConfig:
    """The flow policy's architecture (saved with every checkpoint)."""

    chunk_length: int = 8  # H: rows predicted per decision
    executed_chunk_length: int = 4  # H': rows executed per decision (closed-loop pushing)
    model_dim: int = 64  # token width of the action expert and the context
    num_heads: int = 4  # attention heads
    num_layers: int = 2  # decoder layers of the action expert
    num_context_tokens: int = 4  # context tokens computed once per decision


def build_policy(
    model_config: ModelConfig,
    normalizer: ObservationNormalizer,
    **sampler: Any,
) -> FlowSDEPolicy:
    """The reference transformer action expert with an observation encoder."""
    encoder = nn.Sequential(
        normalizer,
        ObservationEncoder(
            OBSERVATION_DIM,
            model_dim=model_config.model_dim,
            num_tokens=model_config.num_context_tokens,
        ),
    )
    expert = ActionExpertTransformer(
        (model_config.chunk_length, ACTION_DIM),
        model_dim=model_config.model_dim,
        num_heads=model_config.num_heads,
        num_layers=model_config.num_layers,
    )
    return FlowSDEPolicy(
        expert,
        action_shape=(model_config.chunk_length, ACTION_DIM),
        encoder=encoder,
        executed_chunk_length=model_config.executed_chunk_length,
        **sampler,
    )


def save_policy(path: Path, policy: FlowSDEPolicy, model_config: ModelConfig, **extra) -> None:
    """An atomic policy checkpoint: architecture, weights (with normaliser) and ``extra``."""
    save_checkpoint(
        {"model_config": asdict(model_config), "policy": policy.state_dict(), **extra}, path
    )


def load_policy(path: Path, **sampler: Any) -> tuple[FlowSDEPolicy, ModelConfig, dict]:
    """Rebuild a policy saved by :func:`save_policy`; returns it, its config and the state."""
    state = load_checkpoint(path)
    model_config = ModelConfig(**state["model_config"])
    normalizer = ObservationNormalizer(torch.zeros(OBSERVATION_DIM), torch.ones(OBSERVATION_DIM))
    policy = build_policy(model_config, normalizer, **sampler)
    policy.load_state_dict(state["policy"])
    return policy, model_config, state


def decisions_per_episode(max_episode_steps: int, executed_chunk_length: int) -> int:
    """How many decisions cover one episode."""
    return math.ceil(max_episode_steps / executed_chunk_length)


def make_env(
    num_envs: int,
    executed_chunk_length: int,
    *,
    max_episode_steps: int,
    success_threshold: float,
    reward: str,
):
    """A batch of ``num_envs`` chunked Pusher-v5 environments stepped in this process.

    :class:`~torchrl_flowpolicy.envs.batched.BatchedGymEnv` steps the MuJoCo environments in
    one loop, :class:`~torchrl_flowpolicy.envs.pusher.PusherTask` adds the success flag (and
    the reward choice), and the chunk wrapper executes ``executed_chunk_length`` rows per
    decision.
    """
    env = BatchedGymEnv(PUSHER_ENV_ID, num_envs, max_episode_steps=max_episode_steps)
    task = PusherTask(success_threshold=success_threshold, reward=reward)
    return make_chunked_env(TransformedEnv(env, task), executed_chunk_length)


def parse_config(config_class, argv=None, description: str | None = None):
    """Expose every (nested) dataclass field as ``--name`` / ``--model.name``."""
    parser = argparse.ArgumentParser(description=description)
    defaults = config_class()

    def add(prefix: str, instance) -> None:
        for item in dataclasses.fields(instance):
            value = getattr(instance, item.name)
            if dataclasses.is_dataclass(value):
                add(f"{prefix}{item.name}.", value)
                continue
            kind = type(value)
            if kind is bool:
                parser.add_argument(
                    f"--{prefix}{item.name}", action=argparse.BooleanOptionalAction, default=value
                )
            else:
                parser.add_argument(f"--{prefix}{item.name}", type=kind, default=value)

    add("", defaults)
    arguments = vars(parser.parse_args(argv))
    for name, value in arguments.items():
        target = defaults
        *parents, leaf = name.split(".")
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, leaf, value)
    return defaults


def load_or_pretrain(config: Any, **sampler: Any) -> tuple[FlowSDEPolicy, ModelConfig, dict]:
    """The pretrained policy at ``config.pretrained_checkpoint``, made by pretraining if missing.

    ``config`` is an example's config (PPO, DSRL): its seed and task settings are passed on to
    ``config.pretrain`` before ``examples/pretrain.py`` runs.
    """
    checkpoint_path = Path(config.pretrained_checkpoint)
    if not checkpoint_path.is_file():
        import pretrain

        config.pretrain.seed = config.seed
        config.pretrain.output_dir = str(checkpoint_path.parent)
        config.pretrain.max_episode_steps = config.max_episode_steps
        config.pretrain.success_threshold = config.success_threshold
        config.pretrain.reward = config.reward
        pretrain.main(config.pretrain)
    return load_policy(checkpoint_path, **sampler)


class MetricLogger:
    """TorchRL loggers named in ``names`` ("wandb" runs offline, "csv"), behind one ``log``."""

    def __init__(self, names: str, experiment: str, output_dir: Path, config: Any):
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
                self.loggers.append(CSVLogger(experiment, log_dir=str(output_dir / "csv")))
            else:
                raise ValueError(f"unknown logger {name!r}: use 'wandb' and/or 'csv'.")

    def log(self, metrics: dict[str, float], step: int) -> None:
        for logger in self.loggers:
            for name, value in metrics.items():
                logger.log_scalar(name, value, step=step)
