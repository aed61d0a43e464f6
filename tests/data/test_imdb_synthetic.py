"""Synthetic IMDB-format reviews: the real loader reads them, they are deterministic, and bad counts are refused."""

import pytest

from lightning_pdist.data import IMDBDataModule
from lightning_pdist.data.imdb_synthetic import SENTIMENT, write_imdb_like


def test_written_reviews_have_the_archive_layout_and_are_deterministic(tmp_path):
    """train|test/pos|neg/<i>_<stars>.txt, each review carrying words of its class; same seed, same files."""
    write_imdb_like(tmp_path / "a", 3, seed=5)
    write_imdb_like(tmp_path / "b", 3, seed=5)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.txt"))
    assert len(files) == 12 and str(files[0]) == "aclImdb/test/neg/0_2.txt"
    for rel in files:
        text = (tmp_path / "a" / rel).read_text()
        assert text == (tmp_path / "b" / rel).read_text()
        assert sum(w in SENTIMENT[rel.parts[2]] for w in text.split()) >= 3


def test_data_module_writes_them_when_asked_and_the_folder_is_empty(tmp_path):
    """IMDBDataModule(synthetic_reviews_per_class=n) fills an empty data_dir in prepare_data, then loads it."""
    dm = IMDBDataModule(str(tmp_path), vocab_size=100, max_len=16, batch_size=4, synthetic_reviews_per_class=10)
    dm.prepare_data()
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 16) and set(y.tolist()) <= {0, 1}
    with pytest.raises(FileNotFoundError, match=r"Nothing is downloaded"):
        IMDBDataModule(str(tmp_path / "empty")).prepare_data()  # without the option the archive is required


@pytest.mark.parametrize("count", [0, -1, 2.5, "10"])
def test_bad_counts_are_refused(tmp_path, count):
    """A count that is not a positive int is refused, naming the argument."""
    with pytest.raises(ValueError, match=r"synthetic_reviews_per_class must be an int >= 1 or None"):
        IMDBDataModule(str(tmp_path), synthetic_reviews_per_class=count)
    with pytest.raises(ValueError, match=r"reviews_per_class must be an int >= 1"):
        write_imdb_like(tmp_path, count)
