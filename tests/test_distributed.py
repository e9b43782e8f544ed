"""Data-parallel ``DenoisingClipPPOLoss``: two ranks on half a batch each take the step of one
process on the whole batch.

The slow test launches this file with ``torchrun --standalone --nproc_per_node 2`` (gloo on
the CPU): each rank computes the loss and its gradient on its half of a fixed batch, averages
the gradients with :func:`~torchrl_flowpolicy.training.distributed.average_gradients` and takes three
clipped Adam steps, as ``examples/ppo.py`` does. The test compares what the ranks wrote with
one process on the union of their halves. ``normalize_advantage=False``: with it, each rank
would standardise its own half (see ``torchrl_flowpolicy.training.distributed``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import Tensor, nn
from torchrl.envs.utils import ExplorationType, set_exploration_type

from torchrl_flowpolicy import FlowSDEPolicy
from torchrl_flowpolicy.networks import MLPVelocityNetwork
from torchrl_flowpolicy.objectives import DenoisingClipPPOLoss
from torchrl_flowpolicy.sampler import SamplerOptions
from torchrl_flowpolicy.training.distributed import (
    average_gradients,
    barrier,
    broadcast_parameters,
    close_distributed,
    init_distributed,
    is_main_process,
    sum_over_processes,
)

ROOT = Path(__file__).resolve().parents[1]
OBSERVATION_DIM = 5
ACTION_SHAPE = (4, 2)
BATCH_SIZE = 16
WORLD_SIZE = 2
OPTIMIZER_STEPS = 3
MAX_GRAD_NORM = 1.0


# ---------------------------------------------------------------------------- the learner
def make_learner(critic_seed: int) -> tuple[FlowSDEPolicy, TensorDictModule, DenoisingClipPPOLoss]:
    """A float64 MLP flow policy (K = 4, the last 2 steps stochastic), a critic initialised
    from ``critic_seed``, and the loss with clip-higher and a KL term."""
    torch.manual_seed(0)
    network = MLPVelocityNetwork(OBSERVATION_DIM, ACTION_SHAPE, hidden_dim=32, num_layers=2)
    policy = FlowSDEPolicy(
        network.double(),
        action_shape=ACTION_SHAPE,
        options=SamplerOptions(num_denoising_steps=4, sde_mode="last", num_sde_steps=2),
    )
    torch.manual_seed(critic_seed)
    critic = TensorDictModule(
        nn.Linear(OBSERVATION_DIM, 1).double(), in_keys=["observation"], out_keys=["state_value"]
    )
    loss = DenoisingClipPPOLoss(
        policy,
        critic,
        clip_epsilon=(0.2, 0.28),
        kl_coeff=0.1,
        normalize_advantage=False,
        loss_critic_type="l2",
    )
    return policy, critic, loss


def make_batch(policy: FlowSDEPolicy) -> TensorDict:
    """Decisions sampled by ``policy`` (stored chains and log-probs) with fixed advantages
    and value targets; then the policy is moved, so that the ratios are not 1 and clip."""
    torch.manual_seed(1)
    observation = torch.randn(BATCH_SIZE, OBSERVATION_DIM, dtype=torch.float64)
    data = TensorDict({"observation": observation}, batch_size=[BATCH_SIZE])
    with set_exploration_type(ExplorationType.RANDOM), torch.no_grad():
        data = policy(data)
    data["advantage"] = torch.randn(BATCH_SIZE, 1, dtype=torch.float64) * 2.0 + 0.3
    data["value_target"] = torch.randn(BATCH_SIZE, 1, dtype=torch.float64)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
    return data


def trained_parameters(policy: nn.Module, critic: nn.Module) -> list[Tensor]:
    return [*policy.parameters(), *critic.parameters()]


def gradients(parameters: list[Tensor]) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in parameters]


def backward(loss: DenoisingClipPPOLoss, data: TensorDict) -> None:
    """The example's learner step: objective + KL + critic, one backward."""
    losses = loss(data)
    (losses["loss_objective"] + losses["loss_kl"] + losses["loss_critic"]).backward()


def train(critic_seed: int, shard: slice) -> dict[str, list]:
    """The gradient at the start, then ``OPTIMIZER_STEPS`` steps of the example's update on
    ``batch[shard]``; gradients averaged over the ranks when a process group exists."""
    policy, critic, loss = make_learner(critic_seed)
    data = make_batch(policy)[shard]
    broadcast_parameters(policy)
    broadcast_parameters(critic)  # every rank starts from rank 0's critic
    parameters = trained_parameters(policy, critic)
    result: dict[str, list] = {"initial_parameters": [p.detach().clone() for p in parameters]}
    actor_optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    critic_optimizer = torch.optim.Adam(critic.parameters(), lr=1e-2)
    for step in range(OPTIMIZER_STEPS):
        actor_optimizer.zero_grad(set_to_none=True)
        critic_optimizer.zero_grad(set_to_none=True)
        backward(loss, data)
        if step == 0:
            result["local_gradients"] = gradients(parameters)
        average_gradients(parameters)
        if step == 0:
            result["gradients"] = gradients(parameters)
        torch.nn.utils.clip_grad_norm_(critic.parameters(), MAX_GRAD_NORM)
        torch.nn.utils.clip_grad_norm_(policy.parameters(), MAX_GRAD_NORM)
        critic_optimizer.step()
        actor_optimizer.step()
    result["parameters"] = [p.detach().clone() for p in parameters]
    return result


def rank_main(output_dir: str) -> None:
    """One rank under ``torchrun``: its half of the batch; writes ``rank{r}.pt``."""
    torch.set_num_threads(1)
    rank, world_size = init_distributed()
    assert world_size == WORLD_SIZE and is_main_process() == (rank == 0)
    shard_size = BATCH_SIZE // world_size
    result = train(critic_seed=100 + rank, shard=slice(rank * shard_size, (rank + 1) * shard_size))
    result["rank_sum"] = sum_over_processes(rank + 1)
    torch.save(result, Path(output_dir) / f"rank{rank}.pt")
    barrier()
    close_distributed()


# ---------------------------------------------------------------------------- tests
def assert_same(actual: list, expected: list, **tolerance) -> None:
    assert len(actual) == len(expected)
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert (a is None) == (e is None), f"tensor {index}: one of the two is None"
        if a is not None:
            torch.testing.assert_close(a, e, msg=lambda m, i=index: f"tensor {i}: {m}", **tolerance)


@pytest.mark.slow
def test_two_ranks_on_half_batches_match_one_process_on_the_whole_batch(tmp_path):
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        environment.pop(name, None)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    result = subprocess.run(
        [*launcher, f"--nproc_per_node={WORLD_SIZE}", __file__, str(tmp_path)],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD_SIZE)]
    single = train(critic_seed=100, shard=slice(None))  # one process, rank 0's critic

    # The halves give different gradients (the test is not vacuous) ...
    local = [torch.cat([g.flatten() for g in rank["local_gradients"]]) for rank in ranks]
    assert (local[0] - local[1]).abs().max() > 1e-3
    # ... whose average is the gradient on the whole batch, on every rank ...
    for rank in ranks:
        assert_same(rank["gradients"], single["gradients"], rtol=1e-10, atol=1e-12)
        assert rank["rank_sum"] == 1 + 2
    # ... and three clipped Adam steps end at the same parameters, identical on both ranks.
    assert_same(ranks[1]["parameters"], ranks[0]["parameters"], rtol=0, atol=0)
    assert_same(ranks[0]["parameters"], single["parameters"], rtol=1e-9, atol=1e-10)
    steps = zip(single["parameters"], single["initial_parameters"], strict=True)
    assert max((after - before).abs().max() for after, before in steps) > 1e-3


def test_without_torchrun_every_helper_is_a_no_op(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert init_distributed() == (0, 1)
    assert is_main_process()
    policy, critic, loss = make_learner(critic_seed=100)
    backward(loss, make_batch(policy))
    parameters = trained_parameters(policy, critic)
    before = gradients(parameters)
    state = {name: value.clone() for name, value in critic.state_dict().items()}
    average_gradients(parameters)
    broadcast_parameters(critic)
    barrier()
    assert_same(gradients(parameters), before, rtol=0, atol=0)
    assert_same(list(critic.state_dict().values()), list(state.values()), rtol=0, atol=0)
    assert sum_over_processes(7) == 7
    close_distributed()


def test_partial_torchrun_environment_is_refused(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        init_distributed()


if __name__ == "__main__":
    rank_main(sys.argv[1])
