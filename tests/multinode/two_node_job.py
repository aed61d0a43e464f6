"""One node's process of a 2-node job, started by torchrun on each node: ``two_node_job.py <strategy> <out.json>``.

The same commands as docs/multinode.md (``Trainer(num_nodes=2, devices=1)`` under ``torchrun --nnodes=2``).
"""

import json
import sys

import torch
from lightning.pytorch import Trainer

import lightning_pdist  # noqa: F401  (registers the strategy names)
from lightning_pdist.data import DigitsDataModule
from lightning_pdist.models import ClassifierModule

if __name__ == "__main__":
    strategy, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    trainer = Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=strategy, max_steps=6, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=2, num_sanity_val_steps=0)  # fmt: skip
    model = ClassifierModule()
    trainer.fit(model, DigitsDataModule(batch_size=16))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    result = {"rank": trainer.global_rank, "world_size": trainer.world_size, "node_rank": trainer.node_rank,
              "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
              "param_sum": float(flat.sum()), "param_norm": float(flat.norm())}  # fmt: skip
    with open(f"{out}.rank{trainer.global_rank}", "w") as f:
        json.dump(result, f)
