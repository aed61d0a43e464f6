"""Tier 3: the base strategy's promises: comm hooks on CPU, registered names, clear errors."""

import pytest
import torch
from _helpers import TinyRegression, fit
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import StrategyRegistry
from torch.multiprocessing import ProcessRaisedException

import lightning_pdist
from lightning_pdist import BMUFStrategy, EASGDStrategy, LocalSGDStrategy, PdistStrategy, SimuParallelSGDStrategy

NAMES = {
    "pdist_ddp": PdistStrategy,
    "local_sgd": LocalSGDStrategy,
    "simuparallel_sgd": SimuParallelSGDStrategy,
    "bmuf": BMUFStrategy,
    "easgd": EASGDStrategy,
}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_names_are_registered_on_import(name):
    """`import lightning_pdist` registers each name (and its _fork variant) with Lightning."""
    assert lightning_pdist.__version__
    trainer = Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
    assert isinstance(trainer.strategy, NAMES[name])
    assert StrategyRegistry[f"{name}_fork"]["init_params"] == {"start_method": "fork"}


def _counting_hook(state, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state["calls"] += 1
    fut = torch.distributed.all_reduce(bucket.buffer().div_(2), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def test_user_comm_hook_runs_on_cpu():
    """A ddp_comm_hook given to PdistStrategy runs on gloo/CPU (Lightning 2.6 would skip it)."""

    class Check(Callback):
        def on_train_end(self, trainer, pl_module):
            assert trainer.strategy._ddp_comm_state["calls"] == 4
            assert trainer.strategy.model._get_ddp_logging_data()["comm_hook"] == "_counting_hook"

    with pytest.warns(UserWarning, match="not counted in pdist/comm_bytes"):
        fit(PdistStrategy(ddp_comm_hook=_counting_hook, ddp_comm_state={"calls": 0}, start_method="fork"),
            TinyRegression(), max_steps=4, callbacks=[Check()])


def test_pytorch_fp16_hook_trains_like_ddp_on_cpu():
    """torch's fp16_compress_hook through PdistStrategy lands within fp16 error of plain DDP, and not on it.

    The hook averages gradients rounded to fp16 (11 significant bits): plain DDP's fp32 average differs from it in
    the low bits, so a run that ignored the hook would equal plain DDP bit for bit."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    a, b = TinyRegression(), TinyRegression()
    fit("ddp_fork", a, max_steps=6)
    with pytest.warns(UserWarning):
        fit(PdistStrategy(ddp_comm_hook=fp16_compress_hook, start_method="fork"), b, max_steps=6)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=1e-3, rtol=0)
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters())), "the fp16 hook did not run"


@pytest.mark.parametrize("cls", [LocalSGDStrategy, BMUFStrategy, EASGDStrategy, SimuParallelSGDStrategy])
def test_averaging_strategies_refuse_a_foreign_comm_hook(cls):
    """The averaging strategies own gradient communication; passing ddp_comm_hook is an error."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    with pytest.raises(ValueError, match=rf"{cls.__name__}\(ddp_comm_hook=.*\): .*must be left unset"):
        cls(ddp_comm_hook=fp16_compress_hook)


def test_easgd_refuses_alpha_times_world_size_above_one():
    """EASGD(alpha=0.8) on 2 ranks stops at setup with the stability rule in the message."""
    with pytest.raises(ProcessRaisedException, match=r"alpha \* world_size = 1.6 must be <= 1"):
        fit(EASGDStrategy(alpha=0.8, start_method="fork"), TinyRegression(), max_steps=2)


def test_one_rank_warns_that_nothing_is_averaged():
    """world_size == 1 works and warns once that nothing is averaged."""
    with pytest.warns(UserWarning, match=r"world_size == 1, so there is nothing to average"):
        fit(LocalSGDStrategy(period=2), TinyRegression(), devices=1, max_steps=4)


class _Manual(TinyRegression):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()


def test_manual_optimization_equals_automatic():
    """Manual optimization with local SGD ends exactly where automatic optimization does."""
    a, b = TinyRegression(), _Manual()
    fit(LocalSGDStrategy(period=3, warmup_steps=2, start_method="fork"), a, max_steps=8)
    fit(LocalSGDStrategy(period=3, warmup_steps=2, start_method="fork"), b, max_steps=8)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def test_gradient_accumulation_counts_optimizer_steps():
    """With accumulate_grad_batches=2 the period counts optimizer steps: 8 steps, period 4 → 2 averages."""

    class Check(Callback):
        def on_train_end(self, trainer, pl_module):
            assert trainer.strategy.step == 8
            # two model averages, and the non-finite flag (2 floats on 2 ranks: 8 bytes) once per optimizer step
            assert trainer.strategy.comm_meter.total_bytes == 2 * 58 * 4 + 8 * 8

    fit(LocalSGDStrategy(period=4, start_method="fork"), TinyRegression(), max_steps=8, accumulate_grad_batches=2,
        callbacks=[Check()])


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: LocalSGDStrategy(period=0), r"LocalSGDStrategy\(period=0\): period must be >= 1"),
        (lambda: LocalSGDStrategy(warmup_steps=-2), r"LocalSGDStrategy\(warmup_steps=-2\): warmup_steps must be >= 0"),
        (lambda: BMUFStrategy(block_momentum=1.5), r"BMUFStrategy\(block_momentum=1.5\): block_momentum must be in \[0, 1\)"),
        (lambda: BMUFStrategy(block_lr=0), r"BMUFStrategy\(block_lr=0\): block_lr must be a finite number > 0"),
        (lambda: EASGDStrategy(alpha=0), r"EASGDStrategy\(alpha=0\): alpha must be in \(0, 1\]"),
        (lambda: EASGDStrategy(period=-1), r"EASGDStrategy\(period=-1\): period must be >= 1"),
    ],
)
def test_constructors_reject_bad_values_naming_the_strategy(make, match):
    """Strategy constructors validate before any process starts, naming class, argument, value and rule."""
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: LocalSGDStrategy(period=2.5), r"LocalSGDStrategy\(period=2.5\): period must be an int"),
        (lambda: BMUFStrategy(block_momentum="0.5"), r"BMUFStrategy\(block_momentum='0.5'\): block_momentum must be a number"),
        (lambda: BMUFStrategy(block_lr=None), r"BMUFStrategy\(block_lr=None\): block_lr must be a number"),
        (lambda: BMUFStrategy(nesterov="yes"), r"BMUFStrategy\(nesterov='yes'\): nesterov must be a bool"),
        (lambda: EASGDStrategy(alpha=True), r"EASGDStrategy\(alpha=True\): alpha must be a number or None"),
    ],
)
def test_constructors_reject_wrong_types_naming_the_argument(make, match):
    """A value of the wrong type raises TypeError naming class, argument and value, not Python's comparison error."""
    with pytest.raises(TypeError, match=match):
        make()


def test_sparse_embedding_gradients_train_under_pdist_ddp_as_one_process_would():
    """An ``EmbeddingBag(sparse=True)`` table on 2 fork-launched ranks through the DDP comm hook (the non-finite check
    and the byte count read a sparse bucket's values): rank 0's final weights equal one process taking the same
    SGD steps on both ranks' batches at once (the mean of two equal-size batch means is the union's mean)."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_pdist.models import SparseBagClassifier

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(1, 40, (48, 6), generator=g), torch.randint(0, 2, (48,), generator=g))

    class Bag(SparseBagClassifier):
        def train_dataloader(self):
            return DataLoader(data, batch_size=4)

        def configure_optimizers(self):  # plain SGD: a step proportional to the gradient (Adagrad would hide a scale)
            return torch.optim.SGD(self.parameters(), lr=0.5)

    torch.manual_seed(0)
    module = Bag(vocab_size=40, embed_dim=4, lr=0.5, head_lr=0.1)
    reference = Bag(vocab_size=40, embed_dim=4, lr=0.5, head_lr=0.1)
    reference.load_state_dict(module.state_dict())
    fit(PdistStrategy(start_method="fork"), module, max_steps=3)
    opt = reference.configure_optimizers()
    # what Lightning's distributed sampler hands each rank in a training fit (shuffled, seed 0, epoch 0)
    order = [list(DistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=0)) for r in (0, 1)]
    for step in range(3):
        idx = [order[r][4 * step + k] for r in (0, 1) for k in range(4)]  # both ranks' batch of this step
        x, y = data[idx]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        opt.step()
    for (name, got), want in zip(module.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=name)
    assert not torch.equal(module.model.embedding.weight, Bag(vocab_size=40, embed_dim=4).model.embedding.weight)
