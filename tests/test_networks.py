"""Tests of the reference velocity networks and the observation encoder."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.envs.utils import ExplorationType, set_exploration_type

from torchrl_flowpolicy.networks import (
    ActionExpertTransformer,
    MLPVelocityNetwork,
    ObservationEncoder,
    SigmaEmbedding,
)
from torchrl_flowpolicy.policy import FlowSDEPolicy
from torchrl_flowpolicy.sampler import SamplerOptions

STEP_LOG_PROB_KEY = ("flow", "step_log_prob")  # the policy's default key

OBSERVATION_DIM, ACTION_SHAPE, MODEL_DIM = 5, (4, 2), 16


def make_encoder_and_expert():
    torch.manual_seed(0)
    encoder = ObservationEncoder(OBSERVATION_DIM, model_dim=MODEL_DIM, num_tokens=3, hidden_dim=32)
    expert = ActionExpertTransformer(ACTION_SHAPE, model_dim=MODEL_DIM, num_heads=2, num_layers=2)
    return encoder, expert


def test_sigma_embedding():
    embedding = SigmaEmbedding(8)
    features = embedding(torch.tensor([0.0, 0.3, 1.0]))
    assert features.shape == (3, 8)
    torch.testing.assert_close(features[0], torch.tensor([0.0] * 4 + [1.0] * 4))
    assert not torch.allclose(features[1], features[2])
    assert embedding(torch.rand(2, 5)).shape == (2, 5, 8)
    with pytest.raises(ValueError, match="embedding_dim"):
        SigmaEmbedding(7)


@pytest.mark.parametrize("num_decisions", [1, 7])
def test_mlp_velocity_network_shapes_and_inputs(num_decisions):
    torch.manual_seed(0)
    network = MLPVelocityNetwork(OBSERVATION_DIM, ACTION_SHAPE, hidden_dim=32, num_layers=2)
    x = torch.randn(num_decisions, *ACTION_SHAPE)
    sigma = torch.rand(num_decisions)
    observation = torch.randn(num_decisions, OBSERVATION_DIM)
    velocity = network(x, sigma, observation)
    assert velocity.shape == (num_decisions, *ACTION_SHAPE)
    # Every input matters.
    assert not torch.allclose(network(x + 1, sigma, observation), velocity)
    assert not torch.allclose(network(x, sigma * 0.5, observation), velocity)
    assert not torch.allclose(network(x, sigma, observation + 1), velocity)


def test_mlp_velocity_network_rejects_wrong_feature_count():
    network = MLPVelocityNetwork(OBSERVATION_DIM, ACTION_SHAPE, hidden_dim=8, num_layers=1)
    with pytest.raises(ValueError, match=f"6 features.*observation_dim={OBSERVATION_DIM}"):
        network(torch.randn(3, *ACTION_SHAPE), torch.rand(3), torch.randn(3, 6))


def test_mlp_velocity_network_float64_accepts_float32_observations():
    network = MLPVelocityNetwork(OBSERVATION_DIM, ACTION_SHAPE, hidden_dim=8).double()
    x = torch.randn(2, *ACTION_SHAPE, dtype=torch.float64)
    velocity = network(x, torch.rand(2, dtype=torch.float64), torch.randn(2, OBSERVATION_DIM))
    assert velocity.dtype == torch.float64


def test_observation_encoder():
    encoder, _ = make_encoder_and_expert()
    tokens = encoder(torch.randn(6, OBSERVATION_DIM))
    assert tokens.shape == (6, 3, MODEL_DIM)
    # The final LayerNorm normalises every token.
    torch.testing.assert_close(tokens.mean(-1), torch.zeros(6, 3), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=f"observation_dim={OBSERVATION_DIM}"):
        encoder(torch.randn(6, OBSERVATION_DIM + 2))


def test_action_expert_shapes_and_context_is_used():
    encoder, expert = make_encoder_and_expert()
    x, sigma = torch.randn(5, *ACTION_SHAPE), torch.rand(5)
    context = encoder(torch.randn(5, OBSERVATION_DIM))
    velocity = expert(x, sigma, context)
    assert velocity.shape == (5, *ACTION_SHAPE)
    other_context = encoder(torch.randn(5, OBSERVATION_DIM))
    assert not torch.allclose(expert(x, sigma, other_context), velocity)
    assert not torch.allclose(expert(x, sigma * 0.5, context), velocity)
    # Decisions do not interact: the output for one row ignores the other rows.
    torch.testing.assert_close(expert(x[:2], sigma[:2], context[:2]), velocity[:2])


def test_action_expert_rejects_wrong_context_shape():
    _, expert = make_encoder_and_expert()
    x, sigma = torch.randn(2, *ACTION_SHAPE), torch.rand(2)
    with pytest.raises(ValueError, match=f"context tokens \\[N, T, {MODEL_DIM}\\]"):
        expert(x, sigma, torch.randn(2, 3, MODEL_DIM + 1))
    with pytest.raises(ValueError, match="context tokens"):
        expert(x, sigma, torch.randn(2, MODEL_DIM))


@pytest.mark.parametrize("mode", [ExplorationType.RANDOM, ExplorationType.DETERMINISTIC])
def test_encoder_runs_once_per_decision_batch(counting, mode):
    encoder, expert = make_encoder_and_expert()
    encoder, expert = counting(encoder), counting(expert)
    policy = FlowSDEPolicy(
        expert,
        action_shape=ACTION_SHAPE,
        encoder=encoder,
        options=SamplerOptions(num_denoising_steps=8, eval_num_denoising_steps=20),
    )
    tensordict = TensorDict({"observation": torch.randn(2, 3, OBSERVATION_DIM)}, batch_size=[2, 3])
    with set_exploration_type(mode), torch.no_grad():
        out = policy(tensordict)
    assert encoder.calls == 1
    assert encoder.rows == [6]
    assert expert.calls == (8 if mode == ExplorationType.RANDOM else 20)
    if mode == ExplorationType.RANDOM:
        encoder.calls = 0
        log_prob = policy.log_prob(out)
        assert encoder.calls == 1
        torch.testing.assert_close(log_prob, out[STEP_LOG_PROB_KEY], rtol=1e-5, atol=1e-4)
