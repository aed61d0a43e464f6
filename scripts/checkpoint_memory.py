"""Peak memory per rank while a checkpoint is saved mid-fit, for every strategy at N = 2 and N = 4 ranks.

    .venv/bin/python scripts/checkpoint_memory.py [--mb 16] [--strategies local_sgd,bmuf,...] [--worlds 2,4]

Each rank trains an MLP of about ``--mb`` MB of fp32 parameters with Adam (so model + optimizer state
is about 3 × that) for 2 steps; at step 2 a callback resets the kernel's peak-RSS counter
(``/proc/self/clear_refs``), calls ``trainer.save_checkpoint`` and reads ``VmHWM``. The table gives
the peak growth over the RSS before the save (MB, the largest over the ranks), and the sizes of
the main file and of one per-rank file. Before per-rank files, averaging and sign checkpoints
gathered every replica onto every rank, so the peak grew with N.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_pdist  # noqa: F401 - registers the strategies

STRATEGIES = {
    "pdist_ddp": {}, "local_sgd": {"period": 4}, "bmuf": {"period": 4}, "easgd": {"period": 4},
    "signsgd_mv": {"error_feedback": True}, "parameter_server": {}, "pipeline": {"num_stages": 2},
}  # fmt: skip


def _status(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB -> MB
    raise KeyError(field)


class Wide(LightningModule):
    def __init__(self, mb: float) -> None:
        super().__init__()
        width = int((mb * 2**20 / 4 / 2) ** 0.5)
        self.net = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        self.width = width

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, self.width, generator=g), torch.randn(64, self.width, generator=g)),
                          batch_size=4)  # fmt: skip


class SaveAndMeasure(Callback):
    def __init__(self, path: str, out: str) -> None:
        self.path, self.out = path, out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != 2:
            return
        before = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        trainer.save_checkpoint(self.path)
        Path(self.out).write_text(f"{_status('VmHWM') - before:.1f}")


def _worker(rank: int, name: str, world: int, mb: float, folder: str, port: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    strategy = lightning_pdist_strategy(name)
    trainer = Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=3, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[SaveAndMeasure(f"{folder}/ckpt.ckpt", f"{folder}/peak{rank}")])  # fmt: skip
    trainer.fit(Wide(mb))


def lightning_pdist_strategy(name: str):
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[name]
    return entry["strategy"](**{**entry["init_params"], **STRATEGIES[name]})


def measure(name: str, world: int, mb: float) -> tuple[float, float, float]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_worker, args=(name, world, mb, folder, port), nprocs=world, start_method="fork")
        peak = max(float(Path(folder, f"peak{r}").read_text()) for r in range(world))
        main = Path(folder, "ckpt.ckpt").stat().st_size / 2**20
        ranks = sorted(Path(folder).glob("ckpt.ckpt.pdist-rank*"))
        rank_file = ranks[0].stat().st_size / 2**20 if ranks else 0.0
    return peak, main, rank_file


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=16.0)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--worlds", default="2,4")
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    print(f"model {args.mb:.0f} MB fp32 + Adam; peak RSS growth during save_checkpoint (max over ranks), file sizes")
    print("| strategy | " + " | ".join(f"N={w} peak MB | main MB | rank file MB" for w in worlds) + " |")
    print("|---|" + "---|---|---|" * len(worlds))
    for name in args.strategies.split(","):
        cells = []
        for world in worlds:
            peak, main, rank_file = measure(name, world, args.mb)
            cells.append(f"{peak:.1f} | {main:.1f} | {rank_file:.1f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
