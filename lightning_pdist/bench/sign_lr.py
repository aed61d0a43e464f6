"""Does a module's own learning rate survive ``strategy="signsgd_mv"``? Lightning's demo Transformer, 2 CPU ranks.

``python -m lightning_pdist.bench.sign_lr [--steps 150] [--out results/sign_lr.json]``

Lightning's ``LightningTransformer`` (``SGD(lr=0.1)``, vocabulary cut to ``--vocab``) trains on random
tokens (no download: the demo's WikiText2 needs the internet) under ``ddp`` and the sign strategies:
the module unchanged (``lr=0.1`` becomes the sign step δ), the δ the setup warning suggests
(``SUGGESTED_SIGN_STEP``), and ``scale="l1"`` with the module's ``lr=0.1``. It prints and writes the mean
training loss over the last 20 steps on rank 0; same seed, data and model in every run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import warnings
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.demos.transformer import LightningTransformer
from torch.utils.data import DataLoader, TensorDataset

from lightning_pdist.sign.strategy import SUGGESTED_SIGN_STEP, SignSGDStrategy


class _Transformer(LightningTransformer):
    def __init__(self, vocab: int, lr: float, tokens: torch.Tensor, batch_size: int):
        super().__init__(vocab_size=vocab)
        self.lr, self.tokens, self.batch_size = lr, tokens, batch_size

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=self.lr)

    def prepare_data(self) -> None:  # the demo's downloads WikiText2
        pass

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.tokens[:, :-1], self.tokens[:, 1:]), batch_size=self.batch_size)


class _Losses(Callback):
    def __init__(self, path: Path):
        self.path, self.losses = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            self.path.write_text(json.dumps(self.losses))


def run(name: str, strategy, lr: float, args, out: Path) -> float:
    seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.samples, args.block + 1), generator=g)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    path = out.with_name(f"{out.stem}_{name}.losses.json")
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[_Losses(path)])  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_Transformer(args.vocab, lr, tokens, args.batch_size))
    losses = json.loads(path.read_text())
    return sum(losses[-20:]) / len(losses[-20:])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--block", type=int, default=35)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=Path("results/sign_lr.json"))
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fork = dict(start_method="fork")
    runs = {
        "ddp lr=0.1": ("ddp_fork", 0.1),
        "signsgd_mv lr=0.1 (unchanged module)": (SignSGDStrategy(**fork), 0.1),
        f"signsgd_mv lr={SUGGESTED_SIGN_STEP:g} (the warning's suggestion)": (SignSGDStrategy(**fork), SUGGESTED_SIGN_STEP),
        "signsgd_mv scale='l1' lr=0.1": (SignSGDStrategy(scale="l1", **fork), 0.1),
        f"it_signsgd lr={SUGGESTED_SIGN_STEP:g}": (SignSGDStrategy("llr", **fork), SUGGESTED_SIGN_STEP),
        "it_signsgd scale='l1' lr=0.1": (SignSGDStrategy("llr", scale="l1", **fork), 0.1),
    }
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "final_loss": {}}
    for i, (name, (strategy, lr)) in enumerate(runs.items()):
        results["final_loss"][name] = loss = run(f"run{i}", strategy, lr, args, args.out)
        print(f"{name:55s} mean loss of the last 20 steps: {loss:.3f}", flush=True)
    args.out.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
