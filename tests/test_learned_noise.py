"""Tests of the learned exploration noise (``NoiseHead``; pi-RL's Flow-Noise, ReinFlow).

The math is checked against ``torch.distributions.Normal`` and its closed-form KL; the policy
against an independent recomputation of the Euler mean plus the head's std; the gradients
against finite differences; the loss against a per-entry hand computation.
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict
from torch import Tensor, nn
from torch.distributions import Normal, kl_divergence
from torchrl.envs.utils import ExplorationType, set_exploration_type

from torchrl_flowpolicy import FlowSDEPolicy, flow
from torchrl_flowpolicy.networks import (
    ActionExpertTransformer,
    MLPVelocityNetwork,
    NoiseHead,
    ObservationEncoder,
)
from torchrl_flowpolicy.objectives import DenoisingClipPPOLoss
from torchrl_flowpolicy.sampler import SamplerOptions

OBSERVATION_DIM = 5
ACTION_SHAPE = (4, 2)
CHAIN = ("flow", "chain")
SDE_MASK = ("flow", "sde_mask")
STEP_LOG_PROB = ("flow", "step_log_prob")
STEP_STD = ("flow", "step_std")
MODES = ("mixed", "last", "all")


# ---------------------------------------------------------------------------- helpers
def make_head(context_dim: int = OBSERVATION_DIM, **kwargs) -> NoiseHead:
    options = {"min_std": 0.02, "max_std": 0.5, "initial_std": 0.1, "hidden_dim": 16} | kwargs
    return NoiseHead(context_dim, ACTION_SHAPE, **options)


def perturb(module: nn.Module, scale: float, seed: int = 3) -> None:
    """Move every parameter by Gaussian noise (an "updated" network; a head that depends on
    its inputs)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            parameter.add_(noise * scale)


def make_policy(
    *,
    dtype: torch.dtype = torch.float64,
    sde_mode: str = "all",
    num_denoising_steps: int = 4,
    noise_level: float = 0.5,
    head_scale: float = 0.3,
    **kwargs,
) -> FlowSDEPolicy:
    """An MLP flow policy with a noise head whose std depends on its inputs."""
    torch.manual_seed(0)
    network = MLPVelocityNetwork(OBSERVATION_DIM, ACTION_SHAPE, hidden_dim=32, num_layers=2)
    head = make_head()
    perturb(head, head_scale)
    return FlowSDEPolicy(
        network.to(dtype),
        action_shape=ACTION_SHAPE,
        noise_head=head.to(dtype),
        **kwargs,
        options=SamplerOptions(
            num_denoising_steps=num_denoising_steps,
            sde_mode=sde_mode,
            num_sde_steps=2,
            noise_level=noise_level,
        ),
    )


def make_transformer_policy(sde_mode: str, dtype: torch.dtype = torch.float32) -> FlowSDEPolicy:
    """The examples' architecture: encoder tokens shared by the expert and the head."""
    torch.manual_seed(0)
    encoder = ObservationEncoder(OBSERVATION_DIM, model_dim=16, num_tokens=2, hidden_dim=32)
    expert = ActionExpertTransformer(ACTION_SHAPE, model_dim=16, num_heads=2, num_layers=1)
    head = make_head(context_dim=2 * 16)
    perturb(head, 0.3)
    return FlowSDEPolicy(
        expert.to(dtype),
        action_shape=ACTION_SHAPE,
        encoder=encoder.to(dtype),
        noise_head=head.to(dtype),
        executed_chunk_length=3,
        options=SamplerOptions(num_denoising_steps=6, sde_mode=sde_mode, num_sde_steps=3),
    )


def collect(policy: FlowSDEPolicy, batch_shape=(8,), seed: int = 1) -> TensorDict:
    torch.manual_seed(seed)
    observation = torch.randn(*batch_shape, OBSERVATION_DIM, dtype=policy.network_dtype)
    data = TensorDict({"observation": observation}, batch_size=batch_shape)
    with set_exploration_type(ExplorationType.RANDOM), torch.no_grad():
        return policy(data)


def hand_steps(policy: FlowSDEPolicy, data: TensorDict) -> list[tuple[Tensor, Tensor, Tensor]]:
    """``(mean, std, sample)`` of every stochastic entry, one at a time: the Euler mean
    ``x_k + v(x_k, sigma_k) Delta_k`` and the head's std at ``x_k``, on the executed rows."""
    num_denoising_steps, rows = policy.num_denoising_steps, policy.executed_chunk_length
    chain = data[CHAIN].reshape(-1, num_denoising_steps + 1, *ACTION_SHAPE)
    mask = data[SDE_MASK].reshape(-1, num_denoising_steps)
    observation = data["observation"].reshape(-1, OBSERVATION_DIM)
    sigmas = flow.sigma_grid(num_denoising_steps, dtype=chain.dtype)
    entries = []
    for decision, step in mask.nonzero().tolist():
        x, context = chain[decision, step][None], observation[decision][None]
        sigma = sigmas[step : step + 1]
        velocity = policy.velocity_network(x, sigma, context)
        mean = flow.ode_step(x, velocity, sigmas[step], sigmas[step + 1])[0, :rows]
        std = policy.noise_head(x, sigma, context)[0, :rows]
        entries.append((mean, std, chain[decision, step + 1, :rows]))
    return entries


def gradient_total(module: nn.Module) -> float:
    return sum(float(p.grad.abs().sum()) for p in module.parameters() if p.grad is not None)


# ---------------------------------------------------------------------------- flow math
def test_per_entry_log_prob_matches_torch_normal():
    generator = torch.Generator().manual_seed(0)
    x, mean = torch.randn(2, 6, 4, 3, generator=generator, dtype=torch.float64).unbind(0)
    std = 0.05 + torch.rand(6, 4, 3, generator=generator, dtype=torch.float64)
    expected = Normal(mean, std).log_prob(x).sum((-2, -1))
    torch.testing.assert_close(flow.gaussian_log_prob(x, mean, std), expected, rtol=1e-12, atol=0)
    # A std shared over the rows broadcasts; one per event equals the same std per entry.
    shared = std[:, :1]
    expected = Normal(mean, shared.expand_as(x)).log_prob(x).sum((-2, -1))
    torch.testing.assert_close(flow.gaussian_log_prob(x, mean, shared), expected)
    per_event = std[:, 0, 0]
    torch.testing.assert_close(
        flow.gaussian_log_prob(x, mean, per_event),
        flow.gaussian_log_prob(x, mean, per_event[:, None, None].expand_as(x)),
    )
    with pytest.raises(ValueError, match="std has shape"):
        flow.gaussian_log_prob(x, mean, std[:, 0])


def test_gaussian_entropy_matches_torch_normal_and_ignores_the_mean():
    generator = torch.Generator().manual_seed(1)
    std = 0.05 + torch.rand(5, 4, 3, generator=generator, dtype=torch.float64)
    expected = Normal(torch.zeros_like(std), std).entropy().sum((-2, -1))
    torch.testing.assert_close(flow.gaussian_entropy(std, std.shape), expected)
    per_event = std[:, 0, 0]
    torch.testing.assert_close(
        flow.gaussian_entropy(per_event, std.shape),
        Normal(0.0, per_event[:, None, None].expand_as(std)).entropy().sum((-2, -1)),
    )


@pytest.mark.parametrize("layout", ["entry-entry", "event-entry", "entry-event", "event-event"])
def test_gaussian_kl_is_the_closed_form_of_torch(layout):
    generator = torch.Generator().manual_seed(2)
    mean, other_mean = torch.randn(2, 5, 4, 3, generator=generator, dtype=torch.float64)
    stds = 0.05 + torch.rand(2, 5, 4, 3, generator=generator, dtype=torch.float64)
    std, other_std = [
        s if kind == "entry" else s[:, 0, 0]
        for s, kind in zip(stds, layout.split("-"), strict=True)
    ]
    full = [s if s.ndim == 3 else s[:, None, None].expand_as(mean) for s in (std, other_std)]
    expected = kl_divergence(Normal(mean, full[0]), Normal(other_mean, full[1])).sum((-2, -1))
    kl = flow.gaussian_kl(mean, std, other_mean, other_std)
    torch.testing.assert_close(kl, expected, rtol=1e-10, atol=1e-12)
    assert (kl > 0).all()
    assert torch.equal(flow.gaussian_kl(mean, std, mean, std), torch.zeros(5, dtype=kl.dtype))


def test_gaussian_kl_with_a_shared_std_is_the_fixed_schedules_formula():
    generator = torch.Generator().manual_seed(3)
    mean, other_mean = torch.randn(2, 7, 4, 3, generator=generator, dtype=torch.float64)
    std = 0.05 + torch.rand(7, generator=generator, dtype=torch.float64)
    squared = (mean - other_mean).pow(2).flatten(1).sum(-1)
    assert torch.equal(flow.gaussian_kl(mean, std, other_mean, std), squared / (2 * std.pow(2)))


def test_bounded_std_stays_inside_its_bounds_and_inverts():
    min_std, max_std = 0.02, 0.3
    raw = torch.tensor([-math.inf, -1e6, -30.0, -1.0, 0.0, 1.0, 30.0, 1e6, math.inf])
    std = flow.bounded_std(raw, min_std, max_std)
    assert torch.isfinite(std).all()
    assert (std >= min_std * (1 - 1e-6)).all() and (std <= max_std * (1 + 1e-6)).all()
    assert (std.diff() >= 0).all()  # monotone in the raw output
    torch.testing.assert_close(std[4], torch.tensor(math.sqrt(min_std * max_std)))
    for target in (0.021, 0.05, 0.08, 0.2, 0.29):
        raw_value = flow.bounded_std_logit(target, min_std, max_std)
        value = flow.bounded_std(torch.tensor(raw_value, dtype=torch.float64), min_std, max_std)
        assert abs(value.item() - target) < 1e-12


@pytest.mark.parametrize(
    ("min_std", "max_std", "initial_std", "match"),
    [
        (0.0, 0.3, None, "min_std must be a finite number > 0"),
        (-0.1, 0.3, None, "min_std must be a finite number > 0"),
        (float("nan"), 0.3, None, "min_std must be a finite number > 0"),
        (0.02, float("inf"), None, "max_std must be a finite number > 0"),
        (0.3, 0.3, None, "min_std must be < max_std"),
        (0.3, 0.02, None, "min_std must be < max_std"),
        (0.02, 0.3, 0.02, "initial_std must be a finite number strictly between"),
        (0.02, 0.3, 0.5, "initial_std must be a finite number strictly between"),
        (0.02, 0.3, float("nan"), "initial_std must be a finite number strictly between"),
    ],
)
def test_std_bounds_are_validated(min_std, max_std, initial_std, match):
    with pytest.raises(ValueError, match=match):
        flow.check_std_bounds(min_std, max_std, initial_std)
    with pytest.raises(ValueError, match=match):
        NoiseHead(3, ACTION_SHAPE, min_std=min_std, max_std=max_std, initial_std=initial_std)


def _x_dependent_std(x: Tensor, sigma: Tensor) -> Tensor:
    return 0.05 + 0.1 * torch.sigmoid(x) * sigma[:, None, None]


def test_integrate_with_a_learned_std_adds_it_to_the_euler_mean():
    generator = torch.Generator().manual_seed(4)
    num_denoising_steps, dtype = 5, torch.float64
    weight = torch.randn(3, 3, generator=generator, dtype=dtype)

    def velocity(x, sigma):
        return torch.tanh(x @ weight) * (1 + sigma[:, None, None])

    schedule = flow.sampling_schedule(num_denoising_steps, 0.0, dtype=dtype)
    x0 = torch.randn(6, 2, 3, generator=generator, dtype=dtype)
    mask = flow.sample_sde_mask((6,), num_denoising_steps, "mixed", generator=generator)
    xi = torch.randn(6, num_denoising_steps, 2, 3, generator=generator, dtype=dtype)
    chain, means, step_std = flow.integrate(
        velocity, x0, schedule, mask, xi, noise_std=_x_dependent_std
    )
    sigmas = schedule.sigmas
    for k in range(num_denoising_steps):
        x, sigma = chain[:, k], sigmas[k].expand(6)
        euler = x + velocity(x, sigma) * (sigmas[k + 1] - sigmas[k])
        std = torch.where(mask[:, k, None, None], _x_dependent_std(x, sigma), 0.0)
        torch.testing.assert_close(means[:, k], euler, rtol=0, atol=1e-15)
        torch.testing.assert_close(step_std[:, k], std, rtol=0, atol=0)
        torch.testing.assert_close(chain[:, k + 1], euler + std * xi[:, k], rtol=0, atol=1e-15)
    # The chain's log-probs with the per-entry std: Normal over the executed rows.
    log_prob = flow.chain_log_prob(chain, means, mask, step_std, rows=1)
    for decision, step in mask.nonzero().tolist():
        expected = Normal(means[decision, step, :1], step_std[decision, step, :1])
        wanted = expected.log_prob(chain[decision, step + 1, :1]).sum()
        torch.testing.assert_close(log_prob[decision, step], wanted)
    assert (log_prob[~mask] == 0).all()
    with pytest.raises(ValueError, match="noise_std needs an sde_mask"):
        flow.integrate(velocity, x0, schedule, noise_std=_x_dependent_std)


def test_integrate_refuses_a_learned_std_that_is_not_positive():
    schedule = flow.sampling_schedule(4, 0.0)
    mask = torch.tensor([[False, False, True, False]])

    def zero_std(x, sigma):
        return torch.zeros_like(x)

    with pytest.raises(ValueError, match="not finite and > 0 at denoising step 2"):
        flow.integrate(
            lambda x, s: x, torch.ones(1, 2, 1), schedule, mask, torch.ones(1, 4, 2, 1),
            noise_std=zero_std,
        )  # fmt: skip


def test_stochastic_steps_recompute_the_sampled_std_in_one_call():
    generator = torch.Generator().manual_seed(5)
    schedule = flow.sampling_schedule(6, 0.0, dtype=torch.float64)
    x0 = torch.randn(4, 3, 2, generator=generator, dtype=torch.float64)
    mask = flow.sample_sde_mask((4,), 6, "all")
    xi = torch.randn(4, 6, 3, 2, generator=generator, dtype=torch.float64)

    def velocity(x, sigma, index=None):
        return -x * sigma[:, None, None]

    chain, means, step_std = flow.integrate(
        velocity, x0, schedule, mask, xi, noise_std=_x_dependent_std
    )
    calls = []

    def indexed_std(x, sigma, decision_index):
        calls.append(x.shape[0])
        return _x_dependent_std(x, sigma)

    steps = flow.stochastic_steps(velocity, chain, mask, schedule, rows=2, noise_std=indexed_std)
    assert calls == [int(mask.sum())]  # one batched call over the stochastic entries
    torch.testing.assert_close(steps.std, step_std[mask][:, :2], rtol=0, atol=0)
    torch.testing.assert_close(steps.mean, means[mask][:, :2], rtol=0, atol=1e-15)
    dense = flow.scatter_steps(
        steps, flow.gaussian_log_prob(steps.sample, steps.mean, steps.std), mask.shape
    )
    torch.testing.assert_close(dense, flow.chain_log_prob(chain, means, mask, step_std, 2))


# ---------------------------------------------------------------------------- NoiseHead
def test_noise_head_starts_at_its_initial_std_and_stays_in_its_bounds():
    torch.manual_seed(0)
    head = make_head(initial_std=0.07)
    x, sigma, context = torch.randn(9, *ACTION_SHAPE) * 5, torch.rand(9), torch.randn(9, 5) * 5
    std = head(x, sigma, context)
    torch.testing.assert_close(std, torch.full_like(std, 0.07), rtol=1e-6, atol=0)
    assert make_head(initial_std=None).initial_std == pytest.approx(math.sqrt(0.02 * 0.5))
    perturb(head, 10.0)  # far from the start: the std varies but stays bounded
    std = head(x * 100, sigma, context * 100)
    assert std.std() > 0
    assert (std >= 0.02 * (1 - 1e-6)).all() and (std <= 0.5 * (1 + 1e-6)).all()
    with pytest.raises(ValueError, match="context_dim=5"):
        head(x, sigma, torch.randn(9, 2, 4))


# ---------------------------------------------------------------------------- the policy
@pytest.mark.parametrize("mode", MODES)
def test_policy_samples_euler_mean_plus_head_std_and_rescores_exactly(mode):
    policy = make_policy(sde_mode=mode, num_denoising_steps=5, executed_chunk_length=3)
    data = collect(policy, (6,))
    assert STEP_STD in policy.out_keys and STEP_STD in policy.spec.keys(True)
    assert data[STEP_STD].shape == (6, 5, *ACTION_SHAPE)
    mask = data[SDE_MASK]
    assert (data[STEP_STD][~mask] == 0).all() and (data[STEP_STD][mask] > 0).all()
    entries = hand_steps(policy, data)
    stored_std = data[STEP_STD][mask][:, :3]
    expected = []
    for (mean, std, sample), stored in zip(entries, stored_std, strict=True):
        torch.testing.assert_close(stored, std, rtol=1e-12, atol=0)
        expected.append(Normal(mean, std).log_prob(sample).sum())
    expected = torch.stack(expected)
    torch.testing.assert_close(data[STEP_LOG_PROB][mask], expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(policy.log_prob(data), data[STEP_LOG_PROB], rtol=0, atol=1e-10)
    # The std depends on the state: not one value for every entry.
    assert stored_std.std() > 1e-3


def test_log_prob_makes_one_call_of_each_network(counting):
    policy = make_policy(sde_mode="all", num_denoising_steps=6)
    policy.velocity_network = counting(policy.velocity_network)
    policy.noise_head = counting(policy.noise_head)
    data = collect(policy, (5,))
    assert policy.velocity_network.calls == 6 and policy.noise_head.calls == 5  # steps 1..5
    policy.velocity_network.calls = policy.noise_head.calls = 0
    policy.noise_head.rows = []
    policy.log_prob(data)
    assert policy.velocity_network.calls == 1 and policy.noise_head.calls == 1
    assert policy.noise_head.rows == [int(data[SDE_MASK].sum())]


def test_without_a_head_the_fixed_schedule_is_unchanged():
    fixed = make_policy()
    head = fixed.noise_head
    fixed.noise_head = None
    assert STEP_STD not in fixed.out_keys and STEP_STD not in fixed.spec.keys(True)
    before = collect(fixed)
    assert STEP_STD not in before.keys(True)
    torch.manual_seed(0)  # a fresh fixed-schedule policy with the same weights and seed
    network = MLPVelocityNetwork(OBSERVATION_DIM, ACTION_SHAPE, hidden_dim=32, num_layers=2)
    plain = FlowSDEPolicy(
        network.double(),
        action_shape=ACTION_SHAPE,
        options=SamplerOptions(num_denoising_steps=4, sde_mode="all", num_sde_steps=2),
    )
    again = collect(plain)
    for key in (CHAIN, SDE_MASK, STEP_LOG_PROB):
        assert torch.equal(before[key], again[key])
    fixed.noise_head = head  # a head set later: the learned sampler, step_std written
    learned = collect(fixed)
    assert STEP_STD in fixed.out_keys and STEP_STD in learned.keys(True)
    assert not torch.equal(learned[CHAIN], before[CHAIN])
    assert torch.equal(learned[CHAIN][:, :2], before[CHAIN][:, :2])  # x_0 and the ODE step 0


def test_with_a_head_a_zero_noise_level_keeps_the_stochastic_steps():
    policy = make_policy(noise_level=0.0)
    data = collect(policy)
    assert data[SDE_MASK].any() and (data[STEP_STD][data[SDE_MASK]] > 0).all()


def test_a_bad_head_is_refused_with_a_message_naming_it():
    policy = make_policy()
    with pytest.raises(ValueError, match="noise_head was built for action_shape"):
        policy.noise_head = NoiseHead(OBSERVATION_DIM, (2, 2))
    data = collect(policy)

    class Negative(nn.Module):
        def forward(self, x, sigma, context):
            return -torch.ones_like(x)

    policy.noise_head = Negative()
    with pytest.raises(ValueError, match="noise_head produced a std that is not finite"):
        policy.log_prob(data)
    with pytest.raises(ValueError, match=r"noise std \(noise_std, a noise head\) is not finite"):
        collect(policy)


# ---------------------------------------------------------------------------- gradients
def test_log_prob_gradient_wrt_head_parameters_matches_finite_differences():
    policy = make_policy(sde_mode="all")
    data = collect(policy)
    head = policy.noise_head
    chosen = [(head.mlp[0].weight, (0, 3)), (head.mlp[2].weight, (1, 1)), (head.mlp[-1].bias, (5,))]
    total = policy.log_prob(data).sum()
    gradients = torch.autograd.grad(total, [parameter for parameter, _ in chosen])
    step = 1e-6
    for (parameter, index), gradient in zip(chosen, gradients, strict=True):
        with torch.no_grad():
            original = parameter[index].item()
            parameter[index] = original + step
            up = policy.log_prob(data).sum().item()
            parameter[index] = original - step
            down = policy.log_prob(data).sum().item()
            parameter[index] = original
        finite_difference = (up - down) / (2 * step)
        assert abs(gradient[index].item()) > 1e-3  # the head matters
        assert gradient[index].item() == pytest.approx(finite_difference, rel=1e-5, abs=1e-7)


def test_entropy_bonus_gradient_reaches_the_head_and_not_the_velocity_network():
    policy = make_transformer_policy("all", dtype=torch.float64)
    data = collect(policy)
    data["advantage"] = torch.randn(8, 1, dtype=torch.float64)
    loss = DenoisingClipPPOLoss(policy, entropy_bonus=True, entropy_coeff=0.1)
    out = loss(data)
    out["loss_entropy"].backward()
    assert gradient_total(policy.noise_head) > 0
    assert all(p.grad is None for p in policy.velocity_network.parameters())
    assert all(p.grad is None for p in policy.encoder.parameters())  # context_grad=False
    # The objective's gradient reaches both networks (the ratio has the std's change too).
    policy.zero_grad(set_to_none=True)
    loss(data)["loss_objective"].backward()
    assert gradient_total(policy.noise_head) > 0 and gradient_total(policy.velocity_network) > 0
    # A few steps of the bonus alone raise the std, up to the bound.
    optimizer = torch.optim.Adam(policy.noise_head.parameters(), lr=0.05)
    start = loss(data)["entropy"].item()
    for _ in range(20):
        optimizer.zero_grad()
        loss(data)["loss_entropy"].backward()
        optimizer.step()
    assert loss(data)["entropy"].item() > start + 1.0
    assert policy.log_prob(data).isfinite().all()


# ---------------------------------------------------------------------------- the loss
def test_ratio_includes_the_change_of_the_std():
    policy = make_policy(sde_mode="all")
    data = collect(policy, (12,))
    advantage = torch.randn(12, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    data["advantage"] = advantage
    perturb(policy.noise_head, 0.2, seed=11)  # only the std moves
    out = DenoisingClipPPOLoss(policy, clip_epsilon=0.2)(data)
    mask = data[SDE_MASK]
    old = data[STEP_LOG_PROB][mask]
    new = torch.stack([Normal(m, s).log_prob(x).sum() for m, s, x in hand_steps(policy, data)])
    ratio = (new - old).exp()
    assert (ratio - 1).abs().max() > 0.05  # the std change alone moves the ratio
    entry_advantage = advantage.expand(12, policy.num_denoising_steps)[mask]
    gain = torch.minimum(ratio * entry_advantage, ratio.clamp(0.8, 1.2) * entry_advantage)
    # (TorchRL keeps the clip bounds log(1 -/+ eps) in float32: agreement to about 1e-8.)
    torch.testing.assert_close(out["loss_objective"], -gain.mean(), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(out["mean_ratio"], ratio.mean(), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(out["log_prob_drift"], (new - old).abs().max())


@pytest.mark.parametrize("kl_estimator", ["analytic", "sample"])
def test_kl_to_the_reference_uses_both_stds(kl_estimator):
    policy = make_policy(sde_mode="all")
    data = collect(policy)
    data["advantage"] = torch.randn(8, 1, dtype=torch.float64)
    loss = DenoisingClipPPOLoss(policy, kl_coeff=0.1, kl_estimator=kl_estimator)
    assert loss(data)["kl_reference"] == 0
    reference = hand_steps(loss.reference_actor, data)
    perturb(policy.noise_head, 0.2, seed=12)
    perturb(policy.velocity_network, 0.02, seed=13)
    out = loss(data)
    per_entry = []
    for (mean, std, sample), (ref_mean, ref_std, _) in zip(
        hand_steps(policy, data), reference, strict=True
    ):
        assert not torch.allclose(std, ref_std)
        if kl_estimator == "analytic":
            per_entry.append(kl_divergence(Normal(mean, std), Normal(ref_mean, ref_std)).sum())
        else:
            per_entry.append(
                Normal(mean, std).log_prob(sample).sum()
                - Normal(ref_mean, ref_std).log_prob(sample).sum()
            )
    per_entry = torch.stack(per_entry)
    torch.testing.assert_close(out["kl_reference"], per_entry.mean(), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(out["loss_kl"], 0.1 * per_entry.mean(), rtol=1e-8, atol=1e-10)
    out["loss_kl"].backward()
    assert gradient_total(policy.noise_head) > 0
    assert all(p.grad is None for p in loss.reference_actor.parameters())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch_shape", [(16,), (4, 5)])
def test_log_prob_drift_on_fresh_data_is_at_float_precision(mode, batch_shape):
    policy = make_transformer_policy(mode)
    data = collect(policy, batch_shape)
    data["advantage"] = torch.randn(*batch_shape, 1)
    out = DenoisingClipPPOLoss(policy)(data)
    assert out["num_stochastic_steps"] == data[SDE_MASK].sum() > 0
    assert out["log_prob_drift"] <= 1e-5
    torch.testing.assert_close(out["mean_ratio"], torch.tensor(1.0), rtol=0, atol=1e-5)
    assert out["clip_fraction"] == 0


def test_single_step_policy_with_a_bfloat16_network_and_a_float32_head():
    # The head keeps its own dtype; the chain, the std and the log-probs stay float32, and
    # the stored std of a single-step policy drops the row dimension like its chain.
    torch.manual_seed(0)
    network = MLPVelocityNetwork(OBSERVATION_DIM, (1, 3), hidden_dim=32).to(torch.bfloat16)
    head = NoiseHead(OBSERVATION_DIM, (1, 3), min_std=0.02, max_std=0.5)
    perturb(head, 0.3)
    policy = FlowSDEPolicy(
        network,
        action_shape=(3,),
        noise_head=head,
        options=SamplerOptions(sde_mode="all", num_denoising_steps=4),
    )
    data = collect(policy, (7,))
    assert data["action"].shape == (7, 3) and data[CHAIN].shape == (7, 5, 3)
    assert data[STEP_STD].shape == (7, 4, 3) and data[STEP_STD].dtype == torch.float32
    assert policy.spec[STEP_STD].shape == (4, 3)
    torch.testing.assert_close(policy.log_prob(data), data[STEP_LOG_PROB], rtol=0, atol=1e-5)
    steps = policy.stochastic_steps(data)
    assert steps.std.shape == (int(data[SDE_MASK].sum()), 1, 3)
    torch.testing.assert_close(steps.std[:, 0], data[STEP_STD][data[SDE_MASK]])
