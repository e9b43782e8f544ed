"""Atomic file writes, and checkpoints loaded with ``weights_only=True``."""

from __future__ import annotations

import os
import pickle
import re
import socket
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

__all__ = ["atomic_write", "remove_orphan_files", "save_checkpoint", "load_checkpoint"]


def _writer_tag() -> str:
    """``{host}-{pid}``: who writes a temporary file (the host name reduced to ``[A-Za-z0-9_]``)."""
    return f"{re.sub(r'[^A-Za-z0-9_]', '_', socket.gethostname())}-{os.getpid()}"


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` of this host runs (``True`` when it cannot be told)."""
    if pid == os.getpid():
        return True
    if os.name == "nt":  # os.kill(pid, 0) would terminate it on Windows
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists (PermissionError: another user's) or cannot be told
        return True
    return True


def remove_orphan_files(path: str | os.PathLike) -> list[Path]:
    """Delete the temporary files that killed writes of ``path`` left behind.

    :func:`atomic_write` names its temporary file ``.{name}.{host}-{pid}.{random}.tmp`` next
    to ``path``. A write killed mid-way (``SIGKILL``, a crash, a lost node) leaves it there;
    this removes those of this host whose process is gone, and those of the earlier naming
    without a writer (``.{name}.{random}.tmp``). Files of a running writer, or of another
    host, are kept. :func:`atomic_write` (so every save) and :func:`load_checkpoint` call it.

    Returns:
        The removed files.
    """
    path = Path(path)
    pattern = re.compile(
        rf"^\.{re.escape(path.name)}\.(?:(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)\.)?[a-z0-9_]+\.tmp$"
    )
    host = _writer_tag().rsplit("-", 1)[0]
    removed = []
    if not path.parent.is_dir():
        return removed
    for candidate in path.parent.iterdir():
        match = pattern.match(candidate.name)
        if match is None or not candidate.is_file():
            continue
        if match["pid"] is not None and (match["host"] != host or _alive(int(match["pid"]))):
            continue
        candidate.unlink(missing_ok=True)
        removed.append(candidate)
    return removed


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Create or replace the file at ``path`` with what ``write`` writes, atomically.

    ``write`` receives a binary file opened on a temporary file in the same folder (named
    ``.{name}.{host}-{pid}.{random}.tmp``); the file is then flushed to disk, made readable
    like a normal file (mode ``0o644``; :func:`tempfile.mkstemp` creates it private) and moved
    over ``path`` with :func:`os.replace`. A ``write`` that raises leaves the previous file
    intact and no temporary file behind (the error is re-raised); a process killed mid-write
    leaves the previous file intact and its temporary file, which the next write or
    :func:`load_checkpoint` of ``path`` removes (:func:`remove_orphan_files`). Missing parent
    folders are created.

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
    remove_orphan_files(path)
    descriptor, temporary = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.{_writer_tag()}.", suffix=".tmp"
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


def _intact_archive(path: Path) -> bool:
    """Whether ``path`` is a zip archive (what :func:`torch.save` writes) with valid CRCs."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip() is None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return False


def load_checkpoint(path: str | os.PathLike, map_location: str | None = "cpu") -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (``weights_only=True``).

    Removes the temporary files of killed saves of ``path`` first (:func:`remove_orphan_files`).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: ``"checkpoint at PATH is corrupt"``: the file is truncated, empty, or
            not a checkpoint (a damaged archive, bytes that do not unpickle).
        pickle.UnpicklingError: an intact file holding objects that ``weights_only=True``
            refuses (torch's message, which names the object).
    """
    path = Path(path)
    remove_orphan_files(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}.")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except PermissionError:
        raise
    except Exception as error:
        unsafe = isinstance(error, pickle.UnpicklingError) and "Unsupported global" in str(error)
        if unsafe and _intact_archive(path):
            raise
        summary = str(error).strip().splitlines()[0][:120] if str(error).strip() else ""
        raise ValueError(
            f"checkpoint at {path} is corrupt ({type(error).__name__}"
            f"{': ' + summary if summary else ''}): it was cut short, damaged or is not a "
            f"checkpoint written by save_checkpoint. Restore it from a copy or start over."
        ) from error
