"""The run lifecycle: random generators, run checkpoints with their identity, resume.

What a training script, its tests and the benchmarks share about one run, apart from the
policy's own checkpoint (:mod:`torchrl_flowpolicy.training.models`) and the logger
(:mod:`torchrl_flowpolicy.training.loggers`):

* the random generators a run draws from, seeded together (:func:`seed_random_generators`),
  their state saved and put back (:func:`random_state`, :func:`restore_random_state`);
* a run checkpoint (:func:`save_run`): the state dicts of what the run trains, its progress
  values and every generator's state, written atomically;
* resume: :func:`require_run_checkpoint` before any work, :func:`load_run` refusing the
  checkpoint of another run (its *identity*, :func:`run_identity`: task, architecture, ...),
  :func:`resume_run` loading it into the networks and optimisers, and an off-policy run's
  stored decisions (:func:`replay_buffer_state`, :func:`restore_replay_buffer`);
* the run's device, checked up front (:func:`resolve_device`), and its JSON and PNG outputs
  written atomically (:func:`write_json`, :func:`save_figure`).

Exact resume needs the three pieces in order: :func:`load_run` before the set-up (a wrong
checkpoint fails early), :func:`resume_run` once the networks exist, and
:func:`restore_random_state` where the uninterrupted run stood when it saved, just before
the first resumed iteration.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> import torch
    >>> path = Path(tempfile.mkdtemp()) / "checkpoint.pt"
    >>> seed_random_generators(0)
    >>> network = torch.nn.Linear(2, 1)
    >>> save_run(path, {"network": network}, iteration=3, task="pusher")
    >>> saved = load_run(path, {"task": "pusher"})
    >>> resume_run(saved, {"network": torch.nn.Linear(2, 1)})["iteration"]
    3
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from torchrl_flowpolicy.training.checkpoint import atomic_write, load_checkpoint, save_checkpoint

__all__ = [
    "seed_random_generators",
    "random_state",
    "restore_random_state",
    "save_run",
    "require_run_checkpoint",
    "load_run",
    "resume_run",
    "IMPLIED_IDENTITY",
    "run_identity",
    "replay_buffer_state",
    "restore_replay_buffer",
    "RunProgress",
    "learning_rate_factor",
    "resolve_device",
    "write_json",
    "save_figure",
]


# ----------------------------------------------------------------------------- random state
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

    The environments' own generators are not here, nor the simulators' states: a run that
    resumes exactly starts every batch from fresh resets whose seeds depend on the iteration
    alone (:func:`~torchrl_flowpolicy.training.protocol.training_seed`).
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


# ----------------------------------------------------------------------------- run checkpoints
def save_run(path: str | Path, trained: Mapping[str, Any], **progress: Any) -> None:
    """An atomic run checkpoint, for resuming.

    Holds ``trained[name].state_dict()`` for every entry (networks, optimisers, loss
    modules), the ``progress`` values as given (counters, history, replay-buffer content,
    the run's identity: what ``torch.load(weights_only=True)`` reads) and, as
    ``"random_state"``, every random generator's state (:func:`random_state`), so that a
    resumed run continues the random streams where they stopped (:func:`restore_random_state`).
    """
    states = {name: item.state_dict() for name, item in trained.items()}
    save_checkpoint({**states, **progress, "random_state": random_state()}, path)


def require_run_checkpoint(path: str | Path) -> None:
    """Refuse to resume without a run checkpoint at ``path`` (call it before any work).

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
    path: str | Path, expected: Mapping[str, Any], implied: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Load a :func:`save_run` checkpoint to resume from, refusing that of another run.

    ``expected`` is the run's identity: checkpoint entries (``"task"``, ``"model_config"``:
    a dict compared field by field) mapped to this run's values. An entry the checkpoint
    does not hold (one saved before it was recorded) is compared with its value in
    ``implied`` (what every run of that time had, e.g. the fixed noise before the learned
    one existed), and not compared when ``implied`` has none.

    Raises:
        FileNotFoundError: no checkpoint at ``path`` (:func:`require_run_checkpoint`).
        ValueError: ``"checkpoint at PATH is corrupt"`` (:func:`~torchrl_flowpolicy.training.checkpoint.load_checkpoint`),
            or a checkpoint saved with another identity, naming each field that differs.
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


def resume_run(
    checkpoint: str | Path | Mapping[str, Any], trained: Mapping[str, Any]
) -> dict[str, Any]:
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


# What a fine-tuning checkpoint saved before an entry of its identity was recorded implies:
# every run had a critic before GRPO and the fixed Flow-SDE noise before the noise head.
IMPLIED_IDENTITY: dict[str, Any] = {"advantage": "gae", "noise": {"kind": "fixed"}}


def run_identity(task: str, model_config: Any, **entries: Any) -> dict[str, Any]:
    """A fine-tuning run's identity, for :func:`load_run` (and :func:`save_run`): the task,
    the pretrained policy's architecture (a dataclass, recorded as a dict; chunking
    included) and the run's own ``entries`` (the advantage, the noise, network sizes).

    Example:
        >>> from torchrl_flowpolicy.training.models import ModelConfig
        >>> identity = run_identity("pusher", ModelConfig(), advantage="gae")
        >>> sorted(identity)
        ['advantage', 'model_config', 'task']
    """
    return {"task": task, "model_config": asdict(model_config), **entries}


def replay_buffer_state(replay_buffer: Any) -> dict[str, Any]:
    """The checkpoint entries of a replay buffer's content: its stored decisions only (not
    the empty capacity) as plain tensors, and their count; :func:`restore_replay_buffer`
    puts them back."""
    stored = replay_buffer[: len(replay_buffer)].to_dict()
    return {"replay_buffer": stored, "buffer_length": len(replay_buffer)}


def restore_replay_buffer(replay_buffer: Any, saved: dict[str, Any]) -> None:
    """Extend ``replay_buffer`` with the decisions :func:`replay_buffer_state` saved, taking
    its entries out of ``saved`` (what :func:`resume_run` returned)."""
    stored, length = saved.pop("replay_buffer"), saved.pop("buffer_length")
    replay_buffer.extend(TensorDict(stored, batch_size=[length]))


@dataclass
class RunProgress:
    """A training run's counters, evaluation history and clock, as its run checkpoint holds
    them (:meth:`state`, for :func:`save_run`) and a resumed run reads them back
    (:meth:`from_state`, on what :func:`resume_run` returned).

    ``start`` is the ``time.perf_counter()`` at which a run that has run for
    :meth:`wall_seconds` started: a resumed run's clock goes on from the checkpoint's.

    Example:
        >>> run = RunProgress(iteration=2, env_steps=600)
        >>> row = run.record({"success_rate": 0.5})
        >>> resumed = RunProgress.from_state(run.state())
        >>> first = resumed.history[0]
        >>> (resumed.iteration, first["success_rate"])
        (2, 0.5)
    """

    iteration: int = 0
    env_steps: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    start: float = field(default_factory=time.perf_counter)

    def wall_seconds(self) -> float:
        """Seconds the run has run (over its interruptions: the time it was running)."""
        return time.perf_counter() - self.start

    def record(self, evaluation: Mapping[str, Any]) -> dict[str, Any]:
        """Append (and return) a row of the evaluation history at the current counters."""
        row = {"env_steps": self.env_steps, "iteration": self.iteration}
        self.history.append({**row, "wall_seconds": self.wall_seconds(), **evaluation})
        return self.history[-1]

    def state(self) -> dict[str, Any]:
        """The checkpoint entries: the counters, the history (as JSON) and the wall time."""
        return {
            "iteration": self.iteration,
            "env_steps": self.env_steps,
            "history": json.dumps(self.history),
            "wall_seconds": self.wall_seconds(),
        }

    @classmethod
    def from_state(cls, saved: Mapping[str, Any]) -> RunProgress:
        """The progress a checkpoint holds; one saved before the wall time was recorded goes
        on from its last history row's."""
        history = json.loads(saved["history"])
        last = history[-1]["wall_seconds"] if history else 0.0
        start = time.perf_counter() - saved.get("wall_seconds", last)
        return cls(saved["iteration"], saved["env_steps"], history, start)


def learning_rate_factor(env_steps: int, total_env_steps: int, decay_env_steps: int) -> float:
    """The multiplier of a learning rate that stays constant, then decays linearly to 0 over
    the last ``decay_env_steps`` of ``total_env_steps`` (``0``: constant, always 1), read
    before the batch collected after ``env_steps``.

    PPO's learning rate annealed linearly to 0 (Schulman et al., 2017, "Proximal Policy
    Optimization Algorithms", appendix A, Table 5: over the whole run), here over the
    budget's end only, so that a constant-rate run continued to a larger budget decays over
    its extension; a resumed run recomputes the factor from its env steps.

    Example:
        >>> tuple(learning_rate_factor(s, 1000, 400) for s in (0, 600, 800, 1000))
        (1.0, 1.0, 0.5, 0.0)
        >>> learning_rate_factor(800, 1000, 0)
        1.0
    """
    if decay_env_steps < 0:
        raise ValueError(f"decay_env_steps must be >= 0, got {decay_env_steps}.")
    if decay_env_steps == 0:
        return 1.0
    remaining = max(total_env_steps - env_steps, 0)
    return min(remaining / decay_env_steps, 1.0)


# ----------------------------------------------------------------------------- device, outputs
def resolve_device(name: str) -> torch.device:
    """A run's ``--device`` as a :class:`torch.device`, checked up front.

    ``"cuda"`` becomes the current CUDA device with its index (under ``torchrun``, the
    process's ``LOCAL_RANK`` GPU, which
    :func:`~torchrl_flowpolicy.training.distributed.init_distributed` selects), so that collector worker processes use the same GPU as their learner.

    Raises:
        ValueError: for a name torch does not know, or a device this machine does not have
            (``--device cuda`` without a CUDA GPU, or a GPU index past the last one).

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
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


def write_json(path: str | Path, value: Any) -> Path:
    """``value`` as indented JSON at ``path``, atomically: a run killed while writing leaves the
    previous file whole (:func:`~torchrl_flowpolicy.training.checkpoint.atomic_write`)."""
    return atomic_write(path, lambda file: file.write(json.dumps(value, indent=2).encode()))


def save_figure(figure: Any, path: str | Path) -> Path:
    """A matplotlib figure as a PNG at ``path``, atomically, like :func:`write_json`."""
    return atomic_write(path, lambda file: figure.savefig(file, format="png", dpi=120))
