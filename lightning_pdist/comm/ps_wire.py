"""Wire format of the parameter-server transport: framed messages over plain TCP sockets.

A message is a fixed header, a JSON metadata object and an optional raw payload::

    b"PDPS" | kind: u8 | meta_len: u32 | payload_len: u64 | meta (UTF-8 JSON) | payload (raw bytes)

Tensors travel as their raw little-endian bytes (``meta["dtype"]`` names the dtype), so a 100 MB shard
costs one ``sendall`` and one ``recv_into``, with no pickling. Nothing received is ever unpickled: the
metadata is JSON and whole-state transfers (checkpoints) use ``torch.load(weights_only=True)``, so a
peer can at worst send wrong numbers, not run code. The transport still has no authentication (see
``docs/algorithms/parameter_server.md``, trust model): run it inside a trusted cluster network.

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
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "HEADER",
    "Kind",
    "PeerClosed",
    "address_allowed",
    "bytes_to_tensor",
    "dumps_state",
    "loads_state",
    "parse_networks",
    "recv_message",
    "send_message",
    "tensor_bytes",
]

MAGIC = b"PDPS"
HEADER = struct.Struct("!4sBIQ")  # magic, kind, meta_len, payload_len
MAX_META = 1 << 24  # 16 MiB of JSON is far beyond any legitimate request


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
    REPLY = 20
    ERROR = 21


class PeerClosed(ConnectionError):
    """The other end closed the connection (it exited, crashed, or shut down)."""


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise PeerClosed("connection closed by peer")
        view = view[n:]


def send_message(sock: socket.socket, kind: Kind, meta: dict[str, Any] | None = None, payload: Any = None) -> int:
    """Send one message; ``payload`` is ``None``, ``bytes``-like or a CPU tensor. Returns bytes sent."""
    meta_bytes = json.dumps(meta or {}, separators=(",", ":")).encode()
    if isinstance(payload, Tensor):
        payload = tensor_bytes(payload)
    body = memoryview(payload if payload is not None else b"").cast("B")
    sock.sendall(HEADER.pack(MAGIC, int(kind), len(meta_bytes), body.nbytes) + meta_bytes)
    if body.nbytes:
        sock.sendall(body)
    return HEADER.size + len(meta_bytes) + body.nbytes


def recv_message(sock: socket.socket) -> tuple[Kind, dict[str, Any], bytearray, int]:
    """Receive one message: ``(kind, meta, payload, bytes received)``.

    Raises:
        PeerClosed: the peer closed the connection.
        ValueError: the bytes are not a message of this protocol.
    """
    head = bytearray(HEADER.size)
    _recv_exact(sock, memoryview(head))
    magic, kind, meta_len, payload_len = HEADER.unpack(head)
    if magic != MAGIC or meta_len > MAX_META:
        raise ValueError(f"recv_message: not a lightning_pdist parameter-server message (header {bytes(head)!r})")
    meta_bytes = bytearray(meta_len)
    _recv_exact(sock, memoryview(meta_bytes))
    payload = bytearray(payload_len)
    if payload_len:
        _recv_exact(sock, memoryview(payload))
    return Kind(kind), json.loads(meta_bytes) if meta_len else {}, payload, HEADER.size + meta_len + payload_len


def tensor_bytes(tensor: Tensor) -> memoryview:
    """The raw bytes of a CPU tensor (flattened, contiguous), without a copy when possible."""
    flat = tensor.detach().reshape(-1).contiguous()
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def bytes_to_tensor(payload: bytearray, dtype: str) -> Tensor:
    """A 1-D tensor over ``payload`` (no copy), ``dtype`` as ``str(torch.float32)`` names it."""
    torch_dtype = getattr(torch, dtype.removeprefix("torch."))
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"bytes_to_tensor(dtype={dtype!r}): not a torch dtype")
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
