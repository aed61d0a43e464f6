"""DiLoCo on torchft: 3 replica processes, one SIGKILLed mid-round and restarted; against a plain-torch DiLoCo.
Then, in the same processes, all three resume their own mid-round checkpoints and must reach exactly where they ended;
they run on, and one of them alone leaves mid-round and rejoins from its own round-end checkpoint while the others
run on: it joins their round end without contributing and takes its step; all three end at the reference.

The reference (written here from the paper's rule, no lightning_pdist import) runs each round over the replicas that
contributed to it in the real run (read from their round records): each starts from θ_global, takes H SGD steps on
its batches (inner momentum kept within a process's life, fresh after a restart), then θ_global takes a Nesterov step
on the mean pseudo-gradient of those replicas only.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _helpers import make_net, regression_data
from _ranks import held_port
from torch import nn

torchft = pytest.importorskip("torchft")
from diloco._ft_replica import CKPT_AT, H, REJOINER, STALL_AT, STEPS, STEPS2, VICTIM, WAIT_AT, ft_batch  # noqa: E402

WORKER = Path(__file__).with_name("_ft_replica.py")
ROOT = Path(__file__).resolve().parents[2]


def _reference(contributors: dict[int, list[tuple[int, int]]], steps: int) -> torch.Tensor:
    """θ_global after the rounds to ``steps``; ``contributors[s]`` = the (replica, life) that contributed to the round
    ending at s (a replica that did not keeps its inner optimizer state for its next round)."""
    data = regression_data(64)
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # noqa: E731
    glob = nn.Parameter(flat(make_net()).clone())
    outer = torch.optim.SGD([glob], lr=0.7, momentum=0.9, nesterov=True)
    nets, inner, lives = {}, {}, {}
    for s in range(H, steps + 1, H):
        deltas = []
        for r, life in contributors[s]:
            if lives.get(r) != life:  # a new process: a fresh inner optimizer
                nets[r] = make_net()
                inner[r] = torch.optim.SGD(nets[r].parameters(), lr=0.1, momentum=0.9)
                lives[r] = life
            torch.nn.utils.vector_to_parameters(glob.detach().clone(), nets[r].parameters())
            for t in range(s - H + 1, s + 1):
                x, y = ft_batch(data, r, t)
                inner[r].zero_grad()
                nn.functional.mse_loss(nets[r](x), y).backward()
                inner[r].step()
            deltas.append(glob.detach() - flat(nets[r]))
        glob.grad = torch.stack(deltas).mean(0)
        outer.step()
    return glob.detach()


def _start(tmp_path, r, life, env, first_port):
    # Each replica is its own 1-process job on a port of its own (the test holds them: one shared port, three stores
    # on it, collide with EADDRINUSE); a restarted replica takes its predecessor's.
    env = {k: v for k, v in env.items() if k not in ("MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK",
                                                     "GROUP_RANK", "LOCAL_WORLD_SIZE")}  # fmt: skip
    env["MASTER_PORT"] = str(first_port + r)
    log = open(tmp_path / f"log{r}.{life}", "w")
    return subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), str(r), str(life)], env=env, stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip


def _wait(path: Path, procs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} did not appear in {timeout}s"
        ended = [i for i, p in enumerate(procs) if p.poll() is not None]
        assert not ended, f"replica(s) {ended} ended early: " + "; ".join(
            f"{f.name}: {f.read_text()[-2000:]}" for f in sorted(path.parent.glob("log*")))
        time.sleep(0.02)


def test_a_killed_replica_is_left_out_and_a_restarted_one_heals_and_catches_up(tmp_path):
    from torchft._torchft import LighthouseServer

    with held_port(3) as first_port:
        _run_replicas(tmp_path, LighthouseServer, first_port)

    _check_rounds(tmp_path)


def _run_replicas(tmp_path, LighthouseServer, first_port):  # noqa: N803
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=3000, heartbeat_timeout_ms=1000)
    env = dict(os.environ, TORCHFT_LIGHTHOUSE=lighthouse.address(), PYTHONPATH=str(ROOT), LOGLEVEL="WARNING")
    procs = [_start(tmp_path, r, 1, env, first_port) for r in range(3)]
    try:
        _wait(tmp_path / "stalled", procs, 120)
        os.kill(procs[VICTIM].pid, signal.SIGKILL)  # mid-round 3, while the others finish it
        procs[VICTIM].wait(10)
        procs.append(_start(tmp_path, VICTIM, 2, env, first_port))
        live = [procs[0], procs[1], procs[3]]
        for p in live:
            p.wait(120)
        logs = {f.name: f.read_text()[-3000:] for f in tmp_path.glob("log*")}
        assert [p.returncode for p in live] == [0, 0, 0], logs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        lighthouse.shutdown()


def _check_rounds(tmp_path):
    records = {r: [json.loads(line) for line in (tmp_path / f"rounds{r}.jsonl").read_text().splitlines()] for r in range(3)}
    assert all(rec["committed"] for rs in records.values() for rec in rs)
    contributors = {s: [] for s in range(H, STEPS + 1, H)}
    for r, rs in records.items():
        for rec in rs:
            if rec["contributed"]:
                contributors[rec["step"]].append((r, rec["life"]))
            assert rec["contributors"] <= rec["participants"] <= 3
    kill_round = (STALL_AT + H - 1) // H * H
    # before the kill every replica contributed; the kill round was finished by the two survivors alone
    for s in range(H, kill_round, H):
        assert [r for r, _ in contributors[s]] == [0, 1, 2], s
    assert [r for r, _ in contributors[kill_round]] == [0, 1]
    # the restarted victim healed (from a live peer, at a round end after the kill) and contributed afterwards
    (healed,) = [rec for rec in records[VICTIM] if rec["healed"] and rec["life"] == 2]
    assert healed["step"] == WAIT_AT + H and kill_round < healed["step"] < CKPT_AT and healed["participants"] == 3
    assert healed["contributors"] == 2
    assert [r for r, _ in contributors[STEPS]] == [0, 1, 2]
    for s, rs in contributors.items():
        counts = {rec["contributors"] for recs in records.values() for rec in recs if rec["step"] == s}
        assert counts == {len(rs)}, (s, counts, rs)

    expected = _reference(contributors, STEPS)
    finals = [torch.load(tmp_path / f"final{r}.pt") for r in range(3)]
    for r, final in enumerate(finals):
        assert final["step"] == STEPS
        torch.testing.assert_close(final["params"], expected, atol=1e-5, rtol=0, msg=lambda m: f"replica {r}: {m}")
    assert finals[VICTIM]["global_step"] == STEPS - healed["step"]  # the restarted replica trained only what was left

    # The resume (every replica from its own checkpoint at CKPT_AT, mid the last round, all three together): the join
    # heals nobody (torchft's step came back with the checkpoint; reset to 0, torchft's init_sync heals replicas from
    # a peer and drops their steps CKPT_AT-1..CKPT_AT), keeps each replica's own mid-round weights, and the
    # round at STEPS averages all three: θ_global, inner and outer optimizer states reach bitwise where they ended.
    resumed = {r: [json.loads(line) for line in (tmp_path / f"rounds{r}.resumed.jsonl").read_text().splitlines()]
               for r in range(3)}  # fmt: skip
    for r in range(3):
        again = torch.load(tmp_path / f"at{STEPS}_{r}.pt")
        assert again["step"] == STEPS and again["global_step"] == finals[r]["global_step"]
        for key in ("params", "inner", "outer"):
            torch.testing.assert_close(again[key], finals[r][key], atol=0, rtol=0, msg=lambda m: f"{r} {key}: {m}")
        assert resumed[r][1]["manager_step"] == records[r][-1]["manager_step"] + 1  # + the join's commit

    # One replica alone leaves and rejoins (REJOINER ends its fit at LEAVE_AT, mid round STEPS + H, and resumes its
    # checkpoint of the round end STEPS while the others run on): its torchft step is theirs, so it heals nothing; it
    # joins their round end with w = 0 and takes the round's step from the all-reduce (S_t / S_w), then contributes.
    fields = ("step", "contributors", "participants", "healed", "committed", "contributed")
    rows = [(CKPT_AT, 0, 3, False, True, False), (STEPS, 3, 3, False, True, True), (STEPS + H, 2, 3, False, True, True),
            (STEPS2, 3, 3, False, True, True)]  # fmt: skip
    for r, recs in resumed.items():
        want = [row if r != REJOINER or row[0] != STEPS + H else row[:-1] + (False,) for row in rows]
        assert [tuple(rec[k] for k in fields) for rec in recs] == want, (r, recs)
    assert [rec["phase"] for rec in resumed[REJOINER]] == ["resumed", "resumed", "rejoined", "rejoined"]
    assert len({recs[-1]["manager_step"] for recs in resumed.values()}) == 1  # one torchft history again
    for s in (STEPS + H, STEPS2):
        contributors[s] = [(r, rec["life"]) for r, recs in resumed.items() for rec in recs
                           if rec["step"] == s and rec["contributed"]]  # fmt: skip
    expected = _reference(contributors, STEPS2)
    ends = {r: torch.load(tmp_path / (f"final{r}.rejoined.pt" if r == REJOINER else f"final{r}.resumed.pt"))
            for r in range(3)}  # fmt: skip
    for r, end in ends.items():
        assert end["step"] == STEPS2
        torch.testing.assert_close(end["params"], expected, atol=1e-5, rtol=0, msg=lambda m: f"replica {r}: {m}")
    rejoiner_at = torch.load(tmp_path / f"at{STEPS}_{REJOINER}.pt")
    assert ends[REJOINER]["global_step"] == rejoiner_at["global_step"] + H  # it trained the last round only
