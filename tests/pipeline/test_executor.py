"""Tier 2: pipeline stages on real gloo processes (2 and 3 stages) against plain-torch references.

Each world is fork-launched once (module-scoped fixture) and trains the same small network with every
schedule, one batch (window) at a time as the strategy does, then drains. The references
(``tests/_pipeline_reference.py``) are written from the update rules alone: gradient accumulation for
the flushed schedules, a closed-form version rule for PipeDream (stage ``s`` runs mini-batch ``k`` on its
weights after ``max(0, k-K+s+1)`` updates), and ``W(t+1) = W(t) - lr·∇f(W(t-1))`` for 2BW.
"""

import _delayed_reference as delayed_reference
import _pipeline_reference as reference
import pytest
import torch
import torch.distributed as dist
from _ranks import run_ranks
from torch import nn

from lightning_pdist.pipeline.schedule import Action, build_schedule, validate
from lightning_pdist.core.accounting import CommMeter
from lightning_pdist.pipeline.executor import StageExecutor
from lightning_pdist.pipeline.p2p import P2P

LR = 0.1
M = 4  # micro-batches per batch
BATCHES = 5
B = 8  # samples per batch
SPLITS = {2: [(0, 4), (4, 7)], 3: [(0, 2), (2, 4), (4, 7)]}
CASES = ("gpipe", "1f1b", "pipedream", "pipedream_vs", "pipedream_nostash", "2bw", "1f1b_postahead", "pipedream_postahead")


def make_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def make_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCHES, B, 4, generator=g), torch.randn(BATCHES, B, 2, generator=g)


def stage_of(net, K, s):
    a, b = SPLITS[K][s]
    return nn.Sequential(*[net[i] for i in range(a, b)])


def run_case(rank, K, case):
    schedule = case.split("_")[0]
    net = make_net()
    stage = stage_of(net, K, rank)
    xs, ys = make_data()
    optimizer = torch.optim.SGD(stage.parameters(), lr=LR)
    meter = CommMeter()
    current = {}

    def input_fn(j):
        return current["x"].tensor_split(M)[j % M]

    def loss_fn(j, forward):
        return nn.functional.mse_loss(forward(current["x"].tensor_split(M)[j % M]), current["y"].tensor_split(M)[j % M])

    executor = StageExecutor(
        stage, rank, K, schedule, P2P(None, meter=meter, post_ahead=case.endswith("_postahead")),
        prev_rank=rank - 1 if rank > 0 else None, next_rank=rank + 1 if rank < K - 1 else None,
        input_fn=input_fn, loss_fn=loss_fn, update_fn=optimizer.step,
        weight_stashing=case != "pipedream_nostash", vertical_sync=case == "pipedream_vs",
    )  # fmt: skip
    max_pending = 0
    for t in range(BATCHES):
        current["x"], current["y"] = xs[t], ys[t]
        executor.admit(M)
        executor.run()
        max_pending = max(max_pending, executor.p2p.pending)
    executor.run(draining=True)
    return {
        "params": [p.detach().clone() for p in stage.parameters()],
        "max_versions": executor.max_versions,
        "bytes": meter.total_bytes,
        "drained": executor.drained,
        "max_pending": max_pending,
        "pending_after_drain": executor.p2p.pending,
        "posted_after_drain": executor.p2p.posted,
    }


def _worker(rank, K, out):
    torch.set_num_threads(1)
    results = {case: run_case(rank, K, case) for case in CASES}
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.barrier()


def launch(K, out):
    run_ranks(_worker, K, out, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(K)]


@pytest.fixture(scope="module", params=[2, 3], ids=["K2", "K3"])
def world(request, tmp_path_factory):
    K = request.param
    return K, launch(K, tmp_path_factory.mktemp(f"pipe{K}"))


# --- references (tests/_pipeline_reference.py, plain torch, one process) -------------------------------------


def stage_params(net, K):
    return [[p.detach().clone() for p in stage_of(net, K, s).parameters()] for s in range(K)]


def reference_accumulation(K):
    xs, ys = make_data()
    return stage_params(reference.accumulation(make_net(), [[(xs[t], ys[t])] for t in range(BATCHES)], M, LR), K)


def reference_pipedream(K, vertical_sync=False):
    xs, ys = make_data()
    mbs = [(x, y) for t in range(BATCHES) for x, y in zip(xs[t].tensor_split(M), ys[t].tensor_split(M))]
    return stage_params(reference.pipedream(make_net(), SPLITS[K], mbs, LR, vertical_sync), K)


def reference_2bw(K):
    xs, ys = make_data()
    return stage_params(reference.two_bw(make_net(), [(xs[t], ys[t]) for t in range(BATCHES)], M, LR), K)


def assert_stages(results, case, expected):
    for s, exp in enumerate(expected):
        for got, want in zip(results[s][case]["params"], exp):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


# --- tests ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["gpipe", "1f1b", "1f1b_postahead"])
def test_flushed_schedules_equal_gradient_accumulation(world, case):
    """GPipe and 1F1B on K gloo ranks equal one-process SGD with gradients accumulated over the micro-batches."""
    K, results = world
    assert_stages(results, case, reference_accumulation(K))


def test_pipedream_with_stashing_equals_the_asynchronous_reference(world):
    """PipeDream (stash on) equals the one-process simulation where each backward uses its forward's weights."""
    K, results = world
    assert_stages(results, "pipedream", reference_pipedream(K))


def test_vertical_sync_uses_the_input_stages_version(world):
    """With vertical sync every stage runs mini-batch k on the input stage's version max(0, k-K+1)."""
    K, results = world
    assert_stages(results, "pipedream_vs", reference_pipedream(K, vertical_sync=True))


def test_without_stashing_the_gradients_differ(world):
    """Turning stashing off (backward on the newest weights) leaves the asynchronous reference behind."""
    K, results = world
    expected = reference_pipedream(K)
    got = torch.cat([p.reshape(-1) for p in results[0]["pipedream_nostash"]["params"]])
    want = torch.cat([p.reshape(-1) for p in expected[0]])
    assert (got - want).abs().max() > 1e-4
    assert K == 1 or not torch.allclose(got, want)


def test_without_stashing_the_backward_is_ddgs(world):
    """No stashing = DDG's rule (the delayed gradient through the stored activations with the current weights): every
    micro-batch's gradient reaches an update, also those whose forward ran before the previous update."""
    K, results = world
    xs, ys = make_data()
    mbs = [(x, y) for t in range(BATCHES) for x, y in zip(xs[t].tensor_split(M), ys[t].tensor_split(M))]
    assert_stages(results, "pipedream_nostash", delayed_reference.reference("ddg", SPLITS[K], mbs, lr=LR, mu=0.0))


def test_2bw_follows_its_update_rule(world):
    """2BW equals W(t+1) = W(t) - lr * grad f(W(t-1)) on the whole network."""
    K, results = world
    assert_stages(results, "2bw", reference_2bw(K))


@pytest.mark.parametrize("case", CASES)
def test_weight_versions_alive_equal_the_schedules_stash_depth(world, case):
    """Distinct weight storages alive at once, measured on each stage, equal the depth validate() derives."""
    K, results = world
    name = case.split("_")[0]
    depth = validate(build_schedule(name, K, M, BATCHES, vertical_sync=case == "pipedream_vs")).stash_depth
    measured = tuple(results[s][case]["max_versions"] for s in range(K))
    assert measured == ((1,) * K if case == "pipedream_nostash" else depth)


def test_bytes_are_activations_and_gradients(world):
    """Each stage sends one frame (header + activation) per forward and one (header + gradient) per backward,
    plus one header-only frame per stream announcing the shape the first time."""
    K, results = world
    n = BATCHES * M
    header = 16 * 8
    mb = B // M
    for s in range(K):
        forward = header + (header + mb * 8 * 4) * n if s < K - 1 else 0
        backward = header + (header + mb * 8 * 4) * n if s > 0 else 0
        assert results[s]["gpipe"]["bytes"] == forward + backward
        assert results[s]["2bw"]["drained"]


@pytest.mark.parametrize("case", CASES)
def test_sends_are_released_as_the_peers_take_them(world, case):
    """Send buffers do not pile up across windows (gloo never reports them complete unwaited): at most the
    micro-batches still in flight per neighbour, and none after a drain."""
    K, results = world
    for s in range(K):
        assert results[s][case]["max_pending"] <= 2 * K, (s, results[s][case]["max_pending"])
        assert results[s][case]["pending_after_drain"] == 0


def test_dispatch_refuses_an_action_it_does_not_know():
    """The dispatch table names the action it cannot run (foreign stage, or a kind without a handler)."""
    executor = StageExecutor(nn.Sequential(nn.Linear(2, 2)), 0, 1, "gpipe", P2P(None), None, None, None, None, lambda: None)
    with pytest.raises(ValueError, match=r"cannot run action 1F0"):
        executor.dispatch(Action(1, "F", 0))
    del executor.handlers["U"]
    with pytest.raises(ValueError, match=r"cannot run action 0U0"):
        executor.dispatch(Action(0, "U", 0))


def _short_batch_worker(rank, K, out):
    import warnings

    net = make_net()
    stage = stage_of(net, K, rank)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    optimizer = torch.optim.SGD(stage.parameters(), lr=LR)
    executor = StageExecutor(
        stage, rank, K, "2bw", P2P(None), prev_rank=rank - 1 if rank > 0 else None, next_rank=rank + 1 if rank < K - 1 else None,
        input_fn=lambda j: x[:1], loss_fn=lambda j, forward: nn.functional.mse_loss(forward(x[:1]), y[:1]), update_fn=optimizer.step,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (4, 1, 4, 4):
            executor.admit(n)
            executor.run()
        executor.run(draining=True)
    torch.save([str(w.message) for w in caught], f"{out}/rank{rank}.pt")
    dist.barrier()


def test_2bw_warns_when_a_short_batch_breaks_the_delay(tmp_path):
    """A batch of fewer micro-batches than the pipeline holds forces a newer version: the stage says so, once."""
    run_ranks(_short_batch_worker, 3, tmp_path, str(tmp_path))
    messages = torch.load(tmp_path / "rank0.pt")
    assert len(messages) == 1 and "batch 2 runs on weight version 0, not 1" in messages[0], messages


def test_forward_context_wraps_forwards_and_not_backwards():
    """forward_context (the plugin's autocast) is entered around every forward and loss, and is off during backwards."""
    from contextlib import contextmanager

    net = nn.Sequential(nn.Linear(2, 2))
    x, y = torch.randn(4, 2), torch.randn(4, 2)
    seen = {"forwards": 0, "backward_autocast": []}

    @contextmanager
    def autocast():
        seen["forwards"] += 1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            seen["backward_autocast"].append(torch.is_autocast_cpu_enabled())
            return g

    def loss_fn(j, forward):
        return nn.functional.mse_loss(Probe.apply(forward(x.tensor_split(2)[j])).float(), y.tensor_split(2)[j])

    executor = StageExecutor(net, 0, 1, "gpipe", P2P(None), None, None, None, loss_fn, lambda: None, forward_context=autocast)
    executor.admit(2)
    executor.run()
    assert seen == {"forwards": 2, "backward_autocast": [False, False]}


def test_receives_posted_ahead_change_nothing_but_when_bytes_arrive(world):
    """``P2P(post_ahead=True)``: 1F1B still equals gradient accumulation (above), PipeDream with stashing still equals
    its reference, the bytes are the same, and no posted receive is left after a drain."""
    K, results = world
    assert_stages(results, "pipedream_postahead", reference_pipedream(K))
    for s in range(K):
        for case in ("1f1b", "pipedream"):
            assert results[s][f"{case}_postahead"]["bytes"] == results[s][case]["bytes"]
            assert results[s][f"{case}_postahead"]["posted_after_drain"] == 0
            assert results[s][f"{case}_postahead"]["pending_after_drain"] == 0
