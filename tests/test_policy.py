"""Tests of ``FlowSDEPolicy``: sampling, the TensorDict contract, log-probs and clear errors."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from torch.distributions import Normal
from torchrl.envs.utils import ExplorationType, set_exploration_type

from torchrl_flowpolicy import flow
from torchrl_flowpolicy.networks import (
    ActionExpertTransformer,
    MLPVelocityNetwork,
    ObservationEncoder,
    TimeReversedVelocity,
)
from torchrl_flowpolicy.policy import FlowSDEPolicy
from torchrl_flowpolicy.sampler import SamplerOptions

# The policy's default output keys (FlowSDEPolicy.set_keys renames them).
CHAIN_KEY = ("flow", "chain")
SDE_MASK_KEY = ("flow", "sde_mask")
STEP_LOG_PROB_KEY = ("flow", "step_log_prob")
LOG_PROB_KEY = "action_log_prob"

OBSERVATION_DIM = 5
ACTION_SHAPE = (4, 2)
MODES = ("mixed", "last", "all")
RANDOM = ExplorationType.RANDOM
SAMPLER_FIELDS = {field.name for field in dataclasses.fields(SamplerOptions)}
SAMPLING_KEYS = {"action", CHAIN_KEY, SDE_MASK_KEY, STEP_LOG_PROB_KEY, LOG_PROB_KEY}


def make_network(**kwargs) -> MLPVelocityNetwork:
    torch.manual_seed(0)
    options = {"hidden_dim": 32, "num_layers": 2} | kwargs
    return MLPVelocityNetwork(OBSERVATION_DIM, ACTION_SHAPE, **options)


def make_tensordict(batch_shape=(6,), seed: int = 1) -> TensorDict:
    generator = torch.Generator().manual_seed(seed)
    observation = torch.randn(*batch_shape, OBSERVATION_DIM, generator=generator)
    return TensorDict({"observation": observation}, batch_size=batch_shape)


def sample(policy, tensordict, seed: int = 0, mode=RANDOM) -> TensorDict:
    torch.manual_seed(seed)
    with set_exploration_type(mode):
        return policy(tensordict.clone())


def euler_chain(network, observation, initial_noise, sigmas) -> list[torch.Tensor]:
    """The bare Euler loop ``x = x + v * (sigma_{k+1} - sigma_k)``."""
    x, chain = initial_noise, [initial_noise]
    for k in range(len(sigmas) - 1):
        velocity = network(x, sigmas[k].expand(x.shape[0]), observation)
        x = x + velocity * (sigmas[k + 1] - sigmas[k])
        chain.append(x)
    return chain


def sde_step_log_probs(policy, tensordict, executed=None) -> torch.Tensor:
    """Per-step log-probs recomputed independently with ``flow.sde_step`` and ``Normal``."""
    chain = tensordict[CHAIN_KEY].reshape(-1, policy.num_denoising_steps + 1, *policy.action_shape)
    mask = tensordict[SDE_MASK_KEY].reshape(-1, policy.num_denoising_steps)
    observation = tensordict["observation"].reshape(-1, OBSERVATION_DIM)
    sigmas = flow.sigma_grid(policy.num_denoising_steps, policy.options.shift, dtype=chain.dtype)
    rows = slice(None, executed)
    columns = []
    with torch.no_grad():
        for k in range(policy.num_denoising_steps):
            x = chain[:, k]
            velocity = policy.velocity_network(x, sigmas[k].expand(x.shape[0]), observation)
            mean, std = flow.sde_step(
                x,
                velocity,
                sigmas[k],
                sigmas[k + 1],
                policy.options.noise_level,
                policy.options.noise_schedule,
            )
            if std > 0:
                normal = Normal(mean[:, rows], std)
                log_prob = normal.log_prob(chain[:, k + 1, rows]).sum((-2, -1))
            else:
                log_prob = torch.zeros(x.shape[0], dtype=x.dtype)
            columns.append(torch.where(mask[:, k], log_prob, torch.zeros_like(log_prob)))
    return torch.stack(columns, -1).reshape(tensordict[SDE_MASK_KEY].shape)


# --------------------------------------------------------------------------- ODE limit
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_zero_noise_sampler_is_exactly_the_euler_ode(mode, shift):
    network = make_network()
    num_denoising_steps, batch = 8, 6
    policy = FlowSDEPolicy(
        network,
        action_shape=ACTION_SHAPE,
        options=SamplerOptions(
            noise_level=0.0,
            sde_mode=mode,
            num_sde_steps=3,
            num_denoising_steps=num_denoising_steps,
            shift=shift,
        ),
    )
    tensordict = make_tensordict((batch,))
    with torch.no_grad():
        out = sample(policy, tensordict, seed=3)
        torch.manual_seed(3)
        initial_noise = torch.randn(batch, num_denoising_steps + 1, *ACTION_SHAPE)[:, 0]
        expected = euler_chain(
            network,
            tensordict["observation"],
            initial_noise,
            flow.sigma_grid(num_denoising_steps, shift),
        )
    for k, x in enumerate(expected):
        assert torch.equal(out[CHAIN_KEY][:, k], x), f"chain differs at x_{k}"
    assert torch.equal(out["action"], expected[-1])


def test_deterministic_mode_is_exactly_the_euler_ode():
    network = make_network()
    policy = FlowSDEPolicy(
        network,
        action_shape=ACTION_SHAPE,
        options=SamplerOptions(eval_num_denoising_steps=20, shift=2.0, eval_noise_scale=1.0),
    )
    tensordict = make_tensordict((5,))
    with torch.no_grad():
        out = sample(policy, tensordict, seed=4, mode=ExplorationType.DETERMINISTIC)
        torch.manual_seed(4)
        initial_noise = torch.randn(5, *ACTION_SHAPE)
        expected = euler_chain(
            network, tensordict["observation"], initial_noise, flow.sigma_grid(20, 2.0)
        )
        decoded = policy.decode(tensordict, initial_noise)
    assert torch.equal(out["action"], expected[-1])
    assert torch.equal(decoded, expected[-1])


@pytest.mark.parametrize("scale", [0.0, 0.3, 2.0])
def test_eval_noise_scale_scales_the_initial_noise_of_the_ode_only(scale):
    network = make_network()
    policy = FlowSDEPolicy(
        network,
        action_shape=ACTION_SHAPE,
        options=SamplerOptions(eval_num_denoising_steps=6, eval_noise_scale=scale),
    )
    reference = FlowSDEPolicy(
        network, action_shape=ACTION_SHAPE, options=SamplerOptions(eval_num_denoising_steps=6)
    )
    tensordict = make_tensordict((5,))
    with torch.no_grad():
        out = sample(policy, tensordict, seed=4, mode=ExplorationType.DETERMINISTIC)
        torch.manual_seed(4)
        initial_noise = torch.randn(5, *ACTION_SHAPE)
        expected = policy.decode(tensordict, scale * initial_noise)
    assert torch.equal(out["action"], expected)
    if scale == 0.0:
        assert torch.equal(out["action"], policy.decode(tensordict, torch.zeros(5, *ACTION_SHAPE)))
    # Rollouts still start from N(0, I): the same seed gives the reference's chain.
    rollout = sample(policy, tensordict, seed=2)
    assert torch.equal(rollout[CHAIN_KEY], sample(reference, tensordict, seed=2)[CHAIN_KEY])


@pytest.mark.parametrize("scale", [0.0, 0.5])
def test_rollout_noise_scale_scales_x0_and_the_log_prob_stays_exact(scale):
    network = make_network()
    policy = FlowSDEPolicy(
        network,
        action_shape=ACTION_SHAPE,
        options=SamplerOptions(sde_mode="last", num_sde_steps=2, rollout_noise_scale=scale),
    )
    reference = FlowSDEPolicy(
        network, action_shape=ACTION_SHAPE, options=SamplerOptions(sde_mode="last", num_sde_steps=2)
    )
    tensordict = make_tensordict((5,))
    out = sample(policy, tensordict, seed=3)
    full = sample(reference, tensordict, seed=3)
    # Same draws: x_0 is scaled, the later step noise is not.
    torch.testing.assert_close(out[CHAIN_KEY][:, 0], scale * full[CHAIN_KEY][:, 0])
    assert not torch.equal(out[CHAIN_KEY][:, -1], full[CHAIN_KEY][:, -1])
    if scale == 0.0:
        assert torch.count_nonzero(out[CHAIN_KEY][:, 0]) == 0
    # Rescoring the stored chain gives the stored log-probs, and these are the Gaussian
    # densities of the stochastic steps (x_0's density does not enter).
    torch.testing.assert_close(policy.log_prob(out), out[STEP_LOG_PROB_KEY], rtol=0, atol=1e-5)
    torch.testing.assert_close(reference.log_prob(out), out[STEP_LOG_PROB_KEY], rtol=0, atol=1e-5)
    assert torch.all(out[LOG_PROB_KEY] != 0)
    # Evaluation is untouched: the deterministic ODE still starts from eval_noise_scale * x_0.
    deterministic = ExplorationType.DETERMINISTIC
    torch.testing.assert_close(
        sample(policy, tensordict, seed=4, mode=deterministic)["action"],
        sample(reference, tensordict, seed=4, mode=deterministic)["action"],
    )


# --------------------------------------------------------------------------- log-probs
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("schedule", ["sqrt", "constant"])
def test_step_log_prob_matches_sde_step_recomputation(mode, schedule):
    policy = FlowSDEPolicy(
        make_network(),
        action_shape=ACTION_SHAPE,
        options=SamplerOptions(sde_mode=mode, noise_schedule=schedule, shift=2.0),
    )
    out = sample(policy, make_tensordict((16,)))
    expected = sde_step_log_probs(policy, out)
    # The stored values and the learner's recomputation both match the reference.
    torch.testing.assert_close(out[STEP_LOG_PROB_KEY], expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(policy.log_prob(out), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out[LOG_PROB_KEY], expected.sum(-1), rtol=1e-5, atol=1e-4)
    assert (expected[~out[SDE_MASK_KEY]] == 0).all()
    assert (expected[out[SDE_MASK_KEY]] != 0).all()


def test_log_prob_gradient_flows_through_the_mean_only():
    policy = FlowSDEPolicy(
        make_network(), action_shape=ACTION_SHAPE, options=SamplerOptions(sde_mode="all")
    )
    with torch.no_grad():
        out = sample(policy, make_tensordict((8,)))
    parameters = list(policy.velocity_network.parameters())

    policy.log_prob(out).sum().backward()
    gradients = [p.grad.clone() for p in parameters]
    policy.zero_grad()

    steps = policy.stochastic_steps(out)
    assert steps.mean.requires_grad
    assert not steps.std.requires_grad
    std = steps.std.detach()[:, None, None].expand_as(steps.mean)
    Normal(steps.mean, std).log_prob(steps.sample).sum().backward()
    for gradient, parameter in zip(gradients, parameters, strict=True):
        torch.testing.assert_close(gradient, parameter.grad)
    assert any(g.abs().sum() > 0 for g in gradients)


class _LogProbOf(nn.Module):
    """``policy.log_prob(tensordict)`` as a module, for ``torch.func.functional_call``."""

    def __init__(self, policy: FlowSDEPolicy, tensordict: TensorDict):
        super().__init__()
        self.policy = policy
        self.tensordict = tensordict

    def forward(self) -> torch.Tensor:
        return self.policy.log_prob(self.tensordict)


def test_log_prob_gradcheck_wrt_network_parameters():
    torch.manual_seed(0)
    network = MLPVelocityNetwork(
        3, (2, 2), hidden_dim=4, num_layers=1, sigma_embedding_dim=4
    ).double()
    policy = FlowSDEPolicy(
        network, action_shape=(2, 2), options=SamplerOptions(num_denoising_steps=4, sde_mode="all")
    )
    observation = torch.randn(3, 3, dtype=torch.float64)
    with torch.no_grad():
        out = sample(policy, TensorDict({"observation": observation}, batch_size=[3]))
    assert out[CHAIN_KEY].dtype == torch.float64
    module = _LogProbOf(policy, out)
    names = [f"policy.velocity_network.{name}" for name, _ in network.named_parameters()]
    values = tuple(p.detach().clone().requires_grad_(True) for p in network.parameters())

    def log_prob(*parameters):
        return torch.func.functional_call(module, dict(zip(names, parameters, strict=True)), ())

    assert torch.autograd.gradcheck(log_prob, values)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_denoising_steps", [2, 8, 16])
def test_log_prob_makes_exactly_one_network_call(counting, mode, num_denoising_steps):
    network = counting(make_network())
    policy = FlowSDEPolicy(
        network,
        action_shape=ACTION_SHAPE,
        options=SamplerOptions(
            num_denoising_steps=num_denoising_steps, sde_mode=mode, num_sde_steps=1
        ),
    )
    out = sample(policy, make_tensordict((5,)))
    assert network.calls == num_denoising_steps
    network.calls, network.rows = 0, []
    log_prob = policy.log_prob(out)
    assert network.calls == 1
    assert network.rows == [int(out[SDE_MASK_KEY].sum())]  # one row per stochastic entry
    log_prob.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in network.parameters())


def _transformer_policy(options: SamplerOptions | None = None):
    torch.manual_seed(0)
    encoder = ObservationEncoder(OBSERVATION_DIM, model_dim=16, num_tokens=3, hidden_dim=32)
    expert = ActionExpertTransformer(ACTION_SHAPE, model_dim=16, num_heads=2, num_layers=1)
    return FlowSDEPolicy(expert, action_shape=ACTION_SHAPE, encoder=encoder, options=options)


@pytest.mark.parametrize("context_grad", [False, True])
def test_encoder_gradient_follows_context_grad(context_grad):
    policy = _transformer_policy(options=SamplerOptions(sde_mode="all"))
    with torch.no_grad():
        out = sample(policy, make_tensordict((4,)))
    policy.log_prob(out, context_grad=context_grad).sum().backward()
    expert_gradients = [p.grad for p in policy.velocity_network.parameters()]
    assert all(g is not None for g in expert_gradients)
    assert sum(g.abs().sum() for g in expert_gradients) > 0
    encoder_gradients = [p.grad for p in policy.encoder.parameters()]
    if context_grad:
        assert all(g is not None for g in encoder_gradients)
        assert sum(g.abs().sum() for g in encoder_gradients) > 0
    else:
        assert all(g is None for g in encoder_gradients)


# --------------------------------------------------------------------------- sampling contract
@pytest.mark.parametrize("mode", MODES)
def test_step_zero_is_never_stochastic_in_the_policy(mode):
    policy = FlowSDEPolicy(
        make_network(),
        action_shape=ACTION_SHAPE,
        options=SamplerOptions(sde_mode=mode, num_denoising_steps=4, num_sde_steps=3),
    )
    with torch.no_grad():
        out = sample(policy, make_tensordict((2000,)))
    assert not out[SDE_MASK_KEY][:, 0].any()
    assert (out[STEP_LOG_PROB_KEY][:, 0] == 0).all()
    assert out[SDE_MASK_KEY][:, 1:].any(0).all()  # every other step is used somewhere


def test_same_seed_same_chain_other_seed_other_chain():
    policy = FlowSDEPolicy(make_network(), action_shape=ACTION_SHAPE)
    tensordict = make_tensordict((32,))
    with torch.no_grad():
        first, again, other = (sample(policy, tensordict, seed) for seed in (5, 5, 6))
    for key in SAMPLING_KEYS:
        assert torch.equal(first[key], again[key]), key
    assert not torch.equal(first[CHAIN_KEY], other[CHAIN_KEY])
    assert not torch.equal(first[SDE_MASK_KEY], other[SDE_MASK_KEY])
    assert not torch.equal(first["action"], other["action"])


@pytest.mark.parametrize(
    "mode", [ExplorationType.DETERMINISTIC, ExplorationType.MODE, ExplorationType.MEAN]
)
def test_exploration_type_switches_between_sde_and_ode(counting, mode):
    network = counting(make_network())
    policy = FlowSDEPolicy(network, action_shape=ACTION_SHAPE)
    assert (policy.num_denoising_steps, policy.options.eval_num_denoising_steps) == (8, 20)
    tensordict = make_tensordict((3,))
    with torch.no_grad():
        random = sample(policy, tensordict, mode=RANDOM)
        assert network.calls == 8
        assert set(random.keys(True, True)) == SAMPLING_KEYS | {"observation"}
        assert random[CHAIN_KEY].shape == (3, 9, *ACTION_SHAPE)
        network.calls = 0
        deterministic = sample(policy, tensordict, mode=mode)
        assert network.calls == 20
        assert set(deterministic.keys(True, True)) == {"observation", "action"}
        network.calls = 0
        policy(tensordict.clone())  # outside any context: default_interaction_type (RANDOM)
        assert network.calls == 8


def test_default_interaction_type():
    # RANDOM by default, as TorchRL's PPO actors: outside a context it samples the chain.
    with torch.no_grad():
        out = FlowSDEPolicy(make_network(), action_shape=ACTION_SHAPE)(make_tensordict((2,)))
    assert set(out.keys(True, True)) == SAMPLING_KEYS | {"observation"}
    policy = FlowSDEPolicy(
        make_network(),
        action_shape=ACTION_SHAPE,
        default_interaction_type=ExplorationType.DETERMINISTIC,
    )
    with torch.no_grad():
        out = policy(make_tensordict((2,)))
    assert set(out.keys(True, True)) == {"observation", "action"}


@pytest.mark.parametrize("batch_shape", [(), (3,), (2, 3)])
@pytest.mark.parametrize("mode", MODES)
def test_batch_shapes(batch_shape, mode):
    num_denoising_steps, (chunk, dim) = 8, ACTION_SHAPE
    policy = FlowSDEPolicy(
        make_network(),
        action_shape=ACTION_SHAPE,
        options=SamplerOptions(sde_mode=mode, num_denoising_steps=num_denoising_steps),
    )
    with torch.no_grad():
        out = sample(policy, make_tensordict(batch_shape))
        recomputed = policy.log_prob(out)
    assert out.batch_size == batch_shape
    assert out["action"].shape == (*batch_shape, chunk, dim)
    assert out[CHAIN_KEY].shape == (*batch_shape, num_denoising_steps + 1, chunk, dim)
    assert out[SDE_MASK_KEY].shape == (*batch_shape, num_denoising_steps)
    assert out[SDE_MASK_KEY].dtype == torch.bool
    assert out[STEP_LOG_PROB_KEY].shape == (*batch_shape, num_denoising_steps)
    assert out[LOG_PROB_KEY].shape == batch_shape
    assert torch.equal(out["action"], out[CHAIN_KEY][..., -1, :, :])
    assert recomputed.shape == (*batch_shape, num_denoising_steps)
    torch.testing.assert_close(recomputed, out[STEP_LOG_PROB_KEY], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[LOG_PROB_KEY], out[STEP_LOG_PROB_KEY].sum(-1))
    with set_exploration_type(ExplorationType.DETERMINISTIC), torch.no_grad():
        deterministic = policy(make_tensordict(batch_shape))
    assert deterministic["action"].shape == (*batch_shape, chunk, dim)


def test_float64_network_samples_in_float64():
    network = make_network().double()
    policy = FlowSDEPolicy(
        network, action_shape=ACTION_SHAPE, options=SamplerOptions(sde_mode="all")
    )
    with torch.no_grad():
        out = sample(policy, make_tensordict((4,)))
        recomputed = policy.log_prob(out)
    for key in ("action", CHAIN_KEY, STEP_LOG_PROB_KEY, LOG_PROB_KEY):
        assert out[key].dtype == torch.float64, key
    assert recomputed.dtype == torch.float64
    torch.testing.assert_close(recomputed, out[STEP_LOG_PROB_KEY], rtol=1e-10, atol=1e-10)
    with set_exploration_type(ExplorationType.DETERMINISTIC), torch.no_grad():
        assert policy(make_tensordict((4,)))["action"].dtype == torch.float64


def test_bfloat16_network_keeps_the_chain_in_float32(counting):
    network = counting(make_network().to(torch.bfloat16))
    policy = FlowSDEPolicy(
        network, action_shape=ACTION_SHAPE, options=SamplerOptions(sde_mode="all")
    )
    seen_dtypes = []
    network.register_forward_pre_hook(lambda module, args: seen_dtypes.append(args[0].dtype))
    with torch.no_grad():
        out = sample(policy, make_tensordict((4,)))
        recomputed = policy.log_prob(out)
    assert set(seen_dtypes) == {torch.bfloat16}  # the network itself runs in bfloat16
    for key in ("action", CHAIN_KEY, STEP_LOG_PROB_KEY, LOG_PROB_KEY):
        assert out[key].dtype == torch.float32, key
    assert recomputed.dtype == torch.float32
    assert torch.isfinite(out[CHAIN_KEY]).all() and torch.isfinite(recomputed).all()
    # The stored x_{k+1} is mean + std * xi with the policy's float32 draw xi; recomputing
    # the mean with bfloat16 velocities recovers xi up to the bfloat16 rounding of v.
    torch.manual_seed(0)
    step_noise = torch.randn(4, policy.num_denoising_steps + 1, *ACTION_SHAPE)[:, 1:]
    steps = policy.stochastic_steps(out)
    recovered = (steps.sample - steps.mean.detach()) / steps.std[:, None, None]
    torch.testing.assert_close(recovered, step_noise[out[SDE_MASK_KEY]], rtol=0, atol=0.05)


def test_executed_chunk_length_restricts_action_and_log_prob():
    executed = 2
    policy = FlowSDEPolicy(
        make_network(),
        action_shape=ACTION_SHAPE,
        executed_chunk_length=executed,
        options=SamplerOptions(sde_mode="all"),
    )
    full = FlowSDEPolicy(
        policy.velocity_network, action_shape=ACTION_SHAPE, options=SamplerOptions(sde_mode="all")
    )
    with torch.no_grad():
        out = sample(policy, make_tensordict((5,)))
        recomputed = policy.log_prob(out)
        full_rows = full.log_prob(out)
    assert out["action"].shape == (5, executed, ACTION_SHAPE[1])
    assert out[CHAIN_KEY].shape == (5, 9, *ACTION_SHAPE)
    assert torch.equal(out["action"], out[CHAIN_KEY][:, -1, :executed])
    expected = sde_step_log_probs(policy, out, executed=executed)
    torch.testing.assert_close(out[STEP_LOG_PROB_KEY], expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(recomputed, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(full_rows, sde_step_log_probs(full, out), rtol=1e-5, atol=1e-4)
    assert not torch.allclose(full_rows, recomputed)
    with set_exploration_type(ExplorationType.DETERMINISTIC), torch.no_grad():
        assert policy(make_tensordict((5,)))["action"].shape == (5, executed, ACTION_SHAPE[1])


# --------------------------------------------------------------------------- adapter
class _TimeForwardGaussianVelocity(nn.Module):
    """Gaussian actions in the t = 0 noise convention: ``x_t = t A + (1 - t) eps``.

    ``E[A - eps | x_t] = m + (t s^2 - (1 - t)) / V (x - t m)``, ``V = t^2 s^2 + (1 - t)^2``.
    """

    def __init__(self, mean: torch.Tensor, std: torch.Tensor):
        super().__init__()
        self.mean, self.std = mean, std

    def forward(self, x, t, context):
        t = t.reshape(-1, 1, 1)
        variance = t**2 * self.std**2 + (1 - t) ** 2
        return self.mean + (t * self.std**2 - (1 - t)) / variance * (x - t * self.mean)


def test_time_reversed_adapter_matches_native_network(gaussian_velocity):
    forward_time = _TimeForwardGaussianVelocity(gaussian_velocity.mean, gaussian_velocity.std)
    tensordict = TensorDict({"observation": torch.zeros(64, 1)}, batch_size=[64])
    options = {"action_shape": (2, 2), "options": SamplerOptions(shift=2.0, eval_noise_scale=1.0)}
    native = FlowSDEPolicy(gaussian_velocity, **options)
    adapted = FlowSDEPolicy(TimeReversedVelocity(forward_time), **options)
    deterministic = ExplorationType.DETERMINISTIC
    with torch.no_grad():
        expected = sample(native, tensordict, seed=7, mode=deterministic)["action"]
        actual = sample(adapted, tensordict, seed=7, mode=deterministic)["action"]
        torch.testing.assert_close(actual, expected)
        # The adapter is not the identity: the raw network gives another chunk.
        raw = FlowSDEPolicy(forward_time, **options)
        assert not torch.allclose(
            sample(raw, tensordict, seed=7, mode=deterministic)["action"], expected, atol=0.1
        )


# --------------------------------------------------------------------------- marginals
def _gaussian_policy(gaussian_velocity, options: SamplerOptions):
    return FlowSDEPolicy(gaussian_velocity, action_shape=(2, 2), options=options)


_SAMPLES = 10000
_DUMMY = TensorDict({"observation": torch.zeros(_SAMPLES, 1)}, batch_size=[_SAMPLES])


@pytest.mark.parametrize("mode", ["all", "mixed"])
@pytest.mark.parametrize("noise_level", [0.2, 0.5, 0.8])
def test_sde_sampler_preserves_gaussian_marginals(
    gaussian_velocity, check_gaussian_moments, mode, noise_level
):
    policy = _gaussian_policy(
        gaussian_velocity,
        options=SamplerOptions(num_denoising_steps=100, noise_level=noise_level, sde_mode=mode),
    )
    with torch.no_grad():
        action = sample(policy, _DUMMY, seed=11)["action"]
    check_gaussian_moments(action, gaussian_velocity.mean, gaussian_velocity.std, 100)


def test_ode_sampler_preserves_gaussian_marginals(gaussian_velocity, check_gaussian_moments):
    policy = _gaussian_policy(
        gaussian_velocity,
        options=SamplerOptions(eval_num_denoising_steps=100, eval_noise_scale=1.0),
    )
    with torch.no_grad():
        action = sample(policy, _DUMMY, seed=12, mode=ExplorationType.DETERMINISTIC)["action"]
    check_gaussian_moments(action, gaussian_velocity.mean, gaussian_velocity.std, 100)


@pytest.mark.parametrize("noise_level", [0.2, 0.5, 0.8])
def test_marginal_check_rejects_a_drift_without_score_correction(
    gaussian_velocity, check_gaussian_moments, monkeypatch, noise_level
):
    true_coefficients = flow.step_coefficients

    def without_score_correction(sigmas, noise_level, schedule="sqrt"):
        _, _, std = true_coefficients(sigmas, noise_level, schedule)
        return torch.ones_like(std), sigmas[1:] - sigmas[:-1], std

    monkeypatch.setattr(flow.sampling, "step_coefficients", without_score_correction)
    policy = _gaussian_policy(
        gaussian_velocity,
        options=SamplerOptions(num_denoising_steps=100, noise_level=noise_level, sde_mode="all"),
    )
    with torch.no_grad():
        action = sample(policy, _DUMMY, seed=11)["action"]
    with pytest.raises(AssertionError):
        check_gaussian_moments(action, gaussian_velocity.mean, gaussian_velocity.std, 100)


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"noise_level": -0.1}, "noise_level"),
        ({"sde_mode": "mixed", "num_denoising_steps": 1}, "num_denoising_steps"),
        ({"shift": 0.0}, "shift"),
        ({"shift": -2.0}, "shift"),
        ({"executed_chunk_length": 0}, "executed_chunk_length"),
        ({"executed_chunk_length": 5}, "executed_chunk_length"),
        ({"sde_mode": "first"}, "sde_mode"),
        ({"noise_schedule": "cosine"}, "noise_schedule"),
        ({"sde_mode": "last", "num_sde_steps": 8}, "num_sde_steps"),
        ({"eval_num_denoising_steps": 0}, "eval_num_denoising_steps"),
        ({"eval_noise_scale": -0.5}, "eval_noise_scale"),
        ({"eval_noise_scale": float("nan")}, "eval_noise_scale"),
        ({"rollout_noise_scale": -1.0}, "rollout_noise_scale"),
        ({"rollout_noise_scale": float("inf")}, "rollout_noise_scale"),
        ({"action_shape": (4, 2, 1)}, "action_shape"),
    ],
)
def test_constructor_errors(kwargs, match):
    # The sampler settings go through SamplerOptions, the others are the policy's arguments.
    settings = {name: value for name, value in kwargs.items() if name in SAMPLER_FIELDS}
    arguments = {"action_shape": ACTION_SHAPE} | {
        name: value for name, value in kwargs.items() if name not in SAMPLER_FIELDS
    }
    with pytest.raises(ValueError, match=match):
        FlowSDEPolicy(make_network(), options=SamplerOptions(**settings), **arguments)


@pytest.mark.parametrize("mode", [RANDOM, ExplorationType.DETERMINISTIC])
def test_wrong_observation_shape_names_the_feature_count(mode):
    policy = FlowSDEPolicy(make_network(), action_shape=ACTION_SHAPE)
    wrong = TensorDict({"observation": torch.randn(3, OBSERVATION_DIM + 1)}, batch_size=[3])
    with pytest.raises(ValueError, match=f"observation_dim={OBSERVATION_DIM}"):
        sample(policy, wrong, mode=mode)


def test_missing_observation_key():
    policy = FlowSDEPolicy(make_network(), action_shape=ACTION_SHAPE, in_keys=["state"])
    with pytest.raises(KeyError, match="state"):
        sample(policy, make_tensordict((3,)))


@pytest.mark.parametrize("key", [CHAIN_KEY, SDE_MASK_KEY])
def test_log_prob_missing_keys(key):
    policy = FlowSDEPolicy(make_network(), action_shape=ACTION_SHAPE)
    out = sample(policy, make_tensordict((3,)))
    del out[key]
    with pytest.raises(KeyError, match=re.escape(repr(key))):
        policy.log_prob(out)


def test_log_prob_wrong_chain_and_mask_shapes():
    policy = FlowSDEPolicy(make_network(), action_shape=ACTION_SHAPE)
    out = sample(policy, make_tensordict((3,)))
    wrong_chain = out.clone().set(CHAIN_KEY, out[CHAIN_KEY][..., :3, :])
    with pytest.raises(ValueError, match=re.escape(repr(CHAIN_KEY))):
        policy.log_prob(wrong_chain)
    wrong_mask = out.clone().set(SDE_MASK_KEY, out[SDE_MASK_KEY][..., :5])
    with pytest.raises(ValueError, match=re.escape(repr(SDE_MASK_KEY))):
        policy.log_prob(wrong_mask)


def test_log_prob_chain_with_other_num_denoising_steps():
    short = FlowSDEPolicy(
        make_network(), action_shape=ACTION_SHAPE, options=SamplerOptions(num_denoising_steps=4)
    )
    out = sample(short, make_tensordict((3,)))
    policy = FlowSDEPolicy(
        short.velocity_network,
        action_shape=ACTION_SHAPE,
        options=SamplerOptions(num_denoising_steps=8),
    )
    with pytest.raises(ValueError, match=r"num_denoising_steps=8.*K=4"):
        policy.log_prob(out)


class _NonFiniteAt(nn.Module):
    """Returns NaN velocities at one noise level, the wrapped network's output elsewhere."""

    def __init__(self, network, sigma: float):
        super().__init__()
        self.network, self.sigma = network, sigma

    def forward(self, x, sigma, context):
        velocity = self.network(x, sigma, context)
        bad = (sigma - self.sigma).abs() < 1e-6
        return torch.where(bad[:, None, None], torch.full_like(velocity, float("nan")), velocity)


@pytest.mark.parametrize("mode", [RANDOM, ExplorationType.DETERMINISTIC])
def test_non_finite_velocity_names_the_denoising_step(mode):
    num_denoising_steps = 8 if mode == RANDOM else 20
    bad_sigma = float(flow.sigma_grid(num_denoising_steps)[3])
    policy = FlowSDEPolicy(_NonFiniteAt(make_network(), bad_sigma), action_shape=ACTION_SHAPE)
    with torch.no_grad(), pytest.raises(ValueError, match="denoising step 3"):
        sample(policy, make_tensordict((3,)), mode=mode)


def test_non_finite_velocity_in_log_prob():
    network = make_network()
    out = sample(
        FlowSDEPolicy(network, action_shape=ACTION_SHAPE, options=SamplerOptions(sde_mode="all")),
        make_tensordict((3,)),
    )
    bad_sigma = float(flow.sigma_grid(8)[5])
    policy = FlowSDEPolicy(_NonFiniteAt(network, bad_sigma), action_shape=ACTION_SHAPE)
    with pytest.raises(ValueError, match="non-finite.*log_prob"):
        policy.log_prob(out)


def test_velocity_of_the_wrong_shape():
    policy = FlowSDEPolicy(lambda x, sigma, context: x[:, :2], action_shape=ACTION_SHAPE)
    with pytest.raises(ValueError, match="velocity_network returned shape"):
        sample(policy, make_tensordict((3,)))


def test_set_keys_renames_every_output_and_the_spec():
    policy = FlowSDEPolicy(make_network(), action_shape=ACTION_SHAPE)
    renamed = {
        "action": ("rollout", "chunk"),
        "chain": ("rollout", "chain"),
        "sde_mask": ("rollout", "mask"),
        "step_log_prob": ("rollout", "step_log_prob"),
        "log_prob": "chunk_log_prob",
    }
    policy.set_keys(**renamed)
    assert set(policy.out_keys) == set(renamed.values())
    assert set(policy.spec.keys(True, True)) == set(renamed.values())
    td = TensorDict({"observation": torch.randn(3, OBSERVATION_DIM)}, batch_size=[3])
    with set_exploration_type(RANDOM):
        out = policy(td)
    for default in SAMPLING_KEYS:
        assert default not in out.keys(True)
    torch.testing.assert_close(policy.log_prob(out), out["rollout", "step_log_prob"])
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        assert ("rollout", "chunk") in policy(td.clone()).keys(True)
    policy.set_keys(chain=None)  # None restores the default
    assert policy.tensor_keys.chain == CHAIN_KEY
    with pytest.raises(ValueError, match="'trajectory' is not a key"):
        policy.set_keys(trajectory="x")


# --------------------------------------------------------------------------- TorchRL scripts
def _record_input_shapes(network: nn.Module) -> list[torch.Size]:
    shapes: list[torch.Size] = []
    network.register_forward_pre_hook(lambda module, args: shapes.append(args[0].shape))
    return shapes


def test_single_step_policy_steps_an_unwrapped_gym_env():
    # action_shape=(D,): "action" is [*B, D], what an unwrapped GymEnv steps; the chain is
    # [*B, K+1, D] and the velocity network sees x [N, 1, D] (H = 1).
    from torchrl.envs import GymEnv

    env = GymEnv("HalfCheetah-v5")
    action_dim = env.action_spec.shape[-1]
    observation_dim = env.observation_spec["observation"].shape[-1]
    torch.manual_seed(0)
    network = MLPVelocityNetwork(observation_dim, (1, action_dim), hidden_dim=32, num_layers=2)
    shapes = _record_input_shapes(network)
    policy = FlowSDEPolicy(
        network,
        action_shape=(action_dim,),
        options=SamplerOptions(num_denoising_steps=4, sde_mode="all"),
    )
    assert policy.action_shape == (action_dim,)
    assert policy.chunk_shape == (1, action_dim)
    env.set_seed(0)
    torch.manual_seed(1)
    with set_exploration_type(RANDOM):
        rollout = env.rollout(6, policy)
    assert rollout.batch_size == (6,)
    assert {shape[1:] for shape in shapes} == {(1, action_dim)}
    assert rollout["action"].shape == (6, action_dim)
    assert rollout[CHAIN_KEY].shape == (6, 5, action_dim)
    assert torch.equal(rollout["action"], rollout[CHAIN_KEY][:, -1])
    assert (rollout[STEP_LOG_PROB_KEY][:, 1:] != 0).all()
    # Rescoring the stored chain gives the stored log-probs.
    torch.testing.assert_close(
        policy.log_prob(rollout), rollout[STEP_LOG_PROB_KEY], rtol=0, atol=1e-5
    )
    torch.testing.assert_close(rollout[LOG_PROB_KEY], rollout[STEP_LOG_PROB_KEY].sum(-1))
    for key, leaf in policy.spec.expand(6).items(True, True):
        assert rollout[key].shape == leaf.shape, key
        assert rollout[key].dtype == leaf.dtype, key
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        evaluation = env.rollout(3, policy)
    env.close()
    assert evaluation["action"].shape == (3, action_dim)
    observation = TensorDict({"observation": torch.randn(2, observation_dim)}, [2])
    assert policy.decode(observation, torch.zeros(2, action_dim)).shape == (2, action_dim)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"action_shape": ()}, "action_shape"),
        ({"action_shape": (2,), "executed_chunk_length": 2}, "executed_chunk_length"),
    ],
)
def test_single_step_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FlowSDEPolicy(make_network(), **kwargs)


def test_collector_with_a_compiled_policy_keeps_the_chain():
    # Collector(compile_policy=...) wraps the policy in a function that hides its spec and
    # probes it outside any exploration context: the probe must write the chain.
    from torchrl.collectors import Collector
    from torchrl.envs import DoubleToFloat, GymEnv, TransformedEnv

    from torchrl_flowpolicy.envs import make_chunked_env

    torch.manual_seed(0)
    network = MLPVelocityNetwork(23, (3, 7), hidden_dim=32, num_layers=2)
    policy = FlowSDEPolicy(
        network,
        action_shape=(3, 7),
        executed_chunk_length=2,
        options=SamplerOptions(num_denoising_steps=4),
    )
    env = make_chunked_env(TransformedEnv(GymEnv("Pusher-v5"), DoubleToFloat()), 2)
    env.set_seed(0)
    collector = Collector(
        env, policy, frames_per_batch=4, total_frames=8, compile_policy={"backend": "eager"}
    )
    try:
        assert not hasattr(collector._wrapped_policy, "spec")  # the wrapper hides it
        batches = list(collector)
    finally:
        collector.shutdown()
    assert len(batches) == 2
    for batch in batches:
        assert batch[CHAIN_KEY].shape == (4, 5, 3, 7)
        assert torch.equal(batch["action"], batch[CHAIN_KEY][:, -1, :2])
        torch.testing.assert_close(
            policy.log_prob(batch), batch[STEP_LOG_PROB_KEY], rtol=0, atol=1e-5
        )


@pytest.mark.parametrize(
    "mode", [ExplorationType.DETERMINISTIC, ExplorationType.MODE, ExplorationType.MEAN]
)
def test_deterministic_evaluation_repeats_by_default(mode):
    policy = FlowSDEPolicy(
        make_network(),
        action_shape=ACTION_SHAPE,
        options=SamplerOptions(eval_num_denoising_steps=6),
    )
    tensordict = make_tensordict((3,))
    with set_exploration_type(mode), torch.no_grad():
        first, second = policy(tensordict.clone())["action"], policy(tensordict.clone())["action"]
    assert torch.equal(first, second)
    # The noise-free chunk: the ODE from x_0 = 0.
    assert torch.equal(first, policy.decode(tensordict, torch.zeros(3, *ACTION_SHAPE)))
    # eval_noise_scale=1 samples the model's distribution: another chunk at every call.
    sampled = FlowSDEPolicy(
        policy.velocity_network,
        action_shape=ACTION_SHAPE,
        options=SamplerOptions(eval_num_denoising_steps=6, eval_noise_scale=1.0),
    )
    with set_exploration_type(mode), torch.no_grad():
        first, second = sampled(tensordict.clone())["action"], sampled(tensordict.clone())["action"]
    assert not torch.allclose(first, second)
