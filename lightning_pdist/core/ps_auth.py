"""Peer authentication of the parameter-server transport: a shared secret, a challenge, HMAC-SHA256 proofs.

Every new connection to a server that holds a secret starts with this exchange, before any other message::

    server -> client   CHALLENGE  payload = server nonce (32 random bytes)
    client -> server   AUTH       payload = HMAC(secret, server nonce || CLIENT_LABEL), meta {"nonce": client nonce (hex)}
    server -> client   REPLY      meta {"proof": HMAC(secret, client nonce || SERVER_LABEL) (hex)}

The server compares with :func:`hmac.compare_digest` and closes a connection that sends anything else first,
a wrong proof, or nothing within ``handshake_timeout``; the client checks the server's proof too, so a process
that took over a dead server's port cannot feed workers parameters. The two labels differ, so a proof seen in
one direction cannot be replayed in the other; fresh nonces on both sides make recorded proofs worthless.

This authenticates, it does not encrypt: a network observer still reads gradients and parameters.
Never imports Lightning (``tests/test_layering.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

__all__ = [
    "CLIENT_LABEL",
    "NONCE_BYTES",
    "PROOF_BYTES",
    "SECRET_BYTES",
    "SERVER_LABEL",
    "check_secret",
    "new_nonce",
    "new_secret",
    "proof",
    "read_secret_file",
    "verify",
]

SECRET_BYTES = 32  # what the strategy generates, and the least a secret file must hold
MAX_SECRET_FILE_BYTES = 4096  # a secret file is a key, not a data file: read no more
NONCE_BYTES = 32
PROOF_BYTES = 32  # SHA-256 digest
CLIENT_LABEL = b"lightning_pdist parameter server v1: client proof"
SERVER_LABEL = b"lightning_pdist parameter server v1: server proof"


def new_secret() -> bytes:
    """A fresh 32-byte shared secret (global rank 0 makes one per fit when it starts the servers)."""
    return secrets.token_bytes(SECRET_BYTES)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def check_secret(secret: object, where: str) -> bytes | None:
    """``secret`` if it is ``None`` or at least :data:`SECRET_BYTES` bytes; else ``TypeError``/``ValueError`` naming ``where``."""
    if secret is None:
        return None
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"{where}: secret must be bytes (or None), got {type(secret).__name__}")
    if len(secret) < SECRET_BYTES:
        raise ValueError(f"{where}: a secret of {len(secret)} bytes is too short; it must hold at least {SECRET_BYTES} bytes")
    return bytes(secret)


def proof(secret: bytes, nonce: bytes, label: bytes) -> bytes:
    """``HMAC-SHA256(secret, nonce || label)``."""
    return hmac.new(secret, nonce + label, hashlib.sha256).digest()


def verify(secret: bytes, nonce: bytes, label: bytes, received: bytes | bytearray) -> bool:
    """Whether ``received`` is :func:`proof` of ``nonce`` (constant-time comparison)."""
    return hmac.compare_digest(proof(secret, nonce, label), bytes(received))


def read_secret_file(path: str) -> bytes:
    """The secret held in ``path`` (``~`` expanded): its bytes as they are (a trailing newline included), at least 32 of them.

    The file must be a regular file that only its owner may access (``chmod 600``), as ssh demands of a
    private key: on a shared node, a group- or world-readable secret authenticates nobody. ``ValueError``
    starts with ``path`` and states the rule. Make one with
    ``python -c "import secrets; print(secrets.token_hex(32))" > PATH; chmod 600 PATH``.
    """
    try:
        fd = os.open(os.path.expanduser(path), os.O_RDONLY)
    except FileNotFoundError:
        raise ValueError(f"{path!r}: no such file; the secret file must exist on every worker and server host") from None
    except OSError as err:
        raise ValueError(f"{path!r}: cannot be read ({err.strerror}); the secret file must be readable by its owner") from None
    try:
        info = os.fstat(fd)  # of the file actually opened, not of whatever the path names a moment later
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path!r}: not a regular file; the secret file must be a regular file")
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise ValueError(f"{path!r}: mode {mode:#o} lets group or others access it; the secret file must be "
                             f"readable only by its owner (chmod 600 {path})")  # fmt: skip
        data = os.read(fd, MAX_SECRET_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise ValueError(f"{path!r}: more than {MAX_SECRET_FILE_BYTES} bytes; the secret file must hold one secret "
                         f"of {SECRET_BYTES} to {MAX_SECRET_FILE_BYTES} bytes")  # fmt: skip
    if len(data) < SECRET_BYTES:
        raise ValueError(f"{path!r}: holds {len(data)} bytes; the secret file must hold at least {SECRET_BYTES} bytes "
                         "(python -c \"import secrets; print(secrets.token_hex(32))\" > PATH)")  # fmt: skip
    return data
