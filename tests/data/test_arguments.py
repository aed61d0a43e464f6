"""What LightningCLI (jsonargparse) and a positional call see of each data module's arguments.

The file-reading modules share ``FileDataModule.__init__`` and its documentation (the digits
``PdistDataModule``'s): this keeps every argument visible, in order, with its default and a help string.
"""

import pytest
from jsonargparse._parameter_resolvers import get_signature_parameters

from lightning_pdist.data import CIFAR10DataModule, DigitsDataModule, IMDBDataModule, MNISTDataModule

SHARED = {
    "batch_size": 32,
    "num_workers": 0,
    "val_fraction": 0.1,
    "seed": 0,
    "train_subset": None,
    "rank_batch_sizes": None,
    "steps_per_epoch": None,
}
EXPECTED = {
    DigitsDataModule: {**SHARED, "val_fraction": 0.2},
    CIFAR10DataModule: {"data_dir": "data", **SHARED},
    MNISTDataModule: {"data_dir": "data", **SHARED},
    IMDBDataModule: {
        "data_dir": "data",
        "vocab_size": 20000,
        "max_len": 256,
        **SHARED,
        "synthetic_reviews_per_class": None,
    },
}


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda c: c.__name__)
def test_cli_sees_every_argument_with_its_default_and_help(cls):
    params = get_signature_parameters(cls)
    assert {p.name: p.default for p in params} == EXPECTED[cls]
    assert [p.name for p in params] == list(EXPECTED[cls])
    assert all(p.doc for p in params), [p.name for p in params if not p.doc]
    assert dict(cls().hparams) == EXPECTED[cls]  # what a checkpoint's hyper_parameters hold


def test_positional_arguments_keep_their_order():
    dm = IMDBDataModule("d", 12, 6, 4, 0, 0.2)
    assert (dm.data_dir, dm.vocab_size, dm.max_len, dm.batch_size, dm.val_fraction) == ("d", 12, 6, 4, 0.2)
    dm = MNISTDataModule("m", 8, 0, 0.3)
    assert (dm.data_dir, dm.batch_size, dm.val_fraction, dm.hparams["data_dir"]) == ("m", 8, 0.3, "m")
