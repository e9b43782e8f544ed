"""Group-relative advantages: closed forms, degenerate groups, episode boundaries, TorchRL's
``MCAdvantage`` on the same complete episodes."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict
from torchrl.objectives.llm import MCAdvantage

from torchrl_flowpolicy.objectives import (
    GroupRelativeAdvantage,
    first_episode_mask,
    group_relative_advantage,
)

SQRT_HALF = math.sqrt(0.5)


# ----------------------------------------------------------------------------- the formula
def test_closed_form_per_group_with_bessel_std():
    # group 0: returns 1, 2, 3 (mean 2, std 1); group 1: 0, 4 (mean 2, std 2 * sqrt(2)).
    returns = torch.tensor([1.0, 0.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    group_ids = torch.tensor([7, 3, 7, 7, 3])  # any ids, in any order
    advantage = group_relative_advantage(returns, group_ids, eps=0.0)
    expected = torch.tensor([-1.0, -SQRT_HALF, 0.0, 1.0, SQRT_HALF], dtype=torch.float64)
    torch.testing.assert_close(advantage, expected)
    # with eps: divided by (std + eps)
    advantage = group_relative_advantage(returns, group_ids, eps=0.5)
    std = torch.tensor([1.0, 8**0.5, 1.0, 1.0, 8**0.5], dtype=torch.float64)
    centered = torch.tensor([-1.0, -2.0, 0.0, 1.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(advantage, centered / (std + 0.5))


def test_sparse_success_returns():
    # 0/1 returns, k successes in a group of G: mean p = k / G, std sqrt(G p (1 - p) / (G - 1)).
    returns = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    advantage = group_relative_advantage(returns, group_ids, eps=0.0)
    # group 0: one success in 4: mean 1/4, std sqrt(3/4 * 1/4 * 4/3) = 1/2
    # group 1: three in 4: mean 3/4, std 1/2
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5, 0.5, 0.5, 0.5, -1.5])
    torch.testing.assert_close(advantage, expected)
    assert advantage.dtype == torch.float32
    # every group sums to zero
    assert advantage[:4].sum().abs() < 1e-6 and advantage[4:].sum().abs() < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("eps", [0.0, 1e-6])
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 0.3, -17.25])
def test_a_group_of_equal_returns_has_zero_advantage(value, eps, dtype):
    # Without the rule: 0 / 0 at eps = 0, and rounding (three float64 returns of 0.1 have a
    # computed mean 1.4e-17 off) gives advantages of -0.82 at eps = 0.
    returns = torch.tensor([value] * 3 + [0.0, 1.0], dtype=dtype)
    group_ids = torch.tensor([0] * 3 + [1, 1])
    advantage = group_relative_advantage(returns, group_ids, eps=eps)
    assert torch.isfinite(advantage).all()
    assert (advantage[:3] == 0).all(), advantage
    expected = torch.tensor([-SQRT_HALF, SQRT_HALF], dtype=dtype)
    torch.testing.assert_close(advantage[3:], expected, rtol=1e-5, atol=0.0)


def test_all_groups_degenerate_give_all_zeros():
    advantage = group_relative_advantage(torch.zeros(6), torch.tensor([0, 0, 1, 1, 2, 2]))
    assert torch.equal(advantage, torch.zeros(6))


def test_shapes_are_kept():
    returns = torch.arange(12.0).reshape(3, 4)
    group_ids = torch.arange(12).reshape(3, 4) // 2
    advantage = group_relative_advantage(returns, group_ids, eps=0.0)
    assert advantage.shape == (3, 4)
    torch.testing.assert_close(advantage, torch.tensor([-SQRT_HALF, SQRT_HALF]).repeat(3, 2))


@pytest.mark.parametrize(
    ("returns", "group_ids", "match"),
    [
        (torch.zeros(3), torch.tensor([0, 0, 1]), "single episode"),
        (torch.zeros(2), torch.tensor([0.0, 0.0]), "integers"),
        (torch.zeros(2), torch.tensor([0, 0, 0]), "same shape"),
        (torch.tensor([0.0, math.nan]), torch.tensor([0, 0]), "not finite"),
        (torch.tensor([0.0, math.inf]), torch.tensor([0, 0]), "not finite"),
    ],
)
def test_bad_input_is_refused(returns, group_ids, match):
    with pytest.raises(ValueError, match=match):
        group_relative_advantage(returns, group_ids)


# ----------------------------------------------------------------------------- the batch
def test_first_episode_mask():
    done = torch.tensor(
        [
            [False, True, False, True],  # two episodes: the first is 2 decisions long
            [False, False, False, True],
            [True, True, True, True],
            [False, False, False, False],  # no done: everything
        ]
    )
    expected = torch.tensor(
        [
            [True, True, False, False],
            [True, True, True, True],
            [True, False, False, False],
            [True, True, True, True],
        ]
    )
    assert torch.equal(first_episode_mask(done), expected)


def collector_batch() -> TensorDict:
    """4 environments in 2 groups, 5 decisions each; env 1's and env 2's episodes end early
    (success) and the collector starts new ones, whose rewards must not count."""
    reward = torch.tensor(
        [
            [0.0, 0.5, 0.0, 0.0, 0.5],  # return 1.0, ends at t = 4
            [1.0, 2.0, 9.0, 9.0, 9.0],  # return 3.0, ends at t = 1
            [0.0, 0.0, 9.0, 9.0, 9.0],  # return 0.0, ends at t = 1
            [1.0, 1.0, 0.0, 0.0, 0.0],  # return 2.0, ends at t = 4
        ]
    )
    done = torch.zeros(4, 5, dtype=torch.bool)
    done[[0, 3], 4] = True
    done[[1, 2], 1] = True
    done[1, 3] = True  # a second, short episode: after the first, ignored
    return TensorDict(
        {
            "group_id": (torch.arange(4) // 2).unsqueeze(-1).expand(4, 5),
            "next": {"reward": reward.unsqueeze(-1), "done": done.unsqueeze(-1)},
        },
        batch_size=[4, 5],
    )


def test_module_scores_each_rows_first_episode():
    batch = GroupRelativeAdvantage(eps=0.0)(collector_batch())
    # group 0: returns 1, 3 -> -+1/sqrt(2); group 1: returns 0, 2 -> -+1/sqrt(2)
    per_row = torch.tensor([-SQRT_HALF, SQRT_HALF, -SQRT_HALF, SQRT_HALF])
    lengths = torch.tensor([5, 2, 2, 5])
    mask = torch.arange(5) < lengths.unsqueeze(-1)
    assert torch.equal(batch["episode_mask"], mask)
    assert batch["advantage"].shape == (4, 5, 1)
    expected = torch.where(mask, per_row.unsqueeze(-1), torch.zeros(()))
    torch.testing.assert_close(batch["advantage"].squeeze(-1), expected)
    returns = torch.tensor([1.0, 3.0, 0.0, 2.0])
    torch.testing.assert_close(
        batch["episode_return"].squeeze(-1), torch.where(mask, returns.unsqueeze(-1), 0.0)
    )
    kept = batch[batch["episode_mask"]]
    assert kept.batch_size == (14,)
    assert (kept["next", "reward"] < 9).all()  # no decision of a later episode is kept


def test_module_agrees_with_torchrl_mc_advantage_on_complete_episodes():
    """TorchRL's ``MCAdvantage`` (``trajectory_return="sum"``) on the rows' first episodes,
    cut out of the batch as complete trajectories, gives the same advantages."""
    generator = torch.Generator().manual_seed(0)
    num_envs, horizon, group_size = 8, 6, 4
    reward = torch.rand(num_envs, horizon, 1, generator=generator)
    lengths = torch.tensor([6, 3, 6, 1, 4, 6, 2, 6])
    done = (torch.arange(horizon) == (lengths - 1).unsqueeze(-1)).unsqueeze(-1)
    batch = TensorDict(
        {
            "group_id": (torch.arange(num_envs) // group_size).unsqueeze(-1).expand(-1, horizon),
            "next": {"reward": reward, "done": done},
        },
        batch_size=[num_envs, horizon],
    )
    ours = GroupRelativeAdvantage()(batch.clone())
    with pytest.raises(RuntimeError, match="done"):  # the raw batch: rows that do not end
        MCAdvantage(group_size, prompt_key="group_id", trajectory_return="sum").inv(
            TensorDict(
                {"group_id": batch["group_id"], "next": {"reward": reward, "done": done & False}},
                batch_size=[num_envs, horizon],
            )
        )
    transform = MCAdvantage(group_size, prompt_key="group_id", trajectory_return="sum")
    theirs = [transform.inv(batch[row, : lengths[row]]) for row in range(num_envs)]
    theirs = torch.cat([out["advantage"] for out in theirs if out is not None])
    kept = ours[ours["episode_mask"]]  # row-major: the rows in order, as MCAdvantage returns
    torch.testing.assert_close(kept["advantage"], theirs, rtol=1e-5, atol=1e-5)


def test_module_refuses_unfinished_rows_varying_groups_and_flat_batches():
    batch = collector_batch()
    unfinished = batch.clone()
    unfinished["next", "done"][0] = False
    with pytest.raises(ValueError, match="1 of 4 rows hold no done"):
        GroupRelativeAdvantage()(unfinished)
    varying = batch.clone()
    varying["group_id"] = torch.arange(4 * 5).reshape(4, 5) // 3  # row 0: 0, 0, 0, 1, 1
    with pytest.raises(ValueError, match="changes along a row"):
        GroupRelativeAdvantage()(varying)
    with pytest.raises(ValueError, match=r"\[\*B, T\] batch"):
        GroupRelativeAdvantage()(batch[:, 0])
    with pytest.raises(KeyError, match="group_id"):
        GroupRelativeAdvantage()(batch.exclude("group_id"))


def test_set_keys_reads_and_writes_renamed_entries():
    batch = collector_batch()
    batch.rename_key_("group_id", ("collector", "group"))
    batch.rename_key_(("next", "reward"), ("next", "task_reward"))
    module = GroupRelativeAdvantage(eps=0.0)
    module.set_keys(
        group_id=("collector", "group"),
        reward=("next", "task_reward"),
        advantage=("grpo", "advantage"),
    )
    assert module.in_keys == [("next", "task_reward"), ("next", "done"), ("collector", "group")]
    assert ("grpo", "advantage") in module.out_keys
    out = module(batch)
    torch.testing.assert_close(
        out["grpo", "advantage"][:, 0, 0], torch.tensor([-1.0, 1, -1, 1]) * SQRT_HALF
    )
    with pytest.raises(ValueError, match="unknown key"):
        module.set_keys(value="state_value")
