"""One DiLoCo replica of the fault-tolerance test: ``python _ft_replica.py DIR REPLICA LIFE`` (env: the lighthouse).

Its batch at step ``t`` is :func:`ft_batch` (a function of the replica and the run's step, so a restarted replica
sees what the reference gives it). Files in ``DIR``: ``ready{r}.{life}`` and ``manager{r}`` (first lives wait for
all three before setup and again, with their torchft Managers heartbeating, before the first quorum: the lighthouse
then waits for everyone, so the first round has all three), ``stalled`` (the victim's first life stops mid-round there, to be SIGKILLed),
``asked{r}.{life}`` (touched 0.5 s after a replica that joins the others' run asked its join quorum, so that its
request is with the lighthouse before theirs: the survivors wait for the restarted victim's after the kill round, so
it heals at the next round end; a late request would miss their quorum, which forms at once from the previous
quorum's members), ``rounds{r}.jsonl`` (this replica's torchft rounds, written as they happen), ``final{r}.pt``, ``mid{r}.ckpt``
(a Lightning checkpoint at step ``CKPT_AT``, mid-round). Then each replica resumes its own ``mid{r}.ckpt`` in a second
``fit`` in the same process (all three together, as after a whole-job restart; ``manager{r}.resumed`` is their
barrier before the join), runs to ``STEPS2``: ``rounds{r}.resumed.jsonl``, ``at{STEPS}_{r}.pt`` (its state at
``STEPS``, to set against the first ``fit``'s end), ``final{r}.resumed.pt``. In that second ``fit`` replica
``REJOINER`` alone leaves: it saves ``end{r}.ckpt`` at the round end ``STEPS``, ends its ``fit`` at ``LEAVE_AT``
(mid-round) and starts a third from ``end{r}.ckpt`` while the others run on (they wait before the round's last step
for its ``asked{r}.{life}``): its join meets the others' round end without contributing (same torchft step: no
heal) and takes the round's step; ``final{r}.rejoined.pt``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import lightning_pdist  # noqa: F401  (first: torch and Lightning imported with the collector paused, core/startup.py)
import torch
from torch import nn

H, STEPS, VICTIM, STALL_AT, WAIT_AT = 4, 24, 2, 10, 12  # the victim stops before step 10 (mid round 3: steps 9-12)
# (the survivors wait after the round at WAIT_AT until the restarted victim asked its join: it heals at WAIT_AT + H)
CKPT_AT = 22  # mid the last round (steps 21-24)
STEPS2, REJOINER, LEAVE_AT = 32, 1, 26  # the resumed fit runs on; replica 1 leaves mid round 7 (25-28) and rejoins


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


def life_of(replica: int) -> int:
    """The process life each replica runs its second fit in (the victim's first life was killed)."""
    return 2 if replica == VICTIM else 1


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from _helpers import make_net, regression_data
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader

    from lightning_pdist import DiLoCoStrategy

    out, r, life = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    data = regression_data(64)
    phase = "first"  # then "resumed" (from mid{r}.ckpt, all three), then "rejoined" (REJOINER only, from end{r}.ckpt)

    class Replica(LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.written = make_net(), 0

        def setup(self, stage):
            if phase != "first":
                return
            (out / f"ready{r}.{life}").touch()
            if life == 1:
                for other in range(3):
                    _wait_for(out / f"ready{other}.1")

        def training_step(self, batch, batch_idx):
            x, y = ft_batch(data, r, self.trainer.strategy.step + 1)
            return nn.functional.mse_loss(self.net(x), y)

        def on_train_batch_start(self, batch, batch_idx):
            step = self.trainer.strategy.step  # the run's steps done (healed on a restarted replica)
            if r == VICTIM and life == 1 and step + 1 == STALL_AT:
                (out / "stalled").touch()
                time.sleep(600)  # SIGKILLed here
            if phase == "first" and r != VICTIM and step == WAIT_AT:
                _wait_for(out / f"asked{VICTIM}.2")  # the restarted victim waits in the lighthouse for this round end
            if phase == "resumed" and r != REJOINER and step + 1 == STEPS + H:
                _wait_for(out / f"asked{REJOINER}.{life_of(REJOINER)}")  # the rejoiner waits for this round end

        def on_train_batch_end(self, *args):
            strategy = self.trainer.strategy
            if args and phase == "first" and strategy.step == CKPT_AT:
                self.trainer.save_checkpoint(out / f"mid{r}.ckpt")
            if args and phase == "resumed" and strategy.step == STEPS:
                _save_state(self.trainer, out / f"at{STEPS}_{r}.pt")
                if r == REJOINER:
                    self.trainer.save_checkpoint(out / f"end{r}.ckpt")
            if args and phase == "resumed" and r == REJOINER and strategy.step == LEAVE_AT:
                self.trainer.should_stop = True  # leaves mid-round; its rounds file is written below
            history = strategy.ft_history
            with open(out / f"rounds{r}{'' if phase == 'first' else '.resumed'}.jsonl", "a") as f:
                for record in history[self.written :]:
                    f.write(json.dumps(dict(record, life=life, phase=phase)) + "\n")
            self.written = len(history)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

        def train_dataloader(self):
            return DataLoader(list(range(1000)), batch_size=1)

    class Strategy(DiLoCoStrategy):
        def _ft_round(self, contribute):
            if (phase == "rejoined" or phase == "first" and life == 2) and not self.ft_history:  # into running rounds
                threading.Timer(0.5, (out / f"asked{r}.{life}").touch).start()  # its quorum request is in by then
            elif (life == 1 or phase == "resumed") and not self.ft_history:  # the join: every Manager heartbeats first
                tag = ".resumed" if phase == "resumed" else ""
                (out / f"manager{r}{tag}").touch()
                for other in range(3):
                    _wait_for(out / f"manager{other}{tag}")
                time.sleep(0.5)  # a few heartbeats (every 0.1 s) reach the lighthouse
            super()._ft_round(contribute)

    runs = [("first", None, STEPS, f"final{r}.pt"), ("resumed", f"mid{r}.ckpt", STEPS2, f"final{r}.resumed.pt")]
    if r == REJOINER:
        runs[1] = ("resumed", f"mid{r}.ckpt", STEPS2, None)
        runs.append(("rejoined", f"end{r}.ckpt", STEPS2, f"final{r}.rejoined.pt"))
    for phase, ckpt, steps, final in runs:
        model = Replica()
        strategy = Strategy(sync_every=H, fault_tolerant=True, replica_id=f"replica_{r}", ft_timeout=20.0)
        trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
        trainer.fit(model, ckpt_path=None if ckpt is None else out / ckpt)
        model.on_train_batch_end()
        if final is not None:
            _save_state(trainer, out / final)


def _save_state(trainer, path: Path) -> None:
    """The module's weights (the global model at a round end or after ``fit``), steps, inner and outer optimizer states."""
    strategy = trainer.strategy
    flat = torch.cat([p.detach().reshape(-1) for p in trainer.lightning_module.parameters()])
    torch.save({"params": flat.clone(), "step": strategy.step, "global_step": trainer.global_step,
                "inner": trainer.optimizers[0].state_dict()["state"],
                "outer": strategy.rounds.parts[0].optimizer.state_dict()["state"]}, path)  # fmt: skip

if __name__ == "__main__":
    main()
