"""The validated settings of :class:`~lightning_pdist.parameter_server.strategy.ParameterServerStrategy`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_pdist.parameter_server.sharding import SHARDINGS
from lightning_pdist.core.ps_auth import read_secret_file
from lightning_pdist.parameter_server.elastic import default_alpha
from lightning_pdist.parameter_server.server import MAX_PATIENCE, MODES, REPLY_BUFFER_RANGE
from lightning_pdist.core.ps_wire import parse_networks
from lightning_pdist.core.config import ConfigErrors, is_int
from lightning_pdist.core.momentum import IMPLICIT_MOMENTUM

__all__ = ["DEFAULT_CHUNKS_IN_FLIGHT", "DEFAULT_REPLY_BUFFER_BYTES", "ParameterServerConfig"]

#: ``chunks_in_flight``'s default: no cap. Why: capping gave no consistent gain on the benchmark it was made for
#: (docs/benchmarks.md, "Pacing the chunked steps"): 4 workers ran 4% faster with 4 in flight, 8 workers no faster
#: (the three runs' ranges overlap), because the workers' pushes already keep pace (each chunk connection's small send
#: buffer, ``core/ps_client.py``). A cap stays available for links where workers do run ahead of each other.
DEFAULT_CHUNKS_IN_FLIGHT = None

#: ``reply_buffer_bytes``'s default: ``None``, the kernel autotunes each reply socket's send buffer. Why: the one
#: measurement on one machine state (docs/benchmarks.md, "An A/B of the reply buffers at 8 workers") ran chunked
#: steps at 8 workers with autotuned reply buffers at 117.4 samples/s and with 16 KiB ones at 100.0 (0.85x): with
#: many workers per single-threaded server, refilling many small buffers costs the server time the link then waits
#: for. At 4 workers 16 KiB buffers took the chunked steps' shaper drops from 135.2 to 13.6 per step (75% of the
#: bound against 68-69%, runs 3.5 hours apart, not an A/B). A small buffer stays available for such links.
DEFAULT_REPLY_BUFFER_BYTES = None


@dataclass(frozen=True)
class ParameterServerConfig(ConfigErrors):
    """The validated settings of a :class:`ParameterServerStrategy` (see its docstring)."""

    num_servers: int | None = None
    sharding: str = "memory"
    mode: str = "sync"
    staleness: int = 0
    backup_workers: int = 0
    push_every: int = 1
    pull_every: int = 1
    delay_compensation: float = 0.0
    partition_bytes: int | None = None
    server_host: str | None = None
    server_port: int | None = None
    server_addresses: tuple[str, ...] | None = None
    server_secret_file: str | None = None
    allowed_networks: str | None = None
    server_timeout: float = 300.0
    easgd_period: int | None = None
    easgd_alpha: float | None = None
    implicit_momentum: str | None = None
    chunk_bytes: int | None = None
    chunks_in_flight: int | None = DEFAULT_CHUNKS_IN_FLIGHT
    reply_buffer_bytes: int | None = DEFAULT_REPLY_BUFFER_BYTES
    owner: str = "ParameterServerStrategy"

    def __post_init__(self) -> None:
        if self.num_servers is not None:
            if not is_int(self.num_servers):
                self._fail("num_servers", "num_servers must be an int or None", TypeError)
            if self.num_servers < 1:
                self._fail("num_servers", "num_servers must be >= 1 (None: one server per two workers)")
        for arg, choices in (("sharding", SHARDINGS), ("mode", MODES)):
            value = getattr(self, arg)
            if not isinstance(value, str):
                self._fail(arg, f"{arg} must be a str", TypeError)
            if value not in choices:
                self._fail(arg, f"{arg} must be one of {', '.join(map(repr, choices))}")
        for arg in ("staleness", "backup_workers", "push_every", "pull_every"):
            if not is_int(getattr(self, arg)):
                self._fail(arg, f"{arg} must be an int", TypeError)
        if self.staleness < 0:
            self._fail("staleness", "staleness must be >= 0 (0 is bulk-synchronous)")
        if self.staleness > 0 and self.mode != "ssp":
            self._fail("staleness", f"staleness bounds mode='ssp' only; mode is {self.mode!r}")
        if self.backup_workers < 0:
            self._fail("backup_workers", "backup_workers must be >= 0")
        if self.backup_workers > 0 and self.mode != "sync":
            self._fail("backup_workers", f"backup workers are a mode='sync' technique; mode is {self.mode!r}")
        for arg in ("push_every", "pull_every"):
            if getattr(self, arg) < 1:
                self._fail(arg, f"{arg} must be >= 1")
            if getattr(self, arg) != 1 and self.mode != "async":
                self._fail(arg, f"{arg} applies to mode='async' (Downpour); mode is {self.mode!r} "
                                "(for sync, accumulate_grad_batches accumulates gradients)")  # fmt: skip
        dc = self.delay_compensation
        if not isinstance(dc, (int, float)) or isinstance(dc, bool):
            self._fail("delay_compensation", "delay_compensation must be a float", TypeError)
        if not dc >= 0:
            self._fail("delay_compensation", "delay_compensation (DC-ASGD's lambda) must be >= 0")
        if dc > 0 and self.mode == "easgd":
            self._fail("delay_compensation", "delay compensation corrects stale gradients of mode='async' or 'ssp'; "
                                             "mode='easgd' pushes no gradients")  # fmt: skip
        self._check_easgd()
        if self.implicit_momentum not in IMPLICIT_MOMENTUM:
            self._fail("implicit_momentum", "implicit_momentum must be None or 'compensate'")
        if self.implicit_momentum == "compensate" and self.mode != "async":
            self._fail("implicit_momentum", "'compensate' lowers the momentum that asynchronous workers add "
                                            f"(Mitliagkas et al. 2016); mode={self.mode!r} is not mode='async'")  # fmt: skip
        if dc > 0 and self.mode == "sync":
            self._fail("delay_compensation", "delay compensation corrects stale gradients of mode='async' or 'ssp'; "
                                             "sync gradients are never stale")  # fmt: skip
        if self.partition_bytes is not None and self.sharding != "memory":
            self._fail("partition_bytes", "partition_bytes applies to sharding='memory'")
        timeout = self.server_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            self._fail("server_timeout", "server_timeout must be a number of seconds (a bool is not)", TypeError)
        if not (timeout > 0 and math.isfinite(timeout)):
            self._fail("server_timeout", "server_timeout must be a finite number of seconds > 0")
        elif timeout > MAX_PATIENCE:  # a worker's requests carry it as their patience, which servers bound
            self._fail("server_timeout", f"server_timeout must be at most {MAX_PATIENCE:g} seconds (the servers' bound "
                                         "on how long a request may ask them to wait)")  # fmt: skip
        if not (dc < math.inf):
            self._fail("delay_compensation", "delay_compensation must be finite (DC-ASGD's lambda; about 0.04 to start)")
        if self.server_host is not None and (not isinstance(self.server_host, str) or not self.server_host):
            self._fail("server_host", "server_host must be an address string such as '127.0.0.1' or '0.0.0.0', "
                                      "or None (derived from the job)", TypeError)  # fmt: skip
        if self.server_port is not None:
            if not is_int(self.server_port):
                self._fail("server_port", "server_port must be an int (the first port of the servers' range) or None "
                                          "(any free port)", TypeError)  # fmt: skip
            if not 1 <= self.server_port <= 65535:
                self._fail("server_port", "server_port must be in 1..65535 (a node's k-th server binds server_port + k)")
            if self.server_addresses is not None:
                self._fail("server_port", "server_port sets the ports of the servers the strategy starts; servers "
                                          "started elsewhere (server_addresses) have their ports in their addresses")  # fmt: skip
        if self.allowed_networks is not None and not isinstance(self.allowed_networks, str):
            self._fail("allowed_networks", "allowed_networks must be a comma-separated string of address ranges "
                                           "such as '127.0.0.0/8,10.0.0.0/8', or None (derived from the job)",
                       TypeError)  # fmt: skip
        if self.partition_bytes is not None and (not is_int(self.partition_bytes) or self.partition_bytes < 1):
            self._fail("partition_bytes", "partition_bytes must be an int >= 1 (bytes per partition) or None")
        self._check_chunks()
        self._check_reply_buffer()
        if self.server_addresses is not None:
            if not self.server_addresses:
                self._fail("server_addresses", "server_addresses must list at least one 'host:port' (or be None)")
            for address in self.server_addresses:
                host, _, port = str(address).rpartition(":")
                if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                    self._fail("server_addresses", f"{address!r} is not 'host:port' with a port in 1..65535")
            if self.num_servers is not None and self.num_servers != len(self.server_addresses):
                self._fail("num_servers", f"server_addresses lists {len(self.server_addresses)} servers")
        if self.server_secret_file is not None:
            if not isinstance(self.server_secret_file, str):
                self._fail("server_secret_file", "server_secret_file must be a path string (or None)", TypeError)
            if self.server_addresses is None:
                self._fail("server_secret_file", "server_secret_file authenticates servers started by hand and needs "
                                                 "server_addresses; servers the strategy starts get a fresh secret")  # fmt: skip
            try:
                read_secret_file(self.server_secret_file)
            except ValueError as err:
                self._fail("server_secret_file", str(err).partition(": ")[2])
        try:
            parse_networks(self.allowed_networks) if self.allowed_networks is not None else None
        except ValueError as err:  # "allowed_networks='...': rule" -> "Owner(allowed_networks='...'): rule"
            argument, _, rule = str(err).partition(": ")
            raise ValueError(f"{self.owner}({argument}): {rule}") from None

    def _check_chunks(self) -> None:
        """``chunk_bytes``: the memory plan in partitions of that size, each pushed, closed and pulled on its own;
        ``chunks_in_flight``: how many of a worker's chunks per server may await their reply."""
        chunk, window = self.chunk_bytes, self.chunks_in_flight
        if window is not None:
            if not is_int(window):
                self._fail("chunks_in_flight", "chunks_in_flight must be an int (chunks per server awaiting their "
                                               "reply) or None (no cap)", TypeError)  # fmt: skip
            if window < 1:
                self._fail("chunks_in_flight", "chunks_in_flight must be >= 1 (1: each chunk waits for the previous "
                                               "one's reply) or None (no cap)")  # fmt: skip
        if chunk is None:
            if window != DEFAULT_CHUNKS_IN_FLIGHT:
                self._fail("chunks_in_flight", "chunks_in_flight paces chunked steps; it needs chunk_bytes (leave it at "
                                               f"its default, {DEFAULT_CHUNKS_IN_FLIGHT}, without chunk_bytes)")  # fmt: skip
            return
        if not is_int(chunk):
            self._fail("chunk_bytes", "chunk_bytes must be an int (bytes per chunk) or None (unchunked steps)", TypeError)
        if chunk < 8 or chunk % 8:
            self._fail("chunk_bytes", "chunk_bytes must be a multiple of 8 bytes, at least 8 (whole elements of any "
                                      "dtype); 262144 (256 KiB) suits 100 Mbit/s links")  # fmt: skip
        if self.mode != "sync" or self.backup_workers:
            self._fail("chunk_bytes", "chunked steps close each chunk on every worker's push: they need mode='sync' "
                                      f"and backup_workers=0 (mode={self.mode!r}, backup_workers={self.backup_workers})")  # fmt: skip
        if self.sharding != "memory":
            self._fail("chunk_bytes", "chunk_bytes cuts the memory plan into partitions of that size; sharding must "
                                      f"be 'memory', not {self.sharding!r}")  # fmt: skip
        if self.partition_bytes is not None and self.partition_bytes != chunk:
            self._fail("chunk_bytes", f"each chunk is one partition: partition_bytes={self.partition_bytes} must be "
                                      "None or equal to chunk_bytes")  # fmt: skip

    def _check_reply_buffer(self) -> None:
        """``reply_buffer_bytes``: each server's send buffer (``SO_SNDBUF``) on the connections it answers pulls on."""
        value = self.reply_buffer_bytes
        if value is None:
            return
        low, high = REPLY_BUFFER_RANGE
        if not is_int(value):
            self._fail("reply_buffer_bytes", "reply_buffer_bytes must be an int (bytes of a server's send buffer per "
                                             "worker connection) or None (the kernel autotunes it)", TypeError)  # fmt: skip
        if not low <= value <= high:
            self._fail("reply_buffer_bytes", f"reply_buffer_bytes must be in [{low}, {high}] bytes (16384 paces "
                                             "replies on 100 Mbit/s links) or None (the kernel autotunes it)")  # fmt: skip
        if self.mode == "easgd":
            self._fail("reply_buffer_bytes", "reply_buffer_bytes paces the servers' replies to gradient pushes and "
                                             "pulls; mode='easgd' exchanges parameters (leave it None)")  # fmt: skip

    @property
    def plan_partition_bytes(self) -> int | None:
        """The memory plan's partition size: ``partition_bytes``, else ``chunk_bytes`` (one chunk per partition)."""
        return self.partition_bytes if self.partition_bytes is not None else self.chunk_bytes

    def _check_easgd(self) -> None:
        period, alpha = self.easgd_period, self.easgd_alpha
        for arg, value in (("easgd_period", period), ("easgd_alpha", alpha)):
            if value is not None and self.mode != "easgd":
                self._fail(arg, f"{arg} applies to mode='easgd' (asynchronous elastic averaging); mode is {self.mode!r}")
        if period is not None:
            if not is_int(period):
                self._fail("easgd_period", "easgd_period (τ, local steps between elastic exchanges) must be an int "
                                           "or None (4)", TypeError)  # fmt: skip
            if period < 1:
                self._fail("easgd_period", "easgd_period (τ, local steps between elastic exchanges) must be >= 1")
        if alpha is not None:
            if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
                self._fail("easgd_alpha", "easgd_alpha (α) must be a number in (0, 1] or None (0.9 / workers)", TypeError)
            if not 0.0 < alpha <= 1.0:  # NaN fails too
                self._fail("easgd_alpha", "easgd_alpha (α, the elastic coefficient) must be in (0, 1] "
                                          "(None: 0.9 / workers, the paper's β = Nα = 0.9)")  # fmt: skip

    @property
    def period(self) -> int:
        """``τ``: local steps between a worker's elastic exchanges (``mode="easgd"``; default 4)."""
        return self.easgd_period if self.easgd_period is not None else 4

    def alpha_for(self, world_size: int) -> float:
        """``α``: the given one, or ``0.9 / N`` (the paper's ``β = N·α = 0.9``)."""
        return float(self.easgd_alpha) if self.easgd_alpha is not None else default_alpha(world_size)

    @property
    def steps_together(self) -> bool:
        """``sync``: every step is one server step for all workers, so the workers agree on each step's skip."""
        return self.mode == "sync"

    @property
    def lockstep(self) -> bool:
        """``sync`` without backup workers: every worker waits for every other at every step."""
        return self.mode == "sync" and self.backup_workers == 0

    @property
    def drops_late_pushes(self) -> bool:
        """``sync`` with backup workers: the servers drop the gradients that arrive after a step closed."""
        return self.mode == "sync" and self.backup_workers > 0

    def servers_for(self, world_size: int) -> int:
        """``S``: the given number, the listed addresses, or one server per two workers (paper 000)."""
        if self.server_addresses is not None:
            return len(self.server_addresses)
        return self.num_servers if self.num_servers is not None else max(1, math.ceil(world_size / 2))

    def check_port_range(self, servers_per_node: int) -> None:
        """``server_port + servers_per_node - 1`` (the last port a node's servers bind) must be a port."""
        if self.server_port is not None and self.server_port + servers_per_node - 1 > 65535:
            self._fail("server_port", f"{servers_per_node} servers on a node bind ports {self.server_port}.."
                                      f"{self.server_port + servers_per_node - 1}; the last must be <= 65535")  # fmt: skip

    def check_world_size(self, world_size: int) -> None:
        if self.backup_workers >= world_size:
            raise ValueError(
                f"{self.owner}(backup_workers={self.backup_workers}): with {world_size} workers, backup_workers must be "
                f"<= world_size - 1 = {world_size - 1} (a step needs at least one gradient)"
            )
