"""Parallax's row-sparse requests on a parameter server (``PUSH_ROWS``, ``PULL_ROWS``), both ends.

Kim et al., EuroSys 2019 (:mod:`~lightning_pdist.parameter_server.parallax`): a server of ``mode="parallax"`` holds
contiguous row ranges of the sparse tables (a :class:`RowShard`, rows laid end to end in one flat buffer, one
``Parameter`` per table range) and steps the module's optimizer on them with *sparse* gradients, as torch steps a
parameter whose gradient is sparse in one process: only the rows some worker touched move. The step is synchronous
(the server's :class:`~lightning_pdist.parameter_server.rules.BackupWorkerAggregator` with no backups): the mean of
the ``N`` workers' row gradients of step ``t``, applied once when the last one arrives::

    g_t[r] = (1 / N) · Σ_m g_{m,t}[r]        (g_{m,t}[r] = 0 for a row r worker m did not touch)

Requests (``[t, count]`` names table ``t`` of the job and how many of its rows follow; rows are global row indices,
sorted and unique, inside the server's range of that table)::

    PUSH_ROWS  {"worker", "version", "tables": [[t, count], ...], "hparams"}   payload: int64 rows | values
    PULL_ROWS  {"worker", "wait_version", "tables": [[t, count], ...]}        payload: int64 rows
               reply payload: the rows' values, in request order, once step ``wait_version`` closed

Both are bounded before anything is allocated: a push carries at most every row of the server's ranges once
(``rows·(8 + d·b)`` bytes), a pull request ``rows·8``; both refuse (naming the field, value and rule) a table that
is not here, a count larger than the range, rows out of range, unsorted or repeated, and a payload of the wrong
size, before any state changes. A pull waiting for a step that other workers hold back is answered after its
``patience``, naming them (the server's stalled-worker reply). Never imports Lightning.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_pdist.parameter_server.shard import ParameterShard
from lightning_pdist.core.ps_wire import Kind, bytes_to_tensor, tensor_bytes

__all__ = ["ROW_KINDS", "SPARSE_OPTIMIZERS", "RowShard", "handle_rows", "pack_rows", "row_payload_limit"]

ROW_KINDS = (Kind.PUSH_ROWS, Kind.PULL_ROWS)
#: torch.optim classes that step a parameter with a sparse gradient (with ``weight_decay=0``).
SPARSE_OPTIMIZERS = ("SGD", "Adagrad")
INDEX_BYTES = 8


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class RowShard(ParameterShard):
    """One server's row ranges of the sparse tables: ``tables[i] = (t, lo, hi, d)`` holds rows ``[lo, hi)`` of
    job table ``t`` (``d`` elements per row), segment ``i`` of the flat buffer (``segments[i] = (0, group, (hi-lo)·d)``).

    The optimizer (one; :data:`SPARSE_OPTIMIZERS`, ``weight_decay = 0``) is rebuilt as :class:`ParameterShard`
    rebuilds it; :meth:`apply_rows_` steps it with the sparse mean gradient.
    """

    def __init__(self, values: Tensor, segments: Sequence[Sequence[int]], optimizers: Sequence, tables: Any):
        if not (isinstance(tables, list) and len(tables) == len(segments)
                and all(isinstance(x, list) and len(x) == 4 and all(map(_is_int, x)) for x in tables)):  # fmt: skip
            raise ValueError(f"tables={repr(tables)[:80]}: must be one [t, lo, hi, d] of ints per segment")
        optimizers = [(o["name"], o["param_groups"]) if isinstance(o, dict) else tuple(o) for o in optimizers]
        if len(optimizers) != 1:
            raise ValueError(f"{len(optimizers)} optimizers: mode='parallax' steps the sparse tables with one")
        name, groups = optimizers[0]
        if name not in SPARSE_OPTIMIZERS:
            raise ValueError(f"optimizer={name!r}: the sparse tables need one that steps sparse gradients: "
                             f"{', '.join(SPARSE_OPTIMIZERS)}")  # fmt: skip
        if any(g.get("weight_decay", 0) not in (0, 0.0) for g in groups):
            raise ValueError("weight_decay must be 0 for the sparse tables (torch steps no sparse gradient with it)")
        seen = set()
        for (t, lo, hi, d), segment in zip(tables, segments):
            if t < 0 or t in seen or not 0 <= lo < hi or d < 1 or segment[-1] != (hi - lo) * d:
                raise ValueError(f"tables entry {[t, lo, hi, d]}: t >= 0 once, 0 <= lo < hi, d >= 1, and its segment "
                                 f"of {segment[-1]} elements must hold (hi - lo)·d")  # fmt: skip
            seen.add(t)
        super().__init__(values, segments, optimizers)
        self.tables = {t: (i, lo, hi, d) for i, (t, lo, hi, d) in enumerate(tables)}
        self._start = {t: self.pieces[0][i][0] for t, (i, *_) in self.tables.items()}

    def max_rows_bytes(self, with_values: bool) -> int:
        """The largest request payload: every row here once, with (push) or without (pull) its values."""
        itemsize = self.flat.element_size() if with_values else 0
        return sum((hi - lo) * (INDEX_BYTES + d * itemsize) for _, lo, hi, d in self.tables.values())

    def parse(self, kind: str, meta: dict, payload: bytearray, with_values: bool) -> list[tuple[int, Tensor, Tensor | None]]:
        """``[(t, rows, values or None), ...]`` of a request; ``ValueError`` naming the field, value and rule."""
        entries = meta.get("tables")
        if not isinstance(entries, list) or len(entries) > len(self.tables) or not all(
                isinstance(e, list) and len(e) == 2 and all(map(_is_int, e)) for e in entries):  # fmt: skip
            raise ValueError(f"{kind}: tables={repr(entries)[:80]}: tables must be a list of at most {len(self.tables)} "
                             f"[table, count] pairs of ints")  # fmt: skip
        counts, seen = [], set()
        for t, count in entries:
            if t not in self.tables or t in seen:
                raise ValueError(f"{kind}: table {t}: must be one of this server's tables {sorted(self.tables)}, once")
            _, lo, hi, _ = self.tables[t]
            if not 0 <= count <= hi - lo:
                raise ValueError(f"{kind}: table {t} count={count}: count must be in [0, {hi - lo}] (rows held here)")
            seen.add(t)
            counts.append(count)
        itemsize = self.flat.element_size()
        n_index = sum(counts) * INDEX_BYTES
        n_values = sum(c * self.tables[t][3] for (t, _), c in zip(entries, counts)) * itemsize if with_values else 0
        if len(payload) != n_index + n_values:
            raise ValueError(f"{kind}: payload of {len(payload)} bytes; {sum(counts)} rows need {n_index + n_values} "
                             f"({INDEX_BYTES}-byte indices{' and their values' if with_values else ''})")  # fmt: skip
        view = memoryview(payload)
        indices = bytes_to_tensor(view[:n_index], "torch.int64") if n_index else torch.zeros(0, dtype=torch.int64)
        values = bytes_to_tensor(view[n_index:], str(self.flat.dtype)) if n_values else torch.zeros(0, dtype=self.flat.dtype)
        out, i, v = [], 0, 0
        for (t, _), count in zip(entries, counts):
            _, lo, hi, d = self.tables[t]
            rows = indices[i : i + count]
            if count and (int(rows[0]) < lo or int(rows[-1]) >= hi or (count > 1 and not bool((rows[1:] > rows[:-1]).all()))):
                raise ValueError(f"{kind}: table {t}: rows must be sorted, unique and in [{lo}, {hi}) (this server's range)")
            vals = values[v : v + count * d].view(count, d) if with_values else None
            out.append((t, rows, vals))
            i, v = i + count, v + (count * d if with_values else 0)
        return out

    def sparse_grad(self, entries: list[tuple[int, Tensor, Tensor | None]]) -> Tensor:
        """The push as a 1-D sparse gradient of the flat buffer (element indices; zeros elsewhere)."""
        idx, vals = [], []
        for t, rows, values in entries:
            _, lo, _, d = self.tables[t]
            idx.append((self._start[t] + (rows - lo) * d).unsqueeze(1) + torch.arange(d))
            vals.append(values)
        index = torch.cat([i.reshape(-1) for i in idx]) if idx else torch.zeros(0, dtype=torch.int64)
        value = torch.cat([v.reshape(-1) for v in vals]) if vals else torch.zeros(0, dtype=self.flat.dtype)
        return torch.sparse_coo_tensor(index.unsqueeze(0), value.to(self.flat.dtype), (self.flat.numel(),))

    @torch.no_grad()
    def apply_rows_(self, grad: Tensor) -> None:
        """One optimizer step with the sparse ``grad`` of the flat buffer: each range gets its rows' part."""
        if self.optimizers[0] is None:  # no rows here (a plan can leave a server without any)
            return
        grad = grad.coalesce()
        index, value = grad.indices()[0], grad.values()
        for start, stop, piece in self.pieces[0]:
            lo, hi = torch.searchsorted(index, torch.tensor([start, stop])).tolist()
            piece.grad = (torch.sparse_coo_tensor((index[lo:hi] - start).unsqueeze(0), value[lo:hi], (stop - start,))
                          if hi > lo else None)  # fmt: skip
        self.optimizers[0].step()
        for _, _, piece in self.pieces[0]:
            piece.grad = None

    def gather(self, entries: list[tuple[int, Tensor, Tensor | None]]) -> Tensor:
        """The values of the requested rows, in request order (one flat tensor)."""
        parts = []
        for t, rows, _ in entries:
            _, lo, hi, d = self.tables[t]
            start = self._start[t]
            parts.append(self.flat[start : start + (hi - lo) * d].view(hi - lo, d)[rows - lo].reshape(-1))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=self.flat.dtype)


def row_payload_limit(shard: Any, kind: Kind) -> int:
    """The most payload a ``PUSH_ROWS``/``PULL_ROWS`` may declare: 0 unless the server holds row ranges."""
    if not isinstance(shard, RowShard):
        return 0
    return shard.max_rows_bytes(with_values=kind == Kind.PUSH_ROWS)


def handle_rows(server: Any, conn: Any, kind: Kind, meta: dict, payload: bytearray) -> None:
    """Serve one ``PUSH_ROWS``/``PULL_ROWS`` on ``server`` (a :class:`~.server.ShardServer` of ``mode="parallax"``)."""
    from lightning_pdist.parameter_server.server import MAX_PATIENCE, RequestRefused, _field, _is_finite_number, _Pending

    shard = server.shard
    if not isinstance(shard, RowShard):
        raise RequestRefused(f"{kind.name}: this server runs mode={server.config.get('mode')!r}; row requests need "
                             "mode='parallax'")  # fmt: skip
    worker = server._worker_of(conn, kind, meta)
    if server.failed:
        raise RuntimeError(server.failed)
    name = kind.name
    try:
        entries = shard.parse(name, meta, payload, with_values=kind == Kind.PUSH_ROWS)
    except ValueError as err:
        raise RequestRefused(str(err)) from None
    server.last_heard[worker] = time.monotonic()
    if kind == Kind.PUSH_ROWS:
        version = _field(meta, "version", name, "an int >= 0", lambda v: _is_int(v) and v >= 0)
        hparams = meta.get("hparams")
        try:
            shard.check_hparams(hparams, 0)
        except ValueError as err:
            raise RequestRefused(f"{name}: {err}") from None
        aggregator = server.aggregator
        if version == aggregator.step and worker in aggregator.arrived:
            raise RequestRefused(f"{name}: version={version}: worker {worker} already pushed step {version}; a worker "
                                 "pushes once per step")  # fmt: skip
        dropped = aggregator.num_dropped
        mean = aggregator.push(worker, version, shard.sparse_grad(entries))
        aggregator.drain_dropped()
        shard.set_hparams(hparams, 0)
        if mean is not None:
            try:
                shard.apply_rows_(mean)
            except Exception as err:
                server.failed = (f"parameter server {server.index}: applying step {version} failed "
                                 f"({type(err).__name__}: {err}); mode='parallax' cannot continue")  # fmt: skip
                raise
            server.version += 1
            server.closed_bytes = (server.loop.bytes_in, server.loop.bytes_out)
        server._reply(conn, Kind.REPLY, {"accepted": aggregator.num_dropped == dropped, "version": server.version,
                                         **server._stats()})  # fmt: skip
        return
    wait = _field(meta, "wait_version", name, "null or an int >= 0", lambda v: v is None or (_is_int(v) and v >= 0), None)
    patience = _field(meta, "patience", name, f"null or a number of seconds in (0, {MAX_PATIENCE:g}]",
                      lambda v: v is None or (_is_finite_number(v) and 0 < v <= MAX_PATIENCE), None)  # fmt: skip
    conn.pending = True
    answer = lambda: ({}, tensor_bytes(shard.gather(entries)))  # noqa: E731  (the rows as they are when answered)
    server.pending.append(_Pending(conn, worker, wait, False, {}, time.monotonic(), patience, answer))


def pack_rows(entries: Sequence[tuple[int, Tensor, Tensor | None]]) -> tuple[list[list[int]], bytes]:
    """A request's ``tables`` and payload from ``[(t, rows (int64, sorted, unique), values (rows × d) or None)]``."""
    tables = [[int(t), int(rows.numel())] for t, rows, _ in entries]
    parts = [tensor_bytes(rows.to(torch.int64)) for _, rows, _ in entries]
    parts += [tensor_bytes(values.detach().contiguous()) for _, _, values in entries if values is not None]
    return tables, b"".join(bytes(p) for p in parts)
