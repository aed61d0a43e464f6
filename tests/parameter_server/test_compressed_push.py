"""Compressed parameter-server pushes: the codec's bounds, a hostile frame against a real server, and real runs.

Every reference is plain torch written here: top-k with error feedback per parameter slice on each worker, the
server's mean and SGD step; QSGD's stochastic rounding from the worker's seeded generator; the payload's byte model
from the format (header, Zstandard of the byte-shuffled uint32 gaps, fp32 values).
"""

import math
import re
import socket
import struct

import numpy as np
import pytest
import torch
import zstandard
from _helpers import TinyRegression, fit, make_net, rank_batches, regression_data
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_pdist import ParameterServerStrategy
from lightning_pdist.compression import BF16, DGC, FP16, QSGD, PowerSGD, RandomK, Sign, TernGrad, TopK
from lightning_pdist.core.push_codec import PushFormatError, decode_push
from lightning_pdist.core.ps_client import ParameterServerClient, ServerConnection, ServerError
from lightning_pdist.parameter_server.coded_push import PushCompressor
from lightning_pdist.parameter_server.layout import OptimizerLayout
from lightning_pdist.parameter_server.process import start_server
from lightning_pdist.parameter_server.sharding import param_specs, plan_sharding
from lightning_pdist.core.ps_wire import HEADER, MAGIC, Kind, recv_message

ZSTD = zstandard.ZstdCompressor(level=3, write_checksum=False, write_content_size=True, write_dict_id=False)


def flat(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def ps(**kwargs) -> ParameterServerStrategy:
    return ParameterServerStrategy(start_method="fork", **kwargs)


def coded_indices(idx: torch.Tensor) -> bytes:
    """The format's index coding, from its description: uint32 gaps, byte-shuffled, one Zstandard frame."""
    if idx.numel() == 0:
        return b""
    gaps = np.diff(np.sort(idx.numpy()), prepend=-1) - 1
    return ZSTD.compress(np.ascontiguousarray(gaps.astype("<u4").view(np.uint8).reshape(-1, 4).T).tobytes())


def sparse_bytes(idx: torch.Tensor, values: torch.Tensor) -> bytes:
    coded = coded_indices(idx)
    return struct.pack("<BBII", 1, 0, idx.numel(), len(coded)) + coded + values.float().numpy().astype("<f4").tobytes()


# ---------------------------------------------------------------------- tier 1: refusals and the decoder's bounds


@pytest.mark.parametrize("kwargs, error, match", [
    ({"compression": PowerSGD()}, ValueError, r"ParameterServerStrategy\(compression=PowerSGD\(.*\)\): "
     r"ParameterServerStrategy compresses pushes, which PowerSGD cannot carry .*: PowerSGD needs an all-reduce"),
    ({"compression": "topk"}, TypeError, r"ParameterServerStrategy\(compression='topk'\): compression must be None or "
     r"a compressor from lightning_pdist.compression"),
    ({"compression": TopK(0.1), "mode": "easgd"}, ValueError, r"ParameterServerStrategy\(compression=TopK\(.*\), "
     r"mode='easgd'\): compression compresses gradient pushes, and mode='easgd' pushes none"),
])  # fmt: skip
def test_compressions_the_servers_cannot_use_are_refused(kwargs, error, match):
    """PowerSGD (needs an all-reduce), a string, and compression with mode='easgd' are refused with the rule."""
    with pytest.raises(error, match=match):
        ParameterServerStrategy(**kwargs)


@pytest.mark.parametrize("compressor", [TopK(0.2), TopK(1.0, values="fp16"), RandomK(0.3), DGC(0.2, momentum=0.5),
                                        QSGD(4), QSGD(300), TernGrad(), Sign(), FP16(), BF16()], ids=repr)  # fmt: skip
def test_every_push_form_decodes_to_what_the_worker_kept(compressor):
    """For every compressor: the server's decode of a push is exactly the x̂ the worker subtracted from x + e."""
    state = compressor.new_state()
    for step in range(3):
        g = torch.randn(37, generator=torch.Generator().manual_seed(step))
        before = state.tensors.get("residual", {}).get("k", torch.zeros(37)).clone()
        data, own = compressor.compress_push(g, "k", state, rank=1, world_size=2)
        decoded, end = decode_push(data + b"tail", 37)
        assert end == len(data) and torch.equal(decoded, own)
        if compressor.error_feedback and not isinstance(compressor, DGC):
            torch.testing.assert_close(state.tensors["residual"]["k"], g + before - own, atol=0, rtol=0)


def test_topk_payload_bytes_follow_the_format():
    """A top-k push is 10 header bytes, the coded indices and k fp32 values: byte for byte the format."""
    g = torch.randn(50, generator=torch.Generator().manual_seed(0))
    data, own = TopK(0.1).compress_push(g, "k", TopK(0.1).new_state(), 0, 1)
    idx = g.abs().topk(5).indices.sort().values
    assert data == sparse_bytes(idx, g[idx])


BAD = [  # (payload for a 6-element tensor, what the error names)
    (struct.pack("<BBII", 1, 0, 7, 0), r"k=7: a sparse push of a tensor of 6 elements carries at most 6"),
    (struct.pack("<BBII", 1, 0, 2, 1 << 30), r"coded indices: 1073741824 bytes needed"),
    (struct.pack("<BBII", 1, 5, 1, 0), r"value dtype code 5"),
    (sparse_bytes(torch.tensor([1, 9]), torch.ones(2)), r"position 9 is outside the tensor of 6 elements"),
    (sparse_bytes(torch.tensor([1, 2]), torch.ones(2))[:-1], r"values: 8 bytes needed"),
    (struct.pack("<BBII", 1, 0, 2, 0) + bytes(8), r"indices: not a Zstandard frame"),
    # a frame that declares 2^40 bytes of content: refused from its header, before zstd allocates anything
    (struct.pack("<BBII", 1, 0, 2, 16) + bytes.fromhex("28b52ffd") + bytes([0xE0]) + (1 << 40).to_bytes(8, "little")
     + bytes(3) + bytes(8), r"the frame declares 1099511627776 bytes; 8 expected"),
    (struct.pack("<BBffI", 2, 0, math.inf, 1.0, 0), r"scale=inf: must be finite"),
    (struct.pack("<BBffI", 2, 0, 1.0, 0.0, 0), r"divisor=0.0: must be a finite number > 0"),
    (struct.pack("<BB", 3, 1) + bytes(11), r"values: 12 bytes needed"),
    (bytes([9]), r"form 9: must be 1 \(sparse\), 2 \(levels\) or 3 \(dense\)"),
    (b"", r"form: 1 bytes needed"),
]


@pytest.mark.parametrize("payload, match", BAD, ids=[m[:24] for _, m in BAD])
def test_the_decoder_refuses_malformed_pushes_before_allocating(payload, match):
    """Each malformed push is refused naming the field and rule; nothing larger than the tensor is allocated."""
    with pytest.raises(PushFormatError, match=match):
        decode_push(payload, 6)


# ---------------------------------------------------------------------- tier 2: a real server, raw bad frames


def test_a_hostile_compressed_push_gets_an_error_and_the_server_carries_on():
    """Sync, 2 workers, a real server: every malformed PUSHPULL_CODED (and trailing bytes, and an absurd declared
    length) is refused by name without consuming the step; a good coded push and a plain push then close it."""
    handle = start_server(0)
    try:
        admin = ServerConnection(0, handle.address, timeout=10)
        admin.request(Kind.INIT, {"mode": "sync", "num_workers": 2, "dtype": "torch.float32", "segments": [[0, 2], [0, 4]],
                                  "optimizer": "SGD", "param_groups": [{"lr": 1.0}]}, torch.zeros(6))  # fmt: skip
        bad = ServerConnection(0, handle.address, timeout=10)
        bad.request(Kind.HELLO, {"worker": 0})
        meta = {"worker": 0, "version": 0, "hparams": [{"lr": 1.0}]}
        two = sparse_bytes(torch.tensor([1]), torch.ones(1))  # a good first piece (2 elements)
        piece1 = re.escape("compressed piece 1 (4 elements): ")
        cases = [(two + payload, piece1 + ".*" + match) for payload, match in BAD if "6 elements" not in match
                 and "12 bytes" not in match]  # fmt: skip
        whole = two + sparse_bytes(torch.tensor([0]), torch.ones(1))
        cases += [(whole + b"x", f"compressed payload of {len(whole) + 1} bytes; its pieces end at byte {len(whole)}"),
                  (two + sparse_bytes(torch.tensor([4]), torch.ones(1)), piece1 + r".*position 4 is outside"),
                  (sparse_bytes(torch.tensor([0, 1, 2]), torch.ones(3)), re.escape("compressed piece 0 (2 elements): k=3"))]
        assert len(cases) == 12
        for payload, match in cases:
            with pytest.raises(ServerError, match=r"refused PUSHPULL_CODED: RequestRefused: PUSHPULL_CODED: " + match):
                bad.request(Kind.PUSHPULL_CODED, meta, payload)
        host, _, port = handle.address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:  # an absurd declared length
            sock.sendall(HEADER.pack(MAGIC, int(Kind.PUSH_CODED), 2, 1 << 40) + b"{}")
            kind, reply, _, _ = recv_message(sock, timeout=10)
            assert kind == Kind.ERROR and "takes at most" in reply["message"], reply
        good = ParameterServerClient([handle.address], 1, timeout=10)
        good.hello()
        step = sparse_bytes(torch.tensor([0]), torch.tensor([4.0])) + sparse_bytes(torch.tensor([3]), torch.tensor([2.0]))
        _, ack = good.push([step], [0], [{"lr": 1.0}], coded=True)
        assert ack[0]["accepted"] and ack[0]["contributors"] == []  # still open: no bad push consumed the step
        bad.request(Kind.PUSH, meta, torch.ones(6))
        shards, metas = good.pull(wait_version=1)
        torch.testing.assert_close(shards[0], -torch.tensor([2.5, 0.5, 0.5, 0.5, 0.5, 1.5]))  # -(x̂ + 1) / 2
        assert handle.poll() is None
        good.close(), bad.close(), admin.close()
    finally:
        handle.stop(timeout=5)


# ---------------------------------------------------------------------- tier 3: real runs against plain torch


def topk_reference(steps: int, ratio: float, n: int = 24, lr: float = 0.1, world: int = 2):
    """Sync PS, per-parameter top-k of g + e on each worker, e ← (g + e) − sent, server: w ← w − lr·mean(sent)."""
    net, data = make_net(), regression_data(n)
    per_epoch = n // world // 4
    residual = [[torch.zeros(p.numel()) for p in net.parameters()] for _ in range(world)]
    sent_sum = [[torch.zeros(p.numel(), dtype=torch.float64) for p in net.parameters()] for _ in range(world)]
    grad_sum = [[torch.zeros(p.numel(), dtype=torch.float64) for p in net.parameters()] for _ in range(world)]
    payloads = []  # per step, per worker: the payload's byte model
    for t in range(steps):
        epoch, i = divmod(t, per_epoch)
        mean = [torch.zeros(p.numel()) for p in net.parameters()]
        payloads.append([])
        for r in range(world):
            x, y = rank_batches(data, r, world, 4, epoch)[i]
            net.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            size = 0
            for j, p in enumerate(net.parameters()):
                g = p.grad.reshape(-1)
                v = g + residual[r][j]
                k = math.ceil(ratio * v.numel())
                idx = v.abs().topk(k).indices
                sent = torch.zeros_like(v)
                sent[idx] = v[idx]
                residual[r][j] = v - sent
                mean[j] += sent / world
                sent_sum[r][j] += sent.double()
                grad_sum[r][j] += g.double()
                size += 10 + len(coded_indices(idx)) + 4 * k
            payloads[-1].append(size)
        with torch.no_grad():
            for p, m in zip(net.parameters(), mean):
                p -= lr * m.view_as(p)
    return net, residual, sent_sum, grad_sum, payloads


class RecordPushes(Callback):
    """Each worker saves, per step, its coded payload bytes and logged push bytes; at the end, its residuals."""

    def __init__(self, path):
        self.path, self.steps = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        strategy = trainer.strategy
        self.steps.append((strategy.push_compressor.payload_bytes, strategy.comm_meter.by_kind["ps_push"]))

    def on_train_end(self, trainer, pl_module):
        names = [n for n, _ in pl_module.named_parameters()]
        residual = trainer.strategy.push_compressor.state.tensors["residual"]
        torch.save({"steps": self.steps, "residual": [residual[f"0/0/{n}"].clone() for n in names]},
                   self.path / f"rank{trainer.global_rank}.pt")  # fmt: skip


def test_topk_ratio_one_equals_the_uncompressed_ps():
    """TopK(1.0) on 2 workers and 2 servers (a tensor cut between them): bit for bit the uncompressed PS, and where
    plain-torch sync SGD ends, with zero residuals."""
    model, plain = TinyRegression(), TinyRegression()
    fit(ps(num_servers=2, compression=TopK(1.0)), model, max_steps=6)
    fit(ps(num_servers=2), plain, max_steps=6)
    assert torch.equal(flat(model), flat(plain))
    net, residual, *_ = topk_reference(6, 1.0, n=64)
    torch.testing.assert_close(flat(model), flat(net), atol=1e-6, rtol=0)
    assert all(float(e.abs().max()) == 0.0 for per_rank in residual for e in per_rank)


def test_topk_error_feedback_resumes_exactly_telescopes_and_counts_its_bytes(tmp_path):
    """TopK(0.25), sync, 2 workers: stopped at step 3 and resumed to 8, the weights equal plain-torch top-k with
    error feedback (1e-6); each worker's checkpointed residual is the reference's, and Σ sent + e =
    Σ g on each worker; every push's payload bytes equal the byte model, and the logged push bytes exceed it only by
    one frame header and its JSON metadata."""
    model = lambda: TinyRegression(n=24)  # noqa: E731  (3 steps per epoch on 2 workers)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    fit(ps(num_servers=1, compression=TopK(0.25)), model(), max_steps=3, callbacks=[ckpt, RecordPushes(tmp_path)],
        enable_checkpointing=True, limit_val_batches=1)  # fmt: skip
    resumed = model()
    fit(ps(num_servers=1, compression=TopK(0.25)), resumed, max_steps=8, ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt"),
        limit_val_batches=1)  # fmt: skip
    net, *_ = topk_reference(8, 0.25)
    torch.testing.assert_close(flat(resumed), flat(net), atol=1e-6, rtol=0)
    _, residual, sent_sum, grad_sum, payloads = topk_reference(3, 0.25)
    for r in range(2):
        saved = torch.load(tmp_path / f"rank{r}.pt")
        for j, e in enumerate(saved["residual"]):
            torch.testing.assert_close(e.reshape(-1), residual[r][j], atol=1e-6, rtol=0)
            torch.testing.assert_close(sent_sum[r][j] + e.reshape(-1).double(), grad_sum[r][j], atol=1e-6, rtol=0)
        before = (0, 0)
        for t, (payload, logged) in enumerate(saved["steps"]):
            assert payload - before[0] == payloads[t][r], (r, t)
            assert HEADER.size < logged - before[1] - payloads[t][r] < HEADER.size + 512, (r, t, logged)
            before = (payload, logged)


def test_async_qsgd_pushes_equal_plain_torch_qsgd():
    """Async, one worker, QSGD(4 levels, seed 3): the servers apply exactly the worker's seeded stochastic rounding."""
    model = TinyRegression()
    fit(ps(mode="async", num_servers=1, compression=QSGD(4, seed=3)), model, devices=1, max_steps=6)
    net = make_net()
    generator = torch.Generator().manual_seed(3 * 1_000_003 + 0)
    for x, y in rank_batches(regression_data(64), 0, 1, 4)[:6]:
        net.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        with torch.no_grad():
            for p in net.parameters():
                g = p.grad.reshape(-1)
                norm = float(g.norm())
                scaled = g.abs() / norm * 4
                low = scaled.floor()
                level = (low + (torch.rand(g.shape, generator=generator) < scaled - low).float()) * torch.where(g < 0, -1.0, 1.0)
                p -= 0.1 * (level * (norm / 4)).view_as(p)
    torch.testing.assert_close(flat(model), flat(net), atol=1e-6, rtol=0)


def test_a_slice_without_gradient_sends_nothing_and_keeps_its_residual():
    """Worker side, 2 servers (a tensor cut between them): each slice is compressed on its own, keyed by optimizer,
    server and parameter; a parameter without gradient is absent from the push and its residual waits; the state
    round-trips through state_dict."""
    net = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    plan = plan_sharding(param_specs(net), 2, "memory")
    layout = OptimizerLayout(list(net.named_parameters()), [torch.optim.SGD(net.parameters(), lr=0.1)], plan)
    coder = PushCompressor(TopK(0.5), layout, rank=0, world_size=2)
    grads = {n: torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, (n, p) in enumerate(net.named_parameters())}
    for server in range(2):
        payload, present = coder.pack(server, 0, grads)
        slices = layout.slices(server, 0)
        assert present == "1" * len(slices)
        offset = 0
        for name, start, stop in slices:
            g = grads[name].reshape(-1)[start:stop]
            decoded, offset = decode_push(payload, stop - start, offset)
            k = math.ceil(0.5 * (stop - start))
            idx = g.abs().topk(k).indices
            assert torch.equal(decoded[idx], g[idx]) and int((decoded != 0).sum()) == k
            torch.testing.assert_close(coder.state.tensors["residual"][f"0/{server}/{name}"], g - decoded, atol=0, rtol=0)
        assert offset == len(payload)
    kept = {k: v.clone() for k, v in coder.state.tensors["residual"].items()}
    payload, present = coder.pack(0, 0, {**grads, "0.weight": None})
    assert present[0] == "0" and all(torch.equal(kept[k], v) for k, v in coder.state.tensors["residual"].items() if "0.weight" in k)
    again = PushCompressor(TopK(0.5), layout, rank=0, world_size=2)
    again.load_state_dict(coder.state_dict())
    assert again.payload_bytes == coder.payload_bytes and again.state.tensors["residual"].keys() == kept.keys()
