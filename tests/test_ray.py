"""The PPO example's Ray collection (``--collector_backend ray``) on a local Ray instance.

``examples/ppo.py``'s :func:`make_collector` builds TorchRL's ``RayCollector``: one Ray
actor per worker, each a ``Collector`` over ``num_envs / W`` seeded environments, given a
CPU copy of the learner's policy. After that copy, the actors see only the weights that
``collector.update_policy_weights_(weights)`` sends (``RayWeightSyncScheme``). The test
checks it as the multi-process test does (``tests/test_scaling.py``): each batch is
rescored under the learner's weights of the moment (the rescoring drift). A batch collected
right after a sent update is at float precision; after an update that is not sent, the
drift is large.

Ray comes with the ``ray`` extra (installed by ``scripts/setup_env.sh``); without it these
tests are skipped. Starting Ray and its actors takes most of their time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from torchrl_flowpolicy import FlowSDEPolicy
from torchrl_flowpolicy.networks import MLPVelocityNetwork
from torchrl_flowpolicy.sampler import SamplerOptions

ray = pytest.importorskip("ray", reason="the ray extra is not installed: pip install '.[ray]'")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CHUNK_LENGTH, ACTION_DIM, EXECUTED, NUM_STEPS = 4, 7, 2, 4
NUM_ENVS, DECISIONS = 4, 3  # 6-step episodes of 2-step chunks: a batch is [4, 3]


@pytest.fixture(scope="module")
def local_ray():
    """A 2-CPU local Ray instance whose workers import the examples as the scripts do."""
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(EXAMPLES), "OMP_NUM_THREADS": "1"}},
    )
    yield
    ray.shutdown()


@pytest.fixture
def ppo(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import ppo

    return ppo


def make_policy() -> FlowSDEPolicy:
    torch.manual_seed(0)
    network = MLPVelocityNetwork(23, (CHUNK_LENGTH, ACTION_DIM), hidden_dim=32, num_layers=2)
    return FlowSDEPolicy(
        network,
        action_shape=(CHUNK_LENGTH, ACTION_DIM),
        executed_chunk_length=EXECUTED,
        options=SamplerOptions(num_denoising_steps=NUM_STEPS, sde_mode="all"),
    )


def rescoring_drift(policy: FlowSDEPolicy, batch) -> float:
    """Largest |log-prob under the learner's current weights - stored log-prob|."""
    with torch.no_grad():
        return (policy.log_prob(batch) - batch["flow", "step_log_prob"]).abs().max().item()


def update(policy: FlowSDEPolicy) -> None:
    """A stand-in for a learner update: every weight moves."""
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))


@pytest.mark.slow
def test_ray_workers_sample_with_the_learner_weights_once_sent(local_ray, ppo):
    config = ppo.PPOConfig(
        num_envs=NUM_ENVS,
        collector_workers=2,
        collector_backend="ray",
        max_episode_steps=EXECUTED * DECISIONS,
    )
    policy = make_policy()
    weights = TensorDict.from_module(policy)
    collector = ppo.make_collector(policy, config, EXECUTED, NUM_ENVS * DECISIONS, seed=7)
    try:
        assert isinstance(collector, ppo.RayCollector)
        batches = iter(collector)
        ppo.seed_batch(collector, config, 7)  # each actor's env.set_seed, with its offset
        first = next(batches)
        # The workers' batches, concatenated along the environments, carry the chain.
        assert first.batch_size == (NUM_ENVS, DECISIONS)
        assert first["flow", "chain"].shape == (
            NUM_ENVS,
            DECISIONS,
            NUM_STEPS + 1,
            CHUNK_LENGTH,
            ACTION_DIM,
        )
        assert first["flow", "sde_mask"][..., 1:].all()  # sde_mode="all": steps 1 .. K-1
        assert first["action"].shape == (NUM_ENVS, DECISIONS, EXECUTED, ACTION_DIM)
        # Worker w's environments follow those of the workers before it: the initial states
        # of one process with NUM_ENVS environments seeded with 7 (the batch's resets).
        reference = ppo.seeded_env(config, NUM_ENVS, EXECUTED, seed=7)
        torch.testing.assert_close(first["observation"][:, 0], reference.reset()["observation"])
        reference.close()
        drifts = [rescoring_drift(policy, first)]

        update(policy)
        collector.update_policy_weights_(weights)  # sent: the next batch uses them
        drifts.append(rescoring_drift(policy, next(batches)))
        update(policy)  # not sent: the actors keep the previous weights
        drifts.append(rescoring_drift(policy, next(batches)))
    finally:
        collector.shutdown()
    assert drifts[0] < 1e-4 and drifts[1] < 1e-4, drifts
    assert drifts[2] > 1e-2, drifts


@pytest.mark.slow  # starting Ray: about 10 s
def test_ray_collector_refuses_more_workers_than_the_cluster_has_cpus(local_ray, ppo):
    # Each actor reserves one CPU; a third would wait forever on this 2-CPU instance.
    config = ppo.PPOConfig(num_envs=3, collector_workers=3, collector_backend="ray")
    with pytest.raises(ValueError, match="needs 3 CPUs of the Ray cluster, which has 2"):
        ppo.make_collector(make_policy(), config, EXECUTED, 9, seed=0)
