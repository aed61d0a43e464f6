"""Probe of the pipeline suite's BERT outside the suite (docs/algorithms/pipeline.md, "Why every method sits at chance").

The convergence part's model, data and cut (``bench/pipeline_worker.py``: ``TRANSFORMER``, 300 synthetic IMDB reviews
per class, batch 32, cut at ``model.encoder.bert.encoder.layer.1``, 4 micro-batches), with an optimizer the suite
does not offer (it gives every method the same SGD). ``--method one_process``: the Trainer on one process, no cut;
``pipedream``, ``dni``, ``cdni`` (DNI with ``synthetic_conditioning="labels"``) or ``frozen`` (DNI whose synthetic
module always predicts 0, so stage 0 never moves): ``PipelineStrategy`` on 2 forked ranks. Prints the validation
accuracy (and the last training loss) after each epoch, from rank 0.

    python scripts/bert_probe.py --method one_process --optimizer adam --lr 1e-3 --epochs 10
    python scripts/bert_probe.py --method dni --optimizer adam --lr 1e-3 --epochs 3
"""

from __future__ import annotations

import argparse
import tempfile
import time

import lightning_pdist  # noqa: F401  (first: registers the strategies, imports Lightning faster)
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_pdist import PipelineStrategy
from lightning_pdist.bench.pipeline_worker import BERT_SPLIT, REVIEWS_PER_CLASS, TRANSFORMER, bert_model
from lightning_pdist.data import IMDBDataModule
from lightning_pdist.models.classifier import ClassifierModule

METHODS = ("one_process", "pipedream", "dni", "cdni", "frozen")


class ZeroPrediction(torch.nn.Module):
    """A synthetic module that always predicts 0 (stage 0 frozen: Adam on a zero gradient steps 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0 * self.p


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=METHODS, default="one_process")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="adam", help="the model's (SGD: momentum 0.9)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    seed_everything(0, verbose=False)
    module = ClassifierModule(model=bert_model(0), num_classes=2, optimizer=args.optimizer, lr=args.lr,
                              momentum=0.9 if args.optimizer == "sgd" else 0.0)  # fmt: skip
    scratch = tempfile.TemporaryDirectory(prefix="pdist-imdb-")
    data = IMDBDataModule(data_dir=scratch.name, vocab_size=TRANSFORMER["vocab_size"], max_len=TRANSFORMER["max_len"],
                          batch_size=32, seed=0, synthetic_reviews_per_class=REVIEWS_PER_CLASS)  # fmt: skip
    began = time.time()
    label = f"{args.method} {args.optimizer} lr {args.lr:g}"

    class Report(Callback):
        def on_validation_end(self, trainer, pl_module):  # noqa: ANN001
            if not trainer.sanity_checking and trainer.global_rank == 0:
                loss = float(trainer.callback_metrics.get("train/loss", float("nan")))
                print(f"{label} epoch {trainer.current_epoch + 1}: val_acc {float(trainer.callback_metrics['val/acc']):.3f} "
                      f"(train/loss {loss:.4f}, {time.time() - began:.0f} s)", flush=True)  # fmt: skip

    if args.method == "one_process":
        devices, strategy = 1, "auto"
    else:
        synthetic = args.method in ("dni", "cdni", "frozen")
        devices = 2
        strategy = PipelineStrategy(schedule="pipedream", synthetic_gradients=synthetic, num_microbatches=4,
                                    synthetic_conditioning="labels" if args.method == "cdni" else None,
                                    synthetic_module=(lambda x: ZeroPrediction()) if args.method == "frozen" else None,
                                    split_points=[f"model.{BERT_SPLIT}"], start_method="fork", process_group_backend="gloo")  # fmt: skip
    Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=args.epochs, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            callbacks=[Report()]).fit(module, datamodule=data)  # fmt: skip
    scratch.cleanup()


if __name__ == "__main__":
    main()
