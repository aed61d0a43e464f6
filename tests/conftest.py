"""Shared fixtures: a clean environment and a held MASTER_PORT per test, no process outliving its test, tests/ on
sys.path for _helpers and _ranks."""

import ctypes
import functools
import gc
import os
import signal
import sys
import time

import pytest
import lightning_pdist  # noqa: F401  (first: torch and Lightning imported with the collector paused, core/startup.py)
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _ranks import held_port  # noqa: E402  (tests/ is on sys.path from here)

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("PL_DISABLE_FORK", "0")
# torch's TCP store names each socket it connects or accepts with a reverse DNS query (for its logs; an IPv4-mapped
# loopback address, which /etc/hosts never answers). This machine's resolver drops about every 25th query a process
# sends, which then waits out glibc's default 5 s timeout: a long-lived rank building many Trainers (a conformance
# column) lost tens of seconds. A 1 s timeout (glibc's least) bounds that; the package itself already connects as
# rarely as it can (core/liveness.py, core/control_group.py). Set before any lookup; every child inherits it.
os.environ.setdefault("RES_OPTIONS", "timeout:1")

# Every Trainer and Fabric constructor scans the entry points of every installed distribution for callback factories
# (lightning.fabric.utilities.registry._load_external_callbacks): ~40 ms of CPU each here, for the ~1,500 Trainers the
# suite builds (the conformance matrix alone builds several per cell and rank). What it finds cannot change while the
# suite runs (nothing is installed meanwhile), so the scan runs once per pytest worker; forked ranks inherit the answer.
# The factories it finds are still called per Trainer, as Lightning does (there are none installed here).
from lightning.fabric.utilities import registry as _lightning_registry  # noqa: E402

_lightning_registry.entry_points = functools.cache(_lightning_registry.entry_points)

# libgomp's thread pool does not survive fork(): once this process has run an OpenMP team (MKL's tanh on a
# few hundred numbers is enough), a forked child that starts a team of its own waits forever in
# gomp_team_barrier_wait_end. Lightning sizes thread pools only where OMP_NUM_THREADS is unset: its popen
# launcher set this process to cpu_count threads, and a later devices=1 fork run (2 threads in the child)
# hung inside the suite but never alone. One thread everywhere, fixed here, keeps every team unborn.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _restore_env():
    """Lightning launchers export MASTER_PORT, WORLD_SIZE, ...; keep them from leaking across tests."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def master_port(_restore_env):
    """This test's ``MASTER_PORT``, held by this process until the test ends (``_ranks.held_port``): every launcher
    that reads it (Lightning's, Fabric's, ``pdist fit``, a job started as torchrun would) has its rank 0 bind a port
    nobody else can have taken, and none falls back to Lightning's own pick-and-release (``find_free_network_port``).
    Launches in one test run one after another on it, as a script's would on a fixed port."""
    with held_port() as port:
        os.environ["MASTER_PORT"] = str(port)
        yield port


@pytest.fixture(autouse=True)
def _teardown_process_group():
    """A 1-rank in-process fit leaves a default process group behind; forked ranks must not inherit it."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # Let the group's runloop threads finish the last works first: a work that completes while this thread holds
        # the GIL and frees the group waits for the GIL inside the group's lock, and the destructor waits for that
        # lock (torch's ~ProcessGroupGloo deadlock; hung a CI run here once, gdb: conftest -> gc -> ~ProcessGroupGloo
        # on pthread_mutex_lock, a pt_gloo_runloop thread in take_gil). Sleeping releases the GIL; the hooks' own
        # callbacks are waited for until gloo's threads have freed them.
        from lightning_pdist.core.hooks import settle_comm_callbacks

        settle_comm_callbacks()
        time.sleep(0.02)
        dist.destroy_process_group()
        time.sleep(0.02)
        gc.collect()  # a DDP wrap's Reducer holds the group in cycles: free it here, where its threads exist


# A child forked from this process (Lightning's ddp_fork, torch.multiprocessing harnesses, servers) never collects
# what it inherited: freeing an inherited ProcessGroupGloo (a dead group in a cycle with its DDP Reducer) joins
# threads the child does not have and hangs (issue 18). gc.freeze costs nothing; collecting before every fork cost
# 0.25 s a fork here (450k objects), minutes over the suite. The library freezes around its own forks
# (lightning_pdist.core.forking); this covers the forks the tests make themselves.
os.register_at_fork(after_in_child=gc.freeze)


# Orphaned grandchildren (a parameter server whose worker died, a rank whose launcher died) are reparented to this
# process instead of init, so the check below sees every process a test started, however deep.
_PR_SET_CHILD_SUBREAPER = 36
try:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
except (OSError, AttributeError):
    pass


def _descendants() -> dict[int, tuple[str, str]]:
    """{pid: (state, command line)} of every live descendant of this process (zombies included, state 'Z')."""
    parent_of, info = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        parent_of[int(entry)] = int(fields[1])
        info[int(entry)] = (fields[0], cmdline or stat[stat.index("(") + 1 : stat.rindex(")")])
    mine, grew = {os.getpid()}, True
    while grew:
        new = {pid for pid, ppid in parent_of.items() if ppid in mine and pid not in mine}
        mine |= new
        grew = bool(new)
    mine.discard(os.getpid())
    return {pid: info[pid] for pid in mine}


def _reap(pids) -> None:
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test():
    """Fails the test if a process it started (at any depth) is still running 15 s after it ends; kills those."""
    before = set(_descendants())
    yield
    deadline = time.monotonic() + 15
    while True:
        left = {pid: v for pid, v in _descendants().items() if pid not in before}
        _reap(pid for pid, (state, _) in left.items() if state == "Z")
        alive = {pid: v for pid, v in left.items() if v[0] != "Z"}
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if alive:
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
        _reap(alive)
        described = "; ".join(f"pid {pid} ({state}): {cmd[:160]}" for pid, (state, cmd) in sorted(alive.items()))
        pytest.fail(f"{len(alive)} process(es) outlived the test and were killed: {described}", pytrace=False)


# scripts/test.sh runs two pytest-xdist workers with --dist loadscope: each test file is one work unit (a file's
# module fixtures, e.g. the recipes' shared launch, run once), and each test class is one (each conformance column
# is a class; no other file has classes). (--dist loadgroup would be the marker-based way, but pytest-xdist 3.8
# renames items through ``item._nodeid``, which pytest 9 no longer reads: its groups come apart.) Units start in
# collection order and a worker takes the next when it is free, so the units that take minutes go first (longest
# first keeps the two workers from ending one long unit apart); the rest keep their order.
_FIRST = ("tests/conformance/test_matrix.py", "tests/bench/", "tests/recipes/", "tests/core/test_hung_ranks.py",
          "tests/multinode/", "tests/parameter_server/test_auth.py", "tests/diloco/")  # fmt: skip


def pytest_collection_modifyitems(config, items):
    first = {path: rank for rank, path in enumerate(_FIRST)}
    items.sort(key=lambda item: next((r for p, r in first.items() if item.nodeid.startswith(p)), len(first)))


# CI sets PDIST_FAIL_ON_SKIP=1 (.ci/run): every package the suite needs is installed there and the machine can make
# network namespaces and mount a tmpfs, so a skip means a test silently stopped testing. `-ra` prints each reason.
_skipped: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("PDIST_FAIL_ON_SKIP") == "1" and _skipped and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if os.environ.get("PDIST_FAIL_ON_SKIP") == "1" and _skipped:
        terminalreporter.write_line(f"PDIST_FAIL_ON_SKIP=1: {len(_skipped)} test(s) skipped (reasons above), so the "
                                    f"run fails: {', '.join(_skipped[:10])}", red=True)  # fmt: skip
