"""Surgery on the user's LightningModule for a pipeline: keep one stage's layers, call the rest remotely.

* :class:`StageSplit` cuts the module's ``nn.Sequential`` network (see
  :mod:`lightning_pdist.pipeline.partition`) and keeps only this stage's layers: the others
  move to the ``meta`` device (no memory) behind :class:`OnAnotherStage` placeholders, so the module's
  parameter names, ``state_dict`` keys and ``configure_optimizers`` see exactly this stage's part.
  :meth:`StageSplit.restore` puts every layer back (after ``fit``, every rank holds the whole model).
* :meth:`StageSplit.calling` swaps the network for a :class:`NetworkProxy` while a user hook runs:
  the hook calls ``self.net(x)`` as always and gets what the pipeline computed (the last stage), or
  hands ``x`` over (:class:`NetworkInput`, the first stage's way to learn the network's input).
* :func:`split_batch` cuts a batch into micro-batches along dimension 0.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_pdist.pipeline.partition import Partition, find_network, layer_times, list_layers, partition, split_by_names

__all__ = ["NetworkInput", "NetworkProxy", "OnAnotherStage", "StageSplit", "batch_size_of", "split_batch"]


class NetworkInput(Exception):
    """Raised by the first stage's proxy to hand over the network's input."""

    def __init__(self, value: Any) -> None:
        super().__init__("network input captured")
        self.value = value


class NetworkProxy(nn.Module):
    """Stands in for the network while a user hook runs; calls ``fn`` instead."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self._fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)


class OnAnotherStage(nn.Module):
    """Placeholder for a layer that lives on another pipeline stage."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"this layer runs on pipeline stage {self.stage}; call the network through the pipeline")

    def extra_repr(self) -> str:
        return f"stage={self.stage}"


def batch_size_of(batch: Any) -> int:
    """Leading dimension of the batch's first tensor."""
    sizes: list[int] = []
    apply_to_collection(batch, Tensor, lambda t: sizes.append(t.shape[0]) if t.ndim else None)
    if not sizes:
        raise ValueError("the batch holds no tensor with a batch dimension; a pipeline cuts batches along dimension 0")
    return sizes[0]


def split_batch(batch: Any, n: int) -> list[Any]:
    """``n`` micro-batches: every tensor of the batch's size along dim 0 is cut, the rest is shared."""
    size = batch_size_of(batch)
    return [
        apply_to_collection(batch, Tensor, lambda t, i=i: t.tensor_split(n)[i] if t.ndim and t.shape[0] == size else t)
        for i in range(n)
    ]


class StageSplit:
    """One stage's view of the module: which layers it runs, and how to call the rest."""

    def __init__(self, module: nn.Module, num_stages: int, stage: int, network: str | None = None,
                 balance: str | None = None, split_points: list[str] | None = None,
                 example_input: Any = None, agree: Callable[[Partition], Partition] | None = None) -> None:  # fmt: skip
        self.module, self.stage, self.num_stages = module, stage, num_stages
        self.path, net = find_network(module, network)
        self.layers = list_layers(net, self.path)
        self.full_keys = list(module.state_dict().keys())
        if split_points is not None:
            self.partition = split_by_names(self.layers, list(split_points))
        elif balance == "time":
            self.partition = partition(self.layers, num_stages, layer_times(self.layers, _network_input(module, self.path, example_input)))
        else:
            self.partition = partition(self.layers, num_stages)
        if agree is not None:  # e.g. every rank takes rank 0's timing-based cut
            self.partition = agree(self.partition)
        self._check_shared_parameters()
        a, b = self.partition.bounds[stage]
        self.stage_module = nn.Sequential(*[layer for _, layer in self.layers[a:b]])
        self._removed: list[tuple[nn.Module, str, nn.Module]] = []
        for s, (lo, hi) in enumerate(self.partition.bounds):
            if s == stage:
                continue
            for name, layer in self.layers[lo:hi]:
                parent_name, _, child = name.rpartition(".")
                parent = module.get_submodule(parent_name)
                self._removed.append((parent, child, layer.to("meta")))
                parent._modules[child] = OnAnotherStage(s)

    def _check_shared_parameters(self) -> None:
        owner: dict[int, int] = {}
        for s, (a, b) in enumerate(self.partition.bounds):
            for name, layer in self.layers[a:b]:
                for p in layer.parameters():
                    if owner.setdefault(id(p), s) != s:
                        raise ValueError(
                            f"{name} shares a parameter with a layer of stage {owner[id(p)]}; tied weights across stages are "
                            "not supported (keep tied layers in one stage with split_points)"
                        )

    @property
    def parent_and_attr(self) -> tuple[nn.Module, str]:
        parent_name, _, attr = self.path.rpartition(".")
        return self.module.get_submodule(parent_name), attr

    @contextmanager
    def calling(self, fn: Callable[..., Any]) -> Iterator[list[int]]:
        """While active, the module's network is ``NetworkProxy(fn)``; yields a one-item call counter."""
        parent, attr = self.parent_and_attr
        original, calls = parent._modules[attr], [0]

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] > 1:
                raise RuntimeError(
                    f"{type(self.module).__name__} called its network {self.path!r} twice in one step; under a pipeline "
                    "each training/validation step must call it exactly once"
                )
            return fn(*args, **kwargs)

        parent._modules[attr] = NetworkProxy(counted)
        try:
            yield calls
        finally:
            parent._modules[attr] = original

    def restore(self, state: dict[str, Tensor], device: torch.device) -> None:
        """Put every layer back, weights from ``state`` (the whole model's ``state_dict``)."""
        for parent, child, layer in self._removed:
            parent._modules[child] = layer.to_empty(device=device)
        self._removed = []
        self.module.load_state_dict(state, strict=False)


def _network_input(module: nn.Module, path: str, example_input: Any) -> Any:
    """The network's input for ``module(example_input)`` (``balance='time'`` profiles on it)."""
    if example_input is None:
        raise ValueError(
            f"balance='time' times each layer on the module's example_input_array; set it on {type(module).__name__} "
            "(e.g. self.example_input_array = torch.zeros(32, 1, 8, 8)) or use balance='parameters'"
        )
    parent_name, _, attr = path.rpartition(".")
    parent = module.get_submodule(parent_name)
    original = parent._modules[attr]

    def capture(x: Any, *_: Any, **__: Any) -> Any:
        raise NetworkInput(x)

    parent._modules[attr] = NetworkProxy(capture)
    try:
        with torch.no_grad():
            module(*example_input) if isinstance(example_input, tuple) else module(example_input)
    except NetworkInput as captured:
        return captured.value
    finally:
        parent._modules[attr] = original
    raise ValueError(f"{type(module).__name__}.forward(example_input_array) never called its network {path!r}")
