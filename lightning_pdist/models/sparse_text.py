"""A bag-of-embeddings sentiment classifier whose embedding table gets row-sparse gradients: the case Hogwild! was
made for (Recht et al. 2011: each step touches few coordinates, so lock-free writes seldom collide)."""

from __future__ import annotations

import torch

from lightning_pdist.models.classifier import ClassifierModule
from lightning_pdist.models.text import BagOfEmbeddings

#: Every id of the synthetic IMDB reviews (lightning_pdist.data.imdb_synthetic: 12,000 made-up words and 10 sentiment
#: words) plus padding and unknown: each word has its own row.
SYNTHETIC_VOCAB = 12012


class SparseBagClassifier(ClassifierModule):
    """``BagOfEmbeddings(sparse=True)`` (mean of the review's token rows, then a linear layer) trained by Adagrad.

    The defaults make the table the model: ``vocab_size · embed_dim = 12,012 · 32 = 384,384`` table parameters
    against ``32 · 2 + 2 = 66`` in the head (99.98%). A batch of 32 synthetic reviews (40-200 words, about half of
    them from a Zipf head) touches a few thousand of the 12,012 rows, so the gradient ``∂L/∂E`` is nonzero only in
    those rows: ``EmbeddingBag(sparse=True)`` hands the optimizer a sparse tensor of them, and the step writes only
    those rows. That is what makes lock-free (Hogwild!) steps rarely
    overwrite each other, and what a dense all-reduce or model exchange pays for in full (the whole table per step).

    Adagrad (Duchi et al. 2011), which steps sparse gradients row by row: ``G[r] += g[r]²``,
    ``E[r] −= lr · g[r] / (√G[r] + ε)`` for the touched rows only (a momentum buffer or an L2 term would touch every
    row each step). Plain SGD does not train this model in the suite's 96 steps: the most frequent words sit in
    nearly every review, so their rows act as a bias that a rate large enough for the rare sentiment rows (the mean
    over 40-200 tokens scales each row's gradient by about 1/120) throws from class to class; on the synthetic
    reviews, one process at batch 32 or 128 swung between 0.5 and 1.0 validation accuracy with SGD at table rates
    10 to 300, and stayed between 0.89 and 1.0 from step 24 on with Adagrad at the defaults. Two parameter groups:
    the table at ``lr``, the head (features of norm about 1) at ``head_lr``. (``optimizer='sgd'`` in the
    hyperparameters is ClassifierModule's, unused: :meth:`configure_optimizers` builds the Adagrad.)

    Args:
        vocab_size: rows of the table (match the data module's ``vocab_size``; 0 is padding).
        embed_dim: width of each row.
        lr: Adagrad learning rate of the table.
        head_lr: Adagrad learning rate of the linear head.
    """

    def __init__(self, vocab_size: int = SYNTHETIC_VOCAB, embed_dim: int = 32, lr: float = 0.2, head_lr: float = 0.02):
        if head_lr <= 0:
            raise ValueError(f"SparseBagClassifier(head_lr={head_lr}): head_lr must be > 0")
        model = BagOfEmbeddings(vocab_size=vocab_size, num_classes=2, embed_dim=embed_dim, sparse=True)
        super().__init__(model=model, num_classes=2, optimizer="sgd", lr=lr)

    def configure_optimizers(self) -> torch.optim.Adagrad:
        """Adagrad over two groups: the table at ``lr``, the head at ``head_lr``."""
        hp = self.hparams
        groups = [{"params": [self.model.embedding.weight], "lr": hp.lr},
                  {"params": list(self.model.head.parameters()), "lr": hp.head_lr}]  # fmt: skip
        return torch.optim.Adagrad(groups, lr=hp.lr)
