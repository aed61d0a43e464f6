"""Tiers 1-2: the delayed-gradient family (``spectrain``, ``ddg``, ``features_replay``) on the pipeline executor.

One 3-rank gloo world (fork-launched once for the module) trains the same 7-layer network with each schedule, one
batch (window) at a time as the strategy does, and drains; rank 0 also runs each schedule as a one-stage pipeline.
The references below are written here, in plain torch, from each rule alone (PipeDream's timing: stage ``s`` runs
micro-batch ``k``'s forward after ``v = max(0, k-K+s+1)`` updates and its backward after ``k``, updates in order):

* SpecTrain: forward and backward of ``k`` on ``ŵ = W_s(v) − (k−v)·lr·V_s(v)`` (``V`` SGD's momentum buffer);
* DDG: forward on ``W_s(v)``, backward by hand through the stored layer inputs with the current ``W_s(k)``;
* features replay: forward on ``W_s(v)`` keeping the stage's input, backward = the stage recomputed on that input
  with ``W_s(k)``, the delayed gradient pulled back through it.
"""

from contextlib import contextmanager, nullcontext

import pytest
import torch
from _delayed_reference import LR, MU, make_net, momentum_sgd, reference
import torch.distributed as dist
from _ranks import run_ranks
from torch import nn
from torch.func import functional_call

from lightning_pdist.core.accounting import CommMeter
from lightning_pdist.pipeline.delayed import replay_backward
from lightning_pdist.pipeline.executor import StageExecutor
from lightning_pdist.pipeline.p2p import P2P
from lightning_pdist.pipeline.schedule import build_schedule, validate
from lightning_pdist.pipeline.spectrain import check_momentum, predicted_weights, staleness

M, BATCHES, B = 4, 3, 8
K = 3
BOUNDS = [(0, 2), (2, 4), (4, 7)]
CASES = ("spectrain", "ddg", "features_replay")


def make_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCHES, B, 4, generator=g), torch.randn(BATCHES, B, 2, generator=g)


def microbatches():
    xs, ys = make_data()
    return [(x, y) for t in range(BATCHES) for x, y in zip(xs[t].tensor_split(M), ys[t].tensor_split(M))]


# --- the stages on real processes ---------------------------------------------------------------------------


def run_case(rank, world, schedule):
    net = make_net()
    a, b = BOUNDS[rank] if world > 1 else (0, 7)
    stage = nn.Sequential(*[net[i] for i in range(a, b)])
    xs, ys = make_data()
    optimizer = torch.optim.SGD(stage.parameters(), lr=LR, momentum=MU)
    current = {}

    def loss_fn(j, forward):
        return nn.functional.mse_loss(forward(current["x"].tensor_split(M)[j % M]), current["y"].tensor_split(M)[j % M])

    executor = StageExecutor(
        stage, rank, world, schedule, P2P(None, meter=CommMeter()),
        prev_rank=rank - 1 if rank > 0 else None, next_rank=rank + 1 if rank < world - 1 else None,
        input_fn=lambda j: current["x"].tensor_split(M)[j % M], loss_fn=loss_fn, update_fn=optimizer.step,
        weight_predictor=lambda params, s: predicted_weights(params, optimizer, s),
    )  # fmt: skip
    for t in range(BATCHES):
        current["x"], current["y"] = xs[t], ys[t]
        executor.admit(M)
        executor.run()
    executor.run(draining=True)
    return {"params": [p.detach().clone() for p in stage.parameters()], "max_versions": executor.max_versions,
            "drained": executor.drained, "pending": executor.p2p.pending}  # fmt: skip


def _worker(rank, world, out):
    torch.set_num_threads(1)
    results = {case: run_case(rank, world, case) for case in CASES}
    if rank == 0:  # the same schedules as one-stage pipelines (no neighbours, no staleness)
        results["one_stage"] = {case: run_case(0, 1, case) for case in CASES}
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.barrier()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("delayed")
    run_ranks(_worker, K, out, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(K)]


# --- tests ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_each_rule_equals_its_plain_torch_reference(world, case):
    """3 stages on 3 gloo ranks end where the rule's one-process reference ends (stage by stage)."""
    expected = reference(case, BOUNDS, microbatches())
    for s in range(K):
        assert world[s][case]["drained"] and world[s][case]["pending"] == 0
        for got, want in zip(world[s][case]["params"], expected[s]):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_one_stage_is_momentum_sgd(world, case):
    """With one stage every staleness is 0: SpecTrain predicts ŵ = w, DDG and features replay are backprop."""
    for got, want in zip(world[0]["one_stage"][case]["params"], momentum_sgd(microbatches())):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_the_rules_differ_from_each_other_and_from_backprop(world):
    """Three different trajectories on stage 0 (the stalest), none of them backprop's."""
    flat = {c: torch.cat([p.reshape(-1) for p in world[0][c]["params"]]) for c in CASES}
    sgd = torch.cat([p.reshape(-1) for p in momentum_sgd(microbatches())[:2]])
    for a in CASES:
        assert (flat[a] - sgd).abs().max() > 1e-4
        for b in CASES:
            assert a == b or (flat[a] - flat[b]).abs().max() > 1e-6


@pytest.mark.parametrize("case", CASES)
def test_weight_copies_alive_equal_the_simulated_stash_depth(world, case):
    """Distinct weight storages measured on each stage equal validate()'s depth: SpecTrain one predicted copy per
    stale micro-batch in flight plus the weights, DDG and features replay 1."""
    depth = validate(build_schedule(case, K, M, BATCHES)).stash_depth
    assert tuple(world[s][case]["max_versions"] for s in range(K)) == depth
    assert depth == {"spectrain": (4, 3, 1), "ddg": (1, 1, 1), "features_replay": (1, 1, 1)}[case]
    assert validate(build_schedule(case, K, M, BATCHES)).max_in_flight == (3, 2, 1)


def test_staleness_is_the_backwards_still_to_run():
    """s = j − b: 0 on the last stage and at the first forward, K−1−k in the steady state of stage k."""
    for s_stage, expected in ((0, [0, 1, 2, 2, 2]), (2, [0, 0, 0, 0, 0])):
        program = build_schedule("spectrain", 3, 5).programs[s_stage]
        backwarded, seen = 0, []
        for a in program:
            if a.kind == "F":
                seen.append(staleness(a.microbatch, backwarded))
            backwarded += a.kind == "B"
        assert seen == expected


def test_prediction_is_w_minus_s_lr_v_and_needs_momentum():
    """ŵ = w − s·lr·v from the optimizer's buffer (w before the first step); optimizers without one are refused."""
    layer = nn.Linear(2, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5, momentum=0.9)
    params = dict(layer.named_parameters())
    torch.testing.assert_close(predicted_weights(params, opt, 3)["weight"], layer.weight.detach())
    layer(torch.ones(1, 2)).sum().backward()
    opt.step()
    v = opt.state[layer.weight]["momentum_buffer"]
    torch.testing.assert_close(predicted_weights(params, opt, 3)["weight"], layer.weight.detach() - 1.5 * v)
    check_momentum(opt, "PipelineStrategy")
    with pytest.raises(ValueError, match=r"PipelineStrategy\(schedule='spectrain'\): SGD has momentum=0 in param group 0; "
                                         r"SpecTrain predicts the weights"):  # fmt: skip
        check_momentum(torch.optim.SGD(layer.parameters(), lr=0.1), "PipelineStrategy")
    with pytest.raises(ValueError, match=r"PipelineStrategy\(schedule='spectrain'\): the optimizer is Adam; .*momentum > 0"):
        check_momentum(torch.optim.Adam(layer.parameters()), "PipelineStrategy")
    with pytest.raises(ValueError, match="needs a weight_predictor"):
        StageExecutor(layer, 0, 1, "spectrain", P2P(None), None, None, None, None, opt.step)


def test_replay_rewinds_the_random_stream_and_equals_backprop():
    """Features replay of a stage with dropout, on the forward's weights, draws the forward's mask: same gradients,
    also when called under inference mode (Lightning's validation loop drains the pipeline there)."""
    stage = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Tanh())
    x, delta = torch.randn(3, 4), torch.randn(3, 8)
    rng = torch.get_rng_state()
    direct_x = x.clone().requires_grad_()
    stage(direct_x).backward(delta)
    weights = {n: p.detach().clone().requires_grad_() for n, p in stage.named_parameters()}
    torch.randn(5)  # the stream moves on; the replay rewinds it

    @contextmanager
    def rewound():
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(rng)
            yield

    after = torch.get_rng_state()
    with torch.inference_mode():  # a drain inside Lightning's evaluation loop: the replay still records its graph
        g_in = replay_backward(lambda leaf, w: functional_call(stage, w, (leaf,)), x, weights, delta, rewound, nullcontext)
    assert torch.equal(torch.get_rng_state(), after)
    torch.testing.assert_close(g_in, direct_x.grad)
    for n, p in stage.named_parameters():
        torch.testing.assert_close(weights[n].grad, p.grad)
