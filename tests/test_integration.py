"""``FlowSDEPolicy`` in TorchRL's collectors and replay buffers, on a chunked Pusher-v5.

What a PPO learner relies on: the collected batches hold the policy's chain, mask and
per-step log-probs with the DESIGN.md section 3 shapes, and a minibatch drawn from a replay
buffer can be re-scored with ``policy.log_prob`` to the stored log-probs.

The collector pre-allocates its buffers from ``policy.spec``. Without a spec it would probe
the policy once at construction, outside any exploration context, where ``FlowSDEPolicy``
runs the deterministic ODE and writes ``"action"`` only, and it would then drop the flow
entries from every batch; ``test_collector_keeps_the_flow_entries`` pins this.
``auto_register_policy_transforms=False`` silences torchrl 0.14's warning that the env
lacks an ``InitTracker`` (emitted for any module policy; this one is not recurrent).
"""

from __future__ import annotations

import functools

import pytest
import torch
from tensordict import TensorDictBase
from torchrl.collectors import Collector, MultiSyncCollector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.data.replay_buffers import SamplerWithoutReplacement
from torchrl.envs import DoubleToFloat, GymEnv, SerialEnv, TransformedEnv
from torchrl.envs.utils import ExplorationType, set_exploration_type

from torchrl_flowpolicy import FlowSDEPolicy
from torchrl_flowpolicy.envs import make_chunked_env
from torchrl_flowpolicy.networks import MLPVelocityNetwork
from torchrl_flowpolicy.sampler import SamplerOptions

ACTION_DIM = 7
OBSERVATION_DIM = 23
CHUNK_LENGTH = 4
NUM_STEPS = 4
EPISODE_LENGTH = 10
FLOW_KEYS = [("flow", "chain"), ("flow", "sde_mask"), ("flow", "step_log_prob")]


def make_pusher(executed_chunk_length: int) -> TransformedEnv:
    """A chunked Pusher-v5 whose 10-step episodes end inside a chunk (10 % 3 = 1)."""
    base = TransformedEnv(GymEnv("Pusher-v5", max_episode_steps=EPISODE_LENGTH), DoubleToFloat())
    return make_chunked_env(base, executed_chunk_length)


def make_batched_pusher(executed_chunk_length: int) -> TransformedEnv:
    base = SerialEnv(
        2,
        lambda: TransformedEnv(
            GymEnv("Pusher-v5", max_episode_steps=EPISODE_LENGTH), DoubleToFloat()
        ),
    )
    return make_chunked_env(base, executed_chunk_length)


def make_policy(executed_chunk_length: int, seed: int = 0) -> FlowSDEPolicy:
    torch.manual_seed(seed)
    network = MLPVelocityNetwork(
        OBSERVATION_DIM, (CHUNK_LENGTH, ACTION_DIM), hidden_dim=32, num_layers=2
    )
    return FlowSDEPolicy(
        network,
        action_shape=(CHUNK_LENGTH, ACTION_DIM),
        executed_chunk_length=executed_chunk_length,
        options=SamplerOptions(num_denoising_steps=NUM_STEPS),
    )


def check_decisions(data: TensorDictBase, executed_chunk_length: int) -> None:
    """The DESIGN.md section 3 entries of collected decisions with batch shape ``[*B]``."""
    batch = tuple(data.batch_size)
    assert data["action"].shape == (*batch, executed_chunk_length, ACTION_DIM)
    assert data["flow", "chain"].shape == (*batch, NUM_STEPS + 1, CHUNK_LENGTH, ACTION_DIM)
    assert data["flow", "sde_mask"].shape == (*batch, NUM_STEPS)
    assert data["flow", "sde_mask"].dtype == torch.bool
    assert data["flow", "step_log_prob"].shape == (*batch, NUM_STEPS)
    assert data["action_log_prob"].shape == batch
    assert data["next", "reward"].shape == (*batch, 1)
    # The executed action is the leading rows of the chain's last state.
    assert torch.equal(data["action"], data["flow", "chain"][..., -1, :executed_chunk_length, :])
    # "mixed": exactly one stochastic step per decision, in 1..K-1.
    sde_mask = data["flow", "sde_mask"]
    assert (sde_mask.sum(-1) == 1).all()
    assert not sde_mask[..., 0].any()
    step_log_prob = data["flow", "step_log_prob"]
    assert (step_log_prob[~sde_mask] == 0).all()
    assert (step_log_prob[sde_mask] != 0).all()
    assert torch.isfinite(step_log_prob).all()
    torch.testing.assert_close(data["action_log_prob"], step_log_prob.sum(-1))


def check_replayed_log_probs(
    policy: FlowSDEPolicy, batches: list[TensorDictBase], minibatch_size: int
) -> None:
    """Minibatches drawn without replacement re-score to the stored per-step log-probs."""
    flat = torch.cat([batch.reshape(-1) for batch in batches])
    num_decisions = flat.numel()
    buffer = ReplayBuffer(
        storage=LazyTensorStorage(num_decisions),
        sampler=SamplerWithoutReplacement(),
        batch_size=minibatch_size,
    )
    buffer.extend(flat)
    assert len(buffer) == num_decisions
    seen = []
    for _ in range(num_decisions // minibatch_size):
        minibatch, info = buffer.sample(return_info=True)
        assert minibatch.batch_size == (minibatch_size,)
        seen.append(info["index"])
        recomputed = policy.log_prob(minibatch)
        assert recomputed.requires_grad
        torch.testing.assert_close(
            recomputed.detach(), minibatch["flow", "step_log_prob"], atol=1e-5, rtol=0
        )
    # Without replacement: every stored decision was drawn exactly once.
    assert sorted(torch.cat(seen).tolist()) == list(range(num_decisions))

    # The check can fail: different parameters give different log-probs.
    with torch.no_grad():
        policy.velocity_network.mlp[-1].bias.add_(0.1)
    minibatch = buffer.sample()
    difference = (policy.log_prob(minibatch).detach() - minibatch["flow", "step_log_prob"]).abs()
    assert difference.max() > 1e-3


def check_consecutive_decisions(data: TensorDictBase) -> None:
    """Within a trajectory ``[T]`` the next observation is the next decision's observation."""
    done = data["next", "done"].squeeze(-1)
    same_trajectory = ~done[:-1]
    torch.testing.assert_close(
        data["next", "observation"][:-1][same_trajectory],
        data["observation"][1:][same_trajectory],
    )
    trajectory_ids = data["collector", "traj_ids"]
    assert torch.equal(trajectory_ids[1:] == trajectory_ids[:-1], same_trajectory)


def test_policy_spec_matches_a_random_rollout_output():
    policy = make_policy(3)
    tensordict = make_pusher(3).reset().expand(5).clone()
    with set_exploration_type(ExplorationType.RANDOM):
        tensordict = policy(tensordict)
    spec = policy.spec.expand(5)
    for key, leaf in spec.items(True, True):
        assert tensordict[key].shape == leaf.shape, key
        assert tensordict[key].dtype == leaf.dtype, key
    assert spec.is_in(tensordict.select(*spec.keys(True, True)))


@pytest.mark.parametrize(
    ("make_env", "executed_chunk_length"),
    [(make_pusher, CHUNK_LENGTH), (make_batched_pusher, 3)],
    ids=["single-env-full-chunk", "serial-env-executes-3-of-4"],
)
def test_collector_keeps_the_flow_entries_and_replayed_log_probs_match(
    make_env, executed_chunk_length
):
    torch.set_num_threads(1)
    policy = make_policy(executed_chunk_length)
    frames_per_batch, total_frames = 8, 24
    collector = Collector(
        functools.partial(make_env, executed_chunk_length),
        policy,
        frames_per_batch=frames_per_batch,
        total_frames=total_frames,
        exploration_type=ExplorationType.RANDOM,
        auto_register_policy_transforms=False,
    )
    collector.set_seed(0)
    batches = []
    for data in collector:
        assert data.numel() == frames_per_batch
        check_decisions(data, executed_chunk_length)
        batches.append(data)
    collector.shutdown()
    assert len(batches) == total_frames // frames_per_batch

    # Decisions are consecutive steps of the chunked env, reset after each done.
    trajectories = torch.cat(batches, -1)
    if trajectories.ndim == 1:
        trajectories = trajectories.unsqueeze(0)
    decisions_per_episode = -(-EPISODE_LENGTH // executed_chunk_length)
    for trajectory in trajectories.unbind(0):
        check_consecutive_decisions(trajectory)
        done = trajectory["next", "done"].squeeze(-1)
        expected = (torch.arange(done.numel()) + 1) % decisions_per_episode == 0
        assert torch.equal(done, expected)

    check_replayed_log_probs(policy, batches, minibatch_size=6)


def make_pusher_for_worker() -> TransformedEnv:
    """The create-env function of each collector worker (importable by worker processes)."""
    return make_pusher(3)


@pytest.mark.slow
def test_multi_sync_collector_workers_store_log_probs_the_learner_reproduces():
    # Each worker process builds its own env; the policy is handed to the collector, which
    # ships its weights to the workers.
    torch.set_num_threads(1)
    policy = make_policy(3, seed=1)
    collector = MultiSyncCollector(
        [make_pusher_for_worker, make_pusher_for_worker],
        policy,
        frames_per_batch=8,
        total_frames=16,
        exploration_type=ExplorationType.RANDOM,
        auto_register_policy_transforms=False,
        cat_results="stack",
    )
    collector.set_seed(0)
    batches = []
    try:
        for data in collector:
            assert data.batch_size == (2, 4)
            check_decisions(data, 3)
            batches.append(data)
    finally:
        collector.shutdown()
    assert len(batches) == 2
    # The two workers are seeded differently: their first observations differ.
    assert not torch.allclose(batches[0]["observation"][0, 0], batches[0]["observation"][1, 0])
    check_replayed_log_probs(policy, batches, minibatch_size=4)
