"""A fork never hands a rank a process group: garbage groups are collected first, a live one is refused.

Each case runs in a fresh interpreter under a deadline, so a regression fails here instead of hanging the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A gloo group left as garbage exactly as a finished DDP wrap leaves it: destroyed, still held by a Reducer in a cycle.
GARBAGE_GROUP = """
import gc, os, sys, tempfile
import lightning_pdist  # first: torch and Lightning imported with the collector paused (core/startup.py)
import torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
gc.disable()
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
cycle = [ddp]; cycle.append(cycle)
dist.destroy_process_group()
del ddp, cycle  # the collector stays off: the garbage is there until someone collects it explicitly
"""


def run(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    script = textwrap.dedent(GARBAGE_GROUP.format(tests=TESTS)) + textwrap.dedent(code)
    try:
        return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        output = b"".join(part for part in (err.stdout, err.stderr) if part).decode(errors="replace")
        pytest.fail(f"hung for {timeout} s (a forked child joined threads it does not have): {output[-3000:]}")


def test_plain_fork_of_garbage_group_hangs_in_the_child_and_fork_process_does_not():
    """The failure this module guards against is real on this torch: a bare os.fork() child hangs collecting it.

    One interpreter for both halves (an interpreter costs ~7 s of imports): the bare fork's child is killed after
    5 s (it returns in milliseconds unless hung), and the garbage it hung on is still there for fork_process."""
    probe = """
    pid = os.fork()
    if pid == 0:
        gc.collect(); os._exit(0)
    import time
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG) == (0, 0):
        time.sleep(0.05)
    done = time.monotonic() < deadline
    if not done:
        os.kill(pid, 9); os.waitpid(pid, 0)
    print("child finished" if done else "child hung", flush=True)
    from lightning_pdist.core.forking import fork_process
    pid = fork_process()
    if pid == 0:
        gc.collect(); os._exit(0)
    print("child exit", os.waitpid(pid, 0)[1])
    """
    result = run(probe)
    assert "child hung" in result.stdout, result.stdout + result.stderr[-3000:]
    assert "child exit 0" in result.stdout, result.stderr[-3000:]


def test_fork_fit_after_garbage_group_trains():
    """Lightning's fork launcher under our strategies: ranks that collect garbage do not meet the parent's group."""
    fit_code = """
    from _helpers import TinyRegression, fit

    class Collecting(TinyRegression):
        def training_step(self, batch, batch_idx):
            gc.collect()  # a rank's collector running over what it inherited
            return super().training_step(batch, batch_idx)

    trainer = fit("bmuf_fork", Collecting(), devices=2, max_steps=3)
    print("finished", trainer.state.finished, sorted(trainer.callback_metrics))
    """
    result = run(fit_code)
    assert "finished True ['pdist/comm_bytes', 'pdist/comm_bytes_total', 'train/loss']" in result.stdout, result.stderr[-3000:]


def test_fork_launches_refuse_a_live_group_before_any_rank_starts():
    """The user's case: a fit whose rank 0 ran here keeps its group; a later `_fork` fit is refused, naming the fix,
    and so is a Fabric `_fork` launch (one interpreter for both: each costs ~8 s of imports)."""
    code = """
    from _helpers import TinyRegression, fit
    from lightning.fabric import Fabric

    fit("pdist_ddp", TinyRegression(), devices=1, max_steps=1)
    assert dist.is_initialized()
    try:
        fit("bmuf_fork", TinyRegression(), devices=2, max_steps=2)
    except RuntimeError as err:
        print("refused:", err)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="bmuf_fork")
    try:
        fabric.launch(lambda f: None)
    except RuntimeError as err:
        print("fabric refused:", err)
    dist.destroy_process_group()
    trainer = fit("bmuf_fork", TinyRegression(), devices=2, max_steps=2)
    print("after destroy: finished", trainer.state.finished)
    """
    result = run(code)
    assert "refused: BMUFStrategy(start_method='fork'): this process holds a live torch.distributed process group" in result.stdout, result.stderr[-3000:]
    assert "destroy_process_group()" in result.stdout
    assert "fabric refused: BMUFFabricStrategy(start_method='fork')" in result.stdout, result.stderr[-3000:]
    assert "after destroy: finished True" in result.stdout, result.stderr[-3000:]
