"""Tier 1-2: peer authentication of the parameter-server transport (issue 11), against real server processes.

Attackers are raw sockets that skip the handshake or answer it wrongly; each test asserts that the attacker is
closed, that the server stays up, and that a worker holding the secret is served while the attack goes on.
"""

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from _helpers import closed_by_server

from lightning_pdist.core.ps_auth import CLIENT_LABEL, SERVER_LABEL, check_secret, new_secret, proof, read_secret_file
from lightning_pdist.core.ps_client import ParameterServerClient, ServerConnection, ServerError, ServerUnavailable
from lightning_pdist.parameter_server.loop import ServerLimits
from lightning_pdist.parameter_server.process import start_server
from lightning_pdist.core.ps_wire import HEADER, MAGIC, Kind, encode_message, recv_message, send_message

GOOD_TIMEOUT = 10.0
SECRET = bytes(range(32))


@contextlib.contextmanager
def serving(secret=SECRET, **limits):
    handle = start_server(0, limits=ServerLimits(**limits), secret=secret)
    try:
        yield handle
    finally:
        assert handle.poll() is None, "the server died under the attack"
        handle.stop(timeout=5)


def init(address, mode="async", num_workers=1, secret=SECRET):
    admin = ServerConnection(0, address, timeout=GOOD_TIMEOUT, secret=secret)
    meta = {"mode": mode, "num_workers": num_workers, "dtype": "torch.float32", "segments": [[0, 6]],
            "optimizer": "SGD", "param_groups": [{"lr": 1.0}]}  # fmt: skip
    admin.request(Kind.INIT, meta, torch.zeros(6))
    return admin


def good_worker(address, worker=0, secret=SECRET):
    client = ParameterServerClient([address], worker, timeout=GOOD_TIMEOUT, secret=secret)
    client.hello()
    return client


def assert_serving(client):
    shards, metas = client.push([torch.ones(6)], [0], [{"lr": 1.0}], pull=True)
    assert shards[0].numel() == 6 and metas[0]["version"] >= 1


def raw(address):
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=GOOD_TIMEOUT)


def message(kind, meta=None, payload=None):
    head, body = encode_message(kind, meta, payload)
    return head + bytes(body)



# ---------------------------------------------------------------------- the secret itself


def test_a_secret_file_must_exist_be_private_and_hold_32_bytes(tmp_path):
    """read_secret_file returns the file's bytes, and refuses a missing, group/world-readable or short file by path and rule."""
    good = tmp_path / "secret"
    good.write_text("a" * 64 + "\n")
    good.chmod(0o600)
    assert read_secret_file(str(good)) == b"a" * 64 + b"\n"
    with pytest.raises(ValueError, match=r"no such file; the secret file must exist"):
        read_secret_file(str(tmp_path / "missing"))
    good.chmod(0o644)
    with pytest.raises(ValueError, match=rf"'{good}': mode 0o644 lets group or others access it; the secret file must be "
                                         r"readable only by its owner \(chmod 600"):  # fmt: skip
        read_secret_file(str(good))
    short = tmp_path / "short"
    short.write_bytes(b"x" * 31)
    short.chmod(0o600)
    with pytest.raises(ValueError, match=r"holds 31 bytes; the secret file must hold at least 32 bytes"):
        read_secret_file(str(short))
    with pytest.raises(ValueError, match=r"not a regular file"):
        read_secret_file(str(tmp_path))


def test_a_secret_must_be_at_least_32_bytes():
    """check_secret (start_server, ShardServer, ServerConnection) refuses a short or non-bytes secret, naming the caller."""
    assert len(new_secret()) == 32 and new_secret() != new_secret()
    with pytest.raises(ValueError, match=r"start_server\(index=0\): a secret of 8 bytes is too short"):
        start_server(0, secret=b"12345678")
    with pytest.raises(TypeError, match=r"x: secret must be bytes"):
        check_secret("a" * 32, "x")


# ---------------------------------------------------------------------- attackers without the secret


def wrong_proof(sock):
    """Read the challenge, answer it with the right shape but a proof made with another secret."""
    kind, _, nonce, _ = recv_message(sock, timeout=GOOD_TIMEOUT)
    assert kind == Kind.CHALLENGE and len(nonce) == 32
    sock.sendall(message(Kind.AUTH, {"nonce": os.urandom(32).hex()}, proof(bytes(32), bytes(nonce), CLIENT_LABEL)))


ATTACKS = {
    "push": lambda s: s.sendall(message(Kind.PUSH, {"worker": 0, "version": 0, "hparams": [{"lr": 1.0}]}, torch.ones(6))),
    "init": lambda s: s.sendall(message(Kind.INIT, {"mode": "async", "num_workers": 1, "dtype": "torch.float32",
                                                    "segments": [[0, 6]], "optimizer": "SGD",
                                                    "param_groups": [{"lr": 0.5}]}, torch.full((6,), 7.0))),  # fmt: skip
    "shutdown": lambda s: s.sendall(message(Kind.SHUTDOWN, {})),
    "pushpull-chunk": lambda s: s.sendall(message(Kind.PUSHPULL_CHUNK, {"worker": 0, "version": 0, "chunk": 0,
                                                                        "hparams": [{"lr": 1.0}]}, torch.ones(6))),  # fmt: skip
    "hello": lambda s: s.sendall(message(Kind.HELLO, {"worker": 1})),
    "wrong-hmac-then-shutdown": lambda s: (wrong_proof(s), s.sendall(message(Kind.SHUTDOWN, {}))),
    "auth-replayed-as-shutdown": lambda s: s.sendall(HEADER.pack(MAGIC, int(Kind.AUTH), 2, 32) + b"{}" + bytes(32)),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_an_unauthenticated_request_is_dropped_and_a_good_worker_is_served(attack):
    """PUSH/INIT/SHUTDOWN/HELLO without the handshake, or a wrong HMAC: the attacker is closed, the server serves on."""
    with serving() as server:
        admin = init(server.address)
        client = good_worker(server.address)
        assert_serving(client)
        with raw(server.address) as sock:
            ATTACKS[attack](sock)
            assert closed_by_server(sock)
        assert_serving(client)
        shards, _ = client.pull()
        torch.testing.assert_close(shards[0], torch.full((6,), -2.0))  # two lr-1 steps from zeros: INIT not replaced
        admin.close()


def test_an_unauthenticated_hello_never_counts_as_a_worker():
    """Sync, 2 workers: a stranger's HELLO as worker 1 then EOF does not make worker 1 gone; the step closes."""
    with serving() as server:
        init(server.address, mode="sync", num_workers=2)
        a = good_worker(server.address, 0)
        with raw(server.address) as sock:
            sock.sendall(message(Kind.HELLO, {"worker": 1}))
            assert closed_by_server(sock)
        time.sleep(0.3)
        b = good_worker(server.address, 1)
        a.push([torch.ones(6)], [0], [{"lr": 1.0}])
        b.push([3 * torch.ones(6)], [0], [{"lr": 1.0}])
        torch.testing.assert_close(a.pull(wait_version=1)[0][0], torch.full((6,), -2.0))


def test_a_silent_connection_is_dropped_at_the_handshake_deadline():
    """A connection that never answers the challenge is closed after handshake_timeout; the worker is served meanwhile."""
    with serving(handshake_timeout=1.0) as server:
        init(server.address)
        client = good_worker(server.address)
        with raw(server.address) as sock:
            assert_serving(client)
            assert closed_by_server(sock, within=5.0)
        assert_serving(client)


def test_a_worker_refused_by_its_address_is_told_so():
    """A server whose allowed_networks leave out the worker's address says so before closing (the worker's error
    names the server and its own address), without naming the server's networks; the server keeps serving."""
    handle = start_server(0, allowed_networks="10.0.0.0/8", secret=SECRET)
    try:
        with pytest.raises(ServerUnavailable, match=r"parameter server 0 at 127\.0\.0\.1:\d+ refused this worker: this "
                           r"server refuses connections from 127\.0\.0\.1: the address is outside its allowed_networks "
                           r"\(the servers' allowed_networks must include every worker's address\)"):  # fmt: skip
            ServerConnection(0, handle.address, timeout=GOOD_TIMEOUT, secret=SECRET)
        with raw(handle.address) as sock:
            kind, meta, _, _ = recv_message(sock, timeout=GOOD_TIMEOUT)
            assert kind == Kind.ERROR and "10.0.0.0" not in meta["message"]
        assert handle.poll() is None
    finally:
        handle.stop(timeout=5)


def test_a_wrong_secret_and_no_secret_fail_naming_the_server():
    """A worker with another secret is refused at connect; one without a secret is told the server needs one."""
    with serving() as server:
        with pytest.raises(ServerUnavailable, match=r"parameter server 0 at .* refused authentication: .*authentication "
                                                    r"failed; the workers and the servers must share the same secret"):  # fmt: skip
            ServerConnection(0, server.address, timeout=GOOD_TIMEOUT, secret=bytes(32))
        plain = ServerConnection(0, server.address, timeout=GOOD_TIMEOUT)
        with pytest.raises(ServerError, match=r"requires authentication .*server_secret_file"):
            plain.request(Kind.HELLO, {"worker": 0})
        plain.close()
        init(server.address)  # the server still takes the right secret


def test_a_worker_with_a_secret_refuses_a_server_without_one():
    """A server started without a secret sends no challenge: the worker fails within its timeout, saying so."""
    with serving(secret=None) as server:
        with pytest.raises(ServerUnavailable, match=r"did not complete authentication within 0.5 s .*--secret-file"):
            ServerConnection(0, server.address, timeout=0.5, secret=SECRET)


def test_a_worker_refuses_a_server_that_cannot_prove_the_secret():
    """An impostor server that answers AUTH with a bogus proof is refused by the worker (mutual authentication)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def impostor():
        sock, _ = listener.accept()
        with sock:
            send_message(sock, Kind.CHALLENGE, {}, os.urandom(32))
            recv_message(sock, timeout=GOOD_TIMEOUT)
            send_message(sock, Kind.REPLY, {"proof": proof(bytes(32), os.urandom(32), SERVER_LABEL).hex()})
            time.sleep(0.5)

    thread = threading.Thread(target=impostor)
    thread.start()
    try:
        with pytest.raises(ServerUnavailable, match=r"could not prove it holds the shared secret"):
            ServerConnection(0, f"127.0.0.1:{listener.getsockname()[1]}", timeout=GOOD_TIMEOUT, secret=SECRET)
    finally:
        thread.join()
        listener.close()


# ---------------------------------------------------------------------- servers started by hand


def hand_started(*args):
    return subprocess.Popen([sys.executable, "-m", "lightning_pdist.parameter_server.process", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def test_a_hand_started_server_with_a_secret_file_authenticates(tmp_path):
    """--secret-file: a worker with the file's secret trains; a raw SHUTDOWN without the handshake is dropped."""
    path = tmp_path / "secret"
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(0o600)
    secret = read_secret_file(str(path))
    process = hand_started("--secret-file", str(path), "--idle-timeout", "30")
    try:
        line = process.stdout.readline()
        address = line.rsplit(" ", 1)[-1].strip()
        assert "listening on" in line, line + process.stderr.read()
        admin = init(address, secret=secret)
        client = good_worker(address, secret=secret)
        with raw(address) as sock:
            sock.sendall(message(Kind.SHUTDOWN, {}))
            assert closed_by_server(sock)
        assert_serving(client)
        admin.request(Kind.SHUTDOWN, {})
        assert process.wait(timeout=GOOD_TIMEOUT) == 0
        assert "unauthenticated" not in process.stderr.read()
    finally:
        process.kill()
        process.wait()


def test_a_hand_started_server_refuses_an_open_secret_file_and_runs_without_one_only_if_insecure(tmp_path):
    """--secret-file readable by others exits naming the path and the rule; no --secret-file refuses to start unless
    --insecure is given (then it warns once); both at once are refused."""
    path = tmp_path / "secret"
    path.write_bytes(b"s" * 32)
    path.chmod(0o640)
    process = hand_started("--secret-file", str(path))
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2
    assert f"--secret-file '{path}': mode 0o640 lets group or others access it" in err
    assert "readable only by its owner" in err
    process = hand_started("--idle-timeout", "0.5")
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2 and "listening" not in err
    assert "--secret-file is required: without it any process that can reach the port may push gradients" in err
    assert "(give --insecure to run unauthenticated anyway)" in err
    process = hand_started("--insecure", "--secret-file", str(path))
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2 and f"--insecure with --secret-file '{path}': give one of them" in err
    process = hand_started("--idle-timeout", "0.5", "--insecure")
    _, err = process.communicate(timeout=60)
    assert process.returncode == 0
    assert err.count("WARNING: unauthenticated (--insecure)") == 1


def test_the_challenge_tells_a_stranger_nothing_but_a_fresh_nonce():
    """The challenge carries no metadata, and every connection gets a different nonce (a recorded proof is useless)."""
    nonces = set()
    with serving() as server:
        for _ in range(2):
            with raw(server.address) as sock:
                kind, meta, nonce, _ = recv_message(sock, timeout=GOOD_TIMEOUT)
                assert kind == Kind.CHALLENGE and meta == {} and len(nonce) == 32
                nonces.add(bytes(nonce))
    assert len(nonces) == 2
