"""The bridge's cost at real size: ``FlowSDEPolicy`` over LeRobot's SmolVLA and pi0 expert.

Runs in ``.venv-lerobot`` (``bash scripts/setup_lerobot_env.sh``), offline, with random
weights (nothing is downloaded). For each model, on one decision (batch 1):

- **rollout**: ``bridge.actor(td)`` under RANDOM exploration (the Flow-SDE at every step but
  step 0, ``sde_mode="all"``, K = 10, with chain, per-step log-probs and tensordict writes)
  against LeRobot's own image / state preparation and ``sample_actions`` on the same inputs
  (goal: ratio <= 1.05);
- **learner**: ``DenoisingClipPPOLoss(...)(td)["loss_objective"].backward()`` on that stored
  decision (all K - 1 = 9 stochastic steps rescored in one batched call) against one forward
  + backward of the action expert alone: LeRobot's ``denoise_step`` on the same 9 stored
  ``(x_k, sigma_k)`` with the decision's prefix cache, backward of a weighted sum (goal:
  ratio <= 1.3). With ``context="cache"`` the learner reuses the stored keys and values;
  with ``context="inputs"`` it runs the prefix again (no gradient), so its baseline is the
  expert plus one prefix pass (timed on its own); ``inputs / expert`` is the prefix's price;
- **bytes** that the learner needs per decision: ``"inputs"`` stores the observations (the
  camera as ``uint8``) and the chain, ``"cache"`` the prefix's keys and values, its mask (and
  pi0's state) and the chain;
- **drift**: the largest ``|log_prob(td) - stored|`` of the learner's rescoring of the
  stored decision, in both modes (0 in float32 on the CPU; the bf16 figure on a GPU).

Models (random weights, float32, built with the package's offline builders):

- ``smolvla``: SmolVLA at its published size: the SmolVLM2-500M-Video-Instruct VLM (text 960
  wide, 15 heads, 5 key/value heads, head_dim 64, MLP 2560, vocabulary 49280, of which
  SmolVLA keeps 16 of 32 layers; vision 768 wide, 12 layers, 12 heads, MLP 3072, patch 16,
  one 512 x 512 camera, pixel shuffle 4), LeRobot's defaults (expert 0.75 x wide, chunk 50,
  32 padded dimensions, 10 steps, 48 language tokens);
- ``pi0``: pi0's action expert at its real size (LeRobot's ``gemma_300m``: 1024 wide, 18
  layers, MLP 4096, 8 heads, 1 key/value head, head_dim 256) with a prefix of pi0's real
  length (one 224 x 224 camera, 256 image tokens, 48 language tokens), but a narrow
  language model (256 wide, the same 18 layers and attention shape, vocabulary 1024) and a
  one-layer vision tower: the 2B PaliGemma does not fit this machine's memory. The expert's
  cost and the cache's size are pi0's; the prefix pass is much cheaper than the real one,
  which makes the rollout ratio harder to meet (the prefix is shared by both arms).

The arms are interleaved round by round (their order alternates); the table reports the
median per-call time of each and the median and interquartile range of the per-round ratios.

Run::

    .venv-lerobot/bin/python benchmarks/bench_lerobot.py                 # both models
    .venv-lerobot/bin/python benchmarks/bench_lerobot.py --models smolvla --rounds 7
    .venv-lerobot/bin/python benchmarks/bench_lerobot.py --quick         # tiny models, seconds
    .venv-lerobot/bin/python benchmarks/bench_lerobot.py --device cuda --bf16   # a GPU
                                                      # (benchmarks/gpu_lerobot.sh)
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from torchrl.envs.utils import ExplorationType, set_exploration_type  # noqa: E402

from torchrl_flowpolicy.integrations.lerobot import flow_policy_from_lerobot  # noqa: E402
from torchrl_flowpolicy.integrations.lerobot_models import (  # noqa: E402
    ModelSizes,
    random_lerobot_policy,
)
from torchrl_flowpolicy.objectives import DenoisingClipPPOLoss  # noqa: E402
from torchrl_flowpolicy.sampler import SamplerOptions  # noqa: E402
from torchrl_flowpolicy.training.run_checks import add_output_options, check_output_option  # noqa: E402
from torchrl_flowpolicy.training.runs import write_json  # noqa: E402

CAMERA = "observation.images.top"
GOALS = {"rollout": 1.05, "learner_cache": 1.3, "learner_inputs": 1.3}

#: SmolVLM2-500M-Video-Instruct's configuration (see the module docstring).
SMOLVLA_SIZES = ModelSizes(
    width=960,
    expert_width=720,  # unused by SmolVLA (expert_width_multiplier 0.75), stated for clarity
    depth=32,
    mlp_dim=2560,
    num_heads=15,
    num_kv_heads=5,
    head_dim=64,
    vision_width=768,
    vision_depth=12,
    vision_mlp_dim=3072,
    vision_heads=12,
    patch_size=16,
    vocab_size=49280,
    scale_factor=4,
)
#: pi0's gemma_300m expert; a narrow language model of the same attention shape.
PI0_SIZES = ModelSizes(
    width=256,
    expert_width=1024,
    depth=18,
    mlp_dim=4096,
    num_heads=8,
    num_kv_heads=1,
    head_dim=256,
    vision_width=64,
    vision_depth=1,
    vision_mlp_dim=128,
    vision_heads=2,
    patch_size=14,
    vocab_size=1024,
)
REAL = {
    "smolvla": {"sizes": SMOLVLA_SIZES, "image_size": 512, "tokens": 48, "config": {}},
    "pi0": {"sizes": PI0_SIZES, "image_size": 224, "tokens": 48, "config": {}},
}
QUICK_CONFIG = {"chunk_size": 4, "n_action_steps": 4, "max_action_dim": 8, "max_state_dim": 8}
QUICK = {
    kind: {"sizes": ModelSizes(), "image_size": 32, "tokens": 6, "config": QUICK_CONFIG}
    for kind in ("smolvla", "pi0")
}
REAL_CONFIG = {"chunk_size": 50, "n_action_steps": 50, "max_action_dim": 32, "max_state_dim": 32}


def build_model(
    kind: str, setting: dict, folder: Path, seed: int = 0, device: str = "cpu", bf16: bool = False
):
    """The random LeRobot policy of ``kind`` at ``setting``'s sizes, in eval mode, on
    ``device``; ``bf16``: the backbone in bfloat16 as LeRobot runs it (pi0's
    ``dtype="bfloat16"``; SmolVLA's VLM, as ``load_vlm_weights`` loads it)."""
    torch.manual_seed(seed)
    config = {**REAL_CONFIG, **setting["config"], "train_expert_only": True, "device": device}
    if bf16 and kind == "pi0":
        config["dtype"] = "bfloat16"
    if kind == "pi0":
        config["num_inference_steps"] = 10
    else:
        config["num_steps"] = 10
        config["tokenizer_max_length"] = max(setting["tokens"], 8)
    policy = random_lerobot_policy(
        kind,
        sizes=setting["sizes"],
        action_dim=7,
        state_dim=8,
        image_size=setting["image_size"],
        camera=CAMERA,
        folder=folder / "smolvlm",
        **config,
    )
    policy = policy.to(device)
    if bf16 and kind == "smolvla":
        policy.model.vlm_with_expert.vlm.to(torch.bfloat16)
    return policy.eval()


def lerobot_batch(
    image_size: int, num_tokens: int, seed: int = 1, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """One decision as LeRobot's pre-processor leaves it (camera in [0, 1])."""
    generator = torch.Generator().manual_seed(seed)
    batch = {
        CAMERA: torch.rand(1, 3, image_size, image_size, generator=generator),
        "observation.state": torch.randn(1, 8, generator=generator),
        "observation.language.tokens": torch.randint(6, 60, (1, num_tokens), generator=generator),
        "observation.language.attention_mask": torch.ones(1, num_tokens, dtype=torch.bool),
    }
    return {name: value.to(device) for name, value in batch.items()}


def as_tensordict(batch: dict[str, torch.Tensor]) -> TensorDict:
    return TensorDict({tuple(name.split(".")): value for name, value in batch.items()}, [1])


def lerobot_sample_actions(policy, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """LeRobot's own path from a prepared batch to a chunk (as its predict_action_chunk)."""
    model = policy.model
    tokens = batch["observation.language.tokens"]
    mask = batch["observation.language.attention_mask"]
    if policy.name == "smolvla":
        images, image_masks = policy.prepare_images(batch)
        state = policy.prepare_state(batch)
        return model.sample_actions(images, image_masks, tokens, mask, state)
    images, image_masks = policy._preprocess_images(batch)
    return model.sample_actions(images, image_masks, tokens, mask, policy.prepare_state(batch))


def expert_step(policy, td_cache: TensorDict, cache_key: str = "prefix_cache") -> Callable:
    """One forward + backward of LeRobot's ``denoise_step`` on the decision's K - 1 stochastic
    entries (the baseline of the learner): the prefix cache repeated per entry, as the
    learner gathers it."""
    model, family = policy.model, policy.name
    chain = td_cache["flow", "chain"][0]  # [K + 1, H, D]
    steps = td_cache["flow", "sde_mask"][0].nonzero().squeeze(-1)
    num_steps = chain.shape[0] - 1
    sigmas = 1 - torch.arange(num_steps + 1, dtype=torch.float32) / num_steps
    x, sigma = chain[steps], sigmas.to(chain.device)[steps]
    entries = len(steps)
    cache = td_cache[cache_key]
    pad_mask = cache["prefix_pad_mask"].expand(entries, -1)
    keys = cache["keys"].expand(entries, *cache["keys"].shape[1:])
    values = cache["values"].expand(entries, *cache["values"].shape[1:])
    weights = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(x.device)

    def step() -> None:
        layers = tuple((k, v, None) for k, v in zip(keys.unbind(1), values.unbind(1), strict=True))
        if family == "smolvla":
            cache_type = sys.modules[type(model.vlm_with_expert).__module__].DynamicCache
            velocity = model.denoise_step(
                prefix_pad_masks=pad_mask, past_key_values=cache_type(layers), x_t=x, timestep=sigma
            )
        else:
            state = cache["state"].expand(entries, -1)
            velocity = model.denoise_step(
                state=state,
                prefix_pad_masks=pad_mask,
                past_key_values=layers,
                x_t=x,
                timestep=sigma,
            )
        (velocity * weights).sum().backward()

    return step


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(function: Callable[[], object], zero_grad: Callable[[], None] | None = None) -> float:
    if zero_grad is not None:
        zero_grad()
    synchronize()
    start = time.perf_counter()
    function()
    synchronize()
    return time.perf_counter() - start


def nbytes(td: TensorDict, keys) -> int:
    return sum(td[key].numel() * td[key].element_size() for key in keys)


def quantiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q25, q50, q75 = statistics.quantiles(values, n=4, method="inclusive")
    return q25, statistics.median(values), q75


def bench_model(
    kind: str, setting: dict, rounds: int, folder: Path, device: str = "cpu", bf16: bool = False
) -> dict:
    start = time.perf_counter()
    policy = build_model(kind, setting, folder, device=device, bf16=bf16)
    build_s = time.perf_counter() - start
    parameters = sum(p.numel() for p in policy.parameters())
    expert_parameters = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    steps = policy.config.num_steps if kind == "smolvla" else policy.config.num_inference_steps
    options = SamplerOptions(
        num_denoising_steps=steps, eval_num_denoising_steps=steps, sde_mode="all"
    )
    inputs = flow_policy_from_lerobot(policy, context="inputs", options=options)
    cached = flow_policy_from_lerobot(policy, context="cache", options=options)
    batch = lerobot_batch(setting["image_size"], setting["tokens"], device=device)
    observation = as_tensordict(batch)
    with set_exploration_type(ExplorationType.RANDOM):
        td_inputs = inputs.actor(observation.clone())
        td_cache = cached.actor(observation.clone())
    for td in (td_inputs, td_cache):
        td["advantage"] = torch.ones(1, 1, device=device)
    # Rescoring drift: the stored log-probs against the learner's, before any update.
    drift = {
        mode: (bridge.policy.log_prob(td).detach() - td["flow", "step_log_prob"]).abs().max().item()
        for mode, bridge, td in (("inputs", inputs, td_inputs), ("cache", cached, td_cache))
    }
    losses = {
        "learner_inputs": DenoisingClipPPOLoss(inputs.policy),
        "learner_cache": DenoisingClipPPOLoss(cached.policy),
    }
    prefix_inputs = [observation[key] for key in inputs.observation_keys.values()]

    def zero_grad() -> None:
        policy.zero_grad(set_to_none=True)

    def rollout() -> None:
        with torch.no_grad(), set_exploration_type(ExplorationType.RANDOM):
            inputs.actor(observation.clone())

    def sample_actions() -> None:
        with torch.no_grad():
            lerobot_sample_actions(policy, batch)

    def prefix() -> None:
        with torch.no_grad():
            inputs.prefix(*prefix_inputs)

    arms: dict[str, tuple[Callable, Callable | None]] = {
        "sample_actions": (sample_actions, None),
        "rollout": (rollout, None),
        "expert": (expert_step(policy, td_cache), zero_grad),
        "learner_cache": (
            lambda: losses["learner_cache"](td_cache)["loss_objective"].backward(),
            zero_grad,
        ),
        "prefix": (prefix, None),
        "learner_inputs": (
            lambda: losses["learner_inputs"](td_inputs)["loss_objective"].backward(),
            zero_grad,
        ),
    }
    for function, reset in arms.values():  # warm-up
        timed(function, reset)
    times: dict[str, list[float]] = {name: [] for name in arms}
    order = list(arms)
    for index in range(rounds):
        for name in order if index % 2 == 0 else order[::-1]:
            times[name].append(timed(*arms[name]))
        print(
            f"[{kind}] round {index + 1}/{rounds}: "
            + ", ".join(f"{name} {times[name][-1]:.3f} s" for name in arms),
            flush=True,
        )
    zero_grad()
    ratios = {
        "rollout": [r / s for r, s in zip(times["rollout"], times["sample_actions"], strict=True)],
        "learner_cache": [
            c / e for c, e in zip(times["learner_cache"], times["expert"], strict=True)
        ],
        "learner_inputs": [
            i / (p + e)
            for i, p, e in zip(
                times["learner_inputs"], times["prefix"], times["expert"], strict=True
            )
        ],
        "inputs_over_expert": [
            i / e for i, e in zip(times["learner_inputs"], times["expert"], strict=True)
        ],
    }
    flow_keys = [
        ("flow", "chain"),
        ("flow", "sde_mask"),
        ("flow", "step_log_prob"),
        "action_log_prob",
    ]
    uint8_image = (batch[CAMERA] * 255).round().to(torch.uint8)
    observation_bytes = nbytes(observation, [key for key in inputs.observation_keys.values()])
    observation_bytes += uint8_image.nbytes - batch[CAMERA].nbytes  # the camera as uint8
    cache_keys = [key for key in cached.policy.in_keys]
    return {
        "model": kind,
        "parameters": parameters,
        "trainable_parameters": expert_parameters,
        "build_s": build_s,
        "stochastic_steps": int(td_cache["flow", "sde_mask"].sum()),
        "cache_dtype": str(td_cache[cache_keys[-1]].dtype),
        "prefix_tokens": int(td_cache[cache_keys[0]].shape[-1]),
        "median_s": {name: statistics.median(values) for name, values in times.items()},
        "ratios": {name: quantiles(values) for name, values in ratios.items()},
        "bytes_inputs": observation_bytes + nbytes(td_inputs, flow_keys),
        "bytes_cache": nbytes(td_cache, cache_keys) + nbytes(td_cache, flow_keys),
        "bytes_flow": nbytes(td_cache, flow_keys),
        "rounds": rounds,
        "device": device,
        "bf16": bf16,
        "log_prob_drift": drift,
    }


def print_table(rows: list[dict]) -> None:
    print("\n| model | params (trainable) | sample_actions | rollout | ratio (q25-q75) | goal |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        m, (q25, q50, q75) = row["median_s"], row["ratios"]["rollout"]
        print(
            f"| {row['model']} | {row['parameters'] / 1e6:.1f} M ({row['trainable_parameters'] / 1e6:.1f} M) "
            f"| {m['sample_actions']:.3f} s | {m['rollout']:.3f} s | {q50:.3f} ({q25:.3f}-{q75:.3f}) "
            f"| <= {GOALS['rollout']} |"
        )
    print(
        "\n| model | steps | expert fwd+bwd | learner, cache | ratio (q25-q75) | prefix | "
        "learner, inputs | ratio to prefix + expert (q25-q75) | inputs / expert | goal |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        m, r = row["median_s"], row["ratios"]
        c, i, o = r["learner_cache"], r["learner_inputs"], r["inputs_over_expert"]
        print(
            f"| {row['model']} | {row['stochastic_steps']} | {m['expert']:.3f} s | "
            f"{m['learner_cache']:.3f} s | {c[1]:.3f} ({c[0]:.3f}-{c[2]:.3f}) | {m['prefix']:.3f} s | "
            f"{m['learner_inputs']:.3f} s | {i[1]:.3f} ({i[0]:.3f}-{i[2]:.3f}) | {o[1]:.2f} | "
            f"<= {GOALS['learner_cache']} |"
        )
    print(
        "\n| model | prefix tokens | cache dtype | bytes per decision, inputs | cache | "
        "of which chain | drift, inputs | drift, cache |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        drift = row["log_prob_drift"]
        print(
            f"| {row['model']} | {row['prefix_tokens']} | {row['cache_dtype']} | "
            f"{row['bytes_inputs'] / 1e6:.3f} MB | {row['bytes_cache'] / 1e6:.3f} MB | "
            f"{row['bytes_flow'] / 1e6:.3f} MB | {drift['inputs']:.1e} | {drift['cache']:.1e} |"
        )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=["smolvla", "pi0"], choices=["smolvla", "pi0"]
    )
    parser.add_argument("--rounds", type=int, default=None, help="default 5 (2 with --quick)")
    parser.add_argument("--quick", action="store_true", help="tiny models: a smoke run in seconds")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    add_output_options(parser, "also write the rows as JSON")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    parser.add_argument("--bf16", action="store_true", help="the backbone in bfloat16")
    args = parser.parse_args(argv)
    check_output_option(parser, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = args.rounds or (2 if args.quick else 5)
    settings = QUICK if args.quick else REAL
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor()}; "
        f"load before: {load}",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for kind in args.models:
            setting, path = settings[kind], Path(folder) / kind
            rows.append(bench_model(kind, setting, rounds, path, args.device, args.bf16))
    load_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"load after: {load_after}")
    print_table(rows)
    if args.output is not None:
        settings_out = {
            "quick": args.quick,
            "rounds": rounds,
            "threads": torch.get_num_threads(),
            "load_before": load,
            "load_after": load_after,
            "torch": torch.__version__,
            "device": args.device,
            "bf16": args.bf16,
        }
        write_json(args.output, {"settings": settings_out, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
