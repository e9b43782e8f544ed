"""Reliability: every bad input gets a clear error, no silent NaN reaches the weights.

One test (or one parametrised case) per class of bad input listed in ``docs/reliability.md``:
sampler parameters, velocity networks, the stored data the PPO loss reads, loss options,
batches without stochastic steps or without decisions, DSRL noise and checkpoints. The last
section holds property-based tests (hypothesis, a bounded number of examples) of the flow
math and of the policy/loss contract.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torchrl.envs.utils import ExplorationType, set_exploration_type

from torchrl_flowpolicy import FlowSDEPolicy, flow
from torchrl_flowpolicy.dsrl import NOISE_KEY, NoiseActionTransform, NoiseDecoder
from torchrl_flowpolicy.networks import MLPVelocityNetwork
from torchrl_flowpolicy.objectives import DenoisingClipPPOLoss
from torchrl_flowpolicy.sampler import SamplerOptions
from torchrl_flowpolicy.training.checkpoint import atomic_write, load_checkpoint, save_checkpoint

OBSERVATION_DIM = 5
ACTION_SHAPE = (4, 2)
CHAIN = ("flow", "chain")
SDE_MASK = ("flow", "sde_mask")
STEP_LOG_PROB = ("flow", "step_log_prob")
RANDOM = ExplorationType.RANDOM
DETERMINISTIC = ExplorationType.DETERMINISTIC
DIAGNOSTICS = ("clip_fraction", "kl_approx", "ESS", "mean_ratio", "max_ratio", "entropy")


def make_network(action_shape=ACTION_SHAPE, dtype=torch.float32) -> MLPVelocityNetwork:
    torch.manual_seed(0)
    network = MLPVelocityNetwork(OBSERVATION_DIM, action_shape, hidden_dim=16, num_layers=1)
    return network.to(dtype)


SAMPLER_FIELDS = {field.name for field in dataclasses.fields(SamplerOptions)}


def make_policy(**settings) -> FlowSDEPolicy:
    """A policy of K = 4 steps; ``settings`` are SamplerOptions fields or policy arguments."""
    options = {"num_denoising_steps": 4} | {
        name: value for name, value in settings.items() if name in SAMPLER_FIELDS
    }
    arguments = {name: value for name, value in settings.items() if name not in SAMPLER_FIELDS}
    return FlowSDEPolicy(
        make_network(), action_shape=ACTION_SHAPE, options=SamplerOptions(**options), **arguments
    )


def collect(policy: FlowSDEPolicy, batch_size: int = 6, *, seed: int = 1) -> TensorDict:
    torch.manual_seed(seed)
    observation = torch.randn(batch_size, OBSERVATION_DIM, dtype=policy.network_dtype)
    data = TensorDict({"observation": observation}, batch_size=[batch_size])
    with set_exploration_type(RANDOM):
        data = policy(data)
    data["advantage"] = torch.randn(batch_size, 1, dtype=policy.network_dtype)
    return data


def key_pattern(key) -> str:
    return re.escape(repr(key))


# ---------------------------------------------------------------------------- sampler
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"noise_level": float("nan")}, "noise_level"),
        ({"noise_level": float("inf")}, "noise_level"),
        ({"noise_level": -0.5}, "noise_level"),
        ({"shift": float("inf")}, "shift"),
        ({"shift": float("nan")}, "shift"),
        ({"shift": -1.0}, "shift"),
        ({"num_denoising_steps": -3}, "num_denoising_steps"),
        ({"num_denoising_steps": 2.5}, "num_denoising_steps"),
        ({"num_denoising_steps": 0, "sde_mode": "all"}, "num_denoising_steps"),
        ({"eval_num_denoising_steps": 2.5}, "eval_num_denoising_steps"),
        ({"eval_num_denoising_steps": -1}, "eval_num_denoising_steps"),
        ({"num_sde_steps": 1.5, "sde_mode": "last"}, "num_sde_steps"),
        ({"num_sde_steps": 0, "sde_mode": "last"}, "num_sde_steps"),
    ],
)
def test_bad_sampler_parameters_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_policy(**kwargs)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("noise_level", float("nan")),
        ("noise_level", -1.0),
        ("shift", float("inf")),
        ("num_denoising_steps", 2.5),
        ("num_denoising_steps", -3),
        ("num_denoising_steps", 1),  # mixed mode needs K >= 2
        ("eval_num_denoising_steps", 0),
        ("sde_mode", "first"),
        ("noise_schedule", "cosine"),
    ],
)
def test_bad_sampler_parameters_are_refused_when_set(name, value):
    policy = make_policy()
    before = policy.options
    with pytest.raises(ValueError, match=name):
        policy.options = policy.options.replace(**{name: value})
    assert policy.options == before  # refused: the policy keeps its valid setting
    assert policy.sampler.options is before
    collect(policy)  # and still samples


def test_a_valid_setting_changes_the_schedule():
    policy = make_policy()
    policy.options = policy.options.replace(noise_level=0.25, num_denoising_steps=6)
    schedule = policy.sampler.schedule(6, torch.float32, torch.device("cpu"))
    assert schedule.num_denoising_steps == 6
    assert schedule.std.max() < make_policy().sampler.schedule(6, torch.float32, None).std.max()
    assert collect(policy)[CHAIN].shape[1] == 7


def test_a_sigma_grid_that_collapses_in_the_working_dtype_is_refused():
    # shift 1e8 at K = 8: 1 - sigma_1 is about 1e-9, below float32's resolution at 1.
    assert (flow.sigma_grid(8, 1e8, dtype=torch.float64).diff() < 0).all()
    with pytest.raises(ValueError, match=r"shift=1e\+08.*num_denoising_steps=8.*float32"):
        flow.sampling_schedule(8, 0.5, 1e8, dtype=torch.float32)
    flow.sampling_schedule(8, 0.5, 1e8, dtype=torch.float64)  # fine in float64
    with pytest.raises(ValueError, match="shift"):
        make_policy(num_denoising_steps=8, shift=1e8)
    with (
        pytest.raises(ValueError, match="eval_num_denoising_steps=40.*shift"),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")  # the rollout grid's step 1 explodes (a warning)
        make_policy(
            num_denoising_steps=2, eval_num_denoising_steps=40, shift=2e7
        )  # the evaluation grid too
    policy = make_policy(num_denoising_steps=8)
    with pytest.raises(ValueError, match="shift"):
        policy.options = policy.options.replace(shift=1e8)


def test_exploding_steps_warn_and_default_settings_do_not():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_policy(num_denoising_steps=8, noise_level=0.5, sde_mode="all")
        make_policy(
            num_denoising_steps=8, noise_level=2.0, sde_mode="all"
        )  # coefficient -1: at the limit
    coefficient = 1 - 5.0**2 / 2  # step 1 of a uniform grid: 1 - a^2 / 2 whatever K
    with pytest.warns(UserWarning, match=rf"noise_level=5.0.*{coefficient}"):
        make_policy(num_denoising_steps=8, noise_level=5.0, sde_mode="all")
    policy = make_policy(num_denoising_steps=8)
    with pytest.warns(UserWarning, match="noise_level"):
        policy.options = policy.options.replace(noise_level=5.0)
    # "last" mode warns only about the steps it makes stochastic (the last, tame ones here).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_policy(num_denoising_steps=8, noise_level=3.0, sde_mode="last", num_sde_steps=1)


def test_a_network_built_for_another_chunk_shape_is_refused():
    with pytest.raises(ValueError, match=r"action_shape \(4, 2\).*\(2, 4\)"):
        FlowSDEPolicy(make_network((4, 2)), action_shape=(2, 4))


def test_a_network_returning_a_non_tensor_names_the_expected_shape():
    network = make_network()
    policy = FlowSDEPolicy(
        lambda x, sigma, context: (network(x, sigma, context),), action_shape=(4, 2)
    )
    observation = TensorDict({"observation": torch.randn(3, OBSERVATION_DIM)}, [3])
    for mode in (RANDOM, DETERMINISTIC):
        with set_exploration_type(mode), pytest.raises(TypeError, match=r"tuple.*\(3, 4, 2\)"):
            policy(observation.clone())


# ---------------------------------------------------------------------------- loss: stored data
def _first_stochastic(data: TensorDict) -> tuple[int, int]:
    decision, step = data[SDE_MASK].nonzero()[0].tolist()
    return decision, step


def _tamper(data: TensorDict, what: str) -> TensorDict:
    decision, step = _first_stochastic(data)
    if what == "old_log_prob_-inf":
        data[STEP_LOG_PROB][decision, step] = -math.inf
    elif what == "old_log_prob_nan":
        data[STEP_LOG_PROB][decision, step] = math.nan
    elif what == "advantage_nan":
        data["advantage"][decision] = math.nan
    elif what == "advantage_inf":
        data["advantage"][decision] = math.inf
    elif what == "sample_nan":  # the stored x_{k+1} of a stochastic step
        data[CHAIN][decision, step + 1, 0, 0] = math.nan
    elif what == "input_nan":  # the stored x_k of a stochastic step
        data[CHAIN][decision, step, 0, 0] = math.nan
    return data


@pytest.mark.parametrize(
    ("what", "key"),
    [
        ("old_log_prob_-inf", STEP_LOG_PROB),
        ("old_log_prob_nan", STEP_LOG_PROB),
        ("advantage_nan", "advantage"),
        ("advantage_inf", "advantage"),
        ("sample_nan", CHAIN),
        ("input_nan", CHAIN),
    ],
)
def test_non_finite_stored_data_is_refused_before_any_gradient(what, key):
    policy = make_policy()
    loss = DenoisingClipPPOLoss(policy)
    data = _tamper(collect(policy), what)
    with pytest.raises(ValueError, match=rf"{key_pattern(key)}.*not finite"):
        loss(data)
    assert all(parameter.grad is None for parameter in policy.parameters())


def test_non_finite_data_of_a_masked_out_decision_are_refused_too():
    # TorchRL's validity mask drops a padded decision from the loss's value, not from its
    # gradient: 0 * NaN is NaN. Without the check the loss is finite and every gradient NaN.
    policy = make_policy(sde_mode="all")
    data = collect(policy)
    valid = torch.ones(6, dtype=torch.bool)
    valid[5] = False
    data["collector", "mask"] = valid
    data[STEP_LOG_PROB][5, 2] = math.nan
    with pytest.raises(ValueError, match=rf"{key_pattern(STEP_LOG_PROB)}.*not finite"):
        DenoisingClipPPOLoss(policy)(data)
    out = DenoisingClipPPOLoss(policy, check_data=False)(data)
    out["loss_objective"].backward()
    assert torch.isfinite(out["loss_objective"])
    assert not all(torch.isfinite(p.grad).all() for p in policy.parameters())


def test_non_finite_entries_the_loss_does_not_read_are_ignored():
    policy = make_policy()
    data = collect(policy)
    data[STEP_LOG_PROB][~data[SDE_MASK]] = math.nan  # deterministic steps: never read
    out = DenoisingClipPPOLoss(policy)(data)
    assert torch.isfinite(out["loss_objective"])


def test_an_advantage_that_overflows_the_loss_is_refused():
    policy = make_policy()
    data = collect(policy)
    data["advantage"] = torch.full_like(data["advantage"], -1e38)
    with pytest.raises(ValueError, match="loss_objective is not finite.*advantage"):
        DenoisingClipPPOLoss(policy)(data)


def test_a_mask_marking_step_zero_is_refused():
    policy = make_policy()
    data = collect(policy)
    data[SDE_MASK][0, 0] = True
    with pytest.raises(ValueError, match=rf"{key_pattern(SDE_MASK)}.*step 0"):
        DenoisingClipPPOLoss(policy)(data)
    with pytest.raises(ValueError, match=rf"{key_pattern(SDE_MASK)}.*step 0"):
        policy.log_prob(data)


def test_check_data_false_skips_the_data_checks():
    policy = make_policy()
    data = _tamper(collect(policy), "old_log_prob_nan")
    out = DenoisingClipPPOLoss(policy, check_data=False)(data)
    assert torch.isnan(out["loss_objective"])


@pytest.mark.parametrize(
    "clip_epsilon", [1.5, 1.0, 0.0, -0.1, float("nan"), (0.2, float("nan")), (1.2, 0.2)]
)
def test_clip_epsilon_outside_its_range_is_refused(clip_epsilon):
    with pytest.raises(ValueError, match="clip_epsilon"):
        DenoisingClipPPOLoss(make_policy(), clip_epsilon=clip_epsilon)


# ---------------------------------------------------------------------------- no stochastic step
def _no_stochastic_step_data(how: str) -> tuple[FlowSDEPolicy, TensorDict]:
    if how == "noise_level_0":
        policy = make_policy(noise_level=0.0)
        return policy, collect(policy)
    policy = make_policy()
    data = collect(policy)
    data[SDE_MASK] = torch.zeros_like(data[SDE_MASK])
    data[STEP_LOG_PROB] = torch.zeros_like(data[STEP_LOG_PROB])
    return policy, data


@pytest.mark.parametrize("how", ["noise_level_0", "all_false_mask"])
def test_diagnostics_are_finite_without_a_stochastic_step(how):
    policy, data = _no_stochastic_step_data(how)
    loss = DenoisingClipPPOLoss(policy, kl_coeff=0.1, entropy_bonus=True, entropy_coeff=0.01)
    out = loss(data)
    expected = {
        "loss_objective": 0.0,
        "loss_kl": 0.0,
        "loss_entropy": 0.0,
        "clip_fraction": 0.0,
        "kl_approx": 0.0,
        "kl_reference": 0.0,
        "ESS": 1.0,
        "mean_ratio": 1.0,
        "max_ratio": 1.0,
        "entropy": 0.0,
        "log_prob_drift": 0.0,
        "num_stochastic_steps": 0,
    }
    assert {name: out[name].item() for name in expected} == expected
    out["loss_objective"].backward()  # a zero objective with a (zero) gradient path


# ---------------------------------------------------------------------------- empty batches
@pytest.mark.parametrize("single_step", [False, True])
def test_an_empty_batch_samples_empty_entries(single_step):
    action_shape = (2,) if single_step else ACTION_SHAPE
    network = make_network((1, 2) if single_step else ACTION_SHAPE)
    policy = FlowSDEPolicy(
        network, action_shape=action_shape, options=SamplerOptions(num_denoising_steps=4)
    )
    empty = TensorDict({"observation": torch.randn(0, OBSERVATION_DIM)}, batch_size=[0])
    with set_exploration_type(RANDOM):
        out = policy(empty.clone())
    assert out["action"].shape == (0, *action_shape)
    assert out[CHAIN].shape == (0, 5, *action_shape)
    assert out[SDE_MASK].shape == out[STEP_LOG_PROB].shape == (0, 4)
    assert out["action_log_prob"].shape == (0,)
    assert policy.log_prob(out).shape == (0, 4)
    with set_exploration_type(DETERMINISTIC):
        assert policy(empty.clone())["action"].shape == (0, *action_shape)
    noise = torch.zeros(0, *action_shape)
    assert policy.decode(empty, noise).shape == (0, *action_shape)


@pytest.mark.parametrize("normalize_advantage", [False, True])
def test_the_loss_of_an_empty_batch_is_zero(normalize_advantage):
    policy = make_policy()
    data = collect(policy, batch_size=0)
    loss = DenoisingClipPPOLoss(policy, normalize_advantage=normalize_advantage)
    out = loss(data)
    assert out["loss_objective"].item() == 0.0
    assert all(torch.isfinite(out[name]) for name in DIAGNOSTICS)
    out["loss_objective"].backward()


# ---------------------------------------------------------------------------- DSRL
def _dsrl_input(policy: FlowSDEPolicy, noise: torch.Tensor, key="action") -> TensorDict:
    observation = torch.randn(noise.shape[0], OBSERVATION_DIM)
    return TensorDict({"observation": observation, key: noise}, batch_size=noise.shape[:1])


@pytest.mark.parametrize("value", [100.0, -1e6, 1.5 * 1.001])
def test_dsrl_noise_outside_its_bound_is_refused(value):
    transform = NoiseActionTransform(make_policy(), noise_bound=1.5)
    noise = torch.zeros(3, *ACTION_SHAPE)
    noise[1, 2, 0] = value
    with pytest.raises(ValueError, match=r"'action'.*outside.*noise_bound=1\.5"):
        transform.inv(_dsrl_input(transform.policy, noise))
    # At the bound itself (a squashed actor's extreme), the noise is decoded.
    noise[1, 2, 0] = math.copysign(1.5, value)
    assert transform.inv(_dsrl_input(transform.policy, noise))["action"].shape == (3, 4, 2)


def test_dsrl_non_finite_noise_names_the_noise_key():
    policy = make_policy()
    noise = torch.zeros(3, *ACTION_SHAPE)
    noise[2, 0, 1] = math.nan
    transform = NoiseActionTransform(policy)
    with pytest.raises(ValueError, match=r"'action'.*not finite"):
        transform.inv(_dsrl_input(policy, noise))
    with pytest.raises(ValueError, match=rf"{key_pattern(NOISE_KEY)}.*not finite"):
        NoiseDecoder(policy)(_dsrl_input(policy, noise, NOISE_KEY))
    with pytest.raises(ValueError, match="initial_noise.*not finite"):
        policy.decode(_dsrl_input(policy, noise), noise)


# ---------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_corrupt_checkpoint_is_named_corrupt(tmp_path, damage):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint({"step": 3, "weights": torch.randn(1000)}, path)
    content = path.read_bytes()
    damaged = {
        "truncated": content[: len(content) // 2],
        "garbage": os.urandom(len(content)),
        "empty": b"",
    }[damage]
    path.write_bytes(damaged)
    with pytest.raises(ValueError, match=rf"checkpoint at {re.escape(str(path))} is corrupt"):
        load_checkpoint(path)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="simulates a killed save with os.fork")
def test_orphan_temporary_files_of_a_killed_save_are_removed(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint({"step": 1}, path)

    def killed(file):  # the process dies mid-write: no cleanup runs
        file.write(b"partial")
        file.flush()
        os._exit(0)

    def kill_a_save():
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            atomic_write(path, killed)
        os.waitpid(pid, 0)

    kill_a_save()
    # A temporary file of the earlier naming (no writer recorded), and another file's.
    (tmp_path / ".checkpoint.pt.k3j2h1ab.tmp").write_bytes(b"old orphan")
    (tmp_path / ".other.pt.k3j2h1ab.tmp").write_bytes(b"another file's")
    assert len(list(tmp_path.glob(".checkpoint.pt.*.tmp"))) == 2
    assert load_checkpoint(path)["step"] == 1  # loading cleans up
    assert not list(tmp_path.glob(".checkpoint.pt.*.tmp"))
    kill_a_save()
    assert len(list(tmp_path.glob(".checkpoint.pt.*.tmp"))) == 1
    save_checkpoint({"step": 2}, path)  # so does saving
    assert sorted(os.listdir(tmp_path)) == [".other.pt.k3j2h1ab.tmp", "checkpoint.pt"]
    assert load_checkpoint(path)["step"] == 2


def test_a_save_in_progress_is_not_taken_for_an_orphan(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint({"step": 1}, path)

    def write(file):  # another load of the same checkpoint runs while this save writes
        assert load_checkpoint(path)["step"] == 1
        torch.save({"step": 2}, file)

    atomic_write(path, write)
    assert load_checkpoint(path)["step"] == 2


# ---------------------------------------------------------------------------- properties
PROPERTY_SETTINGS = settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def sampler_settings(draw):
    num_denoising_steps = draw(st.integers(2, 10))
    mode = draw(st.sampled_from(["mixed", "last", "all"]))
    return {
        "num_denoising_steps": num_denoising_steps,
        "eval_num_denoising_steps": draw(st.integers(1, 12)),
        "sde_mode": mode,
        "num_sde_steps": draw(st.integers(1, num_denoising_steps - 1)),
        "noise_level": draw(st.sampled_from([0.0]) | st.floats(0.05, 1.5)),
        "noise_schedule": draw(st.sampled_from(["sqrt", "constant"])),
        "shift": 10 ** draw(st.floats(-1.0, 9.0)),
        "dtype": draw(st.sampled_from([torch.float32, torch.float64])),
        "action_shape": (draw(st.integers(1, 3)), draw(st.integers(1, 3))),
        "batch_size": draw(st.integers(0, 4)),
    }


@PROPERTY_SETTINGS
@given(sampler_settings())
def test_property_log_probs_are_finite_and_fresh_ratios_are_one(options):
    dtype, batch_size = options.pop("dtype"), options.pop("batch_size")
    action_shape = options.pop("action_shape")
    network = make_network(action_shape, dtype)
    probability_dtype = flow.probability_dtype(dtype)
    steps = (options["num_denoising_steps"], options["eval_num_denoising_steps"])
    shift = options["shift"]
    grids = [  # the shifted grids in the chain's dtype, computed here, unchecked
        (shift * sigma / (1 + (shift - 1) * sigma)).to(probability_dtype)
        for sigma in (1 - torch.arange(k + 1, dtype=torch.float64) / k for k in steps)
    ]
    if not all((grid.diff() < 0).all() for grid in grids):
        with pytest.raises(ValueError, match="shift"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the step warning may come first
            FlowSDEPolicy(network, action_shape=action_shape, options=SamplerOptions(**options))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # large steps warn; they must stay finite anyway
        policy = FlowSDEPolicy(
            network, action_shape=action_shape, options=SamplerOptions(**options)
        )
    data = collect(policy, batch_size)
    assert torch.isfinite(data[CHAIN]).all() and torch.isfinite(data["action_log_prob"]).all()
    out = DenoisingClipPPOLoss(policy)(data)
    tolerance = 1e-3 if dtype == torch.float32 else 1e-8
    scale = max([1.0, *data[STEP_LOG_PROB].abs().flatten().tolist()])
    assert out["log_prob_drift"].item() <= tolerance * scale
    assert all(torch.isfinite(out[name]) for name in DIAGNOSTICS)
    torch.testing.assert_close(out["mean_ratio"].item(), 1.0, atol=1e-2, rtol=0)


@PROPERTY_SETTINGS
@given(
    num_denoising_steps=st.integers(1, 12),
    shift=st.floats(0.2, 20.0),
    schedule=st.sampled_from(["sqrt", "constant"]),
    shape=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_property_zero_noise_level_is_the_euler_ode(
    num_denoising_steps, shift, schedule, shape, dtype, seed
):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape[-1], shape[-1], generator=generator, dtype=dtype)
    x0 = torch.randn(shape, generator=generator, dtype=dtype)

    def velocity(x, sigma):  # a non-linear, sigma-dependent field
        return torch.tanh(x @ weight) * (1 + sigma[:, None, None])

    schedule_zero = flow.sampling_schedule(num_denoising_steps, 0.0, shift, schedule, dtype=dtype)
    mask = torch.rand(shape[0], num_denoising_steps, generator=generator) < 0.5
    noise = torch.randn(shape[0], num_denoising_steps, *shape[1:], generator=generator, dtype=dtype)
    chain, _, _ = flow.integrate(velocity, x0, schedule_zero, mask, noise)
    sigmas, x = flow.sigma_grid(num_denoising_steps, shift, dtype=dtype), x0
    for k in range(num_denoising_steps):
        x = x + velocity(x, sigmas[k].expand(shape[0])) * (sigmas[k + 1] - sigmas[k])
        torch.testing.assert_close(chain[:, k + 1], x, rtol=0, atol=0)


def test_the_reliability_page_names_existing_tests():
    """Every ``file::test`` that docs/reliability.md cites is a test of that file."""
    root = Path(__file__).resolve().parents[1]
    cited = re.findall(
        r"`(test_\w+\.py)::(test_\w+)`", (root / "docs" / "reliability.md").read_text()
    )
    assert len(cited) > 20
    for file, name in cited:
        assert re.search(rf"^def {name}\(", (root / "tests" / file).read_text(), re.M), (file, name)
