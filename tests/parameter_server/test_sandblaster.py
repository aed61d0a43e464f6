"""Sandblaster L-BFGS (``SandblasterStrategy``, registered ``sandblaster``).

Tier 2: a real server process and raw clients (portions, first answers, the commands, hostile frames of each new
kind, a close that names the worker holding a portion). Tier 3: real Lightning fits on 2 workers with real servers,
against ``torch.optim.LBFGS`` itself on the whole batch in this process, with a straggler; exact resume mid-run.
"""

import json
import math
from concurrent.futures import ThreadPoolExecutor
import socket
import time

import pytest
import torch
from _helpers import SnapshotParams, TinyRegression, closed_by_server, fit, load_snapshot, make_net, rank_batches, regression_data
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_pdist import SandblasterStrategy
from lightning_pdist.core.ps_client import ServerConnection, ServerError, WorkerStalled
from lightning_pdist.parameter_server.process import start_server
from lightning_pdist.parameter_server.sandblaster import batch_digest, portion_bounds
from lightning_pdist.core.ps_wire import HEADER, MAGIC, Kind, dumps_state, loads_state, recv_message

TIMEOUT = 10.0
SECRET = bytes(range(32))
LR, HISTORY, BATCH, N, STEPS = 0.2, 3, 8, 24, 6  # 3 batches per epoch: the checkpoint after epoch 0 is step 3


# ---------------------------------------------------------------------- tier 3: Lightning, 2 workers


class LBFGSRegression(TinyRegression):
    """The regression of the other PS tests with torch's LBFGS; ``straggler``'s training_step sleeps ``delay`` s."""

    def __init__(self, straggler=None, delay=0.0, optimizer="lbfgs", **lbfgs):
        super().__init__(lr=LR, batch_size=BATCH, n=N)
        self.straggler, self.delay, self.optimizer, self.lbfgs = straggler, delay, optimizer, lbfgs

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.straggler:
            time.sleep(self.delay)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        if self.optimizer != "lbfgs":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.LBFGS(self.parameters(), **{"lr": self.lr, "history_size": HISTORY, "max_iter": 1, **self.lbfgs})


def torch_lbfgs(steps):
    """torch.optim.LBFGS on the whole batch in this process, over the batches every worker loads (Lightning's
    DistributedSampler with one replica, shuffled with seed 0)."""
    net = make_net()
    opt = torch.optim.LBFGS(net.parameters(), lr=LR, history_size=HISTORY, max_iter=1)
    out = {}
    for t in range(1, steps + 1):
        epoch, i = divmod(t - 1, N // BATCH)
        x, y = rank_batches(regression_data(N), 0, 1, BATCH, epoch)[i]

        def closure():
            opt.zero_grad()
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            return loss

        opt.step(closure)
        out[t] = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone()
    return out


class Counts(Callback):
    def __init__(self, out):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        counts = dict(trainer.strategy.portion_counts, step=trainer.strategy.step)
        (self.out / f"counts{trainer.global_rank}.json").write_text(json.dumps(counts))


def sandblaster(**kwargs):
    return SandblasterStrategy(start_method="fork", portions=4, num_servers=2, server_timeout=60.0, **kwargs)


def test_two_workers_equal_torch_lbfgs_with_a_straggler_and_resume_exactly(tmp_path):
    """2 workers, 2 servers, 4 portions of a batch of 8, history 3, worker 1 sleeping 0.4 s per portion and
    backup_portions=1. Every step equals torch.optim.LBFGS on the whole batch (1e-5) on worker 0, and both workers
    end on it; worker 0 answers the portions worker 1 sits on (backup copies, the first answer kept), so the steps
    follow the fast worker: worker 1's answers count for at most one portion per step. Resumed from the step-3
    checkpoint (history, direction, previous gradient on the servers; t, H, ρ on the coordinator), steps 4..6 are the
    uninterrupted run's bit for bit."""
    ref = torch_lbfgs(STEPS)
    run, resumed = tmp_path / "run", tmp_path / "resumed"
    run.mkdir(), resumed.mkdir()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    fit(sandblaster(backup_portions=1), LBFGSRegression(straggler=1, delay=0.4), max_steps=STEPS,
        callbacks=[SnapshotParams(run), Counts(run), ckpt], enable_checkpointing=True, limit_val_batches=1)  # fmt: skip
    for t in range(1, STEPS + 1):  # worker 0 coordinates: it holds each step's x (a lagging worker pulls the latest)
        torch.testing.assert_close(load_snapshot(run, 0, t), ref[t], atol=1e-5, rtol=0)
    for rank in (0, 1):
        torch.testing.assert_close(load_snapshot(run, rank, "final"), ref[STEPS], atol=1e-5, rtol=0)
    c0, c1 = (json.loads((run / f"counts{r}.json").read_text()) for r in (0, 1))
    assert c0["step"] == c1["step"] == STEPS
    assert c0["accepted"] + c1["accepted"] == 4 * STEPS  # every portion of every step answered once, first answer kept
    assert c1["accepted"] <= STEPS < c0["accepted"]  # the straggler held up at most one portion of each step...
    assert c0["backups"] >= 1 and c1["computed"] > c1["accepted"]  # ...which worker 0 answered first, as a backup
    saved = torch.load(tmp_path / "epoch=0-step=3.ckpt", weights_only=False)["pdist"]
    pairs = len(saved["sandblaster"]["ro"])  # the coordinator's ρ_i, one per pair the servers hold
    assert saved["sandblaster"]["n_iter"] == 3 and 1 <= pairs <= 2
    assert all(len(s["sandblaster"]["history"]) == pairs for s in saved["servers"])
    fit(sandblaster(), LBFGSRegression(), max_steps=STEPS, callbacks=[SnapshotParams(resumed)],
        ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt"), limit_val_batches=1)  # fmt: skip
    for t in range(4, STEPS + 1):
        assert torch.equal(load_snapshot(resumed, 0, t), load_snapshot(run, 0, t)), t
    for rank in (0, 1):
        assert torch.equal(load_snapshot(resumed, rank, "final"), load_snapshot(run, rank, "final")), rank


class RankDependent(LBFGSRegression):
    """``seeds``: each rank seeds itself with its rank (in ``setup``, before the strategy's); ``data``: each rank
    loads a dataset of its own (same size, same seed: Lightning's sampler order agrees, the samples do not)."""

    def __init__(self, what):
        super().__init__()
        self.what = what

    def setup(self, stage):
        if self.what == "seeds":
            seed_everything(self.global_rank, verbose=False)

    def train_dataloader(self):
        data = regression_data(N, seed=self.global_rank if self.what == "data" else 0)
        return DataLoader(data, batch_size=BATCH, shuffle=True)


def test_ranks_that_would_draw_different_batches_are_refused():
    """Ranks seeded apart under use_distributed_sampler=True: refused at setup, naming the argument, both seeds and
    the rule. Ranks with different data (same sampler order): step 1 is refused on its claims, naming the step and
    both workers, before any L-BFGS step is taken."""
    with pytest.raises(Exception, match=r"SandblasterStrategy: Trainer\(use_distributed_sampler=True\) shuffles each "
                                        r"rank's sampler with its PL_GLOBAL_SEED, which differs across ranks \(rank 0: "
                                        r"0, rank 1: 1\); Sandblaster needs the same batch on every rank"):  # fmt: skip
        fit(sandblaster(), RankDependent("seeds"), max_steps=2)
    with pytest.raises(Exception, match=r"SB_CLAIM: step 1: worker [01]'s batch \(digest [0-9a-f]{16}\) differs from "
                                        r"worker [01]'s \(digest [0-9a-f]{16}\); Sandblaster's portions are slices of one "
                                        r"batch"):  # fmt: skip
        fit(sandblaster(), RankDependent("data"), max_steps=2)


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"portions": 0}, ValueError, r"\(portions=0\): portions must be in \[1, 4096\]"),
        ({"portions": 2.5}, TypeError, r"\(portions=2.5\): portions must be an int or None"),
        ({"backup_portions": -1}, ValueError, r"\(backup_portions=-1\): backup_portions must be in \[0, portions\)"),
        ({"portions": 4, "backup_portions": 4}, ValueError, r"\(backup_portions=4\): backup_portions must be in \[0, portions=4\)"),
        ({"backup_portions": "1"}, TypeError, r"\(backup_portions='1'\): backup_portions must be an int"),
        ({"server_timeout": 0}, ValueError, r"\(server_timeout=0\): server_timeout must be a finite number"),
        ({"server_timeout": 0.5}, ValueError, r"\(server_timeout=0.5\): server_timeout must be at least 1 second"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, error, match):
    with pytest.raises(error, match=r"^SandblasterStrategy" + match):
        SandblasterStrategy(**kwargs)


def test_modules_it_cannot_run_are_refused_at_setup():
    """A non-LBFGS optimizer, a line search, max_iter > 1: each refused at setup naming the argument, value and rule."""
    for module, match in [
        (LBFGSRegression(optimizer="sgd"), r"configure_optimizers returned torch.optim.sgd.SGD; Sandblaster runs batch "
                                           r"L-BFGS and needs exactly one torch.optim.LBFGS"),
        (LBFGSRegression(line_search_fn="strong_wolfe"), r"LBFGS\(line_search_fn='strong_wolfe'\): not supported"),
        (LBFGSRegression(max_iter=2), r"LBFGS\(max_iter=2\): not supported; each training batch is one L-BFGS iteration"),
    ]:  # fmt: skip
        with pytest.raises(Exception, match=r"SandblasterStrategy: " + match):  # raised in the launched rank
            fit(sandblaster(), module, devices=1, max_steps=1)


def test_registered_name():
    trainer = Trainer(accelerator="cpu", devices=1, strategy="sandblaster", logger=False)
    assert isinstance(trainer.strategy, SandblasterStrategy) and trainer.strategy.portions_for(2) == 8
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


# ---------------------------------------------------------------------- tier 2: a real server, raw clients


def init(address, numel=6, secret=None, **extra):
    admin = ServerConnection(0, address, timeout=TIMEOUT, secret=secret)
    meta = {"mode": "sandblaster", "num_workers": 2, "dtype": "torch.float32", "segments": [[-1, -1, numel]],
            "history_size": 2, "max_portions": 4, "backup_portions": 1, "dispatcher": True, **extra}  # fmt: skip
    admin.request(Kind.INIT, meta, torch.arange(numel, dtype=torch.float32))
    admin.request(Kind.HELLO, {"worker": 0})
    return admin


def state_of(admin):
    return loads_state(admin.request(Kind.GET_STATE, {})[1])


def test_portions_backups_first_answers_commands_and_a_named_straggler():
    """Server 0 hands out portions 0..3, then one backup copy of the last unanswered portion to an idle worker; the
    first answer for a portion is kept, a later one dropped; ``close`` makes g the size-weighted sum in portion order
    and waits for missing portions, answering after its patience with the worker that holds them; ``finish`` ends
    the step, and a late answer is dropped."""
    server = start_server(0, secret=SECRET)
    try:
        admin = init(server.address, secret=SECRET)  # worker 0: the coordinator
        w1 = ServerConnection(0, server.address, timeout=TIMEOUT, secret=SECRET)
        w1.request(Kind.HELLO, {"worker": 1, "pid": 4242})
        claim = lambda c, w: c.request(Kind.SB_CLAIM, {"worker": w, "step": 1, "portions": 4})[0]  # noqa: E731
        assert [claim(admin, 0)["portion"], claim(w1, 1)["portion"], claim(admin, 0)["portion"]] == [0, 1, 2]
        assert claim(admin, 0)["portion"] == 3
        grads = {p: torch.full((6,), float(p + 1)) for p in range(4)}
        sizes = [3, 2, 2, 1]

        def answer(conn, w, p, step=1, value=None):
            meta = {"worker": w, "step": step, "portion": p, "portions": 4, "samples": sizes[p], "loss": float(p)}
            return conn.request(Kind.SB_GRAD, meta, grads[p] if value is None else value)[0]

        for p in (0, 2, 3):
            assert answer(admin, 0, p)["accepted"]
        assert claim(admin, 0) == {"portion": 1, "backup": True}  # the one unanswered portion, to the idle worker
        assert claim(admin, 0)["portion"] is None  # backup_portions=1: no second copy
        impatient = ServerConnection(0, server.address, timeout=0.5, secret=SECRET)  # its patience: 0.5 s
        impatient.request(Kind.HELLO, {"worker": 0})
        with pytest.raises(WorkerStalled, match=r"worker 0 .*, worker 1 \(pid 4242.*\) have not answered portion\(s\) \[1\] "
                                                r"of step 1 for 0.5 s: stopped, hung or dead; parameter server 0 is alive"):
            impatient.request(Kind.SB_OPS, {"worker": 0, "step": 1, "ops": [["close", 4, 8]]})
        ops = [["close", 4, 8], ["absmax", "g"], ["dot", "g", "g"], ["copy", "d", "g"], ["scale", "d", -1.0],
               ["axpy", "x", 0.5, "d"]]  # fmt: skip
        with ThreadPoolExecutor(1) as pool:  # the close waits for portion 1, and is answered once it arrives
            waiting = pool.submit(admin.request, Kind.SB_OPS, {"worker": 0, "step": 1, "ops": ops})
            time.sleep(0.2)
            assert not waiting.done()
            assert answer(impatient, 0, 1)["accepted"]  # the backup's answer first (worker 0, another connection)...
            values = waiting.result(timeout=TIMEOUT)[0]["values"]
        assert not answer(w1, 1, 1, value=torch.full((6,), 99.0))["accepted"]  # ...the straggler's dropped
        # closed but not finished: a late answer is dropped, not kept for the next step
        assert not answer(w1, 1, 2)["accepted"] and not state_of(admin)["version"]
        admin.request(Kind.SB_OPS, {"worker": 0, "step": 1, "ops": [["finish"]]})
        g = sum(grads[p] * (sizes[p] / 8) for p in range(4))
        assert values[0] == pytest.approx(sum(p * sizes[p] / 8 for p in range(4)))
        assert values[1] == pytest.approx(g.abs().max().item()) and values[2] == pytest.approx(g.dot(g).item())
        state = state_of(admin)
        torch.testing.assert_close(state["shard"]["values"], torch.arange(6.0) - 0.5 * g, atol=1e-6, rtol=0)
        assert state["version"] == 1 and not answer(w1, 1, 1)["accepted"]  # late: step 1 is over
        assert claim(w1, 1)["portion"] is None
    finally:
        assert server.poll() is None, "the server died"
        server.stop(timeout=5)


def test_claims_with_different_batch_digests_are_refused_from_then_on():
    """Claims of one step carrying the same digest are served; a claim with another digest is refused naming the
    step and both workers, and so is every claim after it, the first worker's included (the job mixed batches)."""
    server = start_server(0, secret=SECRET)
    try:
        admin = init(server.address, secret=SECRET)
        w1 = ServerConnection(0, server.address, timeout=TIMEOUT, secret=SECRET)
        w1.request(Kind.HELLO, {"worker": 1})
        a, b = batch_digest([torch.ones(4, 2), torch.zeros(4)]), batch_digest([torch.ones(4, 2), torch.zeros(4, 1)])
        assert a != b and a == batch_digest([torch.ones(4, 2), torch.zeros(4)])  # the shape counts, not only the bytes
        claim = lambda c, w, d: c.request(Kind.SB_CLAIM, {"worker": w, "step": 1, "portions": 4, "batch": d})[0]  # noqa: E731
        assert [claim(admin, 0, a)["portion"], claim(w1, 1, a)["portion"]] == [0, 1]
        mixed = rf"SB_CLAIM: step 1: worker 1's batch \(digest {b}\) differs from worker 0's \(digest {a}\)"
        for conn, w, d in [(w1, 1, b), (admin, 0, a), (w1, 1, a)]:
            with pytest.raises(ServerError, match=mixed):
                claim(conn, w, d)
    finally:
        assert server.poll() is None, "the server died"
        server.stop(timeout=5)


def test_hostile_frames_of_each_new_kind_are_refused_and_the_server_lives():
    """SB_GRAD is bounded by the shard, SB_CLAIM and SB_OPS by zero payload bytes, all checked on the header; an
    unauthenticated SB_OPS never reaches the handler; bad fields and commands are refused naming them; none changes
    the state, and the coordinator's good commands are served after."""
    server = start_server(0, secret=SECRET)
    try:
        admin = init(server.address, secret=SECRET)
        impatient = ServerConnection(0, server.address, timeout=0.3, secret=SECRET)  # a close waits 0.3 s at most
        impatient.request(Kind.HELLO, {"worker": 0})
        before = state_of(admin)
        host, _, port = server.address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:  # no handshake
            sock.sendall(HEADER.pack(MAGIC, int(Kind.SB_OPS), 2, 0) + b"{}")
            assert closed_by_server(sock)
        for kind, payload_len, limit in [(Kind.SB_GRAD, 28, 24), (Kind.SB_CLAIM, 4, 0), (Kind.SB_OPS, 1 << 40, 0)]:
            conn = ServerConnection(0, server.address, timeout=TIMEOUT, secret=SECRET)
            conn.sock.sendall(HEADER.pack(MAGIC, int(kind), 2, payload_len) + b"{}")
            reply, meta, _, _ = recv_message(conn.sock, timeout=TIMEOUT)
            assert reply == Kind.ERROR and f"{kind.name} declares payload_len={payload_len}; this receiver takes at most {limit}" in meta["message"]
            assert closed_by_server(conn.sock)
        w1 = ServerConnection(0, server.address, timeout=TIMEOUT, secret=SECRET)
        with pytest.raises(ServerError, match=r"send HELLO before"):
            w1.request(Kind.SB_CLAIM, {"step": 1, "portions": 4})
        w1.request(Kind.HELLO, {"worker": 1})
        good = {"worker": 1, "step": 1, "portion": 0, "portions": 4, "samples": 2, "loss": 0.5}
        for kind, meta, payload, match in [
            (Kind.SB_CLAIM, {"step": 2, "portions": 4}, None, r"SB_CLAIM: step=2: step must be an int in \[1, 1\]"),
            (Kind.SB_CLAIM, {"step": 1, "portions": 5}, None, r"SB_CLAIM: portions=5: portions must be an int in \[1, 4\]"),
            (Kind.SB_CLAIM, {"step": 1}, None, r"SB_CLAIM: field 'portions' is missing"),
            (Kind.SB_CLAIM, {"step": 1, "portions": 4, "batch": 7}, None, r"SB_CLAIM: batch=7: batch must be a digest of 16"),
            (Kind.SB_GRAD, {**good, "portion": 4}, torch.ones(6), r"SB_GRAD: portion=4: portion must be an int in \[0, 4\)"),
            (Kind.SB_GRAD, {**good, "loss": math.inf}, torch.ones(6), r"SB_GRAD: loss=inf: loss must be a finite number"),
            (Kind.SB_GRAD, {**good, "samples": 0}, torch.ones(6), r"SB_GRAD: samples=0: samples must be an int >= 1"),
            (Kind.SB_GRAD, good, torch.ones(5), r"SB_GRAD: a gradient of 5 elements; this shard holds 6"),
            (Kind.SB_GRAD, good, bytes(7), r"SB_GRAD: .*7 bytes is not a whole number of 4-byte elements"),
            (Kind.SB_GRAD, {**good, "worker": 0}, torch.ones(6), r"SB_GRAD: worker=0: this connection said HELLO as worker 1"),
            (Kind.SB_OPS, {"step": 1, "ops": [["finish"]]}, None, r"SB_OPS: worker 1 sent commands; only the coordinator"),
        ]:  # fmt: skip
            with pytest.raises(ServerError, match=match):
                w1.request(kind, meta, payload)
        for ops, match in [
            ([["jump", "x"]], r"ops\[0\]=.*name one of"),
            ([["dot", "g", "S0"]], r"ops\[0\]: dot names vector 'S0'; .*S<i>, Y<i> for i < 0"),
            ([["scale", "d", math.nan]], r"ops\[0\]: scale's coefficient nan must be a finite number"),
            ([["copy", "x", "g"]], r"ops\[0\]: copy may not write 'x'"),
            ([["axpy", "g", 1.0]], r"ops\[0\]: axpy takes 3 arguments, got 2"),
            ([["finish"]] * 65, r"ops must be a list of 1 to 64 commands"),
            ([["close", 4, 8]], r"not yet sent portion\(s\) \[0, 1, 2, 3\] of step 1 here"),  # nobody claimed them
        ]:  # fmt: skip
            with pytest.raises((ServerError, WorkerStalled), match=match):
                impatient.request(Kind.SB_OPS, {"worker": 0, "step": 1, "ops": ops})
        with pytest.raises(ServerError, match=r"SB_OPS: step=2: step must be an int in \[1, 1\]"):
            admin.request(Kind.SB_OPS, {"worker": 0, "step": 2, "ops": [["finish"]]})
        with pytest.raises(ServerError, match=r"PUSH: this server runs mode='sandblaster'"):
            admin.request(Kind.PUSH, {"version": 0}, torch.ones(6))
        with pytest.raises(ServerError, match=r"SET_STATE"):  # a broken history changes nothing
            admin.request(Kind.SET_STATE, {}, dumps_state({**before, "sandblaster": {**before["sandblaster"],
                                                                                     "history": [[torch.ones(3)] * 2]}}))  # fmt: skip
        after = state_of(admin)
        assert torch.equal(after["shard"]["values"], before["shard"]["values"]) and after["version"] == 0
        assert all(torch.equal(after["sandblaster"]["vectors"][k], v) for k, v in before["sandblaster"]["vectors"].items())
        with pytest.raises(ServerError, match=r"INIT: history_size=0: history_size must be an int in \[1, 1024\]"):
            init(server.address, secret=SECRET, history_size=0)
        assert admin.request(Kind.SB_OPS, {"worker": 0, "step": 1, "ops": [["dot", "x", "x"], ["finish"]]})[0]["values"] \
            == [float(sum(i * i for i in range(6)))]  # fmt: skip
    finally:
        assert server.poll() is None, "the server died"
        server.stop(timeout=5)


def test_a_server_of_another_mode_refuses_the_new_kinds_and_server_one_hands_out_nothing():
    server = start_server(0)
    try:
        admin = ServerConnection(0, server.address, timeout=TIMEOUT)
        admin.request(Kind.INIT, {"mode": "sync", "num_workers": 1, "dtype": "torch.float32", "segments": [[0, 6]],
                                  "optimizer": "SGD", "param_groups": [{"lr": 0.1}]}, torch.zeros(6))  # fmt: skip
        admin.request(Kind.HELLO, {"worker": 0})
        with pytest.raises(ServerError, match=r"SB_CLAIM: this server runs mode='sync'; SB_CLAIM needs mode='sandblaster'"):
            admin.request(Kind.SB_CLAIM, {"step": 1, "portions": 1})
        with pytest.raises(Exception, match=r"SB_GRAD declares payload_len=24; this receiver takes at most 0 bytes"):
            admin.request(Kind.SB_GRAD, {}, torch.ones(6))
        admin = init(server.address, dispatcher=False)
        with pytest.raises(ServerError, match=r"SB_CLAIM: parameter server 0 does not hand out portions \(server 0 does\)"):
            admin.request(Kind.SB_CLAIM, {"step": 1, "portions": 4})
        assert portion_bounds(8, 3) == [(0, 3), (3, 6), (6, 8)]
    finally:
        assert server.poll() is None, "the server died"
        server.stop(timeout=5)
