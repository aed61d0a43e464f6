"""Tiers 1-2: synthetic gradients (DNI, ``synthetic_gradients=True``, the schedule machinery's ``dni``) on the executor.

One 3-rank gloo world (fork-launched once for the module) trains the 7-layer network of ``_delayed_reference`` under
DNI, one batch (window) at a time as the strategy does, then drains (with the default normalised synthetic modules,
with ``normalize=False``, and conditioned on labels: cDNI); the same world also runs every stage's
synthetic module replaced by an *oracle* that returns the true gradient (a copy of the stages above it, stepped as
they are), which must be backprop exactly; rank 0 also runs DNI as a one-stage pipeline. Checked against the
plain-torch reference in ``tests/_dni_reference.py`` at 1e-6, and against the simulator's depths.
"""

import pytest
import torch
import torch.distributed as dist
from _delayed_reference import LR, MU, make_net, momentum_sgd
from _dni_reference import dni_reference
from _ranks import run_ranks
from torch import nn

from lightning_pdist.core.accounting import CommMeter
from lightning_pdist.pipeline.config import PipelineConfig
from lightning_pdist.pipeline.dni import SyntheticGradient, class_labels
from lightning_pdist.pipeline.executor import StageExecutor
from lightning_pdist.pipeline.p2p import P2P
from lightning_pdist.pipeline.schedule import build_schedule, validate
from lightning_pdist.pipeline.strategy import PipelineStrategy

M, BATCHES, B, K = 4, 3, 8, 3
BOUNDS = [(0, 2), (2, 4), (4, 7)]
SYNTH_LR = 0.1


def synthetic_optimizer(params):
    return torch.optim.Adam(params, lr=SYNTH_LR)


C = 3  # cDNI: classes of the labels (how many of y's two targets are positive)


def labels():
    return [(y > 0).sum(1) for _, y in microbatches()]


def microbatches():
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(BATCHES, B, 4, generator=g), torch.randn(BATCHES, B, 2, generator=g)
    return [(x, y) for t in range(BATCHES) for x, y in zip(xs[t].tensor_split(M), ys[t].tensor_split(M))]


class Oracle(SyntheticGradient):
    """Predicts the true ``dL/dh``: a copy of the stages above, trained by momentum SGD on the same micro-batches."""

    def __init__(self, first_layer):
        super().__init__()
        self.above = nn.Sequential(*list(make_net())[first_layer:])
        self.opt = torch.optim.SGD(self.above.parameters(), lr=LR, momentum=MU)
        self.labels = [y for _, y in microbatches()]
        self.worst = 0.0  # largest |target − prediction| seen by train()
        self.predicted = []

    def predict(self, h):
        h = h.detach().requires_grad_()
        self.opt.zero_grad()
        nn.functional.mse_loss(self.above(h), self.labels[len(self.predicted)]).backward()
        self.opt.step()
        self.predicted.append(h.grad)
        return h.grad

    def train(self, h, target):
        self.worst = max(self.worst, float((target - self.predicted[self.steps]).abs().max()))
        self.steps += 1
        return 0.0


def run_case(rank, world, case):
    net = make_net()
    a, b = BOUNDS[rank] if world > 1 else (0, 7)
    stage = nn.Sequential(*[net[i] for i in range(a, b)])
    optimizer = torch.optim.SGD(stage.parameters(), lr=LR, momentum=MU)
    synthetic = (None if b == 7 else Oracle(b) if case == "oracle"
                 else SyntheticGradient(optimizer_factory=synthetic_optimizer, normalize=case != "raw",
                                        num_classes=C if case == "cdni" else None))  # fmt: skip
    ys = labels()
    mbs = microbatches()
    executor = StageExecutor(
        stage, rank, world, "dni", P2P(None, meter=CommMeter()),
        prev_rank=rank - 1 if rank > 0 else None, next_rank=rank + 1 if rank < world - 1 else None,
        input_fn=lambda j: mbs[j][0], loss_fn=lambda j, forward: nn.functional.mse_loss(forward(mbs[j][0]), mbs[j][1]),
        update_fn=optimizer.step, synthetic=synthetic, label_fn=lambda j: ys[j],
    )  # fmt: skip
    for _ in range(BATCHES):
        executor.admit(M)
        executor.run()
    executor.run(draining=True)
    synth = executor.synthetic
    return {"params": [p.detach().clone() for p in stage.parameters()], "drained": executor.drained,
            "pending": executor.p2p.pending, "max_versions": executor.max_versions, "max_held": executor.max_held,
            "synth": [p.detach().clone() for p in synth.module.parameters()] if case in ("dni", "raw", "cdni") and synth else None,
            "state": executor.state_dict(), "worst": synth.worst if case == "oracle" and synth else 0.0}  # fmt: skip


def _worker(rank, world, out):
    torch.set_num_threads(1)
    results = {case: run_case(rank, world, case) for case in ("dni", "raw", "cdni", "oracle")}
    if rank == 0:
        results["one_stage"] = run_case(0, 1, "dni")
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.barrier()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("dni")
    run_ranks(_worker, K, out, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(K)]


@pytest.mark.parametrize("case", ["dni", "raw", "cdni"])
def test_three_stages_equal_the_plain_torch_reference_and_the_simulator(world, case):
    """DNI on 3 gloo ranks ends where the reference ends (stage weights and synthetic modules), normalised (the
    default), not, and conditioned on the labels (cDNI: ``M([h/‖h‖, onehot(y)])``, each label column learned); the
    stages are drained, hold one weight version and at most the simulated micro-batches; stage 0 moved, not as
    backprop."""
    conditioned = dict(labels=labels(), num_classes=C) if case == "cdni" else {}
    weights, synth = dni_reference(BOUNDS, microbatches(), LR, MU, synthetic_optimizer, normalize=case != "raw", **conditioned)
    stats = validate(build_schedule("dni", K, M, BATCHES))
    assert stats.stash_depth == (1, 1, 1) and stats.max_in_flight == (2, 2, 1)
    for s in range(K):
        got = world[s][case]
        assert got["drained"] and got["pending"] == 0
        assert (got["max_versions"], got["max_held"]) == (stats.stash_depth[s], stats.max_in_flight[s])
        for g, w in zip(got["params"], weights[s]):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
        for g, w in zip(got["synth"] or [], synth[s] if s < K - 1 else []):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
        assert (got["state"].get("synthetic") is not None) == (s < K - 1)
    first = torch.cat([p.reshape(-1) for p in world[0][case]["params"]])
    init = torch.cat([p.detach().reshape(-1) for p in list(make_net().parameters())[:2]])
    sgd = torch.cat([p.reshape(-1) for p in momentum_sgd(microbatches())[:2]])
    assert (first - init).abs().max() > 1e-4 and (first - sgd).abs().max() > 1e-4
    assert world[0][case]["synth"][0].abs().max() > 0  # the zero-initialised module learned
    assert (world[0][case]["state"]["synthetic"]["scale"] > 0) == (case != "raw")
    if case == "cdni":  # Linear(8 + C, 8): every label's column moved
        assert world[0][case]["synth"][0].shape == (8, 8 + C) and (world[0][case]["synth"][0][:, 8:].abs().amax(0) > 0).all()


def test_true_gradient_in_place_of_the_prediction_is_backprop(world):
    """With an oracle for every M_s, each stage's DNI update is backprop's: all end at momentum SGD, and every
    target a stage receives equals what its oracle predicted (the bootstrapped target is then the true gradient)."""
    expected = momentum_sgd(microbatches())
    got = [p for s in range(K) for p in world[s]["oracle"]["params"]]
    for g, w in zip(got, expected):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
    assert max(world[s]["oracle"]["worst"] for s in range(K)) < 1e-6


def test_one_stage_is_momentum_sgd(world):
    """One stage has no boundary: no synthetic module, plain momentum SGD."""
    for g, w in zip(world[0]["one_stage"]["params"], momentum_sgd(microbatches())):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)


def test_the_simulated_timeline_has_no_backward_chain():
    """Each stage's B j follows its F j; S j waits only for stage s+1's B j: the ramp is the whole bubble."""
    stats = validate(build_schedule("dni", 3, 4))
    assert stats.drawing.splitlines()[0] == "stage 0 | F0 B0 F1 B1 F2 B2 F3 B3 .. .."
    assert stats.makespan == 10 and validate(build_schedule("pipedream", 3, 4)).makespan > 10
    assert build_schedule("dni", 2, 3).to_text().splitlines()[1] == "0F0 0B0 0U0 0F1 0B1 0U1 0S0 0F2 0B2 0U2 0S1 0S2"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(synthetic_gradients=True), ValueError, r"\(synthetic_gradients=True\): schedule='1f1b': DNI updates each "
                                                      r"stage right after its forward.*not '1f1b', which updates once per batch"),
        (dict(schedule="ddg", synthetic_gradients=True), ValueError, r"schedule='ddg': .*whose backward waits for stage s\+1"),
        (dict(schedule="pipedream", synthetic_module=nn.Linear), ValueError,
         r"\(synthetic_module=<class .*Linear'>\): synthetic_module configures .* only synthetic_gradients=True has"),
        (dict(schedule="pipedream", synthetic_gradients=True, synthetic_optimizer="adam"), TypeError,
         r"\(synthetic_optimizer='adam'\): synthetic_optimizer must be a factory"),
        (dict(schedule="pipedream", synthetic_normalize=False), ValueError,
         r"\(synthetic_normalize=False\): synthetic_normalize configures .* only synthetic_gradients=True has"),
        (dict(schedule="pipedream", synthetic_gradients=True, synthetic_normalize=1), TypeError,
         r"\(synthetic_normalize=1\): synthetic_normalize must be True or False"),
        (dict(schedule="pipedream", synthetic_gradients="yes"), TypeError, r"\(synthetic_gradients='yes'\): synthetic_gradients must be True or False"),
        (dict(schedule="pipedream", synthetic_gradients=True, vertical_sync=True), ValueError,
         r"vertical_sync=True\): vertical sync applies to schedule='pipedream', not 'dni'"),
        (dict(schedule="pipedream", synthetic_gradients=True, weight_stashing=False), ValueError,
         r"weight_stashing=False\): .*with synthetic_gradients=True keeps no weight stash"),
        (dict(schedule="pipedream", synthetic_gradients=True, nonfinite="skip_step"), ValueError, r"skip_step needs every rank"),
        (dict(schedule="pipedream", synthetic_conditioning="labels"), ValueError,
         r"\(synthetic_conditioning='labels'\): synthetic_conditioning configures .* only synthetic_gradients=True has"),
        (dict(schedule="pipedream", synthetic_gradients=True, synthetic_conditioning="label"), ValueError,
         r"\(synthetic_conditioning='label'\): synthetic_conditioning must be None \(DNI\) or 'labels'"),
        (dict(schedule="pipedream", synthetic_gradients=True, synthetic_num_classes=10), ValueError,
         r"\(synthetic_num_classes=10\): synthetic_num_classes is the one-hot width of synthetic_conditioning='labels'"),
        (dict(schedule="pipedream", synthetic_gradients=True, synthetic_conditioning="labels", synthetic_num_classes=1),
         ValueError, r"\(synthetic_num_classes=1\): synthetic_num_classes must be >= 2"),
    ],
)  # fmt: skip
def test_bad_combinations_are_refused_at_construction(kwargs, error, match):
    """Each combination DNI cannot honour names the argument, its value and the rule."""
    with pytest.raises(error, match=match):
        PipelineStrategy(**kwargs)


def test_replicas_wrong_modules_and_missing_pieces_are_refused():
    """Replicated stages (refused once the world is known), a factory that is not a module or predicts the wrong
    shape (at the first boundary), an executor without its synthetic module."""
    config = PipelineConfig(num_stages=2, schedule="pipedream", synthetic_gradients=True)
    assert config.spec.name == "dni" and config.schedule == "pipedream"
    config.check_world_size(2)
    with pytest.raises(ValueError, match=r"\(synthetic_gradients=True\): 4 processes for 2 stages make 2 replicas"):
        config.check_world_size(4)
    h = torch.randn(3, 5)
    with pytest.raises(TypeError, match=r"synthetic_module=...\): the factory returned Tensor, not an nn.Module"):
        SyntheticGradient(lambda h: h).predict(h)
    with pytest.raises(RuntimeError, match=r"maps a boundary activation of shape \(3, 5\) to \(3, 2\); it must predict dL/dh"):
        SyntheticGradient(lambda h: nn.Linear(5, 2)).predict(h)
    with pytest.raises(TypeError, match=r"synthetic_optimizer=...\): the factory returned list"):
        SyntheticGradient(optimizer_factory=list).predict(h)
    with pytest.raises(ValueError, match=r"schedule='dni'\): stage 0 needs a synthetic-gradient module"):
        StageExecutor(nn.Linear(2, 2), 0, 2, "dni", P2P(None), None, 1, None, None, lambda: None)
    with pytest.raises(ValueError, match=r"stage=0\): its synthetic module is conditioned on labels and no label_fn"):
        StageExecutor(nn.Linear(2, 2), 0, 2, "dni", P2P(None), None, 1, None, None, lambda: None,
                      synthetic=SyntheticGradient(num_classes=3))  # fmt: skip


@pytest.mark.parametrize(
    "batch, match",
    [
        (torch.zeros(4, 2), r"cannot see the targets in a Tensor batch.*the batch's last element \(a tuple or list "
                            r"batch\) or its 'labels' entry \(a dict batch\)"),
        ({"input_ids": torch.zeros(4, 2)}, r"cannot see the targets in a dict batch with keys \['input_ids'\]"),
        ((torch.zeros(4, 2), torch.zeros(4, 2)), r"last element of a tuple batch is a tensor of shape \(4, 2\) not 1-D"),
        ((torch.zeros(4, 2), torch.zeros(4)), r"shape \(4,\) of dtype torch.float32, not an integer type"),
        ([torch.zeros(4, 2), torch.tensor([0, 1, 3, 2])], r"holding 0..3, outside \[0, 3\); the targets must be class indices"),
    ],
)  # fmt: skip
def test_cdni_refuses_a_batch_whose_targets_are_not_class_indices(batch, match):
    """cDNI's labels: a batch without visible targets, or targets that are not 1-D integer class indices in [0, C),
    are refused naming the rule; a dict's 'labels' and a tuple's last element are taken; a module without
    num_classes is refused at setup unless synthetic_num_classes is given."""
    with pytest.raises(ValueError, match=match):
        class_labels(batch, 3)
    assert torch.equal(class_labels({"labels": torch.tensor([2, 0])}, 3), torch.tensor([2, 0]))
    assert torch.equal(class_labels((torch.zeros(2, 5), torch.tensor([1, 2])), 3), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"\(synthetic_conditioning='labels', synthetic_num_classes=None\): the labels' "
                                         r"one-hot needs the number of classes, and Linear has no hparams.num_classes"):
        strategy = PipelineStrategy(schedule="pipedream", synthetic_gradients=True, synthetic_conditioning="labels")
        strategy._lightning_module = nn.Linear(2, 2)
        strategy._conditioning_classes()
    given = PipelineStrategy(schedule="pipedream", synthetic_gradients=True, synthetic_conditioning="labels",
                             synthetic_num_classes=4)  # fmt: skip
    assert given._conditioning_classes() == 4


def test_default_module_is_zero_and_its_state_round_trips():
    """The default M is a zero linear map (ĝ = 0 at first) with Adam(lr=1e-4), trained on the target over its rms
    σ; a state loaded before the first boundary waits for it, and a trained module's prediction (and σ) come back
    exactly."""
    h, target = torch.randn(4, 6), torch.randn(4, 6)
    first = SyntheticGradient()
    assert torch.equal(first.predict(h), torch.zeros(4, 6))
    assert isinstance(first.optimizer, torch.optim.Adam) and first.optimizer.param_groups[0]["lr"] == 1e-4
    losses = [first.train(h, target) for _ in range(3)]
    assert first.scale == pytest.approx(float(target.pow(2).mean().sqrt()))
    assert losses[0] == pytest.approx(0.5 * target.numel()) and losses[2] < losses[0]  # ½‖0 − δ/σ‖² = ½·numel
    second = SyntheticGradient()
    second.load_state_dict(first.state_dict())
    torch.testing.assert_close(second.predict(h), first.predict(h), atol=0, rtol=0)
    assert second.train(h, target) == first.train(h, target) and second.scale == first.scale


def test_normalised_prediction_neither_overshoots_nor_grows_with_the_activation():
    """The measured cause of DNI's blow-up on the digits CNN: after one Adam step on a wide non-negative boundary
    (ReLU features) and a small true gradient, ``ĝ = M(h)`` overshoots the target many times over and scales with
    ``h``; ``σ·M(h/‖h‖)`` stays below the target's size and is the same for ``1000·h``."""
    g = torch.Generator().manual_seed(0)
    h, delta = torch.rand(8, 512, generator=g), 3e-3 * torch.randn(8, 512, generator=g)
    ratios = {}
    for normalize in (False, True):
        for lr in (1e-3, 1e-4):
            synthetic = SyntheticGradient(optimizer_factory=lambda p, lr=lr: torch.optim.Adam(p, lr=lr), normalize=normalize)
            synthetic.train(h, delta)
            g_hat = synthetic.predict(h)
            ratios[normalize, lr] = float(g_hat.norm() / delta.norm())
            big = synthetic.predict(1000 * h)
            if normalize:
                torch.testing.assert_close(big, g_hat, atol=1e-9, rtol=1e-5)
            else:  # h·A + b: the bias stays, the rest grows 1000-fold
                assert float(big.norm()) > 100 * float(g_hat.norm())
    assert ratios[False, 1e-3] > 10 and ratios[False, 1e-4] > 1  # lr·‖h‖₁ per element, against |δ| ≈ 3e-3
    assert ratios[True, 1e-3] < 1 and ratios[True, 1e-4] < 0.1


def test_a_packed_boundary_predicts_only_the_values_that_carry_a_gradient():
    """A ``split_points`` boundary is one packed vector: the hidden state (from weights) gets its own zero linear map,
    the ``-inf`` mask, the integer positions and the header get ĝ = 0 (no NaN), and the receiver detaches the mask."""
    from lightning_pdist.pipeline.ownership import gradient_parts, pack, unpack

    h = nn.Linear(3, 3)(torch.randn(2, 4, 3))
    mask = torch.full((4, 4), float("-inf")).triu(1)
    packed = pack(7, [h, mask, torch.arange(4)])
    n_head = int(packed[0])
    assert gradient_parts(packed) == [(n_head, (2, 4, 3))]
    key, (h2, mask2, pos2) = unpack(packed)
    assert key == 7 and h2.requires_grad and not mask2.requires_grad and pos2.dtype == torch.int64
    synthetic = SyntheticGradient(parts=gradient_parts)
    assert torch.equal(synthetic.predict(packed.detach()), torch.zeros_like(packed))
    target = torch.zeros_like(packed)
    target[n_head : n_head + h.numel()] = torch.randn(h.numel())
    for _ in range(3):
        synthetic.train(packed.detach(), target)
    g = synthetic.predict(packed.detach())
    assert [type(m).__name__ for m in synthetic.module] == ["Linear"] and synthetic.module[0].in_features == 3
    assert torch.isfinite(g).all() and g[n_head : n_head + h.numel()].abs().max() > 0
    assert g[:n_head].abs().max() == 0 and g[n_head + h.numel() :].abs().max() == 0
    with torch.no_grad():  # a forward without a graph cannot tell: every float value is marked
        assert len(gradient_parts(pack(0, [h, mask, torch.arange(4)]))) == 2
