"""Tiny LeRobot models, batches and LeRobot's own sampler for the bridge's tests."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from torchrl_flowpolicy.integrations.lerobot_models import random_lerobot_policy

ACTION_DIM, STATE_DIM, IMAGE_SIZE, NUM_TOKENS = 3, 5, 32, 6


def build(kind: str, folder, seed: int = 0, **config):
    """A tiny random LeRobot policy of ``kind`` (its SmolVLM configuration in ``folder``)."""
    torch.manual_seed(seed)
    return random_lerobot_policy(
        kind,
        folder=folder / "smolvlm",
        action_dim=ACTION_DIM,
        state_dim=STATE_DIM,
        image_size=IMAGE_SIZE,
        **config,
    )


def lerobot_batch(batch_size: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """A LeRobot batch as its pre-processor leaves it: a camera in [0, 1], a (normalised)
    state and token ids (none of them a special SmolVLM token)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "observation.images.top": torch.rand(
            batch_size, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator
        ),
        "observation.state": torch.randn(batch_size, STATE_DIM, generator=generator),
        "observation.language.tokens": torch.randint(
            6, 60, (batch_size, NUM_TOKENS), generator=generator
        ),
        "observation.language.attention_mask": torch.ones(batch_size, NUM_TOKENS, dtype=torch.bool),
    }


def as_tensordict(batch: dict[str, torch.Tensor]) -> TensorDict:
    """The batch under the bridge's default keys (the names' dotted parts, nested)."""
    size = next(iter(batch.values())).shape[0]
    return TensorDict({tuple(name.split(".")): value for name, value in batch.items()}, [size])


def reference_actions(lerobot_policy, batch: dict[str, torch.Tensor], noise: torch.Tensor):
    """LeRobot's own ``sample_actions`` from ``noise`` (its inputs prepared by its own
    methods, as its ``predict_action_chunk`` does), padded columns included."""
    lerobot_policy.eval()
    model, batch = lerobot_policy.model, dict(batch)
    tokens = batch["observation.language.tokens"]
    token_mask = batch["observation.language.attention_mask"]
    if lerobot_policy.name == "smolvla":
        images, image_masks = lerobot_policy.prepare_images(batch)
        state = lerobot_policy.prepare_state(batch)
        return model.sample_actions(images, image_masks, tokens, token_mask, state, noise=noise)
    images, image_masks = lerobot_policy._preprocess_images(batch)
    inputs = [images, image_masks, tokens, token_mask]
    if lerobot_policy.name == "pi0":
        inputs.append(lerobot_policy.prepare_state(batch))
    return model.sample_actions(*inputs, noise=noise)
