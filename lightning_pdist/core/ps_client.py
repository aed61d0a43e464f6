"""Worker side of the parameter-server transport: one TCP connection per server, requests in parallel.

Every failure names the server: a server that died closes its sockets, so the next request fails at once
with ``ServerUnavailable("parameter server 1 at 127.0.0.1:40123 closed the connection ...")``; a server
that hangs, or trickles its reply, fails the request ``timeout`` seconds after it was sent (one deadline for the
whole reply, not per byte). Replies are read with the bounded reader of :mod:`~lightning_pdist.core.ps_wire`:
a header declaring more than the peer sends costs nothing, and a garbled reply fails the request, naming the
server. One thread per server sends and then receives, so
a server that is answering another worker never waits on this one (no cycle of full socket buffers).

Waiting requests (``PULL``, ``PUSHPULL``: a sync or SSP server answers them only once the other workers have
pushed) carry the worker's ``timeout`` as their ``patience``: a live server answers by then, naming the workers it
still waits for (:class:`WorkerStalled`: ``worker 1 (pid 4242 on host node3, ...) has not pushed step 17 for 20 s:
it is stopped, hung or dead; parameter server 0 is alive``), so the client waits :data:`WAIT_GRACE` seconds longer
for that answer before it blames the server itself.

Given the servers' shared secret, a connection first answers the server's challenge and checks the server's
proof in turn (:mod:`~lightning_pdist.core.ps_auth`); a wrong secret on either side fails the connection at once,
naming the server. Handshake bytes are not counted in ``bytes_sent``/``bytes_received`` (training traffic only).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch import Tensor

from lightning_pdist.core.ps_auth import CLIENT_LABEL, NONCE_BYTES, SERVER_LABEL, check_secret, new_nonce, proof, verify
from lightning_pdist.core.ps_wire import Kind, PeerClosed, bytes_to_tensor, recv_message, send_message

__all__ = ["WAIT_GRACE", "ParameterServerClient", "ServerConnection", "ServerError", "ServerUnavailable", "WorkerStalled",
           "group_hparams"]

#: Seconds a waiting request's reply may take beyond ``timeout``: the server answers at ``timeout`` when other
#: workers hold it back (naming them); only a server that has not answered by ``timeout + WAIT_GRACE`` is blamed.
WAIT_GRACE = 10.0
#: Send buffer of each chunk connection (bytes; Linux doubles it): see :meth:`ParameterServerClient.open_chunks`.
CHUNK_SEND_BUFFER = 1 << 14
_WAITING_KINDS = (Kind.PULL, Kind.PUSHPULL, Kind.PUSHPULL_CODED, Kind.PUSHPULL_CHUNK, Kind.PULL_ROWS, Kind.SB_OPS)  # SB_OPS: a close waits for portions


class ServerUnavailable(RuntimeError):
    """A parameter server closed the connection, refused it, or did not answer in time."""


class ServerError(RuntimeError):
    """A parameter server answered a request with an error."""


class WorkerStalled(RuntimeError):
    """A live parameter server answered a waiting request: other workers (named) kept it from answering in time."""


class ServerConnection:
    """A connection to parameter server ``index`` at ``address`` (``"host:port"``)."""

    def __init__(self, index: int, address: str, timeout: float = 300.0, connect_timeout: float = 30.0,
                 secret: bytes | None = None, wait_grace: float = WAIT_GRACE):  # fmt: skip
        """Connect to the server (``connect_timeout``: how long a refused connection is retried, in s).

        ``secret``: the servers' shared secret; the connection authenticates before it returns. ``wait_grace``: how
        much longer than ``timeout`` a waiting request waits for the server's answer naming the workers it waits for.
        """
        self.index = index
        self.address = address
        self.timeout = timeout
        self.wait_grace = wait_grace
        self.bytes_sent = 0
        self.bytes_received = 0
        host, _, port = address.rpartition(":")
        # Servers started by hand or by another launcher may still be importing torch: a refused connection
        # is retried until ``connect_timeout``; any other error fails at once.
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=connect_timeout)
                break
            except ConnectionRefusedError as err:
                if time.monotonic() >= deadline:
                    raise ServerUnavailable(
                        f"parameter server {index} at {address}: cannot connect ({err}; retried for {connect_timeout:g} s)"
                    ) from None
                time.sleep(0.1)
            except OSError as err:
                raise ServerUnavailable(f"parameter server {index} at {address}: cannot connect ({err})") from None
        self.sock.settimeout(timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        secret = check_secret(secret, f"ServerConnection(index={index})")
        if secret is not None:
            try:
                self._authenticate(secret, min(timeout, connect_timeout))
            except BaseException:
                self.close()
                raise

    def _authenticate(self, secret: bytes, timeout: float) -> None:
        """Answer the server's challenge, then check its proof of our nonce (``ps_auth``'s exchange)."""
        where = self._where()
        try:
            kind, meta, challenge, _ = recv_message(self.sock, timeout=timeout, payload_limit=lambda k: NONCE_BYTES)
            if kind == Kind.ERROR:  # refused before any handshake, e.g. this worker's address is not allowed
                raise ServerUnavailable(f"{where} refused this worker: {str(meta.get('message', '?'))[:300]} (the "
                                        "servers' allowed_networks must include every worker's address)")  # fmt: skip
            if kind != Kind.CHALLENGE or len(challenge) != NONCE_BYTES:
                raise ServerUnavailable(f"{where} sent {kind.name} instead of an authentication challenge; is it a "
                                        "lightning_pdist parameter server started with the same secret?")  # fmt: skip
            nonce = new_nonce()
            send_message(self.sock, Kind.AUTH, {"nonce": nonce.hex()}, proof(secret, bytes(challenge), CLIENT_LABEL))
            kind, meta, _, _ = recv_message(self.sock, timeout=timeout, payload_limit=lambda k: 0)
        except TimeoutError:
            raise ServerUnavailable(f"{where} did not complete authentication within {timeout:g} s (a server started "
                                    "without a secret sends no challenge: start it with --secret-file)") from None  # fmt: skip
        except (PeerClosed, OSError, ValueError) as err:
            raise ServerUnavailable(f"{where} closed the connection during authentication ({err})") from None
        if kind == Kind.ERROR:
            raise ServerUnavailable(f"{where} refused authentication: {meta.get('message', '?')}")
        server_proof = meta.get("proof")
        try:
            received = bytes.fromhex(server_proof) if isinstance(server_proof, str) else b""
        except ValueError:
            received = b""
        if kind != Kind.REPLY or not verify(secret, nonce, SERVER_LABEL, received):
            raise ServerUnavailable(f"{where} could not prove it holds the shared secret; not connecting to it "
                                    "(another process may have taken over the server's port)")  # fmt: skip

    def _where(self) -> str:
        return f"parameter server {self.index} at {self.address}"

    def send(self, kind: Kind, meta: dict | None = None, payload: Any = None) -> None:
        try:
            self.bytes_sent += send_message(self.sock, kind, meta, payload)
        except OSError as err:
            raise ServerUnavailable(f"{self._where()} is gone: sending {kind.name} failed ({err})") from None

    def request(self, kind: Kind, meta: dict | None = None, payload: Any = None) -> tuple[dict, bytearray]:
        """Send one request and wait for its reply: ``(meta, payload)``."""
        if kind in _WAITING_KINDS:  # the server answers by then, naming the workers it waits for, if any hold it back
            meta = {**(meta or {}), "patience": self.timeout}
        self.send(kind, meta, payload)
        return self.receive(kind)

    def receive(self, kind: Kind) -> tuple[dict, bytearray]:
        """Wait for the reply to the ``kind`` request sent last on this connection: ``(meta, payload)``."""
        waits = kind in _WAITING_KINDS
        limit = self.timeout + self.wait_grace if waits else self.timeout
        try:
            reply, meta_in, payload_in, nbytes = recv_message(self.sock, timeout=limit)  # whole reply
        except (PeerClosed, ConnectionResetError, BrokenPipeError):
            raise ServerUnavailable(f"{self._where()} closed the connection (it exited or crashed) during {kind.name}") from None
        except TimeoutError:
            hint = (f"; a live server answers a waiting request after {self.timeout:g} s, naming the workers it waits "
                    "for, so this server is stopped, hung or unreachable (or its host is overloaded)" if waits else "")  # fmt: skip
            within = f"{limit:g} s{hint}" if waits else f"server_timeout={limit:g} s"  # the setting every PS strategy names
            raise ServerUnavailable(f"{self._where()} did not answer {kind.name} within {within}") from None
        except (OSError, ValueError) as err:
            raise ServerUnavailable(f"{self._where()} failed during {kind.name}: {err}") from None
        self.bytes_received += nbytes
        if reply == Kind.CHALLENGE:
            raise ServerError(f"{self._where()} requires authentication (it was started with a secret); pass the same "
                              "secret (strategy: server_secret_file) to connect")  # fmt: skip
        if reply == Kind.ERROR and waits and "stalled" in meta_in:
            raise WorkerStalled(f"{kind.name} to {self._where()}: {meta_in.get('message', '?')}. Look at the worker(s) "
                                f"named; if only slow, raise the timeout (server_timeout, now {self.timeout:g} s)")  # fmt: skip
        if reply == Kind.ERROR:
            raise ServerError(f"{self._where()} refused {kind.name}: {meta_in.get('message', '?')}")
        return meta_in, payload_in

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class ParameterServerClient:
    """Connections from one worker to every server, and the exchanges a training step needs.

    Args:
        addresses: ``"host:port"`` of server 0, 1, ...
        worker: this worker's index in ``[0, num_workers)``.
        timeout: seconds a request may wait for its reply (a sync step waits for the slowest worker).
        secret: the servers' shared secret (``None``: servers without authentication).
        wait_grace: how much longer than ``timeout`` a waiting request waits for a server's answer.
    """

    def __init__(self, addresses: list[str], worker: int, timeout: float = 300.0, secret: bytes | None = None,
                 wait_grace: float = WAIT_GRACE):  # fmt: skip
        self.worker = worker
        self.connections: list[ServerConnection] = []
        try:
            for index, address in enumerate(addresses):
                self.connections.append(ServerConnection(index, address, timeout=timeout, secret=secret, wait_grace=wait_grace))
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(max_workers=len(addresses), thread_name_prefix="pdist-ps-client") if len(addresses) > 1 else None
        self.last_wait_s = 0.0
        self.chunk_connections: list[list[ServerConnection]] = [[] for _ in addresses]  # open_chunks: per server
        self._chunk_pool: ThreadPoolExecutor | None = None
        self._addresses, self._timeout, self._secret, self._wait_grace = list(addresses), timeout, secret, wait_grace

    @property
    def bytes_sent(self) -> int:
        """Training bytes sent on every connection (the chunk connections included)."""
        return sum(c.bytes_sent for c in self.connections) + sum(c.bytes_sent for cs in self.chunk_connections for c in cs)

    def open_chunks(self, counts: list[int]) -> None:
        """One more connection per chunk of each server (``counts[s]`` chunks), each said HELLO as this worker.

        Chunk ``j`` of a step always travels on connection ``j``: a server answers each connection's requests one at
        a time, so chunk ``j``'s pull can come back while chunk ``j + 1``'s push is still going out on another.
        """
        meta = self._hello_meta()
        try:
            for server, count in enumerate(counts):
                for _ in range(count - len(self.chunk_connections[server])):
                    connection = ServerConnection(server, self._addresses[server], timeout=self._timeout,
                                                  secret=self._secret, wait_grace=self._wait_grace)  # fmt: skip
                    # A small send buffer keeps chunks in order on the wire: sendall of chunk j returns only when
                    # all but CHUNK_SEND_BUFFER of it left, so chunk j + 1 does not share the link with all of chunk j
                    # (an autotuned buffer grows to megabytes behind a queueing link and sends every chunk at once).
                    connection.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CHUNK_SEND_BUFFER)
                    self.chunk_connections[server].append(connection)
                    connection.request(Kind.HELLO, meta)
        except BaseException:
            self.abort()
            raise
        if self._chunk_pool is None:
            self._chunk_pool = ThreadPoolExecutor(max_workers=2 * len(counts), thread_name_prefix="pdist-ps-chunks")

    def pushpull_chunks(self, metas: list[dict], payloads: list[list[Any]],
                        in_flight: int | None = None) -> list[list[tuple[dict, bytearray]]]:  # fmt: skip
        """Server ``s``'s chunk ``j``: ``metas[s]`` with ``"chunk": j`` and ``payloads[s][j]``; the replies, per server.

        Per server one thread sends the chunks in order while another reads their replies in order, so the pulls of
        early chunks come back while later chunks are still being pushed (:meth:`open_chunks` first).

        ``in_flight = m`` paces the pushes: chunk ``j`` of a server is sent only once the reply to chunk ``j - m``
        came back, so at most ``m`` of this worker's chunks per server are pushed and not yet answered. A server
        answers chunk ``j`` once every worker pushed it, so no worker runs more than ``m`` chunks ahead of the
        slowest: the workers push the same chunks at the same time, each chunk closes as its last push arrives
        (pulls follow pushes evenly instead of in a burst at the step's end), and a server's link holds at most
        ``W·m`` chunks of pushes. ``None``: no cap (each worker pushes as fast as its link takes the chunks).
        """
        start = time.perf_counter()
        slots = [threading.Semaphore(in_flight) if in_flight else None for _ in range(self.num_servers)]
        failed = threading.Event()

        def send(server: int) -> None:
            for j, (connection, payload) in enumerate(zip(self.chunk_connections[server], payloads[server])):
                if slots[server] is not None:
                    slots[server].acquire()
                    if failed.is_set():
                        return
                connection.send(Kind.PUSHPULL_CHUNK, {**metas[server], "chunk": j, "patience": self._timeout}, payload)

        def receive(server: int) -> list[tuple[dict, bytearray]]:
            replies = []
            try:
                for connection in self.chunk_connections[server][: len(payloads[server])]:
                    replies.append(connection.receive(Kind.PUSHPULL_CHUNK))
                    if slots[server] is not None:
                        slots[server].release()
            except BaseException:
                failed.set()  # a sender waiting for this reply's slot stops instead of waiting forever
                for slot in slots:
                    if slot is not None:
                        slot.release(max(map(len, payloads)) + 1)
                raise
            return replies

        try:
            senders = [self._chunk_pool.submit(send, s) for s in range(self.num_servers)]
            receivers = [self._chunk_pool.submit(receive, s) for s in range(self.num_servers)]
            for future in senders:
                future.result()
            results = [f.result() for f in receivers]
        except BaseException:
            self.abort()
            raise
        self.last_wait_s = time.perf_counter() - start
        return results

    @property
    def num_servers(self) -> int:
        return len(self.connections)

    def map(self, kind: Kind, metas: list[dict], payloads: list[Any] | None = None) -> list[tuple[dict, bytearray]]:
        """One request per server, in parallel; returns the replies in server order.

        The time from the first send to the last reply is kept in :attr:`last_wait_s` (for sync
        training it includes waiting for the other workers).
        """
        payloads = payloads if payloads is not None else [None] * len(self.connections)
        start = time.perf_counter()
        try:
            if self._pool is None:
                results = [c.request(kind, m, p) for c, m, p in zip(self.connections, metas, payloads)]
            else:
                futures = [self._pool.submit(c.request, kind, m, p) for c, m, p in zip(self.connections, metas, payloads)]
                results = [f.result() for f in futures]  # re-raises the first failure (lowest server index)
        except BaseException:
            # A failed exchange is fatal: wake any thread still blocked on another server, so that the
            # process can exit at once instead of after that server's timeout.
            self.abort()
            raise
        self.last_wait_s = time.perf_counter() - start
        return results

    def abort(self) -> None:
        """Shut every connection down (unblocks threads waiting on a reply); the client is unusable after."""
        for connection in [*self.connections, *(c for cs in self.chunk_connections for c in cs)]:
            try:
                connection.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def hello(self) -> list[dict]:
        """Register with every server, telling it this process's pid and host (named if this worker stalls)."""
        return [meta for meta, _ in self.map(Kind.HELLO, [self._hello_meta()] * self.num_servers)]

    def _hello_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"worker": self.worker, "pid": os.getpid()}
        host = socket.gethostname()
        if 0 < len(host) <= 255 and host.isascii() and host.isprintable():
            meta["host"] = host
        return meta

    def pull(self, wait_version: int | None = None, record: bool = True) -> tuple[list[Tensor], list[dict]]:
        """Every server's shard (tensors over the received bytes) and reply metadata."""
        meta = {"worker": self.worker, "wait_version": wait_version, "record": record}
        replies = self.map(Kind.PULL, [meta] * self.num_servers)
        return [bytes_to_tensor(p, m["dtype"]) for m, p in replies], [m for m, _ in replies]

    def push(self, shards: list[Tensor | bytes], versions: list[int], hparams: list[dict], pull: bool = False,
             extras: list[dict] | None = None, coded: bool = False):  # fmt: skip
        """Push a gradient shard to every server; with ``pull`` also get the new shards back (one round trip).

        ``versions[s]`` is the version of server ``s``'s shard the gradient was computed on (the step id
        that synchronous servers drop late gradients by). ``extras[s]`` is merged into server ``s``'s request
        (``optimizer``: which user optimizer stepped, ``present``: which of its pieces the payload holds; see
        :mod:`lightning_pdist.parameter_server.shard`). With ``coded``, each of ``shards`` is the bytes of one
        compressed tensor per present piece (:mod:`lightning_pdist.core.push_codec`), sent as ``PUSH_CODED``.
        Returns ``(shards or None, reply metas)``.
        """
        extras = extras if extras is not None else [{}] * len(versions)
        metas = [{"worker": self.worker, "version": v, "hparams": hparams, **e} for v, e in zip(versions, extras)]
        kinds = (Kind.PUSHPULL_CODED, Kind.PUSH_CODED) if coded else (Kind.PUSHPULL, Kind.PUSH)
        replies = self.map(kinds[0] if pull else kinds[1], metas, shards)
        metas = [m for m, _ in replies]
        if not pull:
            return None, metas
        return [bytes_to_tensor(p, m["dtype"]) for m, p in replies], metas

    def elastic(self, shards: list[Tensor]) -> tuple[list[Tensor], list[dict]]:
        """One elastic exchange with every server (``mode="easgd"``): send ``x_i``'s shards, get each ``e = α(x_i − x̃)``.

        Each server has already added its ``e`` to its center when it answers; the caller subtracts the same ``e``.
        """
        replies = self.map(Kind.ELASTIC, [{"worker": self.worker}] * self.num_servers, shards)
        return [bytes_to_tensor(p, m["dtype"]) for m, p in replies], [m for m, _ in replies]

    def bye(self) -> None:
        for connection in self.connections:
            try:
                connection.send(Kind.BYE, {"worker": self.worker})
            except ServerUnavailable:
                pass

    def close(self) -> None:
        for connection in [*self.connections, *(c for cs in getattr(self, "chunk_connections", []) for c in cs)]:
            connection.close()
        for pool in (getattr(self, "_pool", None), getattr(self, "_chunk_pool", None)):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)


def group_hparams(group: dict, where: str) -> dict:
    """A param group's hyperparameters as the servers rebuild the optimizer from them (JSON values only)."""
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, tuple):
            value = list(value)
        if value is None or isinstance(value, (bool, int, float, str)) or (
            isinstance(value, list) and all(isinstance(v, (int, float)) for v in value)
        ):
            out[key] = value
        else:
            raise TypeError(
                f"{where} has {key}={value!r}; the servers rebuild the optimizer from numbers, strings and booleans only"
            )
    return out
