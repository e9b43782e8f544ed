"""Environments: chunked execution, batched gymnasium environments and the default task."""

from torchrl_flowpolicy.envs.batched import BatchedGymEnv
from torchrl_flowpolicy.envs.chunking import ChunkedAction, decision_discount, make_chunked_env
from torchrl_flowpolicy.envs.pusher import (
    PusherExpert,
    PusherTask,
    collect_demos,
    is_success,
    load_or_collect_demos,
    make_pusher_env,
    object_goal_distance,
)

__all__ = [
    "BatchedGymEnv",
    "ChunkedAction",
    "make_chunked_env",
    "decision_discount",
    "PusherExpert",
    "PusherTask",
    "make_pusher_env",
    "collect_demos",
    "load_or_collect_demos",
    "object_goal_distance",
    "is_success",
]
