"""The `pdist` console script: strategy choices, per-strategy help, shipped recipes by name."""

from __future__ import annotations

import pytest

import lightning_pdist
from lightning_pdist.cli import main
from lightning_pdist.strategies.config import OWNED_DDP_ARGS

# Strategies that own gradient communication and refuse DDP's hook arguments.
OWNERS = ["BMUFStrategy", "EASGDStrategy", "LocalSGDStrategy", "SimuParallelSGDStrategy", "SignSGDStrategy",
          "ParameterServerStrategy", "PipelineStrategy"]  # fmt: skip


def _cli_output(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code in (0, None)
    return capsys.readouterr().out


def test_strategy_choices_offer_every_strategy_but_not_the_abstract_base(capsys):
    """`pdist fit --help` lists each strategy class and not the abstract ModelAveragingStrategy."""
    text = "".join(_cli_output(["fit", "--help"], capsys).split())  # argparse wraps long class paths
    assert "ModelAveragingStrategy" not in text
    for name in lightning_pdist.__all__:
        if name.endswith("Strategy"):
            assert f"lightning_pdist.{name}" in text, name


@pytest.mark.parametrize("strategy", OWNERS)
def test_strategy_help_leaves_out_the_arguments_it_refuses(strategy, capsys):
    """`--trainer.strategy.help <Class>` shows the strategy's own arguments, not the DDP hook arguments it refuses."""
    text = _cli_output(["fit", "--trainer.strategy.help", strategy], capsys)
    assert "--trainer.strategy.start_method" in text
    for name in OWNED_DDP_ARGS:
        assert f"--trainer.strategy.{name}" not in text, name


def test_pdist_ddp_help_keeps_the_hook_arguments(capsys):
    """PdistStrategy takes ddp_comm_hook (its comm hooks run on CPU too), so its help still offers them."""
    text = _cli_output(["fit", "--trainer.strategy.help", "PdistStrategy"], capsys)
    for name in OWNED_DDP_ARGS:
        assert f"--trainer.strategy.{name}" in text, name


@pytest.mark.parametrize("strategy", OWNERS)
def test_owned_arguments_left_unset_are_still_accepted(strategy):
    """Passing the refused arguments as None (what older configs hold) constructs the strategy as before."""
    cls = getattr(lightning_pdist, strategy)
    kwargs = {"num_stages": 2} if strategy == "PipelineStrategy" else {}
    instance = cls(**kwargs, **dict.fromkeys(OWNED_DDP_ARGS))
    assert instance._ddp_comm_hook is None
