"""The ``pdist`` console script: LightningCLI with every lightning_pdist strategy registered.

Usage::

    pdist fit --config recipes/bmuf.yaml
    pdist fit --config recipes/local_sgd.yaml --trainer.strategy.init_args.period=16
    pdist fit --trainer.strategy=easgd --trainer.devices=2 --trainer.accelerator=cpu

The model is :class:`~lightning_pdist.models.ClassifierModule`; the data module is any subclass of
:class:`~lightning_pdist.data.PdistDataModule` chosen by ``class_path`` (default: the scikit-learn
digits). Strategy names resolve because this module imports :mod:`lightning_pdist`, which registers
them; ``class_path: lightning_pdist.BMUFStrategy`` works in any LightningCLI too.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_pdist  # noqa: F401  (registers the strategy names)
from lightning_pdist.data import PdistDataModule
from lightning_pdist.models import ClassifierModule

__all__ = ["PdistCLI", "main"]


class PdistCLI(LightningCLI):
    """LightningCLI with the digits data as the default data module."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"data": {"class_path": "lightning_pdist.data.DigitsDataModule"}})


def main(args: list[str] | None = None) -> None:
    """Entry point of ``pdist``; ``args`` replaces ``sys.argv[1:]`` (for tests)."""
    PdistCLI(
        ClassifierModule,
        PdistDataModule,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
