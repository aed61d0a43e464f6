"""Tier 2: the pipeline's framed point-to-point messages between two gloo ranks, good and hostile.

Rank 1 sends crafted frames; rank 0's receive must refuse each one, naming the sender and the rule,
before allocating an announced payload.
"""

import pytest
import torch
import torch.distributed as dist
from _ranks import run_ranks

from lightning_pdist.core.accounting import CommMeter
from lightning_pdist.pipeline.p2p import ANNOUNCE, BACKWARD, DATA, FORWARD, HEADER_BYTES, HEADER_LEN, MAGIC, P2P

LIMIT = 1 << 20


def frame(magic=MAGIC, stream=FORWARD, microbatch=0, version=0, code=0, shape=(2, 3), kind=DATA, size=24):
    """A raw frame as the receiver expects it after (2, 3) fp32 messages: 128-byte header + 24 bytes."""
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[:6] = torch.tensor([magic, stream, microbatch, version, code, len(shape)])
    h[6 : 6 + len(shape)] = torch.tensor(shape)
    h[14] = kind
    return torch.cat([h.view(torch.uint8), torch.zeros(size, dtype=torch.uint8)])


HOSTILE = {
    "bad_magic": frame(magic=0x1234),
    "huge": frame(shape=(1 << 20, 1 << 20), kind=ANNOUNCE),  # 4 TiB announced
    "bad_dtype": frame(code=99),
    "bad_ndim": frame(shape=()).index_fill_(0, torch.tensor([40]), 42),  # ndim field (int64 #5, low byte)
    "negative": frame(shape=(2, -3)),
    "bad_kind": frame(kind=7),
    "wrong_shape": frame(shape=(3, 2)),
    "wrong_microbatch": frame(microbatch=7),
}


def _worker(rank, world_size, out):
    meter = CommMeter()
    p2p = P2P(None, max_message_bytes=LIMIT, meter=meter)
    results = {}
    if rank == 1:
        for j in range(3):
            p2p.send(torch.full((2, 3), float(j)), dst=0, stream=FORWARD, microbatch=j, version=10 + j)
        p2p.send(torch.ones(4, dtype=torch.bfloat16), dst=0, stream=BACKWARD, microbatch=5)
        for raw in HOSTILE.values():
            dist.send(raw, dst=0, tag=FORWARD)
        p2p.wait_all()
        results["bytes"] = meter.total_bytes
    else:
        # 0: a plain receive; 1 and 2: posted ahead (P2P.post), as the executor does once it knows a frame will come
        got = [p2p.recv(1, FORWARD, 0)]
        for j in (1, 2):
            p2p.post(1, FORWARD, j)
            p2p.post(1, FORWARD, j)  # posting twice is one receive
            got.append(p2p.recv(1, FORWARD, j))
        results["forward"] = [(m.tensor.clone(), m.microbatch, m.version) for m in got]
        p2p.post(1, BACKWARD, 5)  # a first message: what arrives in the posted frame is the announce of its shape
        results["backward"] = p2p.recv(1, BACKWARD, 5).tensor.clone()
        results["posted_left"] = p2p.posted
        for name in HOSTILE:
            try:
                p2p.recv(1, FORWARD, 0)
                results[name] = "accepted"
            except RuntimeError as err:
                results[name] = str(err)
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.barrier()


@pytest.fixture(scope="module")
def exchange(tmp_path_factory):
    out = tmp_path_factory.mktemp("p2p")
    run_ranks(_worker, 2, out, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_messages_arrive_in_order_with_their_ids(exchange):
    """Tensors, micro-batch ids and version ids arrive as sent, per stream, through a plain receive or one posted
    ahead (an announce landing in a posted frame included); bf16 keeps its dtype."""
    received = exchange[0]
    for j, (tensor, microbatch, version) in enumerate(received["forward"]):
        assert torch.equal(tensor, torch.full((2, 3), float(j))) and (microbatch, version) == (j, 10 + j)
    assert received["backward"].dtype == torch.bfloat16 and torch.equal(received["backward"], torch.ones(4, dtype=torch.bfloat16))
    assert received["posted_left"] == 0


def test_sender_counts_frames_one_per_message_while_shapes_repeat(exchange):
    """A message is one 128-byte header + payload frame; a new shape costs one announce frame of the old size."""
    assert exchange[1]["bytes"] == (HEADER_BYTES + 3 * (HEADER_BYTES + 6 * 4)) + (HEADER_BYTES + HEADER_BYTES + 4 * 2)


@pytest.mark.parametrize(
    "name, match",
    [("bad_magic", r"from rank 1: bad header \(magic 0x1234"), ("huge", r"exceeds max_message_bytes=1048576"),
     ("bad_dtype", r"bad header \(dtype code 99"), ("bad_ndim", r"bad header \(dtype code 0, ndim 42, kind 0\)"),
     ("negative", r"negative shape \[2, -3\]"), ("bad_kind", r"kind 7\)"),
     ("wrong_shape", r"expected a data frame of shape \(0, \(2, 3\)\), got kind 0 with \(0, \(3, 2\)\)"),
     ("wrong_microbatch", r"got micro-batch 7 on stream 0, the schedule expects 0")],
)  # fmt: skip
def test_hostile_headers_are_refused_before_allocation(exchange, name, match):
    """A corrupt or hostile header is refused with the sender and the rule (a 4 TiB claim allocates nothing)."""
    import re

    assert re.search(match, exchange[0][name]), exchange[0][name]


def test_unsupported_dtype_and_rank_are_refused_before_sending():
    """The sender refuses what the header cannot describe."""
    p2p = P2P(None)
    with pytest.raises(TypeError, match="cannot send dtype torch.complex64"):
        p2p.send(torch.zeros(2, dtype=torch.complex64), dst=1, stream=FORWARD, microbatch=0)
    with pytest.raises(ValueError, match="tensor of 9 dims; at most 8"):
        p2p.send(torch.zeros([1] * 9), dst=1, stream=FORWARD, microbatch=0)

