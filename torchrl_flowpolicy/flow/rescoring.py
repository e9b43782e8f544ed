"""The learner's rescoring: the Gaussian transitions of the stored stochastic steps.

A rollout stores its chain ``x_0 .. x_K`` and which steps were stochastic; the learner
recomputes, under the current parameters, the Gaussian mean (and, with a learned noise, the
std) of every stochastic ``(decision, step)`` entry with one batched velocity call over all
of them (:func:`stochastic_steps`), never a loop over ``K``. :func:`scatter_steps` places
per-entry values back on the ``[*B, K]`` grid; :func:`check_sde_mask` and
:func:`check_stochastic_steps` refuse stored data that cannot be scored, naming the entries
(:func:`format_step_entries`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from torchrl_flowpolicy.flow.sampling import SamplingSchedule, all_finite

__all__ = [
    "StochasticSteps",
    "stochastic_steps",
    "scatter_steps",
    "format_step_entries",
    "check_sde_mask",
    "check_stochastic_steps",
]


class StochasticSteps(NamedTuple):
    """The Gaussian transitions of the stochastic (decision, step) entries of a batch.

    ``M`` is the number of stochastic entries, in row-major order of the flattened ``[N, K]``
    mask (the order of ``tensor[mask]``).

    Attributes:
        decision_index: ``[M]`` index into the flattened batch of decisions.
        step_index: ``[M]`` denoising step ``k`` of each entry.
        mean: ``[M, H', D]`` the Gaussian mean ``mu_k`` under the current parameters.
        std: the standard deviation ``std_k``: ``[M]``, parameter-free, for the fixed
            schedule; ``[M, H', D]``, one per entry under the current parameters, for a
            learned noise (``noise_std``).
        sample: ``[M, H', D]`` the stored ``x_{k+1}``.

    ``H'`` is the number of rows the log-probability covers (the executed rows).
    """

    decision_index: Tensor
    step_index: Tensor
    mean: Tensor
    std: Tensor
    sample: Tensor


#: ``velocity(x [M, H, D], sigma [M], decision_index [M]) -> v [M, H, D]``; the same
#: signature, returning the std, for the ``noise_std`` of :func:`stochastic_steps`.
IndexedVelocity = Callable[[Tensor, Tensor, Tensor], Tensor]


def stochastic_steps(
    velocity: IndexedVelocity,
    chain: Tensor,
    sde_mask: Tensor,
    schedule: SamplingSchedule,
    rows: int | None = None,
    noise_std: IndexedVelocity | None = None,
) -> StochasticSteps:
    """Recompute the Gaussian transitions of the stochastic steps of stored chains.

    One batched ``velocity`` call over all ``M`` stochastic entries (never a loop over K),
    and with ``noise_std`` one batched call of it. The gradient reaches the parameters
    through the means, and with ``noise_std`` through the stds as well.

    Args:
        velocity: ``velocity(x, sigma, decision_index) -> v``; ``decision_index`` tells the
            callback which decision's context each entry needs.
        chain: ``[N, K + 1, H, D]`` the stored ``x_0 .. x_K``.
        sde_mask: ``[N, K]`` the stored stochastic-step mask.
        schedule: the sampler's constants, in the chain's dtype.
        rows: the leading chunk rows the log-probability covers (default: all ``H``).
        noise_std: ``noise_std(x, sigma, decision_index) -> std [M, H, D]``, the learned
            per-entry std (:func:`~torchrl_flowpolicy.flow.integrate`'s, with the decision index); ``None``: the
            schedule's ``std_k``.

    Examples:
        >>> from torchrl_flowpolicy.flow import sampling_schedule
        >>> schedule = sampling_schedule(4, noise_level=0.5)
        >>> chain, mask = torch.randn(2, 5, 3, 1), torch.tensor([[False, True, False, False]] * 2)
        >>> steps = stochastic_steps(lambda x, sigma, i: torch.zeros_like(x), chain, mask, schedule)
        >>> steps.mean.shape, steps.step_index.tolist()
        (torch.Size([2, 3, 1]), [1, 1])
    """
    decision_index, step_index = sde_mask.bool().nonzero(as_tuple=True)
    x = chain[decision_index, step_index]
    sample = chain[decision_index, step_index + 1]
    v = velocity(x, schedule.sigmas[step_index], decision_index)
    mean = (
        schedule.x_coefficient[step_index, None, None] * x
        + schedule.velocity_coefficient[step_index, None, None] * v
    )
    rows = chain.shape[-2] if rows is None else rows
    if noise_std is None:
        std = schedule.std[step_index]
    else:
        std = torch.broadcast_to(noise_std(x, schedule.sigmas[step_index], decision_index), x.shape)
        std = std[:, :rows]
    return StochasticSteps(decision_index, step_index, mean[:, :rows], std, sample[:, :rows])


def scatter_steps(steps: StochasticSteps, values: Tensor, shape: torch.Size) -> Tensor:
    """Place per-entry ``values [M]`` into a zero tensor of ``shape = [*B, K]``.

    The entries index the flattened ``[prod(B), K]`` grid (:class:`StochasticSteps`).

    Examples:
        >>> steps = StochasticSteps(torch.tensor([1]), torch.tensor([2]), None, None, None)
        >>> scatter_steps(steps, torch.tensor([5.0]), torch.Size([2, 3]))
        tensor([[0., 0., 0.],
                [0., 0., 5.]])
    """
    *batch_shape, num_denoising_steps = shape
    out = values.new_zeros(
        math.prod(batch_shape), num_denoising_steps
    )  # prod(()) = 1: one decision
    out = out.index_put((steps.decision_index, steps.step_index), values)
    return out.reshape(shape)


def format_step_entries(steps: StochasticSteps, bad: Tensor, limit: int = 3) -> str:
    """The first ``(decision, step)`` pairs of the entries where ``bad [M]``, for messages.

    Examples:
        >>> steps = StochasticSteps(torch.tensor([0, 2, 5]), torch.tensor([1, 3, 2]), *[None] * 3)
        >>> format_step_entries(steps, torch.tensor([True, False, True]), limit=1)
        '(0, 1) and 1 more'
    """
    pairs = torch.stack([steps.decision_index[bad], steps.step_index[bad]], -1)
    shown = ", ".join(str(tuple(pair)) for pair in pairs[:limit].tolist())
    return shown + (f" and {len(pairs) - limit} more" if len(pairs) > limit else "")


def check_sde_mask(sde_mask: Tensor, name: str = "sde_mask") -> None:
    """Raise a ``ValueError`` naming ``name`` when a stored mask ``[N, K]`` marks step 0.

    Step 0 (sigma = 1) is never stochastic: its Flow-SDE std is undefined.

    Examples:
        >>> check_sde_mask(torch.tensor([[False, True]]))  # valid: returns None
    """
    if torch.compiler.is_compiling():  # in the graph (a Python branch would break it)
        message = f"the stored mask {name} marks step 0 as stochastic (run eagerly for details)"
        torch._assert_async(~sde_mask[:, 0].any(), message)
        return
    if sde_mask[:, 0].any():
        raise ValueError(
            f"the stored mask {name} marks step 0 as stochastic for "
            f"{int(sde_mask[:, 0].sum())} decisions: step 0 (sigma = 1) is never "
            f"stochastic (its SDE std is undefined). The data were not written by "
            f"FlowSDEPolicy, or were altered."
        )


def check_stochastic_steps(
    steps: StochasticSteps, chain: Tensor, *, check_samples: bool = True, chain_name: str = "chain"
) -> None:
    """Raise a ``ValueError`` when recomputed steps cannot be scored, naming the entries.

    Checked: a learned std (``steps.std`` per entry) finite and > 0, finite means (a
    non-finite mean is blamed on the stored inputs ``x_k`` of ``chain [N, K + 1, H, D]`` when
    they are not finite, on the velocity otherwise) and, with ``check_samples``, finite
    stored samples ``x_{k+1}``. Each check costs one sum when the data are good.
    """
    if steps.std.ndim > 1 and not (all_finite(steps.std) and bool((steps.std > 0).all())):
        bad = ~(torch.isfinite(steps.std) & (steps.std > 0)).flatten(1).all(-1)
        raise ValueError(
            f"noise_head produced a std that is not finite and > 0 while recomputing "
            f"log-probs from the stored chain, at stochastic steps (decision, step) "
            f"{format_step_entries(steps, bad)}: a noise head must return a positive std "
            f"(flow.bounded_std); check its inputs and dtype."
        )
    if not all_finite(steps.mean, "a recomputed step mean"):
        inputs = chain[steps.decision_index, steps.step_index]
        if not torch.isfinite(inputs).all():
            bad = ~torch.isfinite(inputs).flatten(1).all(-1)
            raise ValueError(
                f"the stored chain {chain_name} is not finite at the inputs x_k of stochastic "
                f"steps (decision, step) {format_step_entries(steps, bad)}: the data were "
                f"corrupted; drop them."
            )
        raise ValueError(
            "velocity_network produced non-finite values while recomputing log-probs "
            "from the stored chain (log_prob)."
        )
    if check_samples and not all_finite(steps.sample, f"the stored chain {chain_name}"):
        bad = ~torch.isfinite(steps.sample).flatten(1).all(-1)
        raise ValueError(
            f"the stored chain {chain_name} is not finite at the samples x_(k+1) of stochastic "
            f"steps (decision, step) {format_step_entries(steps, bad)}: the data were "
            f"corrupted; drop them."
        )
