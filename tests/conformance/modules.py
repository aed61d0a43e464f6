"""The LightningModules users have, small enough to run every one under every strategy.

Each entry is a module class with a no-argument constructor (so ``load_from_checkpoint`` needs
nothing), the Trainer settings it is used with, and what the matrix may expect of it:

* ``deterministic``: a resumed run must end where the uninterrupted one does (dropout is not: the
  RNG state is not in Lightning's checkpoints).
* ``unused``: some parameters get no gradient in some backward passes; DDP-based strategies need
  their ``<name>_find_unused_parameters_true`` variant, as Lightning's ``ddp`` does.

Every module trains on ``STEPS_PER_EPOCH`` batches of 4 per rank and evaluates on 2 batches, with
data generated from fixed seeds (identical on every rank, as a user's dataset would be).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torchmetrics
from lightning.pytorch import LightningModule
from lightning.pytorch.demos import Transformer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS_PER_EPOCH = 4
BATCH = 4
WORLD = 2


def _data(n: int, d_in: int, classes: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    y = (x[:, :classes] + 0.3 * torch.randn(n, classes, generator=g)).argmax(1)
    return TensorDataset(x, y)


class Classifier(LightningModule):
    """Plain automatic optimization: an MLP classifier, SGD with momentum; the base of most entries."""

    d_in, classes = 8, 3

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = self.build()

    def build(self) -> nn.Module:
        return nn.Sequential(nn.Linear(self.d_in, 16), nn.Tanh(), nn.Linear(16, self.classes))

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def dataset(self, split: str) -> TensorDataset:
        n = WORLD * BATCH * STEPS_PER_EPOCH if split == "train" else WORLD * BATCH * 2
        return _data(n, self.d_in, self.classes, seed={"train": 0, "val": 1, "test": 2, "predict": 3}[split])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset("train"), batch_size=BATCH)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset("val"), batch_size=BATCH)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset("test"), batch_size=BATCH)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset("predict"), batch_size=BATCH)


class GAN(Classifier):
    """Manual optimization with two optimizers toggled in turn (Lightning's GAN recipe)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(1)
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, self.d_in))
        self.net = nn.Sequential(nn.Linear(self.d_in, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))  # discriminator

    def loss(self, batch: Any) -> torch.Tensor:  # validation: how well the discriminator tells real from fake
        x, _ = batch
        fake = self.generator(torch.randn(x.shape[0], 4, generator=torch.Generator().manual_seed(7)))
        logits = torch.cat([self.net(x), self.net(fake)]).squeeze(1)
        target = torch.cat([torch.ones(x.shape[0]), torch.zeros(x.shape[0])])
        return nn.functional.binary_cross_entropy_with_logits(logits, target)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(x.shape[0], 4, generator=torch.Generator().manual_seed(batch_idx))
        self.toggle_optimizer(opt_g)
        g_loss = nn.functional.binary_cross_entropy_with_logits(self.net(self.generator(z)).squeeze(1), torch.ones(x.shape[0]))
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        d_loss = self.loss(batch)
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.log_dict({"g_loss": g_loss, "train_loss": d_loss}, prog_bar=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])

    def configure_optimizers(self) -> Any:
        return [torch.optim.Adam(self.generator.parameters(), lr=1e-3), torch.optim.Adam(self.net.parameters(), lr=1e-3)]


class SlowSecondOptimizer(Classifier):
    """Two optimizers on one loss; the second steps only every other batch (manual optimization)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_a, opt_b = self.optimizers()
        loss = self.loss(batch)
        self.manual_backward(loss)
        opt_a.step()
        if batch_idx % 2 == 1:
            opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.log("train_loss", loss)

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.05), torch.optim.SGD(self.net[2].parameters(), lr=0.05)]


class BatchNormOneCycle(Classifier):
    """BatchNorm, OneCycleLR stepped every batch, used with gradient clipping (and accumulation)."""

    def build(self) -> nn.Module:
        return nn.Sequential(nn.Linear(self.d_in, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, self.classes))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=64)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Dropout(Classifier):
    def build(self) -> nn.Module:
        return nn.Sequential(nn.Linear(self.d_in, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, self.classes))


class SyncedMetrics(Classifier):
    """torchmetrics objects logged by attribute, and sync_dist=True values."""

    def __init__(self) -> None:
        super().__init__()
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=self.classes)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=self.classes)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc, on_epoch=True, sync_dist=True)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.test_acc(self.net(x), y)
        self.log("test_acc", self.test_acc, on_epoch=True)


class UnusedSometimes(Classifier):
    """An auxiliary head that joins the loss on odd batches only."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(self.d_in, self.classes)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x) + (self.aux(x) if batch_idx % 2 else 0.0)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss)
        return loss


class Frozen(Classifier):
    """The first layer is frozen (requires_grad=False), as in fine-tuning."""

    def __init__(self) -> None:
        super().__init__()
        self.net[0].requires_grad_(False)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class TokenTransformer(Classifier):
    """Lightning's demo Transformer LM (reduced) on random tokens."""

    vocab = 32

    def build(self) -> nn.Module:
        return Transformer(vocab_size=self.vocab, ninp=16, nhead=2, nhid=32, nlayers=1, dropout=0.0)

    def loss(self, batch: Any) -> torch.Tensor:
        inputs, target = batch
        return nn.functional.nll_loss(self.net(inputs, target), target.view(-1))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(*batch)

    def dataset(self, split: str) -> TensorDataset:
        n = WORLD * BATCH * STEPS_PER_EPOCH if split == "train" else WORLD * BATCH * 2
        g = torch.Generator().manual_seed(len(split))
        tokens = torch.randint(0, self.vocab, (n, 9), generator=g)
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class HFEncoder(Classifier):
    """A ``transformers`` BERT encoder (random init from a config) with a classification head."""

    def build(self) -> nn.Module:
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=32, max_position_embeddings=16, num_labels=self.classes,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
        return BertForSequenceClassification(config)

    def loss(self, batch: Any) -> torch.Tensor:
        ids, y = batch
        return nn.functional.cross_entropy(self.net(input_ids=ids).logits, y)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(input_ids=batch[0]).logits

    def dataset(self, split: str) -> TensorDataset:
        n = WORLD * BATCH * STEPS_PER_EPOCH if split == "train" else WORLD * BATCH * 2
        g = torch.Generator().manual_seed(len(split))
        ids = torch.randint(0, 40, (n, 8), generator=g)
        return TensorDataset(ids, ids[:, 0] % self.classes)


class _EncoderNet(nn.Module):
    """Token embeddings, torch's ``nn.TransformerEncoder`` (2 post-norm layers, batch-first) with a padding mask,
    mean-pooled into a linear head."""

    def __init__(self, vocab: int, width: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=ids == 0).mean(1))


class TorchEncoder(Classifier):
    """torch's ``nn.TransformerEncoder`` classifier on random tokens, some padded: the encoder a user builds from
    ``torch.nn`` alone."""

    vocab = 40

    def build(self) -> nn.Module:
        return _EncoderNet(self.vocab, 16, self.classes)

    def dataset(self, split: str) -> TensorDataset:
        n = WORLD * BATCH * STEPS_PER_EPOCH if split == "train" else WORLD * BATCH * 2
        g = torch.Generator().manual_seed(len(split))
        ids = torch.randint(1, self.vocab, (n, 8), generator=g)
        ids[::3, 6:] = 0  # padding, masked in attention
        return TensorDataset(ids, ids[:, 0] % self.classes)


class Boring(BoringModel):
    """Lightning's own BoringModel, unchanged (its random data come from the seed set before it is built)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__()


@dataclass(frozen=True)
class ModuleSpec:
    make: Callable[[], LightningModule]
    trainer: dict = field(default_factory=dict)  # Trainer arguments; a callable value is called per Trainer
    deterministic: bool = True
    unused: bool = False
    about: str = ""


MODULES: dict[str, ModuleSpec] = {
    "boring": ModuleSpec(Boring, about="Lightning's BoringModel (one Linear layer, StepLR)"),
    "plain": ModuleSpec(Classifier, about="MLP, automatic optimization, SGD with momentum"),
    "gan": ModuleSpec(GAN, unused=True, about="manual optimization, two Adam optimizers toggled (GAN)"),
    "slow_second_optimizer": ModuleSpec(SlowSecondOptimizer, about="two optimizers, the second steps every other batch"),
    "batchnorm_clip_norm_accumulate": ModuleSpec(
        BatchNormOneCycle, trainer=dict(gradient_clip_val=1.0, accumulate_grad_batches=2),
        about="BatchNorm + per-step OneCycleLR + norm clipping + accumulate_grad_batches=2",
    ),
    "batchnorm_clip_value": ModuleSpec(
        BatchNormOneCycle, trainer=dict(gradient_clip_val=0.5, gradient_clip_algorithm="value"),
        about="BatchNorm + per-step OneCycleLR + value clipping",
    ),
    "dropout": ModuleSpec(Dropout, deterministic=False, about="dropout (resume not bit-exact: RNG state)"),
    "metrics_sync_dist": ModuleSpec(SyncedMetrics, about="torchmetrics Accuracy + sync_dist=True"),
    "unused_parameters": ModuleSpec(UnusedSometimes, unused=True, about="a head unused on even batches"),
    "frozen": ModuleSpec(Frozen, about="frozen first layer, Adam on the rest"),
    "transformer_lm": ModuleSpec(TokenTransformer, about="Lightning's demo Transformer LM, random tokens"),
    "hf_bert": ModuleSpec(HFEncoder, about="transformers BERT encoder (random init)"),
    "torch_encoder": ModuleSpec(TorchEncoder, about="torch's nn.TransformerEncoder (2 layers, a padding mask), mean-pooled"),
    "bf16_mixed": ModuleSpec(Classifier, trainer=dict(precision="bf16-mixed"), about="precision='bf16-mixed'"),
    "16_mixed": ModuleSpec(Classifier, trainer=dict(precision="16-mixed"),
                           about="precision='16-mixed' (on CPU Lightning runs bf16-mixed instead)"),
    "fp16_grad_scaler": ModuleSpec(Classifier, trainer=dict(plugins=lambda: [MixedPrecision("16-mixed", "cpu")]),
                                   about="fp16 autocast with a GradScaler (MixedPrecision('16-mixed', 'cpu'))"),
    "bf16_true": ModuleSpec(Classifier, trainer=dict(precision="bf16-true"), about="precision='bf16-true'"),
}
