"""Tier 1: sharding plans reproduce algorithms-reference.md A6 for VGG-16 and own every element exactly once."""

import json
import math
import random

import pytest
import torch
from torch import nn

from lightning_pdist.parameter_server.sharding import (
    BYTEPS_PARTITION_BYTES,
    ParamSlice,
    ParamSpec,
    ShardingPlan,
    param_specs,
    plan_sharding,
)
from lightning_pdist.models.vgg import vgg16

VGG16_PARAMS = 138_357_544


@pytest.fixture(scope="module")
def vgg_specs():
    return param_specs(vgg16(device="meta"))


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    # six layers of uneven sizes; never run forward, only sharded
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.Conv1d(3, 2, 2), nn.Linear(2, 4), nn.Linear(4, 3))


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _assert_tiles(ranges, total):
    """Sorted ranges must run from 0 to total with no gap and no overlap."""
    pos = 0
    for lo, hi in sorted(ranges):
        assert lo == pos and hi > lo, (lo, hi, pos)
        pos = hi
    assert pos == total


# ---- A6 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sharding, num_servers, max_params",
    [
        ("layer", 1, 138_357_544),
        ("layer", 2, 109_438_912),
        ("layer", 4, 105_751_360),
        ("memory", 1, 138_357_544),
        ("memory", 2, 69_178_772),
        ("memory", 4, 34_589_386),
    ],
)
def test_vgg16_max_server_load_matches_reference_table(vgg_specs, sharding, num_servers, max_params):
    """The most loaded server holds exactly A6's number of VGG-16 parameters (4 bytes each)."""
    plan = plan_sharding(vgg_specs, num_servers, sharding)
    assert plan.numel == VGG16_PARAMS
    assert plan.max_numel == max_params
    assert plan.max_bytes == 4 * max_params
    assert plan.mean_bytes == 4 * VGG16_PARAMS / num_servers
    assert plan.imbalance == pytest.approx(max_params / (VGG16_PARAMS / num_servers))


def test_vgg16_layer_plan_keeps_layers_whole_and_fc6_is_the_bottleneck(vgg_specs):
    """Under layer sharding each weight sits with its bias, and fc6's server is the most loaded one."""
    plan = plan_sharding(vgg_specs, 4, "layer")
    for spec in vgg_specs:
        if spec.name.endswith(".weight"):
            assert plan.owner_of(spec.name) == plan.owner_of(spec.layer + ".bias")
    fc6 = plan.owner_of("classifier.fc6.weight")
    assert plan.bytes_per_server[fc6] == plan.max_bytes
    assert plan.imbalance == pytest.approx(3.057, abs=1e-3)


@pytest.mark.parametrize("num_servers", [1, 2, 4])
def test_vgg16_byteps_partitions_are_dealt_round_robin(vgg_specs, num_servers):
    """4,096,000-byte partitions of the flat vector go to server p mod S; loads match a count by hand."""
    plan = plan_sharding(vgg_specs, num_servers, partition_bytes=BYTEPS_PARTITION_BYTES)
    total = 4 * VGG16_PARAMS
    parts = math.ceil(total / BYTEPS_PARTITION_BYTES)
    assert parts == 136
    expected = [0] * num_servers
    for p in range(parts):
        expected[p % num_servers] += min(BYTEPS_PARTITION_BYTES, total - p * BYTEPS_PARTITION_BYTES)
    assert list(plan.bytes_per_server) == expected
    assert sum(len(plan.server_slices(s)) for s in range(num_servers)) == parts


# ---- coverage ------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_servers", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("sharding, partition_bytes", [("layer", None), ("memory", None), ("memory", 4_096_000)])
def test_vgg16_slices_tile_the_flat_vector(vgg_specs, sharding, num_servers, partition_bytes):
    """The servers' flat ranges cover [0, d) with no gap or overlap, and byte ranges cover [0, 4d)."""
    plan = plan_sharding(vgg_specs, num_servers, sharding, partition_bytes)
    _assert_tiles([r for s in range(num_servers) for r in plan.server_slices(s)], VGG16_PARAMS)
    _assert_tiles([r for s in range(num_servers) for r in plan.byte_ranges(s)], 4 * VGG16_PARAMS)
    assert sum(plan.numel_per_server) == VGG16_PARAMS


@pytest.mark.parametrize("num_servers", [1, 2, 3, 5])
@pytest.mark.parametrize("sharding, partition_bytes", [("layer", None), ("memory", None), ("memory", 8), ("memory", 36)])
def test_every_element_owned_once_and_gather_scatter_round_trip(sharding, num_servers, partition_bytes):
    """Ownership counts are all one, indices match gather, and scattering every shard rebuilds the vector."""
    model = _tiny_model()
    plan = plan_sharding(model, num_servers, sharding, partition_bytes)
    flat = _flat(model)
    counts = torch.zeros(flat.numel(), dtype=torch.int64)
    rebuilt = torch.zeros_like(flat)
    for server in range(num_servers):
        idx = plan.server_indices(server)
        counts[idx] += 1
        shard = plan.gather(flat, server)
        assert torch.equal(shard, flat[idx])
        assert shard.numel() == plan.numel_per_server[server]
        plan.scatter_(rebuilt, server, shard)
    assert torch.equal(counts, torch.ones_like(counts))
    assert torch.equal(rebuilt, flat)


@pytest.mark.parametrize("sharding", ["layer", "memory"])
def test_param_slices_address_the_same_elements_as_flat_ranges(sharding):
    """Each (name, start, stop) slice of a parameter equals the flat vector at the slice's offset."""
    model = _tiny_model()
    plan = plan_sharding(model, 3, sharding)
    flat, params = _flat(model), dict(model.named_parameters())
    for server in range(3):
        for piece in plan.param_slices(server):
            lo, hi = piece.flat_range
            assert torch.equal(params[piece.name].detach().reshape(-1)[piece.start : piece.stop], flat[lo:hi])


def test_memory_ranges_are_contiguous_ceil_d_over_s():
    """Without partitions server s owns the one range [s*ceil(d/S), min(d, (s+1)*ceil(d/S)))."""
    specs = [ParamSpec("a", 10, 4, "l"), ParamSpec("b", 13, 4, "m")]  # d = 23
    plan = plan_sharding(specs, 4)
    assert [plan.server_slices(s) for s in range(4)] == [((0, 6),), ((6, 12),), ((12, 18),), ((18, 23),)]
    assert plan.owners_of("a") == (0, 1) and plan.owners_of("b") == (1, 2, 3)


def test_mixed_element_sizes_split_by_bytes():
    """With fp16 and fp32 tensors the cut runs over bytes: an element goes to the range holding its first byte."""
    specs = [ParamSpec("h", 6, 2, "x"), ParamSpec("f", 4, 4, "y")]  # bytes: h [0, 12), f [12, 28)
    plan = plan_sharding(specs, 2)  # c = 4 * ceil(28 / 8) = 16 B
    assert plan.byte_ranges(0) == ((0, 16),) and plan.byte_ranges(1) == ((16, 28),)
    assert plan.server_slices(0) == ((0, 7),) and plan.bytes_per_server == (16, 12)
    half = nn.Linear(3, 2).to(torch.float16)
    assert [s.element_size for s in param_specs(half)] == [2, 2]


def test_layer_greedy_matches_argmin_reference_on_random_layers():
    """Random layer sizes: each layer's server is the argmin of loads so far, ties to the lowest index."""
    rng = random.Random(5)
    specs = []
    for i in range(30):
        specs.append(ParamSpec(f"l{i}.weight", rng.choice([1, 5, 5, 40, 300]), 4, f"l{i}"))
        if rng.random() < 0.5:
            specs.append(ParamSpec(f"l{i}.bias", rng.randint(1, 9), 4, f"l{i}"))
    plan = plan_sharding(specs, 4, "layer")
    loads = [0, 0, 0, 0]
    for i in range(30):
        layer_bytes = sum(s.nbytes for s in specs if s.layer == f"l{i}")
        target = loads.index(min(loads))
        loads[target] += layer_bytes
        assert plan.owner_of(f"l{i}.weight") == target
    assert list(plan.bytes_per_server) == loads


# ---- values ------------------------------------------------------------------------------------------


def test_plans_are_comparable_hashable_values(vgg_specs):
    """Plans built twice from the same input are equal and hash alike; a different S or strategy is not."""
    a = plan_sharding(vgg_specs, 4, "layer")
    b = plan_sharding(list(vgg_specs), 4, "layer")
    assert a == b and hash(a) == hash(b)
    assert a != plan_sharding(vgg_specs, 2, "layer")
    assert a != plan_sharding(vgg_specs, 4, "memory")
    assert plan_sharding(vgg16(device="meta"), 4, "layer") == a


def test_plan_prints_a_per_server_table(vgg_specs):
    """str() shows the header, one row per server with its layers, and max/mean/imbalance; repr summarises."""
    text = str(plan_sharding(vgg_specs, 4, "layer"))
    lines = text.splitlines()
    assert lines[0].startswith("ShardingPlan(sharding='layer', num_servers=4): 32 tensors in 16 layers")
    assert len(lines) == 2 + 4 + 1
    assert "105,751,360" in lines[3] and "classifier.fc6" in lines[3] and "76.4%" in lines[3]
    assert lines[-1] == "max 423,005,440 B (105,751,360 elements), mean 138,357,544 B, imbalance max/mean 3.057"
    memory = plan_sharding(vgg_specs, 2, partition_bytes=BYTEPS_PARTITION_BYTES)
    assert "68 partitions: [0, 1,024,000), [2,048,000, 3,072,000), ..." in str(memory)
    assert "imbalance=1.007" in repr(memory) and "slices=" in repr(memory)
    assert json.loads(json.dumps(memory.summary()))["bytes_per_server"] == [278_528_000, 274_902_176]


def test_param_specs_follow_registration_order_and_skip_shared_parameters():
    """param_specs lists parameters in registration order with their owning module, tied weights once."""
    emb = nn.Embedding(4, 3)
    model = nn.Sequential(emb, nn.Linear(3, 3), nn.Linear(3, 4, bias=False))
    tied = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False))
    tied[1].weight = tied[0].weight
    assert [(s.name, s.layer, s.numel) for s in param_specs(model)] == [
        ("0.weight", "0", 12),
        ("1.weight", "1", 9),
        ("1.bias", "1", 3),
        ("2.weight", "2", 12),
    ]
    assert [s.name for s in param_specs(tied)] == ["0.weight"]


def test_zero_size_parameter_gets_an_owner():
    """An empty tensor gets an empty slice on a server, so owner_of still answers for it."""
    specs = [ParamSpec("a", 4, 4, "x"), ParamSpec("empty", 0, 4, "y"), ParamSpec("b", 4, 4, "z")]
    for sharding in ("layer", "memory"):
        plan = plan_sharding(specs, 2, sharding)
        assert plan.owner_of("empty") in (0, 1)
        assert plan.numel_per_server == (4, 4)


# ---- errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_servers=0), ValueError, r"plan_sharding\(num_servers=0\): num_servers must be >= 1"),
        (dict(num_servers=2.0), TypeError, r"plan_sharding\(num_servers=2.0\): num_servers must be an int"),
        (dict(num_servers=2, sharding="bytes"), ValueError, r"sharding='bytes'\): sharding must be one of 'layer', 'memory'"),
        (dict(num_servers=2, partition_bytes=0), ValueError, r"partition_bytes=0\): partition_bytes must be >= 1"),
        (dict(num_servers=2, partition_bytes=6), ValueError, r"partition_bytes=6\): .* multiple of the largest element size, 4 B"),
        (
            dict(num_servers=2, sharding="layer", partition_bytes=8),
            ValueError,
            r"partition_bytes=8\): partition_bytes applies only to sharding='memory'",
        ),
    ],
)
def test_bad_arguments_name_argument_value_and_rule(kwargs, error, match):
    """Each bad argument raises the right error type with the argument, its value and the rule."""
    with pytest.raises(error, match=match):
        plan_sharding(_tiny_model(), **kwargs)


def test_layer_with_more_servers_than_layers_names_the_empty_servers(vgg_specs):
    """18 servers for VGG-16's 16 layers: the error names servers 16 and 17 and the layer count."""
    with pytest.raises(
        ValueError,
        match=r"plan_sharding\(num_servers=18, sharding='layer'\): the model has 16 layers \(32 parameter tensors\), "
        r"so servers \[16, 17\] would be empty; under 'layer' sharding num_servers must be <= 16",
    ):
        plan_sharding(vgg_specs, 18, "layer")


def test_zero_byte_layer_that_leaves_a_server_empty_is_refused():
    """A zero-byte layer gives greedy nothing to balance; the empty server is named."""
    specs = [ParamSpec("a", 4, 4, "x"), ParamSpec("e", 0, 4, "y"), ParamSpec("b", 4, 4, "z")]
    with pytest.raises(ValueError, match=r"num_servers=3, sharding='layer'\).*servers \[2\] would be empty"):
        plan_sharding(specs, 3, "layer")


def test_memory_plans_that_leave_a_server_empty_are_refused():
    """ceil(9/4) = 3-element ranges leave server 3 empty; one partition cannot feed two servers."""
    with pytest.raises(ValueError, match=r"9 elements in ranges of ceil\(9/4\) = 3 leave servers \[3\] empty"):
        plan_sharding([ParamSpec("a", 9)], 4)
    with pytest.raises(ValueError, match=r"partition_bytes=4096000\): 36 B make 1 partition\(s\), leaving servers \[1\]"):
        plan_sharding([ParamSpec("a", 9)], 2, partition_bytes=4_096_000)


def test_bad_specs_are_refused():
    """Repeated names, empty models, non-spec entries and bad spec fields raise with the rule."""
    with pytest.raises(ValueError, match=r"parameter names must be unique, \['a'\] repeat"):
        plan_sharding([ParamSpec("a", 2), ParamSpec("a", 3)], 1)
    with pytest.raises(ValueError, match=r"parameters must hold at least one element"):
        plan_sharding([ParamSpec("a", 0)], 1)
    with pytest.raises(TypeError, match=r"specs must hold ParamSpec values"):
        plan_sharding([("a", 3)], 1)
    with pytest.raises(ValueError, match=r"ParamSpec\(numel=-1\): numel must be >= 0"):
        ParamSpec("a", -1)
    with pytest.raises(ValueError, match=r"ParamSpec\(element_size=0\): element_size must be >= 1"):
        ParamSpec("a", 1, 0)
    with pytest.raises(TypeError, match=r"ParamSpec\(numel=2.5\): numel must be an int"):
        ParamSpec("a", 2.5)
    with pytest.raises(TypeError, match=r"param_specs\(module=list\): module must be a torch.nn.Module"):
        param_specs([])


def test_hand_built_plan_with_a_gap_or_overlap_is_refused():
    """ShardingPlan checks that its slices cover each parameter once, in flat order."""
    specs = (ParamSpec("a", 4), ParamSpec("b", 2))
    good = (ParamSlice(0, "a", 0, 4, 0, 0), ParamSlice(1, "b", 0, 2, 4, 1))
    assert ShardingPlan("memory", 2, specs, good).numel_per_server == (4, 2)
    gap = (ParamSlice(0, "a", 0, 3, 0, 0), ParamSlice(1, "b", 0, 2, 4, 1))
    with pytest.raises(ValueError, match=r"does not continue a at element 3"):
        ShardingPlan("memory", 2, specs, gap)
    missing = (ParamSlice(0, "a", 0, 4, 0, 0),)
    with pytest.raises(ValueError, match=r"b\[0:2\] is owned by no server"):
        ShardingPlan("memory", 2, specs, missing)
    bad_server = (ParamSlice(0, "a", 0, 4, 0, 0), ParamSlice(2, "b", 0, 2, 4, 1))
    with pytest.raises(ValueError, match=r"server outside \[0, 2\)"):
        ShardingPlan("memory", 2, specs, bad_server)


def test_lookups_and_data_moves_check_their_arguments():
    """Unknown names, split parameters, bad servers and wrong-length vectors raise with the rule."""
    plan = plan_sharding([ParamSpec("a", 4), ParamSpec("b", 2)], 2)
    with pytest.raises(ValueError, match=r"owners_of\(name='c'\): name must be one of the plan's 2 parameters"):
        plan.owners_of("c")
    with pytest.raises(ValueError, match=r"owner_of\(name='a'\): a is split across servers \[0, 1\]"):
        plan.owner_of("a")
    with pytest.raises(ValueError, match=r"server_slices\(server=2\): server must be in \[0, 2\)"):
        plan.server_slices(2)
    with pytest.raises(ValueError, match=r"gather\(flat=\(5,\)\): flat must be a vector of the plan's 6 elements"):
        plan.gather(torch.zeros(5), 0)
    with pytest.raises(ValueError, match=r"scatter_\(server=0, shard=\(2,\)\): shard must be a vector of the server's 3"):
        plan.scatter_(torch.zeros(6), 0, torch.zeros(2))


def _two_server_plan():
    return plan_sharding([ParamSpec("a", 4), ParamSpec("b", 2)], 2)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: ParamSpec(3, 1), TypeError, r"ParamSpec\(name=3\): name must be a str"),
        (lambda: ParamSpec("", 1), ValueError, r"ParamSpec\(name=''\): name must be non-empty"),
        (lambda: plan_sharding([ParamSpec("a", 4)], 1, sharding=None), TypeError, r"sharding=None\): sharding must be a str"),
        (lambda: plan_sharding([ParamSpec("a", 4)], 1, partition_bytes=4.0), TypeError, r"partition_bytes=4.0\): .*int or None"),
        (lambda: ShardingPlan("memory", 1, (ParamSpec("a", 1),), ((0, "a", 0, 1, 0, 0),)), TypeError, r"slices must hold ParamSlice"),
        (lambda: ShardingPlan("memory", 1, (ParamSpec("a", 1), ParamSpec("a", 1)), ()), ValueError, r"\['a'\] repeat"),
        (
            lambda: ShardingPlan("memory", 1, (ParamSpec("a", 1),), (ParamSlice(0, "a", 0, 1, 0, 0), ParamSlice(0, "z", 0, 1, 1, 0))),
            ValueError,
            r"slice ParamSlice\(.*name='z'.*\) is beyond the last parameter",
        ),
        (lambda: _two_server_plan().param_slices("0"), TypeError, r"param_slices\(server='0'\): server must be an int"),
        (lambda: _two_server_plan().gather([0.0] * 6, 0), TypeError, r"gather\(flat=list\): flat must be a torch.Tensor"),
        (lambda: _two_server_plan().scatter_(torch.zeros(6), 0, [0.0] * 3), TypeError, r"scatter_\(shard=list\): shard must be a"),
    ],
)
def test_remaining_bad_types_and_values_are_refused(call, error, match):
    """Every other raise in the module: wrong types, empty names, repeated names, trailing slices."""
    with pytest.raises(error, match=match):
        call()
