"""A process whose DDP hook callback is still in flight on gloo's thread ends cleanly (core/hooks.py).

Two real processes, gloo, rendezvous through a file. Rank 1 hands a callback to gloo (``handed_then``, as the DDP
hooks do) for an all-reduce that rank 0 joins only a second later, then reaches the end of its script. Without
:func:`~lightning_pdist.core.hooks.settle_comm_callbacks` at exit the callback runs while the interpreter finalizes,
and the process aborts ("terminate called without an active exception", SIGABRT: tried by removing the ``atexit``
line); with it, rank 1 waits for the callback and exits with 0.
"""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys, time
    import torch, torch.distributed as dist
    from lightning_pdist.core.hooks import handed_then, settle_comm_callbacks

    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
    dist.barrier()
    if rank == 0:
        time.sleep(1.0)
        dist.all_reduce(torch.ones(8))
        dist.destroy_process_group()
    else:
        seen = []
        fut = handed_then(dist.group.WORLD.allreduce([torch.ones(8)]).get_future(), lambda f: seen.append(1))
        assert settle_comm_callbacks(timeout=0.2) is False  # rank 0 has not joined yet: still in flight
        print("rank 1 leaves with a callback in flight", flush=True)
""")


def test_a_rank_ends_cleanly_with_a_hook_callback_still_in_flight(tmp_path):
    script = tmp_path / "in_flight.py"
    script.write_text(SCRIPT)
    ranks = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "rendezvous")], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]  # fmt: skip
    try:
        outs = [p.communicate(timeout=60) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert "callback in flight" in outs[1][0]
    assert [p.returncode for p in ranks] == [0, 0], [err[-2000:] for _, err in outs]
    assert "terminate called" not in outs[1][1]
