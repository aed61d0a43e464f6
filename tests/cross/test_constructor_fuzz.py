"""Property: any value for any constructor argument is refused naming that argument, or accepted and trains finitely.

``hypothesis`` draws one argument at a time (so a refusal must name *that* argument) from a mix of types and edge
values: None, booleans, small and huge ints, floats including NaN and infinities, short strings, lists, dicts.
A refusal is a ``TypeError`` or ``ValueError`` at construction whose message contains the argument's name. An
accepted value must survive a short fit on one process (the first few accepted values per strategy: fits are what
cost time) with a finite loss, or be refused at setup naming the argument where the rule needs the model (a sharding
plan with more servers than elements).
"""

from __future__ import annotations

import inspect
import math
import os
import warnings

import pytest
import torch
from _helpers import TinyRegression, free_port
from lightning.pytorch import Trainer

import lightning_pdist as lp

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

STRATEGIES = [lp.PdistStrategy, lp.LocalSGDStrategy, lp.SimuParallelSGDStrategy, lp.BMUFStrategy, lp.EASGDStrategy,
              lp.SignSGDStrategy, lp.ParameterServerStrategy, lp.PipelineStrategy, lp.TensorParallelStrategy]  # fmt: skip
#: Arguments that are not the algorithm's and whose values Lightning itself interprets.
SKIP = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
        "ddp_comm_state", "ddp_comm_wrapper", "process_group_backend", "timeout", "start_method", "kwargs"}  # fmt: skip
FITS_PER_STRATEGY = 2

values = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.integers(10**6, 10**12), st.sampled_from([2, 8, 64]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e-300, 0.5, 1.0, 1e300]),
    st.text(max_size=4), st.sampled_from(["auto", "sync", "mean", "1f1b", "memory", "127.0.0.1:1"]),
    st.lists(st.integers(-2, 70000), max_size=3), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)  # fmt: skip


def _arguments(cls: type) -> list[str]:
    params = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in params if p.name not in SKIP and p.name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD]


CASES = [(cls, arg) for cls in STRATEGIES for arg in _arguments(cls)]
fitted: dict[type, list[str]] = {}  # the accepted values that get a fit, per strategy (replays fit them again)


def _fit(strategy) -> float:
    os.environ["MASTER_PORT"] = str(free_port())
    module = TinyRegression()
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, num_sanity_val_steps=0)  # fmt: skip
    trainer.fit(module)
    return float(trainer.callback_metrics["train/loss"])


@pytest.mark.parametrize(("cls", "arg"), CASES, ids=[f"{c.__name__}-{a}" for c, a in CASES])
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(value=values)
def test_refused_naming_the_argument_or_trains_finitely(cls, arg, value):
    """Refused with a message naming the argument, or accepted and trains to a finite loss."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            strategy = cls(**{arg: value})
    except (TypeError, ValueError) as err:
        assert arg in str(err), f"{cls.__name__}({arg}={value!r}) refused without naming {arg}: {err}"
        return
    chosen, key = fitted.setdefault(cls, []), f"{arg}={value!r}"
    if key not in chosen and len(chosen) >= FITS_PER_STRATEGY:
        return
    chosen.append(key)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = _fit(strategy)
    except ValueError as err:  # what depends on the model (e.g. a sharding plan) is refused at setup, named
        assert arg in str(err), f"{cls.__name__}({arg}={value!r}) refused at setup without naming {arg}: {err}"
        return
    finally:
        # The fit ran in this (pytest's) process: leave no process group for later tests' forked ranks to inherit.
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert math.isfinite(loss), f"{cls.__name__}({arg}={value!r}) trained to loss {loss}"
