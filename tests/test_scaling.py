"""Scaling out with TorchRL's own machinery: collector processes that follow the learner.

``MultiSyncCollector`` runs each worker's copy of the policy in its own process. After a
learner update, ``collector.update_policy_weights_()`` sends the new weights; the next batch
must then be sampled by the updated policy, which the learner checks by rescoring the stored
chains (the rescoring drift, :meth:`~torchrl_flowpolicy.FlowSDEPolicy.log_prob` against the
stored ``step_log_prob``).

Two set-ups, measured here. Workers that build their own policy (``policy_factory``) with
``MultiProcessWeightSyncScheme`` (weights sent through queues) keep the old weights until
the call, and the drift is large without it. Given the learner's policy itself on CPU (what
the examples do), TorchRL moves its parameters to shared memory: the optimiser's in-place
steps reach the workers directly, and the call only synchronises. The examples call it after
every update either way, so they stay correct on any device and scheme.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torchrl.collectors import MultiSyncCollector
from torchrl.envs.utils import ExplorationType
from torchrl.weight_update import MultiProcessWeightSyncScheme

from torchrl_flowpolicy import FlowSDEPolicy
from torchrl_flowpolicy.envs import make_pusher_env
from torchrl_flowpolicy.networks import MLPVelocityNetwork

CHUNK_LENGTH, ACTION_DIM, EXECUTED = 4, 7, 2


def make_policy() -> FlowSDEPolicy:
    torch.manual_seed(0)
    network = MLPVelocityNetwork(23, (CHUNK_LENGTH, ACTION_DIM), hidden_dim=32, num_layers=2)
    return FlowSDEPolicy(
        network,
        action_shape=(CHUNK_LENGTH, ACTION_DIM),
        num_steps=4,
        executed_chunk_length=EXECUTED,
        sde_mode="all",
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


def run_collector(learner: FlowSDEPolicy, sync: bool, **collector_options) -> list[float]:
    """Three batches of 2 workers x 2 envs x 3 decisions; after each, the ``learner``'s
    policy moves and, with ``sync``, the collector sends its weights. Returns each
    batch's rescoring drift under the learner's weights at the time the batch arrived."""
    torch.set_num_threads(1)
    make_env = functools.partial(make_pusher_env, 2, EXECUTED, max_episode_steps=6)
    collector = MultiSyncCollector(
        [make_env, make_env],
        frames_per_batch=12,
        total_frames=36,
        exploration_type=ExplorationType.RANDOM,
        auto_register_policy_transforms=False,
        cat_results=0,
        **collector_options,
    )
    drifts = []
    try:
        for batch in collector:
            assert batch.batch_size == (4, 3)
            drifts.append(rescoring_drift(learner, batch))
            update(learner)
            if sync:
                collector.update_policy_weights_(learner)
    finally:
        collector.shutdown()
    return drifts


@pytest.mark.slow
@pytest.mark.parametrize("sync", [True, False], ids=["synced", "not-synced"])
def test_workers_with_their_own_policy_follow_the_learner_only_when_synced(sync):
    # Each worker builds its policy (policy_factory, same seed: same initial weights) and
    # receives weights through queues only: the call is what moves them.
    scheme = MultiProcessWeightSyncScheme()
    drifts = run_collector(
        make_policy(), sync, policy_factory=make_policy, weight_sync_schemes={"policy": scheme}
    )
    assert drifts[0] < 1e-4
    if sync:
        assert max(drifts) < 1e-4, drifts
    else:
        assert min(drifts[1:]) > 1e-2, drifts


@pytest.mark.slow
def test_workers_given_the_policy_share_its_memory_on_cpu():
    # The examples' configuration: the learner's policy is handed to the collector, which
    # puts its weights in shared memory (CPU); the workers sample with the updated weights.
    policy = make_policy()
    drifts = run_collector(policy, sync=True, policy=policy)
    assert all(parameter.is_shared() for parameter in policy.parameters())
    assert max(drifts) < 1e-4, drifts
