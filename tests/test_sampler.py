"""Tests of ``FlowSampler`` on tensors: sampling, the ODE, rescoring, settings, the action mask
and the network dtype; and of the flow math they rest on (masked Gaussian terms)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from torch.distributions import Normal

from torchrl_flowpolicy import FlowSDEPolicy, flow
from torchrl_flowpolicy.networks import MLPVelocityNetwork, NoiseHead
from torchrl_flowpolicy.objectives import DenoisingClipPPOLoss
from torchrl_flowpolicy.objectives.surrogate import clipped_surrogate, ratio_diagnostics
from torchrl_flowpolicy.sampler import FlowSampler, SamplerOptions

OBSERVATION_DIM = 5
CHUNK_SHAPE = (4, 3)
REAL = torch.tensor([True, True, False])  # the last action dimension is padding


def make_sampler(**kwargs) -> FlowSampler:
    torch.manual_seed(0)
    network = MLPVelocityNetwork(OBSERVATION_DIM, CHUNK_SHAPE, hidden_dim=32, num_layers=2)
    return FlowSampler(network, chunk_shape=CHUNK_SHAPE, **kwargs)


def observation(batch: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, OBSERVATION_DIM, generator=torch.Generator().manual_seed(seed))


class Decay(nn.Module):
    """``v = x * rate``: every action dimension moves on its own (no mixing across them)."""

    def __init__(self, rate: float = 0.7):
        super().__init__()
        self.rate = nn.Parameter(torch.tensor(rate))

    def forward(self, x, sigma, context):
        return x * self.rate


# --------------------------------------------------------------------------- tensor methods
@pytest.mark.parametrize("mode", ["mixed", "last", "all"])
def test_sample_rescore_and_log_prob_agree_on_tensors(mode):
    sampler = make_sampler(options=SamplerOptions(sde_mode=mode, num_sde_steps=3))
    context = sampler.context(observation())
    torch.manual_seed(2)
    rollout = sampler.sample(context, 6)
    assert rollout.chain.shape == (6, 9, *CHUNK_SHAPE)
    assert rollout.sde_mask.shape == rollout.step_log_prob.shape == (6, 8)
    assert rollout.step_std is None
    assert torch.equal(rollout.action, rollout.chain[:, -1])
    assert torch.equal(rollout.log_prob, rollout.step_log_prob.sum(-1))
    assert (rollout.step_log_prob[~rollout.sde_mask] == 0).all()
    steps = sampler.rescore(context, rollout.chain, rollout.sde_mask)
    assert steps.mean.requires_grad
    torch.testing.assert_close(
        sampler.log_prob(steps), rollout.step_log_prob[rollout.sde_mask], rtol=0, atol=1e-5
    )
    # The same draws as the policy's: the policy is a shell around this sampler.
    policy = FlowSDEPolicy(sampler, action_shape=CHUNK_SHAPE)
    torch.manual_seed(2)
    td = policy(TensorDict({"observation": observation()}, [6]))
    assert torch.equal(td["flow", "chain"], rollout.chain)
    assert torch.equal(td["flow", "step_log_prob"], rollout.step_log_prob)


def test_ode_is_the_euler_loop_and_ode_sample_scales_its_noise():
    sampler = make_sampler(options=SamplerOptions(eval_num_denoising_steps=5, shift=2.0))
    context = sampler.context(observation(3))
    x0 = torch.randn(3, *CHUNK_SHAPE)
    sigmas, x = flow.sigma_grid(5, 2.0), x0
    with torch.no_grad():
        for k in range(5):
            x = x + sampler.velocity_network(x, sigmas[k].expand(3), context) * (
                sigmas[k + 1] - sigmas[k]
            )
    assert torch.equal(sampler.ode(context, x0), x)
    # eval_noise_scale 0 (the default): the noise-free chunk, whatever the draw.
    assert torch.equal(sampler.ode_sample(context, 3), sampler.ode(context, torch.zeros_like(x0)))
    sampler.options = sampler.options.replace(eval_noise_scale=0.5)
    torch.manual_seed(4)
    drawn = torch.randn(3, *CHUNK_SHAPE)
    torch.manual_seed(4)
    assert torch.equal(sampler.ode_sample(context, 3), sampler.ode(context, 0.5 * drawn))
    with pytest.raises(ValueError, match="initial_noise has shape"):
        sampler.ode(context, torch.zeros(3, 2, 3))


def test_rescore_names_the_stored_tensors_and_their_steps():
    sampler = make_sampler()
    context = sampler.context(observation(2))
    rollout = sampler.sample(context, 2)
    with pytest.raises(ValueError, match=r"my_chain.*num_denoising_steps=8.*K=5"):
        sampler.rescore(context, rollout.chain[:, :6], rollout.sde_mask, chain_name="my_chain")
    bad_mask = rollout.sde_mask.clone()
    bad_mask[0, 0] = True
    with pytest.raises(ValueError, match="my_mask marks step 0"):
        sampler.rescore(context, rollout.chain, bad_mask, sde_mask_name="my_mask")
    sampler.rescore(context, rollout.chain, bad_mask, check_data=False)  # unchecked: scored


# --------------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    ("change", "name"),
    [
        ({"noise_level": -1.0}, "noise_level"),
        ({"num_denoising_steps": 1}, "num_denoising_steps"),
        ({"num_denoising_steps": 2.5}, "num_denoising_steps"),
        ({"eval_num_denoising_steps": 0}, "eval_num_denoising_steps"),
        ({"sde_mode": "first"}, "sde_mode"),
        ({"sde_mode": "last", "num_sde_steps": 8}, "num_sde_steps"),
        ({"shift": 0.0}, "shift"),
        ({"noise_schedule": "cosine"}, "noise_schedule"),
        ({"rollout_noise_scale": -0.1}, "rollout_noise_scale"),
        ({"eval_noise_scale": float("nan")}, "eval_noise_scale"),
    ],
)
def test_a_refused_option_names_itself_and_changes_nothing(change, name):
    with pytest.raises(ValueError, match=name):
        make_sampler(options=SamplerOptions(**change))
    sampler = make_sampler()
    before = sampler.options
    schedule = sampler.schedule(8, torch.float32, None)
    with pytest.raises(ValueError, match=name):
        sampler.options = before.replace(**change)
    assert sampler.options is before
    assert sampler.schedule(8, torch.float32, None) is schedule  # the cache is untouched


def test_new_options_clear_the_cached_schedules_and_executed_rows_are_checked():
    sampler = make_sampler()
    first = sampler.schedule(8, torch.float32, None)
    sampler.options = sampler.options.replace(noise_level=0.2)
    second = sampler.schedule(8, torch.float32, None)
    assert second is not first and bool((second.std < first.std)[1:].all())
    with pytest.raises(ValueError, match="executed_chunk_length"):
        sampler.executed_chunk_length = 5
    assert sampler.executed_chunk_length == 4
    sampler.executed_chunk_length = 2
    assert sampler.sample(sampler.context(observation(2)), 2).action.shape == (2, 2, 3)
    with pytest.raises(TypeError, match="SamplerOptions"):
        sampler.options = {"noise_level": 0.2}


def test_changing_a_noise_scale_leaves_the_global_random_stream_alone():
    # Evaluation switches eval_noise_scale back and forth between decisions: that must not
    # draw from the generator the rollouts use (a full check in "mixed" mode draws one mask).
    sampler = make_sampler()
    state = torch.get_rng_state()
    sampler.options = sampler.options.replace(eval_noise_scale=1.0, rollout_noise_scale=0.5)
    assert torch.equal(torch.get_rng_state(), state)


def test_policy_settings_read_and_set_through_the_sampler():
    policy = FlowSDEPolicy(make_sampler().velocity_network, action_shape=CHUNK_SHAPE)
    assert policy.options is policy.sampler.options and policy.num_denoising_steps == 8
    policy.options = policy.options.replace(num_denoising_steps=4)
    assert (
        policy.sampler.options.num_denoising_steps == 4
        and policy.spec["flow", "chain"].shape[0] == 5
    )
    policy.executed_chunk_length = 2
    assert policy.sampler.executed_chunk_length == 2
    with pytest.raises(ValueError, match="executed_chunk_length"):
        policy.executed_chunk_length = 0
    assert "sampler.velocity_network.mlp.0.weight" in policy.state_dict()
    with pytest.raises(ValueError, match="a ready FlowSampler"):
        FlowSDEPolicy(make_sampler(), action_shape=CHUNK_SHAPE, options=SamplerOptions())


#: Every setting, and the names two of them had before the settings were grouped.
SETTINGS = [field.name for field in dataclasses.fields(SamplerOptions)]
FORMER_NAMES = {"num_steps": "num_denoising_steps", "eval_num_steps": "eval_num_denoising_steps"}


@pytest.mark.parametrize("name", [*SETTINGS, *FORMER_NAMES])
def test_a_setting_set_as_an_attribute_is_refused_with_the_fix(name):
    field = FORMER_NAMES.get(name, name)
    sampler = make_sampler()
    policy = FlowSDEPolicy(make_sampler(), action_shape=CHUNK_SHAPE)
    for owner, module in (("sampler", sampler), ("policy", policy)):
        before = module.options
        fix = f"{owner}.options = {owner}.options.replace({field}=...)"
        with pytest.raises(AttributeError, match=re.escape(fix)) as refused:
            setattr(module, name, getattr(before, field))  # even a valid value
        message = str(refused.value)
        assert f"{owner}.{name} = ..." in message and "(a frozen SamplerOptions)" in message
        if name in FORMER_NAMES:
            assert f"{name!r} is the former name of the setting {field!r}" in message
        assert module.options is before and name not in vars(module)


def test_options_replaced_whole_are_still_set_and_checked():
    policy = FlowSDEPolicy(make_sampler(), action_shape=CHUNK_SHAPE)
    policy.options = dataclasses.replace(policy.options, eval_noise_scale=1.0)
    assert policy.sampler.options.eval_noise_scale == 1.0
    with pytest.raises(ValueError, match="noise_level"):
        policy.options = policy.options.replace(noise_level=-1.0)
    assert policy.options.noise_level == 0.5 and policy.options.eval_noise_scale == 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.options.noise_level = 0.1  # the options themselves are frozen


def test_attributes_that_are_not_settings_still_set():
    sampler = make_sampler()
    policy = FlowSDEPolicy(sampler, action_shape=CHUNK_SHAPE)
    policy.in_keys = ["state"]
    policy.note = "a user's own attribute"
    policy.extra = nn.Linear(2, 2)  # a submodule, registered as one
    policy.register_buffer("scale", torch.ones(1))
    policy.scale = torch.zeros(1)  # a buffer, replaced
    sampler.temperature = nn.Parameter(torch.ones(()))  # a parameter, registered as one
    policy.noise_head = NoiseHead(OBSERVATION_DIM, CHUNK_SHAPE)  # through the sampler
    assert policy.in_keys == ["state"] and policy.note == "a user's own attribute"
    assert "extra.weight" in policy.state_dict() and torch.equal(policy.scale, torch.zeros(1))
    assert "sampler.temperature" in dict(policy.named_parameters())
    assert (
        policy.sampler.noise_head is policy.noise_head and ("flow", "step_std") in policy.out_keys
    )


def test_a_checkpoint_of_the_networks_at_the_policy_root_loads():
    policy = FlowSDEPolicy(make_sampler().velocity_network, action_shape=CHUNK_SHAPE)
    old_layout = {
        key.removeprefix("sampler."): value.clone() + 1.0
        for key, value in policy.state_dict().items()
    }
    assert all(key.startswith("velocity_network.") for key in old_layout)
    fresh = FlowSDEPolicy(
        MLPVelocityNetwork(OBSERVATION_DIM, CHUNK_SHAPE, hidden_dim=32, num_layers=2),
        action_shape=CHUNK_SHAPE,
    )
    fresh.load_state_dict(old_layout)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, old_layout[key.removeprefix("sampler.")]), key


# --------------------------------------------------------------------------- action mask
@pytest.mark.parametrize("per_entry", [False, True])
def test_masked_log_prob_is_the_closed_form_over_the_real_dimensions(per_entry):
    generator = torch.Generator().manual_seed(0)
    x, mean = torch.randn(5, 4, 3, generator=generator), torch.randn(5, 4, 3, generator=generator)
    std = torch.rand(5, 4, 3, generator=generator) + 0.2 if per_entry else torch.rand(5) + 0.2
    expected_std = std if per_entry else std[:, None, None].expand(5, 4, 3)
    expected = Normal(mean[..., REAL], expected_std[..., REAL]).log_prob(x[..., REAL]).sum((-2, -1))
    torch.testing.assert_close(flow.gaussian_log_prob(x, mean, std, mask=REAL), expected)
    # The padded column may hold anything, NaN included: neither the value nor its gradient moves.
    mean = mean.clone().requires_grad_(True)
    padded = x.clone()
    padded[..., 2] = torch.tensor([float("nan"), 1e30, -3.0, 0.0, 7.0])[:, None]
    noisy_std = std.clone()
    if per_entry:
        noisy_std[..., 2] = 0.0  # a zero std at a padded entry: no log(0)
    value = flow.gaussian_log_prob(padded, mean, noisy_std, mask=REAL)
    torch.testing.assert_close(value, expected)
    value.sum().backward()
    assert torch.isfinite(mean.grad).all() and (mean.grad[..., 2] == 0).all()
    # Entropy and KL over the real dimensions too.
    normal = Normal(mean.detach()[..., REAL], expected_std[..., REAL])
    other = Normal(x[..., REAL], 2 * expected_std[..., REAL])
    torch.testing.assert_close(
        flow.gaussian_entropy(std, (5, 4, 3), mask=REAL), normal.entropy().sum((-2, -1))
    )
    kl = torch.distributions.kl_divergence(normal, other).sum((-2, -1))
    torch.testing.assert_close(flow.gaussian_kl(mean.detach(), std, x, 2 * std, mask=REAL), kl)


def test_masked_flow_matching_error_averages_the_real_dimensions():
    generator = torch.Generator().manual_seed(1)
    velocity, action, noise = (torch.randn(3, 4, 3, generator=generator) for _ in range(3))
    error = flow.flow_matching_error(velocity, action, noise, action_mask=REAL)
    expected = (velocity - (noise - action))[..., :2].pow(2).mean((-2, -1))
    torch.testing.assert_close(error, expected)
    velocity[..., 2] = 1e6
    torch.testing.assert_close(
        flow.flow_matching_error(velocity, action, noise, None, REAL), expected
    )


def test_a_masked_sampler_scores_the_real_dimensions_only():
    sampler = FlowSampler(
        Decay(), chunk_shape=CHUNK_SHAPE, action_mask=REAL, options=SamplerOptions(sde_mode="all")
    )
    context = torch.zeros(6, 1)
    rollout = sampler.sample(context, 6)
    # The closed form: each stochastic step's Gaussian, over the real dimensions.
    schedule = flow.sampling_schedule(8, 0.5)
    chain, expected = rollout.chain, torch.zeros(6, 8)
    for k in range(1, 8):
        mean = schedule.x_coefficient[k] * chain[:, k] + schedule.velocity_coefficient[k] * (
            chain[:, k] * 0.7
        )
        normal = Normal(mean[..., REAL], schedule.std[k])
        expected[:, k] = normal.log_prob(chain[:, k + 1][..., REAL]).sum((-2, -1))
    torch.testing.assert_close(rollout.step_log_prob, expected, rtol=1e-5, atol=1e-4)
    # The padded column's stored values do not change the rescored log-prob.
    changed = chain.clone()
    changed[..., 2] = torch.randn(changed[..., 2].shape) * 50
    for stored in (chain, changed):
        steps = sampler.rescore(context, stored, rollout.sde_mask)
        torch.testing.assert_close(sampler.log_prob(steps), rollout.step_log_prob[rollout.sde_mask])
    unmasked = FlowSampler(Decay(), chunk_shape=CHUNK_SHAPE, options=SamplerOptions(sde_mode="all"))
    steps = unmasked.rescore(context, chain, rollout.sde_mask)
    assert not torch.allclose(unmasked.log_prob(steps), sampler.log_prob(steps))


def test_a_masked_policy_trains_with_zero_drift():
    policy = FlowSDEPolicy(
        MLPVelocityNetwork(OBSERVATION_DIM, CHUNK_SHAPE, hidden_dim=16, num_layers=1),
        action_shape=CHUNK_SHAPE,
        action_mask=REAL,
        options=SamplerOptions(sde_mode="all"),
    )
    data = policy(TensorDict({"observation": observation(8)}, [8]))
    data["advantage"] = torch.randn(8, 1)
    out = DenoisingClipPPOLoss(policy, entropy_bonus=True)(data)
    assert out["log_prob_drift"] < 1e-5
    # The entropy covers the H' x 2 real entries of each step.
    std = flow.sampling_schedule(8, 0.5).std[1:]
    expected = (8 * (std.log() + 0.5 * torch.log(torch.tensor(2 * torch.pi * torch.e)))).mean()
    torch.testing.assert_close(out["entropy"], expected)
    with pytest.raises(ValueError, match=r"action_mask must be a boolean tensor of shape \(3,\)"):
        FlowSDEPolicy(policy.velocity_network, action_shape=CHUNK_SHAPE, action_mask=REAL[:2])


# --------------------------------------------------------------------------- network dtype
def test_a_bfloat16_network_behind_a_plain_callable_needs_and_gets_its_dtype():
    torch.manual_seed(0)
    network = MLPVelocityNetwork(OBSERVATION_DIM, CHUNK_SHAPE, hidden_dim=16, num_layers=1)
    network = network.to(torch.bfloat16)
    seen = []

    def backbone(x, sigma, context):  # no parameters to infer the dtype from
        seen.append((x.dtype, sigma.dtype))
        return network(x, sigma, context)

    sampler = FlowSampler(
        backbone,
        chunk_shape=CHUNK_SHAPE,
        network_dtype=torch.bfloat16,
        options=SamplerOptions(sde_mode="all"),
    )
    assert sampler.network_dtype == torch.bfloat16 and sampler.dtype == torch.float32
    context = sampler.context(observation(4))
    rollout = sampler.sample(context, 4)
    assert set(seen) == {(torch.bfloat16, torch.bfloat16)}
    assert rollout.chain.dtype == rollout.step_log_prob.dtype == torch.float32
    steps = sampler.rescore(context, rollout.chain, rollout.sde_mask)
    log_prob = sampler.log_prob(steps)
    assert log_prob.dtype == torch.float32 and steps.mean.dtype == torch.float32
    # The learner recomputes exactly what the rollout stored: zero drift.
    assert torch.equal(log_prob, rollout.step_log_prob[rollout.sde_mask])
    with pytest.raises(ValueError, match="network_dtype"):
        FlowSampler(backbone, chunk_shape=CHUNK_SHAPE, network_dtype=torch.int8)


def test_the_declared_network_dtype_overrides_the_parameters():
    sampler = make_sampler(network_dtype=torch.float64)
    assert sampler.network_dtype == torch.float64 and sampler.dtype == torch.float64
    assert make_sampler().network_dtype == torch.float32


# --------------------------------------------------------------------------- flow pieces
def test_integrate_returns_one_shape_of_result():
    schedule = flow.sampling_schedule(4, 0.5)
    x0, mask = torch.zeros(2, 3, 1), torch.tensor([[False, True, True, True]] * 2)

    def velocity(x, sigma):
        return torch.ones_like(x)

    ode = flow.integrate(velocity, x0, schedule)
    sde = flow.integrate(velocity, x0, schedule, mask, torch.zeros(2, 4, 3, 1))
    learned = flow.integrate(
        velocity, x0, schedule, mask, torch.zeros(2, 4, 3, 1), noise_std=lambda x, s: x + 1
    )
    for result in (ode, sde, learned):
        assert isinstance(result, flow.IntegratedChain) and result.chain.shape == (2, 5, 3, 1)
    assert ode.means is None and ode.step_std is None
    assert sde.means.shape == (2, 4, 3, 1) and sde.step_std is None
    assert learned.step_std.shape == (2, 4, 3, 1) and (learned.step_std[:, 0] == 0).all()


def test_ratio_diagnostics_are_those_of_the_stochastic_entries_only():
    bounds = (torch.tensor(0.8).log(), torch.tensor(1.2).log())
    # Two decisions, K = 3; the stochastic entries have ratios e^0.5, e^-0.1, 1.
    log_weight = torch.tensor([[0.0, 0.5, -0.1], [0.0, 0.0, 0.0]])[..., None]
    mask = torch.tensor([[False, True, True], [False, False, True]])
    surrogate = clipped_surrogate(log_weight, torch.ones(2, 1, 1), bounds)
    diagnostics = ratio_diagnostics(surrogate, mask, torch.tensor([1.0, 2.0, 3.0]))
    ratios = torch.tensor([0.5, -0.1, 0.0]).exp()
    torch.testing.assert_close(diagnostics["clip_fraction"], torch.tensor(1 / 3))
    torch.testing.assert_close(diagnostics["kl_approx"], torch.tensor(-0.4 / 3))
    torch.testing.assert_close(diagnostics["ESS"], ratios.sum() ** 2 / ratios.pow(2).sum() / 3)
    torch.testing.assert_close(diagnostics["mean_ratio"], ratios.mean())
    torch.testing.assert_close(diagnostics["max_ratio"], ratios.max())
    torch.testing.assert_close(diagnostics["entropy"], torch.tensor(2.0))
    torch.testing.assert_close(diagnostics["log_prob_drift"], torch.tensor(0.5))
    assert diagnostics["num_stochastic_steps"].item() == 3
    empty = ratio_diagnostics(surrogate, torch.zeros_like(mask), torch.zeros(0))
    assert empty["ESS"].item() == empty["max_ratio"].item() == 1.0
    assert empty["clip_fraction"].item() == empty["log_prob_drift"].item() == 0.0
