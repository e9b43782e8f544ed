"""Confidence intervals for the evaluation protocol: success rates and paired differences.

Success over ``n`` held-out episodes is a binomial proportion: :func:`wilson_interval` gives
its 95 % score interval (Wilson, 1927), which stays inside [0, 1] and keeps its coverage near
0 and 1, where the normal approximation does not. Two checkpoints evaluated on the same
initial states and the same initial noise are paired: :func:`paired_bootstrap_interval`
resamples the episodes (pairs kept together) to bound the difference of their means
(Efron & Tibshirani, 1993, percentile interval), which is much tighter than comparing two
independent intervals when the checkpoints agree on most episodes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["wilson_interval", "paired_bootstrap_interval"]


def _normal_quantile(confidence: float) -> float:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}.")
    return math.sqrt(2) * torch.special.erfinv(torch.tensor(confidence, dtype=torch.float64)).item()


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a success rate ``successes / trials``.

    Args:
        successes: the number of successful episodes (``0 <= successes <= trials``).
        trials: the number of episodes (> 0).
        confidence: the interval's coverage.

    Returns:
        ``(low, high)``, inside [0, 1].

    Examples:
        >>> low, high = wilson_interval(5, 10)
        >>> round(low, 4), round(high, 4)
        (0.2366, 0.7634)
    """
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(
            f"need 0 <= successes <= trials and trials >= 1, got {successes}/{trials}."
        )
    z = _normal_quantile(confidence)
    rate = successes / trials
    denominator = 1 + z**2 / trials
    center = (rate + z**2 / (2 * trials)) / denominator
    half = z / denominator * math.sqrt(rate * (1 - rate) / trials + z**2 / (4 * trials**2))
    return max(0.0, center - half), min(1.0, center + half)


def paired_bootstrap_interval(
    first: Tensor,
    second: Tensor,
    confidence: float = 0.95,
    *,
    num_resamples: int = 10_000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """The mean difference ``mean(first - second)`` of paired outcomes and its interval.

    Episode ``i`` of both tensors must come from the same initial state (and initial noise):
    the bootstrap resamples episode indices with replacement, keeping each pair together, and
    reports the percentile interval of the resampled mean difference. Seeded: the same
    inputs give the same interval.

    Args:
        first: ``[n]`` outcomes (success flags or returns) of one checkpoint.
        second: ``[n]`` outcomes of the other, on the same episodes.
        confidence: the interval's coverage.
        num_resamples: bootstrap resamples.
        seed: seed of the resampling.

    Returns:
        ``(difference, low, high)``.

    Examples:
        >>> rl = torch.tensor([1, 1, 1, 0] * 50)
        >>> bc = torch.tensor([1, 0, 0, 0] * 50)
        >>> difference, low, high = paired_bootstrap_interval(rl, bc)
        >>> difference, low > 0.4, high < 0.6
        (0.5, True, True)
    """
    _normal_quantile(confidence)  # validates it
    if first.ndim != 1 or first.shape != second.shape or first.numel() == 0:
        raise ValueError(
            f"first and second must be 1-D outcomes of the same episodes, got shapes "
            f"{tuple(first.shape)} and {tuple(second.shape)}."
        )
    differences = first.to(torch.float64) - second.to(torch.float64)
    generator = torch.Generator().manual_seed(seed)
    count = differences.numel()
    index = torch.randint(0, count, (num_resamples, count), generator=generator)
    means = differences[index].mean(-1)
    tail = (1 - confidence) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=torch.float64))
    return differences.mean().item(), low.item(), high.item()
