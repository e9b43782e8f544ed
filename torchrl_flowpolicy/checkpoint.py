"""Atomic checkpoints, loaded with ``weights_only=True``."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["save_checkpoint", "load_checkpoint"]


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``state`` to ``path`` atomically.

    The state is written to a temporary file in the same directory, flushed to disk, then
    moved over ``path`` with :func:`os.replace`: a run killed mid-write leaves the previous
    checkpoint intact. ``state`` must hold only what ``torch.load(weights_only=True)``
    accepts: tensors, state dicts, numbers, strings, lists, tuples and dicts of those.

    Examples:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "checkpoint.pt"
        >>> _ = save_checkpoint({"step": 3, "weights": torch.ones(2)}, path)
        >>> load_checkpoint(path)["step"]
        3
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(descriptor, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(path: str | os.PathLike, map_location: str | None = "cpu") -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (``weights_only=True``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}.")
    return torch.load(path, map_location=map_location, weights_only=True)
