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

The device plumbing of ``examples/ppo.py`` (``--device``) is checked on the CPU: the option
reaches the collector (policy and storing device; the simulators stay on the CPU), the
replay buffer's storage, the critic and the loss, and an unavailable device is refused
before any work. The Ray collector has its own file, ``tests/test_ray.py``.
"""

from __future__ import annotations

import functools

import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import MultiSyncCollector
from torchrl.envs.utils import ExplorationType
from torchrl.weight_update import MultiProcessWeightSyncScheme

from torchrl_flowpolicy import FlowSDEPolicy, SamplerOptions
from torchrl_flowpolicy.networks import MLPVelocityNetwork, ObservationNormalizer
from torchrl_flowpolicy.tasks import make_pusher_env
from torchrl_flowpolicy.training import collectors
from torchrl_flowpolicy.training.collectors import (
    CollectorOptions,
    first_reset_seed,
    make_collector,
    seed_batch,
)
from torchrl_flowpolicy.training.models import ModelConfig, build_policy
from torchrl_flowpolicy.training.protocol import training_seed

CHUNK_LENGTH, ACTION_DIM, EXECUTED = 4, 7, 2


def make_policy() -> FlowSDEPolicy:
    torch.manual_seed(0)
    network = MLPVelocityNetwork(23, (CHUNK_LENGTH, ACTION_DIM), hidden_dim=32, num_layers=2)
    return FlowSDEPolicy(
        network,
        action_shape=(CHUNK_LENGTH, ACTION_DIM),
        executed_chunk_length=EXECUTED,
        options=SamplerOptions(num_denoising_steps=4, sde_mode="all"),
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


# ----------------------------------------------------------------------------- the PPO example
@pytest.fixture
def ppo(example, tmp_path, monkeypatch):
    """``examples/ppo.py``, loaded from its path, run from an empty folder: its default
    ``outputs/ppo`` is then free, whatever a main job run in the clone has left there (the
    check refuses a folder holding results)."""
    monkeypatch.chdir(tmp_path)
    return example("ppo")


def example_policy() -> FlowSDEPolicy:
    """A small policy of the examples' architecture (its critic copies the normaliser)."""
    torch.manual_seed(0)
    model_config = ModelConfig(
        chunk_length=CHUNK_LENGTH, executed_chunk_length=EXECUTED, model_dim=16, num_layers=1
    )
    normalizer = ObservationNormalizer(torch.zeros(23), torch.ones(23))
    sampler = SamplerOptions(num_denoising_steps=4, sde_mode="all")
    return build_policy(model_config, normalizer, sampler)


def example_collector(ppo, config, policy, frames: int, seed: int, device="cpu"):
    """The collector ``examples/ppo.py`` builds for ``config``, and its options."""
    make_env, options = ppo.training_envs(config, EXECUTED), ppo.collector_options(config, device)
    collector = make_collector(policy, make_env, options, frames_per_batch=frames, seed=seed)
    return collector, options


def leaf_devices(tensordict) -> set[torch.device]:
    return {leaf.device for leaf in tensordict.values(include_nested=True, leaves_only=True)}


def test_ppo_device_option_defaults_to_the_cpu(ppo):
    assert ppo.parse_args([]).device == "cpu"
    assert ppo.parse_args(["--device", "cuda:1"]).device == "cuda:1"
    assert ppo.check_config(ppo.PPOConfig(), world_size=1) == torch.device("cpu")


@pytest.mark.parametrize("name", ["gpu", "cuda:99"])
def test_ppo_refuses_an_unavailable_device_up_front(ppo, name):
    if name == "cuda:99" and torch.cuda.device_count() > 99:
        pytest.skip("this machine has 100 GPUs")
    with pytest.raises(ValueError, match="--device"):
        ppo.check_config(ppo.PPOConfig(device=name), world_size=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_ppo_device_cuda_without_a_gpu_says_so(ppo):
    with pytest.raises(ValueError, match="no CUDA GPU.*--device cpu"):
        ppo.check_config(ppo.PPOConfig(device="cuda"), world_size=1)


def test_ppo_refuses_what_the_collectors_cannot_do(ppo, monkeypatch):
    with pytest.raises(ValueError, match="multiple of --collector_workers"):
        ppo.check_config(ppo.PPOConfig(num_envs=5, collector_workers=2), world_size=1)
    with pytest.raises(ValueError, match="multiple of workers=2"):  # the package's own check
        CollectorOptions(num_envs=5, workers=2)
    ray_config = ppo.PPOConfig(collector_backend="ray")
    with pytest.raises(ValueError, match="under torchrun"):
        ppo.check_config(ray_config, world_size=2)
    monkeypatch.setattr(collectors.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"torchrl_flowpolicy\[ray\]"):
        ppo.check_config(ray_config, world_size=1)


def test_ppo_collector_buffer_and_loss_on_the_configured_device(ppo):
    # What --device places: the collector's policy and stored batches, the replay buffer's
    # storage, the critic and every loss output. The simulators stay on the CPU.
    device = ppo.check_config(ppo.PPOConfig(), world_size=1)
    config = ppo.PPOConfig(num_envs=2, max_episode_steps=6, minibatch_size=3)
    policy = example_policy().to(device)
    collector, _ = example_collector(ppo, config, policy, 6, seed=0, device=device)
    try:
        assert collector.policy_device == device and collector.storing_device == device
        assert collector.env_device == torch.device("cpu")
        batch = next(iter(collector))
    finally:
        collector.shutdown()
    assert leaf_devices(batch) == {device}
    learner = ppo.make_learner(policy, config, EXECUTED)
    assert {parameter.device for parameter in learner.critic.parameters()} == {device}
    replay_buffer = ppo.make_replay_buffer(config, 6, device)
    row = ppo.ppo_iteration(learner, batch, replay_buffer, config, train_actor=True)
    assert replay_buffer.storage.device == device
    assert leaf_devices(replay_buffer.sample()) == {device}
    assert leaf_devices(learner.loss_module(replay_buffer.sample())) == {device}
    assert all(torch.isfinite(torch.tensor(value)) for value in row.values())


@pytest.mark.slow
def test_ppo_worker_processes_follow_the_learner_weights_the_example_sends(ppo):
    # examples/ppo.py --collector_workers 2: the learner's policy handed to a
    # MultiSyncCollector, devices given, the weights sent as a TensorDict after each update.
    torch.set_num_threads(1)
    config = ppo.PPOConfig(num_envs=4, collector_workers=2, max_episode_steps=6, threads=1)
    policy = example_policy()
    collector, _ = example_collector(ppo, config, policy, 12, seed=0)
    assert isinstance(collector, MultiSyncCollector)
    weights = TensorDict.from_module(policy)
    drifts = []
    try:
        batches = iter(collector)
        for _ in range(3):
            batch = next(batches)
            assert batch.batch_size == (4, 3)
            drifts.append(rescoring_drift(policy, batch))
            update(policy)
            collector.update_policy_weights_(weights)
    finally:
        collector.shutdown()
    assert max(drifts) < 1e-4, drifts


def seeded_initial_observations(ppo, config, seed: int) -> torch.Tensor:
    """The first observations of one process's ``num_envs`` environments reset with
    ``seed + i``."""
    env = ppo.training_envs(config, EXECUTED)(config.num_envs, seed)
    try:
        return env.reset()["observation"]
    finally:
        env.close()


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_ppo_batches_start_from_the_states_that_their_iteration_seeds(ppo, workers):
    # Every batch starts from fresh resets of all environments, seeded by seed_batch with
    # the iteration's training_seed (over all workers' environments), so that a collector
    # built for a resumed run starts where the uninterrupted one does.
    torch.set_num_threads(1)
    config = ppo.PPOConfig(num_envs=4, collector_workers=workers, max_episode_steps=6, threads=1)
    policy = example_policy()
    first_observations = {}
    # A run from the start, and one resumed after iteration 2 (worker processes: only that).
    for first_iteration in (1, 3) if workers == 1 else (3,):
        seed = first_reset_seed(config.seed, first_iteration, config.num_envs)
        collector, options = example_collector(ppo, config, policy, 12, seed=seed)
        try:
            batches = iter(collector)
            for iteration in range(first_iteration, 5):
                seed_batch(collector, options, first_reset_seed(config.seed, iteration, 4))
                batch = next(batches)
                assert batch.batch_size == (4, 3)  # one 6-step episode of 2-step chunks
                observations = batch["observation"][:, 0]
                first_observations.setdefault(iteration, observations)
                torch.testing.assert_close(observations, first_observations[iteration])
        finally:
            collector.shutdown()
    for iteration, observations in first_observations.items():
        seed = training_seed(config.seed, iteration, config.num_envs)
        expected = seeded_initial_observations(ppo, config, seed)
        torch.testing.assert_close(observations, expected, rtol=0, atol=0)
    assert not torch.equal(first_observations[3], first_observations[4])


@pytest.mark.parametrize("script", ["ppo", "dsrl"])
def test_examples_refuse_an_unavailable_device_before_any_work(script, tmp_path, example):
    # Before the pretraining, the environments or the output folder: nothing is made.
    module = example(script)
    output = tmp_path / "run"
    config = module.parse_args(
        ["--device", "cuda:99", "--output_dir", str(output), "--pretrained_checkpoint", "none.pt"]
    )
    if torch.cuda.device_count() > 99:
        pytest.skip("this machine has 100 GPUs")
    with pytest.raises(ValueError, match="--device cuda:99"):
        module.main(config)
    assert not output.exists()


def test_dsrl_replay_buffer_and_networks_on_the_policy_device(example):
    dsrl = example("dsrl")
    config = dsrl.parse_args(["--quick"])
    device = torch.device("cpu")
    policy = example_policy().to(device)
    noise_env = dsrl.make_noise_env(policy, config, 2, EXECUTED)
    actor, learner = dsrl.make_learner(policy, noise_env.full_action_spec_unbatched, config, 2)
    assert noise_env.device == device
    assert {leaf.device for leaf in learner.loss_module.parameters()} == {device}
    assert {leaf.device for leaf in actor.parameters()} == {device}
    assert dsrl.make_replay_buffer(config, EXECUTED, device).storage.device == device
    noise_env.close()
