"""Recording evaluation episodes (``torchrl_flowpolicy.training.video``): frames on every executed
environment step, the same outcomes as an unrecorded evaluation, GIF and MP4 files, and
``examples/evaluate.py --video_episodes``. Skipped where MuJoCo cannot render offscreen
(run with ``MUJOCO_GL=egl``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageSequence

from torchrl_flowpolicy import FlowSDEPolicy
from torchrl_flowpolicy.networks import MLPVelocityNetwork, ObservationNormalizer
from torchrl_flowpolicy.sampler import SamplerOptions
from torchrl_flowpolicy.tasks import get_task, make_pusher_env
from torchrl_flowpolicy.training.evaluation import evaluate_episodes
from torchrl_flowpolicy.training.video import (
    FAILURE_COLOR,
    SUCCESS_COLOR,
    collect_frames,
    make_render_env,
    record_episodes,
    tile_episodes,
    write_video,
)

ROOT = Path(__file__).resolve().parents[1]
SIZE = 48  # frame height and width: small, fast
SEED = 20_000


@pytest.fixture(scope="module")
def offscreen_rendering():
    """Skip the tests that render when MuJoCo has no offscreen context (e.g. no MUJOCO_GL)."""
    env = make_render_env("pusher", 1, height=SIZE, width=SIZE, max_episode_steps=2)
    try:
        env.base_env.envs[0].reset(seed=0)
        frame = env.base_env.envs[0].render()
    except Exception as error:  # any backend failure means: cannot render here
        pytest.skip(f"offscreen MuJoCo rendering unavailable (set MUJOCO_GL=egl): {error}")
    finally:
        env.close()
    assert frame.shape == (SIZE, SIZE, 3) and frame.dtype == np.uint8


def tiny_policy(observation_dim: int, executed_chunk_length: int = 4) -> FlowSDEPolicy:
    torch.manual_seed(0)
    network = MLPVelocityNetwork(observation_dim, (8, 7), hidden_dim=32, num_layers=2)
    return FlowSDEPolicy(
        network,
        action_shape=(8, 7),
        executed_chunk_length=executed_chunk_length,
        options=SamplerOptions(eval_num_denoising_steps=4),
    )


def gif_frames(path: Path) -> list[np.ndarray]:
    with Image.open(path) as image:
        return [np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(image)]


def test_pusher_frames_on_every_executed_step_and_same_outcomes(offscreen_rendering, tmp_path):
    # 6 steps in chunks of 4: the second decision executes only 2 rows before the time limit.
    options = {"max_episode_steps": 6, "success_threshold": 0.25}
    policy = tiny_policy(23)
    env = make_render_env("pusher", 3, 4, height=SIZE, width=SIZE, **options)
    try:
        video = record_episodes(
            policy, env, tmp_path / "pusher.gif", max_decisions=2, seed=SEED, num_episodes=2
        )
    finally:
        env.close()

    # One frame at the reset, one per executed env step (4 + 2); the unrecorded third
    # sub-environment still ran, so the outcomes cover all three.
    assert video.frames_per_episode == [7, 7]
    assert video.num_frames == 7
    assert video.outcomes["success"].shape == (3,)
    # Rendering does not change the simulation: an unrecorded evaluation, same seed, same batch.
    plain = make_pusher_env(3, 4, **options)
    expected = evaluate_episodes(policy, plain, max_decisions=2, seed=SEED)
    plain.close()
    assert video.success == expected["success"][:2].tolist()
    torch.testing.assert_close(video.outcomes["return"], expected["return"], rtol=0, atol=0)

    frames = gif_frames(video.path)
    assert len(frames) == 7
    assert frames[0].shape == (SIZE, 2 * SIZE, 3)  # two tiles side by side
    assert len({frame.tobytes() for frame in frames}) == 7  # the arm moves on every step
    assert not np.array_equal(frames[0][:, :SIZE], frames[0][:, SIZE:])  # two initial states
    # Both episodes end on the last frame, outlined by their success (GIF colours are close).
    for index, succeeded in enumerate(video.success):
        corner = frames[-1][0, index * SIZE].astype(int)
        color = SUCCESS_COLOR if succeeded else FAILURE_COLOR
        assert np.abs(corner - np.array(color)).max() <= 12, (corner, color)


def test_scripted_expert_unchunked_and_mp4(offscreen_rendering, tmp_path):
    cv2 = pytest.importorskip("cv2")
    task = get_task("pusher")
    env = make_render_env("pusher", 2, None, height=SIZE, width=SIZE, max_episode_steps=5)
    try:
        expert = task.make_expert(env)
        video = record_episodes(
            expert, env, tmp_path / "expert.mp4", max_decisions=5, seed=SEED, fps=10
        )
    finally:
        env.close()
    assert video.frames_per_episode == [6, 6]
    capture = cv2.VideoCapture(str(video.path))
    written = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
    width = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH))
    capture.release()
    assert written == 6 + 10  # + the last frame held 1 s at 10 fps
    assert width == 2 * SIZE


def test_collect_frames_restores_the_environment_and_checks_rendering(tmp_path):
    env = make_render_env("pusher", 2, 4, height=SIZE, width=SIZE, max_episode_steps=4)
    originals = list(env.base_env.envs)
    with pytest.raises(RuntimeError, match="inside"):
        with collect_frames(env, 1) as collectors:
            assert env.base_env.envs[0] is collectors[0] and env.base_env.envs[1] is originals[1]
            raise RuntimeError("inside")
    assert env.base_env.envs == originals
    with pytest.raises(ValueError, match="num_episodes"):
        with collect_frames(env, 3):
            pass
    env.close()

    unrendered = make_pusher_env(1, 4, max_episode_steps=4)
    with pytest.raises(ValueError, match="render_mode='rgb_array'"):
        with collect_frames(unrendered):
            pass
    unrendered.close()
    with pytest.raises(ValueError, match=r"\.gif"):
        write_video([np.zeros((4, 4, 3), np.uint8)], tmp_path / "video.avi")


def test_tile_episodes_holds_finished_episodes_and_fills_a_grid():
    def episode(values: list[int]) -> list[np.ndarray]:
        return [np.full((4, 6, 3), value, np.uint8) for value in values]

    frames = tile_episodes(
        [episode([10, 20, 30]), episode([40]), episode([50, 60])],
        columns=2,
        success=[True, False, True],
        outline_thickness=1,
    )
    assert len(frames) == 3 and frames[0].shape == (8, 12, 3)
    last = frames[-1]
    assert last[2, 2].tolist() == [30] * 3  # episode 0, inside its outline
    assert last[0, 0].tolist() == list(SUCCESS_COLOR)
    assert frames[0][0, 6].tolist() == list(FAILURE_COLOR)  # episode 1 ended at its reset
    assert frames[2][2, 8].tolist() == [40] * 3  # ... and holds its only frame
    assert frames[0][5, 2].tolist() == [50] * 3 and frames[0][4, 0].tolist() == [50] * 3
    assert frames[1][4, 0].tolist() == list(SUCCESS_COLOR)  # episode 2 ends at frame 1
    assert frames[0][5, 8].tolist() == [0, 0, 0]  # the empty cell
    with pytest.raises(ValueError, match="episode 1"):
        tile_episodes([episode([1]), [np.zeros((4, 5, 3), np.uint8)]])


def test_lift_recording_matches_evaluation(offscreen_rendering, tmp_path):
    pytest.importorskip("robosuite")
    from torchrl_flowpolicy.tasks.robosuite.env import make_robosuite_env

    policy = tiny_policy(60)
    env = make_render_env("lift", 2, 4, height=SIZE, width=SIZE, max_episode_steps=8)
    try:
        video = record_episodes(policy, env, tmp_path / "lift.gif", max_decisions=2, seed=SEED)
    finally:
        env.close()
    plain = make_robosuite_env(2, 4, max_episode_steps=8)
    expected = evaluate_episodes(policy, plain, max_decisions=2, seed=SEED)
    plain.close()
    assert video.success == expected["success"].tolist()
    torch.testing.assert_close(video.outcomes["length"], expected["length"], rtol=0, atol=0)
    for frames, succeeded in zip(video.frames_per_episode, video.success, strict=True):
        assert frames == 9 or (succeeded and frames < 9)  # success may end it early
    frames = gif_frames(video.path)
    assert frames[0].shape == (SIZE, 2 * SIZE, 3)
    assert not np.array_equal(frames[0], frames[-1])


@pytest.mark.slow
def test_evaluate_example_writes_one_video_per_checkpoint_and_scale(offscreen_rendering, tmp_path):
    from torchrl_flowpolicy.training.models import ModelConfig, build_policy, save_policy

    torch.manual_seed(0)
    model_config = ModelConfig(model_dim=16, num_heads=2, num_layers=1)
    size = model_config.observation_dim
    normalizer = ObservationNormalizer(torch.zeros(size), torch.ones(size))
    save_policy(tmp_path / "policy.pt", build_policy(model_config, normalizer), model_config)
    output = tmp_path / "evaluation.json"
    command = [
        sys.executable,
        str(ROOT / "examples" / "evaluate.py"),
        "--checkpoints", str(tmp_path / "policy.pt"),
        "--eval_noise_scales", "1.0,0.0",
        "--eval_episodes", "3",
        "--expert",
        "--max_episode_steps", "8",
        "--eval_num_denoising_steps", "2",
        "--video_episodes", "2",
        "--video_size", str(SIZE),
        "--video_dir", str(tmp_path / "videos"),
        "--output_json", str(output),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    videos = json.loads(output.read_text())["videos"]
    names = [Path(video["path"]).name for video in videos]
    stem = f"{tmp_path.name}-policy"
    assert names == ["expert.gif", f"{stem}-scale1.gif", f"{stem}-scale0.gif"]
    for video in videos:
        assert Path(video["path"]).is_file()
        assert video["frames_per_episode"] == [9, 9] and len(video["episode_success"]) == 2
    # Noise-free decoding and the expert draw no noise: the recorded episodes are the
    # evaluation's first two.
    rows = json.loads(output.read_text())["rows"]
    assert videos[0]["episode_success"] == rows[0]["episode_success"][:2]
    assert videos[2]["episode_success"] == rows[2]["episode_success"][:2]
    assert "video" in result.stdout
