"""What a run checks about the files it reads and writes, before any work.

A run never destroys results it did not make, and never reads a file that is not there:

* :func:`check_output_dir`: a folder that holds a run's results (its checkpoint, its
  ``summary.json``) is refused unless the run continues it (``--resume``) or is told to
  replace them (``--overwrite``);
* :func:`check_output_file`: the same for one result file (an evaluation's JSON, a figure);
  a script whose one result file is its ``--output`` (the benchmarks) adds that option and
  ``--overwrite`` with :func:`add_output_options` and checks them with
  :func:`check_output_option` right after parsing them, before any measurement;
* :func:`check_not_an_input`: no output is one of the run's own inputs (a figure written
  over the summary it plots);
* :func:`check_input_file`: an input that is missing, or a folder, is an error naming the
  option that gave it;
* :func:`weights_digest`: a short digest of a state dict, that a run records to tell its
  pretrained start on resume (:func:`~torchrl_flowpolicy.training.runs.load_run`).

Every error names the command-line option (``option=``) and the path. The files themselves
are written atomically (:func:`~torchrl_flowpolicy.training.checkpoint.atomic_write`).

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> folder = Path(tempfile.mkdtemp())
    >>> check_output_dir(folder, resume=False, overwrite=False)  # empty: nothing to lose
    >>> _ = (folder / "summary.json").write_text("{}")
    >>> check_output_dir(folder, resume=False, overwrite=False)
    Traceback (most recent call last):
    ...
    FileExistsError: --output_dir ... holds the results of a run (summary.json): ...
"""

from __future__ import annotations

import argparse
import hashlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "RUN_RESULTS",
    "check_output_dir",
    "check_output_file",
    "add_output_options",
    "check_output_option",
    "check_not_an_input",
    "check_input_file",
    "weights_digest",
]

#: The files of a fine-tuning run's folder that only that run may replace.
RUN_RESULTS = ("checkpoint.pt", "summary.json")


def check_output_dir(
    output_dir: str | os.PathLike,
    results: Iterable[str] = RUN_RESULTS,
    *,
    resume: bool,
    overwrite: bool,
    option: str = "--output_dir",
    resumable: bool = True,
) -> None:
    """Refuse a run's output folder that holds one of the ``results`` of a run, unless the
    run continues it (``resume``) or replaces them (``overwrite``); the message offers
    ``--resume`` when the script has it (``resumable``).

    Raises:
        NotADirectoryError: ``output_dir`` is a file.
        FileExistsError: ``output_dir`` holds results, naming them and the ways out.
    """
    folder = Path(output_dir)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{option} {folder}: a file, not a folder.")
    found = [name for name in results if (folder / name).exists()]
    if found and not (resume or overwrite):
        continued = "--resume to continue that run, " if resumable else ""
        raise FileExistsError(
            f"{option} {folder} holds the results of a run ({', '.join(found)}): pass "
            f"{continued}--overwrite to replace its results, or another {option}."
        )


def check_output_file(path: str | os.PathLike, option: str, *, overwrite: bool) -> None:
    """Refuse an output file that exists, unless ``overwrite``; and one that is a folder.

    Raises:
        IsADirectoryError: ``path`` is a folder.
        FileExistsError: ``path`` exists and ``overwrite`` is not given.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{option} {path}: a folder, not a file to write.")
    if path.exists() and not overwrite:
        raise FileExistsError(
            f"{option} {path} exists: pass --overwrite to replace it, or choose another path."
        )


def add_output_options(
    parser: argparse.ArgumentParser, description: str = "write the results as JSON to this path"
) -> None:
    """Add ``--output`` (a script's one result file, ``description`` its help) and
    ``--overwrite`` (replace an existing one) to ``parser``; :func:`check_output_option`
    checks them."""
    parser.add_argument("--output", default=None, help=description)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")


def check_output_option(parser: argparse.ArgumentParser, arguments: argparse.Namespace) -> None:
    """:func:`check_output_file` on ``arguments.output`` (when given) with
    ``arguments.overwrite``, as a command-line error of ``parser``: its usage and the
    message, exit status 2. Called right after parsing, a refused file costs no work.

    Example:
        >>> import tempfile
        >>> parser = argparse.ArgumentParser(prog="bench")
        >>> add_output_options(parser)
        >>> existing = Path(tempfile.mkdtemp()) / "bench.json"
        >>> _ = existing.write_text("{}")
        >>> replace = parser.parse_args(["--output", str(existing), "--overwrite"])
        >>> check_output_option(parser, replace)  # on to the work
        >>> check_output_option(parser, parser.parse_args(["--output", str(existing)]))
        Traceback (most recent call last):
        ...
        SystemExit: 2
    """
    if arguments.output is None:
        return
    try:
        check_output_file(arguments.output, "--output", overwrite=arguments.overwrite)
    except (FileExistsError, IsADirectoryError) as error:
        parser.error(str(error))


def _same_file(first: Path, second: Path) -> bool:
    if first.exists() and second.exists():
        return os.path.samefile(first, second)
    return first.resolve() == second.resolve()


def check_not_an_input(
    outputs: Mapping[str, Iterable[str | os.PathLike]],
    inputs: Mapping[str, Iterable[str | os.PathLike]],
) -> None:
    """Refuse an output that is one of the inputs (the same file, through any path).

    Args:
        outputs: option (``"--output"``) -> the files it makes the script write.
        inputs: option (``"--runs"``) -> the files it makes the script read.

    Raises:
        ValueError: naming both options and the file.
    """
    for output_option, written in outputs.items():
        for output in map(Path, written):
            for input_option, read in inputs.items():
                for source in map(Path, read):
                    if _same_file(output, source):
                        raise ValueError(
                            f"{output_option} {output} is the file {input_option} reads "
                            f"({source}): a script never writes over its own inputs; "
                            f"choose another {output_option}."
                        )


def check_input_file(path: str | os.PathLike, option: str, hint: str = "") -> Path:
    """``path`` as a :class:`~pathlib.Path`, refusing a missing file or a folder.

    Raises:
        FileNotFoundError: nothing at ``path``, naming ``option`` (and ``hint``).
        IsADirectoryError: ``path`` is a folder.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{option} {path}: a folder, not a file (give the file in it).")
    if not path.is_file():
        raise FileNotFoundError(f"{option} {path}: no such file{'; ' + hint if hint else '.'}")
    return path


def weights_digest(state_dict: Mapping[str, Any]) -> str:
    """A 16-hex-digit SHA-256 digest of a state dict's names, dtypes, shapes and values.

    Equal weights give equal digests on any device; a run records that of its pretrained
    start, so that resuming it from another start is refused.

    Example:
        >>> weights_digest({"weight": torch.zeros(2)}) == weights_digest({"weight": torch.zeros(2)})
        True
        >>> weights_digest({"weight": torch.zeros(2)}) == weights_digest({"weight": torch.ones(2)})
        False
    """
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        value = state_dict[name]
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            tensor = value.detach().to("cpu").contiguous().reshape(-1)
            digest.update(f"{tensor.dtype}{tuple(value.shape)}".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()[:16]
