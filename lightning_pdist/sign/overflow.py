"""Loss scaling for the sign votes: one overflow decision per backward pass, the same on every rank.

An fp16 ``GradScaler`` multiplies the loss by ``S`` so that small gradients survive fp16's range;
now and then ``S·g`` overflows (Inf/NaN) and that optimizer step must be skipped and ``S`` backed
off. Under a sign vote the decision must be *collective*: if rank 1 overflowed and rank 0 did not,
both must skip, or the replicas part. The vote already provides the agreement for free: every
rank puts a non-finite flag in the header of each bucket's all-to-all (the vote's first message),
so after that collective every rank knows whether *any* rank's gradient in the bucket was
non-finite. "Some bucket of this backward overflowed" is therefore the same on every rank, with no
extra collective and no extra byte.

One backward pass votes bucket by bucket, and a later bucket may overflow after earlier ones have
voted. So that a skipped step leaves no trace, :class:`LossScaledRound` *stages* every change a
bucket's vote makes to the hook state (Signum momentum, EF residual, LLR statistics, the round
counter) and applies them only when the backward pass ends without an overflow
(:meth:`LossScaledRound.finish`); an overflowed pass drops them all. Once a bucket has overflowed,
the later buckets of the same pass skip their collectives (every rank knows, so every rank skips).

The same round serves ``nonfinite="raise"``/``"skip_step"`` without a scaler: ``SignSGDStrategy`` begins
every backward pass with a scale of 1 (so nothing is divided), and a non-finite flag then drops the pass
exactly as an overflow does, after which the strategy stops or skips the step
(:mod:`lightning_pdist.core.nonfinite`).

With plain PyTorch DDP::

    round = LossScaledRound()
    state.loss_scaling = round                  # a SignSGDState / ITSignSGDState
    round.begin(scaler.get_scale())             # the scale this backward's loss is multiplied by
    scaler.scale(loss).backward()
    if not round.finish():                      # True: some rank overflowed; nothing was committed
        optimizer.step()                        # the vote is ±1 (or s̄·U, unscaled): no unscale_
    # then update the scaler with the agreed flag (lightning_pdist.sign.precision does this)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["LossScaledRound"]


@dataclass
class LossScaledRound:
    """The loss scale of the current backward pass, its agreed overflow flag and its staged state changes.

    Attributes:
        loss_scale: ``S``, the factor the loss was multiplied by (set by :meth:`begin`). The hook
            divides the gradient by it (in fp32) before Signum momentum, error feedback or the
            ``"l1"`` scales touch it; the plain ±1 vote needs no division (the sign of ``S·g`` is
            the sign of ``g``).
        overflowed: some rank's gradient in some bucket of this pass was non-finite (the same on
            every rank: it is read from the all-to-all headers).
        overflow_at: ``(bucket index, ranks)`` of the first overflow in this pass, for messages.
    """

    loss_scale: float = 1.0
    overflowed: bool = False
    overflow_at: tuple[int, list[int]] | None = None
    _staged: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _buckets: set[int] = field(default_factory=set, repr=False)  # bucket indices that voted in this pass

    def begin(self, loss_scale: float) -> None:
        """Start a backward pass whose loss was multiplied by ``loss_scale``."""
        if not (isinstance(loss_scale, (int, float)) and math.isfinite(loss_scale) and loss_scale > 0):
            raise ValueError(f"LossScaledRound.begin(loss_scale={loss_scale!r}): the loss scale must be finite and > 0")
        if self._buckets:
            raise RuntimeError(
                f"LossScaledRound.begin: buckets {sorted(self._buckets)} voted since the last finish(); call "
                "finish() after every backward pass, so that its votes are committed or dropped"
            )
        self.loss_scale = float(loss_scale)

    def enter_bucket(self, index: int, hook: str) -> None:
        """Note that bucket ``index`` votes in this pass; a second vote before :meth:`finish` is a misuse."""
        if index in self._buckets:
            raise RuntimeError(
                f"{hook}: bucket {index} voted twice without LossScaledRound.finish() in between; with loss "
                "scaling, call finish() after every backward pass (the precision plugin does it in post_backward)"
            )
        self._buckets.add(index)

    def stage(self, change: Callable[[], None]) -> None:
        """Keep a change to the hook state until :meth:`finish` (applied only if no rank overflowed)."""
        self._staged.append(change)

    def overflow(self, index: int, ranks: list[int]) -> None:
        """Every rank learned, from bucket ``index``'s headers, that ``ranks`` overflowed."""
        if not self.overflowed:
            self.overflowed, self.overflow_at = True, (index, ranks)

    def finish(self) -> bool:
        """End the pass: apply the staged changes unless it overflowed. Returns whether it overflowed."""
        overflowed = self.overflowed
        if not overflowed:
            for change in self._staged:
                change()
        self._staged, self._buckets = [], set()
        self.overflowed, self.overflow_at = False, None
        return overflowed
