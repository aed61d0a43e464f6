"""Tier 1/3: Fabric strategies refuse bad arguments at construction and misuse at setup, save and load; their names."""

import pytest
import torch
from _fabric_loop import launch, train
from _helpers import make_net
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

from lightning_pdist import BMUFStrategy
from lightning_pdist.fabric import BMUFFabricStrategy, EASGDFabricStrategy, LocalSGDFabricStrategy, SignSGDFabricStrategy


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: LocalSGDFabricStrategy(period=0), ValueError, r"LocalSGDFabricStrategy\(period=0\): period must be >= 1"),
        (lambda: LocalSGDFabricStrategy(period=2.0), TypeError, r"LocalSGDFabricStrategy\(period=2.0\): period must be an int"),
        (lambda: LocalSGDFabricStrategy(warmup_steps=-1), ValueError, r"\(warmup_steps=-1\): warmup_steps must be >= 0"),
        (lambda: BMUFFabricStrategy(block_momentum=1.0), ValueError, r"BMUFFabricStrategy\(block_momentum=1.0\): block_momentum must be in \[0, 1\)"),
        (lambda: BMUFFabricStrategy(block_lr=0), ValueError, r"BMUFFabricStrategy\(block_lr=0\): block_lr must be a finite number > 0"),
        (lambda: BMUFFabricStrategy(nesterov=1), TypeError, r"BMUFFabricStrategy\(nesterov=1\): nesterov must be a bool"),
        (lambda: BMUFFabricStrategy(period=True), TypeError, r"BMUFFabricStrategy\(period=True\): period must be an int"),
        (lambda: EASGDFabricStrategy(alpha=1.5), ValueError, r"EASGDFabricStrategy\(alpha=1.5\): alpha must be in \(0, 1\]"),
        (lambda: EASGDFabricStrategy(alpha="0.1"), TypeError, r"EASGDFabricStrategy\(alpha='0.1'\): alpha must be a number"),
        (lambda: SignSGDFabricStrategy("mean"), ValueError, r"SignSGDFabricStrategy\(aggregation='mean'\): aggregation must be one of"),
        (lambda: SignSGDFabricStrategy(momentum=1.0), ValueError, r"SignSGDFabricStrategy\(momentum=1.0\): momentum"),
        (lambda: SignSGDFabricStrategy(scale="l2"), ValueError, r"SignSGDFabricStrategy\(scale='l2'\): scale must be one of"),
        (lambda: SignSGDFabricStrategy(nonfinite="skip_step"), ValueError, r"SignSGDFabricStrategy\(nonfinite='skip_step'\): under Fabric your loop calls optimizer.step\(\)"),
        (lambda: BMUFFabricStrategy(perod=4), TypeError, r"BMUFFabricStrategy\(perod=4\): unknown argument; did you mean 'period'\?"),
        (lambda: LocalSGDFabricStrategy(ddp_comm_hook=print), TypeError, r"LocalSGDFabricStrategy\(ddp_comm_hook=.*\): unknown argument"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_at_construction(make, error, message):
    """Each bad value or unknown keyword raises at construction, echoing the argument and stating the rule."""
    with pytest.raises(error, match=message):
        make()


def test_ddp_arguments_are_accepted():
    """Fabric DDPStrategy's and DistributedDataParallel's keywords pass through."""
    strategy = BMUFFabricStrategy(period=2, start_method="fork", find_unused_parameters=True, broadcast_buffers=False)
    assert strategy._ddp_kwargs == {"find_unused_parameters": True, "broadcast_buffers": False}


@pytest.mark.parametrize(
    "name, cls, params",
    [
        ("local_sgd", LocalSGDFabricStrategy, {}),
        ("bmuf_fork", BMUFFabricStrategy, {"start_method": "fork"}),
        ("easgd_spawn", EASGDFabricStrategy, {"start_method": "spawn"}),
        ("signsgd_mv", SignSGDFabricStrategy, {"aggregation": "majority"}),
        ("it_signsgd_fork", SignSGDFabricStrategy, {"aggregation": "llr", "start_method": "fork"}),
        ("bmuf_find_unused_parameters_true", BMUFFabricStrategy, {"find_unused_parameters": True}),
    ],
)
def test_names_are_registered_with_fabric(name, cls, params):
    """Fabric(strategy=name) builds the Fabric strategy; the Trainer's registry keeps its own classes."""
    assert STRATEGY_REGISTRY[name]["init_params"] == params
    assert isinstance(Fabric(accelerator="cpu", devices=2, strategy=name).strategy, cls)
    assert StrategyRegistry["bmuf"]["strategy"] is BMUFStrategy


def test_second_module_is_refused():
    """fabric.setup of a second module raises before wrapping it: the algorithm runs on one module."""
    strategy = LocalSGDFabricStrategy()
    strategy.module = make_net()  # as after the first fabric.setup
    with pytest.raises(RuntimeError, match=r"fabric.setup was called for a second module \(Linear\) after Sequential"):
        strategy.setup_module(nn.Linear(2, 2))


def _checkpoint(tmp_path, saved_by="BMUFFabricStrategy"):
    path = tmp_path / "ckpt.pt"
    torch.save({"model": make_net().state_dict(), "pdist": {"strategy": saved_by, "step": 1}}, path)
    return path


def test_load_before_setup_is_refused(tmp_path):
    """fabric.load of an algorithm checkpoint before fabric.setup raises: setup would overwrite every replica."""
    path = _checkpoint(tmp_path)
    with pytest.raises(RuntimeError, match=r"came before fabric.setup\(model, optimizer\)"):
        BMUFFabricStrategy().load_checkpoint(path, {"model": make_net()})


def test_another_algorithms_checkpoint_is_refused(tmp_path):
    """Resuming from a checkpoint saved by another algorithm raises, naming both."""
    path = _checkpoint(tmp_path, saved_by="EASGDFabricStrategy")
    strategy = BMUFFabricStrategy()
    strategy.module = make_net()
    with pytest.raises(ValueError, match=r"BMUFFabricStrategy: .* was saved by EASGDFabricStrategy"):
        strategy.load_checkpoint(path, {"model": make_net()})


def test_a_pdist_key_in_the_saved_state_is_refused(tmp_path):
    """fabric.save(state) with a key "pdist" raises instead of being overwritten by the algorithm state."""
    with pytest.raises(ValueError, match=r"fabric.save\(state\) has a key 'pdist'"):
        LocalSGDFabricStrategy().save_checkpoint(tmp_path / "x.pt", {"pdist": 1})


def test_easgd_alpha_too_large_for_the_world_is_refused_at_setup():
    """EASGD(alpha=0.6) on 2 ranks (alpha * world_size > 1) raises in fabric.setup, on every rank."""
    with pytest.raises(Exception, match=r"alpha \* world_size = 1.2 must be <= 1"):
        launch(EASGDFabricStrategy(alpha=0.6, start_method="fork"), lambda fabric: train(fabric, 1))


def test_one_rank_warns_and_trains():
    """devices=1 warns that nothing is communicated and still runs the rule (local SGD: plain SGD)."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=LocalSGDFabricStrategy(period=2))
    with pytest.warns(UserWarning, match=r"LocalSGDFabricStrategy: world_size == 1, so there is nothing to communicate"):
        fabric.launch(lambda f: train(f, 3))


def test_consensus_before_setup_is_refused():
    """load_consensus() before fabric.setup raises, naming the missing call."""
    with pytest.raises(RuntimeError, match=r"LocalSGDFabricStrategy: no module is set up yet; call fabric.setup"):
        LocalSGDFabricStrategy().load_consensus()


@pytest.mark.filterwarnings("ignore:LocalSGDFabricStrategy. world_size == 1")
def test_resume_without_this_ranks_file_warns(tmp_path):
    """A checkpoint whose rank file is gone resumes from the consensus, with a warning that says why."""
    path = tmp_path / "ckpt.pt"
    fabric = Fabric(accelerator="cpu", devices=1, strategy=LocalSGDFabricStrategy(period=2))
    fabric.launch(lambda f: train(f, 2, save_at=1, path=path))
    (tmp_path / "ckpt.pt.pdist-rank0-of-1").unlink()
    fabric = Fabric(accelerator="cpu", devices=1, strategy=LocalSGDFabricStrategy(period=2))
    with pytest.warns(UserWarning, match=r"pdist-rank0-of-1 \(rank 0's part of the checkpoint\) does not exist; every "
                                         r"rank resumes from the consensus model"):  # fmt: skip
        fabric.launch(lambda f: train(f, 2, path=path, resume=True))


def test_sign_resume_without_rank_state_warns():
    """The sign strategy says the vote state starts from zero when no rank file can be read."""
    from lightning_pdist.sign.hooks import SignSGDState

    strategy = SignSGDFabricStrategy()
    strategy.hook_state = SignSGDState()
    with pytest.warns(UserWarning, match=r"SignSGDFabricStrategy: no file; the vote statistics, residuals and momentum"):
        strategy.load_rank_state(None, {}, "no file")
