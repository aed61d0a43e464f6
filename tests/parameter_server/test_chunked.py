"""Chunked sync steps (chunk_bytes, chunks.py): the rule in one process, then a real server answering chunk by chunk."""

import socket
import threading

import pytest
import torch

from lightning_pdist.core.ps_client import ParameterServerClient, ServerConnection, ServerError
from lightning_pdist.core.ps_wire import Kind
from lightning_pdist.parameter_server.chunks import MAX_CHUNKS, chunk_bounds, check_chunks
from lightning_pdist.parameter_server.process import start_server
from lightning_pdist.parameter_server.shard import ParameterShard

SEGMENTS = [[0, 0, 5], [-1, -1, 3], [0, 0, 4], [0, 0, 6]]  # a frozen slice in the middle
CHUNKS = [5, 7, 6]  # chunk 1 holds the frozen slice and the 4-element piece


def test_chunk_boundaries_must_be_segment_boundaries():
    """check_chunks: ranges from sizes; a boundary inside a segment, a wrong total or too many chunks are refused."""
    assert check_chunks(CHUNKS, SEGMENTS) == [(0, 5), (5, 12), (12, 18)]
    with pytest.raises(ValueError, match="chunk boundary 4 is inside a segment"):
        check_chunks([4, 14], SEGMENTS)
    with pytest.raises(ValueError, match="chunks hold 17 elements; the segments hold 18"):
        check_chunks([5, 7, 5], SEGMENTS)
    with pytest.raises(ValueError, match=f"a list of 1 to {MAX_CHUNKS} ints >= 1"):
        check_chunks([1] * (MAX_CHUNKS + 1), [[0, 0, 1]] * (MAX_CHUNKS + 1))
    with pytest.raises(ValueError, match="ints >= 1"):
        check_chunks([0, 18], SEGMENTS)


def test_each_chunk_is_a_contiguous_range_of_the_compact_push():
    """chunk_bounds counts the present elements of each chunk, in order."""
    pieces = [(0, 5, 0), (8, 12, 1), (12, 18, 2)]
    assert chunk_bounds(pieces, [True, True, True], 3) == [0, 5, 9, 15]
    assert chunk_bounds(pieces, [True, False, True], 3) == [0, 5, 5, 11]


def test_stepping_chunk_by_chunk_is_bit_identical_to_one_step():
    """Adam with weight decay on three pieces: apply_range_ per chunk, in any order, equals apply_ exactly, step after step."""
    torch.manual_seed(0)
    values = torch.randn(18)
    groups = [{"lr": 0.01, "weight_decay": 0.1}]
    whole, chunked = ParameterShard(values, SEGMENTS, "Adam", groups), ParameterShard(values, SEGMENTS, "Adam", groups)
    ranges = check_chunks(CHUNKS, SEGMENTS)
    for step in range(4):
        grad = torch.randn(18)
        present = [True, step % 2 == 0, True]  # the middle piece has a gradient every other step
        whole.apply_(grad, 0, present)
        for a, b in reversed(ranges):
            chunked.apply_range_(grad[a:b].clone(), 0, present, a, b)
        assert torch.equal(whole.flat, chunked.flat)
    assert torch.equal(chunked.flat[5:8], values[5:8])  # frozen


@pytest.fixture
def server():
    handle = start_server(0)
    yield handle
    handle.stop(timeout=5)


def init(address, num_workers=2, **extra):
    conn = ServerConnection(0, address, timeout=10)
    meta = {"mode": "sync", "num_workers": num_workers, "dtype": "torch.float32", "segments": SEGMENTS,
            "optimizer": "SGD", "param_groups": [{"lr": 0.5}], "chunks": CHUNKS, **extra}  # fmt: skip
    conn.request(Kind.INIT, meta, torch.arange(18, dtype=torch.float32))
    return conn


def chunk_meta(worker, chunk, version=0):
    return {"worker": worker, "version": version, "hparams": [{"lr": 0.5}], "chunk": chunk}


def test_a_chunk_is_answered_once_every_worker_pushed_it_before_later_chunks_arrive(server):
    """Both workers push chunk 0 only: each gets x[0:5] - lr·mean back at once; the step's version moves with the last chunk."""
    admin = init(server.address)
    conns = []
    for worker in (0, 1):
        conn = ServerConnection(0, server.address, timeout=10)
        conn.request(Kind.HELLO, {"worker": worker})
        conns.append(conn)
    conns[0].send(Kind.PUSHPULL_CHUNK, chunk_meta(0, 0), torch.ones(5))
    meta, payload = conns[1].request(Kind.PUSHPULL_CHUNK, chunk_meta(1, 0), 3 * torch.ones(5))
    expected = torch.arange(5.0) - 0.5 * 2.0
    torch.testing.assert_close(torch.frombuffer(payload, dtype=torch.float32), expected)
    assert meta["chunk"] == 0 and meta["version"] == 1  # chunk 0 closed step 0; chunks 1 and 2 have not been pushed
    meta, payload = conns[0].receive(Kind.PUSHPULL_CHUNK)
    torch.testing.assert_close(torch.frombuffer(payload, dtype=torch.float32), expected)
    state = admin.request(Kind.HELLO, {"worker": 0})[0]
    assert state["version"] == 0  # the step is still open
    admin.close()


def test_two_workers_chunked_equal_the_unchunked_step(server):
    """pushpull_chunks from two workers in threads: the pulled shard is x - lr·mean(g), version 1, on every worker."""
    admin = init(server.address)
    workers = [ParameterServerClient([server.address], w, timeout=10) for w in (0, 1)]
    grads = [torch.randn(15), torch.randn(15)]  # optimizer 0's 15 elements (the frozen 3 are not pushed)
    bounds = chunk_bounds([(0, 5, 0), (8, 12, 1), (12, 18, 2)], [True] * 3, 3)
    results = [None, None]

    def run(w):
        workers[w].hello()
        workers[w].open_chunks([3])
        meta = {"worker": w, "version": 0, "hparams": [{"lr": 0.5}]}
        results[w] = workers[w].pushpull_chunks([meta], [[grads[w][a:b] for a, b in zip(bounds, bounds[1:])]])

    threads = [threading.Thread(target=run, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    mean = (grads[0] + grads[1]) / 2
    step = torch.cat([mean[:5], torch.zeros(3), mean[5:]])
    expected = torch.arange(18.0) - 0.5 * step
    for replies in results:
        (chunks,) = replies
        assert [m["version"] for m, _ in chunks] == [1, 1, 1]
        torch.testing.assert_close(torch.cat([torch.frombuffer(p, dtype=torch.float32) for _, p in chunks]), expected)
    for w in workers:
        w.close()
    admin.close()


@pytest.mark.parametrize("in_flight", [1, None])
def test_a_paced_worker_pushes_a_chunk_only_once_the_one_before_was_answered(server, in_flight):
    """Worker 0 pushes its 3 chunks with in_flight=1 (None: no cap); worker 1 pushes chunk 1 first. Paced, worker 0
    holds chunk 1 back until chunk 0 closes, so worker 1's chunk 1 stays unanswered; unpaced, it is answered at once.
    Either way both workers end with x - lr·mean(g) on every chunk."""
    admin = init(server.address)
    paced = ParameterServerClient([server.address], 0, timeout=10)
    paced.hello()
    paced.open_chunks([3])
    grads = [torch.randn(15), torch.randn(15)]
    bounds = chunk_bounds([(0, 5, 0), (8, 12, 1), (12, 18, 2)], [True] * 3, 3)
    parts = [[g[a:b] for a, b in zip(bounds, bounds[1:])] for g in grads]
    result = []
    thread = threading.Thread(target=lambda: result.append(paced.pushpull_chunks(
        [{"worker": 0, "version": 0, "hparams": [{"lr": 0.5}]}], [parts[0]], in_flight=in_flight)))  # fmt: skip
    thread.start()
    other = []
    for j in range(3):
        conn = ServerConnection(0, server.address, timeout=10)
        conn.request(Kind.HELLO, {"worker": 1})
        other.append(conn)
    other[1].send(Kind.PUSHPULL_CHUNK, chunk_meta(1, 1), parts[1][1])
    other[1].sock.settimeout(1.0)
    try:
        early = other[1].sock.recv(1, socket.MSG_PEEK)  # a reply's first byte, if chunk 1 closed
    except TimeoutError:
        early = b""
    assert bool(early) == (in_flight is None)
    other[1].sock.settimeout(10)
    other[0].send(Kind.PUSHPULL_CHUNK, chunk_meta(1, 0), parts[1][0])
    other[2].send(Kind.PUSHPULL_CHUNK, chunk_meta(1, 2), parts[1][2])
    mine = torch.cat([torch.frombuffer(c.receive(Kind.PUSHPULL_CHUNK)[1], dtype=torch.float32) for c in other])
    thread.join(timeout=20)
    mean = (grads[0] + grads[1]) / 2
    expected = torch.arange(18.0) - 0.5 * torch.cat([mean[:5], torch.zeros(3), mean[5:]])
    ((chunks,),) = result
    torch.testing.assert_close(torch.cat([torch.frombuffer(p, dtype=torch.float32) for _, p in chunks]), expected)
    torch.testing.assert_close(mine, expected)
    for conn in other:
        conn.close()
    paced.close()
    admin.close()


def test_a_server_without_chunks_refuses_chunked_pushes_and_plain_pushes_on_a_chunked_one(server):
    """PUSHPULL_CHUNK needs an INIT with chunks; a chunked server refuses whole-shard pushes. Both name the rule."""
    admin = init(server.address)
    conn = ServerConnection(0, server.address, timeout=10)
    conn.request(Kind.HELLO, {"worker": 0})
    with pytest.raises(ServerError, match="steps are chunked .*push each chunk with PUSHPULL_CHUNK"):
        conn.request(Kind.PUSHPULL, {"worker": 0, "version": 0, "hparams": [{"lr": 0.5}]}, torch.ones(15))
    plain = {"mode": "sync", "num_workers": 1, "dtype": "torch.float32", "segments": [[0, 6]], "optimizer": "SGD",
             "param_groups": [{"lr": 0.5}]}  # fmt: skip
    admin.request(Kind.INIT, plain, torch.zeros(6))
    with pytest.raises(ServerError, match="without chunks; chunked pushes need an INIT with chunks"):
        conn.request(Kind.PUSHPULL_CHUNK, chunk_meta(0, 0), None)
    admin.close()
