"""Shared fixtures: a clean environment per test and the tests/ folder on sys.path for _helpers."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("PL_DISABLE_FORK", "0")


@pytest.fixture(autouse=True)
def _restore_env():
    """Lightning launchers export MASTER_PORT, WORLD_SIZE, ...; keep them from leaking across tests."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _teardown_process_group():
    """A 1-rank in-process fit leaves a default process group behind; forked ranks must not inherit it."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
