"""Seeded evaluation of a policy on a batch of episodes, under either decoding.

Every evaluation re-seeds the environments and torch's RNG (in a forked state) with its
seed, so two checkpoints, or two decodings of one, evaluated with the same seed see the
same initial states and the same initial noise: their per-episode outcomes are paired.
Which seeds to use is the protocol's business (:mod:`~torchrl_flowpolicy.training.protocol`).

**Decodings.** A flow policy is evaluated under two decodings (:func:`evaluate_decodings`):
``"sampled"``, its deterministic ODE from ``x_0 ~ N(0, I)`` (the model's own chunk
distribution), and ``"noise_free"``, the ODE from ``x_0 = 0``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import Tensor
from torchrl.envs import EnvBase
from torchrl.envs.utils import ExplorationType, set_exploration_type

from torchrl_flowpolicy.policy import FlowSDEPolicy

__all__ = [
    "DECODINGS",
    "episode_outcomes",
    "evaluate_episodes",
    "evaluate_policy",
    "decoding",
    "decoding_label",
    "evaluate_decodings",
]

Decoding = Literal["sampled", "noise_free"]
DECODINGS: tuple[Decoding, ...] = ("sampled", "noise_free")
# The scale of x_0 = scale * N(0, I) each decoding starts its ODE from.
_DECODING_NOISE_SCALES: dict[Decoding, float] = {"sampled": 1.0, "noise_free": 0.0}


def episode_outcomes(
    rollout: TensorDictBase, success_key: NestedKey = "success"
) -> dict[str, torch.Tensor]:
    """Per-episode return and success of a rollout ``[num_envs, T]``.

    Each environment's episode ends at its first ``("next", "done")``; the return sums the
    rewards up to and including that step; success is ``("next", success_key)`` at that step.
    An environment that never finished counts its whole rollout and its last step.

    Returns:
        ``{"return": [num_envs], "success": [num_envs] bool, "length": [num_envs]}``.
    """
    done = rollout.get(("next", "done")).reshape(rollout.shape[0], rollout.shape[1])
    num_steps = done.shape[1]
    steps = torch.arange(num_steps, device=done.device).expand_as(done)
    last = torch.where(done, steps, torch.full_like(steps, num_steps - 1)).min(dim=1).values
    reward = rollout.get(("next", "reward")).reshape(done.shape)
    within = steps <= last[:, None]
    episode_return = (reward * within).sum(1)
    rows = torch.arange(done.shape[0], device=done.device)
    success = rollout.get(("next", success_key)).reshape(done.shape)[rows, last].bool()
    return {"return": episode_return, "success": success, "length": last + 1}


@torch.no_grad()
def evaluate_episodes(
    policy: TensorDictModuleBase,
    env: EnvBase,
    *,
    max_decisions: int,
    seed: int,
    exploration_type: ExplorationType = ExplorationType.DETERMINISTIC,
    success_key: NestedKey = "success",
    num_episodes: int | None = None,
    details: Callable[[TensorDictBase, dict[str, Tensor]], dict[str, Tensor]] | None = None,
) -> dict[str, Tensor]:
    """Run one episode in each of ``env``'s batched environments; per-episode outcomes.

    ``env`` is seeded with ``seed`` before its reset and torch's global RNG with ``seed``
    inside a forked RNG state, so the same ``seed`` gives the same initial states and the
    same policy noise (a flow policy's ``x_0``). The caller's random stream is left
    untouched. Arguments as for :func:`evaluate_policy`.

    With ``num_episodes`` larger than the batch ``N`` (simulators too heavy to hold one per
    episode, such as robosuite's), the episodes run in rounds of ``N``: round ``r`` seeds
    the environments and torch with ``seed + r N``, so episode ``i`` still starts from reset
    seed ``seed + i``, and the outcomes stay paired across policies evaluated with the same
    ``N``. The last round's extra episodes are dropped.

    ``details(rollout, outcomes)`` adds per-episode entries ``[N]`` read from each round's
    rollout ``[N, T]`` (such as
    :func:`~torchrl_flowpolicy.tasks.robosuite.can_outcomes.can_rollout_outcomes`: why each
    PickPlaceCan episode failed).

    Returns:
        :func:`episode_outcomes` of the rollout: ``"return"``, ``"success"``, ``"length"``,
        and the ``details``' entries, each ``[num_episodes]`` (default: ``[N]``).
    """
    batch = env.batch_size[0] if env.batch_size else 1
    num_episodes = batch if num_episodes is None else num_episodes
    if num_episodes < 1:
        raise ValueError(f"num_episodes must be >= 1, got {num_episodes}.")
    rounds = []
    for first in range(0, num_episodes, batch):
        env.set_seed(seed + first)
        # The policy's own randomness (a flow policy's initial noise) is seeded too, in a
        # forked RNG so that evaluating does not change the caller's random stream.
        with torch.random.fork_rng(devices=[]), set_exploration_type(exploration_type):
            torch.manual_seed(seed + first)
            rollout = env.rollout(
                max_decisions, policy, break_when_any_done=False, break_when_all_done=True
            )
        if rollout.ndim == 1:
            rollout = rollout.unsqueeze(0)
        outcomes = episode_outcomes(rollout, success_key)
        if details is not None:
            outcomes |= details(rollout, outcomes)
        rounds.append(outcomes)
    return {
        key: torch.cat([outcomes[key] for outcomes in rounds])[:num_episodes] for key in rounds[0]
    }


def evaluate_policy(
    policy: TensorDictModuleBase,
    env: EnvBase,
    *,
    max_decisions: int,
    seed: int,
    exploration_type: ExplorationType = ExplorationType.DETERMINISTIC,
    success_key: NestedKey = "success",
    num_episodes: int | None = None,
) -> dict[str, float]:
    """Run one episode in each of ``env``'s batched environments and summarise them.

    Seeded as :func:`evaluate_episodes`: use a fixed evaluation seed (one of the
    :mod:`~torchrl_flowpolicy.training.protocol`'s splits) to compare checkpoints. Under the default DETERMINISTIC exploration a
    :class:`~torchrl_flowpolicy.FlowSDEPolicy` runs its ODE with ``eval_num_denoising_steps`` from
    ``x_0 = eval_noise_scale * N(0, I)``.

    Args:
        policy: the policy to evaluate.
        env: a batched environment (``env.batch_size = [num_episodes]``) writing
            ``("next", success_key)``.

    Keyword Args:
        max_decisions: the rollout length in decisions (macro-steps).
        seed: the evaluation seed.
        exploration_type: DETERMINISTIC (default) or RANDOM (the rollout policy).
        success_key: the success entry.
        num_episodes: the number of episodes (default: the batch size; more run in rounds,
            see :func:`evaluate_episodes`).

    Returns:
        ``success_rate``, ``mean_return``, ``num_episodes`` and ``seconds``.
    """
    start = time.perf_counter()
    outcomes = evaluate_episodes(
        policy,
        env,
        max_decisions=max_decisions,
        seed=seed,
        exploration_type=exploration_type,
        success_key=success_key,
        num_episodes=num_episodes,
    )
    return {
        "success_rate": outcomes["success"].float().mean().item(),
        "mean_return": outcomes["return"].float().mean().item(),
        "num_episodes": int(outcomes["success"].numel()),
        "seconds": time.perf_counter() - start,
    }


@contextmanager
def decoding(policy: FlowSDEPolicy, name: Decoding) -> Iterator[FlowSDEPolicy]:
    """Set a flow policy's deterministic decoding within the block, then restore it.

    ``"sampled"``: the ODE from ``x_0 ~ N(0, I)`` (``eval_noise_scale = 1``);
    ``"noise_free"``: from ``x_0 = 0`` (``eval_noise_scale = 0``). Both draw the same
    ``randn`` (scaled), so the random stream after a decision does not depend on the decoding.
    """
    if name not in DECODINGS:
        raise ValueError(f"unknown decoding {name!r}: use one of {list(DECODINGS)}.")
    previous = policy.options
    wanted = previous.replace(eval_noise_scale=_DECODING_NOISE_SCALES[name])
    if wanted != previous:  # setting options checks them: only when they change
        policy.options = wanted
    try:
        yield policy
    finally:
        if policy.options != previous:
            policy.options = previous


def decoding_label(eval_noise_scale: float) -> str:
    """How a deterministic evaluation from ``x_0 = eval_noise_scale * N(0, I)`` is named in
    reports and figures: ``"sampled"`` at 1, ``"noise-free"`` at 0, the scale otherwise.

    Example:
        >>> decoding_label(0.0), decoding_label(1.0), decoding_label(0.5)
        ('noise-free', 'sampled', 'x_0 = 0.5 N(0, I)')
    """
    if eval_noise_scale < 0:
        raise ValueError(f"eval_noise_scale must be >= 0, got {eval_noise_scale}.")
    for name, scale in _DECODING_NOISE_SCALES.items():
        if float(eval_noise_scale) == scale:
            return name.replace("_", "-")
    return f"x_0 = {eval_noise_scale:g} N(0, I)"


def evaluate_decodings(
    policy: TensorDictModuleBase,
    env: EnvBase,
    *,
    max_decisions: int,
    seed: int,
    success_key: NestedKey = "success",
    num_episodes: int | None = None,
) -> dict[Decoding, dict[str, Tensor]]:
    """Evaluate ``policy`` under both decodings, on the same states and the same noise.

    | policy | ``"sampled"`` | ``"noise_free"`` |
    | --- | --- | --- |
    | :class:`~torchrl_flowpolicy.FlowSDEPolicy` | ODE from ``x_0 ~ N(0, I)`` | ODE from ``x_0 = 0`` |
    | any other (DSRL's noise actor) | RANDOM: the actor samples | DETERMINISTIC: its mean |

    ``num_episodes`` (default: the batch size) runs the episodes in rounds, as in
    :func:`evaluate_episodes`.

    Returns:
        ``{decoding: {"return", "success", "length"}}``, each ``[num_episodes]``
        (:func:`evaluate_episodes`), episode ``i`` of both from the same initial state.

    Examples:
        >>> from torchrl_flowpolicy.tasks import make_pusher_env
        >>> from torchrl_flowpolicy.networks import MLPVelocityNetwork
        >>> network = MLPVelocityNetwork(observation_dim=23, action_shape=(4, 7))
        >>> policy = FlowSDEPolicy(network, action_shape=(4, 7), executed_chunk_length=2)
        >>> env = make_pusher_env(3, executed_chunk_length=2, max_episode_steps=6)
        >>> outcomes = evaluate_decodings(policy, env, max_decisions=3, seed=20_000)
        >>> sorted(outcomes), outcomes["noise_free"]["success"].shape
        (['noise_free', 'sampled'], torch.Size([3]))
    """
    options = {
        "max_decisions": max_decisions,
        "seed": seed,
        "success_key": success_key,
        "num_episodes": num_episodes,
    }
    if isinstance(policy, FlowSDEPolicy):
        outcomes = {}
        for name in DECODINGS:
            with decoding(policy, name):
                outcomes[name] = evaluate_episodes(policy, env, **options)
        return outcomes
    return {
        "sampled": evaluate_episodes(
            policy, env, exploration_type=ExplorationType.RANDOM, **options
        ),
        "noise_free": evaluate_episodes(
            policy, env, exploration_type=ExplorationType.DETERMINISTIC, **options
        ),
    }
