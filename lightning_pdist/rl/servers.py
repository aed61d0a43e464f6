"""Gorila's parameter servers, started and spoken to as a user on another host would: the documented program
``python -m lightning_pdist.parameter_server.process`` and the servers' wire protocol (``core/ps_client.py``).

:class:`ServerGroup` (on the first learner) writes a fresh 32-byte secret to a file only its owner may read (mode
0600, in a private temporary directory), starts ``num_servers`` server processes with ``--secret-file`` on any free
port of ``127.0.0.1`` (each prints the port it bound; its output goes to a log file in that directory, quoted when it
fails to start), and configures them with one ``INIT`` each, as the parameter-server strategy's rank 0 does: mode
``async`` (Downpour: each push is one optimizer step on ``g / num_learners`` on arrival, pulls are answered at once),
the learners as its workers, its contiguous shard of the flat Q-network, and the learner's optimizer (class name
and param groups; the server rebuilds it for its shard). Each server process dies with the learner that started it
(``PR_SET_PDEATHSIG``) and is shut down, then killed if it lingers, by :meth:`ServerGroup.close`.

Flat layout: the Q-network's parameters in ``parameters()`` order, split into ``num_servers`` contiguous ranges of
``⌈d / S⌉`` (the last shorter); each range's ``segments`` are the runs of one param group inside it.
Never imports Lightning.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_pdist.core.ps_client import ParameterServerClient, group_hparams
from lightning_pdist.core.ps_wire import Kind, dumps_state, loads_state

__all__ = ["ServerGroup", "bounds", "segments"]

_PR_SET_PDEATHSIG = 1
#: A started server's idle timeout (seconds without a message). Only a backstop: each server dies with its learner
#: (PDEATHSIG) and is closed by it. It counts from the server's start, so the server timeout (how long a server may
#: take to start or answer) was too short for it: on a loaded machine the learner connected after its first server,
#: started before the others and Lightning's set-up, had already left.
IDLE_BACKSTOP_S = 3600.0
_LISTENING = re.compile(rb"listening on (\S+):(\d+)")
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def bounds(numel: int, num_servers: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each server's shard of a flat vector of ``numel`` values."""
    size = -(-numel // num_servers)
    return [(min(numel, s * size), min(numel, (s + 1) * size)) for s in range(num_servers)]


def segments(group_sizes: list[tuple[int, int]], start: int, stop: int) -> list[list[int]]:
    """``[[0, group, numel], ...]`` of ``[start, stop)``, given ``(group, numel)`` of each parameter in flat order."""
    out: list[list[int]] = []
    offset = 0
    for group, numel in group_sizes:
        lo, hi = max(start, offset), min(stop, offset + numel)
        if hi > lo:
            if out and out[-1][1] == group:
                out[-1][2] += hi - lo
            else:
                out.append([0, group, hi - lo])
        offset += numel
    return out


def _die_with_parent(parent: int) -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


class ServerGroup:
    """``num_servers`` server processes started from this process, and the secret they share."""

    def __init__(self, num_servers: int, owner: str, timeout: float) -> None:
        self.owner, self.timeout = owner, timeout
        self.dir = tempfile.mkdtemp(prefix="pdist-gorila-")  # mode 0700
        self.secret_file = os.path.join(self.dir, "secret")
        self.secret = os.urandom(16).hex().encode() + os.urandom(16).hex().encode()  # 64 bytes
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.secret)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")])))
        self.procs: list[subprocess.Popen] = []
        self.logs: list[str] = []
        parent = os.getpid()
        try:
            for s in range(num_servers):
                log = os.path.join(self.dir, f"server{s}.log")
                with open(log, "wb") as out:
                    self.procs.append(subprocess.Popen(
                        [sys.executable, "-m", "lightning_pdist.parameter_server.process", "--index", str(s),
                         "--host", "127.0.0.1", "--port", "0", "--secret-file", self.secret_file,
                         "--idle-timeout", str(IDLE_BACKSTOP_S)],
                        stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, close_fds=True,
                        preexec_fn=lambda: _die_with_parent(parent)))  # fmt: skip
                self.logs.append(log)
            self.addresses = [self._address(s) for s in range(num_servers)]
        except BaseException:
            self.close()
            raise

    def _tail(self, s: int) -> str:
        try:
            return Path(self.logs[s]).read_bytes()[-2000:].decode(errors="replace")
        except OSError:
            return ""

    def _address(self, s: int) -> str:
        deadline = time.monotonic() + self.timeout
        while True:
            found = _LISTENING.search(Path(self.logs[s]).read_bytes())
            if found:
                return f"{found.group(1).decode()}:{found.group(2).decode()}"
            code = self.procs[s].poll()
            if code is not None or time.monotonic() > deadline:
                what = f"exited with status {code}" if code is not None else f"did not listen within server_timeout={self.timeout:g} s"
                raise RuntimeError(f"{self.owner}: parameter server {s} (pid {self.procs[s].pid}, python -m "
                                   f"lightning_pdist.parameter_server.process) {what}; its output:\n{self._tail(s)}")  # fmt: skip
            time.sleep(0.05)

    def init(self, client: ParameterServerClient, flat: Tensor, group_sizes: list[tuple[int, int]],
             optimizer: torch.optim.Optimizer, num_learners: int) -> None:  # fmt: skip
        """One ``INIT`` per server: mode ``async``, its shard of ``flat``, the optimizer it runs on it."""
        groups = [group_hparams(g, f"{self.owner}: param group {i}") for i, g in enumerate(optimizer.param_groups)]
        optimizers = [{"name": type(optimizer).__name__, "param_groups": groups}]
        parts = bounds(flat.numel(), len(self.procs))
        metas = [{"mode": "async", "num_workers": num_learners, "dtype": str(flat.dtype), "optimizers": optimizers,
                  "segments": segments(group_sizes, a, b)} for a, b in parts]  # fmt: skip
        client.map(Kind.INIT, metas, [flat[a:b].contiguous() for a, b in parts])

    @staticmethod
    def get_state(client: ParameterServerClient) -> list[Any]:
        return [loads_state(payload) for _, payload in client.map(Kind.GET_STATE, [{}] * client.num_servers)]

    @staticmethod
    def set_state(client: ParameterServerClient, states: list[Any]) -> None:
        client.map(Kind.SET_STATE, [{}] * client.num_servers, [dumps_state(s) for s in states])

    def close(self, client: ParameterServerClient | None = None, wait: float = 5.0) -> None:
        """``SHUTDOWN`` each server (when ``client`` is given), wait up to ``wait`` s, then SIGKILL; reap all."""
        if client is not None:
            try:
                client.map(Kind.SHUTDOWN, [{}] * client.num_servers)
            except Exception:  # noqa: BLE001  (a server already gone: killed below)
                pass
        deadline = time.monotonic() + wait
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
        shutil.rmtree(self.dir, ignore_errors=True)
