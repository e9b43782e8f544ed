"""FlowSDEPolicy over LeRobot's own pi0, pi0.5 and SmolVLA (tiny random models, offline).

Exact against LeRobot's ``sample_actions`` on the same noise, zero rescoring drift in both
storage modes, PPO moving the action expert and not a frozen VLM, and a fine-tuned policy
saved with LeRobot's ``save_pretrained`` whose reload LeRobot's ``select_action`` runs.
"""

from __future__ import annotations

import contextlib
import doctest
import re
from pathlib import Path

import pytest

pytest.importorskip("lerobot")

import torch  # noqa: E402
from bridge_helpers import (  # noqa: E402
    ACTION_DIM,
    as_tensordict,
    build,
    lerobot_batch,
    reference_actions,
)
from torchrl.envs.utils import ExplorationType, set_exploration_type

from torchrl_flowpolicy.integrations import lerobot as bridge_module
from torchrl_flowpolicy.integrations import lerobot_models
from torchrl_flowpolicy.integrations.lerobot import flow_policy_from_lerobot
from torchrl_flowpolicy.objectives import DenoisingClipPPOLoss
from torchrl_flowpolicy.sampler import SamplerOptions

BATCH = 3


def is_vlm(name: str) -> bool:
    """Whether a parameter of a LeRobot policy belongs to its VLM (not the action expert)."""
    return (
        ".paligemma_with_expert.paligemma." in f".{name}" or ".vlm_with_expert.vlm." in f".{name}"
    )


def rollout(bridge, td):
    with set_exploration_type(ExplorationType.RANDOM):
        return bridge.actor(td)


def test_ode_equals_lerobot_sample_actions(kind, tmp_path):
    lerobot_policy = build(kind, tmp_path)
    bridge = flow_policy_from_lerobot(lerobot_policy)
    batch = lerobot_batch(BATCH)
    chunk_shape = bridge.policy.action_shape
    assert tuple(chunk_shape) == (4, 8)  # LeRobot's chunk, padded to max_action_dim
    noise = torch.randn(BATCH, *chunk_shape)
    reference = reference_actions(lerobot_policy, batch, noise.clone())
    ours = bridge.policy.decode(as_tensordict(batch), noise)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
    # The noise-free chunk (x_0 = 0) is LeRobot's from zero noise.
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        noise_free = bridge.actor(as_tensordict(batch))["action"]
    zero = reference_actions(lerobot_policy, batch, torch.zeros(BATCH, *chunk_shape))
    torch.testing.assert_close(noise_free, zero, atol=1e-5, rtol=0)
    assert (noise_free - ours).abs().max() > 1e-3  # the two checks saw different chunks


def test_rollout_at_zero_noise_level_is_lerobot_sampler(kind, tmp_path):
    lerobot_policy = build(kind, tmp_path)
    bridge = flow_policy_from_lerobot(
        lerobot_policy,
        options=SamplerOptions(
            num_denoising_steps=10, eval_num_denoising_steps=10, noise_level=0.0
        ),
    )
    batch = lerobot_batch(BATCH)
    td = rollout(bridge, as_tensordict(batch))
    chain = td["flow", "chain"]
    reference = reference_actions(lerobot_policy, batch, chain[:, 0].clone())
    torch.testing.assert_close(chain[:, -1], reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("context", ["inputs", "cache"])
@pytest.mark.parametrize("sde_mode", ["mixed", "all"])
def test_stored_log_probs_rescore_without_drift(kind, context, sde_mode, tmp_path):
    """Mixed mode rescores the rollout's batch of decisions in one call of the same size: the
    log-probs are bitwise equal. "all" rescores 3 steps x 3 decisions in one call of 9, where
    the matrix products round differently: equal to float precision."""
    lerobot_policy = build(kind, tmp_path)
    options = SamplerOptions(num_denoising_steps=4, sde_mode=sde_mode)
    bridge = flow_policy_from_lerobot(lerobot_policy, context=context, options=options)
    tolerance = 0.0 if sde_mode == "mixed" else 1e-5
    td = rollout(bridge, as_tensordict(lerobot_batch(BATCH)))
    stored = td["flow", "step_log_prob"]
    assert bool(td["flow", "sde_mask"].any()) and bool((stored != 0).any())
    if context == "cache":
        keys = td["prefix_cache", "keys"]
        assert keys.shape[:2] == (BATCH, 2) and keys.dtype == torch.float32
        # The stored cache is the prefix of each decision.
        with torch.no_grad():
            recomputed = bridge.prefix(*[td[key] for key in bridge.observation_keys.values()])
        torch.testing.assert_close(keys, recomputed[-2], atol=0, rtol=0)
    torch.testing.assert_close(bridge.policy.log_prob(td), stored, atol=tolerance, rtol=0)
    td["advantage"] = torch.randn(BATCH, 1)
    out = DenoisingClipPPOLoss(bridge.policy)(td)
    assert float(out["log_prob_drift"]) <= tolerance
    assert abs(float(out["mean_ratio"]) - 1) <= tolerance
    assert abs(float(out["max_ratio"]) - 1) <= tolerance


def test_padded_action_columns_are_not_scored(kind, tmp_path):
    bridge = flow_policy_from_lerobot(build(kind, tmp_path))
    assert bridge.action_dim == ACTION_DIM
    assert bridge.policy.sampler.action_mask.tolist() == [True] * ACTION_DIM + [False] * 5
    td = rollout(bridge, as_tensordict(lerobot_batch(BATCH)))
    # sde_mode="mixed": one stochastic step k per decision; move a column of its sample x_(k+1).
    step = td["flow", "sde_mask"].int().argmax(-1)
    decisions = torch.arange(BATCH)

    def rescored(column: int) -> torch.Tensor:
        moved = td.clone()
        chain = moved["flow", "chain"].clone()
        chain[decisions, step + 1, :, column] += 1.0
        moved["flow", "chain"] = chain
        return bridge.policy.log_prob(moved).sum(-1)

    torch.testing.assert_close(rescored(ACTION_DIM), td["action_log_prob"], atol=0, rtol=0)
    assert bool(((rescored(0) - td["action_log_prob"]).abs() > 1e-3).all())


@pytest.mark.parametrize("context", ["inputs", "cache"])
def test_ppo_step_moves_the_expert_not_a_frozen_vlm(kind, context, tmp_path):
    lerobot_policy = build(kind, tmp_path, train_expert_only=True)
    bridge = flow_policy_from_lerobot(lerobot_policy, context=context)
    assert sum(p.numel() for p in bridge.policy.parameters()) == sum(
        p.numel() for p in lerobot_policy.parameters()
    )  # the LeRobot weights are the policy's, counted once
    td = rollout(bridge, as_tensordict(lerobot_batch(BATCH)))
    td["advantage"] = torch.randn(BATCH, 1)
    before = {name: p.detach().clone() for name, p in lerobot_policy.named_parameters()}
    optimiser = torch.optim.Adam(
        [p for p in bridge.policy.parameters() if p.requires_grad], lr=1e-2
    )
    DenoisingClipPPOLoss(bridge.policy)(td)["loss_objective"].backward()
    optimiser.step()
    changed = {n for n, p in lerobot_policy.named_parameters() if not torch.equal(before[n], p)}
    assert changed and not any(is_vlm(name) for name in changed)
    assert any("action_out_proj" in name for name in changed)
    assert any(".gemma_expert." in name or ".lm_expert." in name for name in changed)


def test_context_grad_reaches_a_trainable_vlm(kind, tmp_path):
    lerobot_policy = build(kind, tmp_path, train_expert_only=False)
    bridge = flow_policy_from_lerobot(lerobot_policy)
    td = rollout(bridge, as_tensordict(lerobot_batch(BATCH)))
    td["advantage"] = torch.randn(BATCH, 1)
    for context_grad in (False, True):
        lerobot_policy.zero_grad(set_to_none=True)
        loss = DenoisingClipPPOLoss(bridge.policy, context_grad=context_grad)
        loss(td)["loss_objective"].backward()
        vlm_grads = [
            p.grad for n, p in lerobot_policy.named_parameters() if is_vlm(n) and p.grad is not None
        ]
        assert bool(vlm_grads) == context_grad
        assert not context_grad or any(bool(g.abs().sum() > 0) for g in vlm_grads)


def test_uint8_images_are_scaled_as_lerobot_does(kind, tmp_path):
    bridge = flow_policy_from_lerobot(build(kind, tmp_path))
    batch = lerobot_batch(BATCH)
    pixels = (batch["observation.images.top"] * 255).round().to(torch.uint8)
    as_float = dict(batch, **{"observation.images.top": pixels.float() / 255})
    as_uint8 = dict(batch, **{"observation.images.top": pixels})
    noise = torch.randn(BATCH, *bridge.policy.action_shape)
    torch.testing.assert_close(
        bridge.policy.decode(as_tensordict(as_uint8), noise),
        bridge.policy.decode(as_tensordict(as_float), noise),
        atol=0,
        rtol=0,
    )


def test_lerobot_reloads_the_fine_tuned_policy(kind, tmp_path):
    lerobot_policy = build(kind, tmp_path, train_expert_only=True)
    bridge = flow_policy_from_lerobot(lerobot_policy)
    batch = lerobot_batch(BATCH)
    chunk_shape = (BATCH, *bridge.policy.action_shape)
    torch.manual_seed(7)
    noise = lerobot_policy.model.sample_noise(chunk_shape, "cpu")  # LeRobot's own noise
    start = bridge.policy.decode(as_tensordict(batch), noise)[..., :ACTION_DIM]
    td = rollout(bridge, as_tensordict(batch))
    td["advantage"] = torch.randn(BATCH, 1)
    optimiser = torch.optim.Adam(
        [p for p in bridge.policy.parameters() if p.requires_grad], lr=1e-2
    )
    DenoisingClipPPOLoss(bridge.policy)(td)["loss_objective"].backward()
    optimiser.step()

    lerobot_policy.save_pretrained(tmp_path / "fine_tuned")
    sizes = contextlib.nullcontext()
    if kind != "smolvla":  # the saved configuration names the variants, not the tiny sizes
        sizes = lerobot_models.lerobot_sizes(lerobot_models.ModelSizes())
    with sizes:
        reloaded = type(lerobot_policy).from_pretrained(tmp_path / "fine_tuned")
    reloaded.reset()
    torch.manual_seed(7)  # select_action draws its noise with sample_noise, as above
    selected = torch.stack(
        [reloaded.select_action(dict(batch)) for _ in range(reloaded.config.n_action_steps)], 1
    )
    fine_tuned = bridge.policy.decode(as_tensordict(batch), noise)[..., :ACTION_DIM]
    assert selected.shape == fine_tuned.shape == (BATCH, 4, ACTION_DIM)
    torch.testing.assert_close(selected, fine_tuned, atol=1e-5, rtol=0)
    assert (start - fine_tuned).abs().max() > 1e-4  # the step changed the chunks


def test_bf16_backbone_samples_and_scores_in_float32(kind, tmp_path):
    """LeRobot's bf16 option (pi0 / pi0.5 ``dtype="bfloat16"``; SmolVLA's VLM in bf16, as
    ``load_vlm_weights`` loads it): the sampler calls ``denoise_step`` in float32 as LeRobot's
    own sampler does, the log-probabilities are float32. The chunk matches LeRobot's to bf16
    precision (measured: 2.4e-7 for pi0 and SmolVLA, 1.5e-5 for pi0.5)."""
    lerobot_policy = build(kind, tmp_path, **({} if kind == "smolvla" else {"dtype": "bfloat16"}))
    if kind == "smolvla":
        lerobot_policy.model.vlm_with_expert.vlm.to(torch.bfloat16)
    assert torch.bfloat16 in {p.dtype for p in lerobot_policy.parameters()}
    bridge = flow_policy_from_lerobot(lerobot_policy)
    batch = lerobot_batch(BATCH)
    noise = torch.randn(BATCH, *bridge.policy.action_shape)
    reference = reference_actions(lerobot_policy, batch, noise.clone())
    ours = bridge.policy.decode(as_tensordict(batch), noise)
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)
    td = rollout(bridge, as_tensordict(batch))
    assert td["action_log_prob"].dtype == td["flow", "chain"].dtype == torch.float32
    assert torch.equal(bridge.policy.log_prob(td), td["flow", "step_log_prob"])


def test_module_examples_run():
    for module in (bridge_module, lerobot_models):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0


def test_lerobot_page_code_runs():
    """docs/lerobot.md's python blocks, in order in one namespace (the main environment's
    page test skips this page: it needs lerobot)."""
    page = Path(__file__).resolve().parents[2] / "docs" / "lerobot.md"
    blocks = re.findall(r"^```python[^\n]*\n(.*?)^```", page.read_text(), re.MULTILINE | re.DOTALL)
    assert blocks
    namespace: dict = {"__name__": "docs_lerobot"}
    for index, block in enumerate(blocks):
        exec(compile(block, f"docs/lerobot.md (python block {index})", "exec"), namespace)
