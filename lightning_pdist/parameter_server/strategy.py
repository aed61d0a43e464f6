"""Parameter-server training (sync, backup workers, Downpour async, SSP, DC-ASGD, async EASGD) as a Lightning strategy.

Process layout (one node; on several, server ``i`` runs on node ``i mod num_nodes``)::

    local rank 0 of each node ──fork──> its servers  (dedicated processes, one shard of the flat vector each)
    worker 0 … worker N-1  ──TCP──>  every server     (push gradient shards, pull parameter shards)
    worker 0 … worker N-1  ──private gloo group──     (Lightning's barrier/broadcast/reduce, buffer averaging)

The Lightning ranks are the workers. The local rank 0 of each node starts the servers placed on its node
(``os.fork``, bound to ``server_host``; one node: all of them, forked by global rank 0); global rank 0 sends
each server its shard and the optimizer, and the workers pull the initial parameters (so they all start from
rank 0's weights, as with DDP). Each
training step a worker runs forward/backward (``closure``), pushes its gradient's shards and pulls
parameter shards back; the user's optimizer object never steps on the worker, it only carries the
hyperparameters (learning-rate schedulers keep working: every push carries the current ones).

Why not ``torch.distributed``'s default group (``lightning-integration.md`` §0.3, §3): Lightning
broadcasts on it before every batch, which would keep asynchronous workers in lockstep. The default
group is never initialized; the workers' Lightning collectives go through a private gloo group
(:class:`~lightning_pdist.core.control_group.ControlGroup`) and the servers speak framed TCP
(:mod:`lightning_pdist.core.ps_wire`), which ``tc`` shapes and whose failures name the peer.

Several nodes: with torchrun/SLURM every node runs the same script; server ``i`` runs on node ``i mod N``
(``num_servers`` adds link capacity). Left unset, ``server_host`` becomes each node's address on the route to
``MASTER_ADDR`` and ``allowed_networks`` the networks of those interfaces (docs/multinode.md); a loopback
``server_host`` is refused; ``server_port`` fixes the ports (a node's ``k``-th server binds ``server_port + k``).
Or set ``server_host`` (``"0.0.0.0"``: every node binds all interfaces; an address of one node: all servers on
global rank 0's node) and ``allowed_networks``, or start servers yourself
(``python -m lightning_pdist.parameter_server.process --host H --port P --secret-file F``) and pass ``server_addresses`` and
``server_secret_file=F``.

Authentication: servers the strategy starts get a fresh 32-byte secret from global rank 0, which sends it over
the workers' private group to every worker, and so to each node's starter before it forks its servers (in memory,
through the fork; never on a command line, in the store or in a file); every connection proves it holds it before
its first request (:mod:`~lightning_pdist.core.ps_auth`).
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any, Callable

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pdist.core.nonfinite import all_finite, nonfinite_error
from lightning_pdist.parameter_server.sharding import ShardingPlan, param_specs, plan_sharding
from lightning_pdist.core.accounting import all_reduce_bytes
from lightning_pdist.core.ps_auth import read_secret_file
from lightning_pdist.core.ps_client import ParameterServerClient, group_hparams
from lightning_pdist.parameter_server.chunks import MAX_CHUNKS
from lightning_pdist.parameter_server.coded_push import PushCompressor
from lightning_pdist.core.compression import Compressor
from lightning_pdist.parameter_server.elastic_worker import ElasticWorkerMixin
from lightning_pdist.parameter_server.layout import OptimizerLayout, accumulate_grads, numeric_hparams
from lightning_pdist.parameter_server.placement import check_placement, placed_nodes, start_servers, stop_servers
from lightning_pdist.parameter_server.process import ServerProcess
from lightning_pdist.parameter_server.server import ELEMENTWISE_OPTIMIZERS, STALENESS_BUCKETS
from lightning_pdist.core.ps_wire import Kind, bytes_to_tensor, dumps_state, loads_state
from lightning_pdist.core.control_group import ControlGroup
from lightning_pdist.core.control_collectives import ControlGroupCollectives
from lightning_pdist.parameter_server.precision import ParameterServerMixedPrecision
from lightning_pdist.core.strategy import PdistStrategy
from lightning_pdist.core.config import OwnedDDPArguments
from lightning_pdist.core.guard import SkipStep, global_step
from lightning_pdist.core.momentum import compensate_optimizers
from lightning_pdist.parameter_server.config import DEFAULT_CHUNKS_IN_FLIGHT, DEFAULT_REPLY_BUFFER_BYTES, ParameterServerConfig
from lightning_pdist.core.run_logging import log_histogram

__all__ = ["ParameterServerConfig", "ParameterServerStrategy"]

class ParameterServerStrategy(ElasticWorkerMixin, ControlGroupCollectives, OwnedDDPArguments, PdistStrategy):
    """Data-parallel training through dedicated parameter-server processes.

    Servers hold the parameters, sharded by :func:`~lightning_pdist.parameter_server.sharding.plan_sharding`, and
    run the user's optimizer on their shard; workers compute gradients and exchange shards with every server.
    Modes: ``sync`` (with ``backup_workers``), ``async`` (Downpour), ``ssp``; DC-ASGD with ``delay_compensation``
    (rules: :mod:`~lightning_pdist.parameter_server.rules`); ``easgd``: asynchronous EASGD/EAMSGD, where the module's
    optimizer steps on each worker and the servers hold the elastic center (:mod:`~.elastic`, :mod:`~.elastic_worker`).
    The method card, ``docs/algorithms/parameter_server.md``, describes the modes, several optimizers, parameters
    without gradients, buffers, fp16 with a GradScaler, non-finite values, evaluation, checkpoints and the logged
    metrics.

    Args:
        num_servers: servers ``S >= 1``; ``None``: ``ceil(N / 2)``, one per two workers (paper 000).
        sharding: ``"memory"`` (equal-byte ranges; balanced) or ``"layer"`` (whole layers, greedy).
        mode: ``"sync"``, ``"async"``, ``"ssp"`` or ``"easgd"``.
        staleness: SSP bound in steps (``mode="ssp"`` only).
        backup_workers: ``b`` in ``[0, N - 1]`` (``mode="sync"`` only).
        push_every: async: steps between pushes of the accumulated (summed) gradient.
        pull_every: async: steps between pulls.
        delay_compensation: DC-ASGD ``λ >= 0`` (async/ssp).
        partition_bytes: ``memory`` sharding in fixed-size partitions dealt round-robin (BytePS style).
        server_host: address the servers bind to. ``None``: ``127.0.0.1`` on one node; across nodes, each node's
            address on the route to ``MASTER_ADDR`` (the others must reach it), server ``i`` on node ``i mod N``.
            ``"0.0.0.0"``: every node's servers bind all interfaces. Any other address is one node's: every server
            then runs on global rank 0's node (warned when that puts several servers of a multi-node job there). A
            loopback address in a job that spans nodes is refused when the Trainer is built.
        server_port: first port of the servers' range: a node's ``k``-th server binds ``server_port + k`` (one node:
            server ``i`` on ``server_port + i``; ``N`` nodes: ``ceil(num_servers / N)`` ports from ``server_port``
            on each), so a firewall can open exactly those. ``None``: any free port. A port taken on any node
            stops the run on every worker, naming the node and the port.
        server_addresses: ``["host:port", ...]`` of servers started elsewhere; none are started then.
        server_secret_file: with ``server_addresses``: the file (mode 600, at least 32 bytes) the servers were
            started with (``--secret-file``); every worker authenticates with it. ``None``: those servers are
            unauthenticated (warned). Servers the strategy starts always authenticate, with a fresh secret.
        allowed_networks: comma-separated address ranges servers accept connections from. ``None``:
            ``127.0.0.0/8`` on one node; across nodes, also the networks of the servers' interfaces on every node
            that starts servers (the job's nodes share them; set it for workers routed in from elsewhere). Nothing
            is encrypted: run inside a trusted network (see the method card).
        server_timeout: seconds a worker waits for a server's reply (default 300). A sync step (or SSP pull) waits
            for the slowest worker: when other workers keep it waiting this long, the live server answers naming them
            (``WorkerStalled: ... worker 1 (pid 4242 on host node3, ...) has not pushed step 17 for 300 s: it is
            stopped, hung or dead; parameter server 0 is alive``); a server that has not answered 10 s later is
            blamed itself. A server that dies fails its workers at once. Worker ``m`` is global rank ``m``.
        easgd_period: ``τ >= 1``, local steps between a worker's elastic exchanges (``mode="easgd"``; ``None``: 4).
        easgd_alpha: ``α`` in ``(0, 1]``, the elastic coefficient (``mode="easgd"``; ``None``: ``0.9 / N``).
        implicit_momentum: ``"compensate"`` (``mode="async"`` only): the servers' optimizer runs with its momentum
            (SGD's ``momentum``, Adam's ``beta1``) lowered by the ``1 − 1/N`` that ``N`` asynchronous workers imply,
            floored at 0 (Mitliagkas et al. 2016; :mod:`lightning_pdist.core.momentum`).
        chunk_bytes: ``None`` (default): a server answers a sync step's push once every worker's whole shard arrived.
            ``c``: the memory plan is cut into ``c``-byte partitions (``partition_bytes=c``), each pushed as its own
            request and answered with its new values as soon as every worker pushed it, so pushes and pulls overlap
            on the servers' links (BytePS; :mod:`~.chunks`). Results are those of ``partition_bytes=c`` unchunked.
            ``mode="sync"``, ``backup_workers=0``, ``sharding="memory"``, no ``compression``; a multiple of 8 bytes;
            at most 64 chunks per server (each is one more connection per worker).
        chunks_in_flight: with ``chunk_bytes``, how many of a worker's chunks per server may be pushed and not yet
            answered: chunk ``j`` goes out once chunk ``j − m`` came back, so the workers push the same chunks at the
            same time and each chunk's pull follows its pushes (:meth:`~lightning_pdist.core.ps_client.
            ParameterServerClient.pushpull_chunks`). ``None`` (default): no cap (:data:`~.config.DEFAULT_CHUNKS_IN_FLIGHT`
            says why). Pacing moves bytes, never values: results are those of any other setting.
        reply_buffer_bytes: each server's send buffer (``SO_SNDBUF``, bytes; Linux doubles it) on the connections
            it answers pushes and pulls on, so its replies enter the link at the link's pace instead of overflowing
            the server host's own queue when a step's ``W`` replies leave together. ``None`` (default): the kernel
            autotunes it (:data:`~.config.DEFAULT_REPLY_BUFFER_BYTES` says why, with the measurements). An int in
            ``[4096, 2**26]``; 16384 suited chunked steps at 4 workers on emulated 100 Mbit/s links. Not with
            ``mode="easgd"``. It moves bytes, never values: results are those of ``None``.
        nonfinite: ``"raise"`` (default), ``"skip_step"`` or ``"propagate"``: what the workers do when a gradient
            holds NaN/Inf before its push (the method card's "Non-finite values").
        compression: a compressor from :mod:`lightning_pdist.compression` (``TopK(0.01)``, ``DGC()``, ``QSGD()``,
            ``TernGrad()``, ``RandomK``, ``Sign``, ``FP16``, ``BF16``; not ``PowerSGD``, which needs an all-reduce):
            each worker compresses every parameter slice it pushes, keeping its error-feedback residual itself
            (checkpointed in its rank file); the servers decode and apply their rule (:mod:`~.coded_push`).
            Not with ``mode="easgd"`` (no gradient pushes there). Pulls are not compressed.
        **kwargs: :class:`~lightning.pytorch.strategies.DDPStrategy` arguments (``start_method``,
            ``timeout`` of the workers' gloo group: the rendezvous, barriers and broadcasts, default 30 min, ...).
            Nothing is wrapped in ``DistributedDataParallel``. The method card's "Timeouts and hung workers" has
            values for long runs.
    """

    strategy_name = "parameter_server"
    progress_bar_keys = {"pdist/ps/wait_s": ("wait", "s")}  # time blocked on the servers, beside comm=
    wraps_in_ddp = False  # gradients go to the servers, not through DDP: no find_unused_parameters variants
    compression_use = "pushes"
    owned_reason = "gradients go to the parameter servers"

    def __init__(
        self,
        num_servers: int | None = None,
        sharding: str = "memory",
        mode: str = "sync",
        staleness: int = 0,
        backup_workers: int = 0,
        push_every: int = 1,
        pull_every: int = 1,
        delay_compensation: float = 0.0,
        partition_bytes: int | None = None,
        server_host: str | None = None,
        server_port: int | None = None,
        server_addresses: list[str] | None = None,
        server_secret_file: str | None = None,
        allowed_networks: str | None = None,
        server_timeout: float = 300.0,
        easgd_period: int | None = None,
        easgd_alpha: float | None = None,
        implicit_momentum: str | None = None,
        chunk_bytes: int | None = None,
        chunks_in_flight: int | None = DEFAULT_CHUNKS_IN_FLIGHT,
        reply_buffer_bytes: int | None = DEFAULT_REPLY_BUFFER_BYTES,
        nonfinite: str = "raise",
        compression: Compressor | None = None,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        if chunk_bytes is not None and type(self).setup_algorithm is not ParameterServerStrategy.setup_algorithm:
            raise ValueError(f"{owner}(chunk_bytes={chunk_bytes!r}): chunked steps cut ParameterServerStrategy's sync "
                             f"gradient pushes; {owner} exchanges its own messages (leave chunk_bytes=None)")  # fmt: skip
        if compression is not None and chunk_bytes is not None:
            raise ValueError(f"{owner}(chunk_bytes={chunk_bytes!r}, compression={compression!r}): chunked steps push "
                             "plain gradients; use compression=None or chunk_bytes=None")  # fmt: skip
        if compression is not None and mode == "easgd":
            raise ValueError(f"{owner}(compression={compression!r}, mode='easgd'): compression compresses gradient "
                             "pushes, and mode='easgd' pushes none (its workers exchange parameters with the center); "
                             "use mode='sync', 'async' or 'ssp', or compression=None")  # fmt: skip
        self.config = ParameterServerConfig(
            num_servers=num_servers, sharding=sharding, mode=mode, staleness=staleness, backup_workers=backup_workers,
            push_every=push_every, pull_every=pull_every, delay_compensation=delay_compensation,
            partition_bytes=partition_bytes, server_host=server_host, server_port=server_port,
            server_addresses=_addresses(server_addresses, owner), server_secret_file=server_secret_file,
            allowed_networks=allowed_networks, server_timeout=server_timeout, easgd_period=easgd_period,
            easgd_alpha=easgd_alpha, implicit_momentum=implicit_momentum, chunk_bytes=chunk_bytes,
            chunks_in_flight=chunks_in_flight, reply_buffer_bytes=reply_buffer_bytes, owner=owner,
        )  # fmt: skip
        # OwnedDDPArguments refuses and hides DDP's comm-hook arguments
        super().__init__(nonfinite=nonfinite, compression=compression, **kwargs)
        if server_addresses is not None and server_secret_file is None:
            rank_zero_warn(f"{owner}(server_addresses={list(server_addresses)!r}, server_secret_file=None): these servers "
                           "are unauthenticated; any process that reaches them (on a shared node, any user's) can push "
                           "gradients or read parameters. Start them with --secret-file and pass server_secret_file.")  # fmt: skip
        self.num_servers, self.sharding, self.mode = num_servers, sharding, mode
        self.staleness, self.backup_workers, self.delay_compensation = staleness, backup_workers, delay_compensation
        self.push_every, self.pull_every = push_every, pull_every
        self.easgd_period, self.easgd_alpha, self.implicit_momentum = easgd_period, easgd_alpha, implicit_momentum
        self.chunk_bytes, self.chunks_in_flight = chunk_bytes, chunks_in_flight
        self.reply_buffer_bytes = reply_buffer_bytes
        self.momentum_from: list[float] = []  # implicit_momentum="compensate": each param group's momentum before
        self.servers: list[ServerProcess] = []  # the servers this process started (a node's local rank 0)
        self.server_addresses: list[str] = []
        self._secret: bytes | None = None  # the servers' shared secret for this fit (never logged or checkpointed)
        self.plan: ShardingPlan | None = None
        self.workers: ControlGroup | None = None
        self.client: ParameterServerClient | None = None
        self.step = 0  # optimizer steps this worker took (all optimizers)
        self.optimizer_steps: list[int] = []  # per optimizer (async push/pull periods count these)
        self.layout: OptimizerLayout | None = None
        self.staleness_histogram = [0] * STALENESS_BUCKETS
        self.dropped_pushes = 0
        self._versions: list[int] = []
        self._accumulated: dict[int, dict[str, Tensor | None]] = {}  # async: optimizer -> summed grads
        self._server_seen: list[tuple[int, int]] = []  # each server's (bytes in, out) at the last logged step
        self._server_now: list[tuple[int, int]] = []  # ... at this worker's latest exchange
        self._histogram_logged = [0] * STALENESS_BUCKETS  # staleness_histogram at the last logged step
        self._exchanged = False  # whether this worker met the servers since the last logged step
        self._eval_backup: Tensor | None = None
        self._finalized = False
        self.push_compressor: PushCompressor | None = None  # compression=: this worker's coder and residuals

    # ------------------------------------------------------------------ world
    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        self.config.check_world_size(self.world_size)
        if self.config.server_addresses is None:
            nodes = placed_nodes(self.config, self.config.servers_for(self.world_size), self.num_nodes)
            self.config.check_port_range(max(nodes.count(node) for node in set(nodes)))

    @property
    def server_pids(self) -> list[int]:
        """Process ids of the servers this process started (each node's local rank 0; one node: global rank 0)."""
        return [abs(s.pid) for s in self.servers]

    @override
    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        env = self.cluster_environment
        host, port = env.main_address, env.main_port
        fitting = self._trainer_fn() in (None, TrainerFn.FITTING)  # validate/test/predict need no servers
        if fitting and self.lightning_module is not None:
            self._plan(self.config.servers_for(self.world_size))  # every rank refuses a bad plan before any server starts
        timeout = self._timeout if isinstance(self._timeout, timedelta) else timedelta(minutes=30)
        self.workers = ControlGroup(host, port, self.global_rank, self.world_size, timeout=timeout)
        if self.config.server_addresses is not None:
            self.server_addresses = list(self.config.server_addresses)
            if self.config.server_secret_file is not None:
                self._secret = read_secret_file(self.config.server_secret_file)
        elif fitting:
            # The workers' group comes first: every node's starter needs rank 0's secret before it forks. Forking
            # after the gloo group exists is safe here, as for DataLoader workers forked after init_process_group:
            # the server child closes every inherited descriptor (gloo's sockets and epoll, the store), runs one
            # thread (torch.set_num_threads(1)), never touches the group's objects and leaves with os._exit.
            self._start_servers(host)

    def _plan(self, num_servers: int) -> ShardingPlan:
        """The sharding plan; an impossible one (more servers than elements, ...) is refused naming the rule."""
        try:
            return plan_sharding(param_specs(self.lightning_module), num_servers, self.config.sharding,
                                 self.config.plan_partition_bytes)  # fmt: skip
        except ValueError as err:
            raise ValueError(f"{type(self).__name__}: {err}") from None

    def _trainer_fn(self) -> TrainerFn | None:
        module = self.lightning_module
        return module.trainer.state.fn if module is not None and module._trainer is not None else None

    @override
    def _configure_launcher(self) -> None:
        # Runs when the Trainer is built, before any process or server starts.
        super()._configure_launcher()
        check_placement(type(self).__name__, self.config, self.num_nodes, self.config.servers_for(self.world_size))

    def _start_servers(self, main_address: str) -> None:
        """Each node's local rank 0 starts its servers; every worker gets all their addresses (:func:`start_servers`)."""
        nodes = placed_nodes(self.config, self.config.servers_for(self.world_size), self.num_nodes)
        self.servers, self.server_addresses, self._secret = start_servers(
            type(self).__name__, self.config, self.workers, main_address, nodes, self.node_rank, self.num_nodes,
            self.local_rank,
        )

    @property
    def control_group(self) -> ControlGroup | None:
        """The workers' own group: Lightning's barrier/broadcast/reduce/all_gather go through it."""
        return self.workers

    # ------------------------------------------------------------------ setup
    @override
    def load_resumed_state(self) -> None:
        """Nothing left to load: :meth:`setup_algorithm` loaded the checkpoint's state, where the servers exist."""
        self._loaded_pdist_state, self._loaded_rank_state = None, (None, "")

    @override
    def setup_algorithm(self) -> None:
        owner = type(self).__name__
        for k, optimizer in enumerate([] if self.elastic else self.optimizers):  # easgd: they step on the workers
            name = type(optimizer).__name__
            if name not in ELEMENTWISE_OPTIMIZERS or type(optimizer) is not getattr(torch.optim, name):
                raise ValueError(
                    f"{owner}: configure_optimizers returned {type(optimizer).__module__}.{type(optimizer).__qualname__}"
                    f"{f' (optimizer {k})' if len(self.optimizers) > 1 else ''}; parameter servers rebuild the optimizer "
                    "on each shard, which is exact only for element-wise optimizers: "
                    f"torch.optim.{', torch.optim.'.join(ELEMENTWISE_OPTIMIZERS)}"
                )
        if not self.elastic:  # easgd: Lightning's precision plugin runs the local step, its scaler included
            self._use_loss_scaling(owner)
        if self.config.implicit_momentum == "compensate":  # before the servers' optimizers are built from the groups
            self.momentum_from, warning = compensate_optimizers(self.optimizers, self.world_size, owner)
            if warning:
                rank_zero_warn(warning)
        params = self._params()
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"{owner}: the model's parameters have dtypes {sorted(map(str, dtypes))}; the servers need one")
        world_size, rank = self.world_size, self.global_rank
        if world_size == 1:
            rank_zero_warn(f"{owner}: world_size == 1: one worker and its servers; " + (
                "its elastic exchanges pull it and the center together." if self.elastic else
                "this is the local optimizer, remotely."))  # fmt: skip
        self.plan = self._plan(len(self.server_addresses) or self.config.servers_for(world_size))
        self.layout = OptimizerLayout(list(self.lightning_module.named_parameters()), self.optimizers, self.plan, owner)
        self._check_chunk_count(owner)
        self.client = ParameterServerClient(self.server_addresses, rank, timeout=self.config.server_timeout,
                                            secret=self._secret)  # fmt: skip
        if rank == 0:
            self.client.map(Kind.INIT, *self._init_requests())
            if self._loaded_pdist_state is not None:
                self._restore_servers(self._loaded_pdist_state)
        self.optimizer_steps = [0] * len(self.optimizers)
        if self._loaded_pdist_state is not None:
            super().load_pdist_state_dict(self._loaded_pdist_state)
            self.step = int(self._loaded_pdist_state.get("step", 0))
            saved = self._loaded_pdist_state.get("optimizer_steps", [self.step])
            self.optimizer_steps = [int(n) for n in saved] if len(saved) == len(self.optimizers) else self.optimizer_steps
        self.barrier()
        self.client.hello()
        if self.config.chunk_bytes is not None:
            self.client.open_chunks([len(self.layout.chunks(s)) for s in range(self.plan.num_servers)])
        shards, metas = self.client.pull(record=True)
        self._load_shards(shards, metas)
        # Counted from the servers' start: the first logged interval holds every worker's set-up requests (INIT,
        # HELLO, first pull), whichever order they came in, so every interval is exact, the first one included.
        self._server_seen = [(0, 0) for _ in metas]
        self._server_now = list(self._server_seen)
        if metas and all("histogram" in m for m in metas):
            self.staleness_histogram = [sum(h) for h in zip(*(m["histogram"] for m in metas))]
        self._histogram_logged = list(self.staleness_histogram)
        self._accumulated = {}
        self._finalized = False
        self._elastic_start()
        if self.elastic and self._loaded_pdist_state is not None:
            self._load_elastic_rank_state(*self._loaded_rank_state)
        self.push_compressor = None
        if self.compression is not None:
            self.push_compressor = PushCompressor(self.compression, self.layout, rank, world_size)
            if self._loaded_pdist_state is not None:
                self._load_push_state(*self._loaded_rank_state)

    def _check_chunk_count(self, owner: str) -> None:
        """``chunk_bytes``: at most :data:`~.chunks.MAX_CHUNKS` per server (each is a connection per worker)."""
        chunk = self.config.chunk_bytes
        if chunk is None:
            return
        most = max(len(self.layout.chunks(s)) for s in range(self.plan.num_servers))
        if most > MAX_CHUNKS:
            least = 8 * math.ceil(self.plan.nbytes / (MAX_CHUNKS * self.plan.num_servers * 8))
            raise ValueError(f"{owner}(chunk_bytes={chunk}): the model's {self.plan.nbytes:,} bytes on "
                             f"{self.plan.num_servers} server(s) make up to {most} chunks per server; at most "
                             f"{MAX_CHUNKS} are allowed (each chunk is one more connection per worker), so chunk_bytes "
                             f"must be >= {least} for this model")  # fmt: skip

    def _use_loss_scaling(self, owner: str) -> None:
        """Swap a ``MixedPrecision`` with a scaler for :class:`ParameterServerMixedPrecision` (the same scaler)."""
        plugin = self.precision_plugin
        if isinstance(plugin, ParameterServerMixedPrecision):
            return  # a later fit with this strategy
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            self.precision_plugin = ParameterServerMixedPrecision.replacing(plugin)
        elif getattr(plugin, "scaler", None) is not None:
            raise ValueError(
                f"{owner}: the precision plugin {type(plugin).__name__} has a gradient scaler; the workers push "
                "unscaled gradients and skip overflowed steps only with Lightning's MixedPrecision('16-mixed') "
                "(precision='16-mixed'), which setup swaps for ParameterServerMixedPrecision"
            )

    def _params(self) -> list[Tensor]:
        return [p for _, p in self.lightning_module.named_parameters()]

    def _flat_params(self) -> Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self._params()])

    @torch.no_grad()
    def _set_flat_params(self, flat: Tensor) -> None:
        offset = 0
        for p in self._params():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def _init_requests(self) -> tuple[list[dict], list[Tensor]]:
        flat = self._flat_params()
        if self.elastic:  # no optimizer on the servers: each holds its shard of the center
            metas = [{"mode": "easgd", "num_workers": self.world_size, "dtype": str(flat.dtype),
                      "segments": [[-1, -1, self.plan.numel_per_server[server]]],
                      "alpha": self.config.alpha_for(self.world_size)} for server in range(self.plan.num_servers)]  # fmt: skip
            return metas, [self.plan.gather(flat, server) for server in range(self.plan.num_servers)]
        optimizers = [
            {"name": type(o).__name__,
             "param_groups": [group_hparams(g, f"{type(self).__name__}: optimizer {k} param group {i}")
                              for i, g in enumerate(o.param_groups)]}
            for k, o in enumerate(self.optimizers)
        ]  # fmt: skip
        metas = [{
            "mode": self.config.mode, "num_workers": self.world_size, "dtype": str(flat.dtype),
            "segments": self.layout.segments(server), "optimizers": optimizers,
            "backup_workers": self.config.backup_workers, "staleness": self.config.staleness,
            "delay_compensation": float(self.config.delay_compensation),
            **({"chunks": self.layout.chunks(server)} if self.config.chunk_bytes is not None else {}),
            **({"reply_buffer_bytes": self.config.reply_buffer_bytes} if self.config.reply_buffer_bytes is not None else {}),
            "reply_turns": not self._workers_meet_every_step(),
        } for server in range(self.plan.num_servers)]  # fmt: skip
        return metas, [self.plan.gather(flat, server) for server in range(self.plan.num_servers)]

    def _workers_meet_every_step(self) -> bool:
        """Sync workers that agree before every push (the gradient check, or an fp16 overflow) meet between a step's
        pull and the next push. Servers answer a step's pulls one worker at a time only where they do not: there the
        first worker served pushes its next gradient while the others still pull; where they meet, nobody can, and
        one reply at a time only delays the last one (docs/benchmarks.md, "Replies one worker at a time")."""
        if not self.config.steps_together or self.world_size == 1:
            return False
        return isinstance(self.precision_plugin, ParameterServerMixedPrecision) or self.nonfinite_guard.consulted(self.precision_plugin)

    def _load_shards(self, shards: list[Tensor], metas: list[dict]) -> None:
        flat = self._flat_params()
        for server, shard in enumerate(shards):
            self.plan.scatter_(flat, server, shard)
        self._set_flat_params(flat)
        self._versions = [int(m["version"]) for m in metas]

    # ------------------------------------------------------------------ training step
    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self.client is None:
            raise RuntimeError(f"{type(self).__name__}.optimizer_step: the servers are not set up (call within Trainer.fit)")
        if self.elastic:
            return self._elastic_optimizer_step(optimizer, closure, model, **kwargs)
        model = model if model is not None else self.lightning_module
        plugin = self.precision_plugin
        scaled = isinstance(plugin, ParameterServerMixedPrecision)
        # forward + backward, then on_before_optimizer_step and gradient clipping; the step itself is the servers'
        k = next((i for i, o in enumerate(self.optimizers) if o is optimizer), None)
        if k is None:
            raise RuntimeError(f"{type(self).__name__}.optimizer_step: {type(optimizer).__name__} is not one of the optimizers "
                               "configure_optimizers returned; the servers run only those")  # fmt: skip
        if scaled:  # fp16 with a GradScaler: the gradients come back unscaled, with this worker's overflow flag
            closure_result, overflowed = plugin.backward_and_unscale(model, optimizer, closure)
            skip = self._agree_overflow(bool(overflowed))
        else:
            closure_result, overflowed, skip = plugin._wrap_closure(model, optimizer, closure), None, False
            if self.nonfinite_guard.consulted(plugin) and not (closure_result is None and model.automatic_optimization):
                skip = self._check_nonfinite(k)
        self._exchange(k, skip)
        self.nonfinite_guard.step_done()
        if scaled and (overflowed is not None or self.config.steps_together):
            # Without a backward Lightning leaves the scale alone; a sync worker still takes the agreed flag, so
            # that every worker's scale stays the same.
            plugin.end_step(skip)
        optimizer._opt_called = True  # the servers stepped: keeps LR schedulers from warning about call order
        self._log_comm_bytes()
        return closure_result

    def _push(self, k: int, grads: dict[str, Tensor | None], pull: bool) -> tuple[list[Tensor] | None, list[dict]]:
        """Push optimizer ``k``'s gradients (only those present) to every server, with its current hyperparameters."""
        coder = self.push_compressor
        pack = coder.pack if coder is not None else self.layout.pack
        packed = [pack(s, k, grads) for s in range(self.plan.num_servers)]
        extras = [{"optimizer": k, "present": present} for _, present in packed]
        hparams = [numeric_hparams(group) for group in self.optimizers[k].param_groups]
        if self.config.chunk_bytes is not None and pull:  # each chunk its own request (chunks.py)
            metas = [{"worker": self.global_rank, "version": v, "hparams": hparams, **e} for v, e in zip(self._versions, extras)]
            parts = []
            for s, (compact, present) in enumerate(packed):
                bounds = self.layout.chunk_bounds(s, k, present)
                parts.append([compact[a:b] for a, b in zip(bounds, bounds[1:])])
            replies = self.client.pushpull_chunks(metas, parts, in_flight=self.config.chunks_in_flight)
            shards = [torch.cat([bytes_to_tensor(p, m["dtype"]) for m, p in chunks]) for chunks in replies]
            # Every chunk's reply carries the step's version; the step's byte counters are in the replies answered
            # after its last chunk closed (chunks on separate connections may close out of order): the largest.
            return shards, [max((m for m, _ in chunks), key=lambda m: m["step_bytes_in"]) for chunks in replies]
        return self.client.push([g for g, _ in packed], self._versions, hparams, pull=pull, extras=extras,
                                coded=coder is not None)  # fmt: skip

    def _agree_overflow(self, overflowed: bool) -> bool:
        """Whether this step's push is skipped: ``sync``, if any worker overflowed; ``async``/``ssp``, if this one did."""
        if not self.config.steps_together or self.workers is None or self.world_size == 1:
            return overflowed
        # One 4-byte all-reduce before the push, every step (sync workers meet at every step anyway). The push
        # cannot carry the flag without a server-side change: each server would have to hold its step back until
        # every worker's flag arrived, and the workers would still have to learn the outcome to back off.
        flags = self.workers.exchange_flags(f"overflow/{self.step}", int(overflowed), self._agreement_timeout,
                                            what=f"whether its step {self.step + 1} overflowed")  # fmt: skip
        return any(flags)

    @property
    def _agreement_timeout(self) -> timedelta:
        return timedelta(seconds=self.config.server_timeout)

    def _check_nonfinite(self, k: int) -> bool:
        """Whether this step's push is skipped for non-finite gradients (``"raise"`` raises instead); before any push.

        ``sync``: every worker learns which workers' gradients were not finite (one all-reduce of ``world_size``
        flags), so every worker raises or skips at the same step. ``async``/``ssp``: this worker's own check.
        """
        bad = not all_finite([g for g in self.layout.grads_of(k).values() if g is not None])
        agreed = self.config.steps_together and self.workers is not None and self.world_size > 1
        if agreed:
            # Through the store with the server's deadline, not a gloo all-reduce: a stopped worker is then named
            # after server_timeout (WorkerSilent), as the servers name it, instead of gloo failing unnamed much later.
            # Tagged by the step count only (not the optimizer): workers that step different optimizers still meet,
            # and the servers refuse that mismatch by name, as they did with the all-reduce.
            flags = self.workers.exchange_flags(f"nonfinite/{self.step}", int(bad), self._agreement_timeout,
                                                what=f"its gradient check before step {self.step + 1}'s push")  # fmt: skip
            ranks = [r for r, flag in enumerate(flags) if flag]
        else:
            ranks = [self.global_rank] if bad else []
        if not ranks:
            return False
        local = not self.config.steps_together
        try:
            self.nonfinite_guard.act(
                "gradients", ranks, self.lightning_module, before="its push (no server has seen them)" if local else
                "the push (no server has seen them)", skipped="its own push of that step" if local else
                "that step's push (no server stepped)", scope=f"worker {self.global_rank}" if local else "every worker")  # fmt: skip
        except SkipStep:
            return True
        return False

    def _exchange(self, k: int, skip: bool = False) -> None:
        # The worker's .grad is left as it is (a torch optimizer's step does not clear it either): the user's or
        # Lightning's zero_grad does, and another optimizer may still need the gradients of its own parameters.
        self.step += 1
        self.optimizer_steps[k] += 1
        grads = self.layout.grads_of(k)
        if skip:  # an fp16 overflow or a non-finite skip: this step's gradient (Inf/NaN) goes nowhere
            grads = dict.fromkeys(grads)
        sent_before = self.client.bytes_sent
        metas: list[dict] = []
        if self.config.mode == "async":
            if not skip:
                self._accumulated[k] = accumulate_grads(self._accumulated.get(k), grads)
            # a skipped step still counts towards push_every: what earlier steps accumulated goes out on time
            push = self.optimizer_steps[k] % self.config.push_every == 0 and k in self._accumulated
            pull = self.optimizer_steps[k] % self.config.pull_every == 0
            if push:
                new, metas = self._push(k, self._accumulated.pop(k), pull)
                if pull:
                    self._load_shards(new, metas)
            elif pull:
                new, metas = self.client.pull(record=True)
                self._load_shards(new, metas)
        elif not (skip and self.config.steps_together):
            # ssp skip: an empty push (no gradient present: no parameter moves) still ends this worker's clock,
            # so the staleness bound keeps counting iterations; its pull waits for the bound as usual.
            new, metas = self._push(k, grads, pull=True)
            self._load_shards(new, metas)
        # sync skip: every worker skips (agreed), no server steps, versions stay where they are
        if metas and self.nonfinite != "propagate":
            self._refuse_nonfinite()
        self.comm_meter.add("ps_push", self.client.bytes_sent - sent_before)
        self._average_buffers(meeting=False)
        self._log_ps_metrics(metas)

    def _refuse_nonfinite(self) -> None:
        """Stop when the pulled parameters are not finite although every push was checked: a server step diverged.

        In sync mode every worker pulls the same parameters, so every worker stops at the same step; in async/ssp
        each stops at its first non-finite pull. Not consulted under ``nonfinite="propagate"``.
        """
        if all_finite(self._params()):  # every exchange: per tensor, no flat copy
            return
        note = ("Every gradient pushed was checked finite (under a GradScaler: unscaled and not overflowed), so the "
                "servers' optimizer step made them, and no skip can undo a server step.")  # fmt: skip
        sync = self.config.steps_together
        raise nonfinite_error(type(self).__name__, "parameters pulled from the servers", [],
                              global_step(self.lightning_module), "they reach a checkpoint", self.nonfinite, note,
                              skippable=False, scope="every worker" if sync else f"worker {self.global_rank}",
                              who=f"worker {self.global_rank}")  # fmt: skip

    def _buffers_every_step(self) -> bool:
        # Only where the workers are in lockstep anyway: an all-reduce per step would hold async/SSP workers
        # together and make sync wait for the stragglers that backup workers exist to leave behind.
        return self.config.lockstep

    @torch.no_grad()
    def _average_buffers(self, meeting: bool) -> None:
        """``b ← (1/N) Σ_m b_m`` for every floating-point buffer (BatchNorm running statistics) over the workers.

        ``meeting=False``: after an optimizer step, sync mode only (counted in ``pdist/comm_bytes``);
        ``meeting=True``: where every worker is anyway (validation, checkpoint, end of fit), the other modes.
        """
        if self.workers is None or self.world_size == 1 or meeting == self._buffers_every_step():
            return
        buffers = [b for b in self.lightning_module.buffers() if b.is_floating_point()]
        if not buffers:
            return
        flat = torch.cat([b.detach().reshape(-1) for b in buffers])
        self.workers.all_reduce_(flat, "sum").div_(self.world_size)
        offset = 0
        for b in buffers:
            b.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()
        if not meeting:
            self.comm_meter.add("ps_buffers", all_reduce_bytes(flat.numel() * flat.element_size(), self.world_size))

    def _log_ps_metrics(self, metas: list[dict]) -> None:
        """Note this step's exchange; :meth:`diagnostics` logs the interval's figures on the next logged step."""
        self._diagnostics.note("pdist/ps/wait_s", self.client.last_wait_s if metas else 0.0)
        self._exchanged = self._exchanged or bool(metas)
        for server, meta in enumerate(metas):
            # Sync servers report their counters at the close of each step (exact per-step load); the live
            # counters of async/ssp servers depend on when this worker's reply went out.
            self._server_now[server] = (meta.get("step_bytes_in", meta["bytes_in"]),
                                        meta.get("step_bytes_out", meta["bytes_out"]))  # fmt: skip
        for tau in (m["staleness"] for m in metas if "staleness" in m):
            self._diagnostics.note("pdist/ps/staleness", tau)
        if self.config.steps_together:
            self.dropped_pushes += sum(1 for m in metas if m.get("accepted") is False)
        elif metas and all("histogram" in m for m in metas):
            self.staleness_histogram = [sum(h) for h in zip(*(m["histogram"] for m in metas))]

    @override
    def diagnostics(self) -> dict[str, float]:
        """The interval's wait, per-server load, staleness (and histogram, to the loggers directly)."""
        out = super().diagnostics()
        loads = []
        pairs = zip(self._server_now, self._server_seen) if self._exchanged else ()  # no exchange: nothing to say
        self._exchanged = False
        for server, ((now_in, now_out), (seen_in, seen_out)) in enumerate(pairs):
            out[f"pdist/ps/server{server}_bytes_in"] = float(now_in - seen_in)
            out[f"pdist/ps/server{server}_bytes_out"] = float(now_out - seen_out)
            loads.append(now_in - seen_in + now_out - seen_out)
        self._server_seen = list(self._server_now)
        if loads:
            out["pdist/ps/server_bytes_max"] = float(max(loads))
            out["pdist/ps/server_bytes_mean"] = float(sum(loads) / len(loads))
        if self.config.drops_late_pushes:
            out["pdist/ps/dropped_pushes"] = float(self.dropped_pushes)
        interval = [now - then for now, then in zip(self.staleness_histogram, self._histogram_logged)]
        if any(interval) and self.lightning_module is not None and self.lightning_module._trainer is not None:
            log_histogram(self.lightning_module._trainer, "pdist/ps/staleness_hist", interval)
        self._histogram_logged = list(self.staleness_histogram)
        return out

    # ------------------------------------------------------------------ evaluation and end of fit
    def _fitting(self) -> bool:
        module = self.lightning_module
        return (module is not None and module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING
                and self.client is not None and not self._finalized)  # fmt: skip

    def _meet_for_center(self) -> None:
        """``easgd``: wait until every worker's exchanges so far have landed, so every worker pulls the same center.

        (An exchange is answered only once applied, so a worker at this barrier has none in flight.) ``async`` and
        ``ssp`` snapshot the servers as each worker finds them (the method card's consistency caveats)."""
        if self.elastic and self.workers is not None and self.world_size > 1:
            self.workers.barrier()

    def _servers_params(self) -> Tensor:
        """The servers' current parameters as a flat vector (a pull that does not count as the worker's)."""
        shards, _ = self.client.pull(record=False)
        flat = self._flat_params()
        for server, shard in enumerate(shards):
            self.plan.scatter_(flat, server, shard)
        return flat

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._close_local_step()  # easgd with several optimizers: the previous batch's local step is over
        super().on_train_batch_start(batch, batch_idx)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self._fitting():
            self._close_local_step()
        if self._fitting() and self._eval_backup is None:
            self._meet_for_center()
            self._average_buffers(meeting=True)  # every worker validates at the same step
            servers = self._servers_params()
            self._eval_backup = self._flat_params()
            self._set_flat_params(servers)

    @override
    def on_validation_end(self) -> None:
        if self._eval_backup is not None:
            self._set_flat_params(self._eval_backup)
            self._eval_backup = None
        super().on_validation_end()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if not self._fitting():
            return
        self._close_local_step()
        for k in sorted(self._accumulated):  # async: push what push_every left over
            self._push(k, self._accumulated.pop(k), pull=False)
        self.client.bye()  # this worker pushes no more: SSP stops waiting for it, backup workers stop counting on it
        self.barrier()  # every worker has pushed its last gradient
        self._set_flat_params(self._servers_params())
        self._average_buffers(meeting=True)
        self.barrier()  # every worker has pulled: each node's starter may shut its servers down in teardown
        self._finalized = True

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._fitting() or self._eval_backup is not None:  # after fit / during validation: the module holds them
            return super().lightning_module_state_dict()
        self._close_local_step()
        self._meet_for_center()
        self._average_buffers(meeting=True)  # Lightning saves a checkpoint on every rank: they all meet here
        own = self._flat_params()
        self._set_flat_params(self._servers_params())
        state = {k: v.detach().clone() for k, v in super().lightning_module_state_dict().items()}
        self._set_flat_params(own)
        return state

    @override
    def pdist_state_dict(self) -> dict:
        state = super().pdist_state_dict()
        state.update(step=self.step, optimizer_steps=list(self.optimizer_steps), mode=self.config.mode,
                     staleness_histogram=list(self.staleness_histogram))
        if self.plan is not None:
            state["plan"] = self.plan.summary()
        if self.client is not None and self.global_rank == 0:
            replies = self.client.map(Kind.GET_STATE, [{}] * self.client.num_servers)
            state["servers"] = [loads_state(payload) for _, payload in replies]
        return state

    @property
    @override
    def rank_world(self) -> tuple[int, int]:
        """The workers' ranks (the default process group is never initialized here)."""
        return self.global_rank, self.world_size

    @override
    def pdist_rank_state(self) -> dict | None:
        """This worker's own file: ``mode="easgd"`` during fit, its ``x_i``, optimizer state and local steps; with
        ``compression``, its residuals and compressor state."""
        if self.elastic:
            return self._elastic_rank_state() if self._fitting() else None
        return None if self.push_compressor is None else {"compressed_push": self.push_compressor.state_dict()}

    def _load_push_state(self, own: dict | None, reason: str) -> None:
        """This worker's residuals, or (when any worker lacks its file: agreed) fresh ones on every worker, warned."""
        own = own.get("compressed_push") if own is not None else None
        missing = torch.tensor([0 if own is not None else 1 + self.global_rank], dtype=torch.int64)
        if self.workers is not None and self.world_size > 1:
            self.workers.all_reduce_(missing, "max")
        if own is None or missing.item():
            why = reason or "it holds no compression state" if own is None else \
                f"worker {missing.item() - 1} has no part of this checkpoint"  # fmt: skip
            rank_zero_warn(f"{type(self).__name__}(compression={self.compression!r}): {why}; every worker resumes "
                           "with zero error-feedback residuals (the resume is not exact).")  # fmt: skip
            return
        self.push_compressor.load_state_dict(own)

    def _restore_servers(self, state: dict) -> None:
        servers = state.get("servers")
        owner = type(self).__name__
        if servers is None:
            rank_zero_warn(f"{owner}: the checkpoint holds no server state; the servers start from its weights with a fresh optimizer.")
            return
        if len(servers) != self.plan.num_servers:
            raise ValueError(
                f"{owner}(num_servers={self.plan.num_servers}): the checkpoint holds {len(servers)} servers' state; resume with "
                "the same num_servers and sharding"
            )
        self.client.map(Kind.SET_STATE, [{}] * len(servers), [dumps_state(s) for s in servers])

    @override
    def load_pdist_state_dict(self, state: dict) -> None:
        # Consumed in setup_algorithm, where the servers exist (see PdistStrategy.load_checkpoint).
        self._loaded_pdist_state = state

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            for server in self.servers:  # each node's starter shuts down the servers it started
                try:
                    client.connections[server.index].request(Kind.SHUTDOWN, {})
                except Exception:  # a server already gone: _stop_servers still reaps it
                    pass
            client.close()
        self._stop_servers()
        self.server_addresses = []
        self._secret = None
        workers, self.workers = self.workers, None
        self.close_control_group(workers)
        super().teardown()

    def _stop_servers(self) -> None:
        servers, self.servers = self.servers, []
        stop_servers(servers)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        super().register_strategies(strategy_registry)
        for mode in ("async", "ssp", "easgd"):
            strategy_registry.register(
                f"{cls.strategy_name}_{mode}", cls, description=f"parameter server, mode={mode!r}", mode=mode, override=True
            )
        strategy_registry.register("ps", cls, description="alias of parameter_server", override=True)


def _addresses(value: Any, owner: str) -> tuple[str, ...] | None:
    """``server_addresses`` as a tuple; a plain string (iterable, but not a list of addresses) is refused."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{owner}(server_addresses={value!r}): server_addresses must be a list of 'host:port' strings")
    return tuple(value)
