"""Tier 1: parameter-server rules (DC-ASGD, backup workers, SSP, staleness) against scripted arrival orders."""

import random

import pytest
import torch

from lightning_pdist.parameter_server.rules import (
    BackupWorkerAggregator,
    DelayCompensation,
    DroppedGradient,
    SSPClock,
    StalenessTracker,
    dc_asgd_gradient,
    gradient_staleness,
)

# ---- DC-ASGD -----------------------------------------------------------------------------------------


def test_dc_asgd_gradient_on_hand_computed_numbers():
    """g + λ·g·g·(w - w_bak) worked out by hand for two coordinates."""
    g, w, w_bak = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 3.0])
    # [1 + 0.5·1·1·1, 2 + 0.5·2·2·(-2)]
    torch.testing.assert_close(dc_asgd_gradient(g, w, w_bak, 0.5), torch.tensor([1.5, -2.0]))
    torch.testing.assert_close(dc_asgd_gradient(g, w, w_bak, 0.0), g)


def _problem(seed=0, workers=3, dim=5):
    """Per-worker least squares f_m(w) = ½‖A_m w − b_m‖²; returns gradient functions."""
    gen = torch.Generator().manual_seed(seed)
    mats = [(torch.randn(4, dim, generator=gen), torch.randn(4, generator=gen)) for _ in range(workers)]
    return [lambda w, a=a, b=b: a.T @ (a @ w - b) for a, b in mats]


# A scripted arrival order: worker 2 is slow, worker 0 fast; ("pull", m) then later ("push", m).
SCRIPT = [
    ("push", 0), ("pull", 0), ("push", 1), ("push", 0), ("pull", 1), ("pull", 0),
    ("push", 2), ("push", 0), ("pull", 2), ("push", 1), ("pull", 0), ("push", 0),
    ("pull", 1), ("push", 2), ("push", 1), ("pull", 2),
]  # fmt: skip


def _reference_dc_asgd(grads, w0, lr, lam, per_worker=True):
    """Plain torch: the server keeps w and one backup per worker (or one per key, MXNet style)."""
    w = w0.clone()
    local = {m: w0.clone() for m in range(3)}  # what each worker last pulled and computes on
    bak = {m: w0.clone() for m in range(3)}
    key_bak = w0.clone()  # MXNet: the weight before the last update
    history = []
    for event, m in SCRIPT:
        if event == "pull":
            local[m] = w.clone()
            bak[m] = w.clone()
            continue
        g = grads[m](local[m])
        backup = bak[m] if per_worker else key_bak
        key_bak = w.clone()
        w = w - lr * (g + lam * g * g * (w - backup))
        history.append(w.clone())
    return history


@pytest.mark.parametrize("lam", [0.0, 0.04, 0.5])
def test_delay_compensation_matches_reference_over_a_scripted_arrival_order(lam):
    """DelayCompensation + torch SGD on the server equals the per-worker-backup equations step by step."""
    grads, w0, lr = _problem(), torch.linspace(-1, 1, 5), 0.05
    expected = _reference_dc_asgd(grads, w0, lr, lam)
    server = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([server], lr=lr)
    dc = DelayCompensation.starting_from(server.detach(), num_workers=3, lam=lam)
    local = {m: w0.clone() for m in range(3)}
    got = []
    for event, m in SCRIPT:
        if event == "pull":
            local[m] = server.detach().clone()
            dc.record_pull(m, server.detach())
            continue
        server.grad = dc.compensate(m, grads[m](local[m]), server.detach())
        opt.step()
        got.append(server.detach().clone())
    assert len(got) == len(expected) == 9
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


def test_per_worker_backup_differs_from_mxnet_per_key_backup():
    """On the script, a per-key backup (MXNet's DCASGD) gives a different trajectory than per-worker backups."""
    grads, w0 = _problem(), torch.linspace(-1, 1, 5)
    per_worker = _reference_dc_asgd(grads, w0, 0.05, 0.5, per_worker=True)
    per_key = _reference_dc_asgd(grads, w0, 0.05, 0.5, per_worker=False)
    assert not torch.allclose(per_worker[-1], per_key[-1], atol=1e-5)


def test_delay_compensation_state_round_trips():
    """state_dict/load_state_dict restore every worker's backup as independent copies."""
    dc = DelayCompensation.starting_from(torch.zeros(3), num_workers=2, lam=0.1)
    dc.record_pull(1, torch.ones(3))
    other = DelayCompensation(num_workers=2, lam=0.0)
    other.load_state_dict(dc.state_dict())
    assert other.lam == 0.1 and torch.equal(other.backups[1], torch.ones(3))
    dc.backups[1].add_(5)
    assert torch.equal(other.backups[1], torch.ones(3))


def test_dc_asgd_bad_input():
    """Negative λ, wrong types, mismatched shapes and a push before any pull are refused."""
    x = torch.zeros(3)
    with pytest.raises(ValueError, match=r"dc_asgd_gradient\(lam=-0.1\): lam must be >= 0"):
        dc_asgd_gradient(x, x, x, -0.1)
    with pytest.raises(ValueError, match=r"DelayCompensation\(lam=nan\): lam must be >= 0"):
        DelayCompensation(num_workers=2, lam=float("nan"))
    with pytest.raises(TypeError, match=r"dc_asgd_gradient\(lam=True\): lam must be a float"):
        dc_asgd_gradient(x, x, x, True)
    with pytest.raises(TypeError, match=r"dc_asgd_gradient\(w_bak=list\): w_bak must be a torch.Tensor"):
        dc_asgd_gradient(x, x, [0.0], 0.1)
    with pytest.raises(ValueError, match=r"g=\(3,\), w=\(3,\), w_bak=\(2,\)\): g, w and w_bak must have the same shape"):
        dc_asgd_gradient(x, x, torch.zeros(2), 0.1)
    dc = DelayCompensation(num_workers=2, lam=0.1)
    with pytest.raises(RuntimeError, match=r"compensate\(worker=1\): worker 1 has never pulled"):
        dc.compensate(1, x, x)
    with pytest.raises(ValueError, match=r"record_pull\(worker=2\): worker must be in \[0, 2\)"):
        dc.record_pull(2, x)


# ---- backup workers ----------------------------------------------------------------------------------


def _grad(worker, step):
    return torch.full((3,), float(10 * step + worker)) + torch.arange(3.0)


def test_backup_workers_apply_first_n_minus_b_and_drop_the_rest():
    """N=4, b=1: each step closes on its third arrival; the straggler and an early push are dropped by step id."""
    agg = BackupWorkerAggregator(num_workers=4, backup_workers=1)
    order = [(2, 0), (0, 0), (3, 0), (1, 0), (1, 1), (0, 2), (3, 1), (2, 1), (0, 1), (1, 0)]
    results = [agg.push(m, t, _grad(m, t)) for m, t in order]
    closed = [i for i, r in enumerate(results) if r is not None]
    assert closed == [2, 7]
    torch.testing.assert_close(results[2], torch.stack([_grad(2, 0), _grad(0, 0), _grad(3, 0)]).mean(0))
    torch.testing.assert_close(results[7], torch.stack([_grad(1, 1), _grad(3, 1), _grad(2, 1)]).mean(0))
    assert agg.last_contributors == (1, 3, 2)
    assert agg.dropped == (
        DroppedGradient(worker=1, step=0, open_step=1),
        DroppedGradient(worker=0, step=2, open_step=1),
        DroppedGradient(worker=0, step=1, open_step=2),
        DroppedGradient(worker=1, step=0, open_step=2),
    )
    assert [d.reason for d in agg.dropped] == ["late", "early", "late", "late"]
    assert agg.step == 2 and agg.num_dropped == 4
    assert agg.drain_dropped()[0].worker == 1 and agg.dropped == () and agg.num_dropped == 4


def test_no_backup_workers_waits_for_everyone():
    """b=0 returns nothing until all N gradients of the step arrived, then their plain mean."""
    agg = BackupWorkerAggregator(num_workers=3)
    assert agg.push(1, 0, _grad(1, 0)) is None
    assert agg.push(0, 0, _grad(0, 0)) is None
    assert agg.arrived == (1, 0)
    mean = agg.push(2, 0, _grad(2, 0))
    torch.testing.assert_close(mean, (_grad(0, 0) + _grad(1, 0) + _grad(2, 0)) / 3)
    assert agg.num_dropped == 0 and agg.step == 1


def test_backup_aggregation_is_deterministic_for_a_given_order():
    """The same random arrival order gives bitwise-identical means and the same drops."""
    rng = random.Random(3)
    events = [(rng.randrange(5), rng.randrange(4), torch.randn(8, generator=torch.Generator().manual_seed(i))) for i in range(60)]

    def run():
        agg = BackupWorkerAggregator(num_workers=5, backup_workers=2)
        outs = []
        for m, t, g in events:
            if t == agg.step and m in agg.arrived:
                continue  # the script may repeat a worker; a real worker pushes once per step
            outs.append(agg.push(m, t, g))
        return outs, agg.dropped

    (a, da), (b, db) = run(), run()
    assert da == db and len(a) == len(b)
    assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))
    assert any(x is not None for x in a)


def test_backup_aggregator_state_round_trips_between_steps_only():
    """state_dict carries the open step and drop count; mid-step it refuses, naming the held workers."""
    agg = BackupWorkerAggregator(num_workers=2, backup_workers=1)
    agg.push(0, 0, _grad(0, 0))
    agg.push(1, 0, _grad(1, 0))  # dropped late
    restored = BackupWorkerAggregator(num_workers=2, backup_workers=1)
    restored.load_state_dict(agg.state_dict())
    assert (restored.step, restored.num_dropped) == (1, 1)
    full = BackupWorkerAggregator(num_workers=2)
    full.push(1, 0, _grad(1, 0))
    with pytest.raises(RuntimeError, match=r"step 0 holds gradients of workers \[1\]; take the state between steps"):
        full.state_dict()


def test_backup_aggregator_bad_input():
    """backup_workers outside [0, N-1], bad workers, double pushes and shape changes are refused."""
    with pytest.raises(ValueError, match=r"\(num_workers=4, backup_workers=4\): backup_workers must be in \[0, num_workers - 1\] = \[0, 3\]"):
        BackupWorkerAggregator(num_workers=4, backup_workers=4)
    with pytest.raises(ValueError, match=r"backup_workers=-1\): backup_workers must be in"):
        BackupWorkerAggregator(num_workers=4, backup_workers=-1)
    with pytest.raises(ValueError, match=r"BackupWorkerAggregator\(num_workers=0\): num_workers must be >= 1"):
        BackupWorkerAggregator(num_workers=0)
    agg = BackupWorkerAggregator(num_workers=3)
    with pytest.raises(ValueError, match=r"push\(worker=3\): worker must be in \[0, 3\)"):
        agg.push(3, 0, _grad(0, 0))
    agg.push(0, 0, _grad(0, 0))
    with pytest.raises(ValueError, match=r"push\(worker=0, step=0\): worker 0 already pushed a gradient for step 0"):
        agg.push(0, 0, _grad(0, 0))
    with pytest.raises(ValueError, match=r"push\(worker=1, grad=\(2,\)\): grad must have the step's shape \(3,\)"):
        agg.push(1, 0, torch.zeros(2))


# ---- SSP -----------------------------------------------------------------------------------------------


def test_ssp_gating_sequence_with_staleness_one():
    """s=1: a worker runs one clock ahead of the slowest and then waits for exactly the laggards."""
    ssp = SSPClock(num_workers=3, staleness=1)
    assert ssp.may_start(0) and ssp.advance(0) == 1
    assert ssp.may_start(0) and ssp.advance(0) == 2
    assert not ssp.may_start(0) and ssp.waiting_for(0) == (1, 2)
    ssp.advance(1)
    assert not ssp.may_start(0) and ssp.waiting_for(0) == (2,)
    ssp.advance(2)
    assert ssp.may_start(0) and ssp.min_clock == 1
    assert ssp.may_start(1, clock=2) and not ssp.may_start(1, clock=3)


def test_ssp_staleness_zero_is_lockstep_bsp():
    """s=0: nobody starts clock c+1 until everyone finished c."""
    ssp = SSPClock(num_workers=2, staleness=0)
    ssp.advance(1)
    assert not ssp.may_start(1) and ssp.may_start(0)
    ssp.advance(0)
    assert ssp.may_start(1) and ssp.clocks == [1, 1]


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_ssp_random_schedule_matches_reference_gate(staleness):
    """Random attempts: may_start equals clock - min(clocks) <= s, and the spread never exceeds s + 1."""
    rng = random.Random(staleness)
    ssp = SSPClock(num_workers=4, staleness=staleness)
    clocks = [0, 0, 0, 0]
    for _ in range(400):
        m = rng.choices(range(4), weights=[5, 3, 2, 1])[0]  # worker 0 is fastest
        allowed = clocks[m] - min(clocks) <= staleness
        assert ssp.may_start(m) == allowed
        if allowed:
            clocks[m] += 1
            ssp.advance(m)
        assert max(clocks) - min(clocks) <= staleness + 1
    assert ssp.clocks == clocks


def test_ssp_retired_worker_releases_the_others():
    """A dead or finished worker no longer holds back the gate; asking for it afterwards is an error."""
    ssp = SSPClock(num_workers=2, staleness=0)
    ssp.advance(0)
    assert not ssp.may_start(0)
    ssp.retire(1)
    assert ssp.may_start(0) and ssp.waiting_for(0) == ()
    with pytest.raises(RuntimeError, match=r"may_start\(worker=1\): worker 1 has retired"):
        ssp.may_start(1)
    restored = SSPClock(num_workers=2)
    restored.load_state_dict(ssp.state_dict())
    assert restored.clocks == [1, 0] and restored.retired == {1} and restored.staleness == 0


def test_ssp_bad_input():
    """Negative or non-int staleness, bad workers, stale clocks and advancing a gated worker are refused."""
    with pytest.raises(ValueError, match=r"SSPClock\(staleness=-1\): staleness must be >= 0"):
        SSPClock(num_workers=2, staleness=-1)
    with pytest.raises(TypeError, match=r"SSPClock\(staleness=1.5\): staleness must be an int"):
        SSPClock(num_workers=2, staleness=1.5)
    ssp = SSPClock(num_workers=2)
    with pytest.raises(ValueError, match=r"may_start\(worker=5\): worker must be in \[0, 2\)"):
        ssp.may_start(5)
    ssp.advance(0)
    with pytest.raises(ValueError, match=r"may_start\(worker=0, clock=0\): clock must be >= the worker's clock 1"):
        ssp.may_start(0, clock=0)
    with pytest.raises(RuntimeError, match=r"advance\(worker=0\): worker 0 at clock 1 may not have started it: workers \[1\]"):
        ssp.advance(0)


# ---- staleness -----------------------------------------------------------------------------------------


def test_staleness_tracker_on_a_scripted_order():
    """Three workers pull v0, push in turn: staleness 0, 1, 2; a fresh pull resets it."""
    tracker = StalenessTracker(num_workers=3)
    assert [tracker.record_apply(m) for m in (0, 1, 2)] == [0, 1, 2]
    assert tracker.record_pull(0) == 3
    assert tracker.record_apply(1) == 3  # worker 1 still on v0, server at v3
    assert tracker.record_apply(0) == 1
    restored = StalenessTracker(num_workers=3)
    restored.load_state_dict(tracker.state_dict())
    assert restored.version == 5 and restored.pulled == {0: 3, 1: 0, 2: 0}


def test_gradient_staleness_rule_and_bad_input():
    """τ = applied - pulled; a pull from the future or a negative version is refused."""
    assert gradient_staleness(7, 4) == 3 and gradient_staleness(2, 2) == 0
    with pytest.raises(ValueError, match=r"applied_version=3, pulled_version=4\): versions must satisfy 0 <= pulled_version <= applied_version"):
        gradient_staleness(3, 4)
    with pytest.raises(TypeError, match=r"gradient_staleness\(pulled_version=1.0\): pulled_version must be an int"):
        gradient_staleness(3, 1.0)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: SSPClock(num_workers=2.0), TypeError, r"SSPClock\(num_workers=2.0\): num_workers must be an int"),
        (lambda: SSPClock(num_workers=2, clocks=[0, 0, 0]), ValueError, r"clocks must hold one entry per worker \(2\)"),
        (lambda: SSPClock(num_workers=2).may_start(0, clock=1.0), TypeError, r"may_start\(clock=1.0\): clock must be an int or None"),
        (lambda: StalenessTracker(num_workers=2).record_pull(True), TypeError, r"record_pull\(worker=True\): worker must be an int"),
        (lambda: BackupWorkerAggregator(num_workers=2, backup_workers=0.5), TypeError, r"backup_workers=0.5\): .*must be an int"),
        (lambda: BackupWorkerAggregator(num_workers=2, step=-1), ValueError, r"step=-1\): step must be an int >= 0"),
        (lambda: BackupWorkerAggregator(num_workers=2).push(0, "0", torch.zeros(1)), TypeError, r"push\(step='0'\): step must be an int"),
        (lambda: BackupWorkerAggregator(num_workers=2).push(0, 0, [1.0]), TypeError, r"push\(grad=list\): grad must be a torch.Tensor"),
    ],
)
def test_remaining_bad_types_and_values_are_refused(call, error, match):
    """Every other raise: non-int counts, workers and steps, a clocks list of the wrong length, a negative step."""
    with pytest.raises(error, match=match):
        call()


def test_one_worker_server_reduces_to_the_local_optimizer():
    """One worker that pulls after every push: aggregator mean is its gradient, DC-ASGD adds nothing, SGD results."""
    grad_fn, w0, lr = _problem(workers=1)[0], torch.linspace(-1, 1, 5), 0.05
    server = w0.clone()
    agg = BackupWorkerAggregator(num_workers=1)
    dc = DelayCompensation.starting_from(server, num_workers=1, lam=0.7)
    tracker = StalenessTracker(num_workers=1)
    local = w0.clone()
    for step in range(5):
        g = grad_fn(server)
        mean = agg.push(0, step, g)
        assert torch.equal(mean, g)
        server = server - lr * dc.compensate(0, mean, server)
        assert tracker.record_apply(0) == 0
        dc.record_pull(0, server)
        tracker.record_pull(0)
        local = local - lr * grad_fn(local)
        torch.testing.assert_close(server, local, rtol=0, atol=0)
