"""Tier 2: a live server names the workers a waiting request waits for (issue 11: hung ranks are not the server's fault).

A worker's waiting request (sync ``PUSHPULL``/``PULL``, SSP pulls) carries its timeout as ``patience``; when other
workers keep the server from answering by then, the server answers with an error naming them (pid, host, address,
what they have not done) and saying that it is alive, and the client raises :class:`WorkerStalled`.
"""

import math
import os
import re
import socket

import pytest
import torch

from lightning_pdist.core.ps_client import ParameterServerClient, ServerConnection, ServerError, WorkerStalled
from lightning_pdist.parameter_server.process import start_server
from lightning_pdist.core.ps_wire import Kind, loads_state, recv_message

PATIENCE = 1.0  # s: the waiting worker's timeout; the server answers then (the client allows WAIT_GRACE more)


@pytest.fixture
def server():
    handle = start_server(0)
    yield handle
    assert handle.poll() is None, "the server died"
    handle.stop(timeout=5)


def init(address, mode="sync", num_workers=2, **extra):
    admin = ServerConnection(0, address)
    meta = {"mode": mode, "num_workers": num_workers, "dtype": "torch.float32", "segments": [[0, 6]],
            "optimizer": "SGD", "param_groups": [{"lr": 0.5}], **extra}  # fmt: skip
    admin.request(Kind.INIT, meta, torch.zeros(6))
    return admin


def worker(address, rank):
    client = ParameterServerClient([address], rank, timeout=PATIENCE)
    client.hello()
    return client


def me() -> str:
    return rf"pid {os.getpid()} on host {re.escape(socket.gethostname())}, connected from 127\.0\.0\.1:\d+"


def test_sync_names_the_worker_that_has_not_pushed_and_stays_alive(server):
    """Worker 1 does not push step 0 in time: worker 0's PUSHPULL fails naming worker 1 (pid, host); the server lives on."""
    init(server.address)
    waiting, late = worker(server.address, 0), worker(server.address, 1)
    with pytest.raises(WorkerStalled) as caught:
        waiting.push([torch.ones(6)], [0], [{"lr": 0.5}], pull=True)
    assert re.fullmatch(
        rf"PUSHPULL to parameter server 0 at {re.escape(server.address)}: worker 1 \({me()}; last heard from [\d.]+ s "
        r"ago\) has not pushed step 0 for [\d.]+ s: it is stopped, hung or dead; parameter server 0 is alive \(a sync "
        r"step needs the gradients of all 2 workers\)\. Look at the worker\(s\) named; if only slow, raise the timeout "
        r"\(server_timeout, now 1 s\)", str(caught.value))  # fmt: skip
    # Alive, and it knows the run is over: worker 0 gave up (its client closed), so step 0 can never close.
    with pytest.raises(ServerError, match=r"worker 0 disconnected and mode='sync' needs 2 of 2 workers per step"):
        late.push([3 * torch.ones(6)], [0], [{"lr": 0.5}])


def test_backup_workers_name_every_worker_missing_from_the_quorum(server):
    """3 workers, backup_workers=1, only worker 0 pushed: workers 1 and 2 are named, with the quorum rule."""
    init(server.address, num_workers=3, backup_workers=1)
    waiting = worker(server.address, 0)
    _silent = [worker(server.address, w) for w in (1, 2)]
    with pytest.raises(WorkerStalled, match=rf"worker 1 \({me()}; .*\), worker 2 \({me()}; .*\) have not pushed step 0 "
                                            r"for [\d.]+ s: they are stopped, hung or dead; parameter server 0 is alive "
                                            r"\(a sync step needs 2 of 3 workers' gradients \(backup_workers=1\); 1 arrived\)"):  # fmt: skip
        waiting.push([torch.ones(6)], [0], [{"lr": 0.5}], pull=True)


def test_ssp_names_the_worker_beyond_the_staleness_bound(server):
    """SSP with staleness=0: worker 0 finished clock 1, worker 1 never pushed: the pull names worker 1 and the bound."""
    init(server.address, mode="ssp", staleness=0)
    waiting, _silent = worker(server.address, 0), worker(server.address, 1)
    with pytest.raises(WorkerStalled, match=rf"worker 1 \({me()}; last heard from [\d.]+ s ago\) has not reached clock 1 "
                                            r"\(worker 0 is at clock 1\) for [\d.]+ s: it is stopped, hung or dead; "
                                            r"parameter server 0 is alive \(mode='ssp' holds a worker until no worker is "
                                            r"more than staleness=0 clocks behind\)"):  # fmt: skip
        waiting.push([torch.ones(6)], [0], [{"lr": 0.5}], pull=True)


def test_a_worker_that_sent_no_pid_or_host_is_named_by_its_address(server):
    """A HELLO without pid and host (a hand-written or older client): the worker is named by the address it came from."""
    init(server.address)
    waiting = worker(server.address, 0)
    silent = ServerConnection(0, server.address)
    silent.request(Kind.HELLO, {"worker": 1})
    with pytest.raises(WorkerStalled, match=r"worker 1 \(connected from 127\.0\.0\.1:\d+; last heard from"):
        waiting.push([torch.ones(6)], [0], [{"lr": 0.5}], pull=True)


def test_a_request_answered_in_time_is_not_affected_by_patience(server):
    """Both workers push: the step closes and both get the new shard (patience only matters while waiting)."""
    init(server.address)
    a, b = worker(server.address, 0), worker(server.address, 1)
    a_conn = a.connections[0]
    a_conn.send(Kind.PUSHPULL, {"worker": 0, "version": 0, "hparams": [{"lr": 0.5}], "patience": 30.0}, torch.ones(6))
    b.push([3 * torch.ones(6)], [0], [{"lr": 0.5}])
    kind, meta, payload, _ = recv_message(a_conn.sock, timeout=30)
    assert kind == Kind.REPLY and meta["version"] == 1


@pytest.mark.parametrize("patience", ["x", True, 0, -1.0, math.inf, 1e8, [1]])
def test_a_bad_patience_is_refused_and_consumes_no_step(server, patience):
    """patience must be a finite number of seconds in (0, 1e7]: anything else is refused, naming it; the step stays open."""
    admin = init(server.address)
    a = worker(server.address, 0)
    conn = a.connections[0]
    conn.send(Kind.PUSHPULL, {"worker": 0, "version": 0, "hparams": [{"lr": 0.5}], "patience": patience}, torch.ones(6))
    kind, meta, _, _ = recv_message(conn.sock, timeout=10)
    assert kind == Kind.ERROR and "patience=" in meta["message"] and "seconds in (0, 1e+07]" in meta["message"]
    state = loads_state(admin.request(Kind.GET_STATE, {})[1])  # refused mid-step: no gradient of step 0 is held
    assert state["version"] == 0 and state["aggregator"]["step"] == 0


@pytest.mark.parametrize(
    "field, value",
    [("pid", "42"), ("pid", 0), ("pid", 1 << 31), ("pid", True), ("host", ""), ("host", "h" * 256),
     ("host", "bad\nhost"), ("host", "h\u00e9te"), ("host", 7)],
)  # fmt: skip
def test_hello_refuses_a_bad_pid_or_host(server, field, value):
    """HELLO's pid (an int >= 1) and host (printable ASCII, 1 to 255 characters) are checked, naming the field."""
    init(server.address)
    conn = ServerConnection(0, server.address)
    with pytest.raises(ServerError, match=rf"refused HELLO: RequestRefused: HELLO: {field}=.*: {field} must be"):
        conn.request(Kind.HELLO, {"worker": 0, field: value})
    conn.close()


def test_a_stopped_server_is_blamed_after_the_grace(server):
    """SIGSTOP the server: a waiting request fails after timeout + wait_grace, naming the server as stopped or hung."""
    import signal

    from lightning_pdist.core.ps_client import ServerUnavailable

    init(server.address)
    client = ParameterServerClient([server.address], 0, timeout=0.5, wait_grace=0.5)
    client.hello()
    os.kill(server.pid, signal.SIGSTOP)
    try:
        with pytest.raises(ServerUnavailable, match=rf"parameter server 0 at {re.escape(server.address)} did not answer "
                                                    r"PUSHPULL within 1 s; a live server answers a waiting request after "
                                                    r"0.5 s, .* so this server is stopped, hung or unreachable"):  # fmt: skip
            client.push([torch.ones(6)], [0], [{"lr": 0.5}], pull=True)
    finally:
        os.kill(server.pid, signal.SIGCONT)
