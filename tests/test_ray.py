"""Ray collection (``examples/ppo.py --collector_backend ray``) on a local Ray instance.

:func:`torchrl_flowpolicy.training.collectors.make_collector` with ``backend="ray"`` builds TorchRL's
``RayCollector``: one Ray
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
from torchrl_flowpolicy.training.collectors import (
    CollectorOptions,
    TaskEnvFactory,
    make_collector,
    seed_batch,
)

ray = pytest.importorskip("ray", reason="the ray extra is not installed: pip install '.[ray]'")

ROOT = Path(__file__).resolve().parents[1]
CHUNK_LENGTH, ACTION_DIM, EXECUTED, NUM_STEPS = 4, 7, 2, 4
NUM_ENVS, DECISIONS = 4, 3  # 6-step episodes of 2-step chunks: a batch is [4, 3]


@pytest.fixture(scope="module")
def local_ray():
    """A 2-CPU local Ray instance whose workers import this checkout's package."""
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}},
    )
    yield
    ray.shutdown()


def pusher_envs() -> TaskEnvFactory:
    """Pusher with 6-step episodes of 2-step chunks, as the example's collectors build it."""
    return TaskEnvFactory("pusher", EXECUTED, {"max_episode_steps": EXECUTED * DECISIONS})


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
def test_ray_workers_sample_with_the_learner_weights_once_sent(local_ray):
    from torchrl.collectors.distributed import RayCollector

    options = CollectorOptions(num_envs=NUM_ENVS, workers=2, backend="ray")
    policy = make_policy()
    weights = TensorDict.from_module(policy)
    frames = NUM_ENVS * DECISIONS
    collector = make_collector(policy, pusher_envs(), options, frames_per_batch=frames, seed=7)
    try:
        assert isinstance(collector, RayCollector)
        batches = iter(collector)
        seed_batch(collector, options, 7)  # each actor's env.set_seed, with its offset
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
        reference = pusher_envs()(NUM_ENVS, 7)
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
def test_ray_collector_refuses_more_workers_than_the_cluster_has_cpus(local_ray):
    # Each actor reserves one CPU; a third would wait forever on this 2-CPU instance.
    options = CollectorOptions(num_envs=3, workers=3, backend="ray")
    with pytest.raises(ValueError, match="needs 3 CPUs of the Ray cluster, which has 2"):
        make_collector(make_policy(), pusher_envs(), options, frames_per_batch=9, seed=0)
