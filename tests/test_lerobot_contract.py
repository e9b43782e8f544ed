"""The LeRobot bridge's contract, without LeRobot: stand-ins with LeRobot's method names.

The stand-ins keep LeRobot 0.6.1's call signatures (keyword names included) and the
structure of its ``sample_actions`` (prefix once, then Euler over ``denoise_step`` from t = 1
to 0), with small attention layers over a per-layer key/value cache, so that a wrong
argument, a lost context row or a misplaced state shows. The bridge takes the helpers
``make_att_2d_masks``, ``prepare_attention_masks_4d`` and ``DynamicCache`` from the module
that defines the model: this one. The real models are tested in ``tests/lerobot_bridge``.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from torchrl.envs.utils import ExplorationType, set_exploration_type

from torchrl_flowpolicy.integrations.lerobot import (
    LeRobotVelocity,
    flow_policy_from_lerobot,
    lerobot_observation_keys,
)
from torchrl_flowpolicy.objectives import DenoisingClipPPOLoss
from torchrl_flowpolicy.sampler import SamplerOptions

CHUNK, MAX_ACTION, ACTION, MAX_STATE, STATE, WIDTH, LAYERS, TOKENS = 3, 4, 2, 4, 3, 8, 2, 5
CAMERA = "observation.images.top"


# ---------------------------------------------------------------- LeRobot's helpers (stand-ins)
def make_att_2d_masks(pad_masks, att_masks):
    cumsum = torch.cumsum(att_masks, dim=1)
    return (cumsum[:, None, :] <= cumsum[:, :, None]) & (
        pad_masks[:, None, :] * pad_masks[:, :, None]
    )


def prepare_attention_masks_4d(att_2d_masks):
    return torch.where(att_2d_masks[:, None], 0.0, -1e9)


class DynamicCache:
    """transformers' cache as SmolVLA uses it: built from (keys, values, sliding) layers."""

    def __init__(self, layers=()):
        self.layers = [SimpleNamespace(keys=k, values=v) for k, v, _ in layers]

    def __iter__(self):
        for layer in self.layers:
            yield layer.keys, layer.values, None

    def crop(self, length):
        for layer in self.layers:
            layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]


# ---------------------------------------------------------------- the stand-in models
class StandInVLM:
    """SmolVLMWithExpertModel / PaliGemmaWithExpertModel: the prefix's ``forward``."""

    def __init__(self, forward):
        self.forward = forward


class StandInModel(nn.Module):
    """A prefix of camera patches and tokens (and SmolVLA's state), one key/value pair per
    layer, and an action expert attending to them."""

    def __init__(self, family: str):
        super().__init__()
        self.family = family
        self.config = SimpleNamespace(chunk_size=CHUNK)
        self.patch_projection = nn.Linear(3, WIDTH)
        self.token_embedding = nn.Embedding(20, WIDTH)
        self.state_proj = nn.Linear(MAX_STATE, WIDTH)
        self.key_projections = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.value_projections = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.action_in_proj = nn.Linear(MAX_ACTION + 1, WIDTH)
        self.action_out_proj = nn.Linear(WIDTH, MAX_ACTION)
        self.prefix_calls = 0
        language_model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
        vlm = StandInVLM(self._vlm_forward)
        if family == "smolvla":
            self.vlm_with_expert = vlm
        else:
            vlm.paligemma = SimpleNamespace(model=SimpleNamespace(language_model=language_model))
            self.paligemma_with_expert = vlm

    def embed_prefix(self, images, img_masks, lang_tokens, lang_masks, state=None):
        self.prefix_calls += 1
        patches = self.patch_projection(images[0].flatten(2).transpose(1, 2))
        embeddings = [patches, self.token_embedding(lang_tokens)]
        pad = [img_masks[0][:, None].expand(-1, patches.shape[1]), lang_masks]
        if self.family == "smolvla":
            embeddings.append(self.state_proj(state)[:, None])
            pad.append(torch.ones_like(lang_masks[:, :1]))
        pad_masks = torch.cat(pad, dim=1)
        return torch.cat(embeddings, dim=1), pad_masks, torch.zeros_like(pad_masks)

    def _vlm_forward(self, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache):
        assert past_key_values is None and use_cache and inputs_embeds[1] is None
        if self.family != "smolvla":  # pi0's 4D additive mask, set to eager first
            language = self.paligemma_with_expert.paligemma.model.language_model
            assert language.config._attn_implementation == "eager"
            assert attention_mask.ndim == 4
        else:
            assert attention_mask.dtype == torch.bool and attention_mask.ndim == 3
        embeddings, positions = inputs_embeds[0], position_ids[..., None].float()
        layers = [
            (key(embeddings + 0.01 * positions)[:, None], value(embeddings)[:, None], None)
            for key, value in zip(self.key_projections, self.value_projections, strict=True)
        ]
        return [None, None], DynamicCache(layers) if self.family == "smolvla" else layers

    def _expert(self, prefix_pad_masks, layers, x_t, timestep, state=None):
        time = timestep[:, None, None].expand(-1, x_t.shape[1], 1)
        query = self.action_in_proj(torch.cat([x_t, time], dim=-1))
        if state is not None:
            query = query + self.state_proj(state)[:, None]
        out = query
        for keys, values, _ in layers:  # layer by layer: their order matters
            scores = out @ keys[:, 0].transpose(1, 2) / WIDTH**0.5
            scores = scores.masked_fill(~prefix_pad_masks[:, None, :], -1e9)
            out = out + scores.softmax(-1) @ values[:, 0]
        return self.action_out_proj(out)

    def sample_actions(
        self, images, img_masks, lang_tokens, lang_masks, state=None, noise=None, num_steps=5
    ):
        """LeRobot's structure: the prefix once, Euler from t = 1 to 0 over ``denoise_step``."""
        prefix_state = state if self.family == "smolvla" else None
        embs, pad_masks, att_masks = self.embed_prefix(
            images, img_masks, lang_tokens, lang_masks, prefix_state
        )
        mask = make_att_2d_masks(pad_masks, att_masks)
        if self.family != "smolvla":
            self.paligemma_with_expert.paligemma.model.language_model.config._attn_implementation = "eager"
            mask = prepare_attention_masks_4d(mask)
        _, cache = self._vlm_forward(mask, torch.cumsum(pad_masks, 1) - 1, None, [embs, None], True)
        x_t, dt = noise, -1.0 / num_steps
        for step in range(num_steps):
            time = torch.full((noise.shape[0],), 1.0 + step * dt)
            inputs = {"state": state} if self.family == "pi0" else {}
            x_t = x_t + dt * self.denoise_step(
                **inputs, prefix_pad_masks=pad_masks, past_key_values=cache, x_t=x_t, timestep=time
            )
        return x_t

    def denoise_step(self, prefix_pad_masks, past_key_values, x_t, timestep, state=None):
        if self.family == "pi0" and state is None:
            raise TypeError("pi0's denoise_step needs the state")
        if self.family != "pi0" and state is not None:
            raise TypeError(f"{self.family}'s denoise_step takes no state")
        if self.family == "smolvla":  # reads .layers and crops, as SmolVLA does
            if not isinstance(past_key_values, DynamicCache):
                raise TypeError("SmolVLA's denoise_step needs a DynamicCache")
            layers = [(layer.keys, layer.values, None) for layer in past_key_values.layers]
            past_key_values.crop(prefix_pad_masks.shape[1])
        else:  # pi0 / pi0.5 clone the (keys, values, sliding) layers they are given
            layers = [(k.clone(), v.clone(), s) for k, v, s in past_key_values]
        return self._expert(prefix_pad_masks, layers, x_t, timestep, state)


class StandInPolicy(nn.Module):
    """LeRobot's policy class: ``name``, ``config``, ``model`` and its input preparation."""

    def __init__(self, family: str, **config):
        super().__init__()
        self.name = family
        self.config = SimpleNamespace(
            image_features={CAMERA: None},
            chunk_size=CHUNK,
            n_action_steps=2,
            max_action_dim=MAX_ACTION,
            max_state_dim=MAX_STATE,
            num_inference_steps=5,
            num_steps=5,
            output_features={"action": SimpleNamespace(shape=(ACTION,))},
            rtc_config=None,
            adapt_to_pi_aloha=False,
            use_cache=True,
            **config,
        )
        self.model = StandInModel(family)

    def _images(self, batch):
        image = batch[CAMERA]
        assert image.dtype == torch.float32 and float(image.max()) <= 1.0
        return [image * 2 - 1], [torch.ones(image.shape[0], dtype=torch.bool)]

    def _preprocess_images(self, batch):  # pi0 / pi0.5
        assert self.name != "smolvla"
        return self._images(batch)

    def prepare_images(self, batch):  # SmolVLA
        assert self.name == "smolvla"
        return self._images(batch)

    def prepare_state(self, batch):
        state = batch["observation.state"]
        return torch.nn.functional.pad(state, (0, MAX_STATE - state.shape[-1]))


FAMILIES = ("pi0", "pi05", "smolvla")


def batch(size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        CAMERA: torch.rand(size, 3, 2, 2, generator=generator),
        "observation.state": torch.randn(size, STATE, generator=generator),
        "observation.language.tokens": torch.randint(0, 20, (size, TOKENS), generator=generator),
        "observation.language.attention_mask": torch.rand(size, TOKENS, generator=generator) > 0.3,
    }


def tensordict(entries: dict[str, torch.Tensor]) -> TensorDict:
    size = next(iter(entries.values())).shape[0]
    return TensorDict({tuple(name.split(".")): value for name, value in entries.items()}, [size])


def reference(lerobot_policy, entries, noise):
    images, masks = lerobot_policy._images(entries)
    state = lerobot_policy.prepare_state(entries)
    tokens = entries["observation.language.tokens"]
    token_mask = entries["observation.language.attention_mask"]
    return lerobot_policy.model.sample_actions(
        images, masks, tokens, token_mask, state, noise=noise
    )


def rollout(bridge, td):
    with set_exploration_type(ExplorationType.RANDOM):
        return bridge.actor(td)


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


def build(family, seed=0, **config):
    torch.manual_seed(seed)
    return StandInPolicy(family, **config)


def test_ode_is_the_models_own_sampler(family):
    lerobot_policy = build(family)
    bridge = flow_policy_from_lerobot(lerobot_policy)
    assert bridge.policy.options.num_denoising_steps == 5  # LeRobot's step count by default
    assert bridge.policy.options.eval_num_denoising_steps == 5
    entries = batch(4)
    noise = torch.randn(4, CHUNK, MAX_ACTION)
    expected = reference(lerobot_policy, entries, noise)
    decoded = bridge.policy.decode(tensordict(entries), noise)  # H' = n_action_steps rows
    torch.testing.assert_close(decoded, expected[:, :2], atol=1e-5, rtol=0)


def test_context_layout_and_keys(family):
    lerobot_policy = build(family)
    bridge = flow_policy_from_lerobot(lerobot_policy)
    names = list(bridge.observation_keys)
    assert names[0] == CAMERA and names[-2:] == [
        "observation.language.tokens",
        "observation.language.attention_mask",
    ]
    assert ("observation.state" in names) == (family != "pi05")
    assert (
        bridge.observation_keys["observation.state" if family != "pi05" else CAMERA][0]
        == "observation"
    )
    entries = batch(4)
    context = bridge.prefix(*[entries[name] for name in names])
    prefix_length = 4 + TOKENS + (family == "smolvla")
    assert len(context) == (4 if family == "pi0" else 3)
    assert context[0].shape == (4, prefix_length) and context[0].dtype == torch.bool
    if family == "pi0":
        assert context[1].shape == (4, MAX_STATE)
    assert context[-2].shape == context[-1].shape == (4, LAYERS, 1, prefix_length, WIDTH)
    custom = lerobot_observation_keys(lerobot_policy, {CAMERA: "pixels"})
    assert custom[CAMERA] == "pixels"


@pytest.mark.parametrize("context", ["inputs", "cache"])
def test_rescoring_uses_each_decisions_own_context(family, context):
    lerobot_policy = build(family)
    bridge = flow_policy_from_lerobot(lerobot_policy, context=context)
    td = rollout(bridge, tensordict(batch(6)))
    calls = lerobot_policy.model.prefix_calls
    assert calls == 1  # one prefix pass for the whole batch of decisions
    torch.testing.assert_close(
        bridge.policy.log_prob(td), td["flow", "step_log_prob"], atol=1e-5, rtol=0
    )
    # The learner runs the prefix again from the stored inputs, never from a stored cache.
    assert lerobot_policy.model.prefix_calls == calls + (context == "inputs")
    shuffled = td.clone()
    stored = bridge.policy.in_keys
    for key in stored:
        shuffled[key] = td[key].roll(1, 0)
    difference = (bridge.policy.log_prob(shuffled) - td["flow", "step_log_prob"]).abs().sum(-1)
    assert bool((difference > 1e-4).all())
    if context == "cache":
        assert all(key[0] == "prefix_cache" for key in stored)
        assert tuple(td["prefix_cache", "keys"].shape) == (
            6,
            LAYERS,
            1,
            4 + TOKENS + (family == "smolvla"),
            WIDTH,
        )


def test_padded_columns_are_masked_and_the_ratio_is_one(family):
    bridge = flow_policy_from_lerobot(build(family))
    assert bridge.action_dim == ACTION
    assert bridge.policy.sampler.action_mask.tolist() == [True, True, False, False]
    td = rollout(bridge, tensordict(batch(6)))
    steps = bridge.policy.stochastic_steps(td)
    normal = torch.distributions.Normal(steps.mean, steps.std[:, None, None])
    expected = normal.log_prob(steps.sample)[..., :ACTION].sum((-1, -2))
    torch.testing.assert_close(td["flow", "step_log_prob"][td["flow", "sde_mask"]], expected)
    td["advantage"] = torch.randn(6, 1)
    out = DenoisingClipPPOLoss(bridge.policy, kl_coeff=0.1)(td)  # a deep-copied reference too
    assert float(out["log_prob_drift"]) < 1e-5 and abs(float(out["mean_ratio"]) - 1) < 1e-5


def test_parameters_belong_to_the_velocity_once(family):
    lerobot_policy = build(family)
    bridge = flow_policy_from_lerobot(lerobot_policy)
    assert [id(p) for p in bridge.policy.parameters()] == [
        id(p) for p in lerobot_policy.parameters()
    ]
    assert not list(bridge.prefix.parameters())  # a reference, not a second owner
    copied = copy.deepcopy(bridge.policy)
    assert copied.encoder.lerobot_policy is copied.velocity_network.lerobot_policy
    assert copied.velocity_network.lerobot_policy is not lerobot_policy


@pytest.mark.parametrize("context_grad", [False, True])
def test_ppo_gradient_reaches_the_prefix_only_with_context_grad(family, context_grad):
    lerobot_policy = build(family)
    bridge = flow_policy_from_lerobot(lerobot_policy)
    td = rollout(bridge, tensordict(batch(6)))
    td["advantage"] = torch.randn(6, 1)
    DenoisingClipPPOLoss(bridge.policy, context_grad=context_grad)(td)["loss_objective"].backward()
    model = lerobot_policy.model
    assert model.action_out_proj.weight.grad.abs().sum() > 0
    prefix_grad = model.key_projections[0].weight.grad
    assert (prefix_grad is not None and bool(prefix_grad.abs().sum() > 0)) == context_grad


def test_uint8_images_are_scaled_to_unit_range(family):
    bridge = flow_policy_from_lerobot(build(family))
    entries = batch(3)
    pixels = (entries[CAMERA] * 255).round().to(torch.uint8)
    noise = torch.randn(3, CHUNK, MAX_ACTION)
    as_uint8 = bridge.policy.decode(tensordict({**entries, CAMERA: pixels}), noise)
    as_float = bridge.policy.decode(tensordict({**entries, CAMERA: pixels / 255}), noise)
    torch.testing.assert_close(as_uint8, as_float, atol=0, rtol=0)


def test_cache_actor_writes_the_prefix_then_samples():
    lerobot_policy = build("pi0")
    bridge = flow_policy_from_lerobot(
        lerobot_policy, context="cache", cache_key=("stored", "prefix")
    )
    td = TensorDict(
        {
            key: value.reshape(2, 3, *value.shape[1:])
            for key, value in tensordict(batch(6)).items(True, True)
        },
        [2, 3],
    )
    td = rollout(bridge, td)  # a [2, 3] batch: flattened for the prefix, reshaped back
    assert td["stored", "prefix", "state"].shape == (2, 3, MAX_STATE)
    assert td["action"].shape == (2, 3, 2, MAX_ACTION)
    with pytest.raises(KeyError, match="observation"):
        bridge.actor(TensorDict({}, [2]))


def test_refusals():
    with pytest.raises(TypeError, match="PI0Policy, PI05Policy or SmolVLAPolicy"):
        flow_policy_from_lerobot(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="rtc_config"):
        flow_policy_from_lerobot(_with(build("pi0"), rtc_config=SimpleNamespace(enabled=True)))
    with pytest.raises(ValueError, match="adapt_to_pi_aloha"):
        flow_policy_from_lerobot(_with(build("smolvla"), adapt_to_pi_aloha=True))
    with pytest.raises(ValueError, match="use_cache"):
        flow_policy_from_lerobot(_with(build("smolvla"), use_cache=False))
    with pytest.raises(ValueError, match="context must be"):
        flow_policy_from_lerobot(build("pi0"), context="kv")
    with pytest.raises(ValueError, match="does not read"):
        flow_policy_from_lerobot(build("pi05"), observation_keys={"observation.state": "state"})
    with pytest.raises(ValueError, match="no image feature"):
        flow_policy_from_lerobot(_with(build("pi0"), image_features={}))
    with pytest.raises(ValueError, match="tuple of 4 tensors"):
        LeRobotVelocity(build("pi0"))(
            torch.zeros(1, CHUNK, MAX_ACTION), torch.ones(1), torch.zeros(1)
        )
    options = SamplerOptions(num_denoising_steps=3)
    assert flow_policy_from_lerobot(build("pi0"), options=options).policy.options == options


def _with(lerobot_policy, **config):
    for name, value in config.items():
        setattr(lerobot_policy.config, name, value)
    return lerobot_policy
