"""Sign compression: signSGD, the majority vote, Signum momentum and EF-signSGD error feedback.

Each of ``M`` workers sends one bit per gradient coordinate, ``Y_m = sign(v_m)``, and every
worker applies the aggregate ``U`` with its optimizer (plain SGD with ``lr = δ`` gives
``x ← x − δ·U``). The vector ``v_m`` a worker signs is one of:

* signSGD (Bernstein et al., ICML 2018): ``v = g``, the stochastic gradient.
* Signum (same paper; the majority-vote form is Bernstein et al., ICLR 2019): ``v = m`` with the
  local momentum ``m ← β·m + (1 − β)·g``, an exponential moving average (the ``1 − β`` factor is
  in the official ``Signum_SGD.py``). Without momentum small batches diverge; ``β = 0.9`` is the
  papers' value.
* EF-signSGD (Karimireddy et al., ICML 2019, Alg. 2): ``p = v + e``, send ``sign(p)`` together with
  one scale per tensor, ``s = ‖p‖₁ / numel`` (the *scaled* sign ``s·sign(p)``), and keep the
  residual ``e ← p − s·sign(p)``. The residual carries what the sign dropped into the next step,
  which restores SGD's convergence rate. Karimireddy applies the learning rate before
  compression (``p = γ·g + e``); here ``e`` is kept in gradient units and the optimizer applies
  ``γ`` afterwards, which is the same update while ``γ`` is constant (PowerSGD's residual
  makes the same choice).

The majority vote is ``U_n = sign(Σ_m Y_{m,n})`` (Bernstein et al., ICLR 2019). It is robust to
fewer than half of the workers inverting or randomising their signs.

Zero rule: ``sign(0) = +1`` (``-0.0`` included), as in the ICLR'19 code (``compressor.py``).
A packed bit has two states, so a three-valued ``sign`` with ``sign(0) = 0`` could not travel
in one bit per coordinate; mapping ``0`` to ``+1`` keeps every coordinate a single bit and costs
nothing in expectation (an exact zero gradient is a measure-zero event for a stochastic
gradient, and a coordinate that is identically zero on every worker, e.g. an unused parameter,
then moves by ``−δ`` per step: freeze it or exclude it from the optimizer).

Tie rule: an even number of workers can split evenly. ``Σ_m Y_{m,n} = 0`` votes ``+1``, the same
rule as ``sign(0) = +1``, so the aggregate is again exactly one bit and a one-worker vote is
``sign(g)``.

Signs are ``int8`` tensors of ``±1`` in this module: exact to sum and a quarter of fp32's memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "WorkerVote",
    "binary_sign",
    "ef_scaled_vote",
    "ef_sign_compress",
    "majority_vote",
    "segment_l1_mean",
    "sign_patterns",
    "signum_momentum",
    "tie_table",
    "vote_table",
    "worker_vote",
]


def binary_sign(x: Tensor) -> Tensor:
    """``sign(x)`` as ``int8`` ``±1`` with ``sign(0) = +1``.

    Args:
        x: any real tensor. NaN maps to ``-1`` (``NaN >= 0`` is False); callers that can see
            non-finite values must check for them first, as the comm hooks do.

    Returns:
        ``int8`` tensor of ``x``'s shape with values in ``{-1, +1}``.
    """
    # (x >= 0)·2 − 1 in int8: torch.where with scalar branches is ~8x slower on CPU.
    return (x >= 0).to(torch.int8).mul_(2).sub_(1)


def majority_vote(signs: Tensor) -> Tensor:
    """The majority vote ``U_n = sign(Σ_m Y_{m,n})`` over the first dimension, ties to ``+1``.

    Args:
        signs: ``(M, n)`` tensor of ``±1`` (any integer or floating dtype), one row per worker.

    Returns:
        ``(n,)`` ``int8`` tensor of ``±1``.
    """
    if signs.dim() != 2:
        raise ValueError(f"majority_vote(signs.shape={tuple(signs.shape)}): signs must be a 2-D (workers, n) tensor")
    # Exact: |Σ| <= M. int16 sums twice as fast as int32 and holds up to 32767 workers.
    total = signs.sum(0, dtype=torch.int16 if signs.shape[0] < 2**15 else torch.int32)
    return binary_sign(total)


def sign_patterns(num_workers: int) -> Tensor:
    """Every combination of ``M`` workers' signs: ``(M, 2^M)`` ``int8``, ``Y_{m,p} = +1`` iff bit ``m`` of ``p`` is set."""
    if not 1 <= num_workers <= 24:
        raise ValueError(f"sign_patterns(num_workers={num_workers}): num_workers must be in [1, 24] (2^M columns)")
    p = torch.arange(2**num_workers)
    bits = (p >> torch.arange(num_workers).unsqueeze(1)) & 1  # (M, 2^M)
    return bits.to(torch.int8).mul_(2).sub_(1)


def vote_table(num_workers: int, vote=majority_vote) -> Tensor:
    """A vote as a truth table: entry ``p`` is True iff ``vote`` gives ``+1`` for sign pattern ``p``.

    A vote whose rule is the same for every coordinate (the majority vote, or the LLR vote with
    weights pooled over a tensor or a worker) depends on a coordinate only through its ``M``
    signs, so the table of its ``2^M`` outcomes, computed by the vote itself, equals it to the bit
    on any input. :func:`~lightning_pdist.sign.bits.truth_table_bits` applies it to packed signs.

    Args:
        num_workers: ``M``.
        vote: ``(M, n)`` ±1 → ``(n,)`` ±1, column by column (default :func:`majority_vote`).

    Returns:
        ``(2^M,)`` bool, indexed as :func:`sign_patterns`.
    """
    return vote(sign_patterns(num_workers)) > 0


def tie_table(num_workers: int) -> Tensor:
    """Entry ``p`` is True iff sign pattern ``p`` splits evenly, ``Σ_m Y_m = 0`` (a tie; never for odd ``M``).

    The vote statistics' tie count, as a truth table for :func:`~lightning_pdist.sign.bits.truth_table_bits`.

    Returns:
        ``(2^M,)`` bool, indexed as :func:`sign_patterns`.
    """
    return sign_patterns(num_workers).sum(0, dtype=torch.int32) == 0


def signum_momentum(momentum: Tensor, grad: Tensor, beta: float) -> Tensor:
    """Signum's local momentum, out of place: ``β·m + (1 − β)·g``.

    Args:
        momentum: the previous buffer ``m`` (fp32).
        grad: the new gradient ``g`` (any floating dtype; promoted to ``momentum``'s dtype).
        beta: ``β`` in ``[0, 1)``; ``0`` returns ``g`` (plain signSGD).

    Returns:
        The new buffer (a new tensor; the caller commits it, so a step can be abandoned).
    """
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"signum_momentum(beta={beta}): beta must be in [0, 1)")
    return momentum.mul(beta).add_(grad.to(momentum.dtype), alpha=1.0 - beta)


def _check_lengths(lengths: Sequence[int], numel: int, caller: str) -> None:
    if sum(lengths) != numel or any(n <= 0 for n in lengths):
        raise ValueError(
            f"{caller}(lengths={list(lengths)}): lengths must be positive and sum to the vector's {numel} elements"
        )


def segment_l1_mean(x: Tensor, lengths: Sequence[int]) -> Tensor:
    """Mean absolute value of each consecutive segment of a flat vector: ``‖x_j‖₁ / numel_j``.

    The sums accumulate in fp64, so that the fp32 result does not depend (barring a rounding
    tie) on how many threads or which vector width reduced it: a simulator and a comm hook
    must agree to the bit.

    Args:
        x: flat vector.
        lengths: segment lengths summing to ``x.numel()`` (a bucket's parameter sizes).

    Returns:
        ``(len(lengths),)`` fp32 tensor.
    """
    _check_lengths(lengths, x.numel(), "segment_l1_mean")
    sums = torch.stack([torch.linalg.vector_norm(seg, 1, dtype=torch.float64) for seg in x.split(list(lengths))])
    return (sums / torch.tensor(list(lengths), dtype=torch.float64)).to(torch.float32)


def ef_sign_compress(vector: Tensor, residual: Tensor, lengths: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
    """EF-signSGD compression (Karimireddy et al., 2019, Alg. 2), out of place.

    ``p = v + e``; ``s_j = ‖p_j‖₁ / numel_j`` per segment ``j``; ``Δ = s·sign(p)``; ``e' = p − Δ``.

    Args:
        vector: the vector to compress ``v`` (gradient or Signum momentum).
        residual: the previous residual ``e`` (fp32, zeros at the start).
        lengths: segment (tensor) lengths; the scale is per segment, as in the paper's per-layer
            compression.

    Returns:
        ``(p, scales, new_residual)``: ``p`` (fp32) whose sign is sent, the ``(T,)`` fp32 scales and
        the new residual ``e'``.
    """
    p = residual + vector.to(residual.dtype)
    scales = segment_l1_mean(p, lengths)
    new_residual = torch.empty_like(p)
    # Segment by segment, e' = p + (−s_j)·sign(p): one pass, no (d,)-sized expanded scale vector.
    for p_j, e_j, s_j in zip(p.split(list(lengths)), new_residual.split(list(lengths)), scales.tolist()):
        torch.add(p_j, binary_sign(p_j), alpha=-s_j, out=e_j)
    return p, scales, new_residual


def ef_scaled_vote(vote: Tensor, worker_scales: Tensor, lengths: Sequence[int]) -> Tensor:
    """The update of a vote under error feedback: ``s̄_j · U`` with ``s̄_j = mean_m s_{m,j}``.

    With one worker this is EF-signSGD's ``Δ = (‖p‖₁/d)·sign(p)``; with several, each tensor's
    step size is the workers' mean scale and its direction the vote. The residuals stay local
    (each worker's own compression error), as in distributed EF-signSGD.

    Args:
        vote: ``(d,)`` ``±1``.
        worker_scales: ``(M, T)`` fp32, row ``m`` from worker ``m``.
        lengths: the ``T`` segment lengths.

    Returns:
        ``(d,)`` fp32.
    """
    out = torch.empty(vote.shape, dtype=torch.float32, device=vote.device)
    for v_j, out_j, s_j in zip(vote.split(list(lengths)), out.split(list(lengths)), worker_scales.mean(0).tolist()):
        torch.mul(v_j, s_j, out=out_j)
    return out


@dataclass
class WorkerVote:
    """What one worker contributes to a vote in one round, before anything is committed.

    Attributes:
        vector: the vector whose sign is sent (``g``, ``m`` or ``g + e``; fp32 unless it is the
            raw gradient).
        scales: EF scales per segment (``None`` without error feedback).
        momentum: the new Signum buffer (``None`` without momentum).
        residual: the new EF residual (``None`` without error feedback).
    """

    vector: Tensor
    scales: Tensor | None
    momentum: Tensor | None
    residual: Tensor | None


def worker_vote(
    grad: Tensor,
    momentum: Tensor | None = None,
    residual: Tensor | None = None,
    *,
    beta: float = 0.0,
    lengths: Sequence[int] | None = None,
) -> WorkerVote:
    """One worker's side of a sign vote: optional Signum momentum, then optional error feedback.

    ``v = g``; with a momentum buffer ``v = m' = β·m + (1 − β)·g``; with a residual
    ``p = v + e`` is signed and ``e' = p − s·sign(p)``. Nothing is modified in place, so a round
    that is abandoned (a non-finite gradient elsewhere) leaves the state as it was.

    Args:
        grad: the flat gradient ``g`` (any floating dtype).
        momentum: Signum buffer, or ``None`` for no momentum.
        residual: EF residual, or ``None`` for no error feedback.
        beta: Signum's ``β``.
        lengths: segment lengths for the EF scales (default: one segment).

    Returns:
        A :class:`WorkerVote`.
    """
    vector = grad
    new_momentum = None
    if momentum is not None:
        new_momentum = signum_momentum(momentum, grad, beta)
        vector = new_momentum
    if residual is None:
        return WorkerVote(vector=vector, scales=None, momentum=new_momentum, residual=None)
    lengths = [grad.numel()] if lengths is None else lengths
    p, scales, new_residual = ef_sign_compress(vector, residual, lengths)
    return WorkerVote(vector=p, scales=scales, momentum=new_momentum, residual=new_residual)
