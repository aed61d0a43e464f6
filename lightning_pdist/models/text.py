"""A bag-of-embeddings text classifier for padded token ids (the IMDB data module's output)."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

PAD = 0  # the padding id of lightning_pdist.data.imdb; kept here so models never import data


class BagOfEmbeddings(nn.Sequential):
    """Mean of the non-padding token embeddings, then a linear layer (fastText without n-grams).

    ``EmbeddingBag(mode="mean", padding_idx=0)`` skips padding in the mean; an all-padding row gives a
    zero vector. Embedding gradients are dense by default, so every distributed algorithm sees an ordinary dense
    parameter; ``sparse=True`` makes the table's gradient a sparse tensor holding only the rows the batch touched
    (then step it with SGD without weight decay, Adagrad or SparseAdam).

    Args:
        vocab_size: ids in ``[0, vocab_size)``, 0 being padding.
        num_classes: output logits.
        embed_dim: embedding width.
        sparse: row-sparse gradients for the embedding table (``nn.EmbeddingBag(sparse=True)``).
    """

    def __init__(self, vocab_size: int = 20000, num_classes: int = 2, embed_dim: int = 64, sparse: bool = False):
        limits = (("vocab_size", vocab_size, 2), ("num_classes", num_classes, 2), ("embed_dim", embed_dim, 1))
        for arg, value, low in limits:
            if value < low:
                raise ValueError(f"BagOfEmbeddings({arg}={value}): {arg} must be >= {low}")
        # An nn.Sequential (embedding, head), so a pipeline can cut it; parameter names are embedding.* and head.*.
        table = nn.EmbeddingBag(vocab_size, embed_dim, mode="mean", padding_idx=PAD, sparse=sparse)
        super().__init__(OrderedDict(embedding=table, head=nn.Linear(embed_dim, num_classes)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, num_classes)`` for int64 token ids ``(B, L)``."""
        if tokens.ndim != 2 or tokens.dtype != torch.int64:
            raise ValueError(
                f"BagOfEmbeddings.forward(tokens={tuple(tokens.shape)} {tokens.dtype}): tokens must be int64 (B, L)"
            )
        return super().forward(tokens)
