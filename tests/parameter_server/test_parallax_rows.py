"""Tier 2: Parallax's row requests (PUSH_ROWS, PULL_ROWS) on a real server process, with raw clients.

One server of ``mode="parallax"`` per test: the synchronous row step against the rule written out here in plain torch
(rows nobody touched bit-identical), a pull that waits for the step and is answered with the stalled worker's name,
and hostile frames for each new kind (authentication first, sizes checked on the header, every field checked
before any state changes).
"""

import socket
import threading

import pytest
import torch
from _helpers import closed_by_server

from lightning_pdist.core.ps_client import ServerConnection, ServerError, WorkerStalled
from lightning_pdist.parameter_server.parallax_rows import pack_rows
from lightning_pdist.parameter_server.process import start_server
from lightning_pdist.core.ps_wire import HEADER, MAGIC, Kind, bytes_to_tensor, loads_state, recv_message

TIMEOUT = 10.0
SECRET = bytes(range(32))
LR = 0.5
# this server holds rows [0, 10) of table 0 (d = 3) and rows [5, 8) of table 2 (d = 2)
TABLES = [[0, 0, 10, 3], [2, 5, 8, 2]]


def init(address, secret=None, optimizer="SGD", num_workers=2):
    values = torch.randn(10 * 3 + 3 * 2, generator=torch.Generator().manual_seed(0))
    admin = ServerConnection(0, address, timeout=TIMEOUT, secret=secret)
    admin.request(Kind.INIT, {"mode": "parallax", "num_workers": num_workers, "dtype": "torch.float32",
                              "segments": [[0, 0, 30], [0, 0, 6]], "tables": TABLES,
                              "optimizers": [{"name": optimizer, "param_groups": [{"lr": LR}]}]}, values)  # fmt: skip
    return admin, values


def connect(address, worker, secret=None, timeout=TIMEOUT, wait_grace=10.0):
    conn = ServerConnection(0, address, timeout=timeout, secret=secret, wait_grace=wait_grace)
    conn.request(Kind.HELLO, {"worker": worker})
    return conn


def push(conn, version, entries):
    tables, payload = pack_rows(entries)
    return conn.request(Kind.PUSH_ROWS, {"version": version, "tables": tables}, payload)[0]


def pull(conn, wait_version, entries):
    tables, payload = pack_rows([(t, torch.tensor(rows), None) for t, rows in entries])
    meta, values = conn.request(Kind.PULL_ROWS, {"wait_version": wait_version, "tables": tables}, payload)
    return meta, bytes_to_tensor(values, meta["dtype"])


def values_of(admin):
    return loads_state(admin.request(Kind.GET_STATE, {})[1])["shard"]["values"]


def test_a_row_step_is_the_mean_of_the_workers_rows_and_a_waiting_pull_gets_it_or_the_stalled_worker():
    """Worker 0 touches rows 1, 4 of table 0 and 6 of table 2; worker 1 rows 4, 9 of table 0. A pull for step 1 sent
    before the step closes is answered once worker 1's push closes it, with w − lr·(Σ_m g_m)/2 on the rows asked for;
    every row no worker touched is bit-identical. Then worker 0 pushes step 1 alone: its pull for step 2 is answered
    after its patience, naming worker 1 (not pushed step 1), and the server lives."""
    server = start_server(0, secret=SECRET)
    try:
        admin, w0 = init(server.address, SECRET)
        a, b, reader = (connect(server.address, w, SECRET) for w in (0, 1, 0))  # reader: worker 0's second connection
        g = torch.Generator().manual_seed(1)
        ga, ga2, gb = torch.randn(2, 3, generator=g), torch.randn(1, 2, generator=g), torch.randn(2, 3, generator=g)
        got = {}
        waiting = threading.Thread(target=lambda: got.update(pull=pull(reader, 1, [(0, [1, 4, 9]), (2, [6, 7])])))
        waiting.start()
        assert push(a, 0, [(0, torch.tensor([1, 4]), ga), (2, torch.tensor([6]), ga2)])["version"] == 0
        assert push(b, 0, [(0, torch.tensor([4, 9]), gb)])["version"] == 1  # closes step 0
        waiting.join(TIMEOUT)
        # the rule, written out: table 0 is w0[:30] as 10 x 3, table 2 (rows 5..7) is w0[30:] as 3 x 2
        t0, t2 = w0[:30].view(10, 3).clone(), w0[30:].view(3, 2).clone()
        grad0 = torch.zeros(10, 3)
        grad0[[1, 4]] += ga
        grad0[[4, 9]] += gb
        grad2 = torch.zeros(3, 2)
        grad2[1] += ga2[0]
        e0, e2 = t0 - LR * grad0 / 2, t2 - LR * grad2 / 2
        meta, rows = got["pull"]
        assert meta["version"] == 1
        torch.testing.assert_close(rows, torch.cat([e0[[1, 4, 9]].reshape(-1), e2[[1, 2]].reshape(-1)]), atol=1e-6, rtol=0)
        now = values_of(admin)
        untouched0 = [r for r in range(10) if r not in (1, 4, 9)]
        assert torch.equal(now[:30].view(10, 3)[untouched0], t0[untouched0])  # bit-identical
        assert torch.equal(now[30:].view(3, 2)[[0, 2]], t2[[0, 2]])
        # a stalled peer is named: worker 1 never pushes step 1
        push(a, 1, [])
        impatient = connect(server.address, 0, SECRET, timeout=1.0, wait_grace=5.0)
        with pytest.raises(WorkerStalled, match=r"worker 1 \(.*\) has not pushed step 1 for .* parameter server 0 is alive"):
            pull(impatient, 2, [(0, [1])])
        with pytest.raises(ServerError, match=r"PUSH_ROWS: version=1: worker 0 already pushed step 1"):
            push(a, 1, [])
    finally:
        assert server.poll() is None, "the server died"
        server.stop(timeout=5)


def test_hostile_row_frames_are_refused_before_anything_changes():
    """Each new kind: without the handshake a frame is dropped unread; a header declaring more than every row here
    (push: 8 + 4·d bytes a row, pull: 8) is refused before its payload; every bad field is refused naming it; a
    PUSH to a parallax server and a row request to a server of another mode are refused. The rows never move, and a
    well-behaved step is then served."""
    server = start_server(0, secret=SECRET)
    try:
        admin, w0 = init(server.address, SECRET, num_workers=1)
        host, _, port = server.address.rpartition(":")
        for kind in (Kind.PUSH_ROWS, Kind.PULL_ROWS):
            with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:  # no handshake
                sock.sendall(HEADER.pack(MAGIC, int(kind), 2, 16) + b"{}" + bytes(16))
                assert closed_by_server(sock)
        limits = {Kind.PUSH_ROWS: 10 * (8 + 12) + 3 * (8 + 8), Kind.PULL_ROWS: 13 * 8}
        for kind, limit in limits.items():  # one byte over the limit is refused from the header
            conn = connect(server.address, 0, SECRET)
            conn.sock.sendall(HEADER.pack(MAGIC, int(kind), 2, limit + 1) + b"{}")
            reply, meta, _, _ = recv_message(conn.sock, timeout=TIMEOUT)
            assert reply == Kind.ERROR and f"{kind.name} declares payload_len={limit + 1}; this receiver takes at " \
                f"most {limit} bytes" in meta["message"]  # fmt: skip
            assert closed_by_server(conn.sock)
        w = connect(server.address, 0, SECRET)
        one = torch.ones(1, 3)
        bad = [
            ({"tables": [[1, 1]]}, pack_rows([(0, torch.tensor([2]), one)])[1], r"table 1: must be one of this server's tables \[0, 2\]"),
            ({"tables": [[0, 11]]}, b"", r"table 0 count=11: count must be in \[0, 10\]"),
            ({"tables": [[0, 1], [0, 1]]}, b"", r"table 0: must be one of .*, once"),
            ({"tables": "x"}, b"", r"tables='x': tables must be a list of at most 2"),
            ({"tables": [[0, 1]]}, bytes(7), r"payload of 7 bytes; 1 rows need 20"),
            ({"tables": [[2, 1]]}, pack_rows([(2, torch.tensor([4]), torch.ones(1, 2))])[1], r"table 2: rows must be sorted, unique and in \[5, 8\)"),
            ({"tables": [[0, 2]]}, pack_rows([(0, torch.tensor([3, 3]), torch.ones(2, 3))])[1], r"table 0: rows must be sorted, unique"),
            ({"tables": [[0, 2]]}, pack_rows([(0, torch.tensor([5, 2]), torch.ones(2, 3))])[1], r"table 0: rows must be sorted, unique"),
            ({"tables": [[0, 1]], "version": -1}, pack_rows([(0, torch.tensor([2]), one)])[1], r"version=-1: version must be an int >= 0"),
            ({"tables": [[0, 1]], "worker": 1}, pack_rows([(0, torch.tensor([2]), one)])[1], r"worker=1: this connection said HELLO as worker 0"),
            ({"tables": [[0, 1]], "hparams": [{"lr": "x"}]}, pack_rows([(0, torch.tensor([2]), one)])[1], r"hparams\[0\]\['lr'\]='x'"),
        ]  # fmt: skip
        for meta, payload, match in bad:
            with pytest.raises(ServerError, match=r"refused PUSH_ROWS: (RequestRefused: )?PUSH_ROWS: " + match):
                w.request(Kind.PUSH_ROWS, {"version": 0, **meta}, payload)
        for meta, match in [({"wait_version": "x", "tables": []}, r"wait_version='x'"),
                            ({"tables": [[0, 1]]}, r"payload of 0 bytes; 1 rows need 8")]:  # fmt: skip
            with pytest.raises(ServerError, match=r"refused PULL_ROWS: (RequestRefused: )?PULL_ROWS: " + match):
                w.request(Kind.PULL_ROWS, meta)
        with pytest.raises(ServerError, match=r"PUSH: this server runs mode='parallax', which takes PUSH_ROWS"):
            w.request(Kind.PUSH, {"version": 0})
        with pytest.raises(ServerError, match=r"INIT: optimizer='Adam': the sparse tables need one that steps sparse"):
            init(server.address, SECRET, optimizer="Adam")
        assert torch.equal(values_of(admin), w0)  # nothing refused moved a row
        assert push(w, 0, [(0, torch.tensor([2]), one)])["version"] == 1  # one worker: the step closes
        assert torch.equal(values_of(admin)[6:9], w0[6:9] - LR)
        admin.request(Kind.INIT, {"mode": "sync", "num_workers": 1, "dtype": "torch.float32", "segments": [[0, 4]],
                                  "optimizer": "SGD", "param_groups": [{"lr": 0.1}]}, torch.zeros(4))  # fmt: skip
        other = connect(server.address, 0, SECRET)
        with pytest.raises(Exception, match=r"PUSH_ROWS declares payload_len=20; this receiver takes at most 0 bytes"):
            other.request(Kind.PUSH_ROWS, {"version": 0, "tables": [[0, 1]]}, pack_rows([(0, torch.tensor([2]), one)])[1])
        other = connect(server.address, 0, SECRET)
        with pytest.raises(ServerError, match=r"PULL_ROWS: this server runs mode='sync'; row requests need mode='parallax'"):
            other.request(Kind.PULL_ROWS, {"tables": []})
    finally:
        assert server.poll() is None, "the server died"
        server.stop(timeout=5)
