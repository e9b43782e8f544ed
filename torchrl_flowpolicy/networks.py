"""Reference velocity networks and observation encoders.

Both networks follow the library's call signature ``network(x, sigma, context) -> v`` with
``x [N, H, D]``, ``sigma [N]`` and a per-decision context.

* :class:`MLPVelocityNetwork`: flattens the chunk and concatenates it with a sinusoidal
  embedding of sigma and the observation.
* :class:`ActionExpertTransformer` with :class:`ObservationEncoder`: the chunk's ``H`` tokens
  attend (self-attention) to each other and (cross-attention) to context tokens computed once
  per decision by the encoder, the pattern of the pi0 / Fast-WAM action expert reusing its
  prefix cache for every denoising step.
* :class:`NoiseHead`: the learned exploration noise, ``(x, sigma, context) -> std`` with the
  same call signature, bounded in ``[min_std, max_std]`` (pi-RL's Flow-Noise, ReinFlow).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from torchrl_flowpolicy.flow.noise import bounded_std, bounded_std_logit, check_std_bounds

__all__ = [
    "check_declared_shape",
    "TimeReversedVelocity",
    "SigmaEmbedding",
    "ObservationNormalizer",
    "MLPVelocityNetwork",
    "ObservationEncoder",
    "ActionExpertTransformer",
    "NoiseHead",
]


def check_declared_shape(network: object, chunk_shape: Sequence[int], name: str) -> None:
    """Refuse a network whose declared ``action_shape`` is not ``chunk_shape`` ``(H, D)``.

    The reference networks declare the ``action_shape`` they were built for; a mismatch would
    reshape chunks silently. A single-step network (``H = 1``) may declare ``(D,)``; a network
    that declares nothing is accepted.

    Examples:
        >>> check_declared_shape(MLPVelocityNetwork(5, (4, 2)), (4, 2), "velocity_network")
        >>> check_declared_shape(MLPVelocityNetwork(5, (4, 2)), (8, 2), "velocity_network")
        Traceback (most recent call last):
        ...
        ValueError: velocity_network was built for action_shape (4, 2), but the chunks are (8, 2): it would reshape them silently. Build it with action_shape (8, 2).
    """
    declared = getattr(network, "action_shape", None)
    chunk_shape = tuple(chunk_shape)
    accepted = {chunk_shape, chunk_shape[1:]} if chunk_shape[0] == 1 else {chunk_shape}
    if isinstance(declared, Sequence) and tuple(declared) not in accepted:
        raise ValueError(
            f"{name} was built for action_shape {tuple(declared)}, but the chunks are "
            f"{chunk_shape}: it would reshape them silently. Build it with action_shape "
            f"{chunk_shape}."
        )


class TimeReversedVelocity(nn.Module):
    """Adapter for velocity networks written in the ``t = 0`` noise, ``t = 1`` action convention.

    Such networks (TorchRL-style flow-matching models, LeRobot's pi0 before its own
    reversal) interpolate ``x_t = t * action + (1 - t) * noise`` and predict
    ``v' = action - noise``. With ``t = 1 - sigma`` the library's velocity is
    ``v(x, sigma) = -v'(x, 1 - sigma)``.

    Args:
        network: a callable ``network(x, t, context) -> v'`` in the ``t = 0`` noise convention.

    Examples:
        >>> class DataMinusNoise(nn.Module):
        ...     def forward(self, x, t, context):
        ...         return context - x  # pushes x towards ``context``
        >>> adapted = TimeReversedVelocity(DataMinusNoise())
        >>> adapted(torch.zeros(1, 2, 3), torch.ones(1), torch.ones(1, 2, 3)).sum().item()
        -6.0
    """

    def __init__(self, network: Callable[..., Tensor]):
        super().__init__()
        self.network = network

    def forward(self, x: Tensor, sigma: Tensor, context: Tensor | tuple[Tensor, ...]) -> Tensor:
        return -self.network(x, 1.0 - sigma, context)


class SigmaEmbedding(nn.Module):
    """Sinusoidal features of the noise level, ``[N] -> [N, embedding_dim]``.

    Frequencies are geometric from 1 to 1000 (sigma lives in [0, 1]).

    Examples:
        >>> SigmaEmbedding(16)(torch.rand(3)).shape
        torch.Size([3, 16])
    """

    def __init__(self, embedding_dim: int = 32, max_frequency: float = 1000.0):
        super().__init__()
        if embedding_dim % 2:
            raise ValueError(f"embedding_dim must be even, got {embedding_dim}.")
        frequencies = torch.exp(torch.linspace(0.0, math.log(max_frequency), embedding_dim // 2))
        self.register_buffer("frequencies", frequencies, persistent=False)

    def forward(self, sigma: Tensor) -> Tensor:
        angles = sigma[..., None].to(self.frequencies.dtype) * self.frequencies
        return torch.cat([angles.sin(), angles.cos()], dim=-1)


class ObservationNormalizer(nn.Module):
    """Fixed affine normalisation ``(observation - loc) / scale`` with its statistics as buffers.

    The statistics travel with the model's ``state_dict`` (computed once, e.g. from the
    demonstrations), so the environment stays raw and every consumer (policy, critic,
    evaluation) sees the same inputs.

    Examples:
        >>> normalizer = ObservationNormalizer(torch.tensor([1.0]), torch.tensor([2.0]))
        >>> normalizer(torch.tensor([[3.0]]))
        tensor([[1.]])
    """

    def __init__(self, loc: Tensor, scale: Tensor):
        super().__init__()
        if loc.shape != scale.shape:
            raise ValueError(f"loc {tuple(loc.shape)} and scale {tuple(scale.shape)} differ.")
        if not bool((scale > 0).all()):
            raise ValueError("scale must be > 0 everywhere.")
        self.register_buffer("loc", loc.clone())
        self.register_buffer("scale", scale.clone())

    @classmethod
    def from_data(cls, observations: Tensor, min_scale: float = 1e-2) -> ObservationNormalizer:
        """Statistics of ``observations [N, O]``; ``scale`` is floored at ``min_scale``."""
        observations = observations.reshape(-1, observations.shape[-1]).float()
        return cls(observations.mean(0), observations.std(0).clamp_min(min_scale))

    def forward(self, observation: Tensor) -> Tensor:
        return (observation - self.loc) / self.scale


def _check_features(context: Tensor, expected: int, name: str) -> None:
    if context.shape[-1] != expected:
        raise ValueError(
            f"{name} got an observation/context with {context.shape[-1]} features (shape "
            f"{tuple(context.shape)}); it was built with observation_dim={expected}. Check the "
            f"policy's in_keys and the observation shape."
        )


class MLPVelocityNetwork(nn.Module):
    """An MLP velocity network ``(x [N, H, D], sigma [N], observation [N, O]) -> [N, H, D]``.

    Args:
        observation_dim: ``O``, the observation (context) features.
        action_shape: ``(H, D)``.

    Keyword Args:
        hidden_dim: width of the hidden layers.
        num_layers: number of hidden layers.
        sigma_embedding_dim: size of the sinusoidal sigma features.

    Examples:
        >>> network = MLPVelocityNetwork(observation_dim=5, action_shape=(4, 2))
        >>> network(torch.randn(3, 4, 2), torch.rand(3), torch.randn(3, 5)).shape
        torch.Size([3, 4, 2])
    """

    def __init__(
        self,
        observation_dim: int,
        action_shape: Sequence[int],
        *,
        hidden_dim: int = 256,
        num_layers: int = 3,
        sigma_embedding_dim: int = 32,
    ):
        super().__init__()
        self.observation_dim = observation_dim
        self.action_shape = torch.Size(action_shape)
        action_numel = math.prod(self.action_shape)
        self.sigma_embedding = SigmaEmbedding(sigma_embedding_dim)
        layers: list[nn.Module] = []
        in_features = action_numel + sigma_embedding_dim + observation_dim
        for _ in range(num_layers):
            layers += [nn.Linear(in_features, hidden_dim), nn.SiLU()]
            in_features = hidden_dim
        layers.append(nn.Linear(in_features, action_numel))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x: Tensor, sigma: Tensor, context: Tensor) -> Tensor:
        _check_features(context, self.observation_dim, type(self).__name__)
        features = torch.cat(
            [
                x.flatten(1),
                self.sigma_embedding(sigma).to(x.dtype),
                context.flatten(1).to(x.dtype),
            ],
            dim=-1,
        )
        return self.mlp(features).view(x.shape)


class ObservationEncoder(nn.Module):
    """Maps an observation ``[N, O]`` to ``num_tokens`` context tokens ``[N, T, model_dim]``.

    Stands in for the expensive conditioning of a robot policy (a VLM prefix, a video
    model's first-frame cache): it runs once per decision, not once per denoising step.

    Examples:
        >>> ObservationEncoder(5, model_dim=32, num_tokens=4)(torch.randn(3, 5)).shape
        torch.Size([3, 4, 32])
    """

    def __init__(
        self,
        observation_dim: int,
        *,
        model_dim: int = 128,
        num_tokens: int = 4,
        hidden_dim: int = 256,
    ):
        super().__init__()
        self.observation_dim = observation_dim
        self.model_dim = model_dim
        self.num_tokens = num_tokens
        self.mlp = nn.Sequential(
            nn.Linear(observation_dim, hidden_dim),
            nn.SiLU(),
            nn.Linear(hidden_dim, num_tokens * model_dim),
        )
        self.norm = nn.LayerNorm(model_dim)

    def forward(self, observation: Tensor) -> Tensor:
        _check_features(observation, self.observation_dim, type(self).__name__)
        tokens = self.mlp(observation.flatten(1).to(self.mlp[0].weight.dtype))
        return self.norm(tokens.view(-1, self.num_tokens, self.model_dim))


class ActionExpertTransformer(nn.Module):
    """A small transformer "action expert": chunk tokens cross-attend to cached context tokens.

    Each of the ``H`` chunk rows is a token (a linear embedding of its ``D`` values plus a
    learned position and the sigma embedding); ``num_layers`` pre-norm decoder layers apply
    self-attention over the chunk and cross-attention to the ``[N, T, model_dim]`` context.

    Args:
        action_shape: ``(H, D)``.

    Keyword Args:
        model_dim: token width (must match the encoder's).
        num_heads: attention heads.
        num_layers: decoder layers.
        feedforward_dim: hidden size of the feed-forward blocks (default ``4 * model_dim``).

    Examples:
        >>> encoder = ObservationEncoder(5, model_dim=32)
        >>> expert = ActionExpertTransformer((4, 2), model_dim=32, num_heads=2)
        >>> context = encoder(torch.randn(3, 5))  # once per decision
        >>> expert(torch.randn(3, 4, 2), torch.rand(3), context).shape
        torch.Size([3, 4, 2])
    """

    def __init__(
        self,
        action_shape: Sequence[int],
        *,
        model_dim: int = 128,
        num_heads: int = 4,
        num_layers: int = 2,
        feedforward_dim: int | None = None,
    ):
        super().__init__()
        self.action_shape = torch.Size(action_shape)
        chunk_length, action_dim = self.action_shape
        self.model_dim = model_dim
        self.action_embedding = nn.Linear(action_dim, model_dim)
        self.position_embedding = nn.Parameter(torch.randn(chunk_length, model_dim) * 0.02)
        self.sigma_embedding = nn.Sequential(
            SigmaEmbedding(model_dim), nn.Linear(model_dim, model_dim), nn.SiLU()
        )
        layer = nn.TransformerDecoderLayer(
            model_dim,
            num_heads,
            dim_feedforward=feedforward_dim or 4 * model_dim,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.decoder = nn.TransformerDecoder(layer, num_layers)
        self.output = nn.Sequential(nn.LayerNorm(model_dim), nn.Linear(model_dim, action_dim))

    def forward(self, x: Tensor, sigma: Tensor, context: Tensor) -> Tensor:
        if context.ndim != 3 or context.shape[-1] != self.model_dim:
            raise ValueError(
                f"ActionExpertTransformer expects context tokens [N, T, {self.model_dim}] "
                f"(an ObservationEncoder's output), got shape {tuple(context.shape)}."
            )
        tokens = self.action_embedding(x) + self.position_embedding
        tokens = tokens + self.sigma_embedding(sigma)[:, None, :]
        tokens = self.decoder(tokens, context.to(tokens.dtype))
        return self.output(tokens)


class NoiseHead(nn.Module):
    """The learned exploration noise: ``(x [N, H, D], sigma [N], context) -> std [N, H, D]``.

    A small MLP on the flattened ``x_k``, a sinusoidal embedding of ``sigma_k`` and the
    flattened per-decision context (the policy's encoder output, computed once per decision,
    or the observation) predicts one raw value per chunk entry; the std is that value
    squashed into ``[min_std, max_std]`` by a sigmoid in log space
    (:func:`~torchrl_flowpolicy.flow.bounded_std`), so it can neither collapse nor explode.
    Passed to :class:`~torchrl_flowpolicy.FlowSDEPolicy` as ``noise_head``, it turns the
    stochastic steps into ``x_{k+1} = x_k + v_k Delta_k + std_k xi_k``: the noise network of
    pi-RL's Flow-Noise (Chen et al., 2025) and of ReinFlow (Zhang et al., 2025).

    Initialisation: the output layer's weights are zero and its bias is the raw value of
    ``initial_std`` (:func:`~torchrl_flowpolicy.flow.bounded_std_logit`), so the head starts
    at exactly ``initial_std`` for every input; the hidden layers keep PyTorch's default
    initialisation and receive gradients once the output weights have moved.

    Args:
        context_dim: the number of features of the flattened context of one decision (``O``
            for an observation; ``T * model_dim`` for an encoder's ``T`` tokens).
        action_shape: ``(H, D)``, the chunk shape the policy's network sees.

    Keyword Args:
        min_std: the lower bound of the std (finite, > 0).
        max_std: the upper bound (finite, > ``min_std``).
        initial_std: the std at initialisation, strictly between the bounds; ``None``
            (default): their geometric mean ``sqrt(min_std * max_std)``, the middle of the
            squashing, where it is steepest.
        hidden_dim: width of the hidden layers.
        num_layers: number of hidden layers.
        sigma_embedding_dim: size of the sinusoidal sigma features.

    Raises:
        ValueError: bounds that are not finite with ``0 < min_std < max_std``, or an
            ``initial_std`` outside them (naming the argument).

    Examples:
        >>> head = NoiseHead(5, (4, 2), min_std=0.02, max_std=0.3, initial_std=0.1)
        >>> std = head(torch.randn(3, 4, 2), torch.rand(3), torch.randn(3, 5))
        >>> std.shape, torch.allclose(std, torch.full_like(std, 0.1))
        (torch.Size([3, 4, 2]), True)
    """

    def __init__(
        self,
        context_dim: int,
        action_shape: Sequence[int],
        *,
        min_std: float = 0.02,
        max_std: float = 0.3,
        initial_std: float | None = None,
        hidden_dim: int = 64,
        num_layers: int = 2,
        sigma_embedding_dim: int = 32,
    ):
        super().__init__()
        check_std_bounds(min_std, max_std, initial_std)
        if initial_std is None:
            initial_std = math.sqrt(min_std * max_std)
        self.context_dim = context_dim
        self.action_shape = torch.Size(action_shape)
        self.min_std, self.max_std = float(min_std), float(max_std)
        self.initial_std = float(initial_std)
        action_numel = math.prod(self.action_shape)
        self.sigma_embedding = SigmaEmbedding(sigma_embedding_dim)
        layers: list[nn.Module] = []
        in_features = action_numel + sigma_embedding_dim + context_dim
        for _ in range(num_layers):
            layers += [nn.Linear(in_features, hidden_dim), nn.SiLU()]
            in_features = hidden_dim
        output = nn.Linear(in_features, action_numel)
        nn.init.zeros_(output.weight)
        nn.init.constant_(output.bias, bounded_std_logit(initial_std, min_std, max_std))
        layers.append(output)
        self.mlp = nn.Sequential(*layers)

    def forward(self, x: Tensor, sigma: Tensor, context: Tensor) -> Tensor:
        features = context.flatten(1)
        if features.shape[-1] != self.context_dim:
            raise ValueError(
                f"NoiseHead got a context with {features.shape[-1]} features once flattened "
                f"(shape {tuple(context.shape)}); it was built with context_dim="
                f"{self.context_dim}. Pass the flattened size of the policy's context (the "
                f"observation, or the encoder's tokens: num_tokens * model_dim)."
            )
        dtype = self.mlp[0].weight.dtype
        features = torch.cat(
            [x.flatten(1).to(dtype), self.sigma_embedding(sigma).to(dtype), features.to(dtype)],
            dim=-1,
        )
        return bounded_std(self.mlp(features), self.min_std, self.max_std).view(x.shape)

    def extra_repr(self) -> str:
        return f"min_std={self.min_std:g}, max_std={self.max_std:g}"
