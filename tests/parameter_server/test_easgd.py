"""Asynchronous EASGD / EAMSGD on the parameter servers (``ParameterServerStrategy(mode="easgd")``).

Tier 2: a real server process and raw clients (the exchange rule, conservation, the swap at α = 1, hostile frames).
Tier 3: real Lightning fits with real servers (one worker against the rule in plain torch, resumed mid-period;
two workers: the module holds the center at validation, checkpoints and the end, each worker resumes its own state).
"""

import math
import socket
from pathlib import Path

import pytest
import torch
from _helpers import TinyRegression, closed_by_server, fit, make_net, rank_batches, regression_data
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_pdist import ParameterServerStrategy
from lightning_pdist.core.ps_client import ParameterServerClient, ServerConnection, ServerError
from lightning_pdist.parameter_server.process import start_server
from lightning_pdist.core.ps_wire import HEADER, MAGIC, Kind, dumps_state, loads_state, recv_message

TIMEOUT = 10.0
SECRET = bytes(range(32))


def init(address, alpha, center, num_workers=2, mode="easgd", secret=None):
    admin = ServerConnection(0, address, timeout=TIMEOUT, secret=secret)
    meta = {"mode": mode, "num_workers": num_workers, "dtype": "torch.float32", "segments": [[-1, -1, center.numel()]],
            "alpha": alpha}  # fmt: skip
    if mode != "easgd":
        meta.update(segments=[[0, center.numel()]], optimizer="SGD", param_groups=[{"lr": 0.1}])
    admin.request(Kind.INIT, meta, center)
    return admin


def center_of(admin) -> torch.Tensor:
    return loads_state(admin.request(Kind.GET_STATE, {})[1])["shard"]["values"]


def worker(address, index, secret=None):
    client = ParameterServerClient([address], index, timeout=TIMEOUT, secret=secret)
    client.hello()
    return client


# ---------------------------------------------------------------------- tier 2: the exchange on a real server


def test_each_exchange_conserves_the_sum_and_alpha_one_swaps():
    """Two workers in turn: e = α(x_i − x̃) against the center as it is then, x̃ + e on the server and x_i − e on the
    worker (the same e bit for bit), so x_i + x̃ is conserved; with α = 1 worker and center trade places exactly.
    The server has a secret: an ELASTIC from a peer that skipped the handshake is dropped and moves nothing."""
    g = torch.Generator().manual_seed(0)
    c0, xs = torch.randn(6, generator=g), [torch.randn(6, generator=g) for _ in range(2)]
    server = start_server(0, secret=SECRET)
    try:
        admin = init(server.address, 0.3, c0, secret=SECRET)
        center = c0.clone()
        host, _, port = server.address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:  # no handshake
            sock.sendall(HEADER.pack(MAGIC, int(Kind.ELASTIC), 12, 24) + b'{"worker":0}' + bytes(24))
            assert closed_by_server(sock)
        assert torch.equal(center_of(admin), c0)
        for i, x in enumerate(xs):
            (e,), (meta,) = worker(server.address, i, SECRET).elastic([x])
            expected = (x - center) * 0.3  # written out here: the rule of Zhang et al. 2015, Algorithm 1
            assert torch.equal(e, expected)
            new_center = center_of(admin)
            assert torch.equal(new_center, center + e)  # the server added exactly the e the worker subtracts
            torch.testing.assert_close((x - e) + new_center, x + center, atol=1e-6, rtol=0)  # x_i + x̃ conserved
            assert meta["version"] == i + 1 and meta["exchanges"] == i + 1
            center = new_center
        # α = 1 on dyadic values (every difference exact): the worker gets the center, the center the worker
        c, x = torch.tensor([0.5, 4.0, -1.25, 3.0]), torch.tensor([1.5, -2.25, 8.0, 3.0])
        admin = init(server.address, 1.0, c, num_workers=1, secret=SECRET)
        (e,), _ = worker(server.address, 0, SECRET).elastic([x])
        assert torch.equal(x - e, c) and torch.equal(center_of(admin), x)
    finally:
        server.stop(timeout=5)


def test_malformed_elastic_frames_and_bad_init_are_refused_and_the_server_lives():
    """ELASTIC is bounded like PUSH: a header declaring more than the shard is refused before anything is read; a
    ragged, short or wrongly typed x_i, an ELASTIC to a non-easgd server, a PUSH to an easgd one and an INIT with a
    bad α are refused naming the rule; none changes the center, and a good worker's exchange is then served."""
    c = torch.arange(6, dtype=torch.float32)
    server = start_server(0)
    try:
        admin = init(server.address, 0.5, c, num_workers=1)
        good = worker(server.address, 0)
        host, _, port = server.address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:  # 1 element more than the shard
            sock.sendall(HEADER.pack(MAGIC, int(Kind.ELASTIC), 2, 28) + b"{}" + bytes(28))
            kind, meta, _, _ = recv_message(sock, timeout=TIMEOUT)
            assert kind == Kind.ERROR and "ELASTIC declares payload_len=28; this receiver takes at most 24" in meta["message"]
            assert closed_by_server(sock)
        bad = ServerConnection(0, server.address, timeout=TIMEOUT)
        bad.request(Kind.HELLO, {"worker": 0})
        for meta, payload, match in [
            ({}, bytes(7), r"ELASTIC: .*7 bytes is not a whole number of 4-byte elements"),
            ({}, torch.ones(5), r"ELASTIC: x_i of 5 elements; this shard holds 6"),
            ({"dtype": "torch.float64"}, torch.ones(6), r"ELASTIC: dtype='torch.float64': dtype must be 'torch.float32'"),
            ({"worker": 3}, torch.ones(6), r"ELASTIC: worker=3: this connection said HELLO as worker 0"),
        ]:
            with pytest.raises(ServerError, match=match):
                bad.request(Kind.ELASTIC, meta, payload)
        with pytest.raises(ServerError, match=r"PUSH: this server runs mode='easgd', which takes ELASTIC exchanges"):
            bad.request(Kind.PUSH, {"version": 0}, torch.ones(6))
        for meta, match in [({"alpha": 1.5}, r"INIT: alpha=1.5: alpha must be a number in \(0, 1\]"),
                            ({"alpha": math.nan}, r"INIT: alpha=nan: alpha must be"),
                            ({"segments": [[0, 0, 6]]}, r"mode='easgd' segments must be \[-1, -1, numel\]")]:  # fmt: skip
            with pytest.raises(ServerError, match=match):
                admin.request(Kind.INIT, {"mode": "easgd", "num_workers": 1, "dtype": "torch.float32",
                                          "segments": [[-1, -1, 6]], "alpha": 0.5, **meta}, c)  # fmt: skip
        assert torch.equal(center_of(admin), c)  # nothing refused touched the center
        with pytest.raises(ServerError, match=r"SET_STATE"):  # a resume with a broken elastic state changes nothing
            state = loads_state(admin.request(Kind.GET_STATE, {})[1])
            admin.request(Kind.SET_STATE, {}, dumps_state({**state, "elastic": {"exchanges": -1}}))
        (e,), _ = good.elastic([c + 2])
        assert torch.equal(e, torch.ones(6)) and torch.equal(center_of(admin), c + 1)
        init(server.address, 0.5, c, num_workers=1, mode="async")  # a server of another mode takes no x_i
        async_worker = ServerConnection(0, server.address, timeout=TIMEOUT)
        async_worker.request(Kind.HELLO, {"worker": 0})
        with pytest.raises(ServerError, match=r"ELASTIC: this server runs mode='async'; elastic exchanges need mode='easgd'"):
            async_worker.request(Kind.ELASTIC, {})
        with pytest.raises(Exception, match=r"ELASTIC declares payload_len=24; this receiver takes at most 0 bytes"):
            async_worker.request(Kind.ELASTIC, {}, c)
    finally:
        assert server.poll() is None, "the server died"
        server.stop(timeout=5)


# ---------------------------------------------------------------------- tier 3: Lightning


def flat(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def easgd(**kwargs) -> ParameterServerStrategy:
    return ParameterServerStrategy(start_method="fork", mode="easgd", **kwargs)


class EAMSGDRegression(TinyRegression):
    """EAMSGD's local step: SGD with Nesterov momentum δ."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum, nesterov=True)


def eamsgd_reference(steps: int, period: int, alpha: float, lr: float, delta: float, n: int):
    """One worker, written out from Zhang et al. 2015 (Algorithm 2): Nesterov SGD locally, every τ steps
    e = α(x − x̃), x ← x − e, x̃ ← x̃ + e. Returns {t: (x, x̃, momentum buffers)} after each step t."""
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=delta, nesterov=True)
    center = flat(net).clone()
    per_epoch = len(rank_batches(regression_data(n), 0, 1, 4))
    out = {}
    for t in range(1, steps + 1):
        epoch, i = divmod(t - 1, per_epoch)
        x, y = rank_batches(regression_data(n), 0, 1, 4, epoch)[i]
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        if t % period == 0:
            local = flat(net)
            e = alpha * (local - center)
            torch.nn.utils.vector_to_parameters(local - e, net.parameters())
            center = center + e
        out[t] = (flat(net).clone(), center.clone(), [opt.state[p]["momentum_buffer"].clone() for p in net.parameters()])
    return out


def test_one_worker_is_the_eamsgd_rule_and_resumes_exactly_mid_period(tmp_path):
    """One worker, Nesterov momentum, τ=3, α=0.5, 2 servers: stop at step 4 (mid-period) and resume to step 7. The
    checkpoint holds the reference's center (state_dict) and worker (its own file: x, momentum, step count); the
    resumed run ends on the reference's center (1e-6). A lost momentum buffer, x_i or phase of τ would miss it."""
    ref = eamsgd_reference(7, period=3, alpha=0.5, lr=0.1, delta=0.9, n=16)
    model = lambda: EAMSGDRegression(lr=0.1, momentum=0.9, n=16)  # noqa: E731  (4 steps per epoch)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    kwargs = dict(devices=1, limit_val_batches=1)
    fit(easgd(easgd_period=3, easgd_alpha=0.5, num_servers=2), model(), max_steps=4, callbacks=[ckpt],
        enable_checkpointing=True, **kwargs)  # fmt: skip
    path = tmp_path / "epoch=0-step=4.ckpt"
    saved = torch.load(path, weights_only=False)
    x4, center4, momentum4 = ref[4]
    torch.testing.assert_close(torch.cat([v.reshape(-1) for v in saved["state_dict"].values()]), center4, atol=1e-6, rtol=0)
    own = torch.load(f"{path}.pdist-rank0-of-1", weights_only=False)
    torch.testing.assert_close(own["params"], x4, atol=1e-6, rtol=0)
    assert own["easgd_steps"] == 4
    for buf, expected in zip(own["optimizer_states"][0]["state"].values(), momentum4):
        torch.testing.assert_close(buf["momentum_buffer"], expected, atol=1e-6, rtol=0)
    resumed = model()
    fit(easgd(easgd_period=3, easgd_alpha=0.5, num_servers=2), resumed, max_steps=7, ckpt_path=str(path), **kwargs)
    torch.testing.assert_close(flat(resumed), ref[7][1], atol=1e-6, rtol=0)
    assert not torch.allclose(ref[7][1], ref[7][0])  # the worker's own x_i is not what the module ends with


class Watch(Callback):
    """Each worker: at validation the module holds the servers' center; before the checkpoint, its own x_i and
    momentum (saved); on resume, the same again; at the end, the module it holds (saved)."""

    def __init__(self, out: Path, resumed: bool = False):
        self.out, self.resumed = out, resumed

    def _own(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        return flat(pl_module).clone(), [opt.state[p]["momentum_buffer"].clone() for p in pl_module.parameters()]

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        center = trainer.strategy._servers_params()
        torch.testing.assert_close(flat(pl_module), center, atol=0, rtol=0)
        assert not torch.equal(trainer.strategy._eval_backup, center)  # mid-period: the worker's own x_i differs

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.resumed and trainer.global_step == 3:
            torch.save(self._own(trainer, pl_module), self.out / f"own{trainer.global_rank}.pt")

    def on_train_start(self, trainer, pl_module):
        if self.resumed:
            trainer.strategy.barrier()  # no worker has taken a step (nor exchanged) yet
            x, momentum = torch.load(self.out / f"own{trainer.global_rank}.pt")
            now_x, now_momentum = self._own(trainer, pl_module)
            assert torch.equal(now_x, x) and all(map(torch.equal, now_momentum, momentum))
            assert trainer.strategy.easgd_steps == 3
            saved = torch.load(self.out / "epoch=0-step=3.ckpt", weights_only=False)
            center = torch.cat([v.reshape(-1) for v in saved["state_dict"].values()])
            assert torch.equal(trainer.strategy._servers_params(), center)
            trainer.strategy.barrier()  # every worker has read the servers before any exchanges
    def on_fit_end(self, trainer, pl_module):
        torch.save(flat(pl_module), self.out / f"end{trainer.global_rank}{'r' if self.resumed else ''}.pt")


def test_two_workers_hold_the_center_and_each_resumes_its_own_state(tmp_path):
    """Two workers, τ=2 (exchanges in arrival order, no barrier), α=0.4, 2 servers, Nesterov momentum. Validation and
    the checkpoint see the center (state_dict = the servers' shards); both workers end holding the same center; from
    the mid-period checkpoint (step 3) each worker resumes its own x_i, momentum and phase exactly, and the servers
    the center. (Which worker's exchange lands first depends on timing, so two-worker runs are compared by state.)"""
    model = lambda: EAMSGDRegression(lr=0.05, momentum=0.9, n=24)  # noqa: E731  (3 steps per epoch per worker)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    kwargs = dict(limit_val_batches=1)
    fit(easgd(easgd_period=2, easgd_alpha=0.4, num_servers=2), model(), max_steps=3, enable_checkpointing=True,
        callbacks=[ckpt, Watch(tmp_path)], **kwargs)  # fmt: skip
    saved = torch.load(tmp_path / "epoch=0-step=3.ckpt", weights_only=False)
    shards = torch.cat([s["shard"]["values"] for s in saved["pdist"]["servers"]])
    assert torch.equal(torch.cat([v.reshape(-1) for v in saved["state_dict"].values()]), shards)
    assert sum(s["elastic"]["exchanges"] for s in saved["pdist"]["servers"]) == 2 * 2  # one exchange each, 2 servers
    assert torch.equal(torch.load(tmp_path / "end0.pt"), torch.load(tmp_path / "end1.pt"))
    fit(easgd(easgd_period=2, easgd_alpha=0.4, num_servers=2), model(), max_steps=5,
        ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt"), callbacks=[Watch(tmp_path, resumed=True)], **kwargs)  # fmt: skip
    assert torch.equal(torch.load(tmp_path / "end0r.pt"), torch.load(tmp_path / "end1r.pt"))


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"easgd_period": 0}, ValueError, r"\(easgd_period=0\): easgd_period \(τ, .*\) must be >= 1"),
        ({"easgd_period": 2.5}, TypeError, r"\(easgd_period=2.5\): easgd_period .* must be an int"),
        ({"easgd_alpha": 0.0}, ValueError, r"\(easgd_alpha=0.0\): easgd_alpha .* must be in \(0, 1\]"),
        ({"easgd_alpha": 1.5}, ValueError, r"\(easgd_alpha=1.5\): easgd_alpha .* must be in \(0, 1\]"),
        ({"easgd_alpha": math.nan}, ValueError, r"\(easgd_alpha=nan\): easgd_alpha .* must be in \(0, 1\]"),
        ({"easgd_alpha": "big"}, TypeError, r"\(easgd_alpha='big'\): easgd_alpha \(α\) must be a number"),
        ({"delay_compensation": 0.1}, ValueError, r"\(delay_compensation=0.1\): .*mode='easgd' pushes no gradients"),
        ({"mode": "sync", "easgd_period": 2}, ValueError, r"\(easgd_period=2\): easgd_period applies to mode='easgd'"),
        ({"mode": "async", "easgd_alpha": 0.5}, ValueError, r"\(easgd_alpha=0.5\): easgd_alpha applies to mode='easgd'"),
    ],
)
def test_bad_easgd_arguments_are_refused_at_construction(kwargs, error, match):
    """Each bad argument names the class, the argument, the value and the rule."""
    with pytest.raises(error, match=r"^ParameterServerStrategy" + match):
        ParameterServerStrategy(**{"mode": "easgd", **kwargs})


def test_registered_name():
    trainer = Trainer(accelerator="cpu", devices=1, strategy="parameter_server_easgd", logger=False)
    assert trainer.strategy.config.mode == "easgd" and trainer.strategy.config.period == 4
    assert trainer.strategy.config.alpha_for(2) == pytest.approx(0.45)
