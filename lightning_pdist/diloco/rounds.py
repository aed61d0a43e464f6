"""DiLoCo's rounds on one replica: ``θ_global`` and the outer optimizer per fragment, the exchanges in flight.

Driven identically by the Trainer strategy (:mod:`.strategy`) and the Fabric strategy (:mod:`.fabric`): after
every inner step ``t`` they call :meth:`Rounds.after_step`, which starts the exchanges the schedule
(:class:`~lightning_pdist.diloco.fragments.StreamingSchedule`) names and completes the ones due::

    start (fragment p, after step t):   Δ_r = θ_global,p − θ_r,p;  exchange(Δ_r, buffers_r) begins
    merge (after step t + τ):           θ_global,p ← OuterOpt_p(θ_global,p, grad = mean_r Δ_r)
                                        b_global,p ← mean_r b_r
                                        θ_r,p ← α·θ_r,p + (1−α)·θ_global,p;  b_r,p likewise

``θ_global`` and every outer optimizer's state are the same on every replica (they change only through the same
means); each replica's own parameters and inner optimizer state are its own. The *global model* (every fragment's
``θ_global`` and mean buffers, an exchange in flight completed on a copy) is what evaluation sees, what checkpoints
hold in ``state_dict`` and what training outputs; reading it costs no collective (at most the wait for an exchange).
"""

from __future__ import annotations

import copy as copy_module
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_pdist.core.accounting import CommMeter
from lightning_pdist.core.flat import flatten, unflatten_into_
from lightning_pdist.diloco.exchange import Exchange, start_exchange
from lightning_pdist.diloco.fragments import StreamingSchedule, fragment_modules, fragment_tensors
from lightning_pdist.diloco.outer import OuterConfig, outer_step_

__all__ = ["Fragment", "Rounds"]


@dataclass
class Fragment:
    """One fragment: its tensors in the module, its ``θ_global`` (a flat parameter), mean buffers, outer optimizer."""

    params: list[Tensor]
    buffers: list[Tensor]
    global_params: nn.Parameter
    global_buffers: Tensor
    optimizer: Optimizer
    pending: Exchange | None = None


class Rounds:
    """The run-time state of DiLoCo / Streaming DiLoCo on one replica (see the module docstring).

    Args:
        schedule: ``H``, ``P``, ``τ``, ``α`` and the quantization.
        outer: the outer optimizer.
        fragments: the user's module names per fragment, or ``None`` for ``P`` contiguous blocks of layers.
        owner: the name in error messages (the strategy class).
    """

    def __init__(self, schedule: StreamingSchedule, outer: OuterConfig, fragments: list[list[str]] | None,
                 owner: str) -> None:  # fmt: skip
        self.schedule, self.outer, self.fragment_names, self.owner = schedule, outer, fragments, owner
        self.parts: list[Fragment] = []
        self.meter: CommMeter | None = None
        #: Called with (mean Δ, mean buffers) before a merge applies them (the non-finite check).
        self.check: Callable[[Tensor, Tensor], None] = lambda delta, buffers: None
        #: Called with ‖mean Δ‖ at every merge (a diagnostic).
        self.note: Callable[[float], None] = lambda norm: None

    def start(self, module: nn.Module, meter: CommMeter | None) -> None:
        """Build the fragments from ``module`` (every replica holds the same weights): ``θ_global`` = the module."""
        self.meter = meter
        groups = fragment_modules(module, self.schedule.num_fragments, self.fragment_names, self.owner,
                                  self.schedule.balance)
        self.parts = []
        for params, buffers in fragment_tensors(module, groups):
            global_params = nn.Parameter(flatten(params))
            self.parts.append(Fragment(params, buffers, global_params, flatten(buffers),
                                       self.outer.build(global_params)))  # fmt: skip

    # ------------------------------------------------------------------ the schedule
    def after_step(self, step: int) -> None:
        """After inner step ``step`` (1-based): start the exchanges due, then merge the ones due (``τ = 0``: both)."""
        for p in self.schedule.starts_after(step):
            self.start_exchange(p)
        for p in self.schedule.merges_after(step):
            self.merge(p)

    def start_exchange(self, p: int) -> None:
        part = self.parts[p]
        delta = part.global_params.detach() - flatten(part.params)
        part.pending = start_exchange(delta, flatten(part.buffers), self.schedule.quantize, self.meter)

    def _outer_step(self, part: Fragment) -> None:
        mean_delta, mean_buffers = part.pending.wait()
        self.check(mean_delta, mean_buffers)
        part.pending = None
        self.note(float(torch.linalg.vector_norm(mean_delta)))
        outer_step_(part.optimizer, part.global_params, mean_delta)
        part.global_buffers.copy_(mean_buffers)

    @torch.no_grad()
    def merge(self, p: int) -> None:
        """Outer step of fragment ``p``, then ``θ_r ← α·θ_r + (1−α)·θ_global`` (buffers likewise)."""
        part = self.parts[p]
        self._outer_step(part)
        alpha = float(self.schedule.fragment_alpha)
        for tensors, target in ((part.params, part.global_params.detach()), (part.buffers, part.global_buffers)):
            new = target if alpha == 0.0 else torch.lerp(target, flatten(tensors), alpha)
            unflatten_into_(new, tensors)

    def finish(self) -> None:
        """Complete every exchange in flight with its outer step (end of training); replicas are not merged."""
        for part in self.parts:
            if part.pending is not None:
                self._outer_step(part)

    # ------------------------------------------------------------------ the global model
    def global_vector(self) -> Tensor:
        """The global model: every fragment's ``θ_global`` and mean buffers, flat, in fragment order, with any
        exchange in flight waited for and its outer step taken on a copy (what :meth:`finish` would make of it)."""
        out = []
        for part in self.parts:
            params, buffers = part.global_params.detach(), part.global_buffers
            if part.pending is not None:
                mean_delta, buffers = part.pending.wait()
                copy = nn.Parameter(params.clone())
                optimizer = self.outer.build(copy)
                optimizer.load_state_dict(copy_module.deepcopy(part.optimizer.state_dict()))
                outer_step_(optimizer, copy, mean_delta)
                params = copy.detach()
            out.append(torch.cat([params, buffers]))
        return torch.cat(out)

    def local_vector(self) -> Tensor:
        """This replica's tensors in the order of :meth:`global_vector`."""
        return torch.cat([torch.cat([flatten(p.params), flatten(p.buffers)]) for p in self.parts])

    @torch.no_grad()
    def load_vector(self, vector: Tensor) -> None:
        """Load a vector laid out as :meth:`global_vector` into the module."""
        offset = 0
        for part in self.parts:
            for tensors in (part.params, part.buffers):
                n = sum(t.numel() for t in tensors)
                unflatten_into_(vector[offset : offset + n], tensors)
                offset += n

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """``θ_global``, mean buffers, outer-optimizer state and the drained result of any exchange in flight per
        fragment: the same on every replica."""
        out = []
        for part in self.parts:
            pending = None if part.pending is None else [t.clone() for t in part.pending.wait()]
            out.append({"global_params": part.global_params.detach().clone(), "global_buffers": part.global_buffers.clone(),
                        "outer_optimizer": part.optimizer.state_dict(), "pending": pending})  # fmt: skip
        return {"fragments": out}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        fragments = state["fragments"]
        if len(fragments) != len(self.parts):
            raise ValueError(f"{self.owner}: the checkpoint has {len(fragments)} fragments, this run {len(self.parts)}")
        for part, saved in zip(self.parts, fragments):
            part.global_params.copy_(saved["global_params"])
            part.global_buffers.copy_(saved["global_buffers"])
            part.optimizer.load_state_dict(saved["outer_optimizer"])
            pending = saved["pending"]
            part.pending = None if pending is None else Exchange.done(*pending)

    def checkpoint(self, step: int) -> dict:
        """What both shells save of the algorithm: the step count (training steps taken) and :meth:`state_dict`."""
        return {"step": step, "rounds": self.state_dict()}

    def restore(self, state: dict) -> int:
        """Load what :meth:`checkpoint` saved; returns the step count."""
        self.load_state_dict(state["rounds"])
        return int(state.get("step", 0))
