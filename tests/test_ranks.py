"""tests/_ranks.py: a failing rank's exception reaches the test with its traceback; a hang is killed at the timeout;
a held port is the ranks' and nobody else's."""

import os
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _ranks import held_master_port, held_port, run_ranks


def _sum(rank, world_size, out):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    torch.save(t, f"{out}/rank{rank}.pt")


def _rank1_fails(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 refuses")
    dist.barrier()  # rank 0 waits for a rank that is gone: run_ranks kills it


def _rank0_hangs(rank, world_size):
    if rank == 0:
        time.sleep(600)


def test_ranks_meet_in_one_group(tmp_path):
    """3 ranks all-reduce 1 + 2 + 3 = 6 on the file:// rendezvous."""
    run_ranks(_sum, 3, tmp_path, str(tmp_path))
    assert [torch.load(tmp_path / f"rank{r}.pt").item() for r in range(3)] == [6.0] * 3


def test_the_failing_ranks_exception_is_raised_with_its_traceback(tmp_path):
    """Rank 1's ValueError is re-raised in the test, its traceback in a note; rank 0 (blocked) is killed."""
    with pytest.raises(ValueError, match="rank 1 refuses") as caught:
        run_ranks(_rank1_fails, 2, tmp_path, timeout=60)
    note = "\n".join(getattr(caught.value, "__notes__", []))
    assert "raised on rank 1 of 2" in note and "_rank1_fails" in note


def test_a_hung_rank_is_killed_at_the_timeout(tmp_path):
    """A rank that never returns: TimeoutError naming it after the timeout, not a hung test."""
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0\] of 2 still running after 3 s"):
        run_ranks(_rank0_hangs, 2, tmp_path, timeout=3)
    assert time.monotonic() - start < 30


def test_a_held_port_is_refused_to_others_and_given_to_the_ranks_store():
    """While held: a bind without SO_REUSEADDR (IPv4 or IPv6) is refused, 2,000 binds to port 0 and 200 outgoing
    connections never get it (a held port of 2 of ~28,000 ephemeral ones: ~140 and ~14 hits expected by chance),
    and torch's store (rank 0's, SO_REUSEADDR) listens on it and serves."""
    with held_port(2) as first:
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
            with socket.socket(family) as other, pytest.raises(OSError, match="in use"):
                other.bind((host, first + 1))
        drawn = set()
        for _ in range(2000):
            with socket.socket() as other:
                other.bind(("127.0.0.1", 0))
                drawn.add(other.getsockname()[1])
        with socket.create_server(("127.0.0.1", 0)) as listener:
            for _ in range(200):
                with socket.create_connection(listener.getsockname()) as client:
                    drawn.add(client.getsockname()[1])
                    listener.accept()[0].close()
        assert not drawn & {first, first + 1}
        store = dist.TCPStore("127.0.0.1", first, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
        store.set("k", "v")
        assert dist.TCPStore("127.0.0.1", first, 1, False, timeout=timedelta(seconds=10)).get("k") == b"v"
        del store


def _env_port(rank, world_size, out):
    with open(f"{out}/rank{rank}", "w") as f:
        f.write(f"{os.environ['MASTER_PORT']} {dist.is_initialized()}")


def test_ranks_without_a_group_inherit_the_held_master_port(tmp_path, master_port):
    """group=False: no process group in the ranks, and the test's MASTER_PORT (held by conftest) in their environment;
    held_master_port() swaps in a port of its own for the block and puts the test's back."""
    run_ranks(_env_port, 2, tmp_path, str(tmp_path), group=False)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == [f"{master_port} False"] * 2
    with held_master_port() as port:
        assert port != master_port and os.environ["MASTER_PORT"] == str(port)
    assert os.environ["MASTER_PORT"] == str(master_port)
