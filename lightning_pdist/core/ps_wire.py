"""Wire format of the parameter-server transport: framed messages over plain TCP sockets.

A message is a fixed header, a JSON metadata object and an optional raw payload::

    b"PDPS" | kind: u8 | meta_len: u32 | payload_len: u64 | meta (UTF-8 JSON) | payload (raw bytes)

Tensors travel as their raw little-endian bytes (``meta["dtype"]`` names the dtype), so a 100 MB shard
costs one ``sendall`` and one ``recv_into``, with no pickling. Nothing received is ever unpickled: the
metadata is JSON and whole-state transfers (checkpoints) use ``torch.load(weights_only=True)``, so a
peer can at worst send wrong numbers, not run code. A server with a shared secret first authenticates
every connection (``CHALLENGE``/``AUTH``, :mod:`lightning_pdist.core.ps_auth`); nothing is encrypted
(``docs/algorithms/parameter_server.md``, trust model): run it inside a trusted cluster network.

Reading is bounded before it allocates (``docs/algorithms/parameter_server.md``, hostile and broken peers):
the header is checked first (magic, a known kind, metadata at most :data:`MAX_META` bytes for ``INIT`` and
:data:`MAX_REQUEST_META` for everything else, a payload no larger than what the receiver says that kind can
carry), the JSON must be an object nested at most :data:`MAX_DEPTH` deep, and a payload buffer grows with the
bytes that actually arrived (at most doubling), never to what the header declares. :class:`FrameReader` does
this incrementally for the server's non-blocking sockets; :func:`recv_message` drives the same reader on a
blocking socket with one deadline for the whole message.

Why plain TCP and not gloo or RPC (``machine-and-network.md`` §2, ``lightning-integration.md`` §0.3):

* it is independent of ``torch.distributed``'s default group, so asynchronous workers are not held
  in lockstep by Lightning's per-batch broadcast on that group;
* it is always TCP, so ``tc`` rate limits apply (TensorPipe RPC silently uses shared memory/CMA);
* a peer that dies closes its sockets, so the other side sees EOF at once and can say *which* server
  or worker is gone, instead of waiting out a collective timeout;
* servers take requests in arrival order from any worker, which is what async/SSP/backup workers need.

Never imports Lightning (``tests/test_layering.py``).
"""

from __future__ import annotations

import enum
import io
import ipaddress
import json
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "HEADER",
    "FrameError",
    "FrameReader",
    "Kind",
    "MAX_DEPTH",
    "MAX_META",
    "MAX_REQUEST_META",
    "PeerClosed",
    "address_allowed",
    "CODED",
    "bytes_to_tensor",
    "coded_payload_limit",
    "decode_meta",
    "dumps_state",
    "encode_message",
    "loads_state",
    "parse_networks",
    "recv_message",
    "send_message",
    "tensor_bytes",
]

MAGIC = b"PDPS"
HEADER = struct.Struct("!4sBIQ")  # magic, kind, meta_len, payload_len
MAX_META = 1 << 24  # INIT (segments, param groups): 16 MiB of JSON is far beyond any legitimate request
MAX_REQUEST_META = 1 << 20  # every other kind: a push's hparams and present flags, 1 MiB is ample
MAX_DEPTH = 32  # JSON nesting; a real request nests 5 deep ({"optimizers": [{"param_groups": [{"betas": [..]}]}]})
_FIRST_CHUNK = 1 << 20  # a payload buffer starts at this size and at most doubles with the bytes that arrived


class Kind(enum.IntEnum):
    """Message kinds. Every request gets exactly one ``REPLY`` or ``ERROR``."""

    HELLO = 1  # worker -> server: {"worker"}; registers the connection
    INIT = 2  # rank 0 -> server: configuration + initial shard (payload)
    PUSH = 3  # worker -> server: gradient shard (payload), {"worker", "version", "hparams"}
    PULL = 4  # worker -> server: {"worker", "wait_version", "record"}; reply payload = shard
    PUSHPULL = 5  # PUSH then PULL in one round trip
    GET_STATE = 6  # rank 0 -> server: reply payload = torch.save bytes of the shard's full state
    SET_STATE = 7  # rank 0 -> server: payload = torch.save bytes (resume)
    SHUTDOWN = 8  # rank 0 -> server: reply, then the server exits
    BYE = 9  # worker -> server: this worker is done (no reply)
    CHALLENGE = 10  # server -> client, first on a connection to a server with a secret: payload = nonce
    AUTH = 11  # client -> server, the answer: payload = HMAC proof, {"nonce"}; reply {"proof"} (core/ps_auth.py)
    ELASTIC = 12  # worker -> server, mode="easgd": payload = its x_i shard; reply payload = e = α(x_i − x̃) (elastic.py)
    PUSH_CODED = 13  # PUSH whose payload is one compressed tensor per present piece (core/push_codec.py), in shard order
    PUSHPULL_CODED = 14  # PUSHPULL with that payload
    PUSHPULL_CHUNK = 15  # sync with chunk_bytes: {"chunk": j, ...} + chunk j's part of a compact push; reply = x[a_j:b_j]
    PUSH_ROWS = 30  # worker -> server, mode="parallax": touched rows of the sparse tables + their gradients (parallax_rows.py)
    PULL_ROWS = 31  # worker -> server, mode="parallax": rows wanted; reply payload = their values once the step closed
    SB_CLAIM = 40  # worker -> server 0, Sandblaster: the next portion of a step (sandblaster_server.py)
    SB_GRAD = 41  # worker -> server, Sandblaster: payload = this shard of one portion's gradient
    SB_OPS = 42  # coordinator -> server, Sandblaster: vector commands on the shard; reply = their scalars
    REPLY = 20
    ERROR = 21


_KINDS = frozenset(int(k) for k in Kind)
#: The compressed push kinds and the plain kinds whose semantics they share.
CODED = {Kind.PUSH_CODED: Kind.PUSH, Kind.PUSHPULL_CODED: Kind.PUSHPULL}


def coded_payload_limit(numel: int, pieces: int) -> int:
    """The most bytes a compressed push of ``numel`` elements in ``pieces`` pieces can need (any form).

    Per piece of ``d`` elements: a sparse push with ``k = d`` is 10 header bytes, the coded indices (Zstandard's
    bound on ``4d`` bytes: ``4d + 4d/128 + 64``) and ``4d`` value bytes; a levels or dense push needs less.
    """
    return 9 * numel + 128 * pieces + 4096


class PeerClosed(ConnectionError):
    """The other end closed the connection (it exited, crashed, or shut down)."""


class FrameError(ValueError):
    """The bytes received are not an acceptable message; the connection cannot go on (close it)."""


def encode_message(kind: Kind, meta: dict[str, Any] | None = None, payload: Any = None) -> tuple[bytes, memoryview]:
    """``(header + metadata, payload view)`` of one message; ``payload`` is ``None``, ``bytes``-like or a CPU tensor."""
    meta_bytes = json.dumps(meta or {}, separators=(",", ":")).encode()
    if isinstance(payload, Tensor):
        payload = tensor_bytes(payload)
    body = memoryview(payload if payload is not None else b"").cast("B")
    return HEADER.pack(MAGIC, int(kind), len(meta_bytes), body.nbytes) + meta_bytes, body


def send_message(sock: socket.socket, kind: Kind, meta: dict[str, Any] | None = None, payload: Any = None) -> int:
    """Send one message on a blocking socket. Returns bytes sent."""
    head, body = encode_message(kind, meta, payload)
    sock.sendall(head)
    if body.nbytes:
        sock.sendall(body)
    return len(head) + body.nbytes


def decode_meta(meta_bytes: bytes | bytearray, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """Parse a message's JSON metadata: an object nested at most ``max_depth`` deep, else :class:`FrameError`."""
    if not meta_bytes:
        return {}
    try:
        meta = json.loads(meta_bytes)
    except RecursionError:  # the C parser stops at the interpreter's recursion limit
        raise FrameError(f"metadata nests deeper than {max_depth} levels") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, int digits limit
        raise FrameError(f"metadata is not JSON ({type(err).__name__}: {str(err)[:200]})") from None
    if not isinstance(meta, dict):
        raise FrameError(f"metadata must be a JSON object, got {type(meta).__name__}")
    stack = [(meta, 1)]  # iterative: the depth check itself must not recurse
    while stack:
        value, depth = stack.pop()
        if depth > max_depth:
            raise FrameError(f"metadata nests deeper than {max_depth} levels")
        children = value.values() if isinstance(value, dict) else value
        stack.extend((v, depth + 1) for v in children if isinstance(v, (dict, list)))
    return meta


class FrameReader:
    """Incremental, bounded decoder of one connection's messages (non-blocking or blocking sockets).

    Args:
        payload_limit: ``payload_limit(kind) -> int``, the most payload bytes a message of ``kind`` may
            carry; checked on the header, before anything is allocated for the payload.
        chunk: the most bytes one :meth:`read` takes from the socket (fairness between connections).

    :meth:`read` raises :class:`FrameError` for a bad header, oversized metadata or payload, or bad JSON;
    :attr:`started` is true from a message's first byte until it is complete (deadlines run on that).
    """

    def __init__(self, payload_limit: Any = None, chunk: int = 1 << 22):
        self.payload_limit = payload_limit
        self.chunk = chunk
        self._reset()

    def _reset(self) -> None:
        self._head = bytearray(HEADER.size)
        self._got = 0  # bytes of the current stage received
        self._stage = "head"
        self._kind = Kind.ERROR
        self._meta = bytearray()
        self._payload = bytearray()
        self._payload_len = 0

    @property
    def started(self) -> bool:
        return self._stage != "head" or self._got > 0

    def _check_header(self) -> None:
        magic, kind, meta_len, payload_len = HEADER.unpack(self._head)
        if magic != MAGIC or kind not in _KINDS:
            raise FrameError(f"not a lightning_pdist parameter-server message (header {bytes(self._head)!r})")
        self._kind = Kind(kind)
        meta_limit = MAX_META if self._kind == Kind.INIT else MAX_REQUEST_META
        if meta_len > meta_limit:
            raise FrameError(f"{self._kind.name} declares meta_len={meta_len}; the limit is {meta_limit} bytes")
        limit = self.payload_limit(self._kind) if self.payload_limit is not None else None
        if limit is not None and payload_len > limit:
            raise FrameError(f"{self._kind.name} declares payload_len={payload_len}; this receiver takes at most "
                             f"{limit} bytes for {self._kind.name}")  # fmt: skip
        self._meta = bytearray(meta_len)  # at most MAX_META
        self._payload_len = payload_len
        self._stage, self._got = "meta", 0

    def _buffer(self) -> memoryview:
        """Where the next bytes go: the rest of the header, of the metadata, or of the (growing) payload."""
        if self._stage == "head":
            return memoryview(self._head)[self._got :]
        if self._stage == "meta":
            return memoryview(self._meta)[self._got :]
        if self._got == len(self._payload):  # grow with what arrived, never to what was declared
            size = min(self._payload_len, max(_FIRST_CHUNK, 2 * len(self._payload)))
            self._payload.extend(bytes(size - len(self._payload)))
        return memoryview(self._payload)[self._got :]

    def _advance(self) -> tuple[Kind, dict[str, Any], bytearray, int] | None:
        """Move to the next stage where the current one is complete; the message once all of it is there."""
        while True:
            if self._stage == "head":
                if self._got < HEADER.size:
                    return None
                self._check_header()
            elif self._stage == "meta":
                if self._got < len(self._meta):
                    return None
                self._stage, self._got = "payload", 0
            else:
                if self._got < self._payload_len:
                    return None
                kind, payload = self._kind, self._payload
                nbytes = HEADER.size + len(self._meta) + self._payload_len
                meta = decode_meta(self._meta)
                self._reset()
                return kind, meta, payload, nbytes

    def read(self, sock: socket.socket) -> tuple[Kind, dict[str, Any], bytearray, int] | None:
        """Read what the socket has (at most :attr:`chunk` bytes, at most one message); the message if complete.

        Raises:
            PeerClosed: EOF.
            BlockingIOError: nothing to read on a non-blocking socket.
            FrameError: the message is not acceptable.
        """
        taken = 0
        while True:
            message = self._advance()
            if message is not None or taken >= self.chunk:
                return message
            whole = self._buffer()
            view = whole[: self.chunk - taken] if whole.nbytes > self.chunk - taken else whole
            if view is not whole:
                whole.release()
            try:
                n = sock.recv_into(view)
            except BlockingIOError:
                if taken:
                    return None
                raise
            finally:
                view.release()  # the payload buffer may grow next: no export may be alive then
            if n == 0:
                raise PeerClosed("connection closed by peer")
            self._got += n
            taken += n


def recv_message(sock: socket.socket, timeout: float | None = None, payload_limit: Any = None) -> tuple[Kind, dict[str, Any], bytearray, int]:
    """Receive one message on a blocking socket: ``(kind, meta, payload, bytes received)``.

    ``timeout``: seconds for the whole message (not per byte; ``None``: the socket's own timeout per read).

    Raises:
        PeerClosed: the peer closed the connection.
        TimeoutError: the message did not arrive in time.
        FrameError: the bytes are not an acceptable message of this protocol (a ``ValueError``).
    """
    reader = FrameReader(payload_limit)
    deadline = None if timeout is None else time.monotonic() + timeout
    previous = sock.gettimeout()
    try:
        while True:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no whole message within {timeout:g} s")
                sock.settimeout(left)
            message = reader.read(sock)
            if message is not None:
                return message
    finally:
        if deadline is not None:
            sock.settimeout(previous)


def tensor_bytes(tensor: Tensor) -> memoryview:
    """The raw bytes of a CPU tensor (flattened, contiguous), without a copy when possible."""
    flat = tensor.detach().reshape(-1).contiguous()
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def bytes_to_tensor(payload: bytearray, dtype: str) -> Tensor:
    """A 1-D tensor over ``payload`` (no copy), ``dtype`` as ``str(torch.float32)`` names it."""
    torch_dtype = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else None
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"bytes_to_tensor(dtype={dtype!r}): not a torch dtype")
    itemsize = torch.empty(0, dtype=torch_dtype).element_size()
    if len(payload) % itemsize:
        raise ValueError(f"bytes_to_tensor(dtype={dtype!r}): a payload of {len(payload)} bytes is not a whole number "
                         f"of {itemsize}-byte elements")  # fmt: skip
    if not payload:
        return torch.zeros(0, dtype=torch_dtype)
    return torch.frombuffer(payload, dtype=torch_dtype)


def dumps_state(state: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def loads_state(payload: bytes | bytearray) -> Any:
    # weights_only: tensors, numbers, strings and containers only; never arbitrary pickled objects.
    return torch.load(io.BytesIO(bytes(payload)), weights_only=True)


def parse_networks(networks: str | Sequence[str]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """``"127.0.0.0/8,10.1.0.0/16"`` or a list of CIDR strings -> networks (ValueError echoes the bad one)."""
    items = [n.strip() for n in networks.split(",")] if isinstance(networks, str) else list(networks)
    out = []
    for item in items:
        if not item:
            continue
        try:
            out.append(ipaddress.ip_network(item, strict=False))
        except ValueError as err:
            raise ValueError(f"allowed_networks={networks!r}: {item!r} is not an address range ({err})") from None
    if not out:
        raise ValueError(f"allowed_networks={networks!r}: at least one address range is required")
    return tuple(out)


def address_allowed(host: str, networks: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> bool:
    """Whether a peer address lies in one of ``networks`` (IPv4-mapped IPv6 counts as IPv4)."""
    address = ipaddress.ip_address(host)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return any(address.version == net.version and address in net for net in networks)
