"""tests/_ranks.py: a failing rank's exception reaches the test with its traceback; a hang is killed at the timeout."""

import time

import pytest
import torch
import torch.distributed as dist
from _ranks import run_ranks


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
