"""Record seeded evaluation episodes to a video (GIF or MP4), rendered offscreen.

:func:`record_episodes` runs :func:`~torchrl_flowpolicy.training.evaluation.evaluate_episodes` (same
reset seeds ``seed + i``, same torch seeding, DETERMINISTIC exploration by default) while the
first ``num_episodes`` sub-environments record a frame after their reset and after every
environment step, then tiles the episodes side by side and writes the video. The success
flags it returns are those of that very rollout.

How the frames are captured. A decision executes ``H'`` environment steps inside
:class:`~torchrl_flowpolicy.envs.ChunkedAction`, so a frame per decision is not enough. The
sub-environments of a :class:`~torchrl_flowpolicy.envs.BatchedGymEnv` are plain gymnasium
environments: :func:`collect_frames` wraps them, for the duration of a ``with`` block, in
gymnasium's own :class:`~gymnasium.wrappers.RenderCollection`, which renders after each
``reset`` and ``step``. That sees every executed step whatever the chunking, and only those:
a sub-environment that finished mid-chunk or mid-rollout is skipped by the partial-step mask,
so it adds no frame. TorchRL's :class:`~torchrl.record.PixelRenderTransform` and
:class:`~torchrl.record.VideoRecorder` do not fit here: the transform calls ``render()`` on
the batched base environment (``BatchedGymEnv`` has none), writes pixels for every
sub-environment on every step (finished ones included) and would have to sit below the
chunking; the recorder writes through a TorchRL logger (MP4 through ``torchvision``, not a
dependency).

Tiling the episodes and writing the file (GIF or MP4) are
:func:`~torchrl_flowpolicy.training.video_writing.tile_episodes` and
:func:`~torchrl_flowpolicy.training.video_writing.write_video`, re-exported here.

Rendering needs an offscreen OpenGL context: set ``MUJOCO_GL=egl`` (or ``osmesa``) before
``mujoco`` is imported. Measured on a shared CPU (software EGL), 256 x 256 pixels: 32-40 ms
per Pusher-v5 frame (4 episodes of 150 steps: 20 s, against 0.6 s without rendering) and
43-53 ms per robosuite Lift step with its frame (4 episodes of 60 steps: 13 s).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gymnasium.wrappers import RenderCollection
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import Tensor
from torchrl.envs import EnvBase
from torchrl.envs.utils import ExplorationType

from torchrl_flowpolicy.envs.batched import BatchedGymEnv
from torchrl_flowpolicy.tasks.registry import get_task
from torchrl_flowpolicy.training.evaluation import evaluate_episodes
from torchrl_flowpolicy.training.video_writing import (
    FAILURE_COLOR,
    SUCCESS_COLOR,
    VIDEO_FORMATS,
    tile_episodes,
    write_video,
)

__all__ = [
    "FAILURE_COLOR",
    "SUCCESS_COLOR",
    "VIDEO_FORMATS",
    "EpisodeVideo",
    "render_options",
    "make_render_env",
    "collect_frames",
    "tile_episodes",
    "write_video",
    "record_episodes",
]


@dataclass(frozen=True)
class EpisodeVideo:
    """What :func:`record_episodes` wrote.

    Attributes:
        path: the video file.
        outcomes: the rollout's :func:`~torchrl_flowpolicy.training.evaluation.episode_outcomes`:
            ``"return"``, ``"success"``, ``"length"`` (in decisions), one entry per
            sub-environment of the batch (recorded or not).
        frames_per_episode: frames of each recorded episode: its reset, then one per
            executed environment step.
        num_frames: frames of the tiled video (the longest recorded episode's).
        seconds: wall time of the rollout (rendering included) and the writing.
    """

    path: Path
    outcomes: dict[str, Tensor]
    frames_per_episode: list[int]
    num_frames: int
    seconds: float

    @property
    def success(self) -> list[bool]:
        """The recorded episodes' success flags, in tile order."""
        return self.outcomes["success"][: len(self.frames_per_episode)].tolist()


def render_options(
    task: str, *, height: int = 256, width: int = 256, camera: str | None = None
) -> dict[str, Any]:
    """The options of ``get_task(task).make_env`` that make it render ``height x width``
    frames offscreen (the task's
    :attr:`~torchrl_flowpolicy.tasks.registry.Task.render_options`).

    Pusher-v5 takes gymnasium MuJoCo's ``width`` / ``height`` / ``camera_name`` (default: a
    view from behind the shoulder); robosuite's
    :class:`~torchrl_flowpolicy.tasks.robosuite.env.RobosuiteGymEnv` its ``render_width`` /
    ``render_height`` / ``camera_name`` (default ``"frontview"``).

    Args:
        task: the task's name (:func:`~torchrl_flowpolicy.tasks.registry.get_task`).

    Keyword Args:
        height: frame height, pixels.
        width: frame width, pixels.
        camera: a named camera of the task's model, or ``None`` for the default view.

    Examples:
        >>> render_options("lift", height=128, width=160)
        {'render_mode': 'rgb_array', 'render_height': 128, 'render_width': 160}
    """
    spec = get_task(task)  # a clear error for an unknown task
    if height < 1 or width < 1:
        raise ValueError(f"height and width must be >= 1, got {height}, {width}.")
    return spec.render_options(height, width, camera)


def make_render_env(
    task: str,
    num_envs: int,
    executed_chunk_length: int | None = None,
    *,
    height: int = 256,
    width: int = 256,
    camera: str | None = None,
    **task_options: Any,
) -> EnvBase:
    """The task's batched environment (:attr:`~torchrl_flowpolicy.tasks.registry.Task.make_env`)
    with offscreen rendering on, for :func:`record_episodes`.

    Apart from rendering it is the environment the examples evaluate in: same options, same
    seeding, same chunking.

    Args:
        task: the task's name.
        num_envs: the batch size (one episode per sub-environment).
        executed_chunk_length: ``H'`` actions per decision, or ``None`` for one per step.

    Keyword Args:
        height: as for :func:`render_options`.
        width: as for :func:`render_options`.
        camera: as for :func:`render_options`.
        **task_options: the task's options (e.g. ``max_episode_steps``).
    """
    options = render_options(task, height=height, width=width, camera=camera)
    return get_task(task).make_env(num_envs, executed_chunk_length, **options, **task_options)


@contextmanager
def collect_frames(
    env: EnvBase, num_episodes: int | None = None
) -> Iterator[list[RenderCollection]]:
    """Within the block, the first ``num_episodes`` sub-environments of ``env`` record frames.

    Each of them is wrapped in gymnasium's :class:`~gymnasium.wrappers.RenderCollection`
    (the module docstring says why): its ``frame_list`` holds one ``[H, W, 3]`` uint8 frame
    for its last reset and one for each step since. The sub-environments are unwrapped again
    when the block ends.

    Args:
        env: a TorchRL environment whose base is a
            :class:`~torchrl_flowpolicy.envs.BatchedGymEnv` of environments built with
            ``render_mode="rgb_array"`` (:func:`make_render_env`), chunked or not.
        num_episodes: how many sub-environments record (the first ones); ``None``: all.

    Yields:
        The ``num_episodes`` wrappers, in sub-environment order.
    """
    base = getattr(env, "base_env", env)
    if not isinstance(base, BatchedGymEnv):
        raise TypeError(
            f"collect_frames needs an environment built on a BatchedGymEnv (e.g. "
            f"make_render_env(task, num_envs, ...)), got {type(base).__name__}."
        )
    num_episodes = len(base.envs) if num_episodes is None else num_episodes
    if not 1 <= num_episodes <= len(base.envs):
        raise ValueError(
            f"num_episodes must be in [1, {len(base.envs)}] (the batch size), got {num_episodes}."
        )
    originals = base.envs[:num_episodes]
    modes = [sub_env.render_mode for sub_env in originals]
    if any(mode != "rgb_array" for mode in modes):
        raise ValueError(
            f"the sub-environments must render offscreen (render_mode='rgb_array'), got "
            f"{modes[0]!r}: build the environment with make_render_env or the options of "
            f"render_options(task)."
        )
    collectors = [RenderCollection(sub_env, pop_frames=False) for sub_env in originals]
    base.envs[:num_episodes] = collectors
    try:
        yield collectors
    finally:
        base.envs[:num_episodes] = originals


def record_episodes(
    policy: TensorDictModuleBase,
    env: EnvBase,
    path: str | Path,
    *,
    max_decisions: int,
    seed: int,
    num_episodes: int | None = None,
    fps: float | None = None,
    columns: int | None = None,
    final_hold_seconds: float = 1.0,
    exploration_type: ExplorationType = ExplorationType.DETERMINISTIC,
    success_key: NestedKey = "success",
) -> EpisodeVideo:
    """Evaluate ``policy`` on seeded episodes and write the first ``num_episodes`` to a video.

    The rollout is :func:`~torchrl_flowpolicy.training.evaluation.evaluate_episodes` itself, seeded
    with ``seed`` (sub-environment ``i`` resets with ``seed + i``; torch's RNG is seeded in a
    forked state), so the outcomes are those of an evaluation of the same batch with the same
    seed. Rendering reads the simulator without changing it. The episodes are tiled side by
    side (:func:`tile_episodes`, outlined green or red by success once they end) and written
    by :func:`write_video`.

    Pairing with a larger evaluation: with ``env``'s batch of ``N`` sub-environments, episode
    ``i`` starts from the state of an ``M``-episode evaluation's episode ``i`` (same reset
    seed); a policy that draws no noise (a flow policy's noise-free decoding, a clean scripted
    expert) then repeats it exactly, while a flow policy's sampled initial noise is drawn for
    ``N`` episodes, not ``M``, so it differs. Two policies recorded with the same ``seed`` and
    batch size (before and after RL) share their states and noise.

    Args:
        policy: the policy (e.g. a :class:`~torchrl_flowpolicy.FlowSDEPolicy`, a scripted
            expert).
        env: a batched environment with offscreen rendering (:func:`make_render_env`); its
            episodes must end within ``max_decisions``. Not closed here.
        path: the video file, ``.gif`` or ``.mp4``.

    Keyword Args:
        max_decisions: the rollout length in decisions (covering one episode).
        seed: the evaluation seed (e.g. :func:`~torchrl_flowpolicy.training.protocol.split_seed`).
        num_episodes: how many episodes to record, the first sub-environments (default: all).
        fps: frames per second (default: the environment's ``render_fps``, real time).
        columns: tiles per row (:func:`tile_episodes`).
        final_hold_seconds: extra display time of the last frame (:func:`write_video`).
        exploration_type: DETERMINISTIC (the evaluation decoding) or RANDOM.
        success_key: the success entry.

    Returns:
        An :class:`EpisodeVideo`: the path, the outcomes, the frame counts.

    Examples:
        >>> import tempfile
        >>> from torchrl_flowpolicy import FlowSDEPolicy
        >>> from torchrl_flowpolicy.networks import MLPVelocityNetwork
        >>> network = MLPVelocityNetwork(observation_dim=23, action_shape=(4, 7))
        >>> policy = FlowSDEPolicy(network, action_shape=(4, 7), executed_chunk_length=2)
        >>> env = make_render_env("pusher", 2, 2, height=64, width=64, max_episode_steps=4)
        >>> video = record_episodes(policy, env, Path(tempfile.mkdtemp()) / "pusher.gif",
        ...                         max_decisions=2, seed=20_000)
        >>> env.close()
        >>> video.frames_per_episode, video.num_frames  # the reset, then 4 steps
        ([5, 5], 5)
    """
    start = time.perf_counter()
    with collect_frames(env, num_episodes) as collectors:
        outcomes = evaluate_episodes(
            policy,
            env,
            max_decisions=max_decisions,
            seed=seed,
            exploration_type=exploration_type,
            success_key=success_key,
        )
        episodes = [collector.frame_list for collector in collectors]
        if fps is None:
            fps = collectors[0].env.metadata.get("render_fps") or 20.0
    success = outcomes["success"][: len(episodes)].tolist()
    frames = tile_episodes(episodes, columns=columns, success=success)
    write_video(frames, path, fps=fps, final_hold_seconds=final_hold_seconds)
    return EpisodeVideo(
        path=Path(path),
        outcomes=outcomes,
        frames_per_episode=[len(frames_of_one) for frames_of_one in episodes],
        num_frames=len(frames),
        seconds=time.perf_counter() - start,
    )
