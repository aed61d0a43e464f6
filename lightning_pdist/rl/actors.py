"""The learner's side of the actors: forks them, serves their parameter pulls, collects their transitions, and names
an actor that crashed, went silent or was killed.

The learner process is the parameter server of its actors: it answers each ``PULL`` with the flat parameters it has
*now* (:func:`~lightning_pdist.rl.actor.params_of`), reading messages only when :meth:`ActorPool.collect` is called,
i.e. between two learner updates, never in the middle of one. ``collect`` takes, asynchronously, whatever the actors
sent (waiting only when there is nothing yet), or, in deterministic mode, exactly one chunk from a given actor
(answering its pull first): with one actor that refreshes every chunk the stream is then the one a single-process
loop produces. The actors are children of the learner (forked before any process group exists in it, never after
one is live: :mod:`lightning_pdist.core.forking`), die with it (``PR_SET_PDEATHSIG``) and are killed by
:meth:`ActorPool.close`. Never imports Lightning.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
import traceback
from multiprocessing.connection import Connection, Listener, wait
from typing import Any, Callable

import torch

from lightning_pdist.core.forking import fork_process
from lightning_pdist.rl.actor import run_actor
from lightning_pdist.rl.channel import Kind, encode, no_delay, receive, send
from lightning_pdist.rl.config import _Common

__all__ = ["ActorFailed", "ActorPool"]


class ActorFailed(RuntimeError):
    """An actor crashed, was killed or went silent; the message names it."""


class ActorPool:
    """``num_actors`` forked actor processes connected to this (the learner's) process."""

    def __init__(self, config: _Common, module: Any, params: Callable[[], torch.Tensor],
                 states: list[dict[str, Any] | None], obs_numel: int, host: str = "127.0.0.1",
                 servers: dict[str, Any] | None = None) -> None:  # fmt: skip
        """``servers`` (Gorila): the actors pull from these parameter servers; a ``PULL`` is answered with a bare
        ``PARAMS`` (the go-ahead) and ``params`` only sizes the frames."""
        self.config, self.params, self.owner, self.servers = config, params, config.owner, servers
        numel = int(params().numel())
        self.params_bytes = 4 * numel + 4096
        # the most a chunk may hold: send_every transitions of two float32 observations, their fields, the actor's state
        self.chunk_bytes = config.send_every * (2 * 4 * obs_numel + 64) + (1 << 20)
        epsilons = config.epsilons()
        authkey = secrets.token_bytes(32)
        self.listener = Listener((host, 0), authkey=authkey)
        self.pids: list[int] = []
        parent = os.getpid()
        for i in range(config.num_actors):
            pid = fork_process()
            if pid == 0:
                status = 1
                try:
                    address = self.listener.address
                    self.listener.close()
                    status = run_actor(i, config, epsilons[i], address, authkey, module, states[i],
                                       parent, self.params_bytes, servers)  # fmt: skip
                except BaseException:  # before it could connect: stderr is all it has
                    traceback.print_exc()
                finally:
                    os._exit(status)
            self.pids.append(pid)
        self.conns: dict[int, Connection] = {}
        self.by_conn: dict[Connection, int] = {}
        try:
            self._accept()
        except BaseException:
            self.close()
            raise

    def _accept(self) -> None:
        self.listener._listener._socket.settimeout(self.config.actor_timeout)  # an actor that never connects
        while len(self.conns) < self.config.num_actors:
            try:
                conn = no_delay(self.listener.accept())
            except TimeoutError:
                raise ActorFailed(self._silence(f"did not connect within actor_timeout={self.config.actor_timeout} s")) from None
            if not conn.poll(self.config.actor_timeout):
                raise ActorFailed(self._silence("connected but never said which actor it is"))
            _, meta, _ = receive(conn, 4096, (Kind.HELLO,))
            self.conns[int(meta["actor"])] = conn
            self.by_conn[conn] = int(meta["actor"])

    def _status(self, i: int) -> str:
        try:
            pid, status = os.waitpid(self.pids[i], os.WNOHANG)
        except ChildProcessError:
            return "is gone"
        if pid == 0:
            return "is still running"
        if os.WIFSIGNALED(status):
            return f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
        return f"exited with status {os.WEXITSTATUS(status)}"

    def _silence(self, what: str) -> str:
        missing = [i for i in range(self.config.num_actors) if i not in self.conns]
        return f"{self.owner}: actor(s) {missing} {what} ({'; '.join(f'actor {i} (pid {self.pids[i]}) {self._status(i)}' for i in missing)})"

    def _lost(self, i: int) -> ActorFailed:
        time.sleep(0.05)  # let the kernel reap it, so its status is known
        return ActorFailed(f"{self.owner}: actor {i} (pid {self.pids[i]}) closed its connection and {self._status(i)}; "
                           "the run stops (the learner does not go on with fewer actors than it was given)")  # fmt: skip

    def _handle(self, i: int, out: list[tuple[dict[str, Any], dict[str, torch.Tensor]]], cache: dict) -> Kind:
        conn = self.conns[i]
        try:
            kind, meta, tensors = receive(conn, max(self.params_bytes, self.chunk_bytes),
                                          (Kind.PULL, Kind.TRANSITIONS, Kind.ERROR))  # fmt: skip
        except (EOFError, ConnectionResetError):
            raise self._lost(i) from None
        if kind == Kind.ERROR:
            raise ActorFailed(f"{self.owner}: actor {i} (pid {self.pids[i]}) failed:\n{meta.get('error', '')}")
        if kind == Kind.PULL and self.servers is not None:
            send(conn, Kind.PARAMS)
        elif kind == Kind.PULL:  # every pull between two updates gets the same frame, encoded once
            if "frame" not in cache:
                cache["frame"] = encode(Kind.PARAMS, {}, {"flat": self.params()})
            conn.send_bytes(cache["frame"])
        else:
            out.append((meta, tensors))
        return kind

    def collect(self, actor: int | None = None) -> list[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
        """Chunks received now: every pending message of every actor (waiting for one if none is pending), or, with
        ``actor`` (deterministic mode), exactly one chunk of that actor."""
        out: list = []
        cache: dict = {}
        deadline = time.monotonic() + self.config.actor_timeout
        if actor is not None:
            while not out:
                if not self.conns[actor].poll(max(0.0, deadline - time.monotonic())):
                    raise ActorFailed(f"{self.owner}: actor {actor} (pid {self.pids[actor]}) sent nothing for "
                                      f"actor_timeout={self.config.actor_timeout} s and {self._status(actor)}")  # fmt: skip
                self._handle(actor, out, cache)
            return out
        rounds = 0
        while True:
            ready = wait(list(self.by_conn), timeout=0)
            for conn in ready:
                self._handle(self.by_conn[conn], out, cache)
            rounds += 1
            if out and (not ready or rounds >= 8):  # drain what is pending, at most 8 messages per actor
                return out
            if not ready:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ActorFailed(f"{self.owner}: no actor sent transitions for actor_timeout={self.config.actor_timeout} s "
                                      f"({'; '.join(f'actor {i} {self._status(i)}' for i in range(len(self.pids)))})")
                wait(list(self.by_conn), timeout=remaining)

    def alive(self) -> list[bool]:
        return [self._status(i) == "is still running" for i in range(len(self.pids))]

    def close(self) -> None:
        """Stop every actor (SIGKILL: one blocked in a send never reads a STOP) and reap it."""
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()
        self.by_conn.clear()
        self.listener.close()
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        self.pids = []
