"""Tests of ``DenoisingClipPPOLoss``: the clipped objective per denoising step.

The objective is checked against an independent per-entry implementation of the seed's
formula (a Python loop over the stochastic ``(decision, step)`` entries, ``flow.sde_step`` at
the stored ``x_k`` and ``torch.distributions.Normal``), against TorchRL's own ``ClipPPOLoss``
where a decision is a single Gaussian, and against finite differences.
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import Tensor, nn
from torch.distributions import Independent, Normal
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import ProbabilisticActor
from torchrl.objectives import ClipPPOLoss, ValueEstimators

from torchrl_flowpolicy import FlowSDEPolicy, flow
from torchrl_flowpolicy.networks import (
    ActionExpertTransformer,
    MLPVelocityNetwork,
    ObservationEncoder,
)
from torchrl_flowpolicy.objectives import DenoisingClipPPOLoss
from torchrl_flowpolicy.objectives.flow_matching import flow_matching_per_sample
from torchrl_flowpolicy.sampler import SamplerOptions

OBSERVATION_DIM = 5
ACTION_SHAPE = (4, 2)
CHAIN = ("flow", "chain")
SDE_MASK = ("flow", "sde_mask")
STEP_LOG_PROB = ("flow", "step_log_prob")


# ---------------------------------------------------------------------------- helpers
def make_policy(
    *,
    num_denoising_steps: int = 4,
    sde_mode: str = "mixed",
    num_sde_steps: int = 2,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    network: nn.Module | None = None,
) -> FlowSDEPolicy:
    torch.manual_seed(seed)
    if network is None:
        network = MLPVelocityNetwork(OBSERVATION_DIM, ACTION_SHAPE, hidden_dim=32, num_layers=2)
    return FlowSDEPolicy(
        network.to(dtype),
        action_shape=ACTION_SHAPE,
        options=SamplerOptions(
            num_denoising_steps=num_denoising_steps, sde_mode=sde_mode, num_sde_steps=num_sde_steps
        ),
    )


def make_transformer_policy(*, seed: int = 0) -> FlowSDEPolicy:
    torch.manual_seed(seed)
    encoder = ObservationEncoder(OBSERVATION_DIM, model_dim=16, num_tokens=2, hidden_dim=32)
    expert = ActionExpertTransformer(ACTION_SHAPE, model_dim=16, num_heads=2, num_layers=1)
    return FlowSDEPolicy(
        expert.double(),
        action_shape=ACTION_SHAPE,
        encoder=encoder.double(),
        options=SamplerOptions(num_denoising_steps=4),
    )


def collect(policy: FlowSDEPolicy, batch_shape: tuple[int, ...], *, seed: int = 1) -> TensorDict:
    """Freshly collected decisions: the policy sampled under RANDOM exploration, no grad."""
    torch.manual_seed(seed)
    observation = torch.randn(*batch_shape, OBSERVATION_DIM, dtype=policy.network_dtype)
    data = TensorDict({"observation": observation}, batch_size=batch_shape)
    with set_exploration_type(ExplorationType.RANDOM), torch.no_grad():
        return policy(data)


def non_uniform_advantage(batch_shape: tuple[int, ...], dtype=torch.float64, seed: int = 2):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*batch_shape, 1, generator=generator, dtype=dtype) * 2.0 + 0.3


def perturb(module: nn.Module, scale: float = 0.05, seed: int = 3) -> None:
    """Move every parameter by Gaussian noise (the "updated" policy)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            parameter.add_(noise * scale)


def network_parameters(policy: FlowSDEPolicy) -> list[Tensor]:
    return [p for p in policy.velocity_network.parameters() if p.requires_grad]


def stored(data: TensorDict, policy: FlowSDEPolicy) -> dict[str, Tensor]:
    """The stored rollout entries, flattened to ``[N, ...]``."""
    num_denoising_steps = policy.num_denoising_steps
    return {
        "chain": data[CHAIN].reshape(-1, num_denoising_steps + 1, *ACTION_SHAPE),
        "mask": data[SDE_MASK].reshape(-1, num_denoising_steps),
        "old_log_prob": data[STEP_LOG_PROB].reshape(-1, num_denoising_steps),
        "observation": data["observation"].reshape(-1, OBSERVATION_DIM),
    }


def hand_step_gaussian(
    policy: FlowSDEPolicy, x: Tensor, observation: Tensor, step: int
) -> tuple[Tensor, Tensor]:
    """``(mean_k, std_k)`` of one transition, computed with ``flow.sde_step`` from the stored x_k."""
    sigmas = flow.sigma_grid(policy.num_denoising_steps, policy.options.shift, dtype=x.dtype)
    velocity = policy.velocity_network(x[None], sigmas[step : step + 1], observation[None])[0]
    return flow.sde_step(x, velocity, sigmas[step], sigmas[step + 1], policy.options.noise_level)


def reference_entries(
    policy: FlowSDEPolicy,
    data: TensorDict,
    advantage: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The seed's clipped objective per stochastic entry, one entry at a time.

    Returns ``(gain [M], ratio [M], entry_advantage [M])``;
    ``loss_objective = -gain.mean()``.
    """
    entries = stored(data, policy)
    advantage = advantage.reshape(-1)
    gains, ratios, advantages = [], [], []
    for decision in range(entries["chain"].shape[0]):
        for step in range(policy.num_denoising_steps):
            if not entries["mask"][decision, step]:
                continue
            chain = entries["chain"][decision]
            mean, std = hand_step_gaussian(
                policy, chain[step], entries["observation"][decision], step
            )
            log_prob = Normal(mean, std).log_prob(chain[step + 1]).sum()
            ratio = torch.exp(log_prob - entries["old_log_prob"][decision, step])
            value = advantage[decision]
            gain = torch.minimum(ratio * value, ratio.clamp(1 - clip_low, 1 + clip_high) * value)
            if dual_clip is not None and value < 0:
                gain = torch.maximum(gain, dual_clip * value)
            gains.append(gain)
            ratios.append(ratio)
            advantages.append(value)
    return torch.stack(gains), torch.stack(ratios), torch.stack(advantages)


# ---------------------------------------------------------------------------- fresh data
@pytest.mark.parametrize(
    "sde_mode, num_denoising_steps, num_sde_steps, entries_per_decision",
    [("mixed", 4, 2, 1), ("last", 6, 3, 3), ("all", 5, 2, 4)],
)
def test_fresh_data_has_unit_ratios_and_objective_minus_mean_advantage(
    sde_mode, num_denoising_steps, num_sde_steps, entries_per_decision
):
    policy = make_policy(
        num_denoising_steps=num_denoising_steps,
        sde_mode=sde_mode,
        num_sde_steps=num_sde_steps,
        dtype=torch.float32,
    )
    data = collect(policy, (32,))
    advantage = non_uniform_advantage((32,), dtype=torch.float32)
    data["advantage"] = advantage
    out = DenoisingClipPPOLoss(policy, clip_epsilon=0.2)(data)

    assert int(out["num_stochastic_steps"]) == 32 * entries_per_decision
    assert data[SDE_MASK].sum(-1).eq(entries_per_decision).all()
    torch.testing.assert_close(out["mean_ratio"], torch.tensor(1.0), atol=1e-5, rtol=0)
    torch.testing.assert_close(out["max_ratio"], torch.tensor(1.0), atol=1e-5, rtol=0)
    assert out["log_prob_drift"] <= 1e-5
    assert out["clip_fraction"] == 0
    # Every decision has the same number of stochastic entries, each weighted by its
    # decision's advantage: the masked mean over entries is the mean advantage.
    torch.testing.assert_close(out["loss_objective"], -advantage.mean(), atol=1e-6, rtol=1e-6)


def test_fresh_data_objective_weights_each_stochastic_entry():
    """With a hand-built mask of uneven entry counts the mean runs over entries, not decisions."""
    policy = make_policy(num_denoising_steps=4, sde_mode="all")
    data = collect(policy, (6,))
    mask = data[SDE_MASK].clone()
    mask[0, 1:] = torch.tensor([True, False, False])
    mask[1, 1:] = torch.tensor([False, True, True])
    data[SDE_MASK] = mask
    data[STEP_LOG_PROB] = torch.where(mask, data[STEP_LOG_PROB], torch.zeros(()).double())
    advantage = non_uniform_advantage((6,))
    data["advantage"] = advantage
    out = DenoisingClipPPOLoss(policy)(data)
    counts = mask.sum(-1).to(advantage.dtype)
    expected = -(advantage.squeeze(-1) * counts).sum() / counts.sum()
    torch.testing.assert_close(out["loss_objective"], expected, atol=1e-10, rtol=1e-10)
    assert out["log_prob_drift"] <= 1e-10


# ---------------------------------------------------------------------------- the formula
@pytest.mark.parametrize("sde_mode", ["mixed", "all"])
@pytest.mark.parametrize("clip_epsilon", [0.2, (0.2, 0.28)])
def test_objective_and_gradient_match_the_seed_formula(sde_mode, clip_epsilon):
    policy = make_policy(num_denoising_steps=4, sde_mode=sde_mode)
    data = collect(policy, (16,))
    advantage = non_uniform_advantage((16,))
    data["advantage"] = advantage
    perturb(policy.velocity_network)
    low, high = clip_epsilon if isinstance(clip_epsilon, tuple) else (clip_epsilon,) * 2

    loss = DenoisingClipPPOLoss(policy, clip_epsilon=clip_epsilon)
    out = loss(data)
    gain, ratio, _ = reference_entries(policy, data, advantage, clip_low=low, clip_high=high)
    expected = -gain.mean()
    # Both branches of the min are exercised.
    clipped = (ratio < 1 - low) | (ratio > 1 + high)
    assert clipped.any() and not clipped.all()
    torch.testing.assert_close(out["clip_fraction"], clipped.double().mean(), atol=0, rtol=0)
    torch.testing.assert_close(out["mean_ratio"], ratio.mean(), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(out["max_ratio"], ratio.max(), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(
        out["log_prob_drift"], ratio.log().abs().max(), atol=1e-12, rtol=1e-10
    )

    torch.testing.assert_close(out["loss_objective"], expected, atol=1e-6, rtol=1e-6)
    parameters = network_parameters(policy)
    gradient = torch.autograd.grad(out["loss_objective"], parameters)
    expected_gradient = torch.autograd.grad(expected, parameters)
    for actual, wanted in zip(gradient, expected_gradient, strict=True):
        torch.testing.assert_close(actual, wanted, atol=1e-6, rtol=1e-6)
    assert sum(g.abs().sum() for g in gradient) > 0


@pytest.mark.parametrize("sde_mode", ["mixed", "all"])
def test_dual_clip_matches_the_formula(sde_mode):
    policy = make_policy(num_denoising_steps=4, sde_mode=sde_mode)
    data = collect(policy, (16,))
    advantage = non_uniform_advantage((16,))
    data["advantage"] = advantage
    perturb(policy.velocity_network, scale=0.08)
    dual_clip = 1.5

    out = DenoisingClipPPOLoss(policy, clip_epsilon=0.2, dual_clip=dual_clip)(data)
    gain, ratio, entry_advantage = reference_entries(
        policy, data, advantage, clip_low=0.2, clip_high=0.2, dual_clip=dual_clip
    )
    # The floor c * A is active for some negative-advantage entries (ratio > c).
    assert ((entry_advantage < 0) & (ratio > dual_clip)).any()
    expected = -gain.mean()
    torch.testing.assert_close(out["loss_objective"], expected, atol=1e-6, rtol=1e-6)
    without_dual_clip = DenoisingClipPPOLoss(policy, clip_epsilon=0.2)(data)["loss_objective"]
    assert (without_dual_clip - out["loss_objective"]).abs() > 1e-3

    parameters = network_parameters(policy)
    gradient = torch.autograd.grad(out["loss_objective"], parameters)
    expected_gradient = torch.autograd.grad(expected, parameters)
    for actual, wanted in zip(gradient, expected_gradient, strict=True):
        torch.testing.assert_close(actual, wanted, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------- TorchRL
class ChunkNormal(Independent):
    """A Gaussian over a whole ``[H, D]`` chunk with a per-coordinate scale."""

    def __init__(self, loc: Tensor, scale: Tensor):
        super().__init__(Normal(loc, scale), 2)


class SingleStepGaussian(nn.Module):
    """``(loc, scale)`` of a decision's only stochastic step, from its stored ``x_k``.

    Uses the same velocity network (and so the same parameters) as the flow policy.
    """

    def __init__(self, velocity_network: nn.Module, num_denoising_steps: int, noise_level: float):
        super().__init__()
        self.velocity_network = velocity_network
        self.num_denoising_steps = num_denoising_steps
        self.noise_level = noise_level

    def forward(self, observation: Tensor, chain: Tensor, sde_mask: Tensor):
        step = sde_mask.long().argmax(-1)
        decision = torch.arange(chain.shape[0])
        x = chain[decision, step]
        sigmas = flow.sigma_grid(self.num_denoising_steps, dtype=chain.dtype)
        sigma, sigma_next = sigmas[step], sigmas[step + 1]
        velocity = self.velocity_network(x, sigma, observation)
        loc, std = flow.sde_step(
            x, velocity, sigma[:, None, None], sigma_next[:, None, None], self.noise_level
        )
        return loc, std.expand_as(loc)


@pytest.mark.parametrize(
    "num_denoising_steps, sde_mode, num_sde_steps", [(2, "mixed", 1), (5, "last", 1)]
)
@pytest.mark.parametrize("clip_epsilon", [0.2, (0.2, 0.28)])
def test_single_stochastic_step_matches_torchrl_clip_ppo_loss(
    num_denoising_steps, sde_mode, num_sde_steps, clip_epsilon
):
    policy = make_policy(
        num_denoising_steps=num_denoising_steps, sde_mode=sde_mode, num_sde_steps=num_sde_steps
    )
    data = collect(policy, (24,))
    assert data[SDE_MASK].sum(-1).eq(1).all()
    # The only stochastic step is the last one: its sample x_{k+1} is the action x_K.
    assert data[SDE_MASK][:, -1].all()
    torch.testing.assert_close(data["action_log_prob"], data[STEP_LOG_PROB].sum(-1))
    data["advantage"] = non_uniform_advantage((24,))
    perturb(policy.velocity_network)

    actor = ProbabilisticActor(
        TensorDictModule(
            SingleStepGaussian(
                policy.velocity_network, num_denoising_steps, policy.options.noise_level
            ),
            in_keys=["observation", CHAIN, SDE_MASK],
            out_keys=["loc", "scale"],
        ),
        in_keys=["loc", "scale"],
        out_keys=["action"],
        distribution_class=ChunkNormal,
        return_log_prob=True,
        log_prob_key="action_log_prob",
    )
    torchrl_loss = ClipPPOLoss(actor, clip_epsilon=clip_epsilon, entropy_bonus=False)
    torchrl_loss.set_keys(sample_log_prob="action_log_prob", action="action")
    ours = DenoisingClipPPOLoss(policy, clip_epsilon=clip_epsilon)

    expected = torchrl_loss(data.clone())
    out = ours(data)
    assert 0 < float(expected["clip_fraction"]) < 1
    for key in ("loss_objective", "clip_fraction", "mean_ratio", "max_ratio", "kl_approx"):
        torch.testing.assert_close(out[key], expected[key], atol=1e-6, rtol=1e-6)

    parameters = network_parameters(policy)
    gradient = torch.autograd.grad(out["loss_objective"], parameters)
    expected_gradient = torch.autograd.grad(expected["loss_objective"], parameters)
    for actual, wanted in zip(gradient, expected_gradient, strict=True):
        torch.testing.assert_close(actual, wanted, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------- gradients
def test_gradient_matches_central_finite_differences():
    policy = make_policy(num_denoising_steps=4, sde_mode="all")
    data = collect(policy, (8,))
    data["advantage"] = non_uniform_advantage((8,))
    perturb(policy.velocity_network)
    loss = DenoisingClipPPOLoss(policy, clip_epsilon=0.2)

    # Away from the clip kinks: every log-ratio is far from log(0.8) and log(1.2).
    log_ratio = (policy.log_prob(data) - data[STEP_LOG_PROB])[data[SDE_MASK]].detach()
    bounds = torch.tensor([math.log(0.8), math.log(1.2)], dtype=torch.float64)
    assert (log_ratio[:, None] - bounds).abs().min() > 1e-3
    assert (log_ratio.abs() > math.log(1.2)).any() and (log_ratio.abs() < math.log(1.2)).any()

    parameters = network_parameters(policy)
    gradient = torch.autograd.grad(loss(data)["loss_objective"], parameters)
    generator = torch.Generator().manual_seed(0)
    step = 1e-6
    for parameter, parameter_gradient in zip(parameters, gradient, strict=True):
        flat_parameter = parameter.data.view(-1)
        for index in torch.randint(flat_parameter.numel(), (3,), generator=generator).tolist():
            original = flat_parameter[index].item()
            with torch.no_grad():
                flat_parameter[index] = original + step
                plus = loss(data)["loss_objective"]
                flat_parameter[index] = original - step
                minus = loss(data)["loss_objective"]
                flat_parameter[index] = original
            numerical = (plus - minus) / (2 * step)
            torch.testing.assert_close(
                parameter_gradient.view(-1)[index], numerical, atol=1e-7, rtol=1e-5
            )


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_advantage_sign_moves_the_decision_log_prob(sign):
    policy = make_policy(num_denoising_steps=4, sde_mode="mixed")
    data = collect(policy, (8,))
    decision = 3
    advantage = torch.zeros(8, 1, dtype=torch.float64)
    advantage[decision] = sign
    data["advantage"] = advantage
    loss = DenoisingClipPPOLoss(policy)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1e-3)

    before = policy.log_prob(data).sum(-1).detach()
    loss(data)["loss_objective"].backward()
    optimizer.step()
    after = policy.log_prob(data).sum(-1).detach()
    change = after[decision] - before[decision]
    assert sign * change > 1e-4


# ---------------------------------------------------------------------------- parameters
def make_critic() -> TensorDictModule:
    torch.manual_seed(5)
    return TensorDictModule(
        nn.Linear(OBSERVATION_DIM, 1).double(), in_keys=["observation"], out_keys=["state_value"]
    )


def gradients_of(module: nn.Module) -> list[Tensor | None]:
    return [parameter.grad for parameter in module.parameters()]


def has_gradient(module: nn.Module) -> bool:
    return any(g is not None and g.abs().sum() > 0 for g in gradients_of(module))


def test_critic_loss_moves_only_the_critic_and_objective_only_the_actor():
    policy = make_transformer_policy()
    critic = make_critic()
    data = collect(policy, (8,))
    data["advantage"] = non_uniform_advantage((8,))
    data["value_target"] = torch.randn(8, 1, dtype=torch.float64)
    perturb(policy.velocity_network)
    loss = DenoisingClipPPOLoss(policy, critic)

    out = loss(data)
    out["loss_critic"].backward(retain_graph=True)
    assert has_gradient(critic)
    assert not has_gradient(policy)

    critic.zero_grad(set_to_none=True)
    out["loss_objective"].backward()
    assert has_gradient(policy.velocity_network)
    assert not has_gradient(policy.encoder)
    assert not has_gradient(critic)


# ---------------------------------------------------------------------------- critic-free
def test_critic_free_loss_equals_the_critic_loss_on_the_stored_advantage():
    policy = make_transformer_policy()
    data = collect(policy, (8,))
    data["advantage"] = non_uniform_advantage((8,))
    data["value_target"] = torch.randn(8, 1, dtype=torch.float64)
    perturb(policy.velocity_network)
    options = {"clip_epsilon": (0.2, 0.28), "kl_coeff": 0.01, "normalize_advantage": True}
    with_critic = DenoisingClipPPOLoss(policy, make_critic(), **options)(data)
    critic_free_loss = DenoisingClipPPOLoss(policy, **options)
    critic_free = critic_free_loss(data)

    assert set(with_critic.keys()) - set(critic_free.keys()) == {
        "loss_critic",
        "explained_variance",
    }
    assert set(critic_free.keys()) <= set(with_critic.keys())
    for name in critic_free.keys():
        torch.testing.assert_close(critic_free[name], with_critic[name], msg=name)
    assert critic_free["loss_objective"].abs() > 0

    # Gradients reach the actor only: the loss trains no other parameter (the frozen KL
    # reference aside).
    actor = {parameter.data_ptr() for parameter in policy.parameters()}
    trained = [parameter for parameter in critic_free_loss.parameters() if parameter.requires_grad]
    assert trained and {parameter.data_ptr() for parameter in trained} <= actor
    sum(value for name, value in critic_free.items() if name.startswith("loss_")).backward()
    assert has_gradient(policy.velocity_network)
    # It reads no next-step entry (nothing bootstraps) and reads the advantage.
    assert critic_free_loss.in_keys and "advantage" in critic_free_loss.in_keys
    assert not [
        key for key in critic_free_loss.in_keys if isinstance(key, tuple) and key[0] == "next"
    ]


@pytest.mark.parametrize(
    "options",
    [{"critic_coeff": 0.5}, {"clip_value": 0.2}, {"loss_critic_type": "l2"}],
)
def test_critic_options_without_a_critic_are_refused_naming_them(options):
    (name,) = options
    with pytest.raises(ValueError, match=f"{name}=.*no critic"):
        DenoisingClipPPOLoss(make_policy(), **options)


def test_critic_free_loss_refuses_what_only_a_critic_serves():
    policy = make_policy()
    for options in ({}, {"critic_coeff": 0.0}, {"critic_coeff": None}, {"clip_value": None}):
        assert "loss_critic" not in DenoisingClipPPOLoss(policy, **options).out_keys
    loss = DenoisingClipPPOLoss(policy)
    with pytest.raises(ValueError, match="make_value_estimator needs a critic"):
        loss.make_value_estimator(ValueEstimators.GAE, gamma=0.9, lmbda=0.95)
    with pytest.raises(ValueError, match="needs a critic"):
        loss.value_estimator  # noqa: B018 (TorchRL builds a default GAE on first access)
    data = collect(policy, (4,))
    with pytest.raises(ValueError, match="loss_critic needs a critic"):
        loss.loss_critic(data)
    with pytest.raises(KeyError, match="no critic to compute it"):
        loss(data)


def test_group_relative_batch_of_equal_returns_gives_a_zero_objective_and_gradient():
    """GRPO composed: GroupRelativeAdvantage on a [envs, T] batch, its first episodes, the
    critic-free loss. Groups whose returns are all equal contribute nothing."""
    from torchrl_flowpolicy.objectives import GroupRelativeAdvantage

    policy = make_policy(sde_mode="all")
    data = collect(policy, (4, 3))
    done = torch.zeros(4, 3, 1, dtype=torch.bool)
    done[:, -1] = True
    done[0, 0] = True  # env 0's episode ends at once; the collector starts another
    data["group_id"] = (torch.arange(4) // 2).unsqueeze(-1).expand(4, 3)
    data["next", "done"] = done
    perturb(policy.velocity_network)
    loss = DenoisingClipPPOLoss(policy, normalize_advantage=False)

    data["next", "reward"] = torch.ones(4, 3, 1, dtype=torch.float64)
    data["next", "reward"][0, 0] = 3.0  # every episode's return is 3
    flat = GroupRelativeAdvantage()(data.clone())
    flat = flat[flat["episode_mask"]]
    assert flat.batch_size == (10,) and (flat["advantage"] == 0).all()
    out = loss(flat)
    assert out["loss_objective"] == 0
    out["loss_objective"].backward()
    assert not has_gradient(policy)

    data["next", "reward"][2, 1] = 1.5  # group 1 now has a spread
    flat = GroupRelativeAdvantage()(data.clone())
    flat = flat[flat["episode_mask"]]
    assert (flat["advantage"][flat["group_id"] == 0] == 0).all()
    assert (flat["advantage"][flat["group_id"] == 1] != 0).all()
    loss(flat)["loss_objective"].backward()
    assert has_gradient(policy.velocity_network)


def test_context_grad_lets_the_objective_reach_the_encoder():
    policy = make_transformer_policy()
    data = collect(policy, (8,))
    data["advantage"] = non_uniform_advantage((8,))
    perturb(policy.velocity_network)

    DenoisingClipPPOLoss(policy, context_grad=False)(data)["loss_objective"].backward()
    assert not has_gradient(policy.encoder)
    assert has_gradient(policy.velocity_network)

    DenoisingClipPPOLoss(policy, context_grad=True)(data)["loss_objective"].backward()
    assert has_gradient(policy.encoder)


# ---------------------------------------------------------------------------- keys, shapes
def test_set_keys_reads_renamed_nested_entries():
    policy = make_policy(num_denoising_steps=4, sde_mode="all")
    data = collect(policy, (8,))
    data["advantage"] = non_uniform_advantage((8,))
    perturb(policy.velocity_network)
    expected = DenoisingClipPPOLoss(policy)(data)

    renamed = TensorDict(
        {
            "observation": data["observation"],
            ("rollout", "denoising", "chain"): data[CHAIN],
            ("rollout", "denoising", "stochastic"): data[SDE_MASK],
            ("rollout", "old_step_log_prob"): data[STEP_LOG_PROB],
            ("estimates", "advantage"): data["advantage"],
        },
        batch_size=[8],
    )
    loss = DenoisingClipPPOLoss(policy)
    loss.set_keys(
        chain=("rollout", "denoising", "chain"),
        sde_mask=("rollout", "denoising", "stochastic"),
        step_log_prob=("rollout", "old_step_log_prob"),
        advantage=("estimates", "advantage"),
    )
    for key in [("rollout", "denoising", "chain"), ("rollout", "denoising", "stochastic")]:
        assert key in loss.in_keys
    out = loss(renamed)
    for key in ("loss_objective", "clip_fraction", "log_prob_drift"):
        torch.testing.assert_close(out[key], expected[key], atol=0, rtol=0)

    # The renamed entries are the ones read: changing them changes the result.
    renamed[("estimates", "advantage")] = renamed[("estimates", "advantage")] + 1.0
    assert (loss(renamed)["loss_objective"] - expected["loss_objective"]).abs() > 0.5
    with pytest.raises(KeyError, match="old_step_log_prob"):
        loss(renamed.exclude(("rollout", "old_step_log_prob")))


@pytest.mark.parametrize("batch_shape", [(), (6,), (3, 4)])
@pytest.mark.parametrize("sde_mode", ["mixed", "all"])
def test_reductions_and_batch_shapes(batch_shape, sde_mode):
    policy = make_policy(num_denoising_steps=4, sde_mode=sde_mode)
    data = collect(policy, batch_shape)
    advantage = non_uniform_advantage(batch_shape)
    data["advantage"] = advantage
    perturb(policy.velocity_network)
    mask = data[SDE_MASK]

    per_entry = DenoisingClipPPOLoss(policy, reduction="none")(data)["loss_objective"]
    assert per_entry.shape == (*batch_shape, 4)
    assert (per_entry[~mask] == 0).all()
    gain, _, _ = reference_entries(policy, data, advantage, clip_low=0.2, clip_high=0.2)
    # TorchRL keeps the clip epsilon in a float32 buffer: clipped entries agree to ~1e-8.
    torch.testing.assert_close(per_entry[mask], -gain, atol=1e-7, rtol=1e-7)

    total = DenoisingClipPPOLoss(policy, reduction="sum")(data)["loss_objective"]
    mean = DenoisingClipPPOLoss(policy, reduction="mean")(data)["loss_objective"]
    assert total.shape == mean.shape == ()
    torch.testing.assert_close(total, per_entry.sum(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(mean, per_entry.sum() / mask.sum(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(mean, -gain.mean(), atol=1e-7, rtol=1e-7)


def test_collector_validity_mask_drops_padded_decisions():
    policy = make_policy(num_denoising_steps=4, sde_mode="all")
    data = collect(policy, (3, 4))
    advantage = non_uniform_advantage((3, 4))
    data["advantage"] = advantage
    perturb(policy.velocity_network)
    valid = torch.ones(3, 4, dtype=torch.bool)
    valid[0, 2:] = False
    valid[2, 3] = False
    data["collector", "mask"] = valid
    gain, _, _ = reference_entries(policy, data, advantage, clip_low=0.2, clip_high=0.2)
    per_entry = torch.zeros(3, 4, 4, dtype=torch.float64)
    per_entry[data[SDE_MASK]] = -gain
    kept = data[SDE_MASK] & valid[..., None]

    mean = DenoisingClipPPOLoss(policy)(data)["loss_objective"]
    torch.testing.assert_close(mean, per_entry[kept].mean(), atol=1e-7, rtol=1e-7)
    total = DenoisingClipPPOLoss(policy, reduction="sum")(data)["loss_objective"]
    torch.testing.assert_close(total, per_entry[kept].sum(), atol=1e-7, rtol=1e-7)
    none = DenoisingClipPPOLoss(policy, reduction="none")(data)["loss_objective"]
    assert none.shape == (3, 4, 4)
    assert (none[~valid] == 0).all()
    torch.testing.assert_close(none, torch.where(kept, per_entry, 0.0), atol=1e-7, rtol=1e-7)


def hand_gae(
    value: Tensor,
    next_value: Tensor,
    reward: Tensor,
    done: Tensor,
    terminated: Tensor,
    gamma,
    lmbda,
) -> Tensor:
    """GAE over the last batch dimension (time), written out step by step."""
    advantage = torch.zeros_like(reward)
    running = torch.zeros_like(reward[..., 0, :])
    for t in reversed(range(reward.shape[-2])):
        not_terminated = (~terminated[..., t, :]).to(reward.dtype)
        not_done = (~done[..., t, :]).to(reward.dtype)
        delta = (
            reward[..., t, :] + gamma * not_terminated * next_value[..., t, :] - value[..., t, :]
        )
        running = delta + gamma * lmbda * not_done * running
        advantage[..., t, :] = running
    return advantage


def test_gae_advantage_is_computed_inside_forward_for_a_rollout_batch():
    batch, time = 3, 5
    policy = make_policy(num_denoising_steps=4, sde_mode="mixed")
    critic = make_critic()
    data = collect(policy, (batch, time))
    generator = torch.Generator().manual_seed(4)
    next_observation = torch.randn(batch, time, OBSERVATION_DIM, generator=generator).double()
    reward = torch.randn(batch, time, 1, generator=generator).double()
    done = torch.zeros(batch, time, 1, dtype=torch.bool)
    done[0, 2] = True
    done[:, -1] = True
    terminated = torch.zeros_like(done)
    terminated[0, 2] = True
    data["next"] = TensorDict(
        {"observation": next_observation, "reward": reward, "done": done, "terminated": terminated},
        batch_size=[batch, time],
    )
    gamma, lmbda = 0.9, 0.8
    loss = DenoisingClipPPOLoss(policy, critic)
    loss.make_value_estimator(ValueEstimators.GAE, gamma=gamma, lmbda=lmbda)
    assert "advantage" not in data.keys()
    out = loss(data)

    with torch.no_grad():
        linear = critic.module
        advantage = hand_gae(
            linear(data["observation"]),
            linear(next_observation),
            reward,
            done,
            terminated,
            gamma,
            lmbda,
        )
    # Fresh data: every ratio is 1 and "mixed" has one entry per decision. (TorchRL keeps
    # gamma and lambda in float32 buffers, hence agreement to ~1e-8 rather than 1e-15.)
    torch.testing.assert_close(out["loss_objective"], -advantage.mean(), atol=1e-6, rtol=1e-6)
    assert out["loss_critic"].shape == ()
    assert out["loss_critic"] > 0


@pytest.mark.parametrize("batch_shape", [(6,), (3, 4)])
def test_advantage_of_shape_batch_plus_one(batch_shape):
    policy = make_policy(num_denoising_steps=4, sde_mode="mixed")
    data = collect(policy, batch_shape)
    advantage = non_uniform_advantage(batch_shape)
    data["advantage"] = advantage
    out = DenoisingClipPPOLoss(policy)(data)
    torch.testing.assert_close(out["loss_objective"], -advantage.mean(), atol=1e-10, rtol=1e-10)
    data["advantage"] = advantage.squeeze(-1)
    with pytest.raises(ValueError, match="advantage"):
        DenoisingClipPPOLoss(policy)(data)


# ---------------------------------------------------------------------------- regularisers
@pytest.mark.parametrize("kl_estimator", ["analytic", "sample"])
def test_kl_to_reference_is_zero_at_start_and_matches_hand_computation(kl_estimator):
    policy = make_policy(num_denoising_steps=4, sde_mode="all")
    data = collect(policy, (8,))
    data["advantage"] = non_uniform_advantage((8,))
    kl_coeff = 0.1
    loss = DenoisingClipPPOLoss(policy, kl_coeff=kl_coeff, kl_estimator=kl_estimator)
    reference = loss.reference_actor
    assert reference is not policy
    assert all(not p.requires_grad for p in reference.parameters())

    out = loss(data)
    assert out["loss_kl"] == 0
    assert out["kl_reference"] == 0

    optimizer = torch.optim.SGD(policy.parameters(), lr=0.05)
    (out["loss_objective"] + out["loss_kl"]).backward()
    optimizer.step()
    out = loss(data)

    entries = stored(data, policy)
    per_entry = []
    for decision, step in entries["mask"].nonzero().tolist():
        chain = entries["chain"][decision]
        observation = entries["observation"][decision]
        mean, std = hand_step_gaussian(policy, chain[step], observation, step)
        reference_mean, reference_std = hand_step_gaussian(
            reference, chain[step], observation, step
        )
        torch.testing.assert_close(std, reference_std)
        if kl_estimator == "analytic":
            per_entry.append((mean - reference_mean).pow(2).sum() / (2 * std**2))
        else:
            sample = chain[step + 1]
            per_entry.append(
                Normal(mean, std).log_prob(sample).sum()
                - Normal(reference_mean, std).log_prob(sample).sum()
            )
    per_entry = torch.stack(per_entry)
    torch.testing.assert_close(out["loss_kl"], kl_coeff * per_entry.mean(), atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(out["kl_reference"], per_entry.mean(), atol=1e-10, rtol=1e-8)
    if kl_estimator == "analytic":
        assert out["loss_kl"] > 0
        out["loss_kl"].backward()
        assert has_gradient(policy.velocity_network)
        assert all(p.grad is None for p in reference.parameters())


def test_self_imitation_uses_only_successful_decisions_and_falls_when_optimised():
    policy = make_policy(num_denoising_steps=4, sde_mode="mixed")
    data = collect(policy, (8,))
    data["advantage"] = non_uniform_advantage((8,))
    success = torch.tensor([True, False, True, False, False, True, False, True])
    data["success"] = success
    loss = DenoisingClipPPOLoss(policy, bc_coeff=0.5)

    def bc_at_seed(batch: TensorDict) -> Tensor:
        torch.manual_seed(11)
        return loss(batch)["loss_bc"]

    baseline = bc_at_seed(data)
    unsuccessful = data.clone()
    unsuccessful["action"][1] += 10.0
    torch.testing.assert_close(bc_at_seed(unsuccessful), baseline, atol=0, rtol=0)
    successful = data.clone()
    successful["action"][2] += 10.0
    assert (bc_at_seed(successful) - baseline).abs() > 1e-3

    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    torch.manual_seed(12)
    for _ in range(60):
        optimizer.zero_grad()
        loss(data)["loss_bc"].backward()
        optimizer.step()
    assert bc_at_seed(data) < 0.7 * baseline.detach()


# ---------------------------------------------------------------------------- cost
@pytest.mark.parametrize(
    "sde_mode, num_denoising_steps, num_sde_steps, entries_per_decision",
    [("mixed", 8, 4, 1), ("last", 6, 3, 3), ("all", 5, 2, 4)],
)
def test_velocity_network_called_once_per_loss_evaluation(
    counting, sde_mode, num_denoising_steps, num_sde_steps, entries_per_decision
):
    torch.manual_seed(0)
    network = counting(MLPVelocityNetwork(OBSERVATION_DIM, ACTION_SHAPE, hidden_dim=32))
    policy = make_policy(
        num_denoising_steps=num_denoising_steps,
        sde_mode=sde_mode,
        num_sde_steps=num_sde_steps,
        network=network,
    )
    data = collect(policy, (8,))
    data["advantage"] = non_uniform_advantage((8,))
    assert network.calls == num_denoising_steps
    loss = DenoisingClipPPOLoss(policy, kl_coeff=0.0, bc_coeff=0.0)

    network.calls, network.rows = 0, []
    out = loss(data)
    out["loss_objective"].backward()
    assert network.calls == 1
    assert network.rows == [8 * entries_per_decision]


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "missing, match",
    [
        (CHAIN, "chain"),
        (SDE_MASK, "sde_mask"),
        (STEP_LOG_PROB, "step_log_prob"),
        ("advantage", "advantage"),
    ],
)
def test_missing_keys_raise_key_errors_naming_the_key(missing, match):
    policy = make_policy()
    data = collect(policy, (4,))
    data["advantage"] = non_uniform_advantage((4,))
    with pytest.raises(KeyError, match=match):
        DenoisingClipPPOLoss(policy)(data.exclude(missing))


def test_chain_from_a_policy_with_other_num_denoising_steps_is_rejected():
    data = collect(make_policy(num_denoising_steps=4), (4,))
    data["advantage"] = non_uniform_advantage((4,))
    with pytest.raises(ValueError, match="num_denoising_steps=6"):
        DenoisingClipPPOLoss(make_policy(num_denoising_steps=6))(data)


def test_stored_log_probs_requiring_grad_are_rejected():
    policy = make_policy()
    data = collect(policy, (4,))
    data["advantage"] = non_uniform_advantage((4,))
    data[STEP_LOG_PROB] = data[STEP_LOG_PROB].clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="require grad"):
        DenoisingClipPPOLoss(policy)(data)


def test_bad_constructor_arguments_are_rejected():
    policy = make_policy()
    for dual_clip in (1.0, 0.5):
        with pytest.raises(ValueError, match="dual_clip"):
            DenoisingClipPPOLoss(policy, dual_clip=dual_clip)
    with pytest.raises(ValueError, match="delay_actor"):
        DenoisingClipPPOLoss(policy, delay_actor=True)


def test_self_imitation_reduction_none_is_per_decision():
    from torchrl_flowpolicy.networks import MLPVelocityNetwork as _MLP

    torch.manual_seed(0)
    policy = FlowSDEPolicy(_MLP(5, (4, 2), hidden_dim=16), action_shape=(4, 2))
    data = TensorDict({"observation": torch.randn(6, 5)}, batch_size=[6])
    with set_exploration_type(ExplorationType.RANDOM):
        data = policy(data)
    data["advantage"] = torch.randn(6, 1)
    data["success"] = torch.tensor([True, False, True, False, False, True])
    per_decision = DenoisingClipPPOLoss(policy, bc_coeff=1.0, reduction="none")
    torch.manual_seed(1)
    values = per_decision(data)["loss_bc"]
    assert values.shape == (6,)
    assert (values[~data["success"]] == 0).all() and (values[data["success"]] > 0).all()
    averaged = DenoisingClipPPOLoss(policy, bc_coeff=1.0)
    torch.manual_seed(1)
    torch.testing.assert_close(averaged(data)["loss_bc"], values[data["success"]].mean())


def test_options_the_loss_cannot_honour_are_refused():
    policy = make_policy()
    with pytest.raises(ValueError, match="entropy_coeff"):
        DenoisingClipPPOLoss(policy, entropy_coeff={"action": 0.1})
    with pytest.raises(ValueError, match="samples_mc_entropy"):
        DenoisingClipPPOLoss(policy, samples_mc_entropy=4)


@pytest.mark.parametrize("max_importance_ratio", [1e-6, 1.02])
def test_max_importance_ratio_caps_every_step_ratio_as_torchrl_does(max_importance_ratio):
    policy = make_policy(num_denoising_steps=4, sde_mode="all")
    data = collect(policy, (16,))
    advantage = non_uniform_advantage((16,))
    data["advantage"] = advantage
    perturb(policy.velocity_network, scale=0.08)
    out = DenoisingClipPPOLoss(policy, clip_epsilon=0.2, max_importance_ratio=max_importance_ratio)(
        data
    )
    uncapped = DenoisingClipPPOLoss(policy, clip_epsilon=0.2)(data)["loss_objective"]

    # TorchRL's cap: lift the (gradient-free) behaviour log-prob so that the ratio the
    # surrogate is weighted by never exceeds the cap; the clip acts on the uncapped ratio.
    _, ratio, entry_advantage = reference_entries(
        policy, data, advantage, clip_low=0.2, clip_high=0.2
    )
    correction = torch.clamp(max_importance_ratio / ratio.detach(), max=1.0)
    gain = torch.minimum(
        ratio * correction * entry_advantage,
        ratio.clamp(0.8, 1.2) * correction * entry_advantage,
    )
    torch.testing.assert_close(out["loss_objective"], -gain.mean(), atol=1e-6, rtol=1e-6)
    assert (correction < 1).any()
    assert (out["loss_objective"] - uncapped).abs() > 1e-4
    assert out["max_ratio"] <= max_importance_ratio * (1 + 1e-6)


def test_the_loss_reads_the_keys_the_policy_writes():
    policy = make_policy()
    policy.set_keys(
        chain=("rollout", "chain"),
        sde_mask=("rollout", "stochastic"),
        step_log_prob=("rollout", "step_log_prob"),
        log_prob=("rollout", "log_prob"),
    )
    data = collect(policy, (8,))
    assert CHAIN not in data.keys(True) and ("rollout", "chain") in data.keys(True)
    data["advantage"] = non_uniform_advantage((8,))
    loss = DenoisingClipPPOLoss(policy)
    assert loss.tensor_keys.chain == ("rollout", "chain")
    assert loss.tensor_keys.step_log_prob == ("rollout", "step_log_prob")
    assert loss.tensor_keys.sample_log_prob == ("rollout", "log_prob")
    assert ("rollout", "stochastic") in loss.in_keys
    out = loss(data)
    assert out["log_prob_drift"] <= 1e-8
    torch.testing.assert_close(out["loss_objective"], -data["advantage"].mean())


# ---------------------------------------------------------------------------- TorchRL scripts
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_entropy_is_always_written(reduction):
    # TorchRL's PPO scripts read loss["loss_entropy"]: without the bonus it is a zero of the
    # objective's dtype, device and shape.
    policy = make_policy()
    data = collect(policy, (2, 3))
    data["advantage"] = non_uniform_advantage((2, 3))
    loss = DenoisingClipPPOLoss(policy, reduction=reduction)
    assert "loss_entropy" in loss.out_keys
    out = loss(data)
    assert set(out.keys()) == set(loss.out_keys)
    objective, entropy = out["loss_objective"], out["loss_entropy"]
    assert torch.equal(entropy, torch.zeros_like(objective))
    assert (entropy.dtype, entropy.device) == (objective.dtype, objective.device)
    (objective + entropy).sum().backward()
    assert all(p.grad is not None for p in network_parameters(policy))
    with_bonus = DenoisingClipPPOLoss(policy, reduction=reduction, entropy_bonus=True)
    assert "loss_entropy" in with_bonus.out_keys
    bonus = with_bonus(data)["loss_entropy"]
    assert bonus.shape == objective.shape and (bonus != 0).any()


def test_single_step_policy_loss():
    # A per-step policy (action_shape=(D,)): the chain is [*B, K+1, D], the loss the same.
    torch.manual_seed(0)
    network = MLPVelocityNetwork(OBSERVATION_DIM, (1, 3), hidden_dim=32, num_layers=2)
    policy = FlowSDEPolicy(
        network.double(),
        action_shape=(3,),
        options=SamplerOptions(num_denoising_steps=4, sde_mode="all"),
    )
    data = collect(policy, (2, 5))
    assert data["action"].shape == (2, 5, 3) and data[CHAIN].shape == (2, 5, 5, 3)
    data["advantage"] = non_uniform_advantage((2, 5))
    loss = DenoisingClipPPOLoss(policy, kl_coeff=0.1)
    out = loss(data)
    assert out["log_prob_drift"] <= 1e-8
    assert out["num_stochastic_steps"] == 2 * 5 * 3
    torch.testing.assert_close(out["loss_objective"], -data["advantage"].mean())
    (out["loss_objective"] + out["loss_kl"]).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in network_parameters(policy))


def test_self_imitation_of_a_single_step_policy_equals_that_of_a_one_row_chunk():
    # The same network as a single-step policy (action [*B, D]) and as a chunk policy of one
    # row (action [*B, 1, D]): the self-imitation error is the same at the same seed.
    torch.manual_seed(0)
    network = MLPVelocityNetwork(OBSERVATION_DIM, (1, 3), hidden_dim=32, num_layers=2).double()
    single = FlowSDEPolicy(
        network, action_shape=(3,), options=SamplerOptions(num_denoising_steps=4, sde_mode="all")
    )
    chunk = FlowSDEPolicy(
        network, action_shape=(1, 3), options=SamplerOptions(num_denoising_steps=4, sde_mode="all")
    )
    data = collect(single, (6,))
    data["advantage"] = non_uniform_advantage((6,))
    data["success"] = torch.tensor([True, False, True, True, False, False])
    chunk_data = data.clone()
    chunk_data["action"] = data["action"].unsqueeze(-2)
    chunk_data[CHAIN] = data[CHAIN].unsqueeze(-2)
    losses = []
    for policy, batch in ((single, data), (chunk, chunk_data)):
        torch.manual_seed(11)
        losses.append(DenoisingClipPPOLoss(policy, bc_coeff=0.5)(batch)["loss_bc"])
    assert losses[0] > 0
    torch.testing.assert_close(losses[0], losses[1], atol=0, rtol=0)
    with pytest.raises(ValueError, match="single-step action shape"):
        flow_matching_per_sample(single, data, data["action"].unsqueeze(-2))


# ---------------------------------------------------------------------------- entropy, drift
def test_a_positive_entropy_coeff_is_honoured_as_clip_ppo_loss_honours_it():
    policy = make_policy()
    data = collect(policy, (16,))
    data["advantage"] = non_uniform_advantage((16,))
    out = DenoisingClipPPOLoss(policy, entropy_coeff=0.01)(data)
    # The bonus is on without entropy_bonus=True: -entropy_coeff * the steps' mean entropy.
    assert out["loss_entropy"].item() != 0.0
    torch.testing.assert_close(out["loss_entropy"], -0.01 * out["entropy"])
    # Without a coefficient (or with 0) nothing is added, as before.
    for options in ({}, {"entropy_coeff": 0.0}):
        assert DenoisingClipPPOLoss(policy, **options)(data)["loss_entropy"].item() == 0.0


def test_a_positive_entropy_coeff_with_the_bonus_off_is_refused_by_name():
    policy = make_policy()
    with pytest.raises(ValueError, match=r"entropy_coeff=0\.01 > 0 with entropy_bonus=False"):
        DenoisingClipPPOLoss(policy, entropy_coeff=0.01, entropy_bonus=False)
    DenoisingClipPPOLoss(policy, entropy_coeff=0.0, entropy_bonus=False)  # consistent: accepted


def test_the_drift_alarm_is_relative_to_the_largest_stored_log_prob():
    policy = make_policy()
    data = collect(policy, (32,))
    data["advantage"] = non_uniform_advantage((32,))
    loss = DenoisingClipPPOLoss(policy)
    fresh = loss(data)
    stored = data[STEP_LOG_PROB][data[SDE_MASK]]
    assert fresh["log_prob_drift_relative"] <= 1e-12  # float64: rounding only
    perturb(policy)
    moved = loss(data)
    scale = max(1.0, stored.abs().max().item())
    torch.testing.assert_close(
        moved["log_prob_drift_relative"], moved["log_prob_drift"] / scale, rtol=1e-12, atol=0
    )
    assert moved["log_prob_drift_relative"] > 1e-3
    assert "log_prob_drift_relative" in loss.out_keys
