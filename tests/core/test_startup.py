"""lightning_pdist.core.startup: the package's import runs with the collector paused and leaves its objects frozen;
forks still tell the objects a process froze itself from the ones it inherited (lightning_pdist.core.forking)."""

import gc
import os

import pytest

from lightning_pdist.core import forking, startup


@pytest.fixture
def unfrozen():
    """Start from no frozen object (as a fresh process does); whatever the test freezes is unfrozen afterwards."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def _in_child(check) -> bool:
    """``check()`` in a forked child (its answer as the exit status)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if check() else 1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def test_the_collector_is_paused_inside_and_the_objects_are_frozen_after(unfrozen):
    before = gc.get_stats()[2]["collections"]
    with startup.paused_then_frozen():
        assert not gc.isenabled()
        kept = [[i] for i in range(200_000)]  # would trigger collections if the collector ran
    assert gc.isenabled() and gc.get_stats()[2]["collections"] == before
    assert gc.get_freeze_count() > len(kept) and startup.froze_at_import()
    assert not forking._inherited()  # a fork here unfreezes them in this process afterwards
    with forking.frozen_for_fork():
        pass
    assert gc.get_freeze_count() == 0


def test_a_forked_child_holds_inherited_objects_and_never_unfreezes_them(unfrozen):
    with startup.paused_then_frozen():
        pass
    assert _in_child(lambda: not startup.froze_at_import() and forking._inherited())

    def fork_again_and_stay_frozen() -> bool:
        frozen = gc.get_freeze_count()
        with forking.frozen_for_fork():
            pass
        return gc.get_freeze_count() >= frozen > 0

    assert _in_child(fork_again_and_stay_frozen)


def test_an_import_inside_a_process_with_frozen_objects_does_not_claim_them(unfrozen):
    """A forked child importing the package for the first time, or a program that froze first: not this import's."""
    gc.freeze()
    with startup.paused_then_frozen():
        pass
    assert not startup.froze_at_import() and forking._inherited()


def test_a_paused_collector_stays_paused(unfrozen):
    gc.disable()
    try:
        with startup.paused_then_frozen():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
