"""TorchRL's stock Gaussian actor and critic, and their behaviour cloning: the baseline a
TorchRL user would fine-tune instead of a flow policy.

The networks are those of TorchRL's reference ``sota-implementations/ppo/ppo_mujoco.py``
(``utils_mujoco.make_ppo_models_state``): MLPs of 2 x 64 Tanh units, a state-independent
scale (:class:`~tensordict.nn.AddStateIndependentNormalScale`), a
:class:`~torchrl.modules.ProbabilisticActor` over a :class:`~torchrl.modules.TanhNormal`
within the action bounds, and a :class:`~torchrl.modules.ValueOperator`. Two additions,
both optional: a fixed :class:`~torchrl_flowpolicy.networks.ObservationNormalizer` in front
of each MLP (statistics of the demonstrations, as the flow policy's; the reference script
normalises with ``VecNorm`` on the environment instead), and any action shape (a chunked
environment's ``[1, D]``).

Behaviour cloning (:func:`behaviour_clone`) maximises the TanhNormal log-likelihood of the
demonstration actions (:func:`demonstration_log_likelihood`), loc and scale together: the
same log-probability that PPO's ratio takes afterwards. Demonstrations often sit exactly on
the action bounds (a clipped expert), where a TanhNormal has no density; each action is
first moved inside the bounds by ``epsilon`` of the half-range (:func:`clamp_inside`).

| symbol | name |
| --- | --- |
| ``O`` | ``observation_dim`` |
| action shape (``[D]`` or ``[1, D]``) | ``action_spec.shape`` |
| ``mu``, ``sigma`` of the pre-tanh Gaussian | ``"loc"``, ``"scale"`` |

Example:
    >>> from torchrl.data import Bounded
    >>> spec = Bounded(-2.0, 2.0, shape=(1, 7))
    >>> actor = make_gaussian_actor(23, spec)
    >>> observations, actions = torch.randn(32, 23), torch.rand(32, 1, 7) * 4 - 2
    >>> before = demonstration_log_likelihood(actor, observations, actions)
    >>> _ = behaviour_clone(actor, observations, actions, steps=50, batch_size=16)
    >>> bool(demonstration_log_likelihood(actor, observations, actions) > before)
    True
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from tensordict import TensorDict
from tensordict.nn import AddStateIndependentNormalScale, TensorDictModule
from torch import Tensor, nn
from torchrl.data import Bounded, Composite, TensorSpec
from torchrl.envs.utils import ExplorationType
from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator

__all__ = [
    "make_gaussian_actor",
    "make_value_network",
    "clamp_inside",
    "demonstration_log_likelihood",
    "behaviour_clone",
]

#: The reference script's hidden layers.
REFERENCE_CELLS = (64, 64)


def _action_spec(spec: TensorSpec) -> Bounded:
    """The bounded ``"action"`` spec of ``spec`` (a full action spec or the spec itself)."""
    action = spec["action"] if isinstance(spec, Composite) else spec
    if not isinstance(action, Bounded):
        raise TypeError(
            f"the Gaussian actor needs a bounded action spec (TanhNormal's low and high), got "
            f"{type(action).__name__}."
        )
    return action


def _mlp(
    observation_dim: int,
    out_features: int | Sequence[int],
    num_cells: Sequence[int],
    normalizer: nn.Module | None,
) -> list[nn.Module]:
    mlp = MLP(
        in_features=observation_dim,
        out_features=out_features,
        num_cells=list(num_cells),
        activation_class=nn.Tanh,
    )
    return [mlp] if normalizer is None else [copy.deepcopy(normalizer), mlp]


def make_gaussian_actor(
    observation_dim: int,
    action_spec: TensorSpec,
    *,
    num_cells: Sequence[int] = REFERENCE_CELLS,
    observation_normalizer: nn.Module | None = None,
    scale_lb: float = 1e-8,
) -> ProbabilisticActor:
    """The reference PPO script's Gaussian actor, for actions of ``action_spec``'s shape.

    Reads ``"observation"``, writes ``"loc"``, ``"scale"``, ``"action"`` and its log-prob;
    samples under RANDOM exploration, returns ``tanh(loc)`` (scaled to the bounds) under
    DETERMINISTIC.

    Args:
        observation_dim: ``O``.
        action_spec: a :class:`~torchrl.data.Bounded` spec (or a full action spec holding one
            under ``"action"``, such as ``env.full_action_spec_unbatched``).

    Keyword Args:
        num_cells: the MLP's hidden layers (Tanh).
        observation_normalizer: a module applied to the observation first (copied).
        scale_lb: the lower bound of the scale.
    """
    spec = _action_spec(action_spec)
    shape = tuple(spec.shape)
    layers = _mlp(observation_dim, shape, num_cells, observation_normalizer)
    module = nn.Sequential(*layers, AddStateIndependentNormalScale(shape, scale_lb=scale_lb))
    return ProbabilisticActor(
        TensorDictModule(module, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"],
        spec=Composite(action=spec),
        distribution_class=TanhNormal,
        distribution_kwargs={
            "low": spec.space.low,
            "high": spec.space.high,
            "tanh_loc": False,
            "event_dims": len(shape),
        },
        return_log_prob=True,
        default_interaction_type=ExplorationType.RANDOM,
    )


def make_value_network(
    observation_dim: int,
    *,
    num_cells: Sequence[int] = REFERENCE_CELLS,
    observation_normalizer: nn.Module | None = None,
) -> ValueOperator:
    """The reference script's critic: an MLP (Tanh) from ``"observation"`` to
    ``"state_value"`` ``[*B, 1]``, after ``observation_normalizer`` (copied) if given."""
    layers = _mlp(observation_dim, 1, num_cells, observation_normalizer)
    return ValueOperator(nn.Sequential(*layers), in_keys=["observation"])


def clamp_inside(action: Tensor, low: Tensor, high: Tensor, epsilon: float) -> Tensor:
    """``action`` moved inside ``(low, high)`` by ``epsilon`` of the half-range, per
    dimension (a TanhNormal has no density on its bounds).

    Example:
        >>> clamp_inside(torch.tensor([2.0, 0.5]), torch.tensor(-2.0), torch.tensor(2.0), 0.01)
        tensor([1.9800, 0.5000])
    """
    if not 0 < epsilon < 1:
        raise ValueError(f"epsilon must be in (0, 1), got {epsilon}.")
    margin = epsilon * (high - low) / 2
    return torch.minimum(torch.maximum(action, low + margin), high - margin)


def demonstration_log_likelihood(
    actor: ProbabilisticActor,
    observations: Tensor,
    actions: Tensor,
    *,
    epsilon: float = 1e-3,
    reduce: bool = True,
) -> Tensor:
    """The actor's TanhNormal log-likelihood of ``actions [N, *A]`` given
    ``observations [N, O]``, summed over the action dimensions, after :func:`clamp_inside`;
    its mean over ``N`` (``reduce``) or ``[N]``."""
    if actions.shape[0] != observations.shape[0]:
        raise ValueError(
            f"observations ({observations.shape[0]}) and actions ({actions.shape[0]}) must "
            "have the same number of steps."
        )
    spec = actor.spec["action"]
    if tuple(actions.shape[1:]) != tuple(spec.shape):
        raise ValueError(
            f"actions have shape {tuple(actions.shape)}; the actor's action shape is "
            f"{tuple(spec.shape)} (reshape the demonstrations, e.g. unsqueeze(1) for [1, D])."
        )
    tensordict = TensorDict({"observation": observations}, batch_size=[observations.shape[0]])
    distribution = actor.get_dist(tensordict)
    inside = clamp_inside(actions, spec.space.low, spec.space.high, epsilon)
    log_likelihood = distribution.log_prob(inside)
    return log_likelihood.mean() if reduce else log_likelihood


def behaviour_clone(
    actor: ProbabilisticActor,
    observations: Tensor,
    actions: Tensor,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float = 1e-3,
    epsilon: float = 1e-3,
    max_grad_norm: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[float]:
    """Maximise :func:`demonstration_log_likelihood` (loc and scale together) with Adam and
    a cosine learning-rate decay, on ``steps`` random minibatches of ``batch_size`` steps
    (drawn with ``generator``: seed it for reproducible weights).

    Returns:
        The negative log-likelihood of every minibatch.
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got {steps} and {batch_size}.")
    optimizer = torch.optim.Adam(actor.parameters(), lr=learning_rate)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    losses = []
    for _ in range(steps):
        index = torch.randint(observations.shape[0], (batch_size,), generator=generator)
        loss = -demonstration_log_likelihood(
            actor, observations[index], actions[index], epsilon=epsilon
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(actor.parameters(), max_grad_norm)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses
