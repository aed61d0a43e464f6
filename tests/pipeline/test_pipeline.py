"""Tier 3: PipelineStrategy in real Lightning runs (fork launcher, gloo): 2 and 3 stages, 2 stages x 2 replicas.

After ``fit`` every rank holds the whole model again (the stages are gathered in ``teardown``), and the
fork launcher hands rank 0's to this process, so each test compares the module it passed in with a
plain-torch reference from ``tests/_pipeline_reference.py``.
"""


import _pipeline_reference as reference
import pytest
import torch
from _helpers import SnapshotParams, TinyRegression, fit, load_snapshot, rank_batches, regression_data
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_pdist import PipelineStrategy
from lightning_pdist.data import DigitsDataModule
from lightning_pdist.models import ClassifierModule

LR, BS, N = 0.1, 4, 64


def deep_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


class DeepRegression(TinyRegression):
    """TinyRegression with a 4-layer network (cuts into up to 4 stages), a forward and predict/test steps."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net = deep_net()

    def forward(self, x):
        return self.net(x)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test/loss", nn.functional.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])


def pipeline(**kwargs):
    return PipelineStrategy(start_method="fork", **kwargs)


def batches(steps, replicas=1, n=N, bs=BS):
    """``[step][replica] -> (x, y)``: Lightning's shuffled DistributedSampler over the ``replicas`` (all stages alike)."""
    data = regression_data(n)
    per_epoch = len(rank_batches(data, 0, replicas, bs))
    return [[rank_batches(data, r, replicas, bs, t // per_epoch)[t % per_epoch] for r in range(replicas)] for t in range(steps)]


def assert_model_equals(module, expected):
    torch.testing.assert_close(reference.flat(module), reference.flat(expected), atol=1e-6, rtol=0)


class _PostAhead(Callback):
    """Logs whether this rank's transport posts receives ahead."""

    def on_train_batch_end(self, trainer, pl_module, *args):
        pl_module.log("post_ahead", float(trainer.strategy.executor.p2p.post_ahead))


# --- equal to the references --------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_flushed_schedules_equal_gradient_accumulation(schedule):
    """GPipe and 1F1B over 3 stages equal one-process SGD with gradients accumulated over 2 micro-batches."""
    module = DeepRegression(lr=LR)
    fit(pipeline(schedule=schedule, num_microbatches=3 if schedule == "1f1b" else 2), module, devices=3, max_steps=6)
    m = 3 if schedule == "1f1b" else 2
    assert_model_equals(module, reference.accumulation(deep_net(), batches(6), m, LR))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream", "2bw"])
def test_four_stages_on_four_processes(schedule):
    """Every schedule on 4 stages (one layer each) ends where its plain-torch reference ends; receives are not posted
    ahead unless asked (the default)."""
    module = DeepRegression(lr=LR)
    trainer = fit(pipeline(schedule=schedule, num_microbatches=4), module, devices=4, max_steps=3, callbacks=[_PostAhead()])
    assert trainer.callback_metrics["post_ahead"] == 0.0
    steps = batches(3)
    if schedule in ("gpipe", "1f1b"):
        expected = reference.accumulation(deep_net(), steps, 4, LR)
    elif schedule == "2bw":
        expected = reference.two_bw(deep_net(), [b for (b,) in steps], 4, LR)
    else:
        mbs = [(xm, ym) for (x, y), in steps for xm, ym in zip(x.tensor_split(4), y.tensor_split(4))]
        expected = reference.pipedream(deep_net(), [(0, 2), (2, 4), (4, 6), (6, 7)], mbs, LR)
    assert_model_equals(module, expected)


def test_two_stages_times_two_replicas_equal_data_parallel_sgd():
    """4 ranks = 2 stages x 2 replicas (each replica its own shard, replicas all-reduce): one SGD on both shards."""
    module = DeepRegression(lr=LR)
    fit(pipeline(num_stages=2, schedule="1f1b", num_microbatches=2), module, devices=4, max_steps=5)
    assert_model_equals(module, reference.accumulation(deep_net(), batches(5, replicas=2), 2, LR))


def test_pipedream_equals_the_asynchronous_reference():
    """PipeDream through Lightning (windows per batch, drained at the end) equals the stashed-weights simulation."""
    module = DeepRegression(lr=LR)
    fit(pipeline(num_stages=2, schedule="pipedream", num_microbatches=2, split_points=["net.4"]), module, devices=2, max_steps=6)
    mbs = [(xm, ym) for (x, y), in batches(6) for xm, ym in zip(x.tensor_split(2), y.tensor_split(2))]
    assert_model_equals(module, reference.pipedream(deep_net(), [(0, 4), (4, 7)], mbs, LR))


def test_pipedream_vertical_sync_equals_its_reference():
    """With vertical sync every stage uses the input stage's version of each mini-batch (3 stages)."""
    module = DeepRegression(lr=LR)
    fit(pipeline(schedule="pipedream", num_microbatches=2, vertical_sync=True, split_points=["net.2", "net.4"]), module,
        devices=3, max_steps=5)  # fmt: skip
    mbs = [(xm, ym) for (x, y), in batches(5) for xm, ym in zip(x.tensor_split(2), y.tensor_split(2))]
    assert_model_equals(module, reference.pipedream(deep_net(), [(0, 2), (2, 4), (4, 7)], mbs, LR, vertical_sync=True))


@pytest.mark.parametrize("vertical_sync", [False, True])
def test_pipedream_drains_for_validation_and_restarts(vertical_sync):
    """Validation every 2 steps drains the pipeline; afterwards the version rule restarts (reference with drains)."""
    module = DeepRegression(lr=LR)
    fit(pipeline(schedule="pipedream", num_microbatches=2, vertical_sync=vertical_sync, split_points=["net.2", "net.4"]),
        module, devices=3, max_steps=6, limit_val_batches=1, val_check_interval=2)  # fmt: skip
    mbs = [(xm, ym) for (x, y), in batches(6) for xm, ym in zip(x.tensor_split(2), y.tensor_split(2))]
    expected = reference.pipedream(deep_net(), [(0, 2), (2, 4), (4, 7)], mbs, LR, vertical_sync, drains=(4, 8))
    assert_model_equals(module, expected)


def test_2bw_follows_its_update_rule():
    """2BW through Lightning equals W(t+1) = W(t) - lr * grad f(W(t-1))."""
    module = DeepRegression(lr=LR)
    fit(pipeline(num_stages=2, schedule="2bw", num_microbatches=2), module, devices=2, max_steps=6)
    assert_model_equals(module, reference.two_bw(deep_net(), [b for (b,) in batches(6)], 2, LR))


def test_one_stage_pipeline_equals_ddp():
    """num_stages=1 on 2 ranks (2 replicas, micro-batches accumulated) ends where Lightning's DDP ends."""
    ddp, pipe = DeepRegression(lr=LR), DeepRegression(lr=LR)
    fit("ddp_fork", ddp, max_steps=6)
    fit(pipeline(num_stages=1, num_microbatches=2), pipe, max_steps=6)
    assert_model_equals(pipe, ddp)


def test_without_stashing_the_run_leaves_the_reference():
    """weight_stashing=False is warned, runs, and is not the stashed trajectory."""
    module = DeepRegression(lr=LR)
    with pytest.warns(UserWarning, match="weight_stashing=False"):
        strategy = pipeline(num_stages=2, schedule="pipedream", num_microbatches=2, weight_stashing=False, split_points=["net.4"])
    fit(strategy, module, devices=2, max_steps=6)
    mbs = [(xm, ym) for (x, y), in batches(6) for xm, ym in zip(x.tensor_split(2), y.tensor_split(2))]
    expected = reference.pipedream(deep_net(), [(0, 4), (4, 7)], mbs, LR)
    assert (reference.flat(module) - reference.flat(expected)).abs().max() > 1e-5


# --- the LightningModule contract ---------------------------------------------------------------------------


class CheckEveryRank(Callback):
    """Asserts on every rank that the logged loss and pipeline metrics are there and equal across ranks."""

    def on_train_end(self, trainer, pl_module):
        metrics = trainer.callback_metrics
        for key in ("train/loss", "val/loss", "pdist/pipeline/bubble", "pdist/pipeline/stage1/stash_depth", "pdist/comm_bytes"):
            assert key in metrics, (trainer.global_rank, sorted(metrics))
        for key in ("train/loss", "val/loss", "pdist/pipeline/bubble"):
            values = trainer.strategy.all_gather(metrics[key].reshape(1))
            assert torch.allclose(values, values[0]), (key, values)


def test_logs_reach_every_rank_and_the_loss_is_the_last_stages():
    """The module's training/validation logs (last stage) appear on every rank; train/loss is the batch loss."""
    module = DeepRegression(lr=LR)
    trainer = fit(pipeline(num_stages=2, num_microbatches=2), module, devices=2, max_steps=4, limit_val_batches=2,
                  val_check_interval=4, callbacks=[CheckEveryRank(), ModelCheckpoint(monitor="val/loss")],
                  enable_checkpointing=True)  # fmt: skip
    net = reference.accumulation(deep_net(), batches(3), 2, LR)
    (x, y), = batches(4)[3]
    expected = nn.functional.mse_loss(net(x), y)
    torch.testing.assert_close(trainer.callback_metrics["train/loss"], expected.detach(), atol=1e-6, rtol=0)
    assert trainer.checkpoint_callback.best_model_path


def test_checkpoint_holds_the_whole_model_and_loads_in_one_process(tmp_path):
    """state_dict has every stage's layers (load_from_checkpoint works alone); each stage's optimizer state is kept."""
    module = DeepRegression(lr=LR, momentum=0.9)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=3)
    fit(pipeline(num_stages=2, num_microbatches=2), module, devices=4, max_steps=3, callbacks=[checkpoint], enable_checkpointing=True)
    path = tmp_path / "epoch=0-step=3.ckpt"
    stored = torch.load(path, weights_only=False)
    assert list(stored["state_dict"]) == list(DeepRegression().state_dict())
    assert len(stored["optimizer_states"][0]["pipeline_stages"]) == 2
    assert all(s["state"] for s in stored["optimizer_states"][0]["pipeline_stages"])  # momentum buffers
    assert stored["pdist"]["pipeline"]["bounds"] == [[0, 4], [4, 7]]
    loaded = DeepRegression.load_from_checkpoint(path)
    assert_model_equals(loaded, module)


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream", "2bw"])
def test_resume_is_exact(tmp_path, schedule):
    """Resumed from the epoch-end checkpoint (a drained pipeline), each stage ends where the run that wrote it ends."""
    make = lambda: DeepRegression(lr=0.05, momentum=0.9, n=12)  # noqa: E731  # 3 steps per epoch (one replica)
    strategy = lambda: pipeline(num_stages=2, schedule=schedule, num_microbatches=2)  # noqa: E731
    ckpt_run, resumed = tmp_path / "ckpt", tmp_path / "resumed"
    ckpt_run.mkdir(), resumed.mkdir()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    fit(strategy(), make(), max_steps=8, callbacks=[SnapshotParams(ckpt_run), checkpoint], enable_checkpointing=True, limit_val_batches=1)
    first = tmp_path / "ckpts" / "epoch=0-step=3.ckpt"
    assert torch.load(first, weights_only=False)["pdist"]["pipeline"]["schedule"] == schedule
    fit(strategy(), make(), max_steps=8, callbacks=[SnapshotParams(resumed)], ckpt_path=str(first), limit_val_batches=1)
    for rank in range(2):
        torch.testing.assert_close(load_snapshot(resumed, rank, 8), load_snapshot(ckpt_run, rank, 8), atol=1e-6, rtol=0)


class SavePredictions(Callback):
    def __init__(self, dirpath):
        self.dirpath, self.outputs = dirpath, []

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.outputs.append(outputs)

    def on_predict_end(self, trainer, pl_module):
        torch.save(torch.cat(self.outputs), self.dirpath / f"rank{trainer.global_rank}.pt")


def test_validate_test_and_predict_run_through_the_pipeline(tmp_path):
    """Outside fit, the pipeline evaluates forward only: test loss and predictions equal the one-process model's."""
    module = DeepRegression()
    data = DataLoader(regression_data(16, seed=3), batch_size=8)
    results = Trainer(accelerator="cpu", devices=2, strategy=pipeline(num_microbatches=2), logger=False, enable_progress_bar=False,
                      enable_model_summary=False).test(module, data)  # fmt: skip
    x, y = regression_data(16, seed=3).tensors
    with torch.no_grad():
        assert results[0]["test/loss"] == pytest.approx(float(nn.functional.mse_loss(deep_net()(x), y)), abs=1e-6)
    assert_model_equals(module, deep_net())
    Trainer(accelerator="cpu", devices=2, strategy=pipeline(num_microbatches=2), logger=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[SavePredictions(tmp_path)]).predict(module, data)  # fmt: skip
    with torch.no_grad():
        for rank in range(2):  # the last stage's predictions reach every stage
            torch.testing.assert_close(torch.load(tmp_path / f"rank{rank}.pt"), deep_net()(x), atol=1e-6, rtol=0)


def test_classifier_accuracy_metric_is_exact_across_stages():
    """ClassifierModule's val/acc (a torchmetrics Metric, updated on the last stage only) equals one-process accuracy."""
    torch.manual_seed(0)
    module = ClassifierModule(model="cnn", lr=0.05)
    data = DigitsDataModule(batch_size=32)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=pipeline(num_stages=2, num_microbatches=2), max_steps=5,
                      val_check_interval=5, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(module, datamodule=data)
    data.setup("validate")
    correct = total = 0
    with torch.no_grad():
        for x, y in data.val_dataloader():
            correct += int((module(x).argmax(1) == y).sum())
            total += len(y)
    assert float(trainer.callback_metrics["val/acc"]) == pytest.approx(correct / total, abs=1e-6)


# --- refusals -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(schedule="zb"), ValueError, r"PipelineStrategy\(schedule='zb'\): schedule must be one of"),
        (dict(num_stages=0), ValueError, r"PipelineStrategy\(num_stages=0\): num_stages must be >= 1"),
        (dict(num_stages="2"), TypeError, r"PipelineStrategy\(num_stages='2'\): num_stages must be an int"),
        (dict(num_microbatches=0), ValueError, r"num_microbatches=0\): num_microbatches must be >= 1"),
        (dict(num_stages=4, num_microbatches=2), ValueError, r"num_microbatches=2\): schedule='1f1b' needs num_microbatches >= num_stages"),
        (dict(schedule="2bw", num_stages=3, num_microbatches=2), ValueError, r"'2bw' needs num_microbatches >= num_stages"),
        (dict(balance="flops"), ValueError, r"balance='flops'\): balance must be None or one of"),
        (dict(balance="time", split_points=["net.2"]), ValueError, r"give balance or split_points, not both"),
        (dict(num_stages=3, split_points=["net.2"]), ValueError, r"3 stages need 2 split points"),
        (dict(vertical_sync=True), ValueError, r"vertical_sync=True\): vertical sync applies to schedule='pipedream'"),
        (dict(weight_stashing=False, schedule="gpipe"), ValueError, r"weight_stashing=False\): turning stashing off"),
        (dict(ddp_comm_hook=lambda s, b: None), ValueError, r"ddp_comm_hook=.*must be left unset"),
        (dict(post_ahead="yes"), TypeError, r"PipelineStrategy\(post_ahead='yes'\): post_ahead must be True or False"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_at_construction(kwargs, error, match):
    """Each bad argument is refused before any process starts, naming the argument, the value and the rule."""
    with pytest.raises(error, match=match):
        PipelineStrategy(**kwargs)


def test_stages_that_do_not_divide_the_world_are_refused():
    """3 processes cannot hold 2-stage pipelines: refused when the Trainer is built."""
    with pytest.raises(ValueError, match=r"PipelineStrategy\(num_stages=2\): world_size 3 is not a multiple of num_stages"):
        Trainer(accelerator="cpu", devices=3, strategy=pipeline(num_stages=2))


class NotSequential(DeepRegression):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(2, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.net(x)), y)


class TwoCalls(DeepRegression):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x) + self.net(x), y)


class TwoOptimizers(DeepRegression):
    def configure_optimizers(self):
        return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.Adam(self.parameters())]


class Manual(DeepRegression):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.parametrize(
    "make, kwargs, match",
    [
        (NotSequential, {}, r"parameters are not all inside one nn.Sequential \(net holds .*outside: head.weight, head.bias"),
        (lambda: DeepRegression(optimizers=2), {}, r"configure_optimizers failed on stage \d, which holds only net.*one optimizer over self.parameters"),
        (TwoOptimizers, {}, r"configure_optimizers failed on stage \d.*multiple optimizers is only supported with manual optimization"),
        (Manual, {}, r"automatic_optimization is False"),
        (DeepRegression, dict(accumulate_grad_batches=2), r"accumulate_grad_batches=2\): the pipeline already accumulates"),
        (DeepRegression, dict(gradient_clip_val=1.0), r"gradient_clip_algorithm='norm'\): the gradient norm spans all stages"),
        (TwoCalls, {}, r"called its network 'net' twice"),
        (lambda: DeepRegression(), dict(strategy_kwargs=dict(balance="time")), r"balance='time' times each layer on the module's example_input_array"),
    ],
)  # fmt: skip
def test_modules_outside_the_contract_are_refused_at_setup(make, kwargs, match):
    """What the pipeline cannot run is refused at setup with what to change."""
    strategy_kwargs = kwargs.pop("strategy_kwargs", {})
    with pytest.raises(Exception, match=match):
        fit(pipeline(num_stages=2, num_microbatches=2, **strategy_kwargs), make(), devices=2, max_steps=1, **kwargs)


def test_more_stages_than_layers_with_parameters_are_refused():
    """A network with 4 parameterized layers cannot fill 4+ ... here 3 stages of a 2-layer net."""
    with pytest.raises(Exception, match=r"num_stages=3: the network has 2 layers with parameters"):
        fit(pipeline(num_microbatches=3), TinyRegression(), devices=3, max_steps=1)


def test_time_balance_profiles_the_example_input():
    """balance='time' with example_input_array cuts the network and trains."""
    module = DeepRegression(lr=LR)
    module.example_input_array = torch.zeros(4, 4)
    fit(pipeline(num_stages=2, num_microbatches=2, balance="time"), module, devices=2, max_steps=2)
    assert reference.flat(module).isfinite().all()


# --- registration, metrics, BatchNorm and dropout ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name, schedule",
    [("pipeline", "1f1b"), ("pipeline_gpipe", "gpipe"), ("pipeline_1f1b", "1f1b"), ("pipedream", "pipedream"),
     ("pipedream_2bw", "2bw"), ("pipedream_fork", "pipedream"), ("pipeline_spawn", "1f1b")],
)  # fmt: skip
def test_names_are_registered(name, schedule):
    """Each registered name builds a PipelineStrategy with its schedule (and start method)."""
    strategy = Trainer(accelerator="cpu", devices=2, strategy=name, logger=False).strategy
    assert isinstance(strategy, PipelineStrategy) and strategy.config.schedule == schedule
    assert strategy._start_method == ("fork" if name.endswith("_fork") else "spawn" if name.endswith("_spawn") else "popen")


@pytest.mark.parametrize("schedule, depths", [("gpipe", (1, 1)), ("pipedream", (2, 1)), ("2bw", (2, 2))])
def test_logged_stash_depth_and_bytes_per_stage(schedule, depths):
    """Each stage logs the weight versions it held (the schedule's depth) and the bytes it sent that step (receives
    posted ahead, asked for under pipedream, change neither)."""
    ahead = schedule == "pipedream"
    trainer = fit(pipeline(num_stages=2, schedule=schedule, num_microbatches=2, post_ahead=ahead), DeepRegression(lr=LR),
                  devices=2, max_steps=4, callbacks=[_PostAhead()])  # fmt: skip
    metrics = trainer.callback_metrics
    assert metrics["post_ahead"] == float(ahead)
    assert tuple(int(metrics[f"pdist/pipeline/stage{s}/stash_depth"]) for s in range(2)) == depths
    per_message = 16 * 8 + 2 * 8 * 4  # header + one (2, 8) fp32 activation or gradient
    # flushed schedules agree on non-finite gradients before the update (nonfinite='raise'): 2 float flags, 2 ranks
    flag = 8 if schedule == "gpipe" else 0
    assert float(metrics["pdist/comm_bytes"]) == 2 * per_message + flag  # stage 0: two activations per step
    assert float(metrics["pdist/pipeline/stage1/comm_bytes"]) == 2 * per_message + flag  # stage 1: two gradients
    assert 0.0 <= float(metrics["pdist/pipeline/bubble"]) < 1.0


def test_replicas_count_their_all_reduce():
    """With 2 replicas a stage also sends 2(R-1)/R of its gradient bytes per update (and, with nonfinite='raise', its
    share of the world's all-reduce of 4 float flags: 2·3/4·16 = 24 bytes)."""
    trainer = fit(pipeline(num_stages=2, num_microbatches=2), DeepRegression(lr=LR), devices=4, max_steps=2)
    stage0_params = (4 * 8 + 8) + (8 * 8 + 8)  # net.0 and net.2
    assert float(trainer.callback_metrics["pdist/comm_bytes"]) == 2 * (16 * 8 + 2 * 8 * 4) + stage0_params * 4 + 24


def bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


class BNRegression(DeepRegression):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net = bn_net()


def test_batchnorm_normalizes_each_micro_batch():
    """BatchNorm uses each micro-batch's statistics and updates its running stats once per micro-batch (as GPipe)."""
    module = BNRegression(lr=LR)
    fit(pipeline(num_stages=2, schedule="gpipe", num_microbatches=2, split_points=["net.3"]), module, devices=2, max_steps=4)
    expected = reference.accumulation(bn_net(), batches(4), 2, LR)
    assert_model_equals(module, expected)
    torch.testing.assert_close(module.net[1].running_mean, expected[1].running_mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(module.net[1].running_var, expected[1].running_var, atol=1e-6, rtol=0)
    assert int(module.net[1].num_batches_tracked) == 8


class DropoutRegression(DeepRegression):
    def __init__(self, p=0.5, **kwargs):
        super().__init__(**kwargs)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(p), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


class RecordMasks(Callback):
    """Saves, per rank, which units every Dropout layer of the module zeroed in training."""

    def __init__(self, dirpath):
        self.dirpath, self.masks = dirpath, []

    def on_train_start(self, trainer, pl_module):
        for layer in pl_module.net:
            if isinstance(layer, nn.Dropout):
                layer.register_forward_hook(lambda mod, inp, out: self.masks.append(out.detach() == 0))

    def on_train_end(self, trainer, pl_module):
        torch.save(self.masks, self.dirpath / f"rank{trainer.global_rank}.pt")


def test_stages_draw_their_own_dropout_masks(tmp_path):
    """Two stages seeded alike still draw different masks (each stage has its own stream: seed + 100 * stage)."""
    module = DeepRegression(lr=LR)
    module.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 2))
    fit(pipeline(num_stages=2, num_microbatches=2, split_points=["net.3"]), module, devices=2, max_steps=3,
        callbacks=[RecordMasks(tmp_path)])  # fmt: skip
    first, second = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert len(first) == len(second) == 6
    assert any(not torch.equal(a, b) for a, b in zip(first, second))


def test_dropout_is_reproducible_and_off_in_evaluation():
    """Dropout masks come from each stage's seeded RNG: equal runs agree, differ from p=0, and eval has no dropout."""
    runs = []
    for p in (0.5, 0.5, 0.0):
        module = DropoutRegression(p=p, lr=LR)
        fit(pipeline(num_stages=2, schedule="pipedream", num_microbatches=2), module, devices=2, max_steps=4)
        runs.append(reference.flat(module))
    torch.testing.assert_close(runs[0], runs[1], atol=0, rtol=0)
    assert not torch.allclose(runs[0], runs[2])
    module = DropoutRegression(p=0.5)
    data = DataLoader(regression_data(16, seed=3), batch_size=8)
    results = Trainer(accelerator="cpu", devices=2, strategy=pipeline(num_microbatches=2), logger=False, enable_progress_bar=False,
                      enable_model_summary=False).test(module, data)  # fmt: skip
    x, y = regression_data(16, seed=3).tensors
    module.eval()
    with torch.no_grad():
        assert results[0]["test/loss"] == pytest.approx(float(nn.functional.mse_loss(module(x), y)), abs=1e-6)
