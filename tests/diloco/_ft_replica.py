"""One DiLoCo replica of the fault-tolerance test: ``python _ft_replica.py DIR REPLICA LIFE`` (env: the lighthouse).

Its batch at step ``t`` is :func:`ft_batch` (a function of the replica and the run's step, so a restarted replica
sees what the reference gives it). Files in ``DIR``: ``ready{r}.{life}`` and ``manager{r}`` (first lives wait for
all three before setup and again, with their torchft Managers heartbeating, before the first quorum: the lighthouse
then waits for everyone, so the first round has all three), ``stalled`` (the victim's first life stops mid-round there, to be SIGKILLed),
``rejoining`` (the restarted victim; the survivors wait for it after the kill round, then slow down so it catches
a round), ``rounds{r}.jsonl`` (this replica's torchft rounds, written as they happen), ``final{r}.pt``, ``mid{r}.ckpt``
(a Lightning checkpoint at step ``CKPT_AT``, mid-round). Then each replica resumes its own ``mid{r}.ckpt`` in a second
``fit`` in the same process (all three together, as after a whole-job restart; ``manager{r}.resumed`` is their
barrier before the join): ``rounds{r}.resumed.jsonl``, ``final{r}.resumed.pt``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

H, STEPS, VICTIM, STALL_AT, WAIT_AT = 4, 24, 2, 10, 12  # the victim stops before step 10 (mid round 3: steps 9-12)
CKPT_AT = 22  # mid the last round (steps 21-24)


def ft_batch(data, replica: int, t: int, bs: int = 4):
    g = torch.Generator().manual_seed(1000 * replica + t)
    idx = torch.randint(0, len(data), (bs,), generator=g)
    x, y = data.tensors
    return x[idx], y[idx]


def _wait_for(path: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout}s")
        time.sleep(0.02)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from _helpers import make_net, regression_data
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader

    from lightning_pdist import DiLoCoStrategy

    out, r, life = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    data = regression_data(64)
    resumed = False  # the second fit, from mid{r}.ckpt

    class Replica(LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.written, self.slow = make_net(), 0, False

        def setup(self, stage):
            if resumed:
                return
            (out / f"ready{r}.{life}").touch()
            if life == 1:
                for other in range(3):
                    _wait_for(out / f"ready{other}.1")
            else:
                (out / "rejoining").touch()

        def training_step(self, batch, batch_idx):
            x, y = ft_batch(data, r, self.trainer.strategy.step + 1)
            return nn.functional.mse_loss(self.net(x), y)

        def on_train_batch_start(self, batch, batch_idx):
            step = self.trainer.strategy.step  # the run's steps done (healed on a restarted replica)
            if r == VICTIM and life == 1 and step + 1 == STALL_AT:
                (out / "stalled").touch()
                time.sleep(600)  # SIGKILLed here
            if r != VICTIM and step == WAIT_AT and not self.slow:
                _wait_for(out / "rejoining")
                self.slow = True
            if self.slow:
                time.sleep(0.15)

        def on_train_batch_end(self, *args):
            strategy = self.trainer.strategy
            if args and not resumed and strategy.step == CKPT_AT:
                self.trainer.save_checkpoint(out / f"mid{r}.ckpt")
            history = strategy.ft_history
            with open(out / f"rounds{r}{'.resumed' if resumed else ''}.jsonl", "a") as f:
                for record in history[self.written :]:
                    f.write(json.dumps(dict(record, life=life)) + "\n")
            self.written = len(history)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

        def train_dataloader(self):
            return DataLoader(list(range(1000)), batch_size=1)

    class Strategy(DiLoCoStrategy):
        def _ft_round(self, contribute):
            if (life == 1 or resumed) and not self.ft_history:  # the join: every Manager heartbeats before it
                tag = ".resumed" if resumed else ""
                (out / f"manager{r}{tag}").touch()
                for other in range(3):
                    _wait_for(out / f"manager{other}{tag}")
                time.sleep(0.5)  # a few heartbeats (every 0.1 s) reach the lighthouse
            super()._ft_round(contribute)

    for resumed in (False, True):
        model = Replica()
        strategy = Strategy(sync_every=H, fault_tolerant=True, replica_id=f"replica_{r}", ft_timeout=20.0)
        trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=STEPS, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
        trainer.fit(model, ckpt_path=out / f"mid{r}.ckpt" if resumed else None)
        model.on_train_batch_end()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        torch.save({"params": flat, "step": strategy.step, "global_step": trainer.global_step,
                    "inner": trainer.optimizers[0].state_dict()["state"],
                    "outer": strategy.rounds.parts[0].optimizer.state_dict()["state"]},
                   out / f"final{r}{'.resumed' if resumed else ''}.pt")  # fmt: skip


if __name__ == "__main__":
    main()
