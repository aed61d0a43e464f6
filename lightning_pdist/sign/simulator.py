"""Sign voting with ``M`` logical workers in one process.

The paper's experiment has ``M = 15`` workers; on a 2-core machine 15 processes would spend their
time contending for the cores. :class:`SignSGDSimulator` runs the workers' side of the vote
(Signum momentum, error feedback, signs) for each worker in turn and then aggregates, with the
same functions as the DDP comm hooks in :mod:`lightning_pdist.sign.hooks`, so that for the
same per-worker gradients it produces the same aggregate, to the bit: the hooks' sharding cuts
the coordinates into slices but every operation on a coordinate is the same, the LLR sum runs
over workers in the same order, and the pooled counts are exact integers.

Example (one bucket holding a whole model)::

    sim = SignSGDSimulator(15, "llr", warmup_rounds=10)
    update = sim.aggregate(torch.stack([flat_grad(w) for w in workers]), lengths=[p.numel() for p in params])
    flat_params -= delta * update
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_pdist.sign.llr import DEFAULT_MAX_WEIGHT, LLRConfig, LLRState, llr_round_
from lightning_pdist.sign.vote import binary_sign, ef_scaled_vote, majority_vote, worker_vote

__all__ = ["AGGREGATIONS", "SignSGDSimulator"]

AGGREGATIONS = ("majority", "llr")


@dataclass
class _SimBucket:
    lengths: tuple[int, ...]
    momentum: list[Tensor | None]
    residual: list[Tensor | None]
    llr: LLRState | None = None
    rounds: int = 0


@dataclass
class SignSGDSimulator:
    """``world_size`` logical workers voting with signs, as the comm hooks do across processes.

    Attributes:
        world_size: number of logical workers ``M``.
        aggregation: ``"majority"`` (signSGD-MV) or ``"llr"`` (IT-signSGD).
        momentum: Signum's ``β`` per worker (0: none).
        error_feedback: EF-signSGD per worker; the result is then ``s̄·U``.
        warmup_rounds, estimator, decay, max_weight, negative_weights: the LLR vote's settings
            (see :class:`~lightning_pdist.sign.llr.LLRConfig`); ignored by ``"majority"``.
        last_weights: the LLR weights used by the latest :meth:`aggregate` (``None`` in warm-up
            or for the majority vote), for inspection.
    """

    world_size: int
    aggregation: str = "majority"
    momentum: float = 0.0
    error_feedback: bool = False
    warmup_rounds: int = 10
    estimator: str = "worker"
    decay: float = 1.0
    max_weight: float = DEFAULT_MAX_WEIGHT
    negative_weights: bool = False
    last_weights: Tensor | None = field(default=None, init=False, repr=False)
    _buckets: dict[int, _SimBucket] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"SignSGDSimulator(world_size={self.world_size!r}): world_size must be an int >= 1")
        if self.aggregation not in AGGREGATIONS:
            choices = ", ".join(repr(a) for a in AGGREGATIONS)
            raise ValueError(
                f"SignSGDSimulator(aggregation={self.aggregation!r}): aggregation must be one of {choices}"
            )
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"SignSGDSimulator(momentum={self.momentum}): momentum must be in [0, 1)")
        self._llr = LLRConfig.of(self, "SignSGDSimulator")

    def llr_state(self, bucket: int = 0) -> LLRState | None:
        """The LLR statistics of ``bucket`` (``None`` before its first LLR round)."""
        entry = self._buckets.get(bucket)
        return None if entry is None else entry.llr

    def aggregate(self, grads: Tensor, lengths: Sequence[int] | None = None, bucket: int = 0) -> Tensor:
        """One round: every worker signs its vector, the votes are aggregated.

        Args:
            grads: ``(M, d)`` per-worker flat gradients (any floating dtype).
            lengths: the tensor sizes the ``d`` coordinates are made of, in order (EF scales and the
                ``tensor`` estimator are per tensor; default: one tensor).
            bucket: which independent state to use (one per DDP bucket being mirrored).

        Returns:
            ``(d,)`` fp32: ``U`` (``±1``), or ``s̄·U`` with error feedback; what a comm hook would
            write into the bucket.

        Raises:
            ValueError: ``grads`` has the wrong shape, holds NaN/Inf, or ``lengths`` differ from this
                bucket's earlier rounds.
        """
        if grads.dim() != 2 or grads.shape[0] != self.world_size:
            raise ValueError(
                f"SignSGDSimulator.aggregate(grads.shape={tuple(grads.shape)}): "
                f"grads must be (world_size={self.world_size}, d)"
            )
        numel = grads.shape[1]
        lengths = (numel,) if lengths is None else tuple(int(n) for n in lengths)
        finite = torch.isfinite(grads).all(dim=1)
        if not bool(finite.all()):
            bad = (~finite).nonzero().flatten().tolist()
            raise ValueError(
                f"SignSGDSimulator.aggregate: bucket {bucket} holds non-finite gradients (NaN/Inf) on worker(s) {bad}; "
                "a NaN has no sign and must not become a silent vote"
            )
        entry = self._entry(bucket, lengths)
        votes = [
            worker_vote(grads[m], entry.momentum[m], entry.residual[m], beta=self.momentum, lengths=lengths)
            for m in range(self.world_size)
        ]
        for m, vote in enumerate(votes):
            entry.momentum[m], entry.residual[m] = vote.momentum, vote.residual
        signs = binary_sign(torch.stack([vote.vector for vote in votes]))  # (M, d) int8
        if self.aggregation == "majority":
            u, self.last_weights = majority_vote(signs), None
        else:
            if entry.llr is None:
                columns = {"coordinate": numel, "tensor": len(lengths), "worker": 1}[self.estimator]
                entry.llr = LLRState.zeros(self.estimator, self.world_size, columns)
            u, self.last_weights = llr_round_(signs, entry.llr, self._llr, lengths)
        entry.rounds += 1
        if self.error_feedback:
            return ef_scaled_vote(u, torch.stack([vote.scales for vote in votes]), lengths)
        return u.to(torch.float32)

    def _entry(self, bucket: int, lengths: tuple[int, ...]) -> _SimBucket:
        entry = self._buckets.get(bucket)
        if entry is not None and entry.lengths != lengths:
            raise ValueError(
                f"SignSGDSimulator.aggregate(lengths={list(lengths)}): bucket {bucket} was made of tensors "
                f"{list(entry.lengths)} in earlier rounds; use another bucket index for another layout"
            )
        if entry is None:
            numel, m = sum(lengths), self.world_size
            entry = _SimBucket(
                lengths=lengths,
                momentum=[torch.zeros(numel) if self.momentum > 0 else None for _ in range(m)],
                residual=[torch.zeros(numel) if self.error_feedback else None for _ in range(m)],
            )
            self._buckets[bucket] = entry
        return entry
