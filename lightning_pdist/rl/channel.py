"""Messages between the learner (which serves the parameters) and its actors: authenticated, bounded frames.

Each actor opens one connection to the learner's listener (``multiprocessing.connection``, TCP on 127.0.0.1 or
any interface the learner binds): the listener and the client prove knowledge of a random 32-byte secret to each
other (HMAC challenge in both directions) before any message is read. A message is one length-prefixed frame::

    kind: u8 | meta_len: u32 | meta (UTF-8 JSON object) | tensor bytes (raw, in the order meta["tensors"] lists)

Nothing is unpickled: tensors travel as raw bytes described by ``(name, dtype, shape)``, the metadata is JSON. Every
read passes the most bytes that kind may carry (``recv_bytes(maxlength)``: a longer frame is refused before it is
allocated), and the tensor sizes must add up to the frame's length.

These are learner↔actor messages (pull go-aheads, chunks of transitions, crash reports), which the parameter
servers' protocol (``core/ps_wire.py``: shards, pushes, pulls) has no kinds for; Gorila's actors speak that protocol
too, to the servers. This file keeps the same guarantees with the standard library's authenticated connections in
~100 lines. Never imports Lightning (``tests/test_layering.py``).
"""

from __future__ import annotations

import enum
import json
import os
import socket
import struct
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch import Tensor

__all__ = ["FrameError", "Kind", "decode", "encode", "no_delay", "receive", "send"]

_HEADER = struct.Struct("!BI")
MAX_META = 1 << 20
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "uint8": torch.uint8,
           "int32": torch.int32}  # fmt: skip


def no_delay(conn: Connection) -> Connection:
    """Turn off Nagle's algorithm on ``conn``'s TCP socket. ``Connection.send_bytes`` writes a large message as two
    ``send`` calls (length, then body); with Nagle on, the body waits for the peer's delayed ACK of the length:
    ~44 ms per parameter pull here against ~0.1 ms without (measured by the rl benchmark's session)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:  # the option is the socket's, shared by both fds
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


class Kind(enum.IntEnum):
    HELLO = 1  # actor -> learner: {"actor": i, "pid": pid}
    PULL = 2  # actor -> learner: send me the parameters
    PARAMS = 3  # learner -> actor: {"version": v}, tensor "flat" (online then target parameters)
    TRANSITIONS = 4  # actor -> learner: a chunk of transitions, their |δ|, the actor's state, finished episodes
    ERROR = 5  # actor -> learner: {"actor": i, "error": traceback text}; the actor exits next
    STOP = 6  # learner -> actor: exit now


class FrameError(ValueError):
    """A frame that breaks the format (wrong kind, sizes that do not add up, an unknown dtype)."""


def encode(kind: Kind, meta: dict[str, Any] | None = None, tensors: dict[str, Tensor] | None = None) -> bytes:
    tensors = tensors or {}
    described = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors.items()]
    head = json.dumps({**(meta or {}), "tensors": described}).encode()
    payload = b"".join(t.detach().contiguous().cpu().numpy().tobytes() for t in tensors.values())
    return _HEADER.pack(int(kind), len(head)) + head + payload


def decode(frame: bytes, expected: tuple[Kind, ...]) -> tuple[Kind, dict[str, Any], dict[str, Tensor]]:
    if len(frame) < _HEADER.size:
        raise FrameError(f"a frame of {len(frame)} bytes is shorter than its header")
    raw_kind, meta_len = _HEADER.unpack_from(frame)
    if raw_kind not in {int(k) for k in expected}:
        raise FrameError(f"message kind {raw_kind} where {[k.name for k in expected]} was expected")
    if meta_len > MAX_META or _HEADER.size + meta_len > len(frame):
        raise FrameError(f"metadata of {meta_len} bytes in a frame of {len(frame)}")
    meta = json.loads(frame[_HEADER.size:_HEADER.size + meta_len])
    if not isinstance(meta, dict):
        raise FrameError("the metadata is not a JSON object")
    tensors, offset = {}, _HEADER.size + meta_len
    for name, dtype, shape in meta.pop("tensors", []):
        if dtype not in _DTYPES:
            raise FrameError(f"tensor {name!r} has dtype {dtype!r}, not one of {sorted(_DTYPES)}")
        count = 1
        for dim in shape:
            count *= int(dim)
        nbytes = count * torch.empty((), dtype=_DTYPES[dtype]).element_size()
        if offset + nbytes > len(frame):
            raise FrameError(f"tensor {name!r} ({nbytes} bytes) runs past the frame's end")
        buffer = bytearray(frame[offset:offset + nbytes])
        tensors[name] = torch.frombuffer(buffer, dtype=_DTYPES[dtype]).reshape(shape) if nbytes else torch.zeros(shape, dtype=_DTYPES[dtype])
        offset += nbytes
    if offset != len(frame):
        raise FrameError(f"{len(frame) - offset} bytes left over after the frame's tensors")
    return Kind(raw_kind), meta, tensors


def send(conn: Connection, kind: Kind, meta: dict[str, Any] | None = None, tensors: dict[str, Tensor] | None = None) -> None:
    conn.send_bytes(encode(kind, meta, tensors))


def receive(conn: Connection, max_bytes: int, expected: tuple[Kind, ...]) -> tuple[Kind, dict[str, Any], dict[str, Tensor]]:
    """One frame, refused (``OSError``) if longer than ``max_bytes``; ``EOFError`` when the peer is gone."""
    return decode(conn.recv_bytes(max_bytes), expected)
