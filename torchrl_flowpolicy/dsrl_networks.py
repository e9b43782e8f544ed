"""The reference SAC networks of noise-space RL (DSRL): a tanh-Gaussian noise actor and a
``Q(observation, noise)`` critic, for TorchRL's ``SACLoss`` on a
:class:`~torchrl_flowpolicy.dsrl.NoiseActionTransform` environment.

Both read the observation through a copy of the frozen flow policy's observation
normaliser and use LayerNorm MLPs (DSRL's choice). The actor's action is the initial noise
``x_0`` in the box ``[-m, m]^(H x D)``, one log-probability per ``[H, D]`` noise;
``zero_mean_init`` starts its mean at ``x_0 = 0``, the policy's noise-free chunk.
:func:`target_entropy_per_dim` gives SAC's target entropy for that box.

Example:
    >>> round(target_entropy_per_dim(0.3), 4)
    -2.204
"""

from __future__ import annotations

import copy
import math

import torch
from tensordict.nn import TensorDictModule
from torch import Tensor, nn
from torchrl.data import Composite
from torchrl.modules import MLP, NormalParamExtractor, ProbabilisticActor, TanhNormal, ValueOperator

from torchrl_flowpolicy.policy import FlowSDEPolicy

__all__ = [
    "layer_norm_mlp",
    "make_noise_actor",
    "NoiseQNetwork",
    "make_noise_critic",
    "target_entropy_per_dim",
]


def layer_norm_mlp(in_features: int, out_features: int, hidden_dim: int, num_layers: int) -> MLP:
    """``num_layers`` hidden layers of ``hidden_dim`` units, each Linear -> LayerNorm -> ReLU."""
    return MLP(
        in_features=in_features,
        out_features=out_features,
        num_cells=[hidden_dim] * num_layers,
        norm_class=nn.LayerNorm,
        norm_kwargs={"normalized_shape": hidden_dim},
        activation_class=nn.ReLU,
    )


def make_noise_actor(
    policy: FlowSDEPolicy,
    noise_spec: Composite,
    *,
    noise_bound: float,
    hidden_dim: int = 256,
    num_layers: int = 3,
    zero_mean_init: bool = True,
) -> ProbabilisticActor:
    """Tanh-Gaussian over the noise box ``[-noise_bound, noise_bound]^(H x D)``, conditioned
    on the observation (``policy``'s normaliser first), on the policy's device."""
    chunk_length, action_dim = policy.action_shape
    normalizer = policy.encoder[0]  # the pretrained policy's observation normaliser
    network = nn.Sequential(
        copy.deepcopy(normalizer),
        layer_norm_mlp(
            normalizer.loc.numel(), 2 * chunk_length * action_dim, hidden_dim, num_layers
        ),
        nn.Unflatten(-1, (chunk_length, 2 * action_dim)),
        NormalParamExtractor(),  # [.., H, 2D] -> loc [.., H, D], scale [.., H, D]
    )
    if zero_mean_init:
        # The output layer's loc half of every row -> 0: the actor's mean noise starts at 0.
        output_layer = [module for module in network.modules() if isinstance(module, nn.Linear)][-1]
        is_loc = (torch.arange(output_layer.out_features) % (2 * action_dim)) < action_dim
        with torch.no_grad():
            output_layer.weight[is_loc] = 0.0
            output_layer.bias[is_loc] = 0.0
    network.to(normalizer.loc.device)
    return ProbabilisticActor(
        TensorDictModule(network, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"],
        spec=noise_spec,
        distribution_class=TanhNormal,
        distribution_kwargs={
            "low": -noise_bound,
            "high": noise_bound,
            "event_dims": 2,  # one log-probability per [H, D] noise
        },
    )


class NoiseQNetwork(nn.Module):
    """``Q(observation, noise)``: a LayerNorm MLP on the normalised observation and the noise."""

    def __init__(self, normalizer: nn.Module, noise_numel: int, hidden_dim: int, num_layers: int):
        super().__init__()
        self.normalizer = normalizer
        in_features = normalizer.loc.numel() + noise_numel
        self.mlp = layer_norm_mlp(in_features, 1, hidden_dim, num_layers)

    def forward(self, observation: Tensor, noise: Tensor) -> Tensor:
        features = torch.cat([self.normalizer(observation), noise.flatten(-2)], dim=-1)
        return self.mlp(features)


def make_noise_critic(
    policy: FlowSDEPolicy, *, hidden_dim: int = 256, num_layers: int = 3
) -> ValueOperator:
    """One critic ``Q(observation, noise)`` on the policy's device (``SACLoss`` makes two with
    separate weights)."""
    normalizer = copy.deepcopy(policy.encoder[0])
    network = NoiseQNetwork(normalizer, policy.action_shape.numel(), hidden_dim, num_layers)
    network.to(policy.encoder[0].loc.device)
    return ValueOperator(network, in_keys=["observation", "action"])


def target_entropy_per_dim(noise_bound: float, target: float = float("nan")) -> float:
    """SAC's target entropy per noise dimension: ``target``, or (NaN) ``log(m) - 1``, SAC's
    usual ``-1`` for the box ``[-1, 1]`` carried to ``[-m, m]``.

    Raises:
        ValueError: a target at or above ``log(2 m)``, the entropy of the uniform noise over
            the box: the temperature would grow without bound.
    """
    if math.isnan(target):
        target = math.log(noise_bound) - 1.0
    if target >= math.log(2 * noise_bound):
        raise ValueError(
            f"target_entropy_per_dim={target} is not below log(2 m) = "
            f"{math.log(2 * noise_bound):.3f}, the entropy of the uniform noise over "
            f"[-m, m] (m = noise_bound = {noise_bound}): the temperature would grow "
            "without bound. Leave it at nan (log(m) - 1) or lower it."
        )
    return target
