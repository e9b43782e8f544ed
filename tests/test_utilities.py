"""Checkpoints, chunk datasets and episode outcomes."""

from __future__ import annotations

import os
import pickle
import stat

import pytest
import torch
from tensordict import TensorDict

from torchrl_flowpolicy.networks import ObservationNormalizer
from torchrl_flowpolicy.sampler import SamplerOptions
from torchrl_flowpolicy.training.checkpoint import atomic_write, load_checkpoint, save_checkpoint
from torchrl_flowpolicy.training.data import make_chunk_dataset
from torchrl_flowpolicy.training.evaluation import episode_outcomes


def test_atomic_write_failing_writer_keeps_the_old_file(tmp_path):
    path = tmp_path / "data.bin"
    assert atomic_write(path, lambda file: file.write(b"old")) == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # not mkstemp's private mode

    def failing(file):
        file.write(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, failing)
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["data.bin"]  # no temporary file left behind
    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(tmp_path / "new" / "other.bin", failing)
    assert os.listdir(tmp_path / "new") == []  # a failed first write creates no file
    atomic_write(path, lambda file: file.write(b"new"))
    assert path.read_bytes() == b"new"
    assert sorted(os.listdir(tmp_path)) == ["data.bin", "new"]


def test_checkpoint_round_trip_and_atomic_replace(tmp_path):
    path = tmp_path / "run" / "checkpoint.pt"
    save_checkpoint({"step": 1, "weights": torch.arange(3.0)}, path)
    save_checkpoint({"step": 2, "weights": torch.ones(3)}, path)
    state = load_checkpoint(path)
    assert state["step"] == 2
    torch.testing.assert_close(state["weights"], torch.ones(3))
    # Only the checkpoint remains: no temporary files are left behind.
    assert os.listdir(path.parent) == ["checkpoint.pt"]


def test_checkpoint_failed_write_keeps_previous(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint({"step": 1}, path)
    with pytest.raises((pickle.PicklingError, AttributeError)):
        save_checkpoint({"step": 2, "bad": lambda: None}, path)
    assert load_checkpoint(path)["step"] == 1
    assert os.listdir(tmp_path) == ["checkpoint.pt"]


def test_checkpoint_refuses_pickled_objects(tmp_path):
    path = tmp_path / "checkpoint.pt"
    torch.save({"object": ObservationNormalizer(torch.zeros(1), torch.ones(1))}, path)
    with pytest.raises(Exception, match="weights_only"):
        load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.pt")


def test_chunk_dataset_windows_stop_at_episode_end():
    actions = torch.arange(5.0)[:, None].repeat(1, 2)
    observations = torch.arange(5.0)[:, None]
    episodes = torch.tensor([0, 0, 0, 1, 1])
    data = make_chunk_dataset(observations, actions, episodes, chunk_length=3)
    assert data.shape == (5,)
    expected_first = torch.tensor([[0.0, 1.0, 2.0], [1.0, 2.0, 0.0], [2.0, 0.0, 0.0]])
    torch.testing.assert_close(data["action"][:3, :, 0], expected_first)
    torch.testing.assert_close(
        data["action"][3:, :, 1], torch.tensor([[3.0, 4.0, 0.0], [4.0, 0, 0]])
    )
    expected_mask = torch.tensor(
        [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.bool
    )
    assert torch.equal(data["action_row_mask"], expected_mask)
    torch.testing.assert_close(data["observation"], observations)


def test_chunk_dataset_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="same number of steps"):
        make_chunk_dataset(torch.zeros(3, 1), torch.zeros(2, 1), torch.zeros(3), 2)


def test_episode_outcomes_use_first_done():
    done = torch.tensor([[False, True, False], [False, False, False]])[..., None]
    rollout = TensorDict(
        {
            "next": {
                "done": done,
                "reward": torch.tensor([[1.0, 2.0, 4.0], [1.0, 1.0, 1.0]])[..., None],
                "success": torch.tensor([[False, True, False], [True, True, False]])[..., None],
            }
        },
        batch_size=[2, 3],
    )
    outcomes = episode_outcomes(rollout)
    torch.testing.assert_close(outcomes["return"], torch.tensor([3.0, 3.0]))
    assert outcomes["success"].tolist() == [True, False]
    assert outcomes["length"].tolist() == [2, 3]


def test_observation_normalizer_from_data():
    data = torch.tensor([[0.0, 5.0], [2.0, 5.0]])
    normalizer = ObservationNormalizer.from_data(data, min_scale=0.5)
    torch.testing.assert_close(normalizer.loc, torch.tensor([1.0, 5.0]))
    torch.testing.assert_close(normalizer.scale, torch.tensor([2.0**0.5, 0.5]))
    with pytest.raises(ValueError, match="scale"):
        ObservationNormalizer(torch.zeros(1), torch.zeros(1))


def test_evaluate_policy_is_reproducible_and_keeps_the_callers_rng():
    from torchrl.envs import TransformedEnv

    from torchrl_flowpolicy import FlowSDEPolicy
    from torchrl_flowpolicy.envs import BatchedGymEnv, make_chunked_env
    from torchrl_flowpolicy.networks import MLPVelocityNetwork
    from torchrl_flowpolicy.tasks import PusherTask
    from torchrl_flowpolicy.training.evaluation import evaluate_policy

    torch.manual_seed(0)
    policy = FlowSDEPolicy(
        MLPVelocityNetwork(23, (4, 7), hidden_dim=32),
        action_shape=(4, 7),
        options=SamplerOptions(eval_num_denoising_steps=4),
    )
    env = make_chunked_env(
        TransformedEnv(BatchedGymEnv("Pusher-v5", 3, max_episode_steps=8), PusherTask()), 4
    )
    state = torch.get_rng_state()
    first = evaluate_policy(policy, env, max_decisions=2, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    second = evaluate_policy(policy, env, max_decisions=2, seed=7)
    other = evaluate_policy(policy, env, max_decisions=2, seed=8)
    assert first["num_episodes"] == 3
    assert first["mean_return"] == second["mean_return"]
    assert first["mean_return"] != other["mean_return"]
