"""DiLoCo's outer exchange across replicas that may die and rejoin, on torchft (Manager, lighthouse, gloo group).

Each replica is its own process (its own Lightning world of one) and its own torchft *replica group*: a
``TCPStore`` it serves, a reconfigurable :class:`torchft.process_group.ProcessGroupGloo` and a
:class:`torchft.manager.Manager` (synchronous quorum) that talks to the lighthouse. Every round end
(:meth:`FaultTolerantReplica.average`)::

    quorum  = the replicas the lighthouse sees alive and asking (torchft; a dead one stops heartbeating)
    heal    : a replica behind the quorum's step loads a live peer's state (θ_global, outer optimizer state, step)
              through torchft's checkpoint transport before anything else (torchft's ``load_state_dict`` hooks)
    w_r     = 1 if replica r ran this round from θ_global, else 0 (it has just joined or healed)
    S       = Σ_{r in quorum} [w_r·Δ_r, w_r·b_r, w_r, w_r·t_r]   one torchft all-reduce (SUM) over the quorum
    mean Δ  = S_Δ / S_w,  mean b = S_b / S_w                 the mean over the replicas present, only
    step    = S_t / S_w                                      the contributors' step t (a joining replica takes it)
    commit  = torchft's should_commit (every replica of the quorum healthy and the collective clean)

The caller takes the outer step only if the round committed and ``S_w > 0``; otherwise every replica goes back to
``θ_global`` (the round's local steps are discarded, as in torchft's own DiLoCo). Bytes this replica sends: one
all-reduce of ``d + 2`` fp32 values over the quorum (``2(n−1)/n · 4(d+2)``, kind ``pseudo_grad_ft_all_reduce``).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
from torch import Tensor
from torch.distributed import ReduceOp, TCPStore

from lightning_pdist.core.accounting import CommMeter, all_reduce_bytes

__all__ = ["FaultTolerantReplica", "RoundOutcome", "check_ft_args"]


@dataclass
class RoundOutcome:
    """What one fault-tolerant round gave this replica."""

    mean_delta: Tensor | None  # None: no outer step (not committed, or nobody contributed)
    mean_buffers: Tensor | None
    contributors: int  # replicas that contributed a pseudo-gradient (Σ w_r)
    participants: int  # replicas in the quorum
    committed: bool
    healed: bool  # this replica loaded a peer's state in this round's quorum
    contributed: bool
    step: int  # the contributors' step (every contributor's is the same), or the caller's when none contributed


def check_ft_args(owner: str, fault_tolerant: Any, lighthouse: str | None, replica_id: str | None,
                  min_replicas: Any, timeout: Any) -> dict | None:  # fmt: skip
    """The keyword arguments of :class:`FaultTolerantReplica`, or ``None`` without fault tolerance; refuses bad ones.

    The lighthouse and replica id default to ``TORCHFT_LIGHTHOUSE`` and ``REPLICA_GROUP_ID`` (torchft's names).
    """
    if not isinstance(fault_tolerant, bool):
        raise ValueError(f"{owner}(fault_tolerant={fault_tolerant!r}): must be True or False")
    if not isinstance(min_replicas, int) or isinstance(min_replicas, bool) or min_replicas < 1:
        raise ValueError(f"{owner}(min_replicas={min_replicas!r}): must be an integer >= 1")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e6:
        raise ValueError(f"{owner}(ft_timeout={timeout!r}): must be a number of seconds in (0, 1e6)")
    if not fault_tolerant:
        for name, value in (("lighthouse", lighthouse), ("replica_id", replica_id)):
            if value is not None:
                raise ValueError(f"{owner}({name}={value!r}): only used with fault_tolerant=True")
        return None
    lighthouse = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not lighthouse:
        raise ValueError(f"{owner}(lighthouse=None): fault_tolerant=True needs the address of a running torchft "
                         "lighthouse ('http://host:port'), as the argument or TORCHFT_LIGHTHOUSE")  # fmt: skip
    replica_id = replica_id if replica_id is not None else os.environ.get("REPLICA_GROUP_ID")
    if replica_id is None or not str(replica_id).strip():
        raise ValueError(f"{owner}(replica_id={replica_id!r}): fault_tolerant=True needs one id per replica, kept "
                         "across its restarts, as the argument or REPLICA_GROUP_ID")  # fmt: skip
    return {"lighthouse": lighthouse, "replica_id": str(replica_id), "min_replicas": min_replicas,
            "timeout": float(timeout)}  # fmt: skip


class FaultTolerantReplica:
    """This replica's torchft replica group (see the module docstring).

    Args:
        lighthouse: the lighthouse address (``http://host:port``).
        replica_id: this replica's id, the same across its restarts (torchft appends a fresh uuid).
        min_replicas: torchft's ``min_replica_size``: a round commits only with at least this many in the quorum.
        timeout: seconds for collectives, should_commit and the checkpoint transfer; the quorum waits ``10×``.
        state_dict: returns what a healing peer needs (called on torchft's quorum thread while this replica waits).
        load_state_dict: loads it on a healing replica (called on the main thread, inside the quorum).
    """

    def __init__(self, lighthouse: str, replica_id: str, min_replicas: int, timeout: float,
                 state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]) -> None:  # fmt: skip
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        self._load, self.healed = load_state_dict, False
        host = os.environ.get("PDIST_FT_HOST", "127.0.0.1")
        # torchft's Manager connects to an existing store as a client; this replica group (of one process) serves it.
        self.store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self.pg = ProcessGroupGloo(timeout=timedelta(seconds=timeout))
        self.manager = Manager(
            pg=self.pg, load_state_dict=self._heal, state_dict=state_dict, min_replica_size=min_replicas,
            use_async_quorum=False, timeout=timedelta(seconds=timeout), quorum_timeout=timedelta(seconds=10 * timeout),
            connect_timeout=timedelta(seconds=timeout), rank=0, world_size=1, store_addr=host,
            store_port=self.store.port, lighthouse_addr=lighthouse, replica_id=replica_id, hostname=socket.gethostname(),
        )  # fmt: skip

    def _heal(self, state: Any) -> None:
        self.healed = True
        self._load(state)

    def average(self, contribution: Callable[[], tuple[Tensor, Tensor] | None], size: tuple[int, int],
                meter: CommMeter | None, step: int) -> RoundOutcome:  # fmt: skip
        """One round: quorum (and heal), the weighted all-reduce over the quorum, commit.

        ``contribution()`` is called after the quorum (so after a heal) and returns ``(Δ_r, b_r)`` flat fp32, or
        ``None`` when this replica has nothing to contribute this round; ``size`` = ``(len Δ, len b)``; ``step``:
        the caller's step, summed with the weights (``S_t = Σ w_r·t_r``) so that a replica that joins a round
        without contributing learns its step (``S_t / S_w``).
        """
        self.healed = False
        self.manager.start_quorum()  # synchronous: a replica behind heals here (self._heal)
        mine = None if self.healed else contribution()
        n_delta, n_buffers = size
        vec = torch.zeros(n_delta + n_buffers + 2)
        if mine is not None:
            torch.cat([mine[0], mine[1], torch.tensor([1.0, float(step)])], out=vec)
        participants = self.manager.num_participants()
        self.manager.allreduce(vec, reduce_op=ReduceOp.SUM).wait()
        if meter is not None and participants > 1:
            meter.add("pseudo_grad_ft_all_reduce", all_reduce_bytes(vec.numel() * 4, participants))
        committed = bool(self.manager.should_commit())
        count = int(round(float(vec[-2])))
        ok = committed and count > 0
        return RoundOutcome(
            mean_delta=vec[:n_delta] / count if ok else None, mean_buffers=vec[n_delta:-2] / count if ok else None,
            contributors=count, participants=participants, committed=committed, healed=self.healed,
            contributed=mine is not None, step=int(round(float(vec[-1]) / count)) if count > 0 else step,
        )  # fmt: skip

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
        self.pg.shutdown() if hasattr(self.pg, "shutdown") else None
