"""Atomic file writes, and checkpoints loaded with ``weights_only=True``."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

__all__ = ["atomic_write", "save_checkpoint", "load_checkpoint"]


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Create or replace the file at ``path`` with what ``write`` writes, atomically.

    ``write`` receives a binary file opened on a temporary file in the same folder (named
    ``.{name}.*.tmp``); the file is then flushed to disk, made readable like a normal file
    (mode ``0o644``; :func:`tempfile.mkstemp` creates it private) and moved over ``path`` with
    :func:`os.replace`. A run killed mid-write, or a ``write`` that raises, leaves the
    previous file intact and no temporary file behind (an error is re-raised). Missing
    parent folders are created.

    Args:
        path: the file to create or replace.
        write: writes the whole content to the binary file it is given.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Examples:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "notes" / "hello.txt"
        >>> _ = atomic_write(path, lambda file: file.write(b"hello"))
        >>> path.read_bytes()
        b'hello'
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"
    )
    try:
        with os.fdopen(descriptor, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``state`` to ``path`` atomically (:func:`atomic_write` around :func:`torch.save`).

    A run killed mid-write leaves the previous checkpoint intact. ``state`` must hold only
    what ``torch.load(weights_only=True)`` accepts: tensors, state dicts, numbers, strings,
    lists, tuples and dicts of those.

    Examples:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "checkpoint.pt"
        >>> _ = save_checkpoint({"step": 3, "weights": torch.ones(2)}, path)
        >>> load_checkpoint(path)["step"]
        3
    """
    return atomic_write(path, lambda file: torch.save(state, file))


def load_checkpoint(path: str | os.PathLike, map_location: str | None = "cpu") -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (``weights_only=True``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}.")
    return torch.load(path, map_location=map_location, weights_only=True)
