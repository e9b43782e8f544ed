"""Tests of ``FlowMatchingLoss`` (supervised flow matching on action chunks)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import Tensor, nn

from torchrl_flowpolicy import FlowSDEPolicy, flow
from torchrl_flowpolicy.networks import MLPVelocityNetwork
from torchrl_flowpolicy.objectives import FlowMatchingLoss

OBSERVATION_DIM = 3
ACTION_SHAPE = (4, 2)
NUM_DECISIONS = 16


def make_policy(seed: int = 0, network: nn.Module | None = None) -> FlowSDEPolicy:
    torch.manual_seed(seed)
    if network is None:
        network = MLPVelocityNetwork(OBSERVATION_DIM, ACTION_SHAPE, hidden_dim=64, num_layers=2)
    return FlowSDEPolicy(network.double(), action_shape=ACTION_SHAPE)


def make_data(seed: int = 1, rows: int = ACTION_SHAPE[0]) -> TensorDict:
    generator = torch.Generator().manual_seed(seed)
    observation = torch.randn(NUM_DECISIONS, OBSERVATION_DIM, generator=generator).double()
    action = torch.randn(NUM_DECISIONS, rows, ACTION_SHAPE[1], generator=generator).double()
    return TensorDict({"observation": observation, "action": action}, batch_size=[NUM_DECISIONS])


def loss_at_seed(loss: FlowMatchingLoss, data: TensorDict, seed: int = 7) -> Tensor:
    torch.manual_seed(seed)
    return loss(data)["loss_flow_matching"]


class SigmaRecorder(nn.Module):
    """Wraps a velocity network and keeps the noise levels it was called with."""

    def __init__(self, network: nn.Module):
        super().__init__()
        self.network = network
        self.sigmas: list[Tensor] = []

    def forward(self, x: Tensor, sigma: Tensor, context: Tensor) -> Tensor:
        self.sigmas.append(sigma.detach().clone())
        return self.network(x, sigma, context)


def test_loss_equals_hand_computation_at_a_fixed_seed():
    policy = make_policy()
    data = make_data()
    loss = loss_at_seed(FlowMatchingLoss(policy), data)

    torch.manual_seed(7)
    action = data["action"]
    noise = torch.randn(action.shape, dtype=action.dtype)
    sigma = torch.rand(NUM_DECISIONS, dtype=action.dtype)
    x = (1 - sigma[:, None, None]) * action + sigma[:, None, None] * noise
    velocity = policy.velocity_network(x, sigma, data["observation"])
    expected = (velocity - (noise - action)).pow(2).mean()
    torch.testing.assert_close(loss, expected, atol=1e-12, rtol=1e-12)

    torch.testing.assert_close(
        loss_at_seed(FlowMatchingLoss(policy, reduction="sum"), data),
        (velocity - (noise - action)).pow(2).mean((-1, -2)).sum(),
        atol=1e-12,
        rtol=1e-12,
    )
    per_decision = loss_at_seed(FlowMatchingLoss(policy, reduction="none"), data)
    assert per_decision.shape == (NUM_DECISIONS,)
    torch.testing.assert_close(per_decision.mean(), expected, atol=1e-12, rtol=1e-12)


def test_padding_rows_do_not_affect_the_loss():
    policy = make_policy()
    data = make_data()
    row_mask = torch.ones(NUM_DECISIONS, ACTION_SHAPE[0], dtype=torch.bool)
    row_mask[::2, 3] = False
    row_mask[1::4, 2:] = False
    data["action_row_mask"] = row_mask
    loss = FlowMatchingLoss(policy)
    baseline = loss_at_seed(loss, data)

    changed = data.clone()
    changed["action"][~row_mask] = torch.randn(int((~row_mask).sum()), ACTION_SHAPE[1]).double()
    torch.testing.assert_close(loss_at_seed(loss, changed), baseline, atol=0, rtol=0)

    real_row_changed = data.clone()
    real_row_changed["action"][0, 0] += 1.0
    assert (loss_at_seed(loss, real_row_changed) - baseline).abs() > 1e-4

    # The error is averaged over the real rows only.
    torch.manual_seed(7)
    action = torch.where(row_mask[..., None], data["action"], torch.zeros(()).double())
    noise = torch.randn(action.shape, dtype=action.dtype)
    sigma = torch.rand(NUM_DECISIONS, dtype=action.dtype)
    x = (1 - sigma[:, None, None]) * action + sigma[:, None, None] * noise
    error = (policy.velocity_network(x, sigma, data["observation"]) - (noise - action)).pow(2)
    row_error = error.mean(-1)
    expected = ((row_error * row_mask).sum(-1) / row_mask.sum(-1)).mean()
    torch.testing.assert_close(baseline, expected, atol=1e-12, rtol=1e-12)


def test_short_target_is_padded_and_masked():
    policy = make_policy()
    executed_rows = 2
    full = make_data()
    short = full.clone()
    short["action"] = full["action"][:, :executed_rows].clone()
    loss = FlowMatchingLoss(policy)

    masked_full = full.clone()
    row_mask = torch.zeros(NUM_DECISIONS, ACTION_SHAPE[0], dtype=torch.bool)
    row_mask[:, :executed_rows] = True
    masked_full["action_row_mask"] = row_mask
    short_loss = loss_at_seed(loss, short)
    torch.testing.assert_close(short_loss, loss_at_seed(loss, masked_full), atol=0, rtol=0)
    assert (short_loss - loss_at_seed(loss, full)).abs() > 1e-4


def test_training_lowers_the_loss_on_a_fixed_dataset():
    policy = make_policy()
    generator = torch.Generator().manual_seed(2)
    observation = torch.randn(32, OBSERVATION_DIM, generator=generator).double()
    weight = torch.randn(OBSERVATION_DIM, ACTION_SHAPE[0] * ACTION_SHAPE[1], generator=generator)
    action = (observation @ weight.double()).tanh().reshape(32, *ACTION_SHAPE)
    data = TensorDict({"observation": observation, "action": action}, batch_size=[32])
    loss = FlowMatchingLoss(policy)

    before = loss_at_seed(loss, data).detach()
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    torch.manual_seed(3)
    for _ in range(100):
        optimizer.zero_grad()
        loss(data)["loss_flow_matching"].backward()
        optimizer.step()
    after = loss_at_seed(loss, data).detach()
    assert after < 0.6 * before, (before, after)


def logit_normal_variance() -> float:
    """``Var[sigmoid(z)]`` for ``z ~ N(0, 1)``, by quadrature."""
    z = torch.linspace(-12.0, 12.0, 100_001, dtype=torch.float64)
    density = torch.exp(-0.5 * z**2) / (2 * torch.pi) ** 0.5
    mean = torch.trapezoid(torch.sigmoid(z) * density, z)
    return (torch.trapezoid(torch.sigmoid(z) ** 2 * density, z) - mean**2).item()


SIGMA_MOMENTS = {
    # distribution: (mean, variance)
    "uniform": (0.5, 1 / 12),
    "logit_normal": (0.5, logit_normal_variance()),
    # 0.001 + 0.999 u with u ~ Beta(1.5, 1): E[u] = 1.5 / 2.5, Var[u] = 1.5 / (2.5^2 * 3.5).
    "beta": (0.001 + 0.999 * 0.6, 0.999**2 * 1.5 / (2.5**2 * 3.5)),
}


@pytest.mark.parametrize("distribution", ["uniform", "logit_normal", "beta"])
def test_sigma_distributions(distribution):
    expected_mean, expected_variance = SIGMA_MOMENTS[distribution]
    torch.manual_seed(0)
    sigma = flow.sample_training_sigma((200_000,), distribution, dtype=torch.float64)
    assert sigma.min() >= 0 and sigma.max() <= 1
    # Standard errors: below 0.3 / sqrt(2e5) ~ 7e-4 for the mean, ~2e-4 for the variance.
    assert abs(sigma.mean().item() - expected_mean) < 4e-3
    assert abs(sigma.var().item() - expected_variance) < 2e-3
    if distribution == "beta":
        assert sigma.min() >= 0.001

    # The loss draws its noise levels from the chosen distribution.
    recorder = SigmaRecorder(MLPVelocityNetwork(OBSERVATION_DIM, ACTION_SHAPE, hidden_dim=16))
    policy = make_policy(network=recorder)
    loss = FlowMatchingLoss(policy, sigma_distribution=distribution)
    data = make_data()
    with torch.no_grad():
        for _ in range(250):
            loss(data)
    drawn = torch.cat(recorder.sigmas)
    assert drawn.numel() == 250 * NUM_DECISIONS
    assert drawn.min() >= 0 and drawn.max() <= 1
    # 4000 draws: standard errors ~5e-3 (mean) and ~1.5e-3 (variance).
    assert abs(drawn.mean().item() - expected_mean) < 0.025
    assert abs(drawn.var().item() - expected_variance) < 0.008


def test_context_grad_option_controls_encoder_gradient():
    from torchrl_flowpolicy.networks import ActionExpertTransformer, ObservationEncoder

    torch.manual_seed(0)
    encoder = ObservationEncoder(OBSERVATION_DIM, model_dim=16, num_tokens=2, hidden_dim=16)
    expert = ActionExpertTransformer(ACTION_SHAPE, model_dim=16, num_heads=2, num_layers=1)
    policy = FlowSDEPolicy(expert.double(), action_shape=ACTION_SHAPE, encoder=encoder.double())
    data = make_data()
    for context_grad in (False, True):
        policy.zero_grad(set_to_none=True)
        FlowMatchingLoss(policy, context_grad=context_grad)(data)["loss_flow_matching"].backward()
        encoder_gradient = [p.grad for p in encoder.parameters()]
        assert all(p.grad is not None for p in expert.parameters())
        assert any(g is not None and g.abs().sum() > 0 for g in encoder_gradient) == context_grad


def test_errors_for_missing_action_and_too_many_rows():
    policy = make_policy()
    data = make_data()
    with pytest.raises(KeyError, match="action"):
        FlowMatchingLoss(policy)(data.exclude("action"))
    loss = FlowMatchingLoss(policy)
    loss.set_keys(action="demonstration")
    with pytest.raises(KeyError, match="demonstration"):
        loss(data)
    data["demonstration"] = data["action"]
    assert loss(data)["loss_flow_matching"].shape == ()
    with pytest.raises(ValueError, match="rows"):
        FlowMatchingLoss(policy)(make_data(rows=ACTION_SHAPE[0] + 1))
    with pytest.raises(ValueError, match="sigma distribution"):
        FlowMatchingLoss(policy, sigma_distribution="normal")
