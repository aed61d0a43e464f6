"""IMDBDataModule, its tokenizer and vocabulary, on a tiny aclImdb folder written in the test."""

import pytest
import torch

from lightning_pdist.data import IMDBDataModule
from lightning_pdist.data.imdb import PAD, UNK, build_vocab, encode, tokenize

TRAIN = {
    "pos": [
        "A great, GREAT film.<br /><br />Loved it",
        "great acting and a great story",
        "I loved this movie",
        "wonderful and great",
        "Don't miss it: great",
    ],
    "neg": ["A bad film. Awful acting", "bad bad bad", "I hated this movie", "awful and boring", "Don't watch: bad"],
}
TEST = {"pos": ["great fun", "loved it"], "neg": ["boring and bad", "zzz unseen words"]}


def _write_imdb(root):
    for split, texts in (("train", TRAIN), ("test", TEST)):
        for cls, reviews in texts.items():
            folder = root / "aclImdb" / split / cls
            folder.mkdir(parents=True)
            for i, text in enumerate(reviews):
                (folder / f"{i}_{7 if cls == 'pos' else 2}.txt").write_text(text, encoding="utf-8")


def test_tokenize_lowercases_drops_breaks_and_keeps_apostrophes():
    """Words are lowercased, <br /> tags and punctuation dropped, and in-word apostrophes kept."""
    assert tokenize("Don't MISS it!<br /><br />10/10, great") == ["don't", "miss", "it", "10", "10", "great"]


def test_vocab_ranks_by_count_then_alphabet():
    """Ids start at 2 in order of frequency, ties alphabetical, cut at vocab_size - 2 words."""
    vocab = build_vocab([["b", "a", "c"], ["b", "a"], ["b"]], vocab_size=4)
    assert vocab == {"b": 2, "a": 3}


def test_encode_pads_truncates_and_marks_unknown():
    """Texts become (N, max_len) int64 with 0 padding, 1 for unknown words, and truncation to max_len."""
    out = encode([["a", "zz"], ["a", "a", "a", "a"]], {"a": 2}, max_len=3)
    assert out.dtype == torch.int64
    assert out.tolist() == [[2, UNK, PAD], [2, 2, 2]]


def test_loads_the_folder_layout(tmp_path):
    """Train/test pos/neg folders load as padded token tensors with neg=0, pos=1 and a train-only vocabulary."""
    _write_imdb(tmp_path)
    dm = IMDBDataModule(str(tmp_path), vocab_size=12, max_len=6, batch_size=4, val_fraction=0.2)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_set) == 8 and len(dm.val_set) == 2 and len(dm.test_set) == 4
    assert dm.input_shape == (6,) and dm.num_classes == 2
    assert dm.vocab == build_vocab([_texts()[i] for i in dm.train_set.indices], 12) and len(dm.vocab) == 10
    tokens, labels = dm.test_set.tensors
    assert tokens.shape == (4, 6) and tokens.dtype == torch.int64 and labels.tolist() == [0, 0, 1, 1]
    assert tokens[1].tolist()[:3] == [UNK, UNK, UNK] and tokens[1].tolist()[3:] == [PAD] * 3  # "zzz unseen words"
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 6) and y.dtype == torch.int64


def test_vocabulary_ignores_the_validation_reviews(tmp_path):
    """Words that occur only in held-out validation reviews are not in the vocabulary."""
    _write_imdb(tmp_path)
    dm = IMDBDataModule(str(tmp_path), vocab_size=1000, val_fraction=0.4)
    dm.setup("fit")
    val_words = {w for i in dm.val_set.indices for w in _texts()[i]}
    train_words = {w for i in dm.train_set.indices for w in _texts()[i]}
    assert val_words - train_words and not (val_words - train_words) & set(dm.vocab)
    assert set(dm.vocab) == train_words


def _texts():
    return [tokenize(t) for cls in ("neg", "pos") for t in TRAIN[cls]]  # file order: neg then pos, by name


def test_missing_folder_raises_and_says_nothing_is_downloaded(tmp_path):
    """Without the aclImdb layout a FileNotFoundError names the folders looked for and says nothing is downloaded."""
    message = r"need \['train/neg', 'train/pos', 'test/neg', 'test/pos'\].*Nothing is downloaded"
    with pytest.raises(FileNotFoundError, match=message):
        IMDBDataModule(str(tmp_path)).prepare_data()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(vocab_size=2), r"IMDBDataModule\(vocab_size=2\): vocab_size must be >= 3"),
        (dict(max_len=0), r"max_len=0\): max_len must be >= 1"),
    ],
)
def test_bad_arguments_raise(tmp_path, kwargs, message):
    """A too-small vocab_size or max_len raises ValueError naming it."""
    with pytest.raises(ValueError, match=message):
        IMDBDataModule(str(tmp_path), **kwargs)


def test_build_vocab_rejects_tiny_size():
    """build_vocab needs room for padding, unknown and one word."""
    with pytest.raises(ValueError, match=r"build_vocab\(vocab_size=2\): vocab_size must be >= 3"):
        build_vocab([["a"]], 2)
