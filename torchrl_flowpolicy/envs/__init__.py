"""Environments: chunked execution of action chunks and task wrappers."""

from torchrl_flowpolicy.envs.chunking import ChunkedAction, decision_discount, make_chunked_env

__all__ = ["ChunkedAction", "make_chunked_env", "decision_discount"]
