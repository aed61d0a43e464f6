"""DDP communication hooks for 1-bit sign voting: signSGD-MV and IT-signSGD.

Both follow PyTorch's ``hook(state, bucket) -> Future[Tensor]`` form, so they register on any
``DistributedDataParallel`` model, CPU/gloo included::

    state = ITSignSGDState(warmup_rounds=10)
    ddp_model.register_comm_hook(state, it_signsgd_hook)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=delta)   # x ← x − δ·U  (paper eq. 5)

Every rank's bucket comes back holding the voted sign ``U`` as ``±1`` in the bucket's dtype (or
``s̄·U`` under error feedback); the math is in :mod:`lightning_pdist.sign.vote` and
:mod:`lightning_pdist.sign.llr`.

Transport: a sharded vote
-------------------------
The bucket's ``d`` coordinates are cut into ``M`` slices of ``8C`` coordinates,
``C = ceil(d / (8M))`` bytes each (the last slices absorb the padding up to ``8·M·C``).

1. Each rank packs its signs (``d/8`` bytes) and, in one ``all_to_all_single``, sends slice ``r``
   to rank ``r``, each preceded by a small header: a non-finite flag and, with error feedback,
   its per-tensor scales (fp32).
2. Rank ``r`` now holds every worker's bits for its slice ``(M, C)`` and votes on it: the majority
   by counting set bits, or the LLR-weighted vote with the statistics of its slice.
3. One ``all_gather_single`` of the packed results (``C`` bytes each, plus, for the pooled LLR
   estimators, this rank's ``(M, G)`` int32 disagreement counts) gives everyone ``U``.

Bytes this rank sends per bucket per step (``H = 4·(1 + T·[error_feedback])`` header bytes,
``T`` tensors in the bucket; ``G = 4M`` for ``estimator="worker"``, ``4MT`` for ``"tensor"``,
0 otherwise)::

    all-to-all  (M − 1)·(C + H)   ≈ (M − 1)/M · d/8
    all-gather  (M − 1)·(C + G)   ≈ (M − 1)/M · d/8

i.e. about ``d/8`` per direction, against ``2(M − 1)/M · 4d`` for an fp32 ring all-reduce: 32×
less. A plain all-gather of every worker's packed signs would send ``(M − 1)·d/8``, ``M`` times
more, and leave every rank with ``M·d`` bits to count; the sharded vote keeps both the traffic
and the vote work per rank at ``O(d)``, and the per-coordinate LLR statistics at ``M · d/M = d``
fp32 per rank instead of ``M·d``. Majority and LLR use the same scheme, so their bytes are equal.
:func:`sign_hook_bytes` gives the exact figures; they are what the ``meter`` records.

Both collectives run synchronously inside the hook, which returns a completed future: issuing
the all-gather from the all-to-all's callback would let buckets' collectives reach gloo in a
different order on different ranks, and would run statistics updates on gloo's thread. The cost
is that the vote does not overlap the rest of the backward pass.

Teardown (torch 2.13, gloo): destroying the process group right after the last hook call hung in
about one run in four while these hooks were developed. gdb showed gloo's worker thread waiting
for the GIL to release a finished collective's (Python-created) tensors, while the main thread,
holding the GIL, joined that thread in ``~ProcessGroupGloo``. Nothing here is specific to sign
hooks. A ``dist.barrier()`` before ``destroy_process_group()`` avoided it in every later run.

Behaviour at the edges
----------------------
* **Non-finite gradients.** A NaN has no sign (``NaN >= 0`` is False, so it would silently vote
  −1). Every rank flags non-finite values in its header, so all ranks learn of them in the same
  collective and act alike (a rank raising alone would leave the others blocked in the next
  collective). With a :class:`~lightning_pdist.sign.overflow.LossScaledRound` in
  ``state.loss_scaling`` (an fp16 ``GradScaler``'s, or the one ``SignSGDStrategy`` installs for
  ``nonfinite="raise"``/``"skip_step"``) the flag marks the whole backward pass: every rank gets NaN
  buckets, later buckets skip their collectives, and the pass's state changes, which wait for its
  end, are dropped (:mod:`~lightning_pdist.sign.overflow`); the owner of the round then stops or
  skips the step. Without a round, ``nonfinite="raise"`` (default) raises ``FloatingPointError``
  naming the bucket and the ranks, and ``nonfinite="propagate"`` returns a NaN bucket on every rank
  and leaves the state untouched for that round; ``"skip_step"`` needs a round.
* **One rank.** No collective is issued; the result is ``sign(grad)`` (or the EF scaled sign).
  Warning about it is the strategy's job.
* **fp16/bf16 buckets.** Signs ignore precision; the result is cast to the bucket's dtype.
  Momentum and residual buffers are kept in fp32 whatever the bucket's dtype.
* **Padding.** ``d`` need not be a multiple of ``8M``; padding bits never reach the result and are
  not counted as disagreements.
* **Bucket layout.** State is keyed by ``bucket.index()`` and kept in the bucket's *canonical*
  layout, the tensor order the state first saw (DDP's initial layout, the same in every process).
  DDP rebuilds its buckets after the first iteration, in gradient-ready order, which typically
  reverses the tensors inside a bucket: the hook then permutes the gradient into the canonical
  order and the result back (two copies of the bucket), so statistics, residuals and momentum
  keep meaning the same coordinates, also after a restart. If a rebuild regroups tensors into
  other buckets, the affected buckets' state restarts from zero, with a warning on rank 0. Build
  the state before the first backward, so that its canonical layout is DDP's initial one.
* **Checkpoints.** ``state_dict()`` holds this rank's state only: its residual and momentum, and
  for ``estimator="coordinate"`` its slice of the statistics (the pooled statistics are the same
  on every rank). A checkpoint must keep one per rank; loading another rank's dict raises.
"""

# No ``from __future__ import annotations``: DDP checks the hooks' annotations at run time.

import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import functional as F

from lightning_pdist.sign.llr import (
    DEFAULT_MAX_WEIGHT,
    LLRConfig,
    LLRState,
    column_ids,
    disagreement_counts,
    llr_observe_,
    llr_vote,
    observations_per_round,
    pooled_vote_tables,
)
from lightning_pdist.core.nonfinite import NONFINITE_POLICIES, check_nonfinite_policy
from lightning_pdist.sign.vote import ef_scaled_vote, segment_l1_mean, vote_table, worker_vote
from lightning_pdist.core.accounting import CommMeter, all_gather_bytes, all_to_all_bytes
from lightning_pdist.sign.bits import (
    count_ones,
    majority_bits,
    mask_bits_,
    pack_bits,
    pack_signs,
    packed_numel,
    truth_table_bits,
    unpack_signs,
)
from lightning_pdist.sign.overflow import LossScaledRound
from lightning_pdist.sign.participation import (
    ParticipationTracker,
    coordinate_mask,
    flag_words,
    pack_flags,
    unpack_flags,
    used_runs,
)
from lightning_pdist.sign.stats import VoteStats, count_disagreements, count_ties

__all__ = [
    "NONFINITE_POLICIES",
    "SCALES",
    "ITSignSGDState",
    "SignBucketState",
    "SignSGDState",
    "it_signsgd_hook",
    "shard_bytes",
    "sign_hook_bytes",
    "signsgd_mv_hook",
]

#: What the hook returns: the vote ``U`` (``"unit"``, ±1) or ``s̄_j·U`` with ``s̄_j`` the workers' mean ``‖v_j‖₁/numel_j``.
SCALES = ("unit", "l1")


def shard_bytes(numel: int, world_size: int) -> int:
    """``C = ceil(numel / (8·world_size))``: packed bytes of one rank's slice of a bucket."""
    return math.ceil(numel / (8 * world_size))


def sign_hook_bytes(
    numel: int,
    world_size: int,
    num_tensors: int = 1,
    *,
    error_feedback: bool = False,
    estimator: str | None = None,
    scale: str = "unit",
    find_unused_parameters: bool = False,
) -> dict[str, int]:
    """Bytes one rank sends for one bucket in one step, by collective, as the hooks count them.

    Args:
        numel: coordinates in the bucket ``d``.
        world_size: ``M``.
        num_tensors: tensors in the bucket ``T``.
        error_feedback: whether scales ride in the all-to-all header (as they do with ``scale="l1"``).
        estimator: the IT-signSGD estimator (``None`` for the majority vote).
        scale: ``"unit"`` or ``"l1"`` (scales in the header).
        find_unused_parameters: whether participation flags ride in the header (``ceil(T/32)`` words).

    Returns:
        ``{"sign_all_to_all": (M−1)(C+H), "sign_all_gather": (M−1)(C+G)}`` (zeros for one rank), for a
        bucket with at least one tensor in the backward pass (else there is no all-gather).
    """
    if world_size == 1:
        return {"sign_all_to_all": 0, "sign_all_gather": 0}
    chunk = shard_bytes(numel, world_size)
    scaled = error_feedback or scale == "l1"
    header = 4 * (1 + (num_tensors if scaled else 0) + (flag_words(num_tensors) if find_unused_parameters else 0))
    counts = {None: 0, "coordinate": 0, "worker": 4 * world_size, "tensor": 4 * world_size * num_tensors}[estimator]
    return {
        "sign_all_to_all": all_to_all_bytes(world_size * (chunk + header), world_size),
        "sign_all_gather": all_gather_bytes(chunk + counts, world_size),
    }


@dataclass
class SignBucketState:
    """Run-time state of one DDP bucket on one rank.

    Attributes:
        lengths: sizes of the bucket's tensors in its canonical layout: the order in which the state
            first saw them (DDP's initial layout, the same in every process).
        rounds: votes taken on this bucket.
        momentum: Signum buffer ``(d,)`` fp32, or ``None`` without momentum.
        residual: EF residual ``(d,)`` fp32, or ``None`` without error feedback.
        llr: IT-signSGD statistics (this rank's slice for ``coordinate``), or ``None``.
        groups: IT-signSGD statistics of the rounds in which only some of the bucket's tensors took
            part, one per set of canonical tensor indices (``find_unused_parameters=True``; a GAN's
            generator and discriminator steps). A set's statistics cover only its coordinates.
    """

    lengths: tuple[int, ...]
    rounds: int = 0
    momentum: Tensor | None = None
    residual: Tensor | None = None
    llr: LLRState | None = None
    groups: dict[tuple[int, ...], LLRState] = field(default_factory=dict)
    param_ids: tuple[int, ...] | None = field(default=None, repr=False)  # id() of its tensors, canonical order
    columns: Tensor | None = field(default=None, repr=False)  # cache: tensor index of this rank's slice

    def state_dict(self) -> dict:
        clone = lambda t: None if t is None else t.clone()  # noqa: E731
        return {
            "lengths": list(self.lengths),
            "rounds": self.rounds,
            "momentum": clone(self.momentum),
            "residual": clone(self.residual),
            "llr": None if self.llr is None else self.llr.state_dict(),
            "groups": {key: llr.state_dict() for key, llr in self.groups.items()},
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> "SignBucketState":
        clone = lambda t: None if t is None else t.clone()  # noqa: E731

        def load_llr(saved: dict) -> LLRState:
            llr = LLRState(saved["estimator"], saved["disagreements"].clone(), saved["observations"].clone())
            llr.rounds = int(saved["rounds"])
            return llr

        llr = None if state["llr"] is None else load_llr(state["llr"])
        return cls(
            lengths=tuple(state["lengths"]),
            rounds=int(state["rounds"]),
            momentum=clone(state["momentum"]),
            residual=clone(state["residual"]),
            llr=llr,
            groups={tuple(key): load_llr(saved) for key, saved in state.get("groups", {}).items()},
        )


@dataclass
class SignSGDState:
    """State of :func:`signsgd_mv_hook` (and the base of :class:`ITSignSGDState`).

    Attributes:
        process_group: group to vote over (``None``: the default group). Never saved.
        meter: where the bytes this rank sends are counted (``None``: not counted).
        momentum: Signum's ``β`` in ``[0, 1)``; each worker votes with the sign of
            ``m ← β·m + (1 − β)·g``. ``0`` (default) is plain signSGD. ``0.9`` is the papers' value.
            Leave the optimizer's own momentum at 0: momentum after the vote is a different
            algorithm (server-side momentum on ``U``).
        error_feedback: EF-signSGD: vote with ``sign(g + e)`` and return the scaled vote
            ``s̄·U`` (per tensor), keeping each worker's residual ``e``. Then use SGD's usual
            learning rate, not Signum's small ``δ``.
        nonfinite: ``"raise"`` (default), ``"skip_step"`` (needs ``loss_scaling``: a round whose owner skips
            the step) or ``"propagate"``; see the module docstring.
        scale: ``"unit"`` (default): the hook returns ``U`` (±1) and the optimizer's ``lr`` is the
            sign step ``δ``. ``"l1"``: it returns ``s̄_j·U`` with ``s̄_j`` the workers' mean
            ``‖v_j‖₁/numel_j`` per tensor (the scales ride in the header, ``4T`` bytes), so an SGD
            ``lr`` keeps its meaning. Error feedback always returns the scaled vote.
        find_unused_parameters: set it as the DDP model's, and call :meth:`watch` before the first
            backward: only the tensors that received a gradient on some rank take part
            (:mod:`~lightning_pdist.sign.participation`; ``ceil(T/32)`` header words).
        buckets: per-bucket state, keyed by ``bucket.index()``.
        stats: vote statistics since they were last taken (:mod:`~lightning_pdist.sign.stats`): this rank's
            disagreements with the vote, ties in its slices. Never saved.
        loss_scaling: ``None`` (default), or the :class:`~lightning_pdist.sign.overflow.LossScaledRound`
            of an fp16 ``GradScaler`` run: then a non-finite gradient on any rank is an overflow that every
            rank skips (``nonfinite`` is not consulted), and the state changes of a backward pass wait for
            its end. Set by :class:`~lightning_pdist.sign.precision.SignMixedPrecision`. Never saved.
    """

    process_group: dist.ProcessGroup | None = None
    meter: CommMeter | None = None
    momentum: float = 0.0
    error_feedback: bool = False
    nonfinite: str = "raise"
    scale: str = "unit"
    find_unused_parameters: bool = False
    buckets: dict[int, SignBucketState] = field(default_factory=dict, init=False, repr=False)
    rank: int | None = field(default=None, init=False)
    world_size: int | None = field(default=None, init=False)
    tracker: ParticipationTracker = field(default_factory=ParticipationTracker, init=False, repr=False)
    stats: VoteStats = field(default_factory=VoteStats, init=False, repr=False)
    loss_scaling: LossScaledRound | None = field(default=None, init=False, repr=False)
    _warned_partial: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"{name}(momentum={self.momentum}): momentum must be in [0, 1)")
        check_nonfinite_policy(self.nonfinite, name)
        if not isinstance(self.error_feedback, bool):
            raise TypeError(f"{name}(error_feedback={self.error_feedback!r}): error_feedback must be a bool")
        if self.scale not in SCALES:
            choices = ", ".join(repr(c) for c in SCALES)
            raise ValueError(f"{name}(scale={self.scale!r}): scale must be one of {choices}")
        if not isinstance(self.find_unused_parameters, bool):
            raise TypeError(
                f"{name}(find_unused_parameters={self.find_unused_parameters!r}): find_unused_parameters must be a bool"
            )

    @property
    def scaled(self) -> bool:
        """Whether the result is ``s̄·U`` (scales travel in the header): error feedback or ``scale="l1"``."""
        return self.error_feedback or self.scale == "l1"

    def watch(self, parameters) -> None:
        """Flag every parameter that receives a gradient (``find_unused_parameters=True``); call once per model."""
        self.tracker.watch(parameters)

    @property
    def llr(self) -> LLRConfig | None:
        """The LLR vote's settings; ``None`` for the plain majority vote."""
        return None

    def state_dict(self) -> dict:
        """This rank's state: rank, world size and every bucket's buffers. No process group."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "buckets": {index: bucket.state_dict() for index, bucket in self.buckets.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` saved by the same rank of a run with the same settings.

        Raises:
            ValueError: the saved buffers belong to other settings (momentum, error feedback,
                aggregation or estimator) than this state's.
        """
        name = type(self).__name__
        buckets = {int(i): SignBucketState.from_state_dict(b) for i, b in state["buckets"].items()}
        for index, bucket in buckets.items():
            mismatch = None
            if bucket.momentum is not None and self.momentum == 0.0:
                mismatch = "a Signum momentum buffer, but this state has momentum=0.0"
            elif bucket.residual is not None and not self.error_feedback:
                mismatch = "an error-feedback residual, but this state has error_feedback=False"
            elif (bucket.llr is not None or bucket.groups) and self.llr is None:
                mismatch = "LLR statistics, but this state takes the plain majority vote"
            elif bucket.llr is not None and bucket.llr.estimator != self.llr.estimator:
                mismatch = (
                    f"LLR statistics of estimator={bucket.llr.estimator!r}, "
                    f"but this state has estimator={self.llr.estimator!r}"
                )
            if mismatch:
                raise ValueError(f"{name}.load_state_dict(bucket {index}): the saved state holds {mismatch}")
        self.rank = state["rank"]
        self.world_size = state["world_size"]
        self.buckets = buckets

    def _bucket(
        self, index: int, params: list[Tensor], device: torch.device
    ) -> tuple[SignBucketState, list[int] | None]:
        """This bucket's state, and where each of its canonical tensors sits in the current layout.

        Returns ``(state, order)`` with ``order[j]`` the current position of the state's ``j``-th
        tensor, or ``order=None`` when the current layout is the canonical one.
        """
        ids = tuple(id(p) for p in params)
        lengths = tuple(p.numel() for p in params)
        found = next((b for b in self.buckets.values() if b.param_ids and set(b.param_ids) == set(ids)), None)
        if found is None:
            saved = self.buckets.get(index)
            if saved is not None and saved.param_ids is None and saved.lengths == lengths:
                # First sight after load_state_dict: DDP's first iteration uses the same initial layout in every
                # process, so the saved canonical layout is this one.
                saved.param_ids, found = ids, saved
        if found is None:
            stale = {i for i, b in self.buckets.items() if i == index or (b.param_ids and set(b.param_ids) & set(ids))}
            if stale and self.rank == 0:
                old = ", ".join(f"{i}: {list(self.buckets[i].lengths)}" for i in sorted(stale))
                warnings.warn(
                    f"{type(self).__name__}: DDP bucket {index} now holds tensors of sizes {list(lengths)} that were "
                    f"in other buckets before ({old}); the sign-vote state of those buckets (statistics, residual, "
                    "momentum) restarts from zero. Buckets whose tensors only change order keep their state; ones "
                    "that regroup tensors cannot, because their statistics are sharded by position.",
                    stacklevel=3,
                )
            for i in stale:
                del self.buckets[i]
            found = SignBucketState(lengths=lengths, param_ids=ids)
            if self.momentum > 0:
                found.momentum = torch.zeros(sum(lengths), device=device)
            if self.error_feedback:
                found.residual = torch.zeros(sum(lengths), device=device)
            self.buckets[index] = found
        if found.param_ids == ids:
            return found, None
        return found, [ids.index(pid) for pid in found.param_ids]

    def _check_group(self, rank: int, world_size: int, hook: str) -> None:
        if self.rank is None:
            self.rank, self.world_size = rank, world_size
        elif (self.rank, self.world_size) != (rank, world_size):
            raise RuntimeError(
                f"{hook}: this {type(self).__name__} belongs to rank {self.rank} of {self.world_size} (it was used "
                f"or restored there) but now runs on rank {rank} of {world_size}; every rank needs its own state, "
                "restored from that rank's state_dict with the same world size"
            )


@dataclass
class ITSignSGDState(SignSGDState):
    """State of :func:`it_signsgd_hook`: :class:`SignSGDState` plus the LLR vote's settings.

    Attributes:
        warmup_rounds: rounds of plain majority vote before the LLR weights apply (statistics
            are collected from the first round).
        estimator: ``"worker"`` (default), ``"tensor"`` or ``"coordinate"`` (paper eq. 4);
            ``"worker"`` pools over the bucket.
        decay: ``1.0`` for eq. 4's running fraction, ``< 1`` for an exponential moving average.
        max_weight: bound on ``|w|`` (default ``log 99``: ``p`` held in ``[0.01, 0.99]``).
        negative_weights: allow ``w < 0`` (exact Chair–Varshney rule for inverting workers).

    See :mod:`lightning_pdist.sign.llr` for the rule and each choice.
    """

    warmup_rounds: int = 10
    estimator: str = "worker"
    decay: float = 1.0
    max_weight: float = DEFAULT_MAX_WEIGHT
    negative_weights: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self._llr = LLRConfig.of(self, "ITSignSGDState")

    @property
    def llr(self) -> LLRConfig:
        return self._llr


# Newer torch (2.13 here) names it all_gather_single and deprecates all_gather_into_tensor; on gloo both need a
# flat output (a 2-D one raises "invalid tensor size").
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _permute(flat: Tensor, lengths: list[int], order: list[int]) -> Tensor:
    """Concatenate the segments of ``flat`` (of ``lengths``) so that segment ``order[j]`` comes ``j``-th."""
    segments = flat.split(lengths)
    return torch.cat([segments[i] for i in order])


def _inverse(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for j, i in enumerate(order):
        inverse[i] = j
    return inverse


def _reinterpret(raw: Tensor, dtype: torch.dtype) -> Tensor:
    """Copy a (rows, bytes) ``uint8`` slice into fresh, aligned memory and view it as ``dtype``."""
    # .contiguous() is not enough: a one-row slice counts as contiguous but keeps its row stride and offset.
    fresh = torch.empty(raw.shape, dtype=torch.uint8, device=raw.device)
    return fresh.copy_(raw).view(dtype)


def _completed(value: Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(value)
    return fut


def _worker_message(
    state: SignSGDState,
    entry: SignBucketState,
    buffer: Tensor,
    world_size: int,
    chunk: int,
    local_used: list[bool] | None,
):
    """This worker's side: momentum/EF, signs, and the all-to-all input. Nothing is committed yet.

    Returns ``(send, float_bytes, flag_bytes, vote)``: the ``(M, H + C)`` message, the header's fp32 part
    (non-finite flag, scales) and its participation flags (``local_used``; none when it is ``None``).
    """
    lowest, highest = torch.aminmax(buffer)  # NaN propagates; 30x faster than isfinite(buffer).all() on CPU
    finite = bool(torch.isfinite(lowest)) and bool(torch.isfinite(highest))
    num_scales = len(entry.lengths) if state.scaled else 0
    header = torch.zeros(1 + num_scales, device=buffer.device)  # fp32: [non-finite flag, scales ...]
    vote = None
    if finite:
        vote = worker_vote(buffer, entry.momentum, entry.residual, beta=state.momentum, lengths=entry.lengths)
        if num_scales:
            header[1:] = vote.scales if vote.scales is not None else segment_l1_mean(vote.vector, entry.lengths)
        packed = pack_signs(vote.vector)  # (ceil(d/8),)
    else:
        header[0] = 1.0
        packed = torch.zeros(packed_numel(buffer.numel()), dtype=torch.uint8, device=buffer.device)
    header_bytes = header.view(torch.uint8)  # (4·(1 + num_scales),)
    flag_bytes = 0
    if local_used is not None:
        flags = pack_flags(local_used).to(buffer.device).view(torch.uint8)  # (4·ceil(T/32),)
        flag_bytes = flags.numel()
        header_bytes = torch.cat([header_bytes, flags])
    packed = F.pad(packed, (0, world_size * chunk - packed.numel())).view(world_size, chunk)  # (M, C)
    send = torch.cat([header_bytes.expand(world_size, -1), packed], dim=1)  # (M, H + C): row r goes to rank r
    return send, header_bytes.numel() - flag_bytes, flag_bytes, vote


# Votes on up to this many workers run on the packed bytes through a truth table of their 2^M outcomes; the table
# and its evaluation grow as 2^M, so larger groups unpack the signs (M·n bytes per slice, the same O(d) per rank).
MAX_TABLE_WORKERS = 12


def _llr_stats(
    state: SignSGDState, entry: SignBucketState, used: Tensor | None, world_size: int, start: int, stop: int
) -> LLRState | None:
    """The LLR statistics this round reads and updates: the bucket's, or those of its set of used tensors."""
    llr = state.llr
    if llr is None:
        return None
    if used is None:
        if entry.llr is None:
            columns = {"coordinate": stop - start, "tensor": len(entry.lengths), "worker": 1}[llr.estimator]
            entry.llr = LLRState.zeros(llr.estimator, world_size, columns)
        return entry.llr
    key = tuple(used.nonzero().flatten().tolist())
    if key not in entry.groups:
        n_used = int(coordinate_mask(entry.lengths, used)[start:stop].sum())  # this slice's coordinates of the set
        columns = {"coordinate": n_used, "tensor": len(entry.lengths), "worker": 1}[llr.estimator]
        entry.groups[key] = LLRState.zeros(llr.estimator, world_size, columns)
    return entry.groups[key]


def _vote_on_slice(
    state: SignSGDState,
    entry: SignBucketState,
    stats: LLRState | None,
    rows: Tensor,
    start: int,
    stop: int,
    used: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Aggregate this rank's slice from every worker's bits ``rows`` (M, C).

    Only the coordinates of the ``used`` tensors (``None``: all) vote and count. Returns the packed vote
    ``(C,)`` ``uint8`` (bits of other coordinates, and past the slice's ``stop − start``, are 0) and the bytes
    of this slice's disagreement counts (pooled LLR estimators only; empty otherwise), which travel with the
    all-gather.
    """
    llr, world_size = state.llr, rows.shape[0]
    if world_size > MAX_TABLE_WORKERS or (llr is not None and llr.estimator == "coordinate"):
        return _vote_on_unpacked_slice(state, entry, stats, rows, start, stop, used)
    # One vote rule per run (majority, or LLR with pooled weights): a truth table applied to the packed bytes.
    tables = vote_table(world_size).unsqueeze(0) if llr is None else pooled_vote_tables(stats, llr)  # (G, 2^M)
    runs = used_runs(entry.lengths, used, start, stop, per_tensor=llr is not None and llr.estimator == "tensor")
    vote = torch.zeros(rows.shape[1], dtype=torch.uint8, device=rows.device)  # (C,)
    for column, a, b in runs:
        first, last = a // 8, packed_numel(b)  # bytes holding the run; the end bytes may be shared
        part = truth_table_bits(rows[:, first:last], tables[column].tolist())
        vote[first:last] |= mask_bits_(part, a - 8 * first, b - 8 * first)
    if llr is None:
        return vote, torch.zeros(0, dtype=torch.uint8, device=rows.device)
    # 1[Y ≠ U] is the XOR of the packed bits; its set bits per run are the disagreement counts.
    differs = rows ^ vote  # (M, C)
    counts = torch.zeros(world_size, stats.disagreements.shape[1], dtype=torch.int64, device=rows.device)
    for column, a, b in runs:
        first, last = a // 8, packed_numel(b)
        counts[:, column] += count_ones(mask_bits_(differs[:, first:last].clone(), a - 8 * first, b - 8 * first))
    return vote, counts.to(torch.int32).view(torch.uint8).reshape(-1)  # (M·G·4,): summed over slices later


def _vote_on_unpacked_slice(
    state: SignSGDState,
    entry: SignBucketState,
    stats: LLRState | None,
    rows: Tensor,
    start: int,
    stop: int,
    used: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """:func:`_vote_on_slice` on unpacked signs: per-coordinate LLR weights, or more than MAX_TABLE_WORKERS."""
    llr, lengths, n_local = state.llr, entry.lengths, stop - start
    no_counts = torch.zeros(0, dtype=torch.uint8, device=rows.device)

    def packed(bits: Tensor) -> Tensor:
        return F.pad(pack_bits(bits), (0, rows.shape[1] - packed_numel(n_local)))  # (C,)

    if llr is None:
        return packed(majority_bits(rows, n_local)), no_counts  # other tensors' votes are dropped by the caller
    signs = unpack_signs(rows, n_local)  # (M, n_local) int8 ±1
    columns = None
    if llr.estimator == "tensor":
        if entry.columns is None:
            entry.columns = column_ids(lengths, start, stop)  # (n_local,)
        columns = entry.columns
    keep = None
    if used is not None:
        keep = coordinate_mask(lengths, used)[start:stop].to(rows.device)  # (n_local,): the coordinates that vote
        signs, columns = signs[:, keep], None if columns is None else columns[keep]
    u, _ = llr_vote(signs, stats, llr, columns)
    counts = disagreement_counts(signs, u, llr.estimator, columns, len(lengths))
    if keep is not None:
        u = torch.ones(n_local, dtype=u.dtype, device=u.device).masked_scatter_(keep, u)
    if llr.estimator == "coordinate":
        _commit(state, lambda: llr_observe_(stats, counts, 1.0, llr.decay))
        return packed(u > 0), no_counts
    return packed(u > 0), counts.to(torch.int32).view(torch.uint8).reshape(-1)  # (M·G·4,): summed over slices later


def _used_tensors(state: SignSGDState, index: int, flags: Tensor) -> Tensor:
    """``(T,)`` bool: the tensors used on some rank, from every rank's flags ``(M, T)``; warns once about partial use."""
    anywhere = flags.any(0)
    partial = (anywhere & ~flags.all(0)).nonzero().flatten().tolist()
    if partial and state.rank == 0 and not state._warned_partial:
        state._warned_partial = True
        ranks = {j: flags[:, j].nonzero().flatten().tolist() for j in partial}
        warnings.warn(
            f"{type(state).__name__}: tensors of DDP bucket {index} took part in the backward pass on some ranks only "
            f"(tensor: ranks that used it, {ranks}); a rank that did not use one votes with a zero gradient for it "
            "(sign(0) = +1), as DDP's average adds a zero for it. Warned once.",
            stacklevel=3,
        )
    return anywhere


def _commit(state: SignSGDState, change) -> None:
    """Apply a change to the vote's state now, or, under loss scaling, when the backward pass ends without overflow."""
    if state.loss_scaling is None:
        change()
    else:
        state.loss_scaling.stage(change)


def _finish(result: Tensor, raw: Tensor, keep: Tensor | None, lengths, order) -> torch.futures.Future[torch.Tensor]:
    """``result`` where ``keep`` (``None``: everywhere), the bucket's own values elsewhere, in DDP's current layout."""
    if keep is not None:
        # DDP drops these slots for globally unused parameters, or (gradient_as_bucket_view=True with a defined
        # .grad) writes them into .grad: returning what it gave us leaves .grad as it was either way.
        result = torch.where(keep, result, raw)
    if order is not None:
        result = _permute(result, list(lengths), _inverse(order))
    return _completed(result)


def _sign_hook(state: SignSGDState, bucket: dist.GradBucket, hook: str) -> torch.futures.Future[torch.Tensor]:
    group = state.process_group
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    state._check_group(rank, world_size, hook)
    llr = state.llr

    params = bucket.parameters()
    numel = bucket.buffer().numel()
    assert sum(p.numel() for p in params) == numel, f"bucket {bucket.index()}: its tensors do not fill it"
    entry, order = state._bucket(bucket.index(), params, bucket.buffer().device)
    lengths = entry.lengths
    # Work in the canonical layout, so that sharded statistics and buffers keep meaning the same coordinates
    # after DDP rebuilds its buckets; the result is permuted back at the end.
    raw = bucket.buffer()
    if order is not None:
        raw = _permute(raw, [p.numel() for p in params], order)
    buffer, local_used, mine = raw, None, None
    if state.find_unused_parameters:
        local_used = state.tracker.take(entry.param_ids, hook)
        if not all(local_used):
            # DDP left zeros or a copy of a stale .grad in the slots of tensors this rank did not use: zeros vote.
            mine = coordinate_mask(lengths, torch.tensor(local_used)).to(raw.device)
            buffer = raw.masked_fill(~mine, 0)
    scaling = state.loss_scaling
    if scaling is None and state.nonfinite == "skip_step":
        raise RuntimeError(
            f"{hook}: nonfinite='skip_step' needs state.loss_scaling, a LossScaledRound begun before and finished after "
            "each backward pass, so that a non-finite pass's state changes are dropped and its owner skips the step "
            "(SignSGDStrategy installs one)"
        )
    if scaling is not None:
        scaling.enter_bucket(bucket.index(), hook)
        if scaling.overflowed:  # an earlier bucket of this pass overflowed on some rank: every rank skips the rest
            return _finish(torch.full_like(raw, float("nan")), raw, mine, lengths, order)
        if (state.momentum > 0 or state.scaled) and scaling.loss_scale != 1.0:
            # Momentum, residual and l1 scales are kept in gradient units (the scale changes between steps): divide
            # by S in fp32, where S·g / S is exact for a power-of-two S. The plain sign needs no division.
            buffer = buffer.float() / scaling.loss_scale

    chunk = shard_bytes(numel, world_size)  # C: packed bytes per slice
    start = min(rank * 8 * chunk, numel)
    stop = min(start + 8 * chunk, numel)  # the last slices hold fewer than 8C coordinates, or none

    # 1. all-to-all: row m of recv is worker m's header and its bits for this rank's slice.
    send, float_bytes, flag_bytes, vote = _worker_message(state, entry, buffer, world_size, chunk, local_used)
    recv = send
    if world_size > 1:
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        if state.meter is not None:
            state.meter.add("sign_all_to_all", all_to_all_bytes(send.numel(), world_size))
    header_size = float_bytes + flag_bytes
    headers = _reinterpret(recv[:, :float_bytes], torch.float32)  # (M, 1 + num_scales)
    used, keep = None, None  # (T,) and (d,) bool: the tensors and coordinates in the vote; None: all
    if local_used is not None:
        flags = unpack_flags(_reinterpret(recv[:, float_bytes:header_size], torch.int32), len(lengths))  # (M, T)
        anywhere = _used_tensors(state, bucket.index(), flags)
        if not bool(anywhere.any()):
            return _completed(bucket.buffer())  # no rank used any of its tensors: nothing votes, nothing changes
        if not bool(anywhere.all()):
            used, keep = anywhere, coordinate_mask(lengths, anywhere).to(raw.device)

    bad_ranks = headers[:, 0].nonzero().flatten().tolist()
    if bad_ranks and scaling is not None:  # the round's owner stops or skips this step; nothing commits
        scaling.overflow(bucket.index(), bad_ranks)
        return _finish(torch.full_like(raw, float("nan")), raw, keep, lengths, order)
    if bad_ranks:
        if state.nonfinite == "raise":
            raise FloatingPointError(
                f"{hook}: bucket {bucket.index()} holds non-finite gradients (NaN/Inf) on rank(s) {bad_ranks}; a NaN "
                "has no sign and must not become a silent vote. Lower the learning rate or fix the loss, or pass "
                "nonfinite='propagate' to hand a NaN bucket to the optimizer (fp16 loss-scale overflows, under a "
                "GradScaler, are skipped on every rank without either)."
            )
        return _finish(torch.full_like(raw, float("nan")), raw, keep, lengths, order)
    if keep is not None:  # tensors outside the vote keep their Signum momentum and EF residual
        vote.momentum = None if vote.momentum is None else torch.where(keep, vote.momentum, entry.momentum)
        vote.residual = None if vote.residual is None else torch.where(keep, vote.residual, entry.residual)
    new_momentum, new_residual = vote.momentum, vote.residual  # every rank's round is valid: commit

    def commit_round() -> None:
        entry.momentum, entry.residual = new_momentum, new_residual
        entry.rounds += 1

    _commit(state, commit_round)

    # 2. vote on this rank's slice.
    stats = _llr_stats(state, entry, used, world_size, start, stop)
    vote_bytes, counts_bytes = _vote_on_slice(state, entry, stats, recv[:, header_size:], start, stop, used)
    payload = torch.cat([vote_bytes, counts_bytes])  # (C + G,)

    # 3. all-gather: row r of gathered is rank r's packed vote (and its disagreement counts).
    gathered = payload
    if world_size > 1:
        gathered = torch.empty(world_size * payload.numel(), dtype=torch.uint8, device=buffer.device)
        _all_gather_flat(gathered, payload, group=group)
        if state.meter is not None:
            state.meter.add("sign_all_gather", all_gather_bytes(payload.numel(), world_size))
    gathered = gathered.view(world_size, -1)  # (M, C + G)
    if world_size > 1:
        # Vote statistics from what this vote already holds: a few byte operations (sign/stats.py).
        disagreed = count_disagreements(send[:, header_size:], gathered[:, :chunk], numel, keep)
        tied = count_ties(recv[:, header_size:], stop - start, None if keep is None else keep[start:stop])
        _commit(state, lambda: state.stats.add(*disagreed, *tied))
    voted = unpack_signs(gathered[:, :chunk], 8 * chunk).reshape(-1)[:numel]  # (d,) int8 ±1: U
    if llr is not None and llr.estimator != "coordinate":
        counts = _reinterpret(gathered[:, chunk:], torch.int32).view(world_size, world_size, -1)  # (M slices, M, G)
        observed = observations_per_round(llr.estimator, lengths)
        if used is not None:  # only the used tensors' coordinates were observed
            observed = observed * used if llr.estimator == "tensor" else observed.new_tensor([float(keep.sum())])
        _commit(state, lambda: llr_observe_(stats, counts.sum(0), observed, llr.decay))
    result = ef_scaled_vote(voted, headers[:, 1:].contiguous(), lengths) if state.scaled else voted
    return _finish(result.to(raw.dtype), raw, keep, lengths, order)


def signsgd_mv_hook(state: SignSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """signSGD with majority vote (Bernstein et al., ICLR 2019): the bucket becomes ``sign(Σ_m sign(v_m))``.

    ``v_m`` is the gradient, or Signum's momentum, or ``g + e`` under error feedback (see
    :class:`SignSGDState`). Ties go to ``+1``. The optimizer (SGD with ``lr=δ``) applies it.
    """
    if not isinstance(state, SignSGDState) or isinstance(state, ITSignSGDState):
        raise TypeError(
            f"signsgd_mv_hook(state={type(state).__name__}): state must be a SignSGDState "
            "(an ITSignSGDState belongs to it_signsgd_hook)"
        )
    return _sign_hook(state, bucket, "signsgd_mv_hook")


def it_signsgd_hook(state: ITSignSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """IT-signSGD (paper 004): the bucket becomes ``sign(Σ_m w_m Y_m)`` with learned LLR weights.

    The plain majority vote for the first ``state.warmup_rounds`` rounds; see
    :mod:`lightning_pdist.sign.llr` for the weights and :class:`ITSignSGDState`.
    """
    if not isinstance(state, ITSignSGDState):
        raise TypeError(f"it_signsgd_hook(state={type(state).__name__}): state must be an ITSignSGDState")
    return _sign_hook(state, bucket, "it_signsgd_hook")
