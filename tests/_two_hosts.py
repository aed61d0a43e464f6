"""Two emulated hosts for the multinode tests: start one command per host, wait, stop everything, check the job.

``tests/multinode/two_node_job.py`` is the training script; the launchers (torchrun, a PyTorchJob's pods) differ
only in the command and environment each host gets.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from lightning_pdist.bench.netns import EmulatedNetwork

JOB_SCRIPT = Path(__file__).resolve().parent / "multinode" / "two_node_job.py"


def job_args(strategy: str, out: Path, kwargs: dict | None = None, environment: str | None = None) -> list[str]:
    """``two_node_job.py``'s arguments: the strategy, where to write, its kwargs, the cluster environment."""
    return ([str(JOB_SCRIPT), strategy, str(out)] + ([json.dumps(kwargs)] if kwargs else [])
            + (["--environment", environment] if environment else []))  # fmt: skip


def run_on_hosts(net: EmulatedNetwork, commands: list[list[str]], envs: list[dict[str, str]], cwd: Path,
                 timeout: float) -> list[str]:  # fmt: skip
    """Run ``commands[i]`` with ``envs[i]`` inside host ``i``; every one must exit 0. Returns each host's output.

    Each command runs in its own session, killed (with whatever it started) if it is still running at the end.
    """
    procs = []
    try:
        for node, (cmd, env) in enumerate(zip(commands, envs)):
            procs.append(subprocess.Popen(net.exec_prefix(node) + cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))  # fmt: skip
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
        assert "failed to bind" not in log.lower() and "address already in use" not in log.lower(), log[-4000:]
    return logs


def read_results(out: Path, world_size: int = 2) -> list[dict]:
    """Each rank's result, as ``two_node_job.py`` wrote it."""
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world_size)]


def assert_trained_and_agree(results: list[dict]) -> None:
    """World size 2 on both, one node each, finite metrics, equal weights at the end."""
    assert [r["world_size"] for r in results] == [2, 2] and [r["node_rank"] for r in results] == [0, 1]
    for r in results:
        assert r["metrics"] and all(v == v for v in r["metrics"].values())
    # BMUF ends fit on the consensus model; the sign vote and the servers keep the replicas identical
    assert results[0]["param_sum"] == results[1]["param_sum"] and results[0]["param_norm"] == results[1]["param_norm"]
