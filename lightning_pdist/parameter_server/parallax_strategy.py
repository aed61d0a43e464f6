"""Parallax (Kim et al., EuroSys 2019) as a Lightning strategy: sparse tables on the parameter servers, dense
parameters all-reduced among the workers, in the same step.

Which parameters are sparse and how their rows are cut across the servers: :mod:`~.parallax` (``nn.Embedding``/
``nn.EmbeddingBag`` with ``sparse=True`` and any 2-D parameter named in ``sparse_params``; contiguous,
memory-balanced row ranges). The servers' row requests: :mod:`~.parallax_rows`. One training step of worker ``m``::

    forward    each sparse embedding's input rows are pulled first (PULL_ROWS, answered once step t closed):
               only the rows this batch needs, from the servers that hold them; a named parameter that is not an
               embedding's weight is pulled whole
    backward   sparse gradients of the tables (their touched rows), dense gradients of the rest
    step       PUSH_ROWS: every server gets this worker's touched rows of its ranges (indices + values), and, at the
               same time, the dense gradients are all-reduced (mean, gloo, the workers' private group); the module's
               optimizer then steps the dense parameters on every worker, and each server steps its rows with the
               mean of the N workers' row gradients once all N arrived (rows no worker touched do not move)

With ``SGD`` this is full-batch SGD over the ``N`` workers' batches. Per step a worker sends
``r·(8 + d·b)`` bytes of a table whose batch touched ``r`` rows of ``d`` elements of ``b`` bytes each way (logged:
``pdist/parallax/push_bytes``, ``pdist/parallax/pull_bytes``, ``pdist/parallax/rows``). Card: the "Parallax"
section of ``docs/algorithms/parameter_server.md``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pdist.core.accounting import all_reduce_bytes
from lightning_pdist.core.strategy import PdistStrategy
from lightning_pdist.core.ps_client import ParameterServerClient
from lightning_pdist.core.ps_client import group_hparams
from lightning_pdist.parameter_server.layout import numeric_hparams
from lightning_pdist.parameter_server.parallax import RowPlan, sparse_parameter_names
from lightning_pdist.parameter_server.parallax_rows import SPARSE_OPTIMIZERS, pack_rows
from lightning_pdist.parameter_server.strategy import ParameterServerStrategy
from lightning_pdist.core.ps_wire import Kind, bytes_to_tensor, dumps_state, loads_state

__all__ = ["ParallaxStrategy"]


class ParallaxStrategy(ParameterServerStrategy):
    """Parallax: sparse tables on parameter servers (rows pushed and pulled as touched), dense parameters all-reduced.

    Args:
        sparse_params: names of 2-D parameters (rows first) to keep on the servers besides every
            ``nn.Embedding``/``nn.EmbeddingBag`` built with ``sparse=True``; ``None``: those alone. A module with no
            sparse parameter is refused when fit starts (before any server), naming the rule.
        num_servers: as :class:`~lightning_pdist.parameter_server.strategy.ParameterServerStrategy`, like the
            server arguments that follow (servers, authentication, bounded frames, stalled workers named after
            ``server_timeout``).
        **kwargs: ``DDPStrategy`` arguments (``start_method``, ``timeout``...); nothing is wrapped in DDP.

    The module's one optimizer must step sparse gradients: ``torch.optim.SGD`` or ``Adagrad`` with
    ``weight_decay=0`` for the sparse tables' param groups (the servers step the tables with it, as torch does in one
    process); the dense parameters step with it on every worker. No gradient scaler (``precision='16-mixed'``).
    """

    strategy_name = "parallax"
    progress_bar_keys = {"pdist/ps/wait_s": ("wait", "s")}

    def __init__(
        self,
        sparse_params: list[str] | None = None,
        num_servers: int | None = None,
        server_host: str | None = None,
        server_port: int | None = None,
        server_addresses: list[str] | None = None,
        server_secret_file: str | None = None,
        allowed_networks: str | None = None,
        server_timeout: float = 300.0,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        if sparse_params is not None and (isinstance(sparse_params, str) or not isinstance(sparse_params, (list, tuple))
                                          or not all(isinstance(n, str) and n for n in sparse_params)):  # fmt: skip
            raise TypeError(f"{owner}(sparse_params={sparse_params!r}): sparse_params must be a list of parameter "
                            "names (e.g. ['embed.weight']) or None")  # fmt: skip
        if sparse_params is not None and len(set(sparse_params)) != len(sparse_params):
            raise ValueError(f"{owner}(sparse_params={list(sparse_params)!r}): each name must appear once")
        super().__init__(num_servers=num_servers, server_host=server_host, server_port=server_port,
                         server_addresses=server_addresses, server_secret_file=server_secret_file,
                         allowed_networks=allowed_networks, server_timeout=server_timeout, **kwargs)  # fmt: skip
        self.sparse_params = tuple(sparse_params) if sparse_params is not None else None
        self.row_plan: RowPlan | None = None
        self.tables: list[tuple[str, nn.Parameter]] = []  # the sparse tables, job table t = position here
        self.version = 0  # the servers' closed steps (every server the same: the steps are synchronous)
        self._hooks: list[Any] = []
        self._hooked: set[int] = set()  # tables pulled by their embedding's forward; the others whole, per step
        self._touched: dict[int, list[Tensor]] = {}  # this step's rows, per table, seen by the forward hooks
        self._pulled_bytes = 0
        self._pulling = False
        self._pool: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ plan
    def _sparse_names(self) -> list[str]:
        owner = type(self).__name__
        try:
            return sparse_parameter_names(self.lightning_module, self.sparse_params or (), owner=owner)
        except ValueError as err:
            if self.sparse_params:
                raise
            given = list(self.sparse_params) if self.sparse_params is not None else None
            raise ValueError(f"{owner}(sparse_params={given!r}): {str(err).split(': ', 1)[1]}") from None

    @override
    def _plan(self, num_servers: int) -> RowPlan:
        params = dict(self.lightning_module.named_parameters())
        tables = [(n, params[n]) for n in self._sparse_names()]
        rows = sum(p.shape[0] for _, p in tables)
        if num_servers > rows:
            raise ValueError(f"{type(self).__name__}(num_servers={num_servers}): the sparse tables have {rows} rows in "
                             "all; num_servers must not exceed them (every server holds at least one row)")  # fmt: skip
        return RowPlan.for_parameters(tables, num_servers)

    # ------------------------------------------------------------------ setup
    @override
    def setup_algorithm(self) -> None:
        owner = type(self).__name__
        if len(self.optimizers) != 1:
            raise ValueError(f"{owner}: configure_optimizers returned {len(self.optimizers)} optimizers; Parallax steps "
                             "the sparse tables on the servers with the module's one optimizer")  # fmt: skip
        optimizer = self.optimizers[0]
        name = type(optimizer).__name__
        if name not in SPARSE_OPTIMIZERS or type(optimizer) is not getattr(torch.optim, name):
            raise ValueError(f"{owner}: configure_optimizers returned {type(optimizer).__module__}."
                             f"{type(optimizer).__qualname__}; the sparse tables need an optimizer that steps sparse "
                             f"gradients: torch.optim.{', torch.optim.'.join(SPARSE_OPTIMIZERS)}")  # fmt: skip
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(f"{owner}: the precision plugin {type(self.precision_plugin).__name__} has a gradient "
                             "scaler; Parallax takes none (use precision='32-true' or 'bf16-mixed')")  # fmt: skip
        module = self.lightning_module
        named = dict(module.named_parameters())
        self.tables = [(n, named[n]) for n in self._sparse_names()]
        group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        for n, p in self.tables:
            if id(p) not in group_of:
                raise ValueError(f"{owner}: the sparse parameter {n!r} is not in the optimizer; the servers train "
                                 "only what the optimizer trains")  # fmt: skip
            wd = optimizer.param_groups[group_of[id(p)]].get("weight_decay", 0)
            if wd:
                raise ValueError(f"{owner}: weight_decay={wd} in the param group of the sparse parameter {n!r}; it must "
                                 "be 0 (torch steps no sparse gradient with weight decay)")  # fmt: skip
        if len({p.dtype for p in module.parameters()}) != 1:
            raise ValueError(f"{owner}: the model's parameters have several dtypes; Parallax needs one")
        sparse_ids = {id(p) for _, p in self.tables}
        self._dense = [p for p in module.parameters() if id(p) not in sparse_ids and p.requires_grad]
        rank, world = self.global_rank, self.world_size
        if world == 1:
            rank_zero_warn(f"{owner}: world_size == 1: one worker and its servers.")
        self.row_plan = self._plan(len(self.server_addresses) or self.config.servers_for(world))
        self.client = ParameterServerClient(self.server_addresses, rank, timeout=self.config.server_timeout,
                                            secret=self._secret)  # fmt: skip
        if rank == 0:
            self.client.map(Kind.INIT, *self._row_init(group_of))
            if self._loaded_pdist_state is not None:
                self._restore_rows(self._loaded_pdist_state)
        if self._loaded_pdist_state is not None:
            PdistStrategy.load_pdist_state_dict(self, self._loaded_pdist_state)
            self.step = int(self._loaded_pdist_state.get("step", 0))
        self.optimizer_steps = [self.step]
        self.barrier()
        metas = self.client.hello()
        self.version = int(metas[0]["version"])
        self._broadcast_dense()
        self._pull_tables()
        self._server_seen, self._server_now, self._exchanged = [], [], False
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdist-parallax-push")
        self._install_hooks()
        self._touched, self._pulled_bytes, self._pulling = {}, 0, False
        self._finalized = False

    def _restore_rows(self, state: dict) -> None:
        servers, owner = state.get("servers"), type(self).__name__
        if servers is None:
            rank_zero_warn(f"{owner}: the checkpoint holds no server state; the tables start from its weights with a "
                           "fresh optimizer state.")  # fmt: skip
            return
        plan = [list(t) for t in self.row_plan.tables]
        if len(servers) != self.row_plan.num_servers or state.get("row_plan", plan) != plan:
            raise ValueError(f"{owner}(num_servers={self.row_plan.num_servers}): the checkpoint holds {len(servers)} "
                             f"servers' rows of tables {state.get('row_plan')}; resume with the same num_servers and "
                             "sparse tables")  # fmt: skip
        self.client.map(Kind.SET_STATE, [{}] * len(servers), [dumps_state(s) for s in servers])

    def _row_init(self, group_of: dict[int, int]) -> tuple[list[dict], list[Tensor]]:
        optimizer = self.optimizers[0]
        hparams = [group_hparams(g, f"{type(self).__name__}: param group {i}") for i, g in enumerate(optimizer.param_groups)]
        dtype = str(self.tables[0][1].dtype)
        metas, payloads = [], []
        for server in range(self.row_plan.num_servers):
            ranges = self.row_plan.rows_of(server)
            tables, segments, values = [], [], []
            for t, (n, p) in enumerate(self.tables):
                if n in ranges:
                    lo, hi = ranges[n]
                    tables.append([t, lo, hi, p[0].numel()])
                    segments.append([0, group_of[id(p)], (hi - lo) * p[0].numel()])
                    values.append(p.detach()[lo:hi].reshape(-1))
            metas.append({"mode": "parallax", "num_workers": self.world_size, "dtype": dtype, "segments": segments,
                          "tables": tables, "optimizers": [{"name": type(optimizer).__name__, "param_groups": hparams}]})
            payloads.append(torch.cat(values) if values else torch.zeros(0, dtype=self.tables[0][1].dtype))
        return metas, payloads

    def _broadcast_dense(self) -> None:
        """Every worker starts from rank 0's dense parameters (the tables come from the servers)."""
        if self.workers is None or self.world_size == 1 or not self._dense:
            return
        flat = torch.cat([p.detach().reshape(-1) for p in self._dense])
        flat = self.workers.broadcast_object(flat, 0)
        self._unflatten(self._dense, flat)

    @staticmethod
    @torch.no_grad()
    def _unflatten(params: list[Tensor], flat: Tensor, grads: bool = False) -> None:
        offset = 0
        for p in params:
            target = p.grad if grads else p
            target.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def _install_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks, self._hooked = [], set()
        by_weight = {id(m.weight): m for m in self.lightning_module.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
        for t, (_, p) in enumerate(self.tables):
            if id(p) in by_weight:
                self._hooks.append(by_weight[id(p)].register_forward_pre_hook(self._make_hook(t)))
                self._hooked.add(t)

    def _make_hook(self, t: int) -> Callable:
        def pull_rows_first(module: nn.Module, args: tuple) -> None:
            if self._pulling and args and isinstance(args[0], Tensor):
                rows = torch.unique(args[0].detach().reshape(-1).to(torch.int64))
                self._touched.setdefault(t, []).append(rows)
                self._pull_rows({t: rows})

        return pull_rows_first

    # ------------------------------------------------------------------ rows
    def _split(self, rows: dict[int, Tensor], grads: dict[int, Tensor] | None = None) -> list[list[tuple]]:
        """Per server: ``[(t, rows, values or None), ...]`` of the rows it holds."""
        out: list[list[tuple]] = [[] for _ in range(self.row_plan.num_servers)]
        for t, r in rows.items():
            owners = self.row_plan.server_of(self.tables[t][0], r)
            for s in range(self.row_plan.num_servers):
                mask = owners == s
                if bool(mask.any()):
                    out[s].append((t, r[mask], grads[t][mask] if grads is not None else None))
        return out

    def _pull_rows(self, rows: dict[int, Tensor], count: bool = True) -> None:
        """Fetch ``rows`` (sorted, unique per table) from the servers once step ``version`` closed; write them in."""
        per_server = self._split(rows)
        metas, payloads = [], []
        for entries in per_server:
            tables, payload = pack_rows(entries)
            metas.append({"worker": self.global_rank, "wait_version": self.version, "tables": tables})
            payloads.append(payload)
        replies = self.client.map(Kind.PULL_ROWS, metas, payloads)
        self._diagnostics.note("pdist/ps/wait_s", self.client.last_wait_s)
        with torch.no_grad():
            for entries, (meta, payload) in zip(per_server, replies):
                values = bytes_to_tensor(payload, meta["dtype"])
                if count:  # a training step's pulls (the logged pdist/parallax/pull_bytes)
                    self._pulled_bytes += len(payload) + 8 * sum(r.numel() for _, r, _ in entries)
                offset = 0
                for t, r, _ in entries:
                    p = self.tables[t][1]
                    d = p[0].numel()
                    p[r] = values[offset : offset + r.numel() * d].view(-1, *p.shape[1:]).to(p.dtype)
                    offset += r.numel() * d

    def _pull_tables(self) -> None:
        """Every row of every table (start, validation, checkpoints, end of fit), once step ``version`` closed."""
        self._pull_rows({t: torch.arange(p.shape[0]) for t, (_, p) in enumerate(self.tables)}, count=False)

    def _touched_rows(self, t: int) -> tuple[Tensor, Tensor]:
        """``(rows, row gradients)`` of table ``t`` this step: a sparse gradient's rows; else the forward's rows (or,
        without an embedding hook, the rows whose gradient is not zero)."""
        p = self.tables[t][1]
        grad = p.grad
        d_shape = p.shape[1:]
        if grad is None:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, *d_shape, dtype=p.dtype)
        if grad.is_sparse:
            grad = grad.coalesce()
            return grad.indices()[0], grad.values()
        if t in self._touched:
            rows = torch.unique(torch.cat(self._touched[t]))
        else:
            rows = torch.nonzero(grad.reshape(grad.shape[0], -1).ne(0).any(dim=1)).reshape(-1)
        return rows, grad[rows]

    # ------------------------------------------------------------------ training step
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        PdistStrategy.on_train_batch_start(self, batch, batch_idx)
        if self.client is None:
            return
        self._pulling = True  # (the touched rows and pulled bytes of a step gather over its accumulated batches)
        whole = {t: torch.arange(p.shape[0]) for t, (_, p) in enumerate(self.tables) if t not in self._hooked}
        if whole:  # a named parameter that is not an embedding's weight: its rows are not known before the backward
            self._pull_rows(whole)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self.client is None:
            raise RuntimeError(f"{type(self).__name__}.optimizer_step: the servers are not set up (call within Trainer.fit)")
        model = model if model is not None else self.lightning_module
        closure_result = self.precision_plugin._wrap_closure(model, optimizer, closure)  # forward (pulls), backward
        self._pulling = False
        rows, grads = {}, {}
        for t in range(len(self.tables)):
            rows[t], grads[t] = self._touched_rows(t)
        metas, payloads, pushed = [], [], 0
        hparams = [numeric_hparams(g) for g in optimizer.param_groups]
        for entries in self._split(rows, grads):
            tables, payload = pack_rows(entries)
            metas.append({"worker": self.global_rank, "version": self.version, "tables": tables, "hparams": hparams})
            payloads.append(payload)
            pushed += len(payload)
        sent_before = sum(c.bytes_sent for c in self.client.connections)
        pushing = self._pool.submit(self.client.map, Kind.PUSH_ROWS, metas, payloads)
        try:
            self._all_reduce_dense()  # at the same time as the push
        finally:
            replies = pushing.result()
        for _, p in self.tables:
            p.grad = None  # the servers step the tables; the worker's optimizer only the dense parameters
        optimizer.step()
        self._average_buffers(meeting=False)  # BatchNorm statistics: the workers' mean, every step (counted)
        self.version += 1
        self.step += 1
        self.optimizer_steps = [self.step]
        self.comm_meter.add("parallax_rows", sum(c.bytes_sent for c in self.client.connections) - sent_before)
        self._diagnostics.note("pdist/parallax/push_bytes", float(pushed))
        self._diagnostics.note("pdist/parallax/pull_bytes", float(self._pulled_bytes))
        self._diagnostics.note("pdist/parallax/rows", float(sum(r.numel() for r in rows.values())))
        self._diagnostics.note("pdist/ps/wait_s", self.client.last_wait_s)
        self._touched, self._pulled_bytes = {}, 0
        if not all(m.get("accepted", True) for m, _ in replies):
            raise RuntimeError(f"{type(self).__name__}: a server dropped worker {self.global_rank}'s rows of step "
                               f"{self.version - 1} (its step had moved on); the workers are out of step")  # fmt: skip
        self._log_comm_bytes()
        return closure_result

    def _all_reduce_dense(self) -> None:
        """``g ← (1/N) Σ_m g_m`` for every dense gradient (DDP's rule), over the workers' gloo group."""
        with_grad = [p for p in self._dense if p.grad is not None]
        if self.world_size == 1 or not with_grad:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in with_grad])
        self.workers.all_reduce_(flat, "sum").div_(self.world_size)
        self._unflatten(with_grad, flat, grads=True)
        self.comm_meter.add("parallax_dense", all_reduce_bytes(flat.numel() * flat.element_size(), self.world_size))

    @override
    def diagnostics(self) -> dict[str, float]:
        return PdistStrategy.diagnostics(self)

    # ------------------------------------------------------------------ evaluation, checkpoints, end of fit
    @override
    def on_validation_start(self) -> None:
        PdistStrategy.on_validation_start(self)
        self._pulling = False
        if self._fitting():
            self._pull_tables()  # every worker validates the servers' tables

    @override
    def on_validation_end(self) -> None:
        PdistStrategy.on_validation_end(self)

    @override
    def on_train_end(self) -> None:
        PdistStrategy.on_train_end(self)
        if not self._fitting():
            return
        self._pulling = False
        self.client.bye()
        self.barrier()
        self._pull_tables()
        self.barrier()  # every worker has pulled: each node's starter may shut its servers down
        self._finalized = True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._fitting():
            self._pull_tables()  # Lightning saves on every rank: every worker pulls the tables as the step left them
        return PdistStrategy.lightning_module_state_dict(self)

    @override
    def pdist_state_dict(self) -> dict:
        state = PdistStrategy.pdist_state_dict(self)
        state.update(step=self.step, version=self.version, mode="parallax")
        if self.row_plan is not None:
            state["row_plan"] = [list(t) for t in self.row_plan.tables]
        if self.client is not None and self.global_rank == 0:
            empty = {"worker": 0, "wait_version": self.version, "tables": []}  # once every push of the step landed
            self.client.map(Kind.PULL_ROWS, [empty] * self.client.num_servers)
            replies = self.client.map(Kind.GET_STATE, [{}] * self.client.num_servers)
            state["servers"] = [loads_state(payload) for _, payload in replies]
        return state

    @override
    def pdist_rank_state(self) -> dict | None:
        return None

    @override
    def teardown(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks, self._pulling = [], False
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        PdistStrategy.register_strategies.__func__(cls, strategy_registry)
