"""LeRobot's pi0, pi0.5 and SmolVLA built offline, with random weights, at a chosen size.

LeRobot builds these models from names: pi0 and pi0.5 from the PaliGemma / Gemma variants
``"gemma_2b"`` and ``"gemma_300m"`` (sizes hard-coded in ``get_gemma_config``), SmolVLA from
a hub model id whose configuration and processor it downloads. Neither fits a test, a
benchmark or an architecture experiment without network access. Here:

- :func:`lerobot_sizes` is a context manager under which pi0 / pi0.5 take their sizes from a
  :class:`ModelSizes` (the language model, the action expert, the vision tower, the
  vocabulary); wrap ``PI0Policy.from_pretrained(folder)`` of a model saved at such a size in
  it as well, since LeRobot's saved configuration keeps only the variant names;
- SmolVLA needs no patch: :func:`write_smolvlm_folder` writes a local SmolVLM configuration
  and a small word-level processor (SmolVLA reads two of its token ids), and
  ``vlm_model_name`` names that folder;
- :func:`random_lerobot_policy` builds either, with LeRobot's own classes, on the CPU.

LeRobot code is imported inside the functions only (``pip install "torchrl_flowpolicy[lerobot]"``).

Example:
    >>> policy = random_lerobot_policy("pi05", action_dim=3)
    >>> type(policy).__name__, policy.config.chunk_size, policy.config.max_action_dim
    ('PI05Policy', 4, 8)
    >>> sum(parameter.numel() for parameter in policy.parameters()) < 100_000
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from unittest import mock

#: The doctests need LeRobot (``tests/test_docs.py`` skips them without it).
__doctest_requires__ = ("lerobot",)

__all__ = ["ModelSizes", "lerobot_sizes", "random_lerobot_policy", "write_smolvlm_folder"]

Kind = Literal["pi0", "pi05", "smolvla"]

#: SmolVLM's special tokens, first in the vocabulary of :func:`write_smolvlm_folder`.
SMOLVLM_SPECIAL_TOKENS = {
    "unk_token": "<unk>",
    "pad_token": "<pad>",
    "fake_image_token": "<fake_token_around_image>",
    "global_image_token": "<global-img>",
    "image_token": "<image>",
    "end_of_utterance_token": "<end_of_utterance>",
}


@dataclass(frozen=True)
class ModelSizes:
    """The sizes of a VLA's transformers (defaults: a tiny model of about 0.1 M parameters).

    pi0's joint attention reshapes with 8 heads (``compute_layer_complete``), so keep
    ``num_heads=8`` for pi0 / pi0.5 if LeRobot's training forward is used. The action expert
    of pi0 / pi0.5 has ``expert_width`` and otherwise the language model's sizes; SmolVLA's
    expert width is its ``expert_width_multiplier`` times ``width``. ``scale_factor`` is
    SmolVLM's pixel shuffle (``image_size / patch_size`` must be a multiple of it).
    """

    width: int = 16
    expert_width: int = 16
    depth: int = 2
    mlp_dim: int = 32
    num_heads: int = 8
    num_kv_heads: int = 1
    head_dim: int = 4
    vision_width: int = 16
    vision_depth: int = 1
    vision_mlp_dim: int = 32
    vision_heads: int = 2
    patch_size: int = 16
    vocab_size: int = 64
    scale_factor: int = 2


@contextlib.contextmanager
def lerobot_sizes(sizes: ModelSizes) -> Iterator[None]:
    """Within the block, LeRobot's pi0 and pi0.5 are built at ``sizes`` (see the module)."""
    from lerobot.policies.pi0 import modeling_pi0
    from lerobot.policies.pi05 import modeling_pi05

    def gemma_config(variant: str) -> Any:
        width = sizes.width if variant == "gemma_2b" else sizes.expert_width
        return modeling_pi0.GemmaConfig(
            width=width,
            depth=sizes.depth,
            mlp_dim=sizes.mlp_dim,
            num_heads=sizes.num_heads,
            num_kv_heads=sizes.num_kv_heads,
            head_dim=sizes.head_dim,
        )

    def resized(build: Any) -> Any:
        def build_resized(config: Any) -> Any:
            text = getattr(config, "text_config", config)
            text.vocab_size = sizes.vocab_size
            vision = getattr(config, "vision_config", None)
            if vision is not None:
                vision.hidden_size = sizes.vision_width
                vision.intermediate_size = sizes.vision_mlp_dim
                vision.num_hidden_layers = sizes.vision_depth
                vision.num_attention_heads = sizes.vision_heads
                vision.patch_size = sizes.patch_size
                vision.projection_dim = text.hidden_size
            return build(config=config)

        return build_resized

    with contextlib.ExitStack() as stack:
        for module in (modeling_pi0, modeling_pi05):
            for name in ("PaliGemmaForConditionalGenerationWithPiGemma", "PiGemmaForCausalLM"):
                stack.enter_context(mock.patch.object(module, name, resized(getattr(module, name))))
            stack.enter_context(mock.patch.object(module, "get_gemma_config", gemma_config))
        yield


def write_smolvlm_folder(folder: str | Path, sizes: ModelSizes, image_size: int) -> Path:
    """Write a SmolVLM configuration and processor of ``sizes`` into ``folder`` (returned).

    The processor's tokenizer is word-level over ``sizes.vocab_size`` tokens: SmolVLM's
    special tokens, then ``"w0"``, ``"w1"``, ... (LeRobot's tokenizer step is not needed:
    feed token ids directly).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        SmolVLMConfig,
        SmolVLMImageProcessor,
        SmolVLMProcessor,
        SmolVLMVideoProcessor,
    )

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    special = list(SMOLVLM_SPECIAL_TOKENS.values())
    words = [f"w{index}" for index in range(sizes.vocab_size - len(special))]
    vocabulary = {token: index for index, token in enumerate(special + words)}
    word_level = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    named = {"unk_token", "pad_token"}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level,
        **{name: SMOLVLM_SPECIAL_TOKENS[name] for name in named},
        extra_special_tokens={
            name: token for name, token in SMOLVLM_SPECIAL_TOKENS.items() if name not in named
        },
    )
    SmolVLMConfig(
        text_config={
            "hidden_size": sizes.width,
            "intermediate_size": sizes.mlp_dim,
            "num_hidden_layers": sizes.depth,
            "num_attention_heads": sizes.num_heads,
            "num_key_value_heads": sizes.num_kv_heads,
            "head_dim": sizes.head_dim,
            "vocab_size": sizes.vocab_size,
        },
        vision_config={
            "hidden_size": sizes.vision_width,
            "intermediate_size": sizes.vision_mlp_dim,
            "num_hidden_layers": sizes.vision_depth,
            "num_attention_heads": sizes.vision_heads,
            "image_size": image_size,
            "patch_size": sizes.patch_size,
        },
        scale_factor=sizes.scale_factor,
        vocab_size=sizes.vocab_size,
    ).save_pretrained(folder)
    SmolVLMProcessor(
        image_processor=SmolVLMImageProcessor(),
        tokenizer=tokenizer,
        video_processor=SmolVLMVideoProcessor(),
    ).save_pretrained(folder)
    return folder


def random_lerobot_policy(
    kind: Kind,
    *,
    sizes: ModelSizes | None = None,
    action_dim: int = 3,
    state_dim: int = 5,
    image_size: int = 32,
    camera: str = "observation.images.top",
    folder: str | Path | None = None,
    **config: Any,
) -> Any:
    """A LeRobot ``PI0Policy`` / ``PI05Policy`` / ``SmolVLAPolicy`` with random weights, offline.

    Args:
        kind: ``"pi0"``, ``"pi05"`` or ``"smolvla"``.

    Keyword Args:
        sizes: the transformers' sizes (default: tiny, :class:`ModelSizes`).
        action_dim: the action feature's dimension (padded to ``max_action_dim``).
        state_dim: the state feature's dimension (padded to ``max_state_dim``).
        image_size: one square camera of this size (channels first, values in ``[0, 1]``),
            LeRobot's image resolution too.
        camera: the camera's feature name.
        folder: SmolVLA only (required): where its SmolVLM configuration is written
            (:func:`write_smolvlm_folder`); the saved policy refers to it.
        **config: LeRobot configuration fields (``chunk_size``, ``n_action_steps``,
            ``max_action_dim``, ``max_state_dim``, ``train_expert_only``, ...); defaults
            here: a chunk of 4, both maxima 8, the CPU.
    """
    from lerobot.configs import FeatureType, PolicyFeature

    sizes = sizes or ModelSizes()
    fields = {
        "chunk_size": 4,
        "n_action_steps": 4,
        "max_action_dim": 8,
        "max_state_dim": 8,
        "device": "cpu",
        **config,
        "input_features": {
            camera: PolicyFeature(FeatureType.VISUAL, (3, image_size, image_size)),
            "observation.state": PolicyFeature(FeatureType.STATE, (state_dim,)),
        },
        "output_features": {"action": PolicyFeature(FeatureType.ACTION, (action_dim,))},
    }
    if kind == "smolvla":
        from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
        from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy

        if folder is None:
            raise ValueError("a SmolVLA policy needs folder= for its local SmolVLM configuration.")
        vlm_folder = write_smolvlm_folder(folder, sizes, image_size)
        return SmolVLAPolicy(
            SmolVLAConfig(
                vlm_model_name=str(vlm_folder),
                load_vlm_weights=False,
                resize_imgs_with_padding=(image_size, image_size),
                **fields,
            )
        )
    if kind == "pi0":
        from lerobot.policies.pi0.configuration_pi0 import PI0Config as Config
        from lerobot.policies.pi0.modeling_pi0 import PI0Policy as Policy
    elif kind == "pi05":
        from lerobot.policies.pi05.configuration_pi05 import PI05Config as Config
        from lerobot.policies.pi05.modeling_pi05 import PI05Policy as Policy
    else:
        raise ValueError(f"kind must be 'pi0', 'pi05' or 'smolvla', got {kind!r}.")
    with lerobot_sizes(sizes):
        return Policy(Config(image_resolution=(image_size, image_size), **fields))
