"""A 2-rank fit that tests/core/test_hung_ranks.py stops or kills: ``python _hung_job.py OUT ALGO ACTION LAUNCH TIMEOUT``.

ALGO: ``ps`` / ``ps_propagate`` (ParameterServerStrategy, server_timeout=TIMEOUT, nonfinite "raise" / "propagate") or
``bmuf`` (BMUFStrategy, timeout=TIMEOUT s).
ACTION: ``stop1`` (rank 1 SIGSTOPs itself after step 3) or ``run`` (both keep training). LAUNCH: ``popen`` or
``fork`` (Lightning launches the ranks), or ``external`` (the test starts each rank with LOCAL_RANK set, as torchrun
does). Every rank writes ``rank{r}.json`` (its pid, the servers' pids) at the start of training and ``step3_rank{r}``
after step 3; training is slowed down so that it is still running when the test acts.
"""

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for _helpers

import lightning_pdist  # noqa: E402,F401  (first: torch and Lightning imported with the collector paused)
from _helpers import TinyRegression  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402

from lightning_pdist import BMUFStrategy, ParameterServerStrategy  # noqa: E402


class Act(Callback):
    def __init__(self, out: Path, action: str):
        self.out, self.action = out, action

    def on_train_start(self, trainer, pl_module):
        info = {"pid": os.getpid(), "servers": list(getattr(trainer.strategy, "server_pids", []))}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(info))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 3:
            (self.out / f"step3_rank{trainer.global_rank}").touch()
            if self.action == "stop1" and trainer.global_rank == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(0.05)


def main() -> None:
    out, algo, action, launch, timeout = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
    start_method = {"external": "popen"}.get(launch, launch)
    if algo in ("ps", "ps_propagate"):  # ps_propagate: no per-step agreement, so the server names the stalled worker
        nonfinite = "propagate" if algo == "ps_propagate" else "raise"
        strategy = ParameterServerStrategy(server_timeout=timeout, nonfinite=nonfinite, start_method=start_method)
    else:
        strategy = BMUFStrategy(period=2, timeout=timedelta(seconds=timeout), start_method=start_method)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=10_000, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Act(out, action)])  # fmt: skip
    trainer.fit(TinyRegression())


if __name__ == "__main__":
    main()
