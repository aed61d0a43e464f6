"""One node's process of a 2-node job: ``two_node_job.py <strategy>[,<strategy>...] <out.json> [kwargs] [--environment kubeflow]``.

The same commands as docs/multinode.md: ``Trainer(num_nodes=2, devices=1)`` started by ``torchrun --nnodes=2`` on
each node, or, with ``--environment kubeflow``, as a PyTorchJob pod's ``python train.py`` (one process per pod,
ranks from the pod's environment through ``plugins=[KubeflowEnvironment()]``). ``kwargs`` (JSON, optional):
arguments for the registered strategy, e.g. ``{"num_servers": 2, "server_port": 29600}``. Several strategies
(comma-separated): each trains in turn in the same processes (one launch instead of one per strategy; the first one
meets no process group yet), writing ``<out.json>.<strategy>.rank<r>``; one strategy writes ``<out.json>.rank<r>``.
"""

import argparse
import json

import lightning_pdist  # noqa: F401  (first: registers the strategy names; torch and Lightning imported with the collector paused)
import torch
from lightning.fabric.plugins.environments import KubeflowEnvironment
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import StrategyRegistry

from lightning_pdist.data import DigitsDataModule
from lightning_pdist.models import ClassifierModule


class ServerAddresses(Callback):
    """The parameter servers' resolved addresses, as every worker holds them during fit."""

    addresses: list[str] | None = None

    def on_train_start(self, trainer, pl_module):
        self.addresses = list(getattr(trainer.strategy, "server_addresses", None) or []) or None


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("strategy")
    parser.add_argument("out")
    parser.add_argument("kwargs", nargs="?", type=json.loads, default={})
    parser.add_argument("--environment", choices=["detect", "kubeflow"], default="detect")
    args = parser.parse_args()
    names = args.strategy.split(",")
    for name in names:
        strategy = name
        if args.kwargs:
            entry = StrategyRegistry[name]
            strategy = entry["strategy"](**{**entry["init_params"], **args.kwargs})
        plugins = [KubeflowEnvironment()] if args.environment == "kubeflow" else None
        torch.manual_seed(0)
        servers = ServerAddresses()
        trainer = Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=strategy, max_steps=6, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          limit_val_batches=2, num_sanity_val_steps=0, callbacks=[servers], plugins=plugins)  # fmt: skip
        model = ClassifierModule()
        trainer.fit(model, DigitsDataModule(batch_size=16))
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        result = {"rank": trainer.global_rank, "world_size": trainer.world_size, "node_rank": trainer.node_rank,
                  "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
                  "param_sum": float(flat.sum()), "param_norm": float(flat.norm()), "server_addresses": servers.addresses,
                  "cluster_environment": type(trainer.strategy.cluster_environment).__name__}  # fmt: skip
        with open(f"{args.out}{'.' + name if len(names) > 1 else ''}.rank{trainer.global_rank}", "w") as f:
            json.dump(result, f)
