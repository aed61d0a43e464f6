"""IMDB movie-review sentiment from the local ``aclImdb`` folder; nothing is downloaded."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.utils.data import Dataset, TensorDataset

from lightning_pdist.data.base import FileDataModule
from lightning_pdist.data.imdb_synthetic import write_imdb_like
from lightning_pdist.data.sampling import stratified_split

PAD, UNK = 0, 1  # token ids reserved in every vocabulary
IMDB_CLASSES = ("neg", "pos")  # label 0, label 1
_BREAK = re.compile(r"<br\s*/?>", re.IGNORECASE)  # the reviews carry HTML line breaks
_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")  # "don't" stays one word


def tokenize(text: str) -> list[str]:
    """Lowercase words and numbers (keeping in-word apostrophes), with ``<br />`` tags dropped."""
    return _WORD.findall(_BREAK.sub(" ", text).lower())


def build_vocab(token_lists: Iterable[list[str]], vocab_size: int) -> dict[str, int]:
    """Map the ``vocab_size - 2`` most frequent words to ids ``2, 3, ...`` (0 is padding, 1 unknown).

    Ties in frequency are broken alphabetically, so the vocabulary depends only on the texts.
    """
    if vocab_size < 3:
        raise ValueError(f"build_vocab(vocab_size={vocab_size}): vocab_size must be >= 3 (padding, unknown, one word)")
    counts = Counter(word for tokens in token_lists for word in tokens)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: vocab_size - 2]
    return {word: i + 2 for i, (word, _) in enumerate(ranked)}


def encode(token_lists: list[list[str]], vocab: dict[str, int], max_len: int) -> torch.Tensor:
    """``(N, max_len)`` int64 ids: each text's first ``max_len`` tokens, unknown words as 1, padded with 0."""
    out = torch.full((len(token_lists), max_len), PAD, dtype=torch.int64)
    for i, tokens in enumerate(token_lists):
        ids = [vocab.get(word, UNK) for word in tokens[:max_len]]
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return out


def read_imdb_split(folder: Path) -> tuple[list[list[str]], torch.Tensor]:
    """Tokenized reviews of ``folder/{neg,pos}/*.txt`` (files in name order) and their labels (neg 0, pos 1)."""
    texts, labels = [], []
    for label, cls in enumerate(IMDB_CLASSES):
        for path in sorted((folder / cls).glob("*.txt")):
            texts.append(tokenize(path.read_text(encoding="utf-8")))
            labels.append(label)
    return texts, torch.tensor(labels, dtype=torch.int64)


def find_imdb_dir(data_dir: str | Path) -> Path:
    """The ``aclImdb`` folder: ``data_dir/aclImdb`` or ``data_dir`` itself, with train/ and test/ {pos,neg}/*.txt.

    Raises:
        FileNotFoundError: naming the folders looked for and where, when any is missing or holds no ``.txt``.
    """
    data_dir = Path(data_dir)
    folders = [f"{split}/{cls}" for split in ("train", "test") for cls in IMDB_CLASSES]
    candidates = (data_dir / "aclImdb", data_dir)
    for root in candidates:
        if all(any((root / f).glob("*.txt")) for f in folders):  # glob on a missing folder yields nothing
            return root
    raise FileNotFoundError(
        f"IMDBDataModule(data_dir='{data_dir}'): need {folders} with *.txt reviews in one of "
        f"{[str(c) for c in candidates]}. "
        "Nothing is downloaded: extract aclImdb_v1.tar.gz into data_dir."
    )


class IMDBDataModule(FileDataModule):
    """IMDB binary sentiment (neg 0, pos 1) as padded int64 token ids ``(max_len,)``.

    Reviews are tokenized by :func:`tokenize`; the vocabulary comes from the training split only (not the
    held-out validation share, nor the test files). The validation split is a seeded stratified
    ``val_fraction`` of ``aclImdb/train``; ``aclImdb/test`` is the test set. ``aclImdb/train/unsup`` is ignored.
    The other arguments are :class:`~lightning_pdist.data.base.PdistDataModule`'s.

    Args:
        data_dir: folder holding ``aclImdb`` (or the ``aclImdb`` folder itself).
        vocab_size: vocabulary size including the padding (0) and unknown (1) ids.
        max_len: tokens kept per review; shorter reviews are padded with 0.
        synthetic_reviews_per_class: when ``data_dir`` holds no ``aclImdb`` folders, write this many synthetic
            reviews per class and split there first (:func:`~lightning_pdist.data.imdb_synthetic.write_imdb_like`);
            for offline runs and tests. ``None``: the real archive's files are required.
    """

    num_classes = 2

    def __init__(
        self,
        data_dir: str = "data",
        vocab_size: int = 20000,
        max_len: int = 256,
        batch_size: int = 32,
        num_workers: int = 0,
        val_fraction: float = 0.1,
        seed: int = 0,
        train_subset: int | None = None,
        rank_batch_sizes: list[int] | None = None,
        steps_per_epoch: int | None = None,
        synthetic_reviews_per_class: int | None = None,
    ):
        if synthetic_reviews_per_class is not None and (
            not isinstance(synthetic_reviews_per_class, int) or synthetic_reviews_per_class < 1
        ):
            raise ValueError(f"IMDBDataModule(synthetic_reviews_per_class={synthetic_reviews_per_class!r}): "
                             "synthetic_reviews_per_class must be an int >= 1 or None")  # fmt: skip
        if vocab_size < 3:
            raise ValueError(
                f"IMDBDataModule(vocab_size={vocab_size}): vocab_size must be >= 3 (padding, unknown, one word)"
            )
        if max_len < 1:
            raise ValueError(f"IMDBDataModule(max_len={max_len}): max_len must be >= 1")
        super().__init__(
            data_dir, batch_size, num_workers, val_fraction, seed, train_subset, rank_batch_sizes, steps_per_epoch
        )
        self.vocab_size, self.max_len = vocab_size, max_len
        self.synthetic_reviews_per_class = synthetic_reviews_per_class
        self.vocab: dict[str, int] | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.max_len,)

    def find_files(self) -> Path:
        return find_imdb_dir(self.data_dir)

    def prepare_data(self) -> None:
        """Fail early, on one process, when the folders are missing (or write synthetic reviews there, if asked)."""
        if self.synthetic_reviews_per_class is not None:
            try:
                self.find_files()
            except FileNotFoundError:
                write_imdb_like(self.data_dir, self.synthetic_reviews_per_class, self.seed)
        super().prepare_data()

    def load(self) -> tuple[Dataset, torch.Tensor, Dataset | None]:
        """Token ids of the training and test reviews; builds :attr:`vocab` from the training split."""
        root = self.find_files()
        train_texts, train_labels = read_imdb_split(root / "train")
        test_texts, test_labels = read_imdb_split(root / "test")
        # The same split setup() makes next, so held-out reviews do not shape the vocabulary.
        train_idx, _ = stratified_split(train_labels, self.val_fraction, self.seed)
        self.vocab = build_vocab((train_texts[i] for i in train_idx.tolist()), self.vocab_size)
        train = TensorDataset(encode(train_texts, self.vocab, self.max_len), train_labels)
        test = TensorDataset(encode(test_texts, self.vocab, self.max_len), test_labels)
        return train, train_labels, test
