"""Data-parallel learning with ``torch.distributed``: one learner per process, launched by
``torchrun``, gradients averaged after every backward pass.

Each process (a *rank*) collects its own data, computes ``DenoisingClipPPOLoss`` on its own
minibatch and calls ``backward()``; :func:`average_gradients` then replaces every gradient
by its mean over the ranks (one ``all_reduce`` per dtype and device), so that every rank
takes the same optimiser step and the parameters stay identical, as with
:class:`~torch.nn.parallel.DistributedDataParallel`. The other helpers set the process group
up from ``torchrun``'s environment (:func:`init_distributed`), make every rank start from
rank 0's weights (:func:`broadcast_parameters`), add counters over ranks
(:func:`sum_over_processes`) and let rank 0 alone do what must happen once
(:func:`is_main_process`, :func:`barrier`). Without ``torchrun`` they are no-ops: a single
process runs exactly as if this module were not there.

**Why not** ``DistributedDataParallel``. DDP averages gradients from hooks that it arms in
*its own* ``forward``: the reducer only expects gradients after ``DDP(module)(...)`` has run.
TorchRL's ``LossModule`` never calls a wrapped module that way: it keeps the networks'
parameters apart (``actor_network_params``, ``critic_network_params``), puts them into the
network with ``TensorDict.to_module`` and calls the bare network; ``DenoisingClipPPOLoss``
moreover calls the policy's ``stochastic_steps`` method, not its ``forward``, and accepts
only a :class:`~torchrl_flowpolicy.FlowSDEPolicy` as actor. A DDP wrapper around the policy
would thus see no forward pass, and the gradients would stay per-rank (checked with two gloo
ranks, the loss built on ``ddp.module``, ``functional=True`` and ``False``: each rank kept its
own gradient; ``DenoisingClipPPOLoss(ddp)`` is refused). TorchRL's ``ClipPPOLoss`` documents the same: ``functional=True``
"makes it impossible to use distributed models (DDP, FSDP, ...)". An explicit all-reduce
after ``backward()`` is what DDP computes, without needing the forward pass.

**What the average means.** Each rank's loss is a mean over its minibatch. The average of
the ranks' gradients equals the gradient of the mean over the union of the minibatches only
when every rank averages over the same number of terms: equal-sized minibatches, and, for
``DenoisingClipPPOLoss``'s objective, the same number of stochastic steps per decision (true
for every ``sde_mode``). Two per-minibatch statistics are per rank in a data-parallel run,
as in any DDP training: advantage normalisation (``normalize_advantage=True`` standardises
each rank's minibatch with its own mean and standard deviation) and the self-imitation term
(a mean over each rank's successful decisions). With ``normalize_advantage=False`` and no
self-imitation, ``W`` ranks on equal shards take exactly the step of one process on their
union (``tests/test_distributed.py``).

Launch::

    torchrun --nproc_per_node 2 examples/ppo.py --quick

Examples:
    >>> import torch
    >>> from torch import nn
    >>> rank, world_size = init_distributed()  # not launched by torchrun: one process
    >>> (rank, world_size, is_main_process())
    (0, 1, True)
    >>> network = nn.Linear(3, 1)
    >>> network(torch.ones(2, 3)).sum().backward()
    >>> before = network.weight.grad.clone()
    >>> average_gradients(network.parameters())  # the mean over one rank: unchanged
    >>> torch.equal(network.weight.grad, before)
    True
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = [
    "init_distributed",
    "is_main_process",
    "average_gradients",
    "broadcast_parameters",
    "sum_over_processes",
    "barrier",
    "close_distributed",
]

# What torchrun sets for every process (torch.distributed's "env://" initialisation).
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_distributed(
    backend: str | None = None, timeout: datetime.timedelta | None = None
) -> tuple[int, int]:
    """Join the process group that ``torchrun`` describes; returns ``(rank, world_size)``.

    Without ``torchrun``'s environment variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``) this does nothing and returns ``(0, 1)``. When a process group already
    exists, its rank and size are returned.

    Args:
        backend: a ``torch.distributed`` backend. Default: ``"gloo"`` without CUDA;
            ``"cpu:gloo,cuda:nccl"`` with CUDA (gloo for CPU tensors, NCCL for GPU tensors;
            each process then uses GPU ``LOCAL_RANK``).
        timeout: how long a collective call waits for the other ranks (default: torch's,
            30 minutes for gloo). Rank 0 alone may run long jobs (pretraining, evaluation)
            while the others wait at a :func:`barrier` or their next collective call: give
            them the time it needs.

    Raises:
        RuntimeError: when some of ``torchrun``'s variables are set but not all, or when
            ``torch.distributed`` is not available.

    Examples:
        >>> init_distributed()  # a plain ``python`` process
        (0, 1)
    """
    if _initialized():
        return dist.get_rank(), dist.get_world_size()
    present = [name for name in TORCHRUN_VARIABLES if name in os.environ]
    if not present:
        return 0, 1
    if len(present) != len(TORCHRUN_VARIABLES):
        missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
        raise RuntimeError(
            f"the environment holds {present} but not {missing}: launch with torchrun "
            f"(torchrun --nproc_per_node N script.py) or unset them for a single process."
        )
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of torch.")
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if "nccl" in backend and torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    options = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend=backend, init_method="env://", **options)
    return dist.get_rank(), dist.get_world_size()


def is_main_process() -> bool:
    """Whether this process is rank 0 (always, without a process group).

    Examples:
        >>> is_main_process()
        True
    """
    return not _initialized() or dist.get_rank() == 0


def average_gradients(parameters: Iterable[Tensor]) -> None:
    """Replace each parameter's gradient by its mean over the ranks, in place.

    Call it after ``backward()`` and before gradient clipping and the optimiser step, with
    the same parameters in the same order on every rank. A parameter whose gradient is
    ``None`` on some ranks counts as a zero gradient there (its loss did not depend on it);
    one whose gradient is ``None`` on every rank keeps ``None`` (the optimiser skips it, as
    it would in one process). The gradients of each (device, dtype) group travel in one
    flat ``all_reduce`` together with one presence flag per parameter. Without a process
    group, or with one rank, it does nothing.

    The mean of the ranks' gradients is the gradient of the mean loss over the union of
    their minibatches only when every rank's loss averages the same number of terms (see
    the module's notes).

    Args:
        parameters: the trained parameters (those that do not require a gradient are
            skipped).

    Raises:
        ValueError: on a sparse gradient.

    Examples:
        >>> from torch import nn
        >>> network = nn.Linear(2, 1)
        >>> network(torch.ones(1, 2)).sum().backward()
        >>> average_gradients(network.parameters())  # one process: unchanged
        >>> network.bias.grad
        tensor([1.])
    """
    if not _initialized() or dist.get_world_size() == 1:
        return
    world_size = dist.get_world_size()
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for parameter in parameters:
        if parameter.requires_grad:
            groups.setdefault((parameter.device, parameter.dtype), []).append(parameter)
    for (device, dtype), group in groups.items():
        pieces, presence = [], []
        for parameter in group:
            gradient = parameter.grad
            if gradient is not None and gradient.is_sparse:
                raise ValueError("average_gradients does not handle sparse gradients.")
            pieces.append(
                torch.zeros(parameter.numel(), device=device, dtype=dtype)
                if gradient is None
                else gradient.reshape(-1)
            )
            presence.append(float(gradient is not None))
        pieces.append(torch.tensor(presence, device=device, dtype=dtype))
        flat = torch.cat(pieces)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        counts = flat[-len(group) :].tolist()
        offset = 0
        for parameter, count in zip(group, counts, strict=True):
            size = parameter.numel()
            if count > 0:
                mean = flat[offset : offset + size].view_as(parameter) / world_size
                if parameter.grad is None:
                    parameter.grad = mean
                else:
                    parameter.grad.copy_(mean)
            offset += size


def broadcast_parameters(module: nn.Module, source: int = 0) -> None:
    """Overwrite ``module``'s parameters and buffers with those of rank ``source``, in place.

    What ``DistributedDataParallel`` does at construction: every rank then starts from the
    same weights (a critic initialised with a rank-specific seed, say). Every rank must
    call it with the same module structure. Without a process group it does nothing.

    Examples:
        >>> from torch import nn
        >>> broadcast_parameters(nn.Linear(2, 1))  # one process: nothing to do
    """
    if not _initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=source)


def sum_over_processes(value: int) -> int:
    """The sum of an integer counter (environment steps, say) over the ranks.

    Every rank must call it. The counter travels as a CPU tensor (the default backends
    include gloo for those). Without a process group it returns ``value``.

    Examples:
        >>> sum_over_processes(600)
        600
    """
    if not _initialized() or dist.get_world_size() == 1:
        return value
    total = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return int(total.item())


def barrier() -> None:
    """Wait until every rank reaches this call (nothing without a process group).

    Examples:
        >>> barrier()
    """
    if _initialized():
        dist.barrier()


def close_distributed() -> None:
    """Leave the process group (nothing without one); no collective call may follow.

    Examples:
        >>> close_distributed()
    """
    if _initialized():
        dist.destroy_process_group()
