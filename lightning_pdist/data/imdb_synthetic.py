"""IMDB-format reviews written on the spot, for runs and tests on machines without the archive (nothing downloads).

The files have the ``aclImdb`` layout (``train|test/pos|neg/<i>_<stars>.txt``), so :class:`IMDBDataModule` reads
them exactly as it reads the real archive. The task is learnable, not realistic: a review is 40-200 words drawn from
12,000 made-up words (half Zipf-distributed, half uniform, so the vocabulary fills) with three sentiment words of
its class inserted at random places.
"""

from __future__ import annotations

import random
from pathlib import Path

SENTIMENT = {"pos": ("great", "loved", "wonderful", "superb", "brilliant"),
             "neg": ("bad", "awful", "boring", "worst", "hated")}  # fmt: skip


def write_imdb_like(root: str | Path, reviews_per_class: int, seed: int = 0) -> Path:
    """Write ``reviews_per_class`` reviews per class and split under ``root/aclImdb``; return ``root``.

    Deterministic in ``seed``. ``ValueError`` if ``reviews_per_class < 1``.
    """
    if not isinstance(reviews_per_class, int) or reviews_per_class < 1:
        raise ValueError(f"write_imdb_like(reviews_per_class={reviews_per_class!r}): reviews_per_class must be an "
                         "int >= 1")  # fmt: skip
    root = Path(root)
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(12000)]
    for split in ("train", "test"):
        for cls, marks in SENTIMENT.items():
            folder = root / "aclImdb" / split / cls
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(reviews_per_class):
                text = [words[min(int(rng.paretovariate(1.1)), len(words)) - 1] if rng.random() < 0.5 else rng.choice(words)
                        for _ in range(rng.randint(40, 200))]  # fmt: skip
                for _ in range(3):
                    text.insert(rng.randrange(len(text)), rng.choice(marks))
                (folder / f"{i}_{8 if cls == 'pos' else 2}.txt").write_text(" ".join(text), encoding="utf-8")
    return root
