"""ClassifierModule (and build_model's MLP and text models): training, logging, optimizers, schedulers, checks."""

import lightning as L
import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pdist.data import DigitsDataModule
from lightning_pdist.models import MLP, BagOfEmbeddings, ClassifierModule, SmallCNN, build_model


def _trainer(**kwargs) -> Trainer:
    defaults = dict(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    return Trainer(**(defaults | kwargs))


def test_one_epoch_on_digits_beats_chance_by_far():
    """One single-process epoch of the default CNN lifts validation accuracy from chance to over 70%."""
    L.seed_everything(0, verbose=False)
    module, dm = ClassifierModule(), DigitsDataModule()
    trainer = _trainer()
    before = trainer.validate(module, dm, verbose=False)[0]["val/acc"]
    trainer.fit(module, dm)
    metrics = trainer.callback_metrics
    assert before < 0.3 and metrics["val/acc"] > 0.7
    assert {"train/loss", "val/loss", "val/acc"} <= set(metrics)
    assert trainer.test(module, dm, verbose=False)[0]["test/acc"] == pytest.approx(float(metrics["val/acc"]))


def test_hparams_are_saved_flat():
    """save_hyperparameters records every init argument by name, for checkpoints and the CLI."""
    module = ClassifierModule(model="mlp", lr=0.1, lr_scheduler="step")
    assert module.hparams.model == "mlp" and module.hparams.lr == 0.1 and module.hparams.lr_scheduler == "step"
    assert isinstance(module.model, MLP)


def test_accepts_a_module_instance_and_keeps_it_out_of_hparams():
    """An nn.Module passed as model is used as is and not pickled into hparams."""
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    module = ClassifierModule(model=net)
    assert module.model is net and "model" not in module.hparams
    assert module(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


@pytest.mark.parametrize(
    ("name", "cls", "x"),
    [
        ("cnn", SmallCNN, torch.rand(3, 1, 8, 8)),
        ("mlp", MLP, torch.rand(3, 1, 8, 8)),
        ("text", BagOfEmbeddings, torch.randint(0, 50, (3, 7))),
    ],
)
def test_build_model_by_name(name, cls, x):
    """Each model name builds its class, which maps that input to (B, num_classes) logits."""
    model = build_model(name, num_classes=4, vocab_size=50)
    assert isinstance(model, cls) and model(x).shape == (3, 4)


def test_text_model_ignores_padding():
    """Trailing padding does not change the bag-of-embeddings logits."""
    model = BagOfEmbeddings(vocab_size=10, num_classes=2, embed_dim=4)
    torch.testing.assert_close(model(torch.tensor([[3, 4, 0, 0]])), model(torch.tensor([[3, 4]])))


def test_text_model_learns_a_keyword_task():
    """ClassifierModule(model="text") fits a toy task (label = token 2 present) in a few short epochs."""
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 30, (256, 8), generator=g)
    labels = torch.randint(0, 2, (256,), generator=g)
    tokens[labels == 1, 0] = 2
    loader = DataLoader(TensorDataset(tokens, labels), batch_size=32, shuffle=True)
    module = ClassifierModule(model="text", num_classes=2, vocab_size=30, optimizer="adam", lr=0.05)
    trainer = _trainer(max_epochs=5, limit_val_batches=8)
    trainer.fit(module, loader, DataLoader(TensorDataset(tokens, labels), batch_size=64))
    assert trainer.callback_metrics["val/acc"] > 0.95


@pytest.mark.parametrize(
    ("name", "cls"), [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)]
)
def test_optimizer_by_name(name, cls):
    """The optimizer name picks the torch optimizer with the given lr and weight decay."""
    opt = ClassifierModule(optimizer=name, lr=0.01, weight_decay=0.001).configure_optimizers()
    assert type(opt) is cls and opt.defaults["lr"] == 0.01 and opt.defaults["weight_decay"] == 0.001


def test_sgd_momentum_is_passed_through():
    """momentum (and nesterov, EAMSGD's local step) reach SGD."""
    assert ClassifierModule(momentum=0.9).configure_optimizers().defaults["momentum"] == 0.9
    assert ClassifierModule(momentum=0.9, nesterov=True).configure_optimizers().defaults["nesterov"] is True


def test_cosine_schedule_anneals_over_the_run():
    """lr_scheduler="cosine" steps every batch and reaches ~0 at the end of the Trainer's run."""
    module = ClassifierModule(lr_scheduler="cosine")
    trainer = _trainer(max_steps=6, limit_val_batches=0)
    trainer.fit(module, DigitsDataModule(train_subset=192))
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    assert trainer.lr_scheduler_configs[0].interval == "step" and trainer.lr_scheduler_configs[0].scheduler.T_max == 6


def test_step_schedule_decays_per_epoch():
    """lr_scheduler="step" multiplies the lr by lr_gamma every lr_step_size epochs."""
    module = ClassifierModule(lr=0.1, lr_scheduler="step", lr_step_size=1, lr_gamma=0.5)
    trainer = _trainer(max_epochs=2, limit_train_batches=2, limit_val_batches=0)
    trainer.fit(module, DigitsDataModule())
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.025)


def test_cosine_without_horizon_raises():
    """A cosine schedule with no max_steps_hint and an unbounded Trainer raises, saying how to fix it."""
    module = ClassifierModule(lr_scheduler="cosine")
    trainer = _trainer(max_epochs=-1, limit_val_batches=0)
    with pytest.raises(ValueError, match=r"ClassifierModule\(lr_scheduler='cosine'\): the cosine horizon is unknown"):
        trainer.fit(module, DigitsDataModule(train_subset=64))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(model="resnet"), ValueError, r"build_model\(name='resnet'\): name must be one of \('cnn', 'mlp'"),
        (dict(model=3), TypeError, r"ClassifierModule\(model=int\): model must be a name"),
        (dict(num_classes=1), ValueError, r"num_classes=1\): num_classes must be >= 2"),
        (dict(optimizer="lamb"), ValueError, r"optimizer='lamb'\): optimizer must be one of"),
        (dict(lr=0.0), ValueError, r"lr=0.0\): lr must be > 0"),
        (dict(momentum=1.0), ValueError, r"momentum=1.0\): momentum must be in \[0, 1\)"),
        (dict(momentum=0.9, optimizer="adam"), ValueError, r"momentum=0.9\): momentum .*'sgd' only, not 'adam'"),
        (dict(nesterov=True), ValueError, r"nesterov=True\): nesterov needs optimizer='sgd' with momentum > 0"),
        (dict(weight_decay=-1.0), ValueError, r"weight_decay=-1.0\): weight_decay must be >= 0"),
        (dict(lr_scheduler="linear"), ValueError, r"lr_scheduler='linear'\): lr_scheduler must be None or one of"),
        (dict(lr_step_size=0), ValueError, r"lr_step_size=0\): lr_step_size must be >= 1"),
        (dict(lr_gamma=0.0), ValueError, r"lr_gamma=0.0\): lr_gamma must be in \(0, 1\]"),
        (dict(max_steps_hint=0), ValueError, r"max_steps_hint=0\): max_steps_hint must be >= 1"),
    ],
)
def test_bad_arguments_raise(kwargs, error, message):
    """Each bad argument raises the right error type naming it, its value and the rule."""
    with pytest.raises(error, match=message):
        ClassifierModule(**kwargs)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: MLP(in_features=0), r"MLP\(in_features=0\): in_features must be >= 1"),
        (lambda: MLP(hidden=0), r"MLP\(hidden=0\): hidden must be >= 1"),
        (lambda: BagOfEmbeddings(vocab_size=1), r"BagOfEmbeddings\(vocab_size=1\): vocab_size must be >= 2"),
        (lambda: BagOfEmbeddings(embed_dim=0), r"BagOfEmbeddings\(embed_dim=0\): embed_dim must be >= 1"),
        (lambda: BagOfEmbeddings()(torch.zeros(2, 3)), r"forward\(tokens=\(2, 3\) torch.float32\): tokens must"),
    ],
)
def test_mlp_and_text_models_reject_bad_arguments(build, message):
    """MLP and BagOfEmbeddings reject out-of-range sizes and non-token inputs, naming the value."""
    with pytest.raises(ValueError, match=message):
        build()


def test_sparse_bag_classifier_steps_only_the_rows_its_batch_touched():
    """SparseBagClassifier: the table's gradient is a sparse tensor of the touched rows; one Adagrad step moves exactly
    those rows (the first step from G = 0 is lr·g/(|g| + 1e-10), written out here) and the head at head_lr; the
    table is nearly all the parameters."""
    from lightning_pdist.models import SparseBagClassifier

    torch.manual_seed(0)
    module = SparseBagClassifier(vocab_size=100, embed_dim=8, lr=3.0, head_lr=0.1)
    table = module.model.embedding.weight
    assert table.numel() / sum(p.numel() for p in module.parameters()) > 0.97
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    tokens, y = torch.tensor([[5, 7, 0, 0], [7, 9, 11, 0]]), torch.tensor([0, 1])
    opt = module.configure_optimizers()
    torch.nn.functional.cross_entropy(module(tokens), y).backward()
    grad = table.grad
    assert grad.is_sparse and set(grad.coalesce().indices()[0].tolist()) == {5, 7, 9, 11}
    head_grad = module.model.head.weight.grad.clone()
    opt.step()
    moved = (table.detach() != before["model.embedding.weight"]).any(dim=1).nonzero().flatten().tolist()
    assert moved == [5, 7, 9, 11]
    first = lambda g, lr: lr * g / (g.square().sqrt() + 1e-10)  # noqa: E731
    torch.testing.assert_close(table.detach(), before["model.embedding.weight"] - first(grad.to_dense(), 3.0))
    torch.testing.assert_close(module.model.head.weight.detach(), before["model.head.weight"] - first(head_grad, 0.1))
    with pytest.raises(ValueError, match=r"SparseBagClassifier\(head_lr=0\): head_lr must be > 0"):
        SparseBagClassifier(head_lr=0)
