"""The evaluation protocol: disjoint seed ranges, the expert beside the policies, intervals.

**Seed ranges.** An evaluation of ``n`` episodes from seed ``s`` resets the environments of
a batch with the seeds ``s, s + 1, ..., s + n - 1`` (a batched environment seeds its
sub-environment ``i`` with ``s + i``) and seeds the policy's noise with ``s``
(:func:`~torchrl_flowpolicy.training.evaluation.evaluate_episodes`). Three disjoint ranges of
``SPLIT_SIZE = 10_000`` seeds, one per purpose:

| split | reset seeds | used for |
| --- | --- | --- |
| ``"curve"`` | 10_000-19_999 | learning curves (a run's periodic evaluations, the pretraining's parity check) |
| ``"validation"`` | 20_000-29_999 | choosing defaults, hyper-parameters, the reported decoding |
| ``"held_out"`` | 30_000-39_999 | the final numbers only; nothing else uses it |

Nothing else resets an environment with a seed in ``[10_000, 40_000)``:

- Demonstrations (:func:`~torchrl_flowpolicy.tasks.collect_demos`) reset episode ``i`` with
  ``demo_seed * 1_000_003 + i``: ``0 ... n - 1`` for ``demo_seed = 0`` (below 10_000 for
  ``n <= 10_000`` episodes), at least 1_000_003 for ``demo_seed >= 1``.
- Training environments: every PPO batch starts from fresh resets seeded with
  :func:`training_seed`, a pure function of the run seed, the iteration and the
  sub-environment (sub-environment ``i`` of iteration ``n``'s batch: ``seed + i < 10_000``
  for the first batch, at least 40_000 for the later ones), so that a resumed run starts
  each batch from the states of the uninterrupted run. The resets within a batch (after an
  episode that ends early) continue each sub-environment's own random stream and take no
  seed. DSRL's collector seeds its environments once, at its start, the same way.
- Grouped training (``--advantage grpo``: group-relative advantages) seeds groups instead
  of sub-environments: group ``g`` of iteration ``n``'s batch resets with
  :func:`training_seed` ``(seed, n, num_groups) + g``, every sub-environment of the group
  with that seed.

**Protocol.** On the held-out split, :func:`protocol_summary` puts the pretrained (BC)
policy's two decodings, the fine-tuned (RL) policy's two decodings
(:func:`~torchrl_flowpolicy.training.evaluation.evaluate_decodings`) and the clean scripted expert
(:func:`evaluate_expert`), all on the same episodes, side by side: success rates with Wilson
95 % intervals, and RL's paired differences to BC's best decoding and to the expert with
paired percentile-bootstrap intervals (:mod:`~torchrl_flowpolicy.training.statistics`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from torch import Tensor

from torchrl_flowpolicy.training.evaluation import DECODINGS, Decoding, evaluate_episodes
from torchrl_flowpolicy.training.statistics import paired_bootstrap_interval, wilson_interval

__all__ = [
    "CURVE_SEED",
    "VALIDATION_SEED",
    "HELD_OUT_SEED",
    "SPLIT_SIZE",
    "SPLIT_SEEDS",
    "split_seed",
    "training_seed",
    "evaluate_expert",
    "protocol_summary",
    "format_protocol",
]

Split = Literal["curve", "validation", "held_out"]

CURVE_SEED = 10_000
"""First reset seed of the learning-curve evaluations."""
VALIDATION_SEED = 20_000
"""First reset seed of the validation evaluations (choosing defaults and hyper-parameters)."""
HELD_OUT_SEED = 30_000
"""First reset seed of the held-out evaluation (final numbers only)."""
SPLIT_SIZE = 10_000
"""Seeds per split: an evaluation holds at most this many episodes."""
SPLIT_SEEDS: dict[Split, int] = {
    "curve": CURVE_SEED,
    "validation": VALIDATION_SEED,
    "held_out": HELD_OUT_SEED,
}


def split_seed(split: Split, num_episodes: int) -> int:
    """The first reset seed of ``split``, checking that ``num_episodes`` stay inside it.

    Examples:
        >>> split_seed("held_out", 200)
        30000
    """
    if split not in SPLIT_SEEDS:
        raise ValueError(f"unknown split {split!r}: use one of {list(SPLIT_SEEDS)}.")
    if not 1 <= num_episodes <= SPLIT_SIZE:
        raise ValueError(f"an evaluation holds 1 to {SPLIT_SIZE} episodes, got {num_episodes}.")
    return SPLIT_SEEDS[split]


def training_seed(seed: int, iteration: int, num_envs: int) -> int:
    """The first reset seed of the training batch of PPO iteration ``iteration`` (1, 2, ...).

    Sub-environment ``i`` of that batch resets with ``training_seed(...) + i``. The first
    batch uses ``seed``, below every evaluation split; iteration ``n >= 2`` uses
    ``40_000 + ((n - 2) * 10_000 + seed) * num_envs``, above them: one block of ``num_envs``
    seeds per (run seed, iteration), so that no two batches of a run, nor two runs of
    different seeds after their first batch, start from the same states.

    Args:
        seed: the run's seed, in ``[0, 10_000 - num_envs]``.
        iteration: the PPO iteration whose batch starts (1 for a run's first batch).
        num_envs: the training environments of the batch (of all processes together).

    Raises:
        ValueError: when ``seed, ..., seed + num_envs - 1`` would reach the evaluation seeds,
            or ``iteration < 1``.

    Examples:
        >>> training_seed(0, 1, 16), training_seed(0, 2, 16), training_seed(3, 2, 16)
        (0, 40000, 40048)
        >>> training_seed(0, 3, 16)
        200000
    """
    if not 0 <= seed <= CURVE_SEED - num_envs:
        raise ValueError(
            f"run seeds must lie in [0, {CURVE_SEED - num_envs}] so that the training "
            f"environments never reset with an evaluation seed; got {seed}."
        )
    if iteration < 1:
        raise ValueError(f"iteration counts PPO iterations from 1, got {iteration}.")
    if iteration == 1:
        return seed
    return HELD_OUT_SEED + SPLIT_SIZE + ((iteration - 2) * CURVE_SEED + seed) * num_envs


def evaluate_expert(
    num_episodes: int,
    *,
    seed: int,
    task: str = "pusher",
    max_envs: int | None = None,
    **task_options: Any,
) -> dict[str, Tensor]:
    """The clean scripted expert (no action noise) on ``num_episodes`` seeded episodes.

    It runs in the task's environment with ``num_episodes`` sub-environments and one action
    per step (``get_task(task).make_env(num_episodes, None, **task_options)``: the same task
    transform and reward as the policies'), seeded as
    :func:`~torchrl_flowpolicy.training.evaluation.evaluate_episodes`: episode ``i`` starts from the
    state of reset seed ``seed + i``, the same as a policy's episode ``i`` in a chunked
    environment of the same size.

    Args:
        num_episodes: the number of episodes (one per sub-environment).

    Keyword Args:
        seed: the first reset seed.
        task: the task's name (:func:`~torchrl_flowpolicy.tasks.registry.get_task`).
        max_envs: at most this many sub-environments; more episodes run in rounds
            (:func:`~torchrl_flowpolicy.training.evaluation.evaluate_episodes`). Default: the task's
            ``max_eval_envs``.
        **task_options: the task's environment options
            (:attr:`~torchrl_flowpolicy.tasks.registry.Task.option_names`); ``max_episode_steps``
            defaults to the task's horizon
            (:attr:`~torchrl_flowpolicy.tasks.registry.Task.max_episode_steps`), the others to
            the environment's defaults.

    Returns:
        ``{"return", "success", "length"}``, each ``[num_episodes]``.
    """
    # Imported here: the environments need the simulators (the ``envs`` extra), the rest of
    # this module does not.
    from torchrl_flowpolicy.tasks.registry import get_task

    spec = get_task(task)
    options = {"max_episode_steps": spec.max_episode_steps, **task_options}
    max_envs = spec.max_eval_envs if max_envs is None else max_envs
    env = spec.make_env(min(num_episodes, max_envs or num_episodes), None, **options)
    try:
        expert = spec.make_expert(env)
        return evaluate_episodes(
            expert,
            env,
            max_decisions=options["max_episode_steps"],
            seed=seed,
            num_episodes=num_episodes,
        )
    finally:
        env.close()


def protocol_summary(
    bc: Mapping[Decoding, Mapping[str, Tensor]],
    rl: Mapping[Decoding, Mapping[str, Tensor]],
    expert: Mapping[str, Tensor],
    *,
    reported_decoding: Decoding,
    confidence: float = 0.95,
    num_resamples: int = 10_000,
    seed: int = 0,
) -> dict:
    """The protocol's numbers, JSON-able: BC and RL under both decodings beside the expert.

    BC's *best* decoding is the one with the higher success rate (ties: the higher mean
    return, then ``"sampled"``). For each RL decoding the paired differences
    ``RL - BC best`` and ``RL - expert`` of the per-episode success are bounded with
    :func:`~torchrl_flowpolicy.training.statistics.paired_bootstrap_interval`; the success
    rates with :func:`~torchrl_flowpolicy.training.statistics.wilson_interval`.
    ``reported_decoding`` names the RL decoding that is the headline (chosen beforehand, on validation states).

    Args:
        bc: the pretrained policy's outcomes per decoding, from
            :func:`~torchrl_flowpolicy.training.evaluation.evaluate_decodings`.
        rl: the fine-tuned policy's, on the same episodes.
        expert: the expert's (:func:`evaluate_expert`), on the same episodes.

    Keyword Args:
        reported_decoding: the RL decoding of the headline.
        confidence: the coverage of every interval.
        num_resamples: bootstrap resamples.
        seed: seed of the bootstrap.

    Returns:
        ``num_episodes``, ``confidence``, ``intervals`` (the methods, in words),
        ``reported_decoding``, ``bc_best_decoding``; ``success`` and ``mean_return`` as
        ``{"bc": {decoding: ...}, "rl": {decoding: ...}, "expert": ...}`` (a success entry is
        ``{"rate", "low", "high"}``); ``rl_minus_bc_best`` and ``rl_minus_expert`` as
        ``{decoding: {"difference", "low", "high"}}``; ``episode_success`` (0/1 lists in the
        same layout), from which any further paired statistic can be computed.
    """
    if reported_decoding not in DECODINGS:
        raise ValueError(f"unknown decoding {reported_decoding!r}: use one of {list(DECODINGS)}.")
    shapes = {bc[name]["success"].shape for name in DECODINGS}
    shapes |= {rl[name]["success"].shape for name in DECODINGS} | {expert["success"].shape}
    if len(shapes) != 1:
        raise ValueError(f"every evaluation must hold the same episodes; got shapes {shapes}.")

    def layout(statistic: Callable[[Mapping[str, Tensor]], Any]) -> dict[str, Any]:
        """``statistic`` of every evaluation: ``{"bc": {decoding: .}, "rl": {.}, "expert": .}``."""
        return {
            "bc": {name: statistic(bc[name]) for name in DECODINGS},
            "rl": {name: statistic(rl[name]) for name in DECODINGS},
            "expert": statistic(expert),
        }

    def success(outcomes: Mapping[str, Tensor]) -> dict[str, float]:
        successes, trials = int(outcomes["success"].sum()), outcomes["success"].numel()
        low, high = wilson_interval(successes, trials, confidence)
        return {"rate": successes / trials, "low": low, "high": high}

    def mean_return(outcomes: Mapping[str, Tensor]) -> float:
        return outcomes["return"].double().mean().item()

    def difference(first: Tensor, second: Tensor) -> dict[str, float]:
        value, low, high = paired_bootstrap_interval(
            first, second, confidence, num_resamples=num_resamples, seed=seed
        )
        return {"difference": value, "low": low, "high": high}

    best = max(
        DECODINGS,
        key=lambda name: (success(bc[name])["rate"], mean_return(bc[name]), name == "sampled"),
    )
    return {
        "num_episodes": int(expert["success"].numel()),
        "confidence": confidence,
        "intervals": (
            "success rates: Wilson score interval; differences: paired percentile bootstrap "
            f"over episodes ({num_resamples} resamples, seed {seed})"
        ),
        "reported_decoding": reported_decoding,
        "bc_best_decoding": best,
        "success": layout(success),
        "mean_return": layout(mean_return),
        "rl_minus_bc_best": {
            name: difference(rl[name]["success"], bc[best]["success"]) for name in DECODINGS
        },
        "rl_minus_expert": {
            name: difference(rl[name]["success"], expert["success"]) for name in DECODINGS
        },
        "episode_success": layout(lambda outcomes: outcomes["success"].int().tolist()),
    }


def format_protocol(summary: Mapping, name: str = "RL") -> str:
    """One line: RL (reported decoding) against BC's best decoding and the expert.

    Examples:
        >>> import torch
        >>> ones, zeros = torch.ones(4, dtype=torch.bool), torch.zeros(4, dtype=torch.bool)
        >>> outcomes = {"success": ones, "return": ones.float()}
        >>> bc = {"sampled": {"success": zeros, "return": zeros.float()}, "noise_free": outcomes}
        >>> summary = protocol_summary(bc, bc, outcomes, reported_decoding="noise_free")
        >>> format_protocol(summary, "PPO")[:62]
        'PPO (noise-free) 100.0% [51.0, 100.0] vs BC best (noise-free) '
    """

    def rate(entry: Mapping) -> str:
        return f"{entry['rate']:.1%} [{100 * entry['low']:.1f}, {100 * entry['high']:.1f}]"

    def points(entry: Mapping) -> str:
        return (
            f"{100 * entry['difference']:+.1f} points "
            f"[{100 * entry['low']:+.1f}, {100 * entry['high']:+.1f}]"
        )

    reported, best = summary["reported_decoding"], summary["bc_best_decoding"]
    success = summary["success"]
    return (
        f"{name} ({reported.replace('_', '-')}) {rate(success['rl'][reported])} vs BC best "
        f"({best.replace('_', '-')}) {rate(success['bc'][best])}: "
        f"{points(summary['rl_minus_bc_best'][reported])}; expert {rate(success['expert'])}: "
        f"{points(summary['rl_minus_expert'][reported])} "
        f"({summary['num_episodes']} episodes, {100 * summary['confidence']:.0f} % intervals)"
    )
