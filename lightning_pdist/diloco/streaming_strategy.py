"""Streaming DiLoCo as a Lightning strategy: DiLoCo's rounds per fragment, overlapped and quantized."""

from __future__ import annotations

from typing import Any

from lightning_pdist.diloco.fragments import StreamingSchedule
from lightning_pdist.diloco.strategy import DiLoCoStrategy

__all__ = ["StreamingDiLoCoStrategy"]


def check_fragments(owner: str, fragments: Any, num_fragments: Any, balance: Any = "layers") -> int:
    """``num_fragments`` in force: ``len(fragments)`` when the user lists them (refusing a contradicting count, and a
    ``balance`` other than the default: a list is taken as given)."""
    if fragments is None:
        return num_fragments
    if balance != "layers":
        raise ValueError(f"{owner}(balance={balance!r}): balance cuts num_fragments blocks of layers; with a fragments "
                         "list the fragments are taken as given, so leave balance at 'layers'")  # fmt: skip
    if not (isinstance(fragments, (list, tuple)) and fragments
            and all(isinstance(f, (list, tuple)) and f and all(isinstance(n, str) for n in f) for f in fragments)):
        raise ValueError(f"{owner}(fragments={fragments!r}): fragments must be a non-empty list of non-empty lists of "
                         "module names")  # fmt: skip
    if num_fragments is not None and num_fragments != len(fragments):
        raise ValueError(f"{owner}(num_fragments={num_fragments!r}): fragments lists {len(fragments)} fragments; "
                         "leave num_fragments unset or make it equal")  # fmt: skip
    return len(fragments)


class StreamingDiLoCoStrategy(DiLoCoStrategy):
    """Streaming DiLoCo: DiLoCo whose fragments synchronize in turn, overlapped with compute, optionally quantized.

    Douillard et al., *Streaming DiLoCo with overlapping communication*, arXiv 2501.18512. The model is cut into
    ``P`` fragments; fragment ``p`` starts its exchange after inner step ``t`` with ``t mod H = p·H/P``; the exchange
    (the mean of ``Δ_r = θ_global,p − θ_r,p``, async on gloo) runs during the next ``overlap_steps = τ`` inner steps;
    then fragment ``p``'s outer step, and ``θ_r,p ← α·θ_r,p + (1−α)·θ_global,p`` (``fragment_alpha = α``). Peak
    traffic is ``1/P`` of DiLoCo's; ``quantize="int4"`` sends 4-bit codes with one fp32 scale per 64 values.
    ``P = 1, τ = 0, α = 0``, no quantization, is :class:`DiLoCoStrategy` exactly.

    Args:
        sync_every: ``H`` (>= 1; default 100); ``num_fragments`` must divide it.
        num_fragments: ``P`` contiguous blocks of layers (modules owning parameters, in registration order); at most
            the number of layers (checked at setup). Default 2; ``None`` with ``fragments``.
        fragments: instead, the module names of each fragment (``[["embed", "blocks.0"], ["blocks.1", "head"]]``);
            every parameter in exactly one.
        overlap_steps: ``τ`` with ``0 <= τ < H/P`` (0).
        fragment_alpha: ``α`` in ``[0, 1]`` (0: replicas load ``θ_global``).
        quantize: ``None``, ``"int8"`` or ``"int4"``: the outer gradients' wire format (all-gather of codes).
        balance: how ``num_fragments`` cuts the layers: ``"layers"`` (default; equal numbers of layers) or
            ``"params"`` (contiguous blocks whose largest parameter count is the smallest possible, so the peak
            traffic comes closest to ``1/P`` of the model); not with ``fragments``.
        outer_optimizer, outer_lr, outer_momentum, outer_kwargs, nonfinite, **kwargs: as :class:`DiLoCoStrategy`.
    """

    strategy_name = "streaming_diloco"

    def __init__(self, sync_every: int = 100, num_fragments: int | None = 2, fragments: list[list[str]] | None = None,
                 overlap_steps: int = 0, fragment_alpha: float = 0.0, quantize: str | None = None,
                 balance: str = "layers", outer_optimizer: Any = "nesterov", outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, outer_kwargs: dict | None = None, nonfinite: str = "raise",
                 **kwargs: Any) -> None:  # fmt: skip
        owner = type(self).__name__
        if fragments is not None and num_fragments == 2:
            num_fragments = None  # the default yields to the list
        count = check_fragments(owner, fragments, num_fragments, balance)
        schedule = StreamingSchedule(sync_every=sync_every, num_fragments=count, overlap_steps=overlap_steps,
                                     fragment_alpha=fragment_alpha, quantize=quantize, balance=balance,
                                     owner=owner)  # fmt: skip
        names = None if fragments is None else [list(f) for f in fragments]
        self._init_rounds(schedule, outer_optimizer, outer_lr, outer_momentum, outer_kwargs, names, nonfinite, **kwargs)
        self.fragments = names
