"""Environments: chunked execution, batched gymnasium environments and the default task.

The default task is split by concept: :mod:`~torchrl_flowpolicy.envs.pusher` (task facts,
success test, :class:`PusherTask`, :func:`make_pusher_env`),
:mod:`~torchrl_flowpolicy.envs.pusher_expert` (the scripted :class:`PusherExpert`) and
:mod:`~torchrl_flowpolicy.envs.demonstrations` (collecting and caching its demonstrations); :mod:`~torchrl_flowpolicy.envs.tasks` names the tasks the
examples run (``"pusher"``, robosuite's ``"lift"`` and ``"can"``), whose robosuite parts
(:mod:`~torchrl_flowpolicy.envs.robosuite_tasks`, :mod:`~torchrl_flowpolicy.envs.robosuite_experts`)
are imported only when used.
"""

from torchrl_flowpolicy.envs.batched import BatchedGymEnv
from torchrl_flowpolicy.envs.chunking import ChunkedAction, decision_discount, make_chunked_env
from torchrl_flowpolicy.envs.demonstrations import collect_demos, load_or_collect_demos
from torchrl_flowpolicy.envs.pusher import (
    PusherTask,
    is_success,
    make_pusher_env,
    object_goal_distance,
)
from torchrl_flowpolicy.envs.pusher_expert import PusherExpert, PusherExpertPolicy
from torchrl_flowpolicy.envs.tasks import TASKS, Task, get_task

__all__ = [
    "BatchedGymEnv",
    "ChunkedAction",
    "make_chunked_env",
    "decision_discount",
    "PusherExpert",
    "PusherExpertPolicy",
    "PusherTask",
    "make_pusher_env",
    "collect_demos",
    "load_or_collect_demos",
    "object_goal_distance",
    "is_success",
    "Task",
    "TASKS",
    "get_task",
]
