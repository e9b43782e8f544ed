"""A DSRL run's progress and its checkpoint (``examples/dsrl.py``): the counters and
evaluation history, saved with the learner, the replay buffer's decisions and the run's
identity, and restored by ``--resume`` exactly.

Example:
    >>> Progress(env_steps=600).updates
    0
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torchrl.data import ReplayBuffer

from torchrl_flowpolicy.training import runs


class Trainable(Protocol):
    """What a checkpoint saves of the learner: its modules and optimisers by name."""

    def trained(self) -> dict[str, Any]: ...


@dataclass
class Progress:
    """The counters and evaluation history of a run (saved in its checkpoint)."""

    iteration: int = 0
    env_steps: int = 0
    updates: int = 0
    update_credit: float = 0.0  # updates owed: utd_ratio per collected decision
    wall_seconds: float = 0.0  # training wall time at the last checkpoint
    history: list[dict] = field(default_factory=list)


def save_dsrl_run(
    path: Path,
    learner: Trainable,
    replay_buffer: ReplayBuffer,
    run: Progress,
    identity: dict[str, Any],
) -> None:
    """The run checkpoint ``--resume`` reads: learner, stored decisions, counters and the
    run's identity (``runs.run_identity``: task, pretrained architecture, SAC networks)."""
    buffer = runs.replay_buffer_state(replay_buffer)  # the stored decisions
    progress = {**dataclasses.asdict(run), "history": json.dumps(run.history)}
    runs.save_run(path, learner.trained(), **buffer, **progress, **identity)


def resume_dsrl_run(
    saved: dict[str, Any], learner: Trainable, replay_buffer: ReplayBuffer
) -> tuple[Progress, dict[str, Any]]:
    """Load a :func:`save_dsrl_run` checkpoint, as ``runs.load_run`` returned it, into
    ``learner`` and ``replay_buffer``; returns the counters and the random generators' state
    (for ``runs.restore_random_state``)."""
    saved = runs.resume_run(saved, learner.trained())
    runs.restore_replay_buffer(replay_buffer, saved)
    for name in ("task", "model_config", "networks", *IDENTITY_EXTRAS):
        saved.pop(name, None)
    random_state = saved.pop("random_state")
    return Progress(**{**saved, "history": json.loads(saved["history"])}), random_state


# The identity entries a checkpoint holds beside task, model_config and networks.
IDENTITY_EXTRAS = ("seed", "pretrained_weights", "sampler")
