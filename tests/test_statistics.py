"""Tests of the evaluation protocol's intervals against closed forms and known values."""

from __future__ import annotations

import math

import pytest
import torch

from torchrl_flowpolicy.training.statistics import paired_bootstrap_interval, wilson_interval


@pytest.mark.parametrize(
    "successes, trials, expected",
    # The Wilson interval at 95 % worked by hand: center (p + z^2/2n) / (1 + z^2/n),
    # half-width z / (1 + z^2/n) * sqrt(p (1 - p) / n + z^2 / 4n^2), z = 1.959964.
    [
        (5, 10, (0.2366, 0.7634)),
        (0, 10, (0.0, 0.2775)),
        (10, 10, (0.7225, 1.0)),
        (170, 200, (0.7939, 0.8929)),
    ],
)
def test_wilson_interval_known_values(successes, trials, expected):
    low, high = wilson_interval(successes, trials)
    assert low == pytest.approx(expected[0], abs=1e-4)
    assert high == pytest.approx(expected[1], abs=1e-4)


def test_wilson_interval_matches_the_normal_interval_for_large_samples():
    successes, trials = 60_000, 100_000
    rate = successes / trials
    half = 1.959964 * math.sqrt(rate * (1 - rate) / trials)
    low, high = wilson_interval(successes, trials)
    assert low == pytest.approx(rate - half, abs=1e-5)
    assert high == pytest.approx(rate + half, abs=1e-5)


def test_paired_bootstrap_matches_the_normal_approximation_and_is_seeded():
    generator = torch.Generator().manual_seed(0)
    first = torch.rand(400, generator=generator) < 0.7
    second = first & (torch.rand(400, generator=generator) < 0.8)  # paired: mostly agree
    difference, low, high = paired_bootstrap_interval(first, second)
    differences = first.double() - second.double()
    standard_error = differences.std(correction=0).item() / math.sqrt(400)
    assert difference == pytest.approx(differences.mean().item())
    assert low == pytest.approx(difference - 1.96 * standard_error, abs=0.01)
    assert high == pytest.approx(difference + 1.96 * standard_error, abs=0.01)
    assert paired_bootstrap_interval(first, second) == (difference, low, high)
    # Pairing matters: the interval of two independent rates would be much wider.
    independent_width = (
        2
        * 1.96
        * math.sqrt(sum(x.double().mean() * (1 - x.double().mean()) / 400 for x in (first, second)))
    )
    assert high - low < 0.6 * independent_width


def test_paired_bootstrap_degenerate_and_bad_inputs():
    same = torch.tensor([1.0, 0.0, 1.0])
    assert paired_bootstrap_interval(same, same) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="same episodes"):
        paired_bootstrap_interval(torch.ones(3), torch.ones(4))
    with pytest.raises(ValueError, match="successes <= trials"):
        wilson_interval(11, 10)
    with pytest.raises(ValueError, match="confidence"):
        wilson_interval(1, 10, confidence=1.5)
