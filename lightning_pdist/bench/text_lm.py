"""The suites' byte-level Transformer language model on the Python standard library's own source (no download).

Shared by the DiLoCo suite (:mod:`~lightning_pdist.bench.diloco_worker`, a plain Fabric loop) and the compression
suite (:mod:`~lightning_pdist.bench.compression_worker`, ``Trainer.fit`` through :class:`LMModule`):

* :func:`stdlib_text`: the first ``text_bytes`` of the standard library's top-level ``*.py`` files, concatenated in
  name order; the last :data:`VAL_BYTES` are held out;
* :func:`make_model`: ``TinyLM``, byte embedding + learned positions, ``layers`` pre-norm causal Transformer blocks
  (4 heads, feed-forward ``4·width``), a linear head over the 256 bytes; the same weights on every rank for a seed;
* :class:`Data`: training windows of ``context`` bytes drawn per rank and step from a generator seeded
  ``1000·seed + rank``; :data:`VAL_WINDOWS` fixed held-out windows;
* :func:`evaluate`: mean cross-entropy (nats/byte) and next-byte accuracy on the held-out windows.

A spec (a dict) names ``width``, ``layers``, ``context``, ``batch_size``, ``text_bytes`` and ``seed``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

__all__ = ["VAL_BYTES", "VAL_WINDOWS", "Data", "evaluate", "lm_module", "loss_of", "make_model", "stdlib_text"]

VAL_BYTES = 1 << 16
VAL_WINDOWS = 64


def stdlib_text(limit: int) -> bytes:
    """The first ``limit`` bytes of the standard library's top-level ``*.py`` files, concatenated in name order."""
    root = Path(os.__file__).parent
    out, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        out.append(data)
        size += len(data)
        if size >= limit:
            break
    text = b"".join(out)[:limit]
    if len(text) < limit:
        raise ValueError(f"stdlib_text(limit={limit}): the standard library at {root} holds only {len(text)} bytes")
    return text


def make_model(spec: dict[str, Any]) -> Any:
    """The byte-level Transformer LM (same weights on every rank for one seed)."""
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        """Embedding (256 bytes) + learned positions, ``layers`` pre-norm causal Transformer blocks, linear head."""

        def __init__(self, width: int, layers: int, context: int) -> None:
            super().__init__()
            self.embed = nn.Embedding(256, width)
            self.pos = nn.Embedding(context, width)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, dropout=0.0, batch_first=True,
                                           norm_first=True) for _ in range(layers))  # fmt: skip
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, 256)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = x.shape[1]
            h = self.embed(x) + self.pos(torch.arange(n))
            mask = nn.Transformer.generate_square_subsequent_mask(n)
            for block in self.blocks:
                h = block(h, src_mask=mask, is_causal=True)
            return self.head(self.norm(h))

    torch.manual_seed(spec["seed"])
    return TinyLM(spec["width"], spec["layers"], spec["context"])


class Data:
    """Training windows drawn per rank and step from a seeded generator; fixed held-out windows."""

    def __init__(self, spec: dict[str, Any], rank: int) -> None:
        import torch

        text = stdlib_text(spec["text_bytes"])
        self.sha = hashlib.sha256(text).hexdigest()[:16]
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.train, self.val = data[:-VAL_BYTES], data[-VAL_BYTES:]
        self.ctx, self.batch = spec["context"], spec["batch_size"]
        self.gen = torch.Generator().manual_seed(1000 * spec["seed"] + rank)

    def windows(self, data: Any, starts: Any) -> tuple[Any, Any]:
        import torch

        idx = starts[:, None] + torch.arange(self.ctx + 1)
        chunk = data[idx]
        return chunk[:, :-1], chunk[:, 1:]

    def next(self) -> tuple[Any, Any]:
        import torch

        starts = torch.randint(0, len(self.train) - self.ctx - 1, (self.batch,), generator=self.gen)
        return self.windows(self.train, starts)

    def held_out(self) -> tuple[Any, Any]:
        import torch

        starts = torch.linspace(0, len(self.val) - self.ctx - 2, VAL_WINDOWS).long()
        return self.windows(self.val, starts)


def loss_of(model: Any, x: Any, y: Any) -> Any:
    """Mean next-byte cross-entropy of ``model`` on windows ``x`` (targets ``y``), and the logits."""
    from torch.nn import functional as F

    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)), logits


def evaluate(model: Any, data: Data) -> tuple[float, float]:
    """Mean cross-entropy (nats/byte) and next-byte accuracy of ``model`` on the held-out windows."""
    import torch

    x, y = data.held_out()
    with torch.no_grad():
        loss, logits = loss_of(model, x, y)
    return float(loss), float((logits.argmax(-1) == y).float().mean())


def lm_module(spec: dict[str, Any], lr: float, momentum: float, steps: int, rank: int) -> tuple[Any, Any, Data]:
    """For ``Trainer.fit``: a LightningModule training :func:`make_model` with SGD(``lr``, ``momentum``), a loader of
    ``steps`` batches drawn as :class:`Data` draws them for ``rank``, and that :class:`Data` (for evaluation)."""
    import torch
    from lightning.pytorch import LightningModule
    from torch.utils.data import DataLoader, IterableDataset

    data = Data(spec, rank)

    class Windows(IterableDataset):
        def __iter__(self) -> Any:
            return (data.next() for _ in range(steps))

    class LMModule(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model(spec)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return loss_of(self.model, *batch)[0]

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=lr, momentum=momentum)

    return LMModule(), DataLoader(Windows(), batch_size=None), data
