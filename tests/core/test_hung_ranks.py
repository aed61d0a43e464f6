"""Tier 3: stopped and killed ranks in real 2-rank jobs (issue 11): who is named, and that no process is left.

Each test runs ``_hung_job.py`` in a session of its own (popen and fork launches: the test starts the launcher;
external launches: the test starts each rank, as torchrun would), stops or kills a rank or the launcher, and
checks the error message and that every rank and server pid is gone. Waits are generous upper bounds, never
timings: a loaded machine only makes them take longer.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("_hung_job.py")
STARTUP = 180.0  # s: two ranks importing torch and Lightning on a loaded machine


@pytest.fixture
def jobs():
    """Processes started by the test; every one of their sessions is SIGKILLed at the end, whatever happened."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def start(jobs, out: Path, *args: str, rank: int | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # MASTER_PORT: the test's held port (conftest.py)
    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "PDIST_LAUNCHER_PID"):
        env.pop(name, None)
    if rank is not None:  # launched from outside, as torchrun does: Lightning starts no process
        env.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    log = open(out / f"log{'' if rank is None else rank}.txt", "w")
    proc = subprocess.Popen([sys.executable, str(JOB), str(out), *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # fmt: skip
    log.close()
    jobs.append(proc)
    return proc


def state(pid: int) -> str | None:
    """The process's state letter (``T``: stopped), or None once it is gone (a zombie counts as gone)."""
    try:
        letter = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return None if letter in "ZX" else letter


def wait_for(condition, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"not within {within:g} s: {what}"
        time.sleep(0.1)


def job_pids(out: Path) -> tuple[int, int, list[int]]:
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return ranks[0]["pid"], ranks[1]["pid"], ranks[0]["servers"]


def rank_1_stopped(out: Path) -> bool:
    return (out / "rank1.json").exists() and (out / "rank0.json").exists() and state(job_pids(out)[1]) == "T"


def assert_all_gone(pids: list[int]) -> None:
    wait_for(lambda: all(state(p) is None for p in pids), 30, f"processes {[p for p in pids if state(p)]} still alive")


@pytest.mark.parametrize("algo", ["ps", "ps_propagate"])
def test_a_stopped_ps_worker_is_named_and_the_job_ends(tmp_path, jobs, algo):
    """SIGSTOP worker 1 (popen): worker 0's error names it (pid, host) after server_timeout, without blaming the server,
    and no process is left. With the default nonfinite="raise" the workers meet before each push (through their
    store) and the silent worker is named there; with "propagate" the server names it (it says it is alive)."""
    launcher = start(jobs, tmp_path, algo, "stop1", "popen", "5")
    code = launcher.wait(timeout=STARTUP + 60)
    log = (tmp_path / "log.txt").read_text()
    rank0, rank1, servers = job_pids(tmp_path)
    assert code != 0
    if algo == "ps":
        assert re.search(rf"WorkerSilent: worker 0: worker 1 \(pid {rank1} on host \S+\) did not report its gradient "
                         r"check before step \d+'s push within 5 s: stopped, hung or dead", log), log[-3000:]  # fmt: skip
    else:
        assert re.search(rf"WorkerStalled: PUSHPULL to parameter server 0 at 127\.0\.0\.1:\d+: worker 1 \(pid {rank1} "
                         rf"on host \S+, connected from 127\.0\.0\.1:\d+; last heard from [\d.]+ s ago\) has not pushed "
                         r"step \d+ for [\d.]+ s: it is stopped, hung or dead; parameter server 0 is alive", log), log[-3000:]  # fmt: skip
    assert "did not answer" not in log  # the server is not blamed
    assert_all_gone([rank0, rank1, *servers])


@pytest.mark.parametrize("algo, launch", [("ps", "fork"), ("bmuf", "popen")])
def test_killing_the_launcher_ends_a_stopped_rank_and_the_servers(tmp_path, jobs, algo, launch):
    """SIGKILL the launching process while rank 1 is stopped: every rank (stopped or not) and every server ends."""
    launcher = start(jobs, tmp_path, algo, "stop1", launch, "300")  # waits far longer than the test
    wait_for(lambda: rank_1_stopped(tmp_path) or launcher.poll() is not None, STARTUP, "rank 1 stops itself")
    assert launcher.poll() is None, (tmp_path / "log.txt").read_text()[-3000:]
    rank0, rank1, servers = job_pids(tmp_path)
    assert (rank0 == launcher.pid) == (launch == "popen")  # popen: rank 0 launches; fork: both ranks are children
    if algo == "ps":
        assert servers and all(state(p) for p in servers)
    launcher.kill()
    launcher.wait()
    assert_all_gone([rank0, rank1, *servers])


def test_a_stopped_bmuf_rank_is_named_by_the_rank_waiting_for_it(tmp_path, jobs):
    """Externally launched BMUF, rank 1 SIGSTOPped: rank 0 fails after timeout=10 s, naming rank 1 as silent."""
    ranks = [start(jobs, tmp_path, "bmuf", "stop1", "external", "10", rank=r) for r in range(2)]
    code = ranks[0].wait(timeout=STARTUP + 60)
    log = (tmp_path / "log0.txt").read_text()
    assert code != 0
    assert re.search(r"BMUFStrategy, global rank 0: a collective failed \(collectives wait timeout=0:00:10\); rank 1 "
                     r"has sent no heartbeat for [\d.]+ s \(checked from rank 0\): stopped, dead, or cut off", log), log[-3000:]  # fmt: skip
    assert state(ranks[1].pid) == "T"  # nobody launched it: the test ends it (the fixture)


def test_a_killed_rank_0_under_bmuf_ends_the_other_rank_naming_it(tmp_path, jobs):
    """Externally launched BMUF, SIGKILL rank 0 (the store's host): rank 1 ends with an error that points at rank 0."""
    ranks = [start(jobs, tmp_path, "bmuf", "run", "external", "10", rank=r) for r in range(2)]
    both = lambda: all((tmp_path / f"step3_rank{r}").exists() for r in range(2)) or any(p.poll() is not None for p in ranks)  # noqa: E731
    wait_for(both, STARTUP, "both ranks reach step 3")
    assert ranks[1].poll() is None, (tmp_path / "log1.txt").read_text()[-3000:]
    ranks[0].kill()
    code = ranks[1].wait(timeout=60)
    log = (tmp_path / "log1.txt").read_text()
    assert code != 0
    assert re.search(r"BMUFStrategy, global rank 1: a collective failed .*; the job's store at 127\.0\.0\.1:\d+ does not "
                     r"answer .*global rank 0 under Lightning's launchers\) is stopped, dead or unreachable", log), log[-3000:]  # fmt: skip
