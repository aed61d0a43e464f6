"""Tier 3: ParameterServerStrategy in real fork-launched Lightning runs with real server processes."""

import os
import signal

import pytest
import torch
from _helpers import TinyRegression, fit, make_net, rank_batches, regression_data
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_pdist import ParameterServerStrategy
from lightning_pdist.core.ps_wire import HEADER


def flat(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def ps(**kwargs) -> ParameterServerStrategy:
    return ParameterServerStrategy(start_method="fork", **kwargs)


class AdamRegression(TinyRegression):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


def test_sync_equals_ddp_with_sgd_on_two_workers():
    """Sync PS with SGD + momentum (2 workers, different data, 2 servers, memory sharding) ends where DDP ends; with
    chunk_bytes=32 (4 chunks per server, each pushed and pulled on its own) and chunks_in_flight=1 (each chunk
    pushed only once the previous one was answered) it ends bit for bit where the same 32-byte partitions end
    unchunked (the resume test below runs the default, no cap). The unchunked partitions run with
    reply_buffer_bytes=4096 (the servers' send buffer per worker connection) and nonfinite="propagate" (no agreement
    before each push, so the servers answer a step's pulls one worker at a time), the chunked run with the kernel's
    buffers: bytes move differently, the parameters are the same bit for bit."""
    model = lambda: TinyRegression(momentum=0.9)  # noqa: E731
    ddp, ps_model, parted, chunked = model(), model(), model(), model()
    fit(DDPStrategy(start_method="fork"), ddp, max_steps=10)
    fit(ps(num_servers=2), ps_model, max_steps=10)
    torch.testing.assert_close(flat(ps_model), flat(ddp), atol=1e-6, rtol=0)
    assert not torch.allclose(flat(ps_model), flat(make_net()))
    fit(ps(num_servers=2, partition_bytes=32, reply_buffer_bytes=4096, nonfinite="propagate"), parted, max_steps=10)
    fit(ps(num_servers=2, chunk_bytes=32, chunks_in_flight=1), chunked, max_steps=10)
    assert torch.equal(flat(chunked), flat(parted))
    torch.testing.assert_close(flat(chunked), flat(ddp), atol=1e-6, rtol=0)


def test_one_worker_equals_the_local_optimizer():
    """One worker, Adam split over 2 servers (a tensor cut in two): the same weights as a local Adam loop."""
    model = AdamRegression()
    fit(ps(num_servers=2), model, devices=1, max_steps=7)
    net = make_net()
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    for x, y in rank_batches(regression_data(64), rank=0, world_size=1, batch_size=4)[:7]:
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    torch.testing.assert_close(flat(model), flat(net), atol=1e-6, rtol=0)


def test_ssp_with_zero_staleness_equals_sync():
    """SSP with staleness=0 is bulk-synchronous: with SGD it ends exactly where sync ends."""
    sync, ssp = TinyRegression(), TinyRegression()
    fit(ps(), sync, max_steps=8)
    fit(ps(mode="ssp", staleness=0), ssp, max_steps=8)
    torch.testing.assert_close(flat(ssp), flat(sync), atol=1e-6, rtol=0)


def test_downpour_push_and_pull_periods_match_reference():
    """Async, one worker, push_every=2, pull_every=3: gradients at the last pulled weights, summed per push."""
    model = TinyRegression(lr=0.1)
    fit(ps(mode="async", push_every=2, pull_every=3), model, devices=1, max_steps=7)
    server, local = make_net(), make_net()
    batches = rank_batches(regression_data(64), rank=0, world_size=1, batch_size=4)
    acc = None
    for t in range(1, 8):
        local.zero_grad()
        x, y = batches[t - 1]
        nn.functional.mse_loss(local(x), y).backward()
        g = torch.cat([p.grad.reshape(-1) for p in local.parameters()])
        acc = g if acc is None else acc + g
        if t % 2 == 0 or t == 7:  # the last, partial accumulation is pushed at the end of fit
            w = torch.nn.utils.parameters_to_vector(server.parameters()) - 0.1 * acc
            torch.nn.utils.vector_to_parameters(w, server.parameters())
            acc = None
        if t % 3 == 0:
            torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(server.parameters()), local.parameters())
    torch.testing.assert_close(flat(model), flat(server), atol=1e-6, rtol=0)


class CheckValidationOnServers(Callback):
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        torch.testing.assert_close(flat(pl_module), trainer.strategy._servers_params())
        self.checked = getattr(self, "checked", 0) + 1

    def on_train_end(self, trainer, pl_module):
        assert getattr(self, "checked", 0) >= 2


def test_validation_runs_on_the_servers_parameters():
    """Async with pull_every=3: mid-fit validation sees the servers' parameters, not the worker's stale copy."""
    fit(ps(mode="async", pull_every=3), TinyRegression(), devices=1, max_steps=8, callbacks=[CheckValidationOnServers()],
        limit_val_batches=1, val_check_interval=4)  # fmt: skip


def test_metrics_are_logged_through_lightning(tmp_path):
    """pdist/comm_bytes, wait time, per-server bytes reach callback_metrics; (async) the staleness histogram reaches
    a CSV logger as scalars (W&B and TensorBoard get a histogram: tests/cross/test_diagnostics.py)."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    trainer = fit(ps(mode="async", num_servers=2), TinyRegression(), max_steps=6, logger=CSVLogger(tmp_path, name="run"))
    logged = set(trainer.callback_metrics)
    assert {"pdist/comm_bytes", "pdist/ps/wait_s", "pdist/ps/server0_bytes_in", "pdist/ps/server1_bytes_out",
            "pdist/ps/server_bytes_max", "pdist/ps/staleness"} <= logged  # fmt: skip
    (path,) = tmp_path.glob("**/metrics.csv")
    assert any(k.startswith("pdist/ps/staleness_hist/") for k in csv.DictReader(open(path)).fieldnames)
    assert trainer.callback_metrics["pdist/comm_bytes"] > 0


class RecordServerBytes(Callback):
    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        self.steps.append([(float(m[f"pdist/ps/server{s}_bytes_in"]), float(m[f"pdist/ps/server{s}_bytes_out"])) for s in range(2)])

    def on_train_end(self, trainer, pl_module):
        shard = 4 * sum(p.numel() for p in pl_module.parameters()) // 2  # memory sharding: half the bytes each
        least = 2 * (shard + HEADER.size)  # two messages, each a header and a shard, plus their JSON metadata
        for step in self.steps[1:]:  # the first step also carries the other worker's initial pull
            for d_in, d_out in step:
                assert least < d_in < least + 1024 and least < d_out < least + 1024, (step, shard)
        assert len({tuple(int(d_in) for d_in, _ in step) for step in self.steps[1:]}) == 1  # pushes: same bytes every step


def test_sync_servers_report_one_steps_bytes():
    """Sync: each server's logged in/out per step is the two workers' pushes and pulls of its shard, every step.

    Not an exact number: the shards and headers are exact, but each message's JSON metadata carries the optimizer's
    hyperparameters and, in the replies, the server's running byte counters, whose digit counts grow as they do;
    restating the encoder's output here would test the test. The pushes are the same bytes every step."""
    fit(ps(num_servers=2), TinyRegression(), max_steps=6, callbacks=[RecordServerBytes()])


def test_resume_restores_the_servers_exactly(tmp_path):
    """Stop at step 3 of 8 and resume: the same weights as the uninterrupted run (momentum lives on the servers)."""
    model = lambda: TinyRegression(lr=0.05, momentum=0.9, n=24)  # noqa: E731  (3 steps per epoch on 2 workers)
    straight = model()
    fit(ps(), straight, max_steps=8, limit_val_batches=1)
    # Saved at validation end: Lightning 2.6 resumes such checkpoints with the exact data order.
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    fit(ps(), model(), max_steps=3, callbacks=[ckpt], enable_checkpointing=True, limit_val_batches=1)
    path = tmp_path / "epoch=0-step=3.ckpt"
    saved = torch.load(path, weights_only=False)
    (server,) = saved["pdist"]["servers"]
    assert server["shard"]["optimizers"][0]["state"]  # the momentum buffers
    torch.testing.assert_close(torch.cat([v.reshape(-1) for v in saved["state_dict"].values()]), server["shard"]["values"])
    resumed = model()
    fit(ps(), resumed, max_steps=8, ckpt_path=str(path), limit_val_batches=1)
    torch.testing.assert_close(flat(resumed), flat(straight), atol=1e-6, rtol=0)


def test_chunked_steps_resume_exactly(tmp_path):
    """chunk_bytes=32: stopped at step 3 of 8 and resumed with the same chunks, the weights of the uninterrupted
    chunked run, bit for bit (the servers' shards, versions and momentum come back between steps)."""
    model = lambda: TinyRegression(lr=0.05, momentum=0.9, n=24)  # noqa: E731  (3 steps per epoch on 2 workers)
    straight = model()
    fit(ps(chunk_bytes=32), straight, max_steps=8, limit_val_batches=1)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    fit(ps(chunk_bytes=32), model(), max_steps=3, callbacks=[ckpt], enable_checkpointing=True, limit_val_batches=1)
    resumed = model()
    fit(ps(chunk_bytes=32), resumed, max_steps=8, ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt"), limit_val_batches=1)
    assert torch.equal(flat(resumed), flat(straight)) and not torch.equal(flat(straight), flat(make_net()))


def test_backup_workers_train_to_the_end_with_three_workers():
    """Sync with backup_workers=1 on 3 workers finishes (late gradients dropped, no hang)."""
    model = TinyRegression()
    fit(ps(backup_workers=1), model, devices=3, max_steps=6)
    assert not torch.allclose(flat(model), flat(make_net()))


class KillServer(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 0 and trainer.global_step == 3:
            os.kill(trainer.strategy.server_pids[0], signal.SIGKILL)


def test_a_dead_server_fails_the_run_with_its_name():
    """SIGKILL server 0 mid-fit: the run fails promptly with an error naming parameter server 0."""
    with pytest.raises(Exception, match="parameter server 0"):
        fit(ps(), TinyRegression(), max_steps=20, callbacks=[KillServer()])


class Crash(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == 2:
            raise RuntimeError("worker 1 crashed on purpose")


def test_a_worker_crash_ends_the_run_without_hanging():
    """A worker that raises mid-fit in sync mode: the run fails (no hang) and the servers exit. The other worker
    waits for the crashed one's gradient check for server_timeout (5 s here; Lightning's SIGTERM handler defers the
    launcher's SIGTERM until then, and the launcher SIGKILLs after 30 s with the 300 s default)."""
    with pytest.raises(Exception, match="crashed on purpose|worker 1 disconnected"):
        fit(ps(server_timeout=5), TinyRegression(), max_steps=20, callbacks=[Crash()])


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_servers": 0}, r"num_servers=0\): num_servers must be >= 1"),
        ({"staleness": -1, "mode": "ssp"}, r"staleness=-1\): staleness must be >= 0"),
        ({"staleness": 2}, r"staleness bounds mode='ssp' only"),
        ({"backup_workers": 1, "mode": "async"}, r"backup_workers=1\): backup workers are a mode='sync' technique"),
        ({"delay_compensation": -0.1, "mode": "async"}, r"delay_compensation=-0.1\): .* must be >= 0"),
        ({"delay_compensation": 0.1}, r"sync gradients are never stale"),
        ({"sharding": "rows"}, r"sharding='rows'\): sharding must be one of 'layer', 'memory'"),
        ({"mode": "hogwild"}, r"mode='hogwild'\): mode must be one of 'sync', 'async', 'ssp'"),
        ({"push_every": 2}, r"push_every applies to mode='async'"),
        ({"pull_every": 0, "mode": "async"}, r"pull_every must be >= 1"),
        ({"ddp_comm_hook": print}, r"ddp_comm_hook=.*must be left unset"),
        ({"chunk_bytes": 12}, r"chunk_bytes=12\): chunk_bytes must be a multiple of 8 bytes, at least 8"),
        ({"chunk_bytes": 0}, r"chunk_bytes=0\): chunk_bytes must be a multiple of 8 bytes"),
        ({"chunk_bytes": 4096, "mode": "async"}, r"chunk_bytes=4096\): chunked steps .* need mode='sync' and backup_workers=0"),
        ({"chunk_bytes": 4096, "backup_workers": 1}, r"chunk_bytes=4096\): .*\(mode='sync', backup_workers=1\)"),
        ({"chunk_bytes": 4096, "sharding": "layer"}, r"chunk_bytes=4096\): .*sharding must be 'memory', not 'layer'"),
        ({"chunk_bytes": 4096, "partition_bytes": 8192}, r"chunk_bytes=4096\): each chunk is one partition: partition_bytes=8192"),
        ({"chunk_bytes": 4096, "chunks_in_flight": 0}, r"chunks_in_flight=0\): chunks_in_flight must be >= 1 \(1: each chunk waits"),
        ({"chunks_in_flight": 2}, r"chunks_in_flight=2\): chunks_in_flight paces chunked steps; it needs chunk_bytes"),
        ({"reply_buffer_bytes": 4095}, r"reply_buffer_bytes=4095\): reply_buffer_bytes must be in \[4096, 67108864\] bytes"),
        ({"reply_buffer_bytes": 1 << 27}, r"reply_buffer_bytes=134217728\): reply_buffer_bytes must be in \[4096, 67108864\]"),
        ({"reply_buffer_bytes": 16384, "mode": "easgd"}, r"reply_buffer_bytes=16384\): .*mode='easgd' exchanges parameters"),
        ({"allowed_networks": "everyone"}, r"^ParameterServerStrategy\(allowed_networks='everyone'\): 'everyone' is not an address range \(.*\)$"),
    ],
)
def test_bad_arguments_are_refused_with_the_rule(kwargs, match):
    """Each bad constructor argument raises ValueError echoing the value and stating the rule."""
    with pytest.raises(ValueError, match=match):
        ParameterServerStrategy(**kwargs)


def test_bad_argument_types():
    """Wrong types raise TypeError; chunk_bytes with compression is refused."""
    with pytest.raises(TypeError, match="num_servers must be an int"):
        ParameterServerStrategy(num_servers=1.5)
    with pytest.raises(TypeError, match="staleness must be an int"):
        ParameterServerStrategy(mode="ssp", staleness="2")
    with pytest.raises(TypeError, match=r"chunk_bytes=4096.0\): chunk_bytes must be an int"):
        ParameterServerStrategy(chunk_bytes=4096.0)
    with pytest.raises(TypeError, match=r"chunks_in_flight=2.0\): chunks_in_flight must be an int"):
        ParameterServerStrategy(chunk_bytes=4096, chunks_in_flight=2.0)
    with pytest.raises(TypeError, match=r"chunks_in_flight=True\): chunks_in_flight must be an int"):
        ParameterServerStrategy(chunk_bytes=4096, chunks_in_flight=True)
    with pytest.raises(TypeError, match=r"reply_buffer_bytes=16384.0\): reply_buffer_bytes must be an int .* or None"):
        ParameterServerStrategy(reply_buffer_bytes=16384.0)
    with pytest.raises(TypeError, match=r"reply_buffer_bytes=True\): reply_buffer_bytes must be an int"):
        ParameterServerStrategy(reply_buffer_bytes=True)
    from lightning_pdist.compression import TopK

    with pytest.raises(ValueError, match=r"chunk_bytes=4096, compression=.*chunked steps push plain gradients"):
        ParameterServerStrategy(chunk_bytes=4096, compression=TopK(0.01))


def test_backup_workers_must_leave_a_quorum():
    """backup_workers >= world_size is refused when the Trainer is built."""
    with pytest.raises(ValueError, match=r"with 2 workers, backup_workers must be <= world_size - 1 = 1"):
        Trainer(accelerator="cpu", devices=2, strategy=ps(backup_workers=2), logger=False)


def test_registered_names():
    """'parameter_server' and its aliases build the strategy."""
    for name, mode in (("parameter_server", "sync"), ("parameter_server_async", "async"), ("ps", "sync")):
        trainer = Trainer(accelerator="cpu", devices=1, strategy=name, logger=False)
        assert isinstance(trainer.strategy, ParameterServerStrategy) and trainer.strategy.mode == mode


class LBFGSRegression(TinyRegression):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


def test_setup_refuses_non_elementwise_optimizers_and_empty_layer_servers():
    """LBFGS is refused; layer sharding with more servers than layers names the servers that would be empty."""
    with pytest.raises(Exception, match="LBFGS; parameter servers rebuild the optimizer on each shard"):
        fit(ps(), LBFGSRegression(), devices=1, max_steps=1)
    with pytest.raises(Exception, match=r"servers \[2\] would be empty"):
        fit(ps(num_servers=3, sharding="layer"), TinyRegression(), devices=1, max_steps=1)
