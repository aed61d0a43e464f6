"""No rank outlives the process that launched it.

Lightning's launchers start ranks as children of the launching process: the ``popen`` launcher (the default)
runs the script again for ranks 1 … N-1 (``subprocess.Popen``; the launching process is rank 0), ``fork`` and
``spawn`` start every rank with ``torch.multiprocessing``. Nothing tells those children when their parent dies:
after a SIGKILL, the OOM killer, or an exception that ends rank 0's script while another rank is stopped (SIGSTOP,
a debugger) or blocked, a child waits out its collective timeout (30 min by default) or, stopped, lingers forever.

So each child rank asks the kernel to SIGKILL it when the launching process dies (Linux
``prctl(PR_SET_PDEATHSIG, SIGKILL)``, which ends a stopped process too), as early as the strategy runs in it
(``setup_environment``). How a child knows its launcher: the ``popen`` launcher puts its pid in the children's
environment (:data:`LAUNCHER_PID_ENV`, only for the children it starts); ``fork``/``spawn`` children carry the
strategy, which recorded the launching pid. Ranks started by something else (torchrun, SLURM, a script of your
own) are left alone: their launcher owns their lifetime.

A rank that a collective fails on (a peer stopped, dead or cut off: gloo says only ``Timed out waiting 1800000ms
for recv operation`` or ``Connection closed by peer``) names the missing ranks: every rank beats a counter in the
job's store (:class:`~lightning_pdist.core.liveness.Heartbeat`, from ``setup_distributed`` to ``teardown``), and
on such a failure :func:`name_lost_ranks` adds to the error which ranks stopped beating.

A ``fork`` launch never copies a process group into the ranks (:class:`ForkSafeLaunch`): a gloo group's threads do
not exist in a forked child, so the child's first collective on an inherited group, or the garbage collector freeing
one (``ProcessGroupGloo::~ProcessGroupGloo`` joins its threads), waits forever. A live group in the launching process
is refused before any rank starts (a Trainer whose rank 0 ran in this process keeps its group until exit); whatever
the ranks inherit, garbage included (a finished DDP wrap's Reducer and group, in cycles), is frozen, never collected
there; the launching process frees its own garbage later, where the threads exist
(:func:`~lightning_pdist.core.forking.frozen_for_fork`).

Caveats: the kernel signals the child when the *thread* that started it exits, which for Lightning's launchers is
the launching process's main thread (``Trainer.fit`` called from another thread that exits early would end the
ranks). A child that finds its launcher already gone when it gets here (it died while the child was importing)
stops at once with a ``RuntimeError``. Elsewhere than Linux a daemon thread polls the parent pid once a second
instead (it cannot end a stopped process).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Any

from lightning.fabric.strategies.launchers import _MultiProcessingLauncher as _FabricMultiProcessingLauncher
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_pdist.core.forking import frozen_for_fork, refuse_live_process_group
from lightning_pdist.core.liveness import Heartbeat, default_store_address, describe_silent_ranks, looks_like_a_lost_peer

__all__ = ["LAUNCHER_PID_ENV", "FabricForkSafeLauncher", "ForkSafeLaunch", "ForkSafeLauncher", "PopenLauncher",
           "die_with_launcher", "launcher_pid", "name_lost_ranks", "own_launcher", "start_heartbeat"]

#: Set by the ``popen`` launcher in the environment of the ranks it starts: its own pid.
LAUNCHER_PID_ENV = "PDIST_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


class PopenLauncher(_SubprocessScriptLauncher):
    """Lightning's ``popen`` launcher, telling the ranks it starts its pid (:data:`LAUNCHER_PID_ENV`)."""

    @override
    def _call_children_scripts(self) -> None:
        before = os.environ.get(LAUNCHER_PID_ENV)
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # Lightning copies os.environ for each child it starts
        try:
            super()._call_children_scripts()
        finally:
            if before is None:
                os.environ.pop(LAUNCHER_PID_ENV, None)
            else:
                os.environ[LAUNCHER_PID_ENV] = before


class ForkSafeLaunch:
    """Mixin for Lightning's multiprocessing launchers: a ``fork`` launch refuses a live process group and starts
    its ranks with everything they inherit frozen, never freed there (:func:`~lightning_pdist.core.forking.frozen_for_fork`)."""

    _start_method: str

    def launch(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        if self._start_method != "fork":
            return super().launch(function, *args, **kwargs)  # type: ignore[misc]
        refuse_live_process_group(type(self._strategy).__name__)  # type: ignore[attr-defined]
        with frozen_for_fork():
            return super().launch(function, *args, **kwargs)  # type: ignore[misc]


class ForkSafeLauncher(ForkSafeLaunch, _MultiProcessingLauncher):
    """Lightning's (Trainer) fork/spawn launcher with :class:`ForkSafeLaunch`."""


class FabricForkSafeLauncher(ForkSafeLaunch, _FabricMultiProcessingLauncher):
    """Fabric's fork/spawn launcher with :class:`ForkSafeLaunch`."""


def own_launcher(launcher: Any) -> Any:
    """``launcher``, with Lightning's ``popen`` launcher replaced by :class:`PopenLauncher` and its fork/spawn
    launchers by their :class:`ForkSafeLaunch` twins (same settings)."""
    if type(launcher) is _SubprocessScriptLauncher:
        return PopenLauncher(launcher.cluster_environment, launcher.num_processes, launcher.num_nodes)
    if type(launcher) is _MultiProcessingLauncher:
        return ForkSafeLauncher(launcher._strategy, start_method=launcher._start_method)
    if type(launcher) is _FabricMultiProcessingLauncher:
        return FabricForkSafeLauncher(launcher._strategy, start_method=launcher._start_method)
    return launcher


def launcher_pid() -> int:
    """The pid of the process that launched this one (``popen`` children), else this process's own pid.

    Recorded when the strategy configures its launcher: in ``fork``/``spawn`` children the strategy carries the
    launching process's value.
    """
    value = os.environ.get(LAUNCHER_PID_ENV, "")
    return int(value) if value.isdigit() else os.getpid()


def die_with_launcher(launcher: int | None) -> bool:
    """In a rank that process ``launcher`` started: be SIGKILLed when it dies. Returns whether this process is one.

    Raises:
        RuntimeError: the launcher is already gone (it died while this rank was starting).
    """
    if launcher is None or launcher == os.getpid():
        return False
    if os.getppid() != launcher:
        if _alive(launcher):
            return False  # started by a process that was itself started by the launcher (forkserver, a tool): not ours
        raise RuntimeError(f"the process that launched this rank (pid {launcher}) is gone; this rank (pid "
                           f"{os.getpid()}) stops instead of waiting for ranks that will never come")  # fmt: skip
    if sys.platform.startswith("linux") and _set_parent_death_signal(signal.SIGKILL):
        if os.getppid() != launcher:  # it died between the check and the prctl
            os.kill(os.getpid(), signal.SIGKILL)
        return True
    threading.Thread(target=_watch_parent, args=(launcher,), name="pdist-launcher-watch", daemon=True).start()
    return True


def _set_parent_death_signal(signum: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_heartbeat(strategy: Any) -> Heartbeat | None:
    """This rank's heartbeat in the default group's TCP store (``None`` with one rank or another kind of store)."""
    address = default_store_address() if strategy.world_size > 1 else None
    if address is None:
        return None
    try:
        return Heartbeat(*address, strategy.global_rank)
    except Exception as err:  # noqa: BLE001  (the heartbeat only improves error messages; never fail a run for it)
        rank_zero_warn(f"{type(strategy).__name__}: no heartbeat in the job's store at {address[0]}:{address[1]} "
                       f"({type(err).__name__}: {err}); a failed collective will not name the missing rank")  # fmt: skip
        return None


def name_lost_ranks(strategy: Any, exception: BaseException, heartbeat: Heartbeat | None) -> None:
    """If ``exception`` is a collective that lost a peer, add which ranks stopped beating to its message."""
    if heartbeat is None or not looks_like_a_lost_peer(exception):
        return
    note = describe_silent_ranks(heartbeat.host, heartbeat.port, strategy.world_size, strategy.global_rank,
                                 wait=2.5 * heartbeat.period)  # fmt: skip
    timeout = getattr(strategy, "_timeout", None)
    waits = f" (collectives wait timeout={timeout})" if timeout is not None else ""
    message = str(exception.args[0]) if exception.args else ""
    exception.args = (f"{message}\n{type(strategy).__name__}, global rank {strategy.global_rank}: a collective failed"
                      f"{waits}; {note}", *exception.args[1:])  # fmt: skip
