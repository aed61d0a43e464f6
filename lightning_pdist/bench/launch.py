"""Starting a benchmark's processes on this machine and accounting for the CPU they share.

:func:`launch_loopback` is the loopback twin of :func:`lightning_pdist.bench.netns.launch_ranks` (same
per-rank environment, so a worker runs unchanged on either); :func:`worker_env` lets the ranks import
this checkout; :func:`busy_cpu_s` and :func:`own_cpu_s` measure how much of the machine other work used
during a run, which every suite reports next to its timings (the machine has 2 shared cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_pdist.bench.netns import LaunchError

__all__ = ["busy_cpu_s", "free_port", "launch_loopback", "own_cpu_s", "read_results", "worker_env"]


def launch_loopback(
    argv: Sequence[str],
    world_size: int,
    master_port: int,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> list[subprocess.CompletedProcess]:
    """Run ``argv`` as ``world_size`` processes on 127.0.0.1 with the per-rank variables of ``launch_ranks``.

    The loopback twin of :func:`lightning_pdist.bench.netns.launch_ranks`: each rank gets ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK=0``, ``LOCAL_WORLD_SIZE=1``, ``NODE_RANK``, ``MASTER_ADDR=127.0.0.1``,
    ``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME=lo``, so the same worker runs unchanged.

    Raises:
        ValueError: ``world_size``, ``master_port`` or ``timeout`` is out of range.
        LaunchError: a rank exited non-zero or the timeout passed; the others are killed first.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"launch_loopback(world_size={world_size!r}): world_size must be an int >= 1")
    if not isinstance(master_port, int) or not 1 <= master_port <= 65535:
        raise ValueError(f"launch_loopback(master_port={master_port!r}): master_port must be in [1, 65535]")
    if not timeout > 0:
        raise ValueError(f"launch_loopback(timeout={timeout!r}): timeout must be > 0 seconds")
    procs: list[subprocess.Popen] = []
    files: list[tuple[Any, Any]] = []
    failed = None
    timed_out = False
    try:
        for rank in range(world_size):
            rank_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
            rank_env.update(
                RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), GLOO_SOCKET_IFNAME="lo",
            )  # fmt: skip
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            files.append((out, err))
            procs.append(
                subprocess.Popen(
                    list(argv), env=rank_env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True
                )
            )
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None or all(c is not None for c in codes):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.02)
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 9)
                except (ProcessLookupError, PermissionError):
                    pass
            proc.wait()
    results = []
    for proc, (out, err) in zip(procs, files):
        out.seek(0)
        err.seek(0)
        results.append(
            subprocess.CompletedProcess(
                proc.args, proc.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace")
            )
        )
        out.close()
        err.close()
    if failed is not None or timed_out:
        rank = failed if failed is not None else next(r for r, res in enumerate(results) if res.returncode != 0)
        why = f"exited with code {results[rank].returncode}" if failed is not None else f"ran past {timeout} s"
        tail = "\n".join(results[rank].stderr.rstrip().splitlines()[-20:])
        message = f"launch_loopback: rank {rank} {why}; the others were stopped. stderr tail:\n{tail}"
        raise LaunchError(message, rank, results)
    return results


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env() -> dict[str, str]:
    """``PYTHONPATH`` with this checkout first: the ranks import it even when it is not installed."""
    # The ranks must import this checkout even when it is not installed; warnings stay in their logs.
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": root if not path else f"{root}{os.pathsep}{path}"}


def busy_cpu_s() -> float | None:
    """CPU seconds this machine has spent busy (all cores, from ``/proc/stat``); ``None`` where unreadable."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait is busy.
    ticks = [int(x) for x in fields[:8]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and of its reaped children (the ranks, once they exited)."""
    import resource

    usages = (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    return sum(u.ru_utime + u.ru_stime for u in usages)


def read_results(out_dir: Path, prefix: str, count: int, suite: str) -> list[dict[str, Any]]:
    """The ``<prefix><i>.json`` files processes ``0 .. count-1`` of one run wrote, in order.

    Raises:
        RuntimeError: one is missing (its process exited cleanly without writing it); the message names ``suite``.
    """
    results = []
    for i in range(count):
        path = out_dir / f"{prefix}{i}.json"
        if not path.exists():
            raise RuntimeError(f"{suite}: {prefix} {i} exited cleanly but wrote no {path}")
        results.append(json.loads(path.read_text()))
    return results
