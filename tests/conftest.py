"""Shared fixtures: a clean environment per test and the tests/ folder on sys.path for _helpers."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("PL_DISABLE_FORK", "0")

# libgomp's thread pool does not survive fork(): once this process has run an OpenMP team (MKL's tanh on a
# few hundred numbers is enough), a forked child that starts a team of its own waits forever in
# gomp_team_barrier_wait_end. Lightning sizes thread pools only where OMP_NUM_THREADS is unset: its popen
# launcher set this process to cpu_count threads, and a later devices=1 fork run (2 threads in the child)
# hung inside the suite but never alone. One thread everywhere, fixed here, keeps every team unborn.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


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
