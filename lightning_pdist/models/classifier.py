"""The LightningModule that recipes, tests and benchmarks train: any classifier, cross-entropy, one optimizer."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.nn import functional as F
from torchmetrics.classification import MulticlassAccuracy

from lightning_pdist.models.cnn import SmallCNN
from lightning_pdist.models.mlp import MLP
from lightning_pdist.models.text import BagOfEmbeddings

MODELS = ("cnn", "mlp", "text")
OPTIMIZERS = ("sgd", "adam", "adamw", "lbfgs")
LR_SCHEDULERS = ("cosine", "step")
DEFAULT_WIDTH = {"cnn": 16, "mlp": 128, "text": 64}


def build_model(
    name: str,
    num_classes: int = 10,
    in_channels: int = 1,
    image_size: int = 8,
    width: int | None = None,
    vocab_size: int = 20000,
) -> nn.Module:
    """The network called ``name``: ``"cnn"`` (:class:`SmallCNN`), ``"mlp"`` (:class:`MLP`) or ``"text"``
    (:class:`BagOfEmbeddings`).

    Args:
        name: one of :data:`MODELS`.
        num_classes: output logits.
        in_channels: image channels (cnn, mlp).
        image_size: side of the square images (cnn, mlp).
        width: CNN first-layer channels, MLP hidden units, or text embedding size; ``None`` takes
            :data:`DEFAULT_WIDTH` for the model.
        vocab_size: token ids the text model embeds (match the data module's).
    """
    if name not in MODELS:
        raise ValueError(f"build_model(name={name!r}): name must be one of {MODELS}, or pass an nn.Module instance")
    width = DEFAULT_WIDTH[name] if width is None else width
    if name == "cnn":
        return SmallCNN(in_channels=in_channels, num_classes=num_classes, image_size=image_size, width=width)
    if name == "mlp":
        return MLP(in_features=in_channels * image_size * image_size, num_classes=num_classes, hidden=width)
    return BagOfEmbeddings(vocab_size=vocab_size, num_classes=num_classes, embed_dim=width)


class ClassifierModule(LightningModule):
    """Cross-entropy classification of ``(x, y)`` batches with one optimizer and automatic optimization.

    Logs ``train/loss`` every step, ``val/loss`` and ``val/acc`` every validation epoch (synced across
    ranks), and ``test/loss`` and ``test/acc``. Accuracy is micro-averaged (the share of correct
    predictions). ``training_step`` returns the loss, so every strategy's ``optimizer_step`` and
    gradient hooks apply.

    All arguments are flat and type-hinted, so ``LightningCLI`` exposes them (``--model.lr 0.1``).

    Args:
        model: ``"cnn"``, ``"mlp"`` or ``"text"`` (see :func:`build_model`), or an ``nn.Module`` that maps
            ``x`` to ``(B, num_classes)`` logits (in YAML: ``class_path`` and ``init_args``).
        num_classes: classes of the data (10 for digits, MNIST, CIFAR-10; 2 for IMDB).
        in_channels: image channels, for a named image model (3 for CIFAR-10).
        image_size: side of the square images, for a named image model (28 for MNIST, 32 for CIFAR-10).
        width: size knob of a named model (see :func:`build_model`); ``None`` takes its default.
        vocab_size: for ``model="text"``; match the data module's ``vocab_size``.
        optimizer: ``"sgd"``, ``"adam"``, ``"adamw"`` or ``"lbfgs"`` (``torch.optim.LBFGS`` with ``max_iter=1``, no line
            search, history 10: one L-BFGS iteration per batch, what ``SandblasterStrategy`` runs).
        lr: learning rate. SGD on the digits CNN trains well at 0.05-0.1; Adam wants about 1e-3.
        momentum: SGD momentum (heavy ball); only for ``optimizer="sgd"``.
        nesterov: Nesterov momentum instead of heavy ball (``optimizer="sgd"``, ``momentum > 0``; EAMSGD's local step).
        weight_decay: L2 penalty (decoupled for AdamW).
        lr_scheduler: ``None``, ``"cosine"`` (to zero over the run, stepped every optimizer step) or
            ``"step"`` (times ``lr_gamma`` every ``lr_step_size`` epochs).
        lr_step_size: epochs between decays for ``lr_scheduler="step"``.
        lr_gamma: decay factor for ``lr_scheduler="step"``.
        max_steps_hint: horizon of the cosine schedule in optimizer steps; ``None`` uses the Trainer's
            ``estimated_stepping_batches``.
    """

    def __init__(
        self,
        model: str | nn.Module = "cnn",
        num_classes: int = 10,
        in_channels: int = 1,
        image_size: int = 8,
        width: int | None = None,
        vocab_size: int = 20000,
        optimizer: str = "sgd",
        lr: float = 0.05,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        lr_scheduler: str | None = None,
        lr_step_size: int = 30,
        lr_gamma: float = 0.1,
        max_steps_hint: int | None = None,
    ):
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"ClassifierModule(num_classes={num_classes}): num_classes must be >= 2")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"ClassifierModule(optimizer={optimizer!r}): optimizer must be one of {OPTIMIZERS}")
        if lr <= 0:
            raise ValueError(f"ClassifierModule(lr={lr}): lr must be > 0")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"ClassifierModule(momentum={momentum}): momentum must be in [0, 1)")
        if momentum and optimizer != "sgd":
            raise ValueError(
                f"ClassifierModule(momentum={momentum}): momentum applies to optimizer='sgd' only, not {optimizer!r}"
            )
        if nesterov and not momentum:
            raise ValueError(f"ClassifierModule(nesterov={nesterov!r}): nesterov needs optimizer='sgd' with momentum > 0")
        if weight_decay < 0:
            raise ValueError(f"ClassifierModule(weight_decay={weight_decay}): weight_decay must be >= 0")
        if weight_decay and optimizer == "lbfgs":
            raise ValueError(f"ClassifierModule(weight_decay={weight_decay}): torch.optim.LBFGS has no weight_decay")
        if lr_scheduler is not None and lr_scheduler not in LR_SCHEDULERS:
            raise ValueError(
                f"ClassifierModule(lr_scheduler={lr_scheduler!r}): lr_scheduler must be None or one of {LR_SCHEDULERS}"
            )
        if lr_step_size < 1:
            raise ValueError(f"ClassifierModule(lr_step_size={lr_step_size}): lr_step_size must be >= 1")
        if not 0.0 < lr_gamma <= 1.0:
            raise ValueError(f"ClassifierModule(lr_gamma={lr_gamma}): lr_gamma must be in (0, 1]")
        if max_steps_hint is not None and max_steps_hint < 1:
            raise ValueError(f"ClassifierModule(max_steps_hint={max_steps_hint}): max_steps_hint must be >= 1 or None")
        if isinstance(model, nn.Module):
            # The module is saved with the weights; keeping it in hparams too would pickle it twice.
            self.save_hyperparameters(ignore=["model"])
            self.model = model
        elif isinstance(model, str):
            self.save_hyperparameters()
            self.model = build_model(model, num_classes, in_channels, image_size, width, vocab_size)
        else:
            raise TypeError(
                f"ClassifierModule(model={type(model).__name__}): model must be a name in {MODELS} or an nn.Module"
            )
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, num_classes)``."""
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Cross-entropy of the batch; logged as ``train/loss``."""
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Accumulates ``val/loss`` and ``val/acc`` for the epoch."""
        self._evaluate(batch, "val", self.val_acc)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Accumulates ``test/loss`` and ``test/acc`` for the epoch."""
        self._evaluate(batch, "test", self.test_acc)

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], prefix: str, accuracy: MulticlassAccuracy) -> None:
        x, y = batch
        logits = self(x)
        accuracy.update(logits, y)
        self.log(f"{prefix}/loss", F.cross_entropy(logits, y), sync_dist=True)
        # A Metric object syncs its counts across ranks itself when Lightning computes it at epoch end.
        self.log(f"{prefix}/acc", accuracy, prog_bar=True)

    def configure_optimizers(self) -> Any:
        """The optimizer named by ``optimizer``, and the ``lr_scheduler`` if one is set."""
        hp = self.hparams
        if hp.optimizer == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay,
                                  nesterov=hp.get("nesterov", False))  # fmt: skip
        elif hp.optimizer == "lbfgs":
            opt = torch.optim.LBFGS(self.parameters(), lr=hp.lr, history_size=10, max_iter=1)
        elif hp.optimizer == "adam":
            opt = torch.optim.Adam(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        if hp.lr_scheduler is None:
            return opt
        if hp.lr_scheduler == "step":
            scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=hp.lr_step_size, gamma=hp.lr_gamma)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}
        horizon = hp.max_steps_hint or self.trainer.estimated_stepping_batches
        if horizon == float("inf"):
            raise ValueError(
                "ClassifierModule(lr_scheduler='cosine'): the cosine horizon is unknown; "
                "set max_steps_hint or give the Trainer max_steps or max_epochs"
            )
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=int(horizon))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
