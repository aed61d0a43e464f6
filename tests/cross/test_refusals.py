"""Refusals a user meets early: keyword typos at construction, another algorithm's checkpoint, non-finite replicas."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.multiprocessing import ProcessRaisedException

from lightning_pdist import (BMUFStrategy, EASGDStrategy, LocalSGDStrategy, ParameterServerStrategy, PdistStrategy,
                             PipelineStrategy, SignSGDStrategy)  # fmt: skip
from _helpers import TinyRegression, fit


@pytest.mark.parametrize(("make", "match"), [
    (lambda: LocalSGDStrategy(perod=4), r"LocalSGDStrategy\(perod=4\): unknown argument; did you mean 'period'\?"),
    (lambda: BMUFStrategy(block_lr=1.0, blok_momentum=0.5), r"did you mean 'block_momentum'\?"),
    (lambda: EASGDStrategy(alhpa=0.1), r"EASGDStrategy\(alhpa=0.1\): unknown argument; did you mean 'alpha'\?"),
    (lambda: SignSGDStrategy(aggregaton="llr"), r"did you mean 'aggregation'\?"),
    (lambda: PdistStrategy(find_unused_parameter=True), r"did you mean 'find_unused_parameters'\?"),
    (lambda: ParameterServerStrategy(num_server=2), r"ParameterServerStrategy\(num_server=2\): unknown argument; did you mean 'num_servers'\?"),
    (lambda: ParameterServerStrategy(find_unused_parameters=True), r"never wraps the model in DistributedDataParallel"),
    (lambda: PipelineStrategy(static_graph=True), r"PipelineStrategy\(static_graph=True\): PipelineStrategy never wraps"),
])  # fmt: skip
def test_keyword_typos_are_refused_at_construction(make, match):
    with pytest.raises(TypeError, match=match):
        make()


def test_ddp_and_lightning_keywords_still_pass():
    """DDP's keywords reach DDP (``_ddp_kwargs``); Lightning's reach the strategy; ours are kept beside them."""
    local = LocalSGDStrategy(period=2, find_unused_parameters=True, gradient_as_bucket_view=True, start_method="fork")
    assert local._ddp_kwargs == {"find_unused_parameters": True, "gradient_as_bucket_view": True}
    assert local._start_method == "fork"
    assert local.rule.schedule.period == 2
    ps = ParameterServerStrategy(start_method="fork", process_group_backend="gloo")
    assert ps._start_method == "fork"
    assert ps._process_group_backend == "gloo" and ps.process_group_backend == "gloo"


def test_infinite_block_lr_is_refused():
    with pytest.raises(ValueError, match=r"BMUFStrategy\(block_lr=inf\): block_lr must be a finite number > 0"):
        BMUFStrategy(block_lr=float("inf"))


def test_another_algorithms_checkpoint_is_refused_when_resuming_but_evaluates(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=2)
    fit(BMUFStrategy(period=4, start_method="fork"), TinyRegression(), max_steps=2, callbacks=[checkpoint],
        enable_checkpointing=True)  # fmt: skip
    path = str(tmp_path / "epoch=0-step=2.ckpt")
    with pytest.raises(ProcessRaisedException, match=r"EASGDStrategy: .* was saved by BMUFStrategy; its algorithm state "
                                                     r"\(algorithm, rank_files, step\) does not carry over"):
        fit(EASGDStrategy(period=4, start_method="fork"), TinyRegression(), max_steps=4, ckpt_path=path)
    trainer = fit(EASGDStrategy(period=4, start_method="fork"), TinyRegression(), max_steps=0)
    trainer.validate(TinyRegression(), ckpt_path=path, verbose=False)  # weights only: fine


class _NanOnRankOne(TinyRegression):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_rank == 1 and batch_idx == 1 else loss


@pytest.mark.parametrize("make", [lambda: LocalSGDStrategy(period=2, start_method="fork"),
                                  lambda: BMUFStrategy(period=2, start_method="fork"),
                                  lambda: EASGDStrategy(period=2, start_method="fork")])  # fmt: skip
def test_a_nan_on_one_rank_stops_every_rank_at_that_step(make):
    """A NaN loss on rank 1 at its second batch stops every rank before that optimizer step (tests/strategies/
    test_nonfinite.py has each policy in detail)."""
    with pytest.raises(ProcessRaisedException, match=r"\(nonfinite='raise'\): non-finite gradients \(NaN/Inf\) on "
                                                     r"rank\(s\) \[1\] at global step 1; every rank stops here"):
        fit(make(), _NanOnRankOne(), max_steps=4)


@pytest.mark.parametrize(("make", "error", "match"), [
    (lambda: ParameterServerStrategy(server_timeout=True), TypeError, r"server_timeout=True\): .*a bool is not"),
    (lambda: ParameterServerStrategy(server_timeout=float("inf")), ValueError, r"server_timeout must be a finite number"),
    (lambda: ParameterServerStrategy(server_timeout=6573539176), ValueError,  # found by the constructor fuzz's fit
     r"server_timeout=6573539176\): server_timeout must be at most 1e\+07 seconds"),
    (lambda: ParameterServerStrategy(server_host=5), TypeError, r"server_host=5\): server_host must be an address"),
    (lambda: ParameterServerStrategy(server_addresses=[]), ValueError, r"server_addresses must list at least one"),
    (lambda: ParameterServerStrategy(server_addresses="127.0.0.1:5000"), TypeError, r"must be a list of 'host:port'"),
    (lambda: ParameterServerStrategy(server_addresses=["h:99999"]), ValueError, r"'h:99999' is not 'host:port' with a port in 1..65535"),
    (lambda: ParameterServerStrategy(allowed_networks=["10.0.0.0/8"]), TypeError, r"allowed_networks=\['10.0.0.0/8'\]\): allowed_networks must be"),
    (lambda: ParameterServerStrategy(mode="async", delay_compensation=float("inf")), ValueError, r"delay_compensation must be finite"),
    (lambda: ParameterServerStrategy(partition_bytes=0), ValueError, r"partition_bytes=0\): partition_bytes must be an int >= 1"),
    (lambda: SignSGDStrategy(max_weight=True), TypeError, r"max_weight=True\): max_weight must be a number"),
    (lambda: SignSGDStrategy("llr", decay="0.5"), TypeError, r"decay='0.5'\): decay must be a number"),
    (lambda: PdistStrategy(ddp_comm_hook="x"), TypeError, r"PdistStrategy\(ddp_comm_hook='x'\): ddp_comm_hook must be a callable"),
])  # fmt: skip
def test_bad_values_once_accepted_are_refused_naming_argument_value_and_rule(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_an_impossible_sharding_plan_is_refused_before_any_server_starts():
    """num_servers=64 on 58 parameters: refused on every rank before a server process exists."""
    from _helpers import server_processes

    with pytest.raises(ProcessRaisedException, match=r"ParameterServerStrategy: plan_sharding\(num_servers=64, "
                                                     r"sharding='memory'\): 58 elements .* leave servers \[58, .* empty"):
        fit(ParameterServerStrategy(num_servers=64, start_method="fork"), TinyRegression(), max_steps=1)
    assert server_processes() == []


@pytest.mark.parametrize(("mode", "who"), [("sync", "every worker"), ("async", "worker 1")])
def test_a_nan_gradient_on_one_worker_stops_the_parameter_server_run_before_its_push(mode, who):
    """sync: every worker stops (they agree per step); async: the worker that found it (tests/strategies/
    test_nonfinite.py has each policy in detail)."""
    with pytest.raises(ProcessRaisedException, match=rf"non-finite gradients \(NaN/Inf\) on rank\(s\) \[1\] at global "
                                                     rf"step 1; {who} stops here, before"):
        fit(ParameterServerStrategy(mode=mode, start_method="fork", server_timeout=30.0), _NanOnRankOne(), max_steps=4)
