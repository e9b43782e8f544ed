"""LeRobot's pi0, pi0.5 and SmolVLA as a :class:`~torchrl_flowpolicy.FlowSDEPolicy`.

The model's own code does all the computing; this module only wires it to the sampler:

- the **encoder** (:class:`LeRobotPrefix`) is the model's prefix pass, what its
  ``sample_actions`` runs once per decision before denoising: LeRobot's own image
  preparation (``_preprocess_images`` / ``prepare_images``: resize with padding, ``[0, 1]`` to
  ``[-1, 1]``, empty cameras) and state padding (``prepare_state``), then ``embed_prefix`` and
  the VLM's forward with ``use_cache=True``. Its context is the prefix padding mask, the
  padded state where the expert reads it (pi0), and the VLM's keys and values stacked over
  layers, one row per decision, so that the learner gathers them per stochastic entry;
- the **velocity network** (:class:`LeRobotVelocity`) is the model's own ``denoise_step``
  over a key/value cache rebuilt from that context.

LeRobot's convention is the library's (``t = 1`` is noise, target ``noise - actions``, Euler
from 1 to 0), so no time reversal is needed: at ``noise_level = 0`` the chunk is that of
LeRobot's ``sample_actions`` from the same noise. The chunk keeps LeRobot's padded width
(``max_action_dim``); its first ``action_dim`` columns are the action, the rest are masked
out of the log-probabilities (``action_mask``). Normalisation stays where LeRobot puts it,
outside the model: feed the policy observations from LeRobot's pre-processor and hand
``action[..., :action_dim]`` to its post-processor.

This module imports no LeRobot code: it calls the methods of the policy object it is given
(tested with lerobot 0.6.1) and takes LeRobot's mask helpers and cache class from the
modules that define the model, the ones its own ``sample_actions`` uses.

Example (a tiny random pi0 built offline; a published checkpoint loads with LeRobot's
``from_pretrained`` instead, which downloads its weights):

    >>> from tensordict import TensorDict
    >>> from torchrl_flowpolicy.integrations.lerobot_models import random_lerobot_policy
    >>> lerobot_policy = random_lerobot_policy("pi0", action_dim=3)
    >>> bridge = flow_policy_from_lerobot(lerobot_policy)
    >>> bridge.policy.action_shape, bridge.action_dim  # LeRobot's chunk, padded to 8 columns
    (torch.Size([4, 8]), 3)
    >>> observation = TensorDict({
    ...     ("observation", "images", "top"): torch.rand(2, 3, 32, 32),
    ...     ("observation", "state"): torch.randn(2, 5),
    ...     ("observation", "language", "tokens"): torch.randint(6, 64, (2, 6)),
    ...     ("observation", "language", "attention_mask"): torch.ones(2, 6, dtype=torch.bool),
    ... }, batch_size=[2])
    >>> bridge.actor(observation)["flow", "chain"].shape  # sampled under RANDOM exploration
    torch.Size([2, 11, 4, 8])
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase, TensorDictSequential
from tensordict.utils import NestedKey
from torch import Tensor, nn

from torchrl_flowpolicy.policy import FlowSDEPolicy
from torchrl_flowpolicy.sampler import SamplerOptions

#: The doctests need LeRobot (``tests/test_docs.py`` skips them without it).
__doctest_requires__ = ("lerobot",)

__all__ = [
    "LeRobotFlowPolicy",
    "LeRobotPrefix",
    "LeRobotPrefixCache",
    "LeRobotVelocity",
    "flow_policy_from_lerobot",
    "lerobot_observation_keys",
]

#: What the learner recomputes or stores per decision: ``"inputs"`` (the observations; the
#: learner runs the prefix again) or ``"cache"`` (the prefix's keys and values).
ContextMode = Literal["inputs", "cache"]

#: LeRobot's batch keys (``lerobot.utils.constants``: OBS_STATE, OBS_LANGUAGE_TOKENS,
#: OBS_LANGUAGE_ATTENTION_MASK).
STATE = "observation.state"
LANGUAGE_TOKENS = "observation.language.tokens"
LANGUAGE_MASK = "observation.language.attention_mask"

#: The families this module knows, by the policy's ``name``: pi0 feeds the state to the
#: action expert, SmolVLA to the prefix, pi0.5 into the prompt (its tokens).
FAMILIES = ("pi0", "pi05", "smolvla")


def _family(lerobot_policy: nn.Module) -> str:
    """The policy's family, after refusing the options this bridge cannot honour."""
    name = getattr(lerobot_policy, "name", None)
    if name not in FAMILIES:
        raise TypeError(
            f"expected a LeRobot PI0Policy, PI05Policy or SmolVLAPolicy (name in {FAMILIES}), "
            f"got {type(lerobot_policy).__name__} with name {name!r}."
        )
    config = lerobot_policy.config
    rtc = getattr(config, "rtc_config", None)
    if rtc is not None and getattr(rtc, "enabled", False):
        raise ValueError(
            "rtc_config.enabled=True: real-time chunking guides the velocity with the previous "
            "chunk, which the Flow-SDE log-probabilities do not model; disable it."
        )
    if name == "smolvla" and getattr(config, "adapt_to_pi_aloha", False):
        raise ValueError(
            "adapt_to_pi_aloha=True transforms SmolVLA's state and actions around the model; "
            "it is not supported: set it to False."
        )
    if name == "smolvla" and not getattr(config, "use_cache", True):
        raise ValueError(
            "SmolVLA's use_cache=False recomputes the prefix at every denoising step; the "
            "bridge needs the key/value cache: set use_cache=True."
        )
    return name


def _helper(obj: object, name: str) -> Any:
    """``name`` from the module that defines ``type(obj)`` (the helper the model's own code
    calls)."""
    module = sys.modules[type(obj).__module__]
    helper = getattr(module, name, None)
    if helper is None:
        raise AttributeError(
            f"{module.__name__} defines no {name!r}, which the bridge takes from the module "
            f"of {type(obj).__name__}: this LeRobot version is not supported (tested: 0.6.1)."
        )
    return helper


def lerobot_observation_keys(
    lerobot_policy: nn.Module, observation_keys: Mapping[str, NestedKey] | None = None
) -> dict[str, NestedKey]:
    """The LeRobot batch entries the prefix reads, each with its tensordict key.

    The cameras of ``config.image_features`` (without LeRobot's ``empty_camera_*``, which it
    pads itself), the state (pi0 and SmolVLA) and the language tokens and mask. A name maps
    to the nested key of its dotted parts (``"observation.state"`` to
    ``("observation", "state")``) unless ``observation_keys`` maps it.
    """
    family = _family(lerobot_policy)
    names = [name for name in lerobot_policy.config.image_features if "empty_camera" not in name]
    if not names:
        raise ValueError(
            "the LeRobot policy has no image feature; pi0, pi0.5 and SmolVLA need one."
        )
    names += ([] if family == "pi05" else [STATE]) + [LANGUAGE_TOKENS, LANGUAGE_MASK]
    observation_keys = dict(observation_keys or {})
    unknown = sorted(set(observation_keys) - set(names))
    if unknown:
        raise ValueError(
            f"observation_keys names {unknown}, which the prefix does not read: {names}."
        )
    return {name: observation_keys.get(name, tuple(name.split("."))) for name in names}


class LeRobotPrefix(nn.Module):
    """The encoder: a LeRobot policy's prefix pass, computed once per decision.

    ``forward(*observations)`` takes the entries of ``lerobot_names`` (in that order, a batch
    ``[N, ...]`` each) and returns the context ``(prefix_pad_mask [N, T], keys, values)``,
    with pi0's padded state ``[N, S]`` after the mask; ``keys`` and ``values`` are the VLM's
    cache stacked over layers, ``[N, L, kv_heads, T, head_dim]``. Images may be float in
    ``[0, 1]`` (LeRobot's layout) or ``uint8`` (divided by 255 first, as LeRobot's
    ``preprocess_observation`` does), channels first.

    The LeRobot policy is held by reference, not as a submodule: its parameters belong to
    the :class:`LeRobotVelocity` of the same bridge, so that they are counted and trained
    once.
    """

    def __init__(self, lerobot_policy: nn.Module, lerobot_names: Sequence[str]):
        super().__init__()
        self.family = _family(lerobot_policy)
        self.__dict__["lerobot_policy"] = lerobot_policy  # a reference, not a submodule
        self.lerobot_names = tuple(lerobot_names)
        self.image_names = frozenset(lerobot_policy.config.image_features)

    def forward(self, *observations: Tensor) -> tuple[Tensor, ...]:
        if len(observations) != len(self.lerobot_names):
            raise ValueError(
                f"LeRobotPrefix takes {len(self.lerobot_names)} observations "
                f"{list(self.lerobot_names)}, got {len(observations)}."
            )
        batch = {
            name: value / 255 if name in self.image_names and value.dtype == torch.uint8 else value
            for name, value in zip(self.lerobot_names, observations, strict=True)
        }
        policy, model = self.lerobot_policy, self.lerobot_policy.model
        make_att_2d_masks = _helper(model, "make_att_2d_masks")
        tokens, token_mask = batch[LANGUAGE_TOKENS], batch[LANGUAGE_MASK]
        if self.family == "smolvla":  # as VLAFlowMatching.sample_actions
            images, image_masks = policy.prepare_images(batch)
            embeddings, pad_mask, attention = model.embed_prefix(
                images, image_masks, tokens, token_mask, state=policy.prepare_state(batch)
            )
            _, cache = model.vlm_with_expert.forward(
                attention_mask=make_att_2d_masks(pad_mask, attention),
                position_ids=torch.cumsum(pad_mask, dim=1) - 1,
                past_key_values=None,
                inputs_embeds=[embeddings, None],
                use_cache=True,
            )
            context = (pad_mask,)
        else:  # as PI0Pytorch.sample_actions / PI05Pytorch.sample_actions
            images, image_masks = policy._preprocess_images(batch)
            embeddings, pad_mask, attention = model.embed_prefix(
                images, image_masks, tokens, token_mask
            )
            masks_4d = _helper(model, "prepare_attention_masks_4d")(
                make_att_2d_masks(pad_mask, attention)
            )
            experts = model.paligemma_with_expert
            experts.paligemma.model.language_model.config._attn_implementation = "eager"
            _, cache = experts.forward(
                attention_mask=masks_4d,
                position_ids=torch.cumsum(pad_mask, dim=1) - 1,
                past_key_values=None,
                inputs_embeds=[embeddings, None],
                use_cache=True,
            )
            context = (
                (pad_mask, policy.prepare_state(batch)) if self.family == "pi0" else (pad_mask,)
            )
        layers = [(layer[0], layer[1]) for layer in cache]
        keys = torch.stack([key for key, _ in layers], dim=1)
        values = torch.stack([value for _, value in layers], dim=1)
        return (*context, keys, values)


class LeRobotVelocity(nn.Module):
    """The velocity network: a LeRobot policy's own ``denoise_step`` over a cached prefix.

    ``forward(x [N, H, D], sigma [N], context) -> v [N, H, D]`` with the context of
    :class:`LeRobotPrefix` (its rows gathered for the ``N`` entries); ``H = chunk_size``,
    ``D = max_action_dim``. The cache is rebuilt from the context at every call: pi0 and pi0.5
    take LeRobot's ``(keys, values, sliding_window)`` layers (their ``denoise_step`` clones
    them into a cache), SmolVLA the cache class its own prefix pass creates.

    The LeRobot policy is a submodule (``lerobot_policy``): its parameters are the bridge's.
    """

    def __init__(self, lerobot_policy: nn.Module):
        super().__init__()
        self.family = _family(lerobot_policy)
        self.lerobot_policy = lerobot_policy
        config = lerobot_policy.config
        self.action_shape = (int(config.chunk_size), int(config.max_action_dim))
        self.context_size = 4 if self.family == "pi0" else 3
        model = lerobot_policy.model
        self._cache_type = (
            _helper(model.vlm_with_expert, "DynamicCache") if self.family == "smolvla" else None
        )

    def forward(self, x: Tensor, sigma: Tensor, context: Sequence[Tensor]) -> Tensor:
        if not isinstance(context, tuple) or len(context) != self.context_size:
            raise ValueError(
                f"LeRobotVelocity ({self.family}) takes the context of LeRobotPrefix, a tuple of "
                f"{self.context_size} tensors (prefix mask, {'state, ' if self.family == 'pi0' else ''}"
                f"keys, values); got {type(context).__name__} of length "
                f"{len(context) if isinstance(context, tuple) else '-'}."
            )
        pad_mask, *state, keys, values = context
        layers = tuple(
            (key, value, None) for key, value in zip(keys.unbind(1), values.unbind(1), strict=True)
        )
        model = self.lerobot_policy.model
        if self.family == "smolvla":
            cache = self._cache_type(layers)
            return model.denoise_step(
                prefix_pad_masks=pad_mask, past_key_values=cache, x_t=x, timestep=sigma
            )
        inputs = {"state": state[0]} if self.family == "pi0" else {}
        return model.denoise_step(
            **inputs, prefix_pad_masks=pad_mask, past_key_values=layers, x_t=x, timestep=sigma
        )


class LeRobotPrefixCache(TensorDictModuleBase):
    """Writes the prefix's context (:class:`LeRobotPrefix`) into the tensordict.

    For ``context="cache"``: a collector runs it before the policy, so that the stored
    decisions carry their keys and values and the learner never runs the prefix. Reads
    ``in_keys`` (the observations, any batch shape) and writes ``out_keys``: the prefix mask,
    pi0's padded state, the keys and the values under ``cache_key``. Never tracks gradients.
    """

    def __init__(self, prefix: LeRobotPrefix, in_keys: Sequence[NestedKey], cache_key: NestedKey):
        super().__init__()
        self.prefix = prefix
        self.in_keys = list(in_keys)
        names = [
            "prefix_pad_mask",
            *(["state"] if prefix.family == "pi0" else []),
            "keys",
            "values",
        ]
        base = cache_key if isinstance(cache_key, tuple) else (cache_key,)
        self.out_keys = [(*base, name) for name in names]

    @torch.no_grad()
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        batch_shape = tensordict.batch_size
        observations = []
        for key in self.in_keys:
            value = tensordict.get(key, None)
            if value is None:
                raise KeyError(
                    f"LeRobotPrefixCache needs the observation {key!r}, which is missing "
                    f"(keys: {list(tensordict.keys(True, True))})."
                )
            observations.append(
                value.reshape(-1, *value.shape[len(batch_shape) :]) if batch_shape else value[None]
            )
        for key, value in zip(self.out_keys, self.prefix(*observations), strict=True):
            tensordict.set(key, value.reshape(*batch_shape, *value.shape[1:]))
        return tensordict


class LeRobotFlowPolicy(NamedTuple):
    """What :func:`flow_policy_from_lerobot` builds.

    Attributes:
        policy: the :class:`~torchrl_flowpolicy.FlowSDEPolicy` (the losses' actor).
        actor: what a collector runs: ``policy`` itself (``context="inputs"``), or
            :class:`LeRobotPrefixCache` then ``policy`` (``context="cache"``).
        prefix: the prefix pass (:class:`LeRobotPrefix`).
        action_dim: the real action dimensions: the first ``action_dim`` of the chunk's
            ``max_action_dim`` columns.
        observation_keys: each LeRobot batch name the prefix reads, with its tensordict key.
    """

    policy: FlowSDEPolicy
    actor: TensorDictModuleBase
    prefix: LeRobotPrefix
    action_dim: int
    observation_keys: dict[str, NestedKey]


def flow_policy_from_lerobot(
    lerobot_policy: nn.Module,
    *,
    context: ContextMode = "inputs",
    options: SamplerOptions | None = None,
    observation_keys: Mapping[str, NestedKey] | None = None,
    cache_key: NestedKey = "prefix_cache",
    executed_chunk_length: int | None = None,
    **policy_kwargs: Any,
) -> LeRobotFlowPolicy:
    """A LeRobot ``PI0Policy``, ``PI05Policy`` or ``SmolVLAPolicy`` as a ``FlowSDEPolicy``.

    The policy object is shared, not copied: training the bridge trains it, and LeRobot's
    ``save_pretrained`` / ``select_action`` then see the fine-tuned weights.

    Args:
        lerobot_policy: the LeRobot policy (any device and dtype; bf16 backbones are fine:
            the sampler calls ``denoise_step`` in float32, the dtype LeRobot's own sampler
            uses, and computes the log-probabilities in float32).

    Keyword Args:
        context: ``"inputs"`` (default): the decisions store their observations and the
            learner runs the prefix again (under ``no_grad`` unless the loss has
            ``context_grad=True``: then the gradient reaches the VLM's trainable
            parameters). ``"cache"``: the decisions store the prefix's keys and values
            (megabytes per decision at real size) and the learner reuses them (no gradient
            into the VLM).
        options: the sampler settings; default: ``SamplerOptions`` with LeRobot's number of
            denoising steps for the rollouts and the evaluation ODE.
        observation_keys: tensordict keys of LeRobot batch names
            (:func:`lerobot_observation_keys`; default: the names' dotted parts as nested keys).
        cache_key: where ``context="cache"`` stores the prefix (see :class:`LeRobotPrefixCache`).
        executed_chunk_length: ``H'``; default: LeRobot's ``n_action_steps``.
        **policy_kwargs: forwarded to :class:`~torchrl_flowpolicy.FlowSDEPolicy`
            (``noise_head``, ``default_interaction_type``).
    """
    if context not in ("inputs", "cache"):
        raise ValueError(f"context must be 'inputs' or 'cache', got {context!r}.")
    family = _family(lerobot_policy)
    config = lerobot_policy.config
    keys = lerobot_observation_keys(lerobot_policy, observation_keys)
    if options is None:
        steps = config.num_steps if family == "smolvla" else config.num_inference_steps
        options = SamplerOptions(num_denoising_steps=steps, eval_num_denoising_steps=steps)
    velocity = LeRobotVelocity(lerobot_policy)
    prefix = LeRobotPrefix(lerobot_policy, list(keys))
    action_dim = int(config.output_features["action"].shape[0])
    max_action_dim = int(config.max_action_dim)
    if not 1 <= action_dim <= max_action_dim:
        raise ValueError(
            f"the LeRobot policy's action feature has {action_dim} dimensions; expected 1 to "
            f"max_action_dim={max_action_dim}."
        )
    cache = LeRobotPrefixCache(prefix, list(keys.values()), cache_key)
    policy = FlowSDEPolicy(
        velocity,
        action_shape=velocity.action_shape,
        in_keys=list(keys.values()) if context == "inputs" else cache.out_keys,
        encoder=prefix if context == "inputs" else None,
        options=options,
        executed_chunk_length=(
            config.n_action_steps if executed_chunk_length is None else executed_chunk_length
        ),
        action_mask=torch.arange(max_action_dim) < action_dim,
        network_dtype=torch.float32,
        **policy_kwargs,
    )
    actor = policy if context == "inputs" else TensorDictSequential(cache, policy)
    return LeRobotFlowPolicy(policy, actor, prefix, action_dim, keys)
