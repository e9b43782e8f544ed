"""Chunked execution on gymnasium's Pusher-v5, checked against row-by-row stepping.

The reference for every chunked rollout is an identically seeded copy of the base
environment stepped one row at a time with the same actions: a chunk stops at the first
done, the decision's reward is the sum of the executed steps' rewards, and the next
decision starts from a reset. A :class:`~torchrl.envs.transforms.StepCounter` inside the
base environment counts the executed environment steps, so an extra step would show.
"""

from __future__ import annotations

import functools

import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Bounded, Composite, Unbounded
from torchrl.envs import (
    Compose,
    DoubleToFloat,
    EnvBase,
    GymEnv,
    ParallelEnv,
    SerialEnv,
    StepCounter,
    TransformedEnv,
)
from torchrl.envs.utils import check_env_specs, step_mdp

from torchrl_flowpolicy.envs import ChunkedAction, decision_discount, make_chunked_env
from torchrl_flowpolicy.sampler import SamplerOptions

ACTION_DIM = 7
OBSERVATION_DIM = 23


def make_base_env(max_episode_steps: int = 100) -> TransformedEnv:
    """Pusher-v5 with float32 observations and a per-environment-step counter."""
    return TransformedEnv(
        GymEnv("Pusher-v5", max_episode_steps=max_episode_steps),
        Compose(DoubleToFloat(), StepCounter()),
    )


def make_batched_env(
    batched_class: type, max_episode_steps: tuple[int, ...]
) -> SerialEnv | ParallelEnv:
    """A batch of Pusher-v5 environments, one episode length per sub-environment."""
    create_env_fns = [functools.partial(make_base_env, steps) for steps in max_episode_steps]
    return batched_class(len(max_episode_steps), create_env_fns)


def random_chunks(num_decisions: int, executed_chunk_length: int, *batch: int, seed: int = 0):
    """``[*batch, T, H', 7]`` actions in the Pusher box ``[-2, 2]``."""
    generator = torch.Generator().manual_seed(seed)
    shape = (*batch, num_decisions, executed_chunk_length, ACTION_DIM)
    return torch.rand(shape, generator=generator) * 4 - 2


def replay_policy(chunks: torch.Tensor, batch_dims: int):
    """A policy writing ``chunks[..., t, :, :]`` at its ``t``-th call."""
    calls = [0]

    def policy(tensordict: TensorDictBase) -> TensorDictBase:
        index = (slice(None),) * batch_dims + (calls[0],)
        calls[0] += 1
        return tensordict.set("action", chunks[index])

    return policy


def step_row_by_row(max_episode_steps: int, seed: int, chunks: torch.Tensor) -> dict:
    """Execute ``chunks [T, H', 7]`` one row at a time on a fresh base environment.

    Returns per-decision tensors: the summed reward, the done / terminated / truncated flags
    and the observation and step count of the last executed step, the observation the
    decision started from, and the number of rows executed. Also returns the seed the
    environment handed on (``set_seed`` chains seeds through a batch of environments).
    """
    env = make_base_env(max_episode_steps)
    next_seed = env.set_seed(seed)
    num_decisions, executed_chunk_length = chunks.shape[:2]
    out = {
        "reward": torch.zeros(num_decisions, 1),
        "done": torch.zeros(num_decisions, 1, dtype=torch.bool),
        "terminated": torch.zeros(num_decisions, 1, dtype=torch.bool),
        "truncated": torch.zeros(num_decisions, 1, dtype=torch.bool),
        "observation": torch.zeros(num_decisions, OBSERVATION_DIM),
        "next_observation": torch.zeros(num_decisions, OBSERVATION_DIM),
        "next_step_count": torch.zeros(num_decisions, 1, dtype=torch.int64),
        "rows": torch.zeros(num_decisions, dtype=torch.int64),
    }
    tensordict = env.reset()
    for decision in range(num_decisions):
        out["observation"][decision] = tensordict["observation"]
        for row in range(executed_chunk_length):
            tensordict["action"] = chunks[decision, row]
            tensordict = env.step(tensordict)
            out["reward"][decision] += tensordict["next", "reward"]
            out["rows"][decision] += 1
            next_td = tensordict["next"]
            tensordict = step_mdp(tensordict)
            if next_td["done"].any():
                break
        for key in ("done", "terminated", "truncated"):
            out[key][decision] = next_td[key]
        out["next_observation"][decision] = next_td["observation"]
        out["next_step_count"][decision] = next_td["step_count"]
        if next_td["done"].any():
            tensordict = env.reset()
    env.close()
    out["next_seed"] = next_seed
    return out


def assert_matches_reference(rollout: TensorDictBase, reference: dict) -> None:
    """Compare one (unbatched) chunked rollout ``[T]`` with :func:`step_row_by_row`."""
    torch.testing.assert_close(rollout["next", "reward"], reference["reward"])
    for key in ("done", "terminated", "truncated"):
        torch.testing.assert_close(rollout["next", key], reference[key])
    torch.testing.assert_close(rollout["observation"], reference["observation"])
    torch.testing.assert_close(rollout["next", "observation"], reference["next_observation"])
    torch.testing.assert_close(rollout["next", "step_count"], reference["next_step_count"])


# ---------------------------------------------------------------------------- specs
@pytest.mark.parametrize("executed_chunk_length", [1, 4])
def test_specs_fix_the_executed_chunk_length_and_keep_the_reward_shape(executed_chunk_length):
    env = make_chunked_env(make_base_env(), executed_chunk_length)
    assert env.full_action_spec["action"].shape == (executed_chunk_length, ACTION_DIM)
    assert env.full_reward_spec["reward"].shape == (1,)
    assert env.fake_tensordict()["action"].shape == (executed_chunk_length, ACTION_DIM)
    assert env.rand_action()["action"].shape == (executed_chunk_length, ACTION_DIM)
    check_env_specs(env, seed=0)
    env.close()


def test_specs_of_a_batched_env():
    env = make_chunked_env(make_batched_env(SerialEnv, (100, 100)), 3)
    assert env.full_action_spec["action"].shape == (2, 3, ACTION_DIM)
    assert env.full_reward_spec["reward"].shape == (2, 1)
    check_env_specs(env, seed=0)
    env.close()


def test_bounded_reward_spec_is_widened_to_a_sum_of_rewards():
    # A sum of 1..3 rewards in [-1, 2] lies in [-3, 6]; one in [0.5, 2] lies in [0.5, 6].
    transform = ChunkedAction(3)
    output_spec = Composite(
        full_reward_spec=Composite(
            reward=Bounded(low=-1.0, high=2.0, shape=(1,)),
            bonus=Bounded(low=0.5, high=2.0, shape=(1,)),
            free=Unbounded(shape=(1,)),
        )
    )
    reward_spec = transform.transform_output_spec(output_spec)["full_reward_spec"]
    assert reward_spec["reward"].space.low.item() == -3.0
    assert reward_spec["reward"].space.high.item() == 6.0
    assert reward_spec["bonus"].space.low.item() == 0.5
    assert reward_spec["bonus"].space.high.item() == 6.0
    assert isinstance(reward_spec["free"], Unbounded)


def test_invalid_executed_chunk_length_is_rejected():
    with pytest.raises(ValueError, match="executed_chunk_length must be an integer >= 1"):
        ChunkedAction(0)


def test_chunk_of_the_wrong_length_raises_a_clear_error():
    env = make_chunked_env(make_base_env(), 4)
    tensordict = env.reset()
    tensordict["action"] = torch.zeros(3, ACTION_DIM)
    with pytest.raises(ValueError, match=r"executed_chunk_length must equal"):
        env.step(tensordict)
    env.close()


# ---------------------------------------------------------------------------- rewards
@pytest.mark.parametrize("executed_chunk_length", [1, 4])
def test_reward_is_the_sum_of_the_executed_steps(executed_chunk_length):
    num_decisions, seed = 5, 3
    chunks = random_chunks(num_decisions, executed_chunk_length)
    env = make_chunked_env(make_base_env(), executed_chunk_length)
    env.set_seed(seed)
    rollout = env.rollout(num_decisions, replay_policy(chunks, 0), break_when_any_done=False)
    env.close()
    reference = step_row_by_row(100, seed, chunks)
    assert not reference["done"].any()
    assert (reference["rows"] == executed_chunk_length).all()
    assert_matches_reference(rollout, reference)
    # Each decision executed exactly executed_chunk_length environment steps.
    expected_count = torch.arange(1, num_decisions + 1)[:, None] * executed_chunk_length
    assert torch.equal(rollout["next", "step_count"], expected_count)


def test_done_inside_a_chunk_stops_the_chunk_and_the_next_decision_starts_from_a_reset():
    # Episodes of 6 steps with chunks of 4: decisions execute 4, 2, 4, 2, ... steps.
    num_decisions, executed_chunk_length, seed = 6, 4, 5
    chunks = random_chunks(num_decisions, executed_chunk_length, seed=1)
    env = make_chunked_env(make_base_env(max_episode_steps=6), executed_chunk_length)
    env.set_seed(seed)
    rollout = env.rollout(num_decisions, replay_policy(chunks, 0), break_when_any_done=False)
    env.close()
    reference = step_row_by_row(6, seed, chunks)
    assert reference["rows"].tolist() == [4, 2, 4, 2, 4, 2]
    assert_matches_reference(rollout, reference)
    # The episode ends on its 6th step (truncation, not termination), never later.
    assert rollout["next", "step_count"].squeeze(-1).tolist() == [4, 6, 4, 6, 4, 6]
    assert rollout["next", "done"].squeeze(-1).tolist() == [False, True] * 3
    assert rollout["next", "truncated"].squeeze(-1).tolist() == [False, True] * 3
    assert not rollout["next", "terminated"].any()
    # The decision after a done starts from a fresh reset, not from the terminal state.
    for after_done in (2, 4):
        assert rollout["step_count"][after_done].item() == 0
        assert not torch.allclose(
            rollout["observation"][after_done], rollout["next", "observation"][after_done - 1]
        )


def test_rollout_that_breaks_at_the_first_done():
    chunks = random_chunks(6, 4, seed=2)
    env = make_chunked_env(make_base_env(max_episode_steps=6), 4)
    env.set_seed(0)
    rollout = env.rollout(6, replay_policy(chunks, 0), break_when_any_done=True)
    env.close()
    assert rollout.batch_size == (2,)
    reference = step_row_by_row(6, 0, chunks[:2])
    assert_matches_reference(rollout, reference)


# ---------------------------------------------------------------------------- batched
def check_batched_env(batched_class: type) -> None:
    # Sub-environment 0 ends its episodes after 6 steps, sub-environment 1 after 9: with
    # chunks of 4, each finishes mid-chunk while the other one goes on stepping.
    episode_lengths, executed_chunk_length, num_decisions, seed = (6, 9), 4, 6, 7
    chunks = random_chunks(num_decisions, executed_chunk_length, len(episode_lengths), seed=3)
    env = make_chunked_env(make_batched_env(batched_class, episode_lengths), executed_chunk_length)
    env.set_seed(seed)
    rollout = env.rollout(num_decisions, replay_policy(chunks, 1), break_when_any_done=False)
    env.close()
    assert rollout.batch_size == (2, num_decisions)
    rows = []
    for index, episode_length in enumerate(episode_lengths):
        reference = step_row_by_row(episode_length, seed, chunks[index])
        seed = reference["next_seed"]
        assert_matches_reference(rollout[index], reference)
        rows.append(reference["rows"].tolist())
    assert rows == [[4, 2, 4, 2, 4, 2], [4, 4, 1, 4, 4, 1]]
    # The sub-environment that finished mid-chunk took no extra step (the step count of
    # its done decision is its episode length).
    step_count = rollout["next", "step_count"].squeeze(-1)
    assert step_count.tolist() == [[4, 6, 4, 6, 4, 6], [4, 8, 9, 4, 8, 9]]


def test_batched_env_sub_env_finishing_mid_chunk_takes_no_extra_step():
    check_batched_env(SerialEnv)


@pytest.mark.slow
def test_parallel_env_sub_env_finishing_mid_chunk_takes_no_extra_step():
    check_batched_env(ParallelEnv)


def test_batched_rollout_until_all_done_skips_the_finished_sub_env():
    # break_when_all_done hands the chunked env a "_step" mask: after sub-environment 0 is
    # done (decision 2) only sub-environment 1 steps, until its own done (step 9).
    chunks = random_chunks(6, 4, 2, seed=4)
    env = make_chunked_env(make_batched_env(SerialEnv, (6, 9)), 4)
    env.set_seed(11)
    rollout = env.rollout(
        6, replay_policy(chunks, 1), break_when_any_done=False, break_when_all_done=True
    )
    env.close()
    assert rollout.batch_size == (2, 3)
    first = step_row_by_row(6, 11, chunks[0, :2])
    second = step_row_by_row(9, first["next_seed"], chunks[1, :3])
    assert_matches_reference(rollout[0, :2], first)
    assert_matches_reference(rollout[1], second)
    assert rollout["next", "step_count"].squeeze(-1).tolist() == [[4, 6, 6], [4, 8, 9]]


def test_non_batch_locked_batched_env_is_rejected():
    class UnlockedEnv(EnvBase):
        batch_locked = False

        def __init__(self):
            super().__init__(batch_size=(2,))
            self.observation_spec = Composite(observation=Unbounded((2, 1)), shape=(2,))
            self.action_spec = Unbounded((2, 1))
            self.reward_spec = Unbounded((2, 1))

        def _reset(self, tensordict):
            return self.full_observation_spec.zero().update(self.full_done_spec.zero())

        def _step(self, tensordict):
            out = self.full_observation_spec.zero().update(self.full_done_spec.zero())
            return out.update(self.full_reward_spec.zero())

        def _set_seed(self, seed):
            return seed

    env = make_chunked_env(UnlockedEnv(), 2)
    tensordict = env.reset()
    tensordict["action"] = torch.zeros(2, 2, 1)
    with pytest.raises(RuntimeError, match="batch-locked"):
        env.step(tensordict)


# ---------------------------------------------------------------------------- discount
def test_decision_discount():
    assert decision_discount(0.99, 4) == 0.99**4
    assert decision_discount(0.9, 1) == 0.9
    with pytest.raises(ValueError, match="gamma_step"):
        decision_discount(1.5, 4)
    with pytest.raises(ValueError, match="executed_chunk_length"):
        decision_discount(0.99, 0)


# ---------------------------------------------------------------------------- frame accounting
def test_env_steps_count_the_executed_environment_steps():
    # Episodes of 6 steps with chunks of 4: the decisions execute 4, 2, 4, 2, ... steps.
    env = make_chunked_env(make_base_env(max_episode_steps=6), 4)
    assert env.observation_spec["env_steps"].dtype == torch.int64
    check_env_specs(env, seed=0)
    env.set_seed(5)
    assert env.reset()["env_steps"].item() == 0
    rollout = env.rollout(6, replay_policy(random_chunks(6, 4), 0), break_when_any_done=False)
    env.close()
    assert rollout["next", "env_steps"].squeeze(-1).tolist() == [4, 2, 4, 2, 4, 2]
    executed = rollout["next", "step_count"] - rollout["step_count"]
    assert torch.equal(rollout["next", "env_steps"], executed)


def test_env_steps_of_a_batched_env_count_only_the_stepping_sub_envs():
    # As in check_batched_env: sub-environment 0 ends its episodes after 6 steps, 1 after 9.
    env = make_chunked_env(make_batched_env(SerialEnv, (6, 9)), 4)
    env.set_seed(7)
    chunks = random_chunks(6, 4, 2, seed=3)
    rollout = env.rollout(6, replay_policy(chunks, 1), break_when_any_done=False)
    env_steps = rollout["next", "env_steps"]
    assert env_steps.squeeze(-1).tolist() == [[4, 2, 4, 2, 4, 2], [4, 4, 1, 4, 4, 1]]
    assert torch.equal(env_steps, rollout["next", "step_count"] - rollout["step_count"])
    # A sub-environment that a partial step skips executes nothing.
    tensordict = env.reset().set("action", chunks[:, 0]).set("_step", torch.tensor([False, True]))
    assert env.step(tensordict)["next", "env_steps"].squeeze(-1).tolist() == [0, 4]
    env.close()


def test_env_steps_key_can_be_renamed_or_turned_off():
    renamed = TransformedEnv(make_base_env(), ChunkedAction(2, env_steps_key=("chunk", "steps")))
    assert ("chunk", "steps") in renamed.observation_spec.keys(True)
    assert renamed.rollout(2)["next", "chunk", "steps"].squeeze(-1).tolist() == [2, 2]
    off = TransformedEnv(make_base_env(), ChunkedAction(2, env_steps_key=None))
    assert "env_steps" not in off.observation_spec.keys(True)
    assert "env_steps" not in off.rollout(2)["next"].keys()


# ---------------------------------------------------------------------------- action bounds
def half_cheetah_policy(chunk_shape: tuple[int, ...], executed_chunk_length: int | None):
    """A flow policy for HalfCheetah-v5 whose actions often leave the box ``[-1, 1]``."""
    from torchrl_flowpolicy import FlowSDEPolicy
    from torchrl_flowpolicy.networks import MLPVelocityNetwork

    torch.manual_seed(0)
    network = MLPVelocityNetwork(17, chunk_shape, hidden_dim=16, num_layers=1)
    action_shape = chunk_shape[-1:] if executed_chunk_length is None else chunk_shape
    return FlowSDEPolicy(
        network,
        action_shape=action_shape,
        executed_chunk_length=executed_chunk_length,
        options=SamplerOptions(num_denoising_steps=4),
    )


@pytest.mark.parametrize("executed_chunk_length", [None, 3])
def test_clamped_actions_are_executed_clamped_and_stored_as_sampled(executed_chunk_length):
    from torchrl.envs.utils import ExplorationType, set_exploration_type

    from torchrl_flowpolicy.envs import ClampAction

    if executed_chunk_length is None:  # one action per step: the unwrapped env + ClampAction
        policy = half_cheetah_policy((1, 6), None)
        env = TransformedEnv(GymEnv("HalfCheetah-v5"), ClampAction())
    else:
        policy = half_cheetah_policy((4, 6), executed_chunk_length)
        env = make_chunked_env(GymEnv("HalfCheetah-v5"), executed_chunk_length, clamp_actions=True)
    env.set_seed(3)
    torch.manual_seed(1)
    with set_exploration_type(ExplorationType.RANDOM):
        rollout = env.rollout(5, policy)
    env.close()
    # The stored action is the policy's unclamped output, so rescoring stays exact.
    action = rollout["action"]
    assert (action.abs() > 1).any() and (action.abs() < 1).any()
    last = rollout["flow", "chain"][:, -1]
    assert torch.equal(action, last if executed_chunk_length is None else last[:, :3])
    torch.testing.assert_close(
        policy.log_prob(rollout), rollout["flow", "step_log_prob"], rtol=0, atol=1e-5
    )
    # The environment executed the clamped actions: stepping an identically seeded copy row
    # by row with the clamped actions gives the same rewards and observations, the raw
    # actions do not (HalfCheetah charges its control cost on the action it is given).
    rows = action.reshape(5, -1, 6)

    def step_rows(actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        reference = GymEnv("HalfCheetah-v5")
        reference.set_seed(3)
        tensordict, rewards, observations = reference.reset(), [], []
        for decision in actions:
            reward = 0.0
            for row in decision:
                tensordict = reference.step(tensordict.set("action", row))
                reward = reward + tensordict["next", "reward"]
                observations.append(tensordict["next", "observation"])
                tensordict = step_mdp(tensordict)
            rewards.append(reward)
        reference.close()
        return torch.stack(rewards), torch.stack(observations).reshape(5, -1, 17)[:, -1]

    clamped_reward, clamped_observation = step_rows(rows.clamp(-1, 1))
    torch.testing.assert_close(rollout["next", "reward"], clamped_reward)
    torch.testing.assert_close(rollout["next", "observation"], clamped_observation)
    raw_reward, _ = step_rows(rows)
    assert not torch.allclose(rollout["next", "reward"], raw_reward)


def test_clamp_action_reads_per_dimension_bounds_and_refuses_unbounded_actions():
    from torchrl.envs import ClipTransform

    from torchrl_flowpolicy.envs import ClampAction

    # TorchRL's ClipTransform takes scalar bounds only.
    with pytest.raises(TypeError, match="scalars"):
        ClipTransform(in_keys_inv=["action"], low=torch.zeros(2), high=torch.ones(2))
    transform = ClampAction(low=torch.tensor([-1.0, 0.0]), high=torch.tensor([1.0, 0.5]))
    action = torch.tensor([[-3.0, 3.0], [0.25, -0.25]])
    clamped = transform.inv(TensorDict({"action": action}, [2]))
    assert torch.equal(clamped["action"], torch.tensor([[-1.0, 0.5], [0.25, 0.0]]))
    assert action[0, 0] == -3.0  # the input tensordict is left as it was
    from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv

    env = TransformedEnv(ContinuousActionVecMockEnv(action_spec=Unbounded((7,))), ClampAction())
    with pytest.raises(ValueError, match="bounded"):
        env.rollout(1)
