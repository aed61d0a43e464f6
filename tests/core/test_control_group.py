"""Tier 2: a strategy's private gloo group (ControlGroup: PS workers, Hogwild! processes) on 3 real ranks over loopback."""

import json
import os
from datetime import timedelta

from _ranks import run_ranks

from lightning_pdist.core.control_group import ControlGroup


def _gather(rank: int, world_size: int, out: str) -> None:
    group = ControlGroup("127.0.0.1", int(os.environ["MASTER_PORT"]), rank, world_size, timeout=timedelta(seconds=60))
    # objects of different pickled sizes, one of them None (a worker with nothing to report)
    mine = None if rank == 1 else {"rank": rank, "payload": "x" * (10 * rank)}
    gathered = group.all_gather_object(mine)
    group.close()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(gathered, f)


def test_all_gather_object_returns_every_workers_object_in_rank_order(tmp_path):
    """all_gather_object: every rank gets every rank's object (sizes differ, None included), in rank order."""
    out = str(tmp_path / "gathered")
    run_ranks(_gather, 3, tmp_path, out, group=False)  # rank 0's store binds the test's held port
    expected = [{"rank": 0, "payload": ""}, None, {"rank": 2, "payload": "x" * 20}]
    for rank in range(3):
        with open(f"{out}.{rank}") as f:
            assert json.load(f) == expected


def test_one_worker_gathers_its_own_object():
    """With world_size 1 there is no group: the gather is the object itself."""
    assert ControlGroup("127.0.0.1", 0, 0, 1).all_gather_object(("secret", None)) == [("secret", None)]


def test_the_store_listens_on_ipv4_for_an_ipv4_host_and_as_torch_does_otherwise(master_port):
    """Rank 0's store takes an IPv4 listener for an IPv4 host (its peers then have plain IPv4 addresses, which torch
    names without a reverse DNS query for an IPv4-mapped one); a host name or an IPv6 address leaves it to torch."""
    import socket

    from lightning_pdist.core.control_group import _ipv4_listener

    assert _ipv4_listener("localhost", master_port) is None and _ipv4_listener("::1", master_port) is None
    port = master_port
    listener = socket.socket(fileno=_ipv4_listener("127.0.0.1", port))
    try:
        assert listener.family == socket.AF_INET and listener.getsockname() == ("0.0.0.0", port)
    finally:
        listener.close()
