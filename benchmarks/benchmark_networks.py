"""The two networks every benchmark measures, built the same way in each script."""

from __future__ import annotations

from torch import nn

from torchrl_flowpolicy.networks import (
    ActionExpertTransformer,
    MLPVelocityNetwork,
    ObservationEncoder,
)

ACTION_SHAPE = (8, 7)
OBSERVATION_DIM = 23
NETWORKS = ("mlp1024", "transformer")


def build_networks(name: str) -> tuple[nn.Module, nn.Module | None]:
    """``(velocity_network, encoder or None)`` for a benchmark network name.

    ``"mlp1024"``: an MLP velocity network of width 1024 (3 hidden layers); ``"transformer"``:
    the reference action expert with its observation encoder (defaults).
    """
    if name == "mlp1024":
        network = MLPVelocityNetwork(OBSERVATION_DIM, ACTION_SHAPE, hidden_dim=1024, num_layers=3)
        return network, None
    if name == "transformer":
        encoder = ObservationEncoder(OBSERVATION_DIM)
        return ActionExpertTransformer(ACTION_SHAPE, model_dim=encoder.model_dim), encoder
    raise ValueError(f"unknown network {name!r}; choose from {NETWORKS}.")
