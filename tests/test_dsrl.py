"""DSRL: the noise-action transform, the policy-side decoder and stock SAC on top of them.

The properties a DSRL learner relies on: the environment's action is the full initial noise
``[*B, H, D]`` in ``[-m, m]``; stepping with a noise executes exactly the chunk that the
frozen policy's deterministic ODE decodes from it (the same transition as stepping the
plain chunked environment with that chunk); the decoded chunk reaches the collected data;
stock ``SACLoss`` trains on the noise and never reaches the frozen model.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensordict.nn import TensorDictModule, TensorDictSequential
from tensordict.utils import NestedKey
from torch import nn
from torchrl.collectors import Collector
from torchrl.data import Bounded, LazyTensorStorage, RandomSampler, ReplayBuffer
from torchrl.envs import GymEnv, ParallelEnv, SerialEnv, TransformedEnv
from torchrl.envs.utils import ExplorationType, check_env_specs, set_exploration_type
from torchrl.modules import NormalParamExtractor, ProbabilisticActor, TanhNormal, ValueOperator
from torchrl.objectives import SACLoss, SoftUpdate

from torchrl_flowpolicy import FlowSDEPolicy
from torchrl_flowpolicy.dsrl import (
    DECODED_ACTION_KEY,
    NOISE_KEY,
    NoiseActionTransform,
    NoiseDecoder,
)
from torchrl_flowpolicy.envs import make_chunked_env
from torchrl_flowpolicy.envs.batched import BatchedGymEnv
from torchrl_flowpolicy.networks import MLPVelocityNetwork
from torchrl_flowpolicy.sampler import SamplerOptions
from torchrl_flowpolicy.tasks.pusher.env import PusherTask

ROOT = Path(__file__).resolve().parents[1]
OBSERVATION_DIM = 23
ACTION_DIM = 7
CHUNK_LENGTH = 4  # H
EXECUTED = 3  # H'
EPISODE_LENGTH = 10  # 10 steps = 3 full chunks + 1 row: the last chunk stops at the done
NUM_ENVS = 2
NEXT_DECODED = ("next", *DECODED_ACTION_KEY)  # the chunk executed by a decision


def make_policy(seed: int = 0, executed: int = EXECUTED) -> FlowSDEPolicy:
    torch.manual_seed(seed)
    network = MLPVelocityNetwork(
        OBSERVATION_DIM, (CHUNK_LENGTH, ACTION_DIM), hidden_dim=32, num_layers=2
    )
    return FlowSDEPolicy(
        network,
        action_shape=(CHUNK_LENGTH, ACTION_DIM),
        executed_chunk_length=executed,
        options=SamplerOptions(num_denoising_steps=4, eval_num_denoising_steps=5),
    )


def make_chunked_pusher(num_envs: int = NUM_ENVS, executed: int = EXECUTED) -> TransformedEnv:
    base = BatchedGymEnv("Pusher-v5", num_envs, max_episode_steps=EPISODE_LENGTH)
    return make_chunked_env(TransformedEnv(base, PusherTask()), executed)


def make_noise_pusher(policy: FlowSDEPolicy, **kwargs) -> TransformedEnv:
    return make_chunked_pusher().append_transform(NoiseActionTransform(policy, **kwargs))


def make_worker_env(policy: FlowSDEPolicy) -> TransformedEnv:
    """A worker's env; a worker process receives its own copy of ``policy`` (pickled)."""
    single = TransformedEnv(GymEnv("Pusher-v5", max_episode_steps=EPISODE_LENGTH), PusherTask())
    return make_chunked_env(single, EXECUTED).append_transform(NoiseActionTransform(policy))


def make_noise_actor(noise_bound: float = 1.5, out_key: NestedKey = "action") -> ProbabilisticActor:
    network = nn.Sequential(
        nn.Linear(OBSERVATION_DIM, 32),
        nn.LayerNorm(32),
        nn.ReLU(),
        nn.Linear(32, 2 * CHUNK_LENGTH * ACTION_DIM),
        nn.Unflatten(-1, (CHUNK_LENGTH, 2 * ACTION_DIM)),
        NormalParamExtractor(),
    )
    return ProbabilisticActor(
        TensorDictModule(network, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"],
        out_keys=[out_key],
        spec=Bounded(-noise_bound, noise_bound, (CHUNK_LENGTH, ACTION_DIM)),
        distribution_class=TanhNormal,
        distribution_kwargs={"low": -noise_bound, "high": noise_bound, "event_dims": 2},
    )


class QNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(OBSERVATION_DIM + CHUNK_LENGTH * ACTION_DIM, 32), nn.ReLU(), nn.Linear(32, 1)
        )

    def forward(self, observation, noise):
        return self.mlp(torch.cat([observation, noise.flatten(-2)], -1))


def frozen_state(policy: FlowSDEPolicy) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in policy.state_dict().items()}


# ----------------------------------------------------------------------------- specs
@pytest.mark.parametrize("noise_bound", [1.5, 0.7])
def test_action_spec_is_the_bounded_full_noise(noise_bound):
    env = make_noise_pusher(make_policy(), noise_bound=noise_bound)
    spec = env.action_spec
    assert isinstance(spec, Bounded)
    # The full initial noise x_0 of the chunk: H rows (not H'), batch dims first.
    assert spec.shape == (NUM_ENVS, CHUNK_LENGTH, ACTION_DIM)
    assert torch.equal(spec.space.low, torch.full(spec.shape, -noise_bound))
    assert torch.equal(spec.space.high, torch.full(spec.shape, noise_bound))
    assert env.action_keys == ["action"]
    decoded = env.full_observation_spec[DECODED_ACTION_KEY]
    assert decoded.shape == (NUM_ENVS, EXECUTED, ACTION_DIM)
    check_env_specs(env, seed=0)


def test_unbatched_env_and_a_separate_noise_key():
    single = TransformedEnv(GymEnv("Pusher-v5", max_episode_steps=EPISODE_LENGTH), PusherTask())
    env = make_chunked_env(single, EXECUTED).append_transform(
        NoiseActionTransform(make_policy(), noise_key=NOISE_KEY)
    )
    assert env.action_keys == [NOISE_KEY]
    assert env.full_action_spec[NOISE_KEY].shape == (CHUNK_LENGTH, ACTION_DIM)
    rollout = env.rollout(3)
    assert rollout[NOISE_KEY].shape == (3, CHUNK_LENGTH, ACTION_DIM)
    assert rollout[NEXT_DECODED].shape == (3, EXECUTED, ACTION_DIM)


def test_a_chunk_length_that_does_not_match_the_policy_is_rejected():
    env = make_chunked_pusher(executed=2)
    with pytest.raises(ValueError, match=r"executed_chunk_length"):
        env.append_transform(NoiseActionTransform(make_policy(executed=3)))
        env.action_spec  # noqa: B018  (the specs are built here at the latest)
    with pytest.raises(ValueError, match="noise_bound"):
        NoiseActionTransform(make_policy(), noise_bound=0.0)


# ----------------------------------------------------------------------------- stepping
def test_stepping_with_a_noise_executes_the_decoded_ode_chunk():
    policy = make_policy()
    noise_env = make_noise_pusher(policy)
    plain_env = make_chunked_pusher()
    noise_env.set_seed(3)
    plain_env.set_seed(3)
    noise_td, plain_td = noise_env.reset(), plain_env.reset()
    torch.manual_seed(1)
    # Four decisions: 3 + 3 + 3 + 1 rows; the last one stops at the done after one row.
    for decision in range(4):
        noise = noise_env.action_spec.rand()
        chunk = policy.decode(noise_td, noise)
        noise_td = noise_env.step(noise_td.set("action", noise))
        plain_td = plain_env.step(plain_td.set("action", chunk))
        assert torch.equal(noise_td[NEXT_DECODED], chunk)
        for key in ("observation", "reward", "done", "success"):
            assert torch.equal(noise_td["next", key], plain_td["next", key]), (decision, key)
        assert bool(noise_td["next", "done"].all()) == (decision == 3)
        noise_td, plain_td = noise_env.step_mdp(noise_td), plain_env.step_mdp(plain_td)

    # The chunk is the frozen ODE from that noise, conditioned on the current observation:
    # another noise or another observation decodes to another chunk.
    noise = noise_env.action_spec.rand()
    chunk = policy.decode(noise_td, noise)
    assert not torch.allclose(chunk, policy.decode(noise_td, -noise))
    moved = noise_td.clone().set("observation", noise_td["observation"] + 1.0)
    assert not torch.allclose(chunk, policy.decode(moved, noise))


def test_a_single_step_policy_decodes_noise_for_an_unwrapped_env():
    # action_shape=(D,): the noise and the executed action are [*B, D]; no chunked env needed.
    torch.manual_seed(0)
    network = MLPVelocityNetwork(OBSERVATION_DIM, (1, ACTION_DIM), hidden_dim=32, num_layers=2)
    policy = FlowSDEPolicy(
        network, action_shape=(ACTION_DIM,), options=SamplerOptions(eval_num_denoising_steps=5)
    )
    env = TransformedEnv(
        GymEnv("Pusher-v5", max_episode_steps=EPISODE_LENGTH), NoiseActionTransform(policy)
    )
    check_env_specs(env)
    assert env.action_spec.shape == (ACTION_DIM,)
    env.set_seed(0)
    td = env.reset()
    noise = env.action_spec.rand()
    td = env.step(td.set("action", noise))
    assert td[NEXT_DECODED].shape == (ACTION_DIM,)
    torch.testing.assert_close(td[NEXT_DECODED], policy.decode(td, noise))


def test_the_decoded_chunk_is_the_policys_ode_integrated_by_hand():
    # Independent of decode(): Euler steps x <- x + (sigma_{k+1} - sigma_k) v(x, sigma_k).
    policy = make_policy()
    env = make_noise_pusher(policy)
    env.set_seed(0)
    td = env.reset()
    noise = env.action_spec.rand()
    td = env.step(td.set("action", noise))
    sigmas = torch.linspace(1.0, 0.0, policy.options.eval_num_denoising_steps + 1)
    x = noise.clone()
    with torch.no_grad():
        for sigma, next_sigma in zip(sigmas[:-1], sigmas[1:], strict=True):
            velocity = policy.velocity_network(x, sigma.expand(NUM_ENVS), td["observation"])
            x = x + (next_sigma - sigma) * velocity
    torch.testing.assert_close(td[NEXT_DECODED], x[:, :EXECUTED])


def test_a_noise_of_the_wrong_shape_is_rejected_with_the_expected_shape():
    policy = make_policy()
    env = make_noise_pusher(policy)
    td = env.reset()
    expected = rf"expected \({NUM_ENVS}, {CHUNK_LENGTH}, {ACTION_DIM}\)"
    for wrong in [
        torch.zeros(NUM_ENVS, EXECUTED, ACTION_DIM),  # the executed chunk, not the noise
        torch.zeros(NUM_ENVS, CHUNK_LENGTH * ACTION_DIM),  # flattened
    ]:
        with pytest.raises(ValueError, match=expected):
            env.step(td.clone().set("action", wrong))
    decoder = NoiseDecoder(policy)
    with pytest.raises(ValueError, match=expected):
        decoder(td.clone().set(NOISE_KEY, torch.zeros(NUM_ENVS, 1, ACTION_DIM)))


def test_the_policy_is_frozen_and_stays_in_eval_mode():
    policy = make_policy()
    policy.train()
    env = make_noise_pusher(policy)
    assert not any(parameter.requires_grad for parameter in policy.parameters())
    assert not policy.training
    env.train()
    assert not policy.training
    td = env.rand_step(env.reset())
    assert not td[NEXT_DECODED].requires_grad


# ----------------------------------------------------------------------------- learning
def test_sac_trains_on_collected_noise_and_never_reaches_the_frozen_model():
    policy = make_policy()
    before = frozen_state(policy)
    env = make_noise_pusher(policy)
    torch.manual_seed(0)
    actor = make_noise_actor()
    collector = Collector(
        env,
        actor,
        frames_per_batch=8,
        total_frames=24,
        exploration_type=ExplorationType.RANDOM,
        auto_register_policy_transforms=False,
    )
    collector.set_seed(0)
    buffer = ReplayBuffer(storage=LazyTensorStorage(64), sampler=RandomSampler(), batch_size=16)
    for batch in collector:
        # The collected action is the noise; the executed chunk is stored next to it.
        assert batch["action"].shape == (NUM_ENVS, 4, CHUNK_LENGTH, ACTION_DIM)
        assert (batch["action"].abs() <= 1.5).all()
        chunk = batch[NEXT_DECODED]
        torch.testing.assert_close(chunk, policy.decode(batch, batch["action"]))
        buffer.extend(batch.reshape(-1))
    collector.shutdown()
    assert len(buffer) == 24

    loss_module = SACLoss(
        actor,
        ValueOperator(QNetwork(), in_keys=["observation", "action"]),
        num_qvalue_nets=2,
        action_spec=env.full_action_spec_unbatched,
    )
    assert loss_module.target_entropy.item() == -CHUNK_LENGTH * ACTION_DIM
    loss_module.make_value_estimator(gamma=0.96)
    target_updater = SoftUpdate(loss_module, tau=0.05)
    optimizer = torch.optim.Adam(loss_module.parameters(), lr=1e-3)
    actor_before = [parameter.clone() for parameter in actor.parameters()]
    for _ in range(5):
        losses = loss_module(buffer.sample())
        for name in ("loss_actor", "loss_qvalue", "loss_alpha"):
            assert torch.isfinite(losses[name]), name
        optimizer.zero_grad()
        (losses["loss_actor"] + losses["loss_qvalue"] + losses["loss_alpha"]).backward()
        optimizer.step()
        target_updater.step()
    assert any(
        not torch.equal(now, then)
        for now, then in zip(actor.parameters(), actor_before, strict=True)
    )
    # No gradient ever reached the frozen policy; its weights did not move.
    for parameter in policy.parameters():
        assert not parameter.requires_grad and parameter.grad is None
    for name, value in policy.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_policy_side_decoder_matches_the_transform_and_trains_with_set_keys():
    # The same noise actor either acts in the noise env (transform) or is followed by the
    # decoder in the plain chunked env: the two rollouts are the same transitions.
    policy = make_policy()
    torch.manual_seed(0)
    actor = make_noise_actor()
    noise_env = make_noise_pusher(policy)
    plain_env = make_chunked_pusher()
    noise_actor = make_noise_actor(out_key=NOISE_KEY)
    noise_actor.load_state_dict(actor.state_dict())
    decoding_policy = TensorDictSequential(noise_actor, NoiseDecoder(policy))
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        noise_env.set_seed(5)
        with_transform = noise_env.rollout(4, actor, break_when_any_done=False)
        plain_env.set_seed(5)
        with_decoder = plain_env.rollout(4, decoding_policy, break_when_any_done=False)
    torch.testing.assert_close(with_transform["action"], with_decoder[NOISE_KEY])
    torch.testing.assert_close(with_transform[NEXT_DECODED], with_decoder["action"])
    torch.testing.assert_close(
        with_transform["next", "observation"], with_decoder["next", "observation"]
    )

    # Stock SACLoss on the policy-side data: the loss reads the noise entry.
    qvalue = ValueOperator(
        QNetwork(), in_keys=["observation", NOISE_KEY], out_keys=["state_action_value"]
    )
    loss_module = SACLoss(noise_actor, qvalue, num_qvalue_nets=2, target_entropy=-1.0)
    loss_module.set_keys(action=NOISE_KEY)
    SoftUpdate(loss_module, tau=0.05)
    losses = loss_module(with_decoder.reshape(-1))
    (losses["loss_actor"] + losses["loss_qvalue"]).backward()
    assert all(parameter.grad is None for parameter in policy.parameters())
    assert noise_actor.module[0].module[0].weight.grad is not None


# ----------------------------------------------------------------------------- processes
def test_each_worker_of_a_parallel_env_decodes_with_its_own_copy():
    policy = make_policy()
    # "fork" keeps the test fast; spawned workers receive the policy pickled, which the
    # next test covers.
    env = ParallelEnv(2, functools.partial(make_worker_env, policy), mp_start_method="fork")
    serial = SerialEnv(2, functools.partial(make_worker_env, policy))
    try:
        assert env.action_spec.shape == (2, CHUNK_LENGTH, ACTION_DIM)
        env.set_seed(0)
        td = env.reset()
        noise = env.action_spec.rand()
        td = env.step(td.set("action", noise))
        torch.testing.assert_close(td[NEXT_DECODED], policy.decode(td, noise), rtol=0, atol=1e-6)
        # Same transitions as the same workers stepped in this process.
        serial.set_seed(0)
        serial_td = serial.step(serial.reset().set("action", noise))
        torch.testing.assert_close(td["next", "observation"], serial_td["next", "observation"])
    finally:
        env.close()
        serial.close()


def test_an_unpickled_env_decodes_with_an_identical_frozen_copy():
    policy = make_policy()
    env = make_noise_pusher(policy)
    unpickled = pickle.loads(pickle.dumps(env))
    copied_policy = unpickled.transform[-1].policy
    assert copied_policy is not policy
    assert not any(parameter.requires_grad for parameter in copied_policy.parameters())
    env.set_seed(0)
    unpickled.set_seed(0)
    noise = env.action_spec.rand()
    td = env.step(env.reset().set("action", noise))
    copy_td = unpickled.step(unpickled.reset().set("action", noise))
    assert torch.equal(td[NEXT_DECODED], copy_td[NEXT_DECODED])
    assert torch.equal(td["next", "observation"], copy_td["next", "observation"])


# ----------------------------------------------------------------------------- example
def quick_dsrl_command(tmp_path: Path, *options: str) -> list[str]:
    """``examples/dsrl.py --quick`` writing everything (pretraining included) under tmp_path."""
    return [
        sys.executable,
        str(ROOT / "examples" / "dsrl.py"),
        "--quick",
        "--output_dir", str(tmp_path / "run"),
        "--pretrained_checkpoint", str(tmp_path / "pretrain" / "policy.pt"),
        "--pretrain_if_missing",
        "--pretrain.demo_dir", str(tmp_path / "demos"),
        "--loggers", "csv",
        *options,
    ]  # fmt: skip


@pytest.mark.slow
def test_dsrl_example_quick_run_and_resume(tmp_path, check_protocol_fields):
    common = quick_dsrl_command(tmp_path)
    result = subprocess.run(common, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert (run / "learning_curve.png").stat().st_size > 0
    assert (run / "checkpoint.pt").is_file()
    assert (tmp_path / "pretrain" / "policy.pt").is_file()
    assert summary["env_steps"] == 4 * 150 * 2  # two whole episodes in each of 4 envs
    assert summary["updates"] > 0
    assert 0.0 <= summary["rl_success"] <= 1.0 and 0.0 <= summary["bc_success"] <= 1.0
    # The actor's starting point is evaluated before any update, then every 600 env steps.
    assert [row["env_steps"] for row in summary["history"]] == [0, 600, 1200]
    assert summary["history"][0]["updates"] == 0
    assert 0.0 <= summary["bc_noise_free_success"] <= 1.0
    assert (run / "csv" / "dsrl_seed0" / "scalars" / "loss" / "qvalue.csv").is_file()
    check_protocol_fields(summary, result.stdout, "DSRL", "noise_free")

    # Resuming with a larger budget continues the counters and the history.
    result = subprocess.run(
        [*common, "--resume", "--total_env_steps", "1800"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resumed from iteration" in result.stdout
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["env_steps"] == 1800
    assert resumed["updates"] > summary["updates"]
    assert [row["env_steps"] for row in resumed["history"]] == [0, 600, 1200, 1800]


@pytest.mark.slow
def test_dsrl_example_zero_mean_start_is_the_noise_free_policy(tmp_path):
    # With the actor's mean at x_0 = 0 and only critic updates, every deterministic
    # evaluation decodes x_0 = 0: exactly the frozen policy's noise-free evaluation.
    command = quick_dsrl_command(tmp_path, "--zero_mean_init", "--critic_warmup_updates", "1000000")
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["updates"] > 0
    for row in summary["history"]:
        assert row["success_rate"] == summary["bc_noise_free_success"]
        # Same ODE from x_0 = 0 through two code paths (policy forward, transform decode):
        # float rounding in the actions grows through the physics steps, by an amount that
        # depends on the machine (measured: 3e-5 on one, 2.2e-3 on another, on a return of
        # 1.9, the same before and after the policy's redesign), so the returns agree to 1 %,
        # not bit for bit; a wrong decoding moves them by far more.
        assert row["mean_return"] == pytest.approx(summary["bc_noise_free_return"], rel=1e-2)


@pytest.mark.slow
def test_dsrl_example_runs_robosuite_can(tmp_path, check_protocol_fields):
    # PickPlaceCan through the same script (demonstrations, pretraining, SAC on the noise,
    # the protocol with the expert), on a 40-step horizon to stay short: the expert needs
    # about 100 steps, so every episode fails and the point is the plumbing of the task.
    pytest.importorskip("robosuite")
    options = ["--task", "can", "--max_episode_steps", "40", "--pretrain.demo_episodes", "2"]
    options += ["--total_env_steps", "320", "--random_env_steps", "160"]
    options += ["--eval_every_env_steps", "320", "--checkpoint_every_env_steps", "160"]
    options += ["--eval_episodes", "4", "--pretrain.eval_episodes", "4"]  # robosuite is slow
    environment = {**os.environ, "WANDB_MODE": "offline", "MUJOCO_GL": "egl"}
    result = subprocess.run(
        quick_dsrl_command(tmp_path, *options),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=environment,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["config"]["task"] == "can"
    assert summary["pretrained"]["config"]["model"]["observation_dim"] == 64
    assert summary["env_steps"] == 320
    assert (tmp_path / "demos" / "can_T40_action_noise0.3_n2_seed0.pt").is_file()
    check_protocol_fields(summary, result.stdout, "DSRL", "noise_free")
    assert summary["held_out"]["success"]["expert"]["rate"] == 0.0  # 40 steps are too few
