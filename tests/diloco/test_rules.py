"""Tier 1: DiLoCo's math without processes: the outer step, the Nesterov/BMUF relation, the schedule, fragments,
quantization, and the refusals at construction."""

import itertools

import pytest
import torch
from torch import nn

from lightning_pdist import DiLoCoStrategy, StreamingDiLoCoStrategy
from lightning_pdist.diloco.fragments import StreamingSchedule, balanced_cuts, fragment_modules, fragment_tensors
from lightning_pdist.diloco.outer import OuterConfig, outer_step_
from lightning_pdist.diloco.quantize import code_bytes, dequantize, quantize


def _rounds(config, deltas):
    g = nn.Parameter(torch.zeros(3))
    opt = config.build(g)
    out = []
    for d in deltas:
        outer_step_(opt, g, d)
        out.append(g.detach().clone())
    return out


def _bmuf(deltas, eta, zeta, nesterov):
    """BMUF as lightning_pdist.averaging.bmuf writes it, with G = Δ: D ← ηD + ζG; A ← A − D (− ηD with NBM)."""
    a, d, out = torch.zeros(3), torch.zeros(3), []
    for g in deltas:
        d = eta * d + zeta * g
        a = a - d - (eta * d if nesterov else 0)
        out.append(a.clone())
    return out


def test_outer_step_is_torch_sgd_and_its_relation_to_bmuf():
    """The default outer step is SGD(0.7, 0.9, nesterov) on Δ; heavy ball equals BMUF's plain block momentum every
    round; Nesterov equals BMUF's NBM on the first round only, then BMUF moves η·D_old further each round."""
    deltas = [torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.3, 0.1, -1.0]), torch.tensor([2.0, 0.0, 1.0])]
    g, b = torch.zeros(3), torch.zeros(3)
    for got, d in zip(_rounds(OuterConfig(), deltas), deltas):
        b = 0.9 * b + d
        g = g - 0.7 * (d + 0.9 * b)
        torch.testing.assert_close(got, g)
    heavy = _rounds(OuterConfig("sgd", 0.8, 0.5), deltas)
    for x, y in zip(heavy, _bmuf(deltas, 0.5, 0.8, nesterov=False)):
        torch.testing.assert_close(x, y)
    nag, nbm = _rounds(OuterConfig("nesterov", 0.8, 0.5), deltas), _bmuf(deltas, 0.5, 0.8, nesterov=True)
    torch.testing.assert_close(nag[0], nbm[0])
    d0 = 0.8 * deltas[0]  # BMUF's D after round 1
    torch.testing.assert_close(nbm[1] - nag[1], -0.5 * d0)
    adam = _rounds(OuterConfig("torch.optim.Adam", 0.1, outer_kwargs={"betas": (0.5, 0.9)}), deltas[:1])
    torch.testing.assert_close(adam[0], -0.1 * torch.sign(deltas[0]), atol=1e-6, rtol=0)  # Adam's first step: lr·sign


def test_streaming_schedule_offsets_and_merges():
    s = StreamingSchedule(sync_every=6, num_fragments=3, overlap_steps=1)
    starts = {t: s.starts_after(t) for t in range(1, 13) if s.starts_after(t)}
    assert starts == {2: [1], 4: [2], 6: [0], 8: [1], 10: [2], 12: [0]}
    assert {t: s.merges_after(t) for t in range(1, 14) if s.merges_after(t)} == {t + 1: p for t, p in starts.items()}


def test_fragments_contiguous_layers_and_user_lists():
    net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Linear(3, 3), nn.Linear(3, 1))
    assert fragment_modules(net, 2, None, "X") == [["0", "1"], ["2", "3"]]
    assert fragment_modules(net, 3, None, "X") == [["0", "1"], ["2"], ["3"]]
    (p0, b0), (p1, b1) = fragment_tensors(net, [["0", "1"], ["2", "3"]])
    assert [t.shape for t in p0] == [(3, 2), (3,), (3,), (3,)] and len(b0) == 2 and b1 == [] and len(p1) == 4
    with pytest.raises(ValueError, match=r"X\(num_fragments=5\): the model has 4 layers with parameters; num_fragments must not exceed"):
        fragment_modules(net, 5, None, "X")
    with pytest.raises(ValueError, match=r"parameters \['3.weight', '3.bias'\] are in no fragment"):
        fragment_modules(net, 2, [["0", "1"], ["2"]], "X")
    with pytest.raises(ValueError, match=r"'9' is not a module name"):
        fragment_modules(net, 2, [["0", "9"], ["2", "3"]], "X")


def test_fragments_balanced_by_parameter_count():
    """Layers of 110, 11, 2 and 20 parameters: equal layer counts give 121 | 22; balanced by parameters, 110 | 33
    (the smallest largest block any contiguous cut allows), and every split is searched (checked by brute force)."""
    net = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 1), nn.Linear(1, 1), nn.Linear(1, 10))
    assert fragment_modules(net, 2, None, "X") == [["0", "1"], ["2", "3"]]
    assert fragment_modules(net, 2, None, "X", "params") == [["0"], ["1", "2", "3"]]
    assert fragment_modules(net, 4, None, "X", "params") == [["0"], ["1"], ["2"], ["3"]]
    sizes = [5, 1, 1, 1, 4, 4, 2, 7, 1, 3]
    for parts in range(1, len(sizes) + 1):
        lengths = balanced_cuts(sizes, parts)
        assert sum(lengths) == len(sizes) and len(lengths) == parts and min(lengths) >= 1
        ends = list(itertools.accumulate(lengths))
        largest = max(sum(sizes[a:b]) for a, b in zip([0, *ends], ends))
        brute = min(max(sum(sizes[a:b]) for a, b in zip([0, *cut], [*cut, len(sizes)]))
                    for cut in itertools.combinations(range(1, len(sizes)), parts - 1))  # fmt: skip
        assert largest == brute, (parts, lengths)


@pytest.mark.parametrize("fmt, qmax", [("int8", 127), ("int4", 7)])
def test_quantize_round_trip_error_and_bytes(fmt, qmax):
    torch.manual_seed(0)
    x = torch.randn(150)
    codes, scales = quantize(x, fmt)
    y = dequantize(codes, scales, fmt, x.numel())
    per_elem_scale = scales.repeat_interleave(64)[:150]
    assert ((y - x).abs() <= per_elem_scale / 2 + 1e-7).all()
    exact = torch.round(x / per_elem_scale).clamp(-qmax, qmax) * per_elem_scale  # multiples of the scale
    codes, scales2 = quantize(exact, fmt)
    torch.testing.assert_close(dequantize(codes, scales2, fmt, 150), exact, atol=1e-6, rtol=0)
    assert (codes.numel(), 4 * scales.numel()) == code_bytes(150, fmt) == ((192 if fmt == "int8" else 96), 12)


@pytest.mark.parametrize("kwargs, message", [
    ({"sync_every": 0}, r"\(sync_every=0\): sync_every must be an int >= 1"),
    ({"sync_every": 6, "num_fragments": 4}, r"\(num_fragments=4\): num_fragments must divide sync_every=6"),
    ({"sync_every": 6, "num_fragments": 2, "overlap_steps": 3}, r"\(overlap_steps=3\): overlap_steps must be an int with 0 <= overlap_steps < sync_every/num_fragments = 3"),
    ({"fragment_alpha": -0.1}, r"\(fragment_alpha=-0.1\): fragment_alpha must be a number in \[0, 1\]"),
    ({"fragment_alpha": 1.5}, r"\(fragment_alpha=1.5\): fragment_alpha must be a number in \[0, 1\]"),
    ({"quantize": "fp4"}, r"\(quantize='fp4'\): quantize must be None, 'int8' or 'int4'"),
    ({"fragments": [["a"], ["b"]], "num_fragments": 3}, r"\(num_fragments=3\): fragments lists 2 fragments"),
    ({"fragments": [[]]}, r"\(fragments=\[\[\]\]\): fragments must be a non-empty list of non-empty lists"),
    ({"balance": "bytes"}, r"\(balance='bytes'\): balance must be 'layers' \(equal numbers of layers\) or 'params'"),
    ({"fragments": [["a"], ["b"]], "balance": "params"}, r"\(balance='params'\): balance cuts num_fragments blocks"),
    ({"outer_lr": 0}, r"\(outer_lr=0\): outer_lr must be a finite number > 0"),
    ({"outer_momentum": 1.0}, r"\(outer_momentum=1.0\): outer_momentum must be a number in \[0, 1\)"),
    ({"outer_momentum": 0.0}, r"\(outer_momentum=0\): Nesterov momentum needs outer_momentum > 0"),
    ({"outer_optimizer": "torch.optim.Nope"}, r"\(outer_optimizer='torch.optim.Nope'\): outer_optimizer must be 'nesterov', 'sgd'"),
    ({"outer_optimizer": "torch.optim.Adam", "outer_kwargs": {"bogus": 1}}, r"\(outer_kwargs=\{'bogus': 1\}\): Adam refused them"),
])  # fmt: skip
def test_refusals_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=r"StreamingDiLoCoStrategy" + message):
        StreamingDiLoCoStrategy(**kwargs)


def test_diloco_refusals_name_its_class():
    with pytest.raises(ValueError, match=r"DiLoCoStrategy\(sync_every=-1\): sync_every must be an int >= 1"):
        DiLoCoStrategy(sync_every=-1)
    with pytest.raises(ValueError, match=r"DiLoCoStrategy\(ddp_comm_hook=.*must be left unset"):
        DiLoCoStrategy(ddp_comm_hook=lambda s, b: None)


@pytest.mark.parametrize("kwargs, message", [
    ({"fault_tolerant": "yes"}, r"\(fault_tolerant='yes'\): must be True or False"),
    ({"min_replicas": 0}, r"\(min_replicas=0\): must be an integer >= 1"),
    ({"ft_timeout": -1}, r"\(ft_timeout=-1\): must be a number of seconds in \(0, 1e6\)"),
    ({"lighthouse": "http://h:1"}, r"\(lighthouse='http://h:1'\): only used with fault_tolerant=True"),
    ({"replica_id": "r0"}, r"\(replica_id='r0'\): only used with fault_tolerant=True"),
    ({"fault_tolerant": True, "replica_id": "r0"}, r"\(lighthouse=None\): fault_tolerant=True needs the address"),
    ({"fault_tolerant": True, "lighthouse": "http://h:1"}, r"\(replica_id=None\): fault_tolerant=True needs one id"),
])  # fmt: skip
def test_fault_tolerance_refusals_at_construction(kwargs, message, monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    with pytest.raises(ValueError, match=r"DiLoCoStrategy" + message):
        DiLoCoStrategy(**kwargs)


def test_fault_tolerance_settings_default_to_torchfts_environment(monkeypatch):
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lighthouse:29510")
    monkeypatch.setenv("REPLICA_GROUP_ID", "3")
    assert DiLoCoStrategy(fault_tolerant=True).ft_settings == {
        "lighthouse": "http://lighthouse:29510", "replica_id": "3", "min_replicas": 1, "timeout": 60.0}
    assert DiLoCoStrategy().ft_settings is None


def test_fault_tolerance_refuses_a_lightning_world_of_several_processes():
    strategy = DiLoCoStrategy(fault_tolerant=True, lighthouse="http://h:1", replica_id="0")
    with pytest.raises(ValueError, match=r"DiLoCoStrategy\(fault_tolerant=True\): each process is one replica "
                                         r"\(devices=1, num_nodes=1\); this run has world_size=2"):
        strategy._setup_fault_tolerant(2)
