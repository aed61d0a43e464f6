"""BERT-like and ALBERT-like text classifiers built offline from a ``transformers`` config (random weights).

Paper 003 trains BERT-base and ALBERT-base on IMDB; these are the same architectures at this machine's scale
(the defaults: 2 layers, hidden 128, 4 heads, FFN 512, instead of 12 / 768 / 12 / 3072). Nothing is downloaded:
the model comes from ``BertConfig`` / ``AlbertConfig`` with random initialisation. ``transformers`` is an
optional dependency (``pip install lightning_pdist[encoders]``); it is imported when a model is built.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_pdist.models.text import PAD

FAMILIES = ("bert", "albert")


class EncoderClassifier(nn.Module):
    """``transformers``' BERT or ALBERT for sequence classification on padded token ids (0 = padding).

    ALBERT shares one Transformer block across all its layers (``num_hidden_groups=1``) and factorises the
    embedding (``embedding_size`` < ``hidden_size``), as in the paper that introduced it.

    Args:
        family: ``"bert"`` or ``"albert"``.
        vocab_size: token ids in ``[0, vocab_size)``; match the data module's.
        num_classes: output logits (2 for IMDB).
        hidden_size: model width; a multiple of ``num_heads``.
        num_layers: Transformer blocks (ALBERT: how many times its one shared block runs).
        num_heads: attention heads; tensor parallelism needs them divisible by its degree.
        intermediate_size: FFN width.
        max_len: longest sequence (position embeddings).
        dropout: hidden and attention dropout (0 makes the forward deterministic).
        embedding_size: ALBERT's factorised embedding width (ignored for BERT).
    """

    def __init__(
        self,
        family: str = "bert",
        vocab_size: int = 20000,
        num_classes: int = 2,
        hidden_size: int = 128,
        num_layers: int = 2,
        num_heads: int = 4,
        intermediate_size: int = 512,
        max_len: int = 256,
        dropout: float = 0.1,
        embedding_size: int = 64,
    ):
        super().__init__()
        if family not in FAMILIES:
            raise ValueError(f"EncoderClassifier(family={family!r}): family must be one of {FAMILIES}")
        for arg, value in (("vocab_size", vocab_size), ("num_classes", num_classes), ("hidden_size", hidden_size),
                           ("num_layers", num_layers), ("num_heads", num_heads),
                           ("intermediate_size", intermediate_size), ("max_len", max_len),
                           ("embedding_size", embedding_size)):  # fmt: skip
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EncoderClassifier({arg}={value!r}): {arg} must be an int >= 1")
        if hidden_size % num_heads:
            raise ValueError(f"EncoderClassifier(hidden_size={hidden_size}): hidden_size must be a multiple of "
                             f"num_heads={num_heads}")  # fmt: skip
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"EncoderClassifier(dropout={dropout}): dropout must be in [0, 1)")
        try:
            import transformers
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError("EncoderClassifier needs transformers: pip install 'lightning_pdist[encoders]'") from err
        common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                      num_attention_heads=num_heads, intermediate_size=intermediate_size,
                      max_position_embeddings=max_len, hidden_dropout_prob=dropout,
                      attention_probs_dropout_prob=dropout, num_labels=num_classes, pad_token_id=PAD)  # fmt: skip
        if family == "bert":
            config = transformers.BertConfig(**common, classifier_dropout=dropout)
            self.encoder = transformers.BertForSequenceClassification(config)
        else:
            config = transformers.AlbertConfig(**common, embedding_size=embedding_size, num_hidden_groups=1,
                                               inner_group_num=1, classifier_dropout_prob=dropout)  # fmt: skip
            self.encoder = transformers.AlbertForSequenceClassification(config)
        self.family = family

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, num_classes)`` for int64 token ids ``(B, L)``; padding (0) is masked out of attention."""
        return self.encoder(input_ids=tokens, attention_mask=(tokens != PAD).long()).logits
