"""Plain torch, one process: why the locking baseline is less stable than lock-free Hogwild! with SGD momentum.

Each Hogwild! process keeps its own optimizer state. Two ``SGD(momentum=0.9)`` optimizers stepping one tensor in
strict turns (the order the lock imposes) diverge on ``f = h·w²/2`` at ``lr·h = 0.3``, where one optimizer and two
that read the same weights before both write (lock-free processes in phase) converge; the lock around the read as
well (full serialisation) does not help. Edges: ``scripts/hogwild_lock_diagnosis.py --part quadratic``; the method
card (docs/algorithms/hogwild.md, "The locking baseline and momentum") says what it means for the benchmark.
"""

import pytest
import torch


def final_abs(a: float, schedule: str, writes: int = 2000, momentum: float = 0.9) -> float:
    """|w| after ``writes`` optimizer writes on ``f = w²/2`` (h = 1, lr = a) from w = 1; inf once it blew up."""
    w = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))
    opts = [torch.optim.SGD([w], lr=a, momentum=momentum) for _ in range(1 if schedule == "one" else 2)]

    def write(opt, read):
        opt.zero_grad()
        w.grad = read.clone()  # ∇f at the weights read
        opt.step()

    t = 0
    while t < writes:
        if schedule == "one":
            write(opts[0], w.detach())
            t += 1
        elif schedule == "alternating":  # each gradient at the current weights: serialised read-compute-write
            write(opts[t % 2], w.detach())
            t += 1
        else:  # paired: both processes read the same w, then both write
            read = w.detach().clone()
            write(opts[0], read)
            write(opts[1], read)
            t += 2
        if not torch.isfinite(w).all() or abs(w.item()) > 1e6:
            return float("inf")
    return abs(w.item())


@pytest.mark.parametrize("a, one, paired, alternating", [(0.15, True, True, True), (0.3, True, True, False),
                                                         (1.5, True, True, False), (2.2, True, False, False)])  # fmt: skip
def test_two_momentum_buffers_taking_turns_diverge_where_one_and_paired_converge(a, one, paired, alternating):
    for schedule, converges in (("one", one), ("paired", paired), ("alternating", alternating)):
        got = final_abs(a, schedule)
        assert (got < 1e-3) == converges, f"lr*h={a}, {schedule}: |w| = {got}"


def test_without_momentum_turns_are_sequential_sgd():
    """Momentum 0: alternating writes are plain sequential SGD (stable to lr·h = 2), paired writes a step of 2·lr."""
    assert final_abs(1.8, "alternating", momentum=0.0) < 1e-3
    assert final_abs(1.8, "paired", momentum=0.0) == float("inf")
