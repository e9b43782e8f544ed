"""The real-LeRobot leg: runs in .venv-lerobot only (``bash scripts/run_lerobot_tests.sh``).

Each module skips itself where lerobot is not installed (the main environment; a skip in this
file would be an error when the folder is named on the command line). Every model is a
tiny random one built offline (:mod:`torchrl_flowpolicy.integrations.lerobot_models`); the
hub is switched off before anything imports ``huggingface_hub``.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402

KINDS = ("pi0", "pi05", "smolvla")


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param
