"""Parallax's split of a model into sparse and dense variables, and the row plan of the sparse ones (pure pieces).

Kim et al., *Parallax: Sparsity-aware Data Parallel Training of Deep Neural Networks*, EuroSys 2019. A variable
whose gradient touches few of its rows per step (an embedding table) lives on the parameter servers, its rows
partitioned across them; a worker pushes only the rows its batch touched (indices and values) and pulls only the
rows its next batch needs. Every other variable is dense and all-reduced among the workers. Per step and worker,
a sparse table of ``R`` rows of ``d`` elements with ``r`` rows touched costs ``r·(8 + d·b)`` bytes each way
(``b`` bytes per element, 8 per index) against ``R·d·b`` all-reduced: worth it while ``r/R`` is small.

* :func:`sparse_parameter_names`: the parameters that go to the servers (``nn.Embedding``/``nn.EmbeddingBag`` with
  ``sparse=True``, and any the user names).
* :func:`auto_sparse`: the ``auto`` rule: sparse when the fraction of rows touched per step is under a threshold.
* :class:`RowPlan`: the sparse tables' rows cut into contiguous, memory-balanced ranges, one per server.

The servers' row requests: :mod:`~lightning_pdist.parameter_server.parallax_rows`; the ``parallax`` strategy:
:mod:`~lightning_pdist.parameter_server.parallax_strategy`; card: ``docs/algorithms/parallax.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor, nn

__all__ = ["RowPlan", "auto_sparse", "sparse_parameter_names", "sparse_push_bytes"]


def sparse_parameter_names(module: nn.Module, names: Iterable[str] = (), owner: str = "parallax") -> list[str]:
    """The parameters Parallax keeps on the servers, in ``named_parameters`` order.

    ``nn.Embedding``/``nn.EmbeddingBag`` weights built with ``sparse=True`` (their gradients are row-sparse), and
    every parameter named in ``names`` (2-D, rows first). Raises ``ValueError`` for a name that is not a parameter,
    a named parameter that is not 2-D, or a module with no sparse parameter at all.
    """
    params = dict(module.named_parameters())
    chosen = {f"{prefix}.weight" if prefix else "weight" for prefix, m in module.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}  # fmt: skip
    for name in names:
        if name not in params:
            raise ValueError(f"{owner}(sparse_params=[{name!r}]): {name!r} is not a parameter of the module "
                             f"(it has {', '.join(list(params)[:8])}{', ...' if len(params) > 8 else ''})")  # fmt: skip
        if params[name].dim() != 2:
            raise ValueError(f"{owner}(sparse_params=[{name!r}]): {name!r} has shape {tuple(params[name].shape)}; a "
                             "sparse parameter is a table of rows (2-D)")  # fmt: skip
        chosen.add(name)
    if not chosen:
        raise ValueError(f"{owner}: the module has no sparse parameter: no nn.Embedding or nn.EmbeddingBag with "
                         "sparse=True, and sparse_params names none; build the embedding with sparse=True or name "
                         "the parameter, or use a dense strategy (ddp, parameter_server)")  # fmt: skip
    return [name for name in params if name in chosen]


def auto_sparse(touched_rows: float, num_rows: int, threshold: float = 0.1) -> bool:
    """The ``auto`` rule: a table is sparse when ``touched_rows / num_rows < threshold`` (rows touched per step)."""
    if num_rows < 1:
        raise ValueError(f"auto_sparse(num_rows={num_rows}): num_rows must be >= 1")
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"auto_sparse(threshold={threshold}): threshold must be in (0, 1]")
    return touched_rows / num_rows < threshold


def sparse_push_bytes(rows: int, row_numel: int, itemsize: int = 4) -> int:
    """Bytes of ``rows`` rows sent as int64 indices and their values: ``rows·(8 + row_numel·itemsize)``."""
    return rows * (8 + row_numel * itemsize)


@dataclass(frozen=True)
class RowPlan:
    """The rows of the sparse tables cut into ``num_servers`` contiguous ranges of about equal bytes.

    The tables are laid end to end in the order given (a row is never split); server ``s`` takes the rows whose
    first byte falls in ``[s·B/S, (s+1)·B/S)`` of the ``B`` bytes in all, so no server holds more than ``B/S`` plus
    one row. Args: ``tables``: ``(name, rows, row_numel)``; ``num_servers``; ``itemsize`` (bytes per element).
    """

    tables: tuple[tuple[str, int, int], ...]
    num_servers: int
    itemsize: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.num_servers, bool) or not isinstance(self.num_servers, int) or self.num_servers < 1:
            raise ValueError(f"RowPlan(num_servers={self.num_servers!r}): num_servers must be an int >= 1")
        for name, rows, row_numel in self.tables:
            if rows < 1 or row_numel < 1:
                raise ValueError(f"RowPlan(tables=...): {name!r} has {rows} rows of {row_numel}; both must be >= 1")

    @cached_property
    def _starts(self) -> dict[str, Tensor]:
        """Per table: the first row of each server's range (``num_servers + 1`` boundaries, the last = rows)."""
        total = sum(rows * numel for _, rows, numel in self.tables) * self.itemsize
        out, offset = {}, 0
        for name, rows, numel in self.tables:
            row_bytes = numel * self.itemsize
            first = offset + row_bytes * torch.arange(rows + 1, dtype=torch.float64)
            cuts = torch.tensor([s * total / self.num_servers for s in range(self.num_servers + 1)], dtype=torch.float64)
            out[name] = torch.searchsorted(first[:-1].contiguous(), cuts, right=False).clamp_(max=rows)
            out[name][-1] = rows
            offset += rows * row_bytes
        return out

    def server_of(self, name: str, rows: Tensor) -> Tensor:
        """The server holding each of ``rows`` (int64 row indices) of table ``name``."""
        return torch.searchsorted(self._starts[name][1:-1].contiguous(), rows, right=True)

    def split(self, name: str, rows: Tensor) -> list[Tensor]:
        """``rows`` of ``name``, unique and sorted, grouped by the server that holds them (one tensor per server)."""
        rows = torch.unique(rows.reshape(-1))
        owners = self.server_of(name, rows)
        return [rows[owners == s] for s in range(self.num_servers)]

    def rows_of(self, server: int) -> dict[str, tuple[int, int]]:
        """``name -> (first row, stop row)`` that ``server`` holds (empty ranges left out)."""
        out = {}
        for name, starts in self._starts.items():
            lo, hi = int(starts[server]), int(starts[server + 1])
            if hi > lo:
                out[name] = (lo, hi)
        return out

    def bytes_per_server(self) -> tuple[int, ...]:
        numel = {name: numel for name, _, numel in self.tables}
        return tuple(sum((hi - lo) * numel[name] * self.itemsize for name, (lo, hi) in self.rows_of(s).items())
                     for s in range(self.num_servers))  # fmt: skip

    @classmethod
    def for_parameters(cls, params: Sequence[tuple[str, Tensor]], num_servers: int) -> "RowPlan":
        """The plan of 2-D parameters ``(name, tensor)``: rows = ``shape[0]``."""
        itemsizes = {p.element_size() for _, p in params}
        if len(itemsizes) > 1:
            raise ValueError(f"RowPlan.for_parameters: the sparse parameters have element sizes {sorted(itemsizes)}; one is needed")
        return cls(tuple((n, p.shape[0], p[0].numel()) for n, p in params), num_servers, itemsizes.pop() if itemsizes else 4)
