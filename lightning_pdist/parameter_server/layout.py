"""Worker side of the shard layout: which user optimizer owns each parameter slice, and compact pushes.

Each user optimizer ``k`` gets its own optimizer on every server (:mod:`lightning_pdist.parameter_server.shard`).
When ``k`` steps on a worker, the worker pushes to server ``s``, in the shard order of
:meth:`ShardingPlan.param_slices`, only the slices of ``k``'s parameters that have a gradient, plus a
``present`` string with one character per slice of ``k`` on ``s`` (``"1"``: sent). A parameter whose
``.grad`` is ``None`` sends nothing, and the server leaves it out of the step unless another worker had
a gradient for it.

Never imports Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_pdist.parameter_server.chunks import chunk_bounds
from lightning_pdist.parameter_server.sharding import ShardingPlan

__all__ = ["OptimizerLayout", "accumulate_grads", "numeric_hparams"]


class OptimizerLayout:
    """The module's parameters, the optimizer and param group owning each, and per-server slices.

    Args:
        named_parameters: ``(name, parameter)`` in the plan's flat order (``module.named_parameters()``).
        optimizers: the user's optimizers; each parameter may be in at most one of them. Parameters in none
            are frozen on the servers.
        plan: the sharding plan over the same parameters.
        owner: the name errors start with.

    Raises:
        ValueError: a parameter in two optimizers, or an optimizer holding a tensor that is not one of the
            module's parameters.
    """

    def __init__(self, named_parameters: Sequence[tuple[str, Tensor]], optimizers: Sequence[Optimizer],
                 plan: ShardingPlan, owner: str = "OptimizerLayout"):  # fmt: skip
        self.plan = plan
        self.params = dict(named_parameters)
        self.num_optimizers = len(optimizers)
        name_of = {id(p): n for n, p in named_parameters}
        self.owner_of: dict[str, tuple[int, int]] = {}
        for k, optimizer in enumerate(optimizers):
            for g, group in enumerate(optimizer.param_groups):
                for p in group["params"]:
                    name = name_of.get(id(p))
                    if name is None:
                        raise ValueError(
                            f"{owner}: optimizer {k} ({type(optimizer).__name__}) param group {g} holds a tensor of shape "
                            f"{tuple(p.shape)} that is not a parameter of the LightningModule; the servers hold the "
                            "module's parameters only"
                        )
                    if name in self.owner_of:
                        raise ValueError(
                            f"{owner}: parameter {name!r} is in optimizer {self.owner_of[name][0]} and optimizer {k}; "
                            "each parameter must belong to one optimizer (a server steps each optimizer's parameters "
                            "with that optimizer's state alone)"
                        )
                    self.owner_of[name] = (k, g)
        # (server, optimizer) -> [(name, start, stop)] of the non-empty slices, in shard order
        self._slices: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        # chunked steps (chunk_bytes): elements per partition of each server, and each slice's partition index there
        self._chunk_numels: list[list[int]] = []
        self._chunk_of: dict[tuple[int, int], list[int]] = {}
        for server in range(plan.num_servers):
            numels: list[int] = []
            last_part = None
            for piece in plan.param_slices(server):
                if piece.part != last_part:
                    numels.append(0)
                    last_part = piece.part
                numels[-1] += piece.numel
                k = self.owner_of.get(piece.name, (-1, -1))[0]
                if k >= 0 and piece.numel:
                    self._slices.setdefault((server, k), []).append((piece.name, piece.start, piece.stop))
                    self._chunk_of.setdefault((server, k), []).append(len(numels) - 1)
            self._chunk_numels.append(numels)

    def chunks(self, server: int) -> list[int]:
        """Elements of each of ``server``'s partitions, in shard order: its chunks under ``chunk_bytes``."""
        return list(self._chunk_numels[server])

    def chunk_bounds(self, server: int, optimizer: int, present: str) -> list[int]:
        """Where each chunk's part starts in :meth:`pack`'s compact gradient (and where the last ends)."""
        pieces = [(start, stop, chunk) for (_, start, stop), chunk in zip(self._slices.get((server, optimizer), []),
                                                                          self._chunk_of.get((server, optimizer), []))]  # fmt: skip
        return chunk_bounds(pieces, [p == "1" for p in present], len(self._chunk_numels[server]))

    def segments(self, server: int) -> list[list[int]]:
        """``[[optimizer, group, numel], ...]`` of ``server``'s slices in shard order (``-1``: frozen)."""
        return [[*self.owner_of.get(p.name, (-1, -1)), p.numel] for p in self.plan.param_slices(server)]

    def names_of(self, optimizer: int) -> list[str]:
        """The parameters ``optimizer`` owns, in flat order."""
        return [name for name in self.params if self.owner_of.get(name, (-1,))[0] == optimizer]

    def grads_of(self, optimizer: int) -> dict[str, Tensor | None]:
        """``name -> .grad`` (``None`` where the worker has none) of ``optimizer``'s parameters."""
        return {name: self.params[name].grad for name in self.names_of(optimizer)}

    def slices(self, server: int, optimizer: int) -> list[tuple[str, int, int]]:
        """``(name, start, stop)`` of ``optimizer``'s non-empty slices on ``server``, in shard order."""
        return list(self._slices.get((server, optimizer), []))

    def pack(self, server: int, optimizer: int, grads: Mapping[str, Tensor | None]) -> tuple[Tensor, str]:
        """``(compact gradient, present)`` of ``optimizer``'s slices on ``server`` (see the module docstring)."""
        parts, present = [], []
        for name, start, stop in self._slices.get((server, optimizer), []):
            grad = grads.get(name)
            present.append("0" if grad is None else "1")
            if grad is not None:  # a sparse embedding gradient goes dense: the servers step whole slices (Parallax: rows)
                parts.append((grad.detach().to_dense() if grad.is_sparse else grad.detach()).reshape(-1)[start:stop])
        if not parts:
            return torch.zeros(0, dtype=next(iter(self.params.values())).dtype), "".join(present)
        return torch.cat(parts), "".join(present)


def accumulate_grads(total: dict[str, Tensor | None] | None, grads: Mapping[str, Tensor | None]) -> dict[str, Tensor | None]:
    """``total + grads`` per parameter, where ``None`` (no gradient) is the identity (a copy on first use)."""
    out = dict(total or {})
    for name, grad in grads.items():
        if grad is None:
            out.setdefault(name, None)
        elif out.get(name) is None:
            out[name] = grad.detach().clone()
        else:
            out[name].add_(grad)
    return out


def numeric_hparams(group: dict) -> dict:
    """The hyperparameters a scheduler may change: numbers and tuples of numbers."""
    out = {}
    for key, value in group.items():
        if key == "params" or isinstance(value, bool):
            continue
        if isinstance(value, Tensor) and value.numel() == 1:
            out[key] = value.item()
        elif isinstance(value, (int, float)):
            out[key] = value
        elif isinstance(value, (tuple, list)) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            out[key] = list(value)
    return out
