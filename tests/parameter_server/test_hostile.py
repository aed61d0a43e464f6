"""Tier 2: a real parameter-server process against hostile and broken peers written here with raw sockets.

Each attack from issue 11 runs against a server started with :func:`start_server` (as the strategy starts
it), with small :class:`ServerLimits` deadlines so that nothing sleeps long. Each test asserts that the
server stays up, that a well-behaved worker is answered within its client timeout while the attack is still
going on, and (where the attack is about memory) that the server's RSS stays within 50 MB of its start.
"""

import contextlib
import json
import math
import socket
import time

import pytest
import torch
from _helpers import closed_by_server

from lightning_pdist.core.ps_client import ParameterServerClient, ServerConnection, ServerError
from lightning_pdist.parameter_server.loop import ServerLimits
from lightning_pdist.parameter_server.process import start_server
from lightning_pdist.parameter_server.server import ShardServer
from lightning_pdist.core.ps_wire import HEADER, MAGIC, FrameError, FrameReader, Kind, decode_meta, recv_message

GOOD_TIMEOUT = 10.0  # the well-behaved worker's bound on every request while an attack goes on
RSS_SLACK = 50 << 20


@contextlib.contextmanager
def serving(**limits):
    handle = start_server(0, limits=ServerLimits(**limits))
    try:
        yield handle
    finally:
        assert handle.poll() is None, "the server died under the attack"
        handle.stop(timeout=5)


def init(address, mode="async", num_workers=1, numel=6, lr=0.5, **extra):
    admin = ServerConnection(0, address, timeout=GOOD_TIMEOUT)
    meta = {"mode": mode, "num_workers": num_workers, "dtype": "torch.float32", "segments": [[0, numel]],
            "optimizer": "SGD", "param_groups": [{"lr": lr}], **extra}  # fmt: skip
    admin.request(Kind.INIT, meta, torch.zeros(numel))
    return admin


def good_worker(address, worker=0):
    client = ParameterServerClient([address], worker, timeout=GOOD_TIMEOUT)
    client.hello()
    return client


def assert_serving(client, numel=6):
    """One push and pull of a well-behaved worker, answered within GOOD_TIMEOUT (else ServerUnavailable)."""
    shards, metas = client.push([torch.ones(numel)], [0], [{"lr": 0.5}], pull=True)
    assert shards[0].numel() == numel and metas[0]["version"] >= 1


def raw(address):
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=GOOD_TIMEOUT)


def header(kind, meta_len, payload_len):
    return HEADER.pack(MAGIC, int(kind), meta_len, payload_len)


def rss(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))



# ---------------------------------------------------------------------- one message that used to kill


@pytest.mark.parametrize("payload_len", [1 << 62, (1 << 64) - 1, 1 << 30], ids=["2^62", "2^64-1", "1GiB"])
@pytest.mark.parametrize("after_init", [False, True], ids=["before-init", "after-init"])
def test_an_absurd_payload_length_is_refused_from_the_header(payload_len, after_init):
    """A 19-byte PUSH declaring 2^62, 2^64-1 or 1 GiB of payload gets an error naming the limit; nothing is allocated."""
    with serving() as server:
        client = None
        if after_init:
            init(server.address)
            client = good_worker(server.address)
        # measured after the INIT: what the INIT itself allocates (its shard, the optimizer, the lazily imported
        # modules the forked server first uses: ~50 MB, depending on what the test process had imported) is not
        # the attack's
        start = rss(server.pid)
        with raw(server.address) as sock:
            sock.sendall(header(Kind.PUSH, 2, payload_len) + b"{}")
            kind, meta, _, _ = recv_message(sock, timeout=GOOD_TIMEOUT)
            assert kind == Kind.ERROR and f"payload_len={payload_len}" in meta["message"]
            assert "at most" in meta["message"]
            assert closed_by_server(sock)
        if client is not None:
            assert_serving(client)
        assert rss(server.pid) - start < RSS_SLACK


def test_an_absurd_init_declared_then_silence_costs_only_what_arrived():
    """INIT declaring 1 GiB, then 2 MB and silence: RSS stays within 50 MB, a worker is served, the sender is dropped."""
    with serving(message_timeout=2.0) as server:
        init(server.address)
        client = good_worker(server.address)
        start = rss(server.pid)
        with raw(server.address) as sock:
            meta = json.dumps({"mode": "async"}).encode()
            sock.sendall(header(Kind.INIT, len(meta), 1 << 30) + meta + bytes(2 << 20))
            assert_serving(client)  # while the INIT is half-sent
            assert rss(server.pid) - start < RSS_SLACK
            assert closed_by_server(sock)  # message_timeout
        assert_serving(client)


def test_deeply_nested_json_is_refused_not_a_recursion_error():
    """400 kB of nested JSON (under the metadata limit) and 33 levels of objects are refused; the server lives."""
    with serving() as server:
        init(server.address)
        client = good_worker(server.address)
        for meta in (b"[" * 200_000 + b"]" * 200_000, json.dumps(nest(33)).encode(), b"[1, 2]", b"{nope"):
            with raw(server.address) as sock:
                sock.sendall(header(Kind.PULL, len(meta), 0) + meta)
                kind, reply, _, _ = recv_message(sock, timeout=GOOD_TIMEOUT)
                assert kind == Kind.ERROR and "metadata" in reply["message"]
            assert_serving(client)


def nest(depth):
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


@pytest.mark.parametrize("garbage", [b"GET / HTTP/1.1\r\n\r\n", header(99, 0, 0), header(Kind.PULL, 2 << 20, 0)],
                         ids=["http", "unknown-kind", "oversized-meta"])  # fmt: skip
def test_garbage_closes_that_connection_only(garbage):
    """Bytes that are not a message close the connection that sent them (after an error reply); others go on."""
    with serving() as server:
        init(server.address)
        client = good_worker(server.address)
        with raw(server.address) as sock:
            sock.sendall(garbage)
            assert closed_by_server(sock)
        assert_serving(client)


def test_frame_reader_grows_the_payload_with_what_arrived():
    """Tier 1: a header declaring 1 GiB and 10 bytes of payload allocate about 1 MiB, not 1 GiB; limits and depth hold."""
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        reader = FrameReader(lambda kind: 1 << 40)
        a.sendall(header(Kind.PUSH, 2, 1 << 30) + b"{}" + bytes(10))
        assert reader.read(b) is None and reader.started
        assert len(reader._payload) <= 1 << 20
        limited = FrameReader(lambda kind: 100)
        a.sendall(header(Kind.PUSH, 0, 101))
        with pytest.raises(FrameError, match="payload_len=101; this receiver takes at most 100 bytes for PUSH"):
            limited.read(b)
    assert decode_meta(json.dumps(nest(32)).encode())
    with pytest.raises(FrameError, match="deeper than 32"):
        decode_meta(json.dumps(nest(33)).encode())


# ---------------------------------------------------------------------- slow and silent peers


def test_slow_and_silent_peers_do_not_freeze_the_server_and_expire():
    """5 header bytes, a partial JSON body, a byte at a time: a worker is served meanwhile; each is dropped by its deadline."""
    with serving(message_timeout=1.5) as server:
        init(server.address)
        client = good_worker(server.address)
        meta = json.dumps({"worker": 0, "wait_version": None}).encode()
        held = [raw(server.address) for _ in range(3)]
        held[0].sendall(header(Kind.PULL, len(meta), 0)[:5])
        held[1].sendall(header(Kind.PULL, len(meta), 0) + meta[:7])
        trickle = header(Kind.PULL, len(meta), 0) + meta
        held[2].sendall(trickle[:1])
        t0 = time.monotonic()
        for i, byte in enumerate(trickle[1:]):  # one byte every 0.1 s: the deadline must not restart per byte
            assert_serving(client)
            try:
                held[2].sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"a byte-at-a-time request was still read after {time.monotonic() - t0:.1f} s")
        for sock in held:
            assert closed_by_server(sock)
            sock.close()
        assert_serving(client)


def test_a_peer_that_never_reads_its_replies_is_dropped():
    """A peer sends GET_STATE for a 32 MB shard over and over, reading nothing: workers are served, the peer is dropped."""
    numel = 8 << 20
    with serving(reply_timeout=2.0) as server:
        init(server.address, numel=numel)
        client = good_worker(server.address)
        start = rss(server.pid)
        sock = raw(server.address)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(0.5)
        request = header(Kind.GET_STATE, 2, 0) + b"{}"
        sent = 0
        with contextlib.suppress(TimeoutError, BrokenPipeError, ConnectionResetError):
            for _ in range(1000):  # one request in flight per connection: the rest wait in the socket
                sock.sendall(request)
                sent += 1
        assert_serving(client, numel)
        assert rss(server.pid) - start < RSS_SLACK + 2 * 4 * numel  # the queued reply, not one per request
        time.sleep(2.5)
        assert closed_by_server(sock)
        sock.close()
        assert_serving(client, numel)


def test_a_flood_of_half_open_connections_leaves_room_for_workers():
    """200 silent connections (more than the listen backlog) against max_connections=32: a new worker still connects."""
    with serving(max_connections=32, handshake_timeout=3.0) as server:
        init(server.address)
        client = good_worker(server.address)
        flood = [raw(server.address) for _ in range(200)]
        try:
            assert_serving(client)
            late = good_worker(server.address)  # evicts the oldest connection that completed no request
            assert_serving(late)
            closed = sum(closed_by_server(s, within=0.2) for s in flood)
            assert closed >= 200 - 32
        finally:
            for s in flood:
                s.close()
        assert_serving(client)


def test_silent_connections_are_dropped_after_the_handshake_timeout():
    """A connection that sends nothing is closed after handshake_timeout, while the workers' idle ones stay."""
    with serving(handshake_timeout=1.0) as server:
        init(server.address)
        client = good_worker(server.address)
        with raw(server.address) as sock:
            assert closed_by_server(sock, within=GOOD_TIMEOUT)
        time.sleep(1.2)
        assert_serving(client)  # a worker's connection is not idle-dropped


# ---------------------------------------------------------------------- bad values in requests


@pytest.mark.parametrize(
    "meta, payload, match",
    [
        ({"hparams": [{"lr": "x"}]}, None, r"hparams\[0\]\['lr'\]='x': lr must be a finite number"),
        ({"hparams": [{"lr": math.nan}]}, None, r"hparams\[0\]\['lr'\]=nan: lr must be a finite number"),
        ({"hparams": [{"lr": 0.1}, {"lr": 0.1}]}, None, r"hparams=.*must be a list of 1 objects"),
        ({"hparams": [{"nesterov": 1.0}]}, None, r"a push changes numeric hyperparameters only .*nesterov=False"),
        ({"optimizer": 7}, None, r"optimizer=7: optimizer must be an int in \[0, 1\)"),
        ({"dtype": "torch.float64"}, None, r"dtype='torch.float64': dtype must be 'torch.float32'"),
        ({}, torch.ones(5), r"gradient of 5 elements; optimizer 0's present pieces on this shard hold 6"),
        ({}, bytes(7), r"7 bytes is not a whole number of 4-byte elements"),
        ({"version": "x"}, None, r"version='x': version must be an int >= 0"),
        ({"present": "2"}, None, r"present='2': must be a string of 1"),
    ],
    ids=["lr-str", "lr-nan", "groups", "bool-hparam", "optimizer", "dtype", "shape", "ragged", "version", "present"],
)
def test_a_bad_push_is_refused_and_consumes_no_step(meta, payload, match):
    """Sync, 2 workers: a push with a bad value is refused naming field, value and rule; the step closes on good pushes."""
    with serving() as server:
        admin = init(server.address, mode="sync", num_workers=2, lr=1.0)
        bad = ServerConnection(0, server.address, timeout=GOOD_TIMEOUT)
        bad.request(Kind.HELLO, {"worker": 0})
        request = {"worker": 0, "version": 0, "hparams": [{"lr": 1.0}], **meta}
        with pytest.raises(ServerError, match=match):
            bad.request(Kind.PUSHPULL, request, torch.ones(6) if payload is None else payload)
        other = good_worker(server.address, worker=1)
        _, ack = other.push([3 * torch.ones(6)], [0], [{"lr": 1.0}])
        assert ack[0]["accepted"] and ack[0]["contributors"] == []  # the step is still open: nothing consumed
        bad.request(Kind.PUSH, {"worker": 0, "version": 0, "hparams": [{"lr": 1.0}]}, torch.ones(6))
        shards, metas = other.pull(wait_version=1)
        assert metas[0]["version"] == 1
        torch.testing.assert_close(shards[0], torch.full((6,), -2.0))  # lr 1 * mean(1, 3)
        admin.close()


SYNC2 = {"mode": "sync", "num_workers": 2, "segments": [[0, 0, 4], [0, 0, 2]]}


@pytest.mark.parametrize(
    "meta, match",
    [
        ({"mode": "nope"}, r"mode='nope': mode must be one of"),
        ({"num_workers": 1 << 40}, r"num_workers=1099511627776: num_workers must be an int in \[1, 65536\]"),
        ({"dtype": "torch.int64"}, r"dtype='torch.int64': dtype must be one of"),
        ({"param_groups": [{"lr": "x"}]}, r"param_groups\[0\]\['lr'\]='x': lr must be a finite number"),
        ({"delay_compensation": math.inf}, r"delay_compensation=inf: delay_compensation must be a finite number >= 0"),
        ({"segments": [[0, 5]]}, r"payload of 24 bytes; segments hold 5 elements"),
        # chunked sync steps: two segments of one server that two workers step in sync, the chunks checked against them
        ({**SYNC2, "chunks": [3, 3]}, r"chunk boundary 3 is inside a segment"),
        ({**SYNC2, "chunks": [4, 3]}, r"chunks hold 7 elements; the segments hold 6"),
        ({**SYNC2, "chunks": "4,2"}, r"chunks='4,2': chunks must be a list of 1 to 64 ints >= 1"),
        ({**SYNC2, "chunks": [1] * 65}, r"chunks must be a list of 1 to 64"),
        ({**SYNC2, "chunks": [4, 2], "mode": "async"}, r"chunks with mode='async', backup_workers=0: chunked steps need mode='sync'"),
        ({**SYNC2, "chunks": [4, 2], "backup_workers": 1}, r"backup_workers=1: chunked steps need mode='sync' without backup"),
    ],
    ids=["mode", "num_workers", "dtype", "lr", "dc", "segments", "chunk-inside", "chunk-total", "chunk-type",
         "chunk-too-many", "chunk-async", "chunk-backup"],
)
def test_a_bad_init_is_refused_and_changes_nothing(meta, match):
    """INIT with a bad field is refused naming it; a server already initialized keeps serving its workers."""
    with serving() as server:
        init(server.address)
        client = good_worker(server.address)
        admin = ServerConnection(0, server.address, timeout=GOOD_TIMEOUT)
        good = {"mode": "async", "num_workers": 1, "dtype": "torch.float32", "segments": [[0, 6]],
                "optimizer": "SGD", "param_groups": [{"lr": 0.5}]}  # fmt: skip
        with pytest.raises(ServerError, match=match):
            admin.request(Kind.INIT, {**good, **meta}, torch.zeros(6))
        assert_serving(client)


def test_garbage_set_state_is_refused_and_the_state_kept():
    """SET_STATE with bytes that are not a checkpoint, or a shard of the wrong size, changes nothing."""
    with serving() as server:
        admin = init(server.address)
        client = good_worker(server.address)
        assert_serving(client)
        from lightning_pdist.core.ps_wire import dumps_state, loads_state

        before = loads_state(admin.request(Kind.GET_STATE, {})[1])
        with pytest.raises(ServerError):
            admin.request(Kind.SET_STATE, {}, b"not a checkpoint")
        wrong = {**before, "shard": {**before["shard"], "values": torch.zeros(1)}}
        with pytest.raises(ServerError, match="values of"):
            admin.request(Kind.SET_STATE, {}, dumps_state(wrong))
        after = loads_state(admin.request(Kind.GET_STATE, {})[1])
        torch.testing.assert_close(after["shard"]["values"], before["shard"]["values"])
        assert after["version"] == before["version"]
        assert_serving(client)


def test_the_dropped_push_record_stays_bounded():
    """Backup workers: thousands of late pushes leave no per-push record behind (num_dropped still counts them)."""
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        server = ShardServer(0, listener)
        meta = {"mode": "sync", "num_workers": 3, "backup_workers": 1, "dtype": "torch.float32", "segments": [[0, 4]],
                "optimizer": "SGD", "param_groups": [{"lr": 0.1}]}  # fmt: skip
        server._init(meta, bytearray(torch.zeros(4).numpy().tobytes()))
        payload = bytearray(torch.ones(4).numpy().tobytes())
        for _ in range(2000):
            ack = server._push(2, Kind.PUSH, {"version": 99, "hparams": [{"lr": 0.1}]}, payload)
            assert ack["accepted"] is False
        assert server.aggregator.num_dropped == 2000 and len(server.aggregator.dropped) == 0
    finally:
        listener.close()


def test_server_limits_refuse_bad_values():
    """ServerLimits names the argument, the value and the rule."""
    with pytest.raises(ValueError, match=r"ServerLimits\(max_connections=0\): max_connections must be an int >= 1"):
        ServerLimits(max_connections=0)
    with pytest.raises(ValueError, match=r"ServerLimits\(message_timeout=inf\): message_timeout must be a finite number"):
        ServerLimits(message_timeout=math.inf)
    assert ServerLimits.from_io_timeout(7.0).reply_timeout == 7.0



def test_an_impostor_that_says_hello_as_a_live_worker_and_leaves_does_not_fail_sync():
    """Sync: a second connection saying HELLO as worker 0 then closing does not mark worker 0 gone; the step closes."""
    with serving() as server:
        init(server.address, mode="sync", num_workers=2, lr=1.0)
        a, b = good_worker(server.address, 0), good_worker(server.address, 1)
        with raw(server.address) as impostor:
            impostor.sendall(header(Kind.HELLO, 12, 0) + b'{"worker":0}')
            assert recv_message(impostor, timeout=GOOD_TIMEOUT)[0] == Kind.REPLY
        time.sleep(0.5)  # let the server see the impostor's EOF before the step
        a.push([torch.ones(6)], [0], [{"lr": 1.0}])
        b.push([3 * torch.ones(6)], [0], [{"lr": 1.0}])
        torch.testing.assert_close(a.pull(wait_version=1)[0][0], torch.full((6,), -2.0))


def test_a_server_silent_past_the_grace_is_blamed_itself():
    """A server that never answers a PUSHPULL, not even to name a stalled worker, is blamed after timeout + wait_grace."""
    import socket as _socket

    from lightning_pdist.core.ps_client import ServerConnection, ServerUnavailable
    from lightning_pdist.core.ps_wire import Kind

    with _socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        connection = ServerConnection(0, f"127.0.0.1:{listener.getsockname()[1]}", timeout=0.3, wait_grace=0.2)
        with pytest.raises(ServerUnavailable, match=r"did not answer PUSHPULL within 0.5 s; a live server answers a "
                                                    r"waiting request after 0.3 s, naming the workers it waits for, so "
                                                    r"this server is stopped, hung or unreachable"):
            connection.request(Kind.PUSHPULL, {})
        connection.sock.close()


# ---------------------------------------------------------------------- chunked sync steps (chunk_bytes)

CHUNK_INIT = {"segments": [[0, 0, 4], [0, 0, 2]], "chunks": [4, 2]}  # two chunks: 16 and 8 bytes


@pytest.mark.parametrize(
    "meta, payload, match",
    [
        ({"chunk": 2}, torch.ones(4), r"chunk=2: chunk must be an int in \[0, 2\)"),
        ({"chunk": True}, torch.ones(4), r"chunk=True: chunk must be an int in \[0, 2\)"),
        ({"chunk": None}, torch.ones(4), r"chunk=None: chunk must be an int"),
        ({"chunk": 1}, torch.ones(4), r"chunk 1 of 4 elements; optimizer 0's present pieces in chunk 1 hold 2"),
        ({"chunk": 0, "present": "01"}, torch.ones(4), r"chunk 0 of 4 elements; .* in chunk 0 hold 0"),
        ({"chunk": 0, "version": -1}, torch.ones(4), r"version=-1: version must be an int >= 0"),
        ({"chunk": 0, "hparams": [{"lr": "x"}]}, torch.ones(4), r"lr must be a finite number"),
        ({"chunk": 0, "dtype": "torch.float16"}, torch.ones(4), r"dtype='torch.float16': dtype must be 'torch.float32'"),
        ({"chunk": 0, "patience": -1}, torch.ones(4), r"patience=-1: patience must be null or a number"),
    ],
    ids=["chunk-range", "chunk-bool", "chunk-null", "size", "present", "version", "hparams", "dtype", "patience"],
)
def test_a_bad_chunk_is_refused_and_consumes_no_step(meta, payload, match):
    """Chunked sync, 2 workers: a chunk with a bad value is refused naming field, value and rule; the step closes on good chunks."""
    with serving() as server:
        admin = init(server.address, mode="sync", num_workers=2, lr=1.0, numel=6, **CHUNK_INIT)
        conns = [ServerConnection(0, server.address, timeout=GOOD_TIMEOUT) for _ in range(4)]
        for i, conn in enumerate(conns):
            conn.request(Kind.HELLO, {"worker": i // 2})
        request = {"worker": 0, "version": 0, "hparams": [{"lr": 1.0}], **meta}
        conns[0].send(Kind.PUSHPULL_CHUNK, request, payload)  # as sent: request() would add its own patience
        with pytest.raises(ServerError, match=match):
            conns[0].receive(Kind.PUSHPULL_CHUNK)
        good = {"version": 0, "hparams": [{"lr": 1.0}]}
        for worker, value in ((0, 1.0), (1, 3.0)):  # both chunks of both workers; chunk j on connection j
            for j, n in enumerate((4, 2)):
                conns[2 * worker + j].send(Kind.PUSHPULL_CHUNK, {**good, "chunk": j}, value * torch.ones(n))
        for conn in conns:
            meta_in, shard = conn.receive(Kind.PUSHPULL_CHUNK)
            assert meta_in["version"] == 1
            torch.testing.assert_close(torch.frombuffer(shard, dtype=torch.float32), torch.full((len(shard) // 4,), -2.0))
        admin.close()


def test_a_chunk_larger_than_the_largest_chunk_is_refused_from_the_header():
    """PUSHPULL_CHUNK declaring more than the largest chunk (16 B here), or any payload before a chunked INIT: refused on
    the header, nothing allocated; a duplicate chunk from one worker is refused and the server serves on."""
    with serving() as server:
        with raw(server.address) as sock:  # not initialized: chunks take no payload
            sock.sendall(header(Kind.PUSHPULL_CHUNK, 2, 8) + b"{}")
            kind, meta, _, _ = recv_message(sock, timeout=GOOD_TIMEOUT)
            assert kind == Kind.ERROR and "at most 0 bytes for PUSHPULL_CHUNK" in meta["message"]
        admin = init(server.address, mode="sync", num_workers=1, lr=1.0, numel=6, **CHUNK_INIT)
        with raw(server.address) as sock:
            sock.sendall(header(Kind.PUSHPULL_CHUNK, 2, 1 << 40) + b"{}")
            kind, meta, _, _ = recv_message(sock, timeout=GOOD_TIMEOUT)
            assert kind == Kind.ERROR and "payload_len=1099511627776" in meta["message"] and "at most 16 bytes" in meta["message"]
            assert closed_by_server(sock)
        a, b = (ServerConnection(0, server.address, timeout=GOOD_TIMEOUT) for _ in range(2))
        a.request(Kind.HELLO, {"worker": 0})
        b.request(Kind.HELLO, {"worker": 0})
        good = {"version": 0, "hparams": [{"lr": 1.0}], "chunk": 0}
        init(server.address, mode="sync", num_workers=2, lr=1.0, numel=6, **CHUNK_INIT)  # two workers: chunk 0 stays open
        a.send(Kind.PUSHPULL_CHUNK, good, torch.ones(4))
        with pytest.raises(ServerError, match="worker 0 already pushed a gradient for step 0"):
            b.request(Kind.PUSHPULL_CHUNK, good, torch.ones(4))
        admin.close()
