"""Smoke test of an installed wheel with its core dependencies only (run by wheel_smoke.sh).

No simulator is installed: the core modules import, a flow policy samples a chunk under
RANDOM exploration, and one denoising-step PPO update (actor and critic) runs and is finite.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.envs.utils import ExplorationType, set_exploration_type

from torchrl_flowpolicy.sampler import SamplerOptions

SIMULATORS = ("gymnasium", "mujoco", "robosuite")
CORE_MODULES = (
    "torchrl_flowpolicy",
    "torchrl_flowpolicy.flow",
    "torchrl_flowpolicy.networks",
    "torchrl_flowpolicy.policy",
    "torchrl_flowpolicy.objectives",
    "torchrl_flowpolicy.dsrl",
    "torchrl_flowpolicy.training.evaluation",
    "torchrl_flowpolicy.training.protocol",
    "torchrl_flowpolicy.training.checkpoint",
    "torchrl_flowpolicy.training.statistics",
    "torchrl_flowpolicy.training.data",
    "torchrl_flowpolicy.training.distributed",
    "torchrl_flowpolicy.sampler",
    "torchrl_flowpolicy.training.runs",
    "torchrl_flowpolicy.training.models",
    "torchrl_flowpolicy.training.loggers",
    "torchrl_flowpolicy.training.episodes",
    "torchrl_flowpolicy.dsrl_networks",
    "torchrl_flowpolicy.envs",
    "torchrl_flowpolicy.tasks",  # the task registry's names are imported on first use
    "torchrl_flowpolicy.training",
)


def main() -> None:
    present = [name for name in SIMULATORS if importlib.util.find_spec(name) is not None]
    assert not present, f"a core-only install must not bring simulators, found {present}"

    for name in CORE_MODULES:
        importlib.import_module(name)
    import torchrl_flowpolicy
    from torchrl_flowpolicy import FlowSDEPolicy
    from torchrl_flowpolicy.envs import make_chunked_env  # chunking needs TorchRL only
    from torchrl_flowpolicy.networks import MLPVelocityNetwork
    from torchrl_flowpolicy.objectives import DenoisingClipPPOLoss

    location = Path(torchrl_flowpolicy.__file__).resolve()
    assert "site-packages" in location.parts, f"not the installed wheel: {location}"
    assert callable(make_chunked_env)
    try:
        from torchrl_flowpolicy.envs import BatchedGymEnv  # noqa: F401
    except ModuleNotFoundError as error:
        assert error.name == "gymnasium" and "[envs]" in str(error), error
    else:
        raise AssertionError("BatchedGymEnv imported without gymnasium")

    torch.manual_seed(0)
    observation_dim, action_shape, batch = 5, (4, 2), 16
    policy = FlowSDEPolicy(
        MLPVelocityNetwork(observation_dim, action_shape, hidden_dim=32, num_layers=2),
        action_shape=action_shape,
        options=SamplerOptions(num_denoising_steps=4, num_sde_steps=2),
    )
    data = TensorDict({"observation": torch.randn(batch, observation_dim)}, batch_size=[batch])
    with set_exploration_type(ExplorationType.RANDOM), torch.no_grad():
        data = policy(data)
    assert data["action"].shape == (batch, *action_shape), data["action"].shape
    assert data["action_log_prob"].isfinite().all()

    critic = TensorDictModule(
        nn.Linear(observation_dim, 1), in_keys=["observation"], out_keys=["state_value"]
    )
    loss = DenoisingClipPPOLoss(policy, critic, clip_epsilon=0.2)
    optimizer = torch.optim.Adam(loss.parameters(), lr=1e-3)
    data["advantage"] = torch.randn(batch, 1)
    data["value_target"] = torch.randn(batch, 1)
    out = loss(data)
    total = out["loss_objective"] + out["loss_critic"]
    assert total.isfinite(), out
    assert float(out["log_prob_drift"]) < 1e-4, out["log_prob_drift"]
    optimizer.zero_grad()
    total.backward()
    optimizer.step()
    total = total.detach()
    assert all(p.isfinite().all() for p in loss.parameters())

    versions = {
        name: importlib.import_module(name).__version__
        for name in ("torch", "torchrl", "tensordict", "numpy")
    }
    print(
        f"[smoke] ok: python {sys.version.split()[0]}, "
        + ", ".join(f"{name} {version}" for name, version in versions.items())
        + f"; loss {total.item():.4f}; no {', '.join(SIMULATORS)}"
    )


if __name__ == "__main__":
    main()
