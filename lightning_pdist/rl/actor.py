"""One actor process: acts ε_i-greedily in its own environment with a copy of the Q-network, sends n-step transitions
with their initial priorities |δ| (computed here, with the copy it acted with) to the learner.

The actor is forked from the learner, so it holds a copy of the LightningModule and uses three of its learner hooks:
``make_env()``, ``q_network``/``target_network`` (whose parameters it overwrites with every pull) and
``td_errors(batch, q_net, target_net)``. Loop, per chunk of ``send_every`` environment steps: pull the parameters if
``refresh_every`` or more steps went by since the last pull (so the refresh period is a whole number of chunks),
take the steps, send the chunk. Each step draws ``u ~ U[0, 1)`` from the actor's generator (seeded ``seed + i``)
and, if ``u < ε_i``, a uniform action from it too; otherwise ``argmax_a Q(s, a)``. The first episode resets with
``seed + i + 1000·restarts`` (``restarts``: how many resumes this run has had).

Every chunk carries the actor's state (the generator, its step and episode counts), so the learner's checkpoint holds
each actor as of the last transitions the replay has. The environment's own state is not kept: a resumed actor starts
a new episode and drops the unfinished n-step tail of the old one. Never imports Lightning.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback
from multiprocessing.connection import Client
from typing import Any

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from lightning_pdist.core.ps_client import ParameterServerClient
from lightning_pdist.rl.channel import Kind, no_delay, receive, send
from lightning_pdist.rl.config import _Common
from lightning_pdist.rl.nstep import NStep, stack

__all__ = ["params_of", "run_actor"]

_PR_SET_PDEATHSIG = 1


def params_of(module: Any) -> torch.Tensor:
    """The flat vector an actor receives: the online network's parameters, then the target network's."""
    return torch.cat([parameters_to_vector(module.q_network.parameters()).detach(),
                      parameters_to_vector(module.target_network.parameters()).detach()]).float()  # fmt: skip


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


class _Actor:
    def __init__(self, index: int, config: _Common, epsilon: float, module: Any, state: dict[str, Any] | None) -> None:
        self.index, self.config, self.epsilon, self.module = index, config, epsilon, module
        self.q, self.target = module.q_network, module.target_network
        self.split = sum(p.numel() for p in self.q.parameters())
        self.generator = torch.Generator().manual_seed(config.seed + index)
        state = state or {}
        if "rng" in state:
            self.generator.set_state(state["rng"])
        self.env_steps, self.restarts = int(state.get("env_steps", 0)), int(state.get("restarts", -1)) + 1
        self.env = module.make_env()
        obs, _ = self.env.reset(seed=config.seed + index + 1000 * self.restarts)
        self.obs = torch.as_tensor(obs, dtype=torch.float32)
        self.nstep = NStep(config.n_step, config.gamma)
        self.episode_return, self.finished = 0.0, []

    def load(self, flat: torch.Tensor) -> None:
        vector_to_parameters(flat[:self.split], self.q.parameters())
        vector_to_parameters(flat[self.split:], self.target.parameters())

    @torch.no_grad()
    def act(self) -> int:
        if float(torch.rand((), generator=self.generator)) < self.epsilon:
            return int(torch.randint(self.env.action_space.n, (), generator=self.generator))
        return int(self.q(self.obs.unsqueeze(0)).argmax(dim=1))

    def step(self) -> list[dict[str, Any]]:
        action = self.act()
        nxt, reward, terminated, truncated, _ = self.env.step(action)
        nxt = torch.as_tensor(nxt, dtype=torch.float32)
        out = self.nstep.push(self.obs, action, float(reward), nxt, bool(terminated), bool(truncated))
        self.episode_return += float(reward)
        self.env_steps += 1
        if terminated or truncated:
            self.finished.append(self.episode_return)
            self.episode_return = 0.0
            obs, _ = self.env.reset()
            self.obs = torch.as_tensor(obs, dtype=torch.float32)
        else:
            self.obs = nxt
        return out

    @torch.no_grad()
    def chunk(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        out = []
        for _ in range(self.config.send_every):
            out += self.step()
        batch = stack(out, tuple(self.obs.shape))
        td = self.module.td_errors(batch, self.q, self.target).float() if out else torch.zeros(0)
        meta = {"actor": self.index, "env_steps": self.env_steps, "episodes": self.finished, "restarts": self.restarts}
        self.finished = []
        return meta, {**batch, "td": td, "rng": self.generator.get_state()}


def _server_client(servers: dict[str, Any] | None) -> ParameterServerClient | None:
    """Gorila: this actor's own connections to the parameter servers (it pulls as its learner's worker index)."""
    if servers is None:
        return None
    client = ParameterServerClient(servers["addresses"], servers["worker"], timeout=servers["timeout"],
                                   secret=servers["secret"])  # fmt: skip
    client.hello()
    return client


def run_actor(index: int, config: _Common, epsilon: float, address: Any, authkey: bytes, module: Any,
              state: dict[str, Any] | None, parent: int, params_bytes: int,
              servers: dict[str, Any] | None = None) -> int:  # fmt: skip
    """The actor's whole life (in the forked child); returns its exit status.

    Ape-X (``servers`` None): the learner's ``PARAMS`` answer carries the parameters. Gorila: it carries none; it
    is the learner's go-ahead (its last push has been applied), and the actor then pulls the online network from the
    parameter servers (``servers``: their addresses, the secret, the learner's worker index) and uses it as its
    target copy too (Gorila's replay is uniform: the actor's priorities are not used)."""
    _die_with_parent(parent)
    torch.set_num_threads(1)
    conn = no_delay(Client(address, authkey=authkey))
    client = None
    try:
        send(conn, Kind.HELLO, {"actor": index, "pid": os.getpid()})
        actor = _Actor(index, config, epsilon, module, state)
        client = _server_client(servers)
        since_refresh = config.refresh_every
        while True:
            if since_refresh >= config.refresh_every:
                send(conn, Kind.PULL)
                kind, _, tensors = receive(conn, params_bytes, (Kind.PARAMS, Kind.STOP))
                if kind == Kind.STOP:
                    return 0
                if client is not None:
                    online = torch.cat([s.float() for s in client.pull(record=False)[0]])
                    tensors = {"flat": torch.cat([online, online])}
                actor.load(tensors["flat"])
                since_refresh = 0
            meta, tensors = actor.chunk()
            since_refresh += config.send_every
            send(conn, Kind.TRANSITIONS, meta, tensors)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 0  # the learner is gone or closed us: nothing to report to
    except BaseException:
        try:
            send(conn, Kind.ERROR, {"actor": index, "error": traceback.format_exc(limit=8)})
        except OSError:
            pass
        return 1
    finally:
        if client is not None:
            client.close()
