"""Tier 1: which processes die with their launcher (core/lifetime.py); tier 3 kills real launchers."""

import os
import subprocess
import sys

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

from lightning_pdist.core import lifetime


def test_the_launching_process_itself_and_no_launcher_are_left_alone():
    """die_with_launcher(None) and die_with_launcher(own pid): nothing to do."""
    assert lifetime.die_with_launcher(None) is False
    assert lifetime.die_with_launcher(os.getpid()) is False


def test_a_live_launcher_that_is_not_the_parent_is_left_alone():
    """A launcher that is alive but not this process's parent (a grandchild, a forkserver child): nothing to do."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:  # alive, and not this process's parent (the suite's own parent may be init when run in the background)
        assert other.pid != os.getppid() and lifetime.die_with_launcher(other.pid) is False
    finally:
        other.kill()
        other.wait()


def test_a_rank_whose_launcher_is_already_gone_stops_at_once():
    """The launcher died while this rank started (reparented): RuntimeError naming both pids."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with pytest.raises(RuntimeError, match=rf"the process that launched this rank \(pid {gone.pid}\) is gone; this rank "
                                           rf"\(pid {os.getpid()}\) stops instead of waiting"):  # fmt: skip
        lifetime.die_with_launcher(gone.pid)


def test_the_popen_launcher_tells_its_children_its_pid_and_only_them(monkeypatch):
    """PopenLauncher sets PDIST_LAUNCHER_PID while it starts the children and restores the environment after."""
    seen = []
    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts",
                        lambda self: seen.append(os.environ.get(lifetime.LAUNCHER_PID_ENV)))  # fmt: skip
    monkeypatch.delenv(lifetime.LAUNCHER_PID_ENV, raising=False)
    launcher = lifetime.own_launcher(_SubprocessScriptLauncher(LightningEnvironment(), 2, 1))
    assert type(launcher) is lifetime.PopenLauncher and launcher.num_processes == 2
    launcher._call_children_scripts()
    assert seen == [str(os.getpid())] and lifetime.LAUNCHER_PID_ENV not in os.environ
    monkeypatch.setenv(lifetime.LAUNCHER_PID_ENV, "123")
    assert lifetime.launcher_pid() == 123  # a child started by it
    monkeypatch.delenv(lifetime.LAUNCHER_PID_ENV)
    assert lifetime.launcher_pid() == os.getpid()


def test_a_heartbeat_that_cannot_start_warns_and_the_run_goes_on(monkeypatch):
    """The store refuses the heartbeat's connection: a warning that failed collectives will not name the rank; None."""

    class Strategy:
        world_size, global_rank = 2, 0

    def refuse(*args, **kwargs):
        raise RuntimeError("connection refused")

    monkeypatch.setattr(lifetime, "default_store_address", lambda: ("127.0.0.1", 1))
    monkeypatch.setattr(lifetime, "Heartbeat", refuse)
    with pytest.warns(UserWarning, match=r"Strategy: no heartbeat in the job's store at 127\.0\.0\.1:1 \(RuntimeError: "
                                         r"connection refused\); a failed collective will not name the missing rank"):  # fmt: skip
        assert lifetime.start_heartbeat(Strategy()) is None
