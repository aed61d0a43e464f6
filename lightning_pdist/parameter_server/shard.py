"""One parameter server's shard: a flat buffer, one ``Parameter`` view per parameter slice, one optimizer per user optimizer.

The user's optimizers are rebuilt on the shard from their class names and param-group hyperparameters.
Only element-wise optimizers (:data:`ELEMENTWISE_OPTIMIZERS`) are accepted: for them, cutting a parameter
into pieces on several servers does not change the update. Each slice of a parameter that the plan puts
on this server is its own ``Parameter`` (a view into :attr:`ParameterShard.flat`, so pushes and pulls
copy nothing), which lets a step leave out exactly the parameters that got no gradient.

A push names the optimizer ``k`` that stepped and carries only the gradients of ``k``'s slices that were
*present* (a parameter whose ``.grad`` was ``None`` on the worker sends nothing)::

    payload = concat(g[piece] for piece in pieces(k) if present[piece])      # compact, shard order

:meth:`ParameterShard.expand` turns it into a shard-sized gradient (zeros elsewhere) for the rules of
:mod:`lightning_pdist.parameter_server.rules`, and :meth:`ParameterShard.apply_` steps optimizer ``k`` with
``piece.grad = None`` for every piece no worker had a gradient for. A torch optimizer skips such a
parameter entirely (no momentum, no weight decay), as after DDP with ``find_unused_parameters=True``.

Never imports Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ParameterShard", "parse_present"]

# torch.optim classes whose update of an element depends only on that element's gradient and state.
ELEMENTWISE_OPTIMIZERS = (
    "ASGD", "Adadelta", "Adagrad", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "SGD",
)  # fmt: skip


def parse_present(present: str | None, count: int) -> list[bool]:
    """``"1011"`` (one character per piece of the optimizer, ``1``: had a gradient) -> booleans; ``None``: all."""
    if present is None:
        return [True] * count
    if not isinstance(present, str) or len(present) != count or set(present) - {"0", "1"}:
        raise ValueError(f"present={present!r}: must be a string of {count} '0'/'1' characters, one per piece")
    return [c == "1" for c in present]


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite(value: Any) -> bool:
    if not _is_number(value):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int beyond float range
        return False


class ParameterShard:
    """One server's shard and its optimizers.

    Args:
        values: the shard's initial values (1-D).
        segments: ``[(optimizer, group, numel), ...]`` in shard order, one per parameter slice; ``optimizer``
            indexes ``optimizers``, ``group`` that optimizer's param groups; ``optimizer = -1`` marks elements
            no optimizer trains (frozen parameters), which never change. A pair ``(group, numel)`` means
            optimizer 0.
        optimizers: ``[(name, param_groups), ...]``, one per user optimizer: a name in
            :data:`ELEMENTWISE_OPTIMIZERS` and the hyperparameters of each param group (without ``params``).
            A single name, with ``param_groups`` given separately, is one optimizer.
        param_groups: with a single optimizer name only.
    """

    def __init__(self, values: Tensor, segments: Sequence[Sequence[int]], optimizers: str | Sequence,
                 param_groups: list[dict] | None = None):  # fmt: skip
        if isinstance(optimizers, str):
            optimizers = [(optimizers, param_groups if param_groups is not None else [{}])]
        optimizers = [(o["name"], o["param_groups"]) if isinstance(o, dict) else tuple(o) for o in optimizers]
        for name, _ in optimizers:
            if name not in ELEMENTWISE_OPTIMIZERS:
                raise ValueError(
                    f"ParameterShard(optimizer={name!r}): a parameter server rebuilds the optimizer per shard, "
                    f"which is exact only for element-wise optimizers: {', '.join(ELEMENTWISE_OPTIMIZERS)}"
                )
        self.segments = [tuple(int(v) for v in (s if len(s) == 3 else (0, *s))) for s in segments]
        if sum(n for *_, n in self.segments) != values.numel():
            raise ValueError(f"ParameterShard(segments=...): segments hold {sum(n for *_, n in self.segments)} elements, "
                             f"shard {values.numel()}")  # fmt: skip
        self.flat = values.detach().clone().reshape(-1)
        groups: list[list[dict]] = [[dict(hp, params=[]) for hp in hps] for _, hps in optimizers]
        self.pieces: list[list[tuple[int, int, nn.Parameter]]] = [[] for _ in optimizers]  # per optimizer: (start, stop, view)
        start = 0
        for k, group, numel in self.segments:
            if k >= len(groups) or (k >= 0 and not 0 <= group < len(groups[k])):
                raise ValueError(f"ParameterShard(segments=...): ({k}, {group}, {numel}) names an optimizer or param group "
                                 f"that does not exist ({len(groups)} optimizers)")  # fmt: skip
            if k >= 0 and numel:
                piece = nn.Parameter(self.flat[start : start + numel])  # shares storage with self.flat
                self.pieces[k].append((start, start + numel, piece))
                groups[k][group]["params"].append(piece)
            start += numel
        self.optimizers = [getattr(torch.optim, name)(gs) if pieces else None
                           for (name, _), gs, pieces in zip(optimizers, groups, self.pieces)]  # fmt: skip

    def _check_optimizer(self, optimizer: int) -> None:
        if not 0 <= optimizer < len(self.optimizers):
            raise ValueError(f"optimizer={optimizer}: must be in [0, {len(self.optimizers)})")

    def check_hparams(self, hparams: Any, optimizer: int = 0) -> None:
        """Refuse what :meth:`set_hparams` must not take; changes nothing.

        A push may change numeric hyperparameters only: ``hparams`` is ``None``, ``[]``, or one object per param
        group of ``optimizer`` whose values are finite numbers, or lists of finite numbers where the group holds
        a tuple of that length (``betas``). A key whose current value is a boolean, a string or ``None``
        (``nesterov``, ``foreach``) cannot be changed by a push.

        Raises:
            ValueError: naming the field, its value and the rule.
        """
        self._check_optimizer(optimizer)
        if hparams is None or hparams == []:
            return
        torch_optimizer = self.optimizers[optimizer]
        groups = torch_optimizer.param_groups if torch_optimizer is not None else None
        count = f"{len(groups)} " if groups is not None else ""
        if not isinstance(hparams, list) or (groups is not None and len(hparams) != len(groups)):
            raise ValueError(f"hparams={_show(hparams)}: hparams must be a list of {count}objects, one per param group "
                             f"of optimizer {optimizer}")  # fmt: skip
        for g, values in enumerate(hparams):
            if not isinstance(values, dict):
                raise ValueError(f"hparams[{g}]={_show(values)}: each entry must be an object of hyperparameters")
            for key, value in values.items():
                where = f"hparams[{g}][{key!r}]={_show(value)}"
                current = groups[g].get(key) if groups is not None else None
                if key == "params" or (groups is not None and key in groups[g] and not _is_number(current)
                                       and not isinstance(current, (tuple, list))):  # fmt: skip
                    raise ValueError(f"{where}: a push changes numeric hyperparameters only (param group {g} of "
                                     f"optimizer {optimizer} has {key}={_show(current)})")  # fmt: skip
                if isinstance(current, (tuple, list)):
                    ok = isinstance(value, list) and len(value) == len(current) and all(map(_is_finite, value))
                    rule = f"a list of {len(current)} finite numbers"
                elif isinstance(value, list) and current is None:
                    ok, rule = bool(value) and all(map(_is_finite, value)), "a finite number or a list of finite numbers"
                else:
                    ok, rule = _is_finite(value), "a finite number"
                if not ok:
                    raise ValueError(f"{where}: {key} must be {rule}")

    def set_hparams(self, hparams: list[dict] | None, optimizer: int = 0) -> None:
        """Take the workers' current hyperparameters of ``optimizer`` (a learning-rate scheduler changes them).

        Call :meth:`check_hparams` first: this one assumes them valid.
        """
        self._check_optimizer(optimizer)
        if not hparams or self.optimizers[optimizer] is None:
            return
        for group, values in zip(self.optimizers[optimizer].param_groups, hparams):
            for key, value in values.items():
                group[key] = tuple(value) if isinstance(value, list) else value

    def expand(self, compact: Tensor, optimizer: int = 0, present: Sequence[bool] | None = None) -> Tensor:
        """The shard-sized gradient of a compact push: ``optimizer``'s present pieces, zeros elsewhere."""
        self._check_optimizer(optimizer)
        pieces = self.pieces[optimizer]
        present = [True] * len(pieces) if present is None else present
        expected = sum(stop - start for (start, stop, _), p in zip(pieces, present) if p)
        if compact.numel() != expected:
            raise ValueError(f"gradient of {compact.numel()} elements; optimizer {optimizer}'s present pieces on this "
                             f"shard hold {expected}")  # fmt: skip
        full = torch.zeros_like(self.flat)
        offset = 0
        for (start, stop, _), p in zip(pieces, present):
            if p:
                full[start:stop] = compact[offset : offset + stop - start]
                offset += stop - start
        return full

    @torch.no_grad()
    def apply_(self, grad: Tensor, optimizer: int = 0, present: Sequence[bool] | None = None) -> None:
        """One step of ``optimizer`` with ``grad`` (shard-sized); pieces not ``present`` get ``grad = None``."""
        self._check_optimizer(optimizer)
        if self.optimizers[optimizer] is None:
            return
        pieces = self.pieces[optimizer]
        present = [True] * len(pieces) if present is None else present
        for (start, stop, piece), p in zip(pieces, present):
            piece.grad = grad[start:stop] if p else None
        self.optimizers[optimizer].step()
        for _, _, piece in pieces:
            piece.grad = None

    @torch.no_grad()
    def apply_range_(self, grad: Tensor, optimizer: int, present: Sequence[bool], a: int, b: int) -> None:
        """One step of ``optimizer`` on its pieces inside ``[a, b)`` only (``grad`` covers ``[a, b)``).

        A chunked sync step (:mod:`~lightning_pdist.parameter_server.chunks`) calls this once per chunk; every piece lies
        in one chunk, and a torch optimizer skips pieces whose ``grad`` is ``None``, so each piece steps once per step,
        on the same numbers as :meth:`apply_`.
        """
        self._check_optimizer(optimizer)
        if self.optimizers[optimizer] is None:
            return
        pieces = self.pieces[optimizer]
        stepped = False
        for (start, stop, piece), p in zip(pieces, present):
            inside = p and a <= start and stop <= b
            piece.grad = grad[start - a : stop - a] if inside else None
            stepped |= inside
        if stepped:  # a chunk holding none of this optimizer's present pieces steps nothing (not even a step count)
            self.optimizers[optimizer].step()
        for _, _, piece in pieces:
            piece.grad = None

    def state_dict(self) -> dict:
        return {
            "values": self.flat.clone(),
            "segments": [list(s) for s in self.segments],
            "optimizers": [o.state_dict() if o is not None else None for o in self.optimizers],
        }

    def load_state_dict(self, state: dict) -> None:
        segments = [tuple(s) for s in state["segments"]]
        if segments != self.segments:
            raise ValueError(
                "ParameterShard.load_state_dict: the checkpoint's shard layout differs from this run's; resume with "
                "the same model, optimizers, num_servers, sharding and partition_bytes"
            )
        values = state["values"]
        if not isinstance(values, Tensor) or values.shape != self.flat.shape or values.dtype != self.flat.dtype:
            raise ValueError(
                f"ParameterShard.load_state_dict: values of {_show(getattr(values, 'shape', values))} "
                f"{getattr(values, 'dtype', '')}; this shard holds {tuple(self.flat.shape)} {self.flat.dtype}"
            )
        self.flat.copy_(values)
        for optimizer, saved in zip(self.optimizers, state["optimizers"]):
            if optimizer is not None and saved is not None:
                optimizer.load_state_dict(saved)
