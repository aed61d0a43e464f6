"""Property: any value for any constructor argument is refused naming that argument, or accepted and trains finitely.

``hypothesis`` draws one argument at a time (so a refusal must name *that* argument) from a mix of types and edge
values: None, booleans, small and huge ints, floats including NaN and infinities, short strings, lists, dicts.
A refusal is a ``TypeError`` or ``ValueError`` at construction whose message contains the argument's name. An
accepted value must be held by the strategy (its ``config``, or the attribute named after the argument) and
round-trip: the held value, given back to the constructor, is accepted and held unchanged. The first accepted value
per (strategy, argument) must also survive a short fit on one process (fits are what cost time) with a finite loss,
or be refused at setup naming the argument where the rule needs the model (a sharding plan with more servers than
elements). The strategies whose every fit starts processes (Gorila's servers and actors, Ape-X's actors: ~10 s of
CPU a fit) fit once with every argument's first accepted value together (``test_process_starting_strategies_...``),
except the timing arguments, which fit alone; each value alone only where the others together are refused.
"""

from __future__ import annotations

import inspect
import math
import warnings

import pytest
import torch
from _helpers import TinyRegression
from tests.conformance.strategies import PDIST_CLASSES
from lightning.pytorch import Trainer


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

STRATEGIES = PDIST_CLASSES  # every strategy class, from the conformance suite's one list
#: Arguments that are not the algorithm's and whose values Lightning itself interprets.
SKIP = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
        "ddp_comm_state", "ddp_comm_wrapper", "process_group_backend", "timeout", "start_method", "kwargs"}  # fmt: skip
#: Arguments the strategy does not keep, and what an accepted value must then be (none today).
NOT_HELD: dict[str, object] = {}
#: A public spelling the strategy keeps as another value, which the constructor does not take back.
ALIASES = {("tensor_parallel_size", None): "auto", ("data_parallel_size", None): "auto", ("plan", "auto"): None,
           ("split_points", "auto"): None}

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
fitted: dict[tuple[type, str], str] = {}  # the accepted value that gets a fit, per (strategy, argument)
#: Strategies whose fit starts processes: their first accepted values are kept here and fit together, once.
PROCESS_STARTING = ("ApeXStrategy", "GorilaStrategy")
#: How long a started process may take: a short one (e.g. 3 s for a server that imports torch) may legitimately run
#: out on a loaded machine, and the fit then ends with an error naming the argument (as a setup refusal does).
TIMING = ("actor_timeout", "server_timeout")
#: Process counts: a fit with 64 servers starts 64 processes that import torch (~200 s of CPU). The fit takes the
#: first accepted count up to MAX_FIT_PROCESSES; every accepted count is still held and round-trips, and the upper
#: bounds are the constructors' own checks (refused above them, named).
PROCESS_COUNTS = ("num_actors", "num_learners", "num_servers")
MAX_FIT_PROCESSES = 4
accepted: dict[tuple[type, str], object] = {}

_MISSING = object()


def _held(strategy, arg: str):
    """The value ``strategy`` keeps for ``arg``: its validated config's field (the averaging strategies keep theirs in
    their rule's config and schedule), else the attribute (public or private)."""
    config, rule = getattr(strategy, "config", None), getattr(strategy, "rule", None)
    owners = ((config, arg), (getattr(rule, "config", None), arg), (getattr(rule, "schedule", None), arg),
              (strategy, arg), (strategy, f"_{arg}"))  # fmt: skip
    for owner, name in owners:
        if owner is not None and hasattr(owner, name):
            return getattr(owner, name)
    return _MISSING


def _check_held(cls: type, arg: str, value) -> None:
    """The accepted ``value`` is held (``None`` may resolve to a default), and the held value round-trips."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        held = _held(cls(**{arg: value}), arg)
        if held is _MISSING:
            assert arg in NOT_HELD and value is NOT_HELD[arg], f"{cls.__name__}({arg}={value!r}) accepted, not held"
            return
        alias = (arg, value) in ALIASES if isinstance(value, (str, type(None))) else False
        if alias:
            assert held == ALIASES[arg, value], f"{cls.__name__}({arg}={value!r}) holds {held!r}"
        elif value is not None:
            same = list(held) == list(value) if isinstance(value, list) else held == value
            assert same, f"{cls.__name__}({arg}={value!r}) accepted but holds {held!r}"
        again = _held(cls(**{arg: value if alias else held}), arg)
    assert again == held, f"{cls.__name__}({arg}={held!r}) (the held value) is held as {again!r}: no round trip"


class SparseRegression(TinyRegression):
    """The regression with its inputs shifted by rows of a sparse embedding (Parallax needs a sparse table)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4, sparse=True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        rows = (x.abs() * 2).long().clamp(max=7)
        loss = torch.nn.functional.mse_loss(self.net(x + self.embed(rows).mean(dim=1)), y)
        self.log("train/loss", loss)
        return loss


def _module(strategy):
    """The module a fit trains: a regression, or for the RL strategies (whose module is a learner) a small DQN."""
    if type(strategy).__name__ in ("ApeXStrategy", "GorilaStrategy"):
        from lightning_pdist.rl import DQNModule

        return DQNModule(hidden=8, steps_per_epoch=2)
    if type(strategy).__name__ == "ParallaxStrategy":
        return SparseRegression()
    if type(strategy).__name__ == "SandblasterStrategy":  # batch L-BFGS: refuses any other optimizer
        return _LBFGSRegression()
    return TinyRegression()


class _LBFGSRegression(TinyRegression):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=self.lr, max_iter=1)


def _fit(strategy) -> float:
    module = _module(strategy)
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
            cls(**{arg: value})
    except (TypeError, ValueError) as err:
        assert arg in str(err), f"{cls.__name__}({arg}={value!r}) refused without naming {arg}: {err}"
        return
    _check_held(cls, arg, value)
    if cls.__name__ in PROCESS_STARTING:
        costly = arg in PROCESS_COUNTS and isinstance(value, int) and value > MAX_FIT_PROCESSES
        if not costly and (cls, arg) not in accepted:
            accepted[cls, arg] = value
        fitted.setdefault((cls, arg), repr(value))
        return
    if fitted.setdefault((cls, arg), repr(value)) != repr(value):
        return
    _check_fit(cls, {arg: value})


def _check_fit(cls: type, kwargs: dict) -> bool:
    """A short fit with ``cls(**kwargs)`` ends with a finite loss (True), or is refused at setup naming one of the
    arguments (False); a timing argument may also end the fit with an error that names it (False)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        strategy = cls(**kwargs)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = _fit(strategy)
    except (ValueError, RuntimeError) as err:  # what depends on the model (e.g. a sharding plan) is refused at setup
        if isinstance(err, ValueError):
            named = any(arg in str(err) for arg in kwargs)
        else:  # a timing argument that ran out, named as `server_timeout=3 s`
            named = any(f"{arg}=" in str(err) for arg in kwargs if arg in TIMING)
        if not named:
            raise
        return False
    finally:
        # The fit ran in this (pytest's) process: leave no process group for later tests' forked ranks to inherit.
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert math.isfinite(loss), f"{cls.__name__}({kwargs!r}) trained to loss {loss}"
    return True


@pytest.mark.parametrize("cls", [c for c in STRATEGIES if c.__name__ in PROCESS_STARTING], ids=lambda c: c.__name__)
def test_process_starting_strategies_train_with_every_accepted_value_together(cls):
    """One fit with every argument's first accepted value (found by the per-argument cases above, or here when this
    test runs alone) but the timing arguments, which fit alone; where the values together are refused (at
    construction or setup), each value gets its own fit."""
    args = _arguments(cls)
    for arg in args:
        if (cls, arg) not in fitted:  # this test runs without the per-argument cases: search each argument now
            test_refused_naming_the_argument_or_trains_finitely(cls, arg)
    chosen = {arg: accepted[cls, arg] for arg in args if (cls, arg) in accepted}
    assert chosen, f"{cls.__name__}: no argument accepted any value"
    # the timing arguments alone (a short one may run out on a loaded machine), the others together (each alone only
    # if they do not fit together)
    rest = {arg: value for arg, value in chosen.items() if arg not in TIMING}
    for arg in set(chosen) - set(rest):
        _check_fit(cls, {arg: chosen[arg]})
    if not _fits_together(cls, rest):
        for arg, value in rest.items():
            _check_fit(cls, {arg: value})


def _fits_together(cls: type, kwargs: dict) -> bool:
    try:
        return _check_fit(cls, kwargs)
    except (TypeError, ValueError):  # refused at construction: the values conflict
        return False
