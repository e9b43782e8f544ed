"""``BatchedGymEnv``: several gymnasium environments behind one batch-locked TorchRL env.

TorchRL's :class:`~torchrl.envs.SerialEnv` steps each sub-environment through its own
TorchRL wrapper, paying the TensorDict bookkeeping once per sub-environment and step; for a
fast simulator such as MuJoCo that bookkeeping dominates. This environment keeps ``N``
plain gymnasium environments, steps them in one Python loop over NumPy arrays and pays the
TensorDict cost once per batched step (see ``benchmarks/bench_envs.py`` for the ratio).

The environments come from a gymnasium id or from a zero-argument factory (a picklable
``functools.partial`` lets multi-process collectors build the batch in their workers), and
``info_keys`` turns boolean entries of gymnasium's ``info`` dict (e.g. a task's ``"success"``)
into ``[N, 1]`` bool entries of the observation.

It honours TorchRL's partial-step (``"_step"``) and partial-reset (``"_reset"``) masks, so
:class:`~torchrl_flowpolicy.envs.ChunkedAction` can stop the sub-environments that finish
mid-chunk, and collectors can reset the finished ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Binary, Bounded, Categorical, Composite, Unbounded
from torchrl.envs import EnvBase

__all__ = ["BatchedGymEnv"]


class BatchedGymEnv(EnvBase):
    """``num_envs`` copies of a gymnasium environment with a Box observation and action.

    Observations and rewards are float32. ``env.set_seed(seed)`` seeds sub-environment ``i``
    with ``seed + i`` at its next reset (the convention of TorchRL's batched environments);
    later resets continue each sub-environment's own random stream.

    Groups. With ``group_size = G``, the sub-environments form ``num_envs / G`` groups of
    ``G`` consecutive ones, and ``env.set_seed(seed)`` seeds sub-environment ``i`` with
    ``seed + i // G``: the ``G`` members of group ``g`` start their next episode from the same
    initial state, that of seed ``seed + g`` (what group-relative advantages compare,
    :class:`~torchrl_flowpolicy.objectives.GroupRelativeAdvantage`). Their later unseeded
    resets need not agree: a member whose episode ends first is reset first. To start every
    group afresh, call ``set_seed`` again before a full reset.

    Info entries. For each name in ``info_keys`` the environment writes a ``[N, 1]`` bool
    entry (a :class:`~torchrl.data.Binary` observation spec) read from ``info[name]`` of each
    sub-environment's step; at a reset it is ``info[name]`` of the reset info when present,
    else ``False``. A step whose info lacks a requested name is an error.

    Args:
        env_id: the gymnasium id, e.g. ``"Pusher-v5"``, or a zero-argument callable that
            returns a new ``gymnasium.Env`` (called ``num_envs`` times).
        num_envs: the batch size.

    Keyword Args:
        info_keys: names of boolean ``info`` entries to expose (e.g. ``("success",)``).
        device: the TorchRL device (tensors are made on the CPU, then moved).
        group_size: ``G``, the sub-environments per group that ``set_seed`` seeds alike
            (default 1: every sub-environment its own seed); ``num_envs`` must be a multiple.
        **make_kwargs: forwarded to ``gymnasium.make`` (e.g. ``max_episode_steps``); only
            with a gymnasium id (a factory takes its settings itself).

    Examples:
        >>> env = BatchedGymEnv("Pusher-v5", 3, max_episode_steps=10)
        >>> env.rollout(4)["next", "observation"].shape
        torch.Size([3, 4, 23])
        >>> import functools
        >>> factory = functools.partial(gym.make, "Pusher-v5", max_episode_steps=10)
        >>> BatchedGymEnv(factory, 2).rollout(4)["next", "observation"].shape
        torch.Size([2, 4, 23])
        >>> grouped = BatchedGymEnv("Pusher-v5", 4, group_size=2, max_episode_steps=10)
        >>> _ = grouped.set_seed(0)  # sub-environments 0, 1 from seed 0; 2, 3 from seed 1
        >>> first, second, third, _ = grouped.reset()["observation"]
        >>> torch.equal(first, second), torch.equal(second, third)
        (True, False)
    """

    batch_locked = True

    def __init__(
        self,
        env_id: str | Callable[[], gym.Env],
        num_envs: int,
        *,
        info_keys: Sequence[str] = (),
        device: torch.device | str | None = None,
        group_size: int = 1,
        **make_kwargs: Any,
    ):
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}.")
        if group_size < 1 or num_envs % group_size:
            raise ValueError(
                f"group_size must be a positive divisor of num_envs {num_envs} (groups of "
                f"consecutive sub-environments), got {group_size}."
            )
        if isinstance(info_keys, str):
            raise TypeError(
                f"info_keys must be a sequence of names, got the string {info_keys!r}; "
                f"write info_keys=({info_keys!r},)."
            )
        info_keys = tuple(info_keys)
        reserved = {"observation", "reward", "done", "terminated", "truncated"}
        clashing = sorted(reserved.intersection(info_keys))
        if clashing or len(set(info_keys)) != len(info_keys):
            raise ValueError(
                f"info_keys must be distinct and differ from {sorted(reserved)}, got {info_keys}."
            )
        if isinstance(env_id, str):
            make_env = functools.partial(gym.make, env_id, **make_kwargs)
        elif callable(env_id):
            if make_kwargs:
                raise ValueError(
                    f"make_kwargs {sorted(make_kwargs)} are only for a gymnasium id; bind them "
                    f"in the factory instead (e.g. functools.partial(factory, ...))."
                )
            make_env = env_id
        else:
            raise TypeError(
                f"env_id must be a gymnasium id or a zero-argument factory returning a "
                f"gymnasium.Env, got {type(env_id).__name__}."
            )
        super().__init__(batch_size=torch.Size([num_envs]), device=device)
        self.env_id = env_id
        self.info_keys = info_keys
        self.group_size = group_size
        self.envs = [make_env() for _ in range(num_envs)]
        if not all(isinstance(env, gym.Env) for env in self.envs):
            raise TypeError(
                f"the factory must return gymnasium.Env instances, got "
                f"{type(self.envs[0]).__name__}."
            )
        observation_space = self.envs[0].observation_space
        action_space = self.envs[0].action_space
        if not isinstance(observation_space, gym.spaces.Box) or not isinstance(
            action_space, gym.spaces.Box
        ):
            raise TypeError(
                f"BatchedGymEnv needs Box observation and action spaces; {env_id!r} has "
                f"{type(observation_space).__name__} and {type(action_space).__name__}."
            )
        batch = (num_envs,)
        self.observation_spec = Composite(
            observation=Unbounded(
                batch + observation_space.shape, dtype=torch.float32, device=self.device
            ),
            shape=batch,
        )
        for key in info_keys:
            self.observation_spec[key] = Binary(
                n=1, shape=batch + (1,), dtype=torch.bool, device=self.device
            )
        self.action_spec = Bounded(
            low=torch.as_tensor(action_space.low, dtype=torch.float32).expand(
                batch + action_space.shape
            ),
            high=torch.as_tensor(action_space.high, dtype=torch.float32).expand(
                batch + action_space.shape
            ),
            shape=batch + action_space.shape,
            dtype=torch.float32,
            device=self.device,
        )
        self.reward_spec = Unbounded(batch + (1,), dtype=torch.float32, device=self.device)
        self.full_done_spec = Composite(
            done=Categorical(2, batch + (1,), dtype=torch.bool, device=self.device),
            terminated=Categorical(2, batch + (1,), dtype=torch.bool, device=self.device),
            truncated=Categorical(2, batch + (1,), dtype=torch.bool, device=self.device),
            shape=batch,
        )
        self._observation = np.zeros((num_envs, *observation_space.shape), dtype=np.float32)
        self._info = np.zeros((num_envs, len(info_keys)), dtype=bool)
        # Each sub-environment's last done flags: a sub-environment skipped by a partial step
        # reports those of its last executed step (what TorchRL's batched envs do).
        self._terminated = np.zeros((num_envs, 1), dtype=bool)
        self._truncated = np.zeros((num_envs, 1), dtype=bool)
        self._seeds: list[int | None] = [None] * num_envs

    def _set_seed(self, seed: int | None) -> None:
        if seed is None:
            self._seeds = [None] * len(self.envs)
        else:
            self._seeds = [seed + index // self.group_size for index in range(len(self.envs))]

    def _mask(self, tensordict: TensorDictBase | None, key: str) -> np.ndarray:
        if tensordict is None:
            return np.ones(len(self.envs), dtype=bool)
        mask = tensordict.get(key, None)
        if mask is None:
            return np.ones(len(self.envs), dtype=bool)
        return mask.reshape(len(self.envs)).cpu().numpy()

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        for index in np.flatnonzero(self._mask(tensordict, "_reset")):
            observation, info = self.envs[index].reset(seed=self._seeds[index])
            self._seeds[index] = None
            self._observation[index] = observation
            self._terminated[index] = self._truncated[index] = False
            for column, key in enumerate(self.info_keys):
                self._info[index, column] = bool(info.get(key, False))
        false = torch.zeros((len(self.envs), 1), dtype=torch.bool)
        return TensorDict(
            {
                "observation": torch.from_numpy(self._observation.copy()),
                "done": false,
                "terminated": false.clone(),
                "truncated": false.clone(),
                **self._info_entries(),
            },
            batch_size=self.batch_size,
        ).to(self.device)

    def _info_entries(self) -> dict[str, torch.Tensor]:
        return {
            key: torch.from_numpy(self._info[:, column : column + 1].copy())
            for column, key in enumerate(self.info_keys)
        }

    def _read_info(self, index: int, info: dict[str, Any]) -> None:
        for column, key in enumerate(self.info_keys):
            if key not in info:
                raise KeyError(
                    f"BatchedGymEnv(info_keys={self.info_keys}): sub-environment {index}'s step "
                    f"info has no {key!r} entry (it has {sorted(info)})."
                )
            self._info[index, column] = bool(info[key])

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        action = tensordict.get("action").detach().cpu().numpy()
        num_envs = len(self.envs)
        reward = np.zeros((num_envs, 1), dtype=np.float32)
        terminated, truncated = self._terminated, self._truncated
        for index in np.flatnonzero(self._mask(tensordict, "_step")):
            observation, step_reward, step_terminated, step_truncated, info = self.envs[index].step(
                action[index]
            )
            self._observation[index] = observation
            self._read_info(index, info)
            reward[index] = step_reward
            terminated[index] = step_terminated
            truncated[index] = step_truncated
        return TensorDict(
            {
                "observation": torch.from_numpy(self._observation.copy()),
                "reward": torch.from_numpy(reward),
                "done": torch.from_numpy(terminated | truncated),
                "terminated": torch.from_numpy(terminated.copy()),
                "truncated": torch.from_numpy(truncated.copy()),
                **self._info_entries(),
            },
            batch_size=self.batch_size,
        ).to(self.device)

    def close(self, *, raise_if_closed: bool = True) -> None:
        for env in self.envs:
            env.close()
        super().close(raise_if_closed=raise_if_closed)
