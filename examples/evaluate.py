"""Evaluate flow-policy checkpoints (and the scripted expert) on one seed split of a task
(Pusher-v5 by default, robosuite Lift with ``--task lift``).

Loads each checkpoint (``examples/pretrain.py``'s ``policy.pt`` or ``examples/ppo.py``'s
``checkpoint.pt``: both store ``"policy"`` and ``"model_config"``), and runs
``eval_episodes`` episodes of the ``split``'s seed range (``torchrl_flowpolicy.training.protocol``:
``curve`` from 10000, the learning curves; ``validation`` from 20000, for choosing defaults,
hyper-parameters and the reported decoding; ``held_out`` from 30000, final numbers only)
with the deterministic ODE (``eval_num_denoising_steps``) once per scale in ``eval_noise_scales``: the
ODE starts from ``x_0 = scale * N(0, I)``. Scale 1 is the ``"sampled"`` decoding (the
model's own chunk distribution, that of every learning curve); scale 0 the ``"noise_free"``
chunk ``x_0 = 0``. With ``uniform_noise_bounds`` it also decodes noise drawn uniformly from
``[-m, m]^(H x D)`` for each bound ``m`` (through DSRL's
:class:`~torchrl_flowpolicy.dsrl.NoiseActionTransform`): how good the frozen policy is
anywhere in a DSRL noise box, before any training. With ``--expert`` the clean scripted
expert runs on the same states. With ``--failure_kinds`` each row also counts its episodes
by why they failed, for a task whose registry entry sorts them (``Task.episode_kinds``;
PickPlaceCan: never lifted, not released, fallen over, released upright elsewhere,
:mod:`torchrl_flowpolicy.tasks.robosuite.can_outcomes`). Every evaluation uses the same states and the
same initial noise (paired). Prints one line per evaluation with its Wilson 95 % interval and writes
them, with the per-episode successes, to ``output_json``. With ``--baseline`` (a pretrained
checkpoint) every checkpoint is also compared with it under the evaluation protocol
(``torchrl_flowpolicy.training.protocol.protocol_summary``): both decodings of each, the expert on the
same states, the paired differences to the baseline's best decoding and to the expert; this
is the command behind the held-out numbers of ``docs/results.md``.

With ``--video_episodes N`` it also records the split's first ``N`` episodes of every
checkpoint, at every scale, and of the expert with ``--expert``, to one video each in
``video_dir`` (:func:`~torchrl_flowpolicy.training.video.record_episodes`: rendered offscreen, so run
with ``MUJOCO_GL=egl``; the episodes side by side, outlined green or red by success once they
end). The video runs its own ``N``-episode evaluation on the same reset seeds: under scale 0
and for the expert its episodes are exactly the evaluation's first ``N``; under a sampled
scale the initial noise is drawn for ``N`` episodes, so their outcomes may differ from the
evaluation's (they are printed and written with the videos). Pass the pretrained and the
fine-tuned checkpoint to see the same states before and after RL.

Every option, list item, path and checkpoint is checked before the first evaluation
(:func:`check_config`); an existing ``output_json`` (or video) is replaced only with
``--overwrite``, and never when it is one of the inputs.

Examples::

    python examples/evaluate.py --split validation --expert \\
        --checkpoints outputs/pretrain_seed0/policy.pt,outputs/ppo_seed0/checkpoint.pt
    python examples/evaluate.py --split held_out --eval_episodes 200 \\
        --baseline outputs/pretrain/policy.pt --checkpoints outputs/ppo/checkpoint.pt
    MUJOCO_GL=egl python examples/evaluate.py --task lift --eval_episodes 50 \\
        --eval_noise_scales 0.0 --video_episodes 4 --video_dir outputs/videos \\
        --checkpoints outputs/pretrain_lift/policy.pt,outputs/ppo_lift/checkpoint.pt
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
from tensordict.nn import TensorDictModuleBase
from torchrl.envs import EnvBase
from torchrl.modules import RandomPolicy
from tqdm import tqdm

from torchrl_flowpolicy.dsrl import NoiseActionTransform
from torchrl_flowpolicy.tasks import TASKS, get_task
from torchrl_flowpolicy.tasks.registry import script_defaults
from torchrl_flowpolicy.training.evaluation import evaluate_decodings, evaluate_episodes
from torchrl_flowpolicy.training.models import SavedPolicy, load_policy_checkpoint
from torchrl_flowpolicy.training.protocol import (
    SPLIT_SIZE,
    format_protocol,
    protocol_summary,
    split_seed,
)
from torchrl_flowpolicy.training.reports import (
    decisions_per_episode,
    evaluate_task_expert,
    make_eval_env,
    outcome_summary,
    task_options,
)
from torchrl_flowpolicy.training.run_checks import (
    check_input_file,
    check_not_an_input,
    check_output_file,
)
from torchrl_flowpolicy.training.runs import write_json
from torchrl_flowpolicy.training.video import collect_frames, make_render_env, record_episodes

from common import TaskOptions, option, parse_config, split_list
from run_settings import validate_config


@dataclass
class EvaluateConfig(TaskOptions):
    """Evaluation settings; every field is a command-line option."""

    checkpoints: str = option("outputs/pretrain/policy.pt", "comma-separated checkpoint paths")
    eval_noise_scales: str = option("1.0,0.0", "comma-separated initial-noise scales")
    uniform_noise_bounds: str = option(
        "", "comma-separated m: also decode uniform noise in [-m, m]^(H x D)"
    )
    eval_num_denoising_steps: int = option(
        0,
        "K of the deterministic ODE (0: the checkpoint's own, saved with its sampler settings)",
        minimum=0,
    )
    eval_episodes: int = option(
        50, "evaluation episodes (the first seeds of the split)", minimum=1, maximum=SPLIT_SIZE
    )
    split: Literal["curve", "validation", "held_out"] = option(
        "validation",
        "seed range: curve (10000+, learning curves), validation (20000+, choices), "
        "held_out (30000+, final numbers only)",
    )
    expert: bool = option(False, "also run the clean scripted expert on the same states")
    failure_kinds: bool = option(
        False, "also sort the episodes by why they failed (tasks with episode kinds: can)"
    )
    baseline: str = option(
        "", "a pretrained checkpoint: compare every checkpoint with it under the protocol"
    )
    reported_decoding: Literal["sampled", "noise_free"] = option(
        "sampled", "with --baseline: the checkpoints' headline decoding (chosen on validation)"
    )
    video_episodes: int = option(
        0,
        "record the split's first N episodes of each evaluation to a video (0: none)",
        minimum=0,
        maximum=SPLIT_SIZE,
    )
    video_dir: str = option("outputs/videos", "where the videos are written")
    video_format: Literal["gif", "mp4"] = option(
        "gif", "gif (Pillow; plays in a browser) or mp4 (OpenCV's mp4v; smaller)"
    )
    video_size: int = option(256, "height and width of one episode's frames, pixels", minimum=1)
    video_camera: str = option(
        "", "a named camera (lift: frontview, agentview, ...); empty: the task's default view"
    )
    output_json: str = option("outputs/evaluation.json", "where the rows are written")
    overwrite: bool = option(False, "replace an existing output_json and videos")
    threads: int = option(1, "torch CPU threads", minimum=1)

    def option_conflicts(self) -> list[str]:
        """Options that contradict each other or are given without what reads them."""
        rules = [
            (
                self.video_episodes == 0 and bool(self.video_camera),
                f"--video_camera {self.video_camera}: only with --video_episodes N > 0",
            ),
            (
                not self.baseline and self.reported_decoding != "sampled",
                f"--reported_decoding {self.reported_decoding}: only with --baseline",
            ),
            (
                self.failure_kinds and get_task(self.task).episode_kinds is None,
                f"--failure_kinds: --task {self.task} does not sort its episodes "
                f"(tasks that do: {[name for name, t in TASKS.items() if t.episode_kinds]})",
            ),
        ]
        return [message for broken, message in rules if broken]


@dataclass
class Inputs:
    """What the options of an evaluation name, parsed and checked (:func:`check_config`):
    the checkpoints in the order given (a path given twice is evaluated twice), each loaded
    once (path -> ``SavedPolicy``), the scales and the noise bounds."""

    checkpoints: list[str]
    policies: dict[str, SavedPolicy]
    scales: list[float]
    bounds: list[float]


def check_config(config: EvaluateConfig) -> Inputs:
    """Every option, path and checkpoint of ``config``, checked before any evaluation.

    Raises:
        ValueError: options out of bounds or contradicting each other, a list item that is
            not a number (naming the option), a scale that is not finite and ``>= 0``, a
            bound that is not finite and ``> 0``, no checkpoint (and no ``--expert``), an
            output that is one of the inputs, a checkpoint of another task or kind, an
            unknown ``--video_camera``.
        FileNotFoundError, IsADirectoryError: a checkpoint path that is missing or a folder.
        FileExistsError: an existing ``--output_json`` or video without ``--overwrite``.
    """
    validate_config(config)
    checkpoints = split_list(config.checkpoints, "--checkpoints")
    scales = split_list(config.eval_noise_scales, "--eval_noise_scales", float)
    bounds = split_list(config.uniform_noise_bounds, "--uniform_noise_bounds", float)
    for scale in scales:
        if not (math.isfinite(scale) and scale >= 0):
            raise ValueError(
                f"--eval_noise_scales {config.eval_noise_scales}: {scale} is not >= 0."
            )
    for bound in bounds:
        if not (math.isfinite(bound) and bound > 0):
            raise ValueError(
                f"--uniform_noise_bounds {config.uniform_noise_bounds}: {bound} is not > 0."
            )
    if not checkpoints and not config.expert:
        raise ValueError(f"--checkpoints {config.checkpoints!r}: no checkpoint to evaluate.")
    if checkpoints and not scales and not bounds:
        raise ValueError("--eval_noise_scales and --uniform_noise_bounds are both empty.")
    read = {
        "--checkpoints": checkpoints,
        "--baseline": [config.baseline] if config.baseline else [],
    }
    for option_name, paths in read.items():
        for path in paths:
            check_input_file(path, option_name)
    videos = [
        Path(config.video_dir) / f"{name}.{config.video_format}"
        for name in video_names(config, checkpoints, scales)
    ]
    written = {"--output_json": [config.output_json], "--video_dir": videos}
    check_not_an_input(written, read)
    for option_name, paths in written.items():
        for path in paths:
            check_output_file(path, option_name, overwrite=config.overwrite)
    policies = {path: load_checkpoint_policy(path, config) for path in checkpoints}
    if config.baseline:
        load_checkpoint_policy(config.baseline, config)
    if config.video_episodes:
        check_rendering(config)
    return Inputs(checkpoints, policies, scales, bounds)


def check_rendering(config: EvaluateConfig) -> None:
    """Render one frame of the task as the videos will (an unknown ``--video_camera`` fails
    here, not after the evaluations).

    Raises:
        ValueError: naming ``--video_camera`` and the renderer's error.
    """
    view = {"height": config.video_size, "width": config.video_size}
    camera = config.video_camera or None
    try:
        env = make_render_env(config.task, 1, camera=camera, **view, **task_options(config))
        try:
            with collect_frames(env, 1):
                env.reset()  # the first frame
        finally:
            env.close()
    except Exception as error:
        raise ValueError(
            f"--video_episodes {config.video_episodes} --video_camera {config.video_camera!r}: "
            f"rendering the task's first frame failed ({type(error).__name__}: {error})."
        ) from error


def video_names(config: EvaluateConfig, checkpoints: list[str], scales: list[float]) -> list[str]:
    """The videos an evaluation records (:func:`video_name`; ``expert`` with ``--expert``)."""
    if not config.video_episodes:
        return []
    names = [video_name(path, scale) for path in checkpoints for scale in scales]
    return (["expert"] if config.expert else []) + names


def load_checkpoint_policy(path: str, config: EvaluateConfig) -> SavedPolicy:
    """The policy of a checkpoint with its saved sampler settings (a checkpoint saved before
    they were recorded: the defaults, K = 20), its ODE's K replaced by ``--eval_num_denoising_steps``
    when given; a checkpoint of another task than ``--task`` is refused."""
    saved = load_policy_checkpoint(Path(path), task=config.task)
    if config.eval_num_denoising_steps:
        options = saved.policy.options.replace(
            eval_num_denoising_steps=config.eval_num_denoising_steps
        )
        saved.policy.options = options
        saved = saved._replace(sampler=options)
    return saved


def report_row(
    outcomes: dict[str, torch.Tensor],
    label: str,
    kind_names: tuple[str, ...] = (),
    **row: object,
) -> dict:
    """One evaluation's row (:func:`~torchrl_flowpolicy.training.reports.outcome_summary` and the
    per-episode successes; with a ``"kind"`` entry, indices into ``kind_names``, the episodes'
    kinds and lengths too), printed as ``label``; ``row`` adds columns."""
    result = outcome_summary(outcomes)
    tqdm.write(
        f"{label}: success {result['success_rate']:.1%} "
        f"[{100 * result['success_low']:.1f}, {100 * result['success_high']:.1f}], "
        f"return {result['mean_return']:.2f} ({result['num_episodes']} episodes)"
    )
    if "kind" in outcomes:  # --failure_kinds: the counts, each episode's kind and length
        kinds = [kind_names[kind] for kind in outcomes["kind"].tolist()]
        result["episode_kinds"] = {name: kinds.count(name) for name in kind_names}
        result["episode_kind"] = kinds
        result["episode_length"] = outcomes["length"].tolist()
        tqdm.write(f"  episodes by kind: {result['episode_kinds']}")
    return {**row, **result, "episode_success": outcomes["success"].int().tolist()}


def evaluate_row(
    actor: TensorDictModuleBase,
    env: EnvBase,
    max_decisions: int,
    label: str,
    config: EvaluateConfig,
    **row: object,
) -> dict:
    """One evaluation on the split's seeds, printed as ``label``; ``row`` adds columns."""
    seed = split_seed(config.split, config.eval_episodes)
    kinds = get_task(config.task).episode_kinds if config.failure_kinds else None
    outcomes = evaluate_episodes(
        actor,
        env,
        max_decisions=max_decisions,
        seed=seed,
        num_episodes=config.eval_episodes,
        details=kinds.classify if kinds else None,
    )
    return report_row(outcomes, label, kinds.names if kinds else (), **row)


def record_video(
    policy: TensorDictModuleBase | None,
    executed_chunk_length: int | None,
    name: str,
    config: EvaluateConfig,
) -> dict:
    """Record the split's first ``video_episodes`` episodes of ``policy`` (``None``: the clean
    scripted expert, one action per step) to ``video_dir/name.<video_format>``; prints and
    returns the video's row."""
    seed = split_seed(config.split, config.eval_episodes)
    view = {
        "height": config.video_size,
        "width": config.video_size,
        "camera": config.video_camera or None,
    }
    env = make_render_env(
        config.task, config.video_episodes, executed_chunk_length, **view, **task_options(config)
    )
    if policy is None:
        policy = get_task(config.task).make_expert(env)
        max_decisions = config.max_episode_steps
    else:
        max_decisions = decisions_per_episode(config.max_episode_steps, executed_chunk_length)
    path = Path(config.video_dir) / f"{name}.{config.video_format}"
    video = record_episodes(policy, env, path, max_decisions=max_decisions, seed=seed)
    env.close()
    tqdm.write(
        f"video {path}: success {video.success} ({video.num_frames} frames, {video.seconds:.1f} s)"
    )
    return {
        "path": str(path),
        "episode_success": [int(flag) for flag in video.success],
        "frames_per_episode": video.frames_per_episode,
    }


def video_name(path: str, scale: float) -> str:
    """``outputs/ppo/checkpoint.pt`` at scale 1 -> ``ppo-checkpoint-scale1``."""
    checkpoint = Path(path)
    return f"{checkpoint.parent.name}-{checkpoint.stem}-scale{scale:g}"


def compare_with_baseline(config: EvaluateConfig, checkpoints: list[str]) -> list[dict]:
    """Each checkpoint against ``config.baseline`` under the protocol, on the split's seeds."""
    seed = split_seed(config.split, config.eval_episodes)
    baseline, model_config, _, _ = load_checkpoint_policy(config.baseline, config)
    executed = model_config.executed_chunk_length
    env = make_eval_env(config, config.eval_episodes, executed)
    options = {
        "max_decisions": decisions_per_episode(config.max_episode_steps, executed),
        "num_episodes": config.eval_episodes,
    }
    bc = evaluate_decodings(baseline, env, seed=seed, **options)
    expert = evaluate_task_expert(config, config.eval_episodes, seed)
    comparisons = []
    for path in checkpoints:
        policy = load_checkpoint_policy(path, config).policy
        rl = evaluate_decodings(policy, env, seed=seed, **options)
        summary = protocol_summary(bc, rl, expert, reported_decoding=config.reported_decoding)
        tqdm.write(f"{path}: {format_protocol(summary)}")
        comparisons.append({"checkpoint": path, "baseline": config.baseline, **summary})
    env.close()
    return comparisons


def main(config: EvaluateConfig) -> list[dict]:
    inputs = check_config(config)  # every option, path and checkpoint: before any evaluation
    checkpoints, scales, bounds = inputs.checkpoints, inputs.scales, inputs.bounds
    torch.set_num_threads(config.threads)
    seed = split_seed(config.split, config.eval_episodes)
    tqdm.write(f"split {config.split}: {config.eval_episodes} episodes from seed {seed}")
    rows, videos = [], []
    if config.expert:
        outcomes = evaluate_task_expert(config, config.eval_episodes, seed)
        rows.append(report_row(outcomes, "clean scripted expert", checkpoint="expert"))
        if config.video_episodes:
            videos.append(record_video(None, None, "expert", config))
    progress = tqdm(total=len(checkpoints) * (len(scales) + len(bounds)), desc="evaluations")
    for path in checkpoints:
        # A fresh copy per listed path: a path given twice is evaluated as loaded, twice.
        policy, model_config, _, _ = inputs.policies[path]
        policy = copy.deepcopy(policy)
        executed = model_config.executed_chunk_length
        max_decisions = decisions_per_episode(config.max_episode_steps, executed)
        env = make_eval_env(config, config.eval_episodes, executed)
        for scale in scales:
            policy.options = policy.options.replace(eval_noise_scale=scale)
            label = f"{path}  scale {scale:g}"
            row = {"checkpoint": path, "eval_noise_scale": scale}
            rows.append(evaluate_row(policy, env, max_decisions, label, config, **row))
            if config.video_episodes:
                videos.append(record_video(policy, executed, video_name(path, scale), config))
            progress.update(1)
        env.close()
        policy.options = policy.options.replace(eval_noise_scale=1.0)
        for bound in bounds:
            noise_env = make_eval_env(config, config.eval_episodes, executed)
            noise_env.append_transform(NoiseActionTransform(policy, noise_bound=bound))
            uniform = RandomPolicy(noise_env.full_action_spec)  # uniform over the box
            label = f"{path}  uniform noise in [-{bound:g}, {bound:g}]"
            row = {"checkpoint": path, "uniform_noise_bound": bound}
            rows.append(evaluate_row(uniform, noise_env, max_decisions, label, config, **row))
            progress.update(1)
            noise_env.close()
    progress.close()
    comparisons = compare_with_baseline(config, checkpoints) if config.baseline else []
    output = Path(config.output_json)
    output.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "config": asdict(config),
        "seed": seed,
        "rows": rows,
        "videos": videos,
        "comparisons": comparisons,
    }
    write_json(output, summary)
    return rows


if __name__ == "__main__":
    main(
        parse_config(EvaluateConfig, description=__doc__, task_defaults=script_defaults("evaluate"))
    )
