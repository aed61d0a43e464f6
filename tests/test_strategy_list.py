"""The one list of strategies the cross-cutting suites share (``tests/conformance/strategies.py``) names every
strategy class the package exports, so a new family cannot land without its conformance column, constructor fuzz and
resume check."""

from tests.conformance.strategies import PDIST_CLASSES, STRATEGIES

import lightning_pdist


def test_every_exported_strategy_class_has_a_column():
    exported = {getattr(lightning_pdist, name) for name in lightning_pdist.__all__ if name.endswith("Strategy")}
    assert exported == set(PDIST_CLASSES), f"without a conformance column: {sorted(c.__name__ for c in exported - set(PDIST_CLASSES))}"


def test_the_list_holds_each_class_once_and_the_baseline():
    assert len(PDIST_CLASSES) == len(set(PDIST_CLASSES)) and "ddp" in STRATEGIES
