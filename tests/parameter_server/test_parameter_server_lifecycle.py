"""Tier 3: ParameterServerStrategy across Trainer lifecycles: evaluation after fit, several Trainers per process."""

import os

import torch
from _helpers import TinyRegression, regression_data
from _ranks import run_ranks
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_pdist import ParameterServerStrategy
from lightning_pdist.core.strategy import PdistStrategy


def flat(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


class EvalRegression(TinyRegression):
    """TinyRegression with test and predict steps on the validation data."""

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test/loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return batch[0], self.net(batch[0])

    def test_dataloader(self):
        return self.val_dataloader()

    def predict_dataloader(self):
        return self.val_dataloader()


def _trainer(strategy, root, **kwargs) -> Trainer:
    args = dict(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
                enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, default_root_dir=root)  # fmt: skip
    return Trainer(**{**args, **kwargs})


def _sequence(rank: int, world_size: int, root: str) -> None:
    # What an externally launched job (torchrun, a conformance suite) does: env set, Lightning launches nothing
    # (MASTER_PORT: the test's held port, inherited).
    os.environ.update(LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", NODE_RANK="0", WORLD_SIZE=str(world_size))
    model = lambda: EvalRegression(lr=0.05, momentum=0.9, n=24)  # noqa: E731  (3 steps per epoch on 2 workers)
    out = {}
    ckpt = ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    first = model()
    trainer = _trainer(ParameterServerStrategy(), root, max_steps=3, callbacks=[ckpt], enable_checkpointing=True)
    trainer.fit(first)
    out["fit"] = flat(first)
    out["validate"] = trainer.validate(first)[0]["val/loss"]
    out["test"] = trainer.test(first)[0]["test/loss"]
    out["predict"] = trainer.predict(first, return_predictions=True)
    out["validate_fresh"] = _trainer(ParameterServerStrategy(), root).validate(first)[0]["val/loss"]
    path = os.path.join(root, "epoch=0-step=3.ckpt")
    out["validate_ckpt"] = _trainer(ParameterServerStrategy(), root).validate(model(), ckpt_path=path)[0]["val/loss"]
    resumed = model()
    _trainer(ParameterServerStrategy(), root, max_steps=6, limit_val_batches=1).fit(resumed, ckpt_path=path)
    out["resumed"] = flat(resumed)
    ddp = model()  # initializes torch's default group (its store holds MASTER_PORT on rank 0 from now on)
    _trainer(PdistStrategy(), root, max_steps=6).fit(ddp)
    out["ddp"] = flat(ddp)
    after = model()
    _trainer(ParameterServerStrategy(), root, max_steps=6).fit(after)
    out["ps_after_ddp"] = flat(after)
    torch.save(out, os.path.join(root, f"rank{rank}.pt"))


def test_several_trainers_in_the_same_two_worker_processes(tmp_path):
    """fit, validate/test/predict (same and fresh Trainer, from a checkpoint), resume, DDP, PS again: one process pair."""
    run_ranks(_sequence, 2, tmp_path, str(tmp_path), group=False)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    net = TinyRegression().net
    torch.nn.utils.vector_to_parameters(ranks[0]["fit"], net.parameters())
    x, y = regression_data(16, seed=1).tensors
    with torch.no_grad():
        val_loss = nn.functional.mse_loss(net(x), y).item()  # 8 samples per worker: the mean of the two means
    for r, out in enumerate(ranks):
        torch.testing.assert_close(out["fit"], ranks[0]["fit"], atol=0, rtol=0)
        for key in ("validate", "test", "validate_fresh", "validate_ckpt"):
            assert abs(out[key] - val_loss) < 1e-6, (r, key, out[key], val_loss)
        with torch.no_grad():
            for inputs, predictions in out["predict"]:
                torch.testing.assert_close(predictions, net(inputs), atol=1e-6, rtol=0)
        # sync PS with SGD + momentum is DDP, whether resumed at step 3 or run under an initialized default group
        torch.testing.assert_close(out["resumed"], out["ddp"], atol=1e-6, rtol=0)
        torch.testing.assert_close(out["ps_after_ddp"], out["ddp"], atol=1e-6, rtol=0)
    assert not torch.allclose(ranks[0]["ddp"], ranks[0]["fit"])
