"""Tile episodes' frames into one video and write it as a GIF or an MP4.

:func:`tile_episodes` puts episodes side by side (frame ``t`` shows each episode at ``t``,
outlined green or red by success once it ends); :func:`write_video` writes RGB frames to a
file. Plain numpy frames in, a file out: no environment, no torch.
:func:`~torchrl_flowpolicy.training.video.record_episodes` uses both on the frames of a seeded
evaluation.

Writers, both already dependencies: GIF with Pillow (``imageio``'s dependency, which
``gymnasium[mujoco]`` requires; plays in a browser and on the docs pages) and MP4 with
OpenCV's ``mp4v`` codec (``pip install 'torchrl_flowpolicy[robosuite]'``; files about 5x
smaller, for long or many episodes; desktop players such as VLC play it, most browsers do
not).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["FAILURE_COLOR", "SUCCESS_COLOR", "VIDEO_FORMATS", "tile_episodes", "write_video"]

VIDEO_FORMATS = (".gif", ".mp4")

SUCCESS_COLOR = (40, 200, 60)
FAILURE_COLOR = (220, 40, 40)


def _outline(frame: np.ndarray, color: tuple[int, int, int], thickness: int) -> np.ndarray:
    frame = frame.copy()
    frame[:thickness] = color
    frame[-thickness:] = color
    frame[:, :thickness] = color
    frame[:, -thickness:] = color
    return frame


def tile_episodes(
    episodes: Sequence[Sequence[np.ndarray]],
    *,
    columns: int | None = None,
    success: Sequence[bool] | None = None,
    outline_thickness: int = 4,
) -> list[np.ndarray]:
    """Tile episodes side by side into one video: frame ``t`` shows each episode at ``t``.

    The video lasts as long as the longest episode; an episode that ended earlier holds its
    last frame. With ``success``, an episode's tile is outlined (green: success, red:
    failure) from its last frame on. Tiles fill a grid row by row; empty cells are black.

    Args:
        episodes: one sequence of ``[H, W, 3]`` uint8 frames per episode, all of one size.

    Keyword Args:
        columns: tiles per row (default: all episodes in one row up to 4, else a square-ish
            grid).
        success: one flag per episode, or ``None`` for no outline.
        outline_thickness: the outline's width, pixels.

    Returns:
        The video's frames, ``[rows * H, columns * W, 3]`` uint8 each.

    Examples:
        >>> black, white = np.zeros((2, 3, 3), np.uint8), np.full((2, 3, 3), 255, np.uint8)
        >>> frames = tile_episodes([[black, white, white], [white]])
        >>> len(frames), frames[0].shape
        (3, (2, 6, 3))
        >>> int(frames[0][0, 0, 0]), int(frames[0][0, 3, 0])
        (0, 255)
    """
    if not episodes or any(len(frames) == 0 for frames in episodes):
        raise ValueError("tile_episodes needs at least one episode, each with at least one frame.")
    shape = episodes[0][0].shape
    for index, frames in enumerate(episodes):
        for frame in frames:
            if frame.shape != shape or frame.dtype != np.uint8 or frame.ndim != 3:
                raise ValueError(
                    f"every frame must be [H, W, 3] uint8 of episode 0's shape {shape}; episode "
                    f"{index} has a {frame.dtype} frame of shape {frame.shape}."
                )
    if success is not None and len(success) != len(episodes):
        raise ValueError(f"success has {len(success)} flags for {len(episodes)} episodes.")
    count = len(episodes)
    if columns is None:
        columns = count if count <= 4 else math.ceil(math.sqrt(count))
    if columns < 1:
        raise ValueError(f"columns must be >= 1, got {columns}.")
    rows = math.ceil(count / columns)
    height, width = shape[:2]
    length = max(len(frames) for frames in episodes)
    video = []
    for step in range(length):
        canvas = np.zeros((rows * height, columns * width, 3), dtype=np.uint8)
        for index, frames in enumerate(episodes):
            frame = frames[min(step, len(frames) - 1)]
            if success is not None and step >= len(frames) - 1:
                color = SUCCESS_COLOR if success[index] else FAILURE_COLOR
                frame = _outline(frame, color, outline_thickness)
            row, column = divmod(index, columns)
            canvas[row * height : (row + 1) * height, column * width : (column + 1) * width] = frame
        video.append(canvas)
    return video


def write_video(
    frames: Sequence[np.ndarray],
    path: str | Path,
    *,
    fps: float = 20.0,
    final_hold_seconds: float = 1.0,
) -> Path:
    """Write ``[H, W, 3]`` uint8 RGB frames to a GIF (Pillow) or an MP4 (OpenCV, ``mp4v``).

    The format follows the suffix of ``path`` (:data:`VIDEO_FORMATS`); the parent folder is
    created. The last frame stays on screen for ``final_hold_seconds`` more: a longer display
    time of the GIF's last frame (the GIF holds exactly ``len(frames)`` frames, fewer only if
    Pillow merges identical consecutive ones), ``round(final_hold_seconds * fps)`` copies of
    it in an MP4.

    Args:
        frames: the video, all frames of one size.
        path: the file to write, ending in ``.gif`` or ``.mp4``.

    Keyword Args:
        fps: frames per second (20: real time for Pusher-v5 and robosuite's 20 Hz control).
        final_hold_seconds: extra display time of the last frame.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Examples:
        >>> import tempfile
        >>> frames = [np.full((8, 8, 3), value, np.uint8) for value in (0, 128, 255)]
        >>> path = write_video(frames, Path(tempfile.mkdtemp()) / "ramp.gif", fps=10)
        >>> from PIL import Image
        >>> Image.open(path).n_frames
        3
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in VIDEO_FORMATS:
        raise ValueError(f"the video's path must end in one of {VIDEO_FORMATS}, got {str(path)!r}.")
    if not frames:
        raise ValueError("write_video needs at least one frame.")
    if fps <= 0 or final_hold_seconds < 0:
        raise ValueError(
            f"fps must be positive and final_hold_seconds >= 0, got {fps}, {final_hold_seconds}."
        )
    height, width = frames[0].shape[:2]
    if any(frame.shape != (height, width, 3) or frame.dtype != np.uint8 for frame in frames):
        raise ValueError(
            f"every frame must be [H, W, 3] uint8 of the first's shape {frames[0].shape}."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".gif":
        from PIL import Image

        # A palette per frame (median cut), without dithering: about 4x smaller than Pillow's
        # default conversion (dithered noise compresses badly) and 5x faster to write.
        images = [
            Image.fromarray(frame).quantize(
                colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE
            )
            for frame in frames
        ]
        frame_ms = 1000.0 / fps
        durations = [frame_ms] * len(images)
        durations[-1] += 1000.0 * final_hold_seconds
        images[0].save(path, save_all=True, append_images=images[1:], duration=durations, loop=0)
        return path
    try:
        import cv2
    except ImportError as error:  # pragma: no cover - depends on the installation
        raise ImportError(
            "MP4 videos need OpenCV: pip install 'torchrl_flowpolicy[robosuite]' (or "
            "opencv-python), or write a .gif."
        ) from error
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV could not open an mp4v writer for {str(path)!r}.")
    try:
        hold = [frames[-1]] * round(final_hold_seconds * fps)
        for frame in [*frames, *hold]:
            writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    finally:
        writer.release()
    return path
