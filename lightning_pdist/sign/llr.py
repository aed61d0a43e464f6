"""IT-signSGD: the log-likelihood-ratio (LLR) weighted majority vote with learned reliabilities.

Paper 004 (``shared/seeds/004_*.txt``; KICS). ``M`` workers send ``Y_{m,n} = sign(g_{m,n})``;
the aggregate is (eq. 3)::

    U_n = sign( Σ_m w_{m,n} · Y_{m,n} ),      w_{m,n} = log((1 − p_{m,n}) / p_{m,n})

where ``p_{m,n}`` (eq. 4) is the fraction of past rounds in which worker ``m``'s sign for
coordinate ``n`` differed from the aggregate. For the first ``warmup_rounds`` rounds the
estimates are unreliable and the plain majority vote is used (``w ≡ 1``); the disagreement
counts are collected from round 0 on, against whatever aggregate was applied. Workers apply
``x ← x − δ·U`` (eq. 5).

This is the Chair–Varshney fusion rule (IEEE TAES 1986) for independent binary decisions with
symmetric error probabilities ``p_m`` and equal priors, i.e. the maximum-likelihood decision for
``sign(E g_n)``; the plain majority vote is its special case ``p_m ≡ p``. Workers with smaller
batches have noisier signs, disagree with the aggregate more often, and so weigh less.

Decisions made here (each is a parameter of :class:`LLRConfig`):

* **Causal reading of eq. 4.** Eq. 4 sums up to the current round ``t``, but ``Û^t`` depends on
  ``p̂^t``; the weights of round ``t`` therefore use the counts of rounds ``0 … t−1``, and the
  counts are updated with round ``t``'s disagreements after the vote.
* **Laplace smoothing, then clipping.** ``p = (k + 1) / (t + 2)`` instead of ``k / t``: a worker
  that never disagreed would otherwise get ``w = log(1/0) = ∞`` and dictate every vote. The
  smoothed estimate is the posterior mean under a uniform prior, lies in ``(0, 1)`` for every
  ``t ≥ 0`` and equals eq. 4 as ``t → ∞``. The weight is then clipped to ``|w| ≤ max_weight``
  (default ``log 99 ≈ 4.6``, i.e. ``p`` held in ``[0.01, 0.99]``), so that a worker that happened
  to agree in every early round cannot outvote many others on that luck alone.
* **No negative weights by default.** A worker with ``p > 1/2`` gets ``w < 0`` under the exact
  rule, i.e. its votes are inverted; that is optimal against a consistently inverting worker
  but amplifies noise in estimates. By default ``w`` is clipped at 0 (such a worker is ignored),
  keeping the majority vote's robustness to fewer than half adversarial workers;
  ``negative_weights=True`` gives the exact Chair–Varshney rule.
* **Ties.** A weighted sum that is zero up to floating-point rounding (all weights 0, or an exact
  cancellation such as ``log 4 − 2·log 2``, common while the counts are small integers) falls
  back to the unweighted majority vote, whose own tie goes to ``+1``
  (:mod:`~lightning_pdist.sign.vote`). With ``warmup_rounds=0`` the first round therefore
  is the majority vote.

Estimators (``estimator=``), with memory per aggregating rank when the vote is sharded over
``M`` ranks (each rank aggregates ``d/M`` coordinates):

==============  ==============================================  =========================
estimator       ``p`` shared by                                   statistics per rank
==============  ==============================================  =========================
``coordinate``  nothing: one ``p_{m,n}`` per worker and coord     ``M · d/M = d`` fp32
                (the paper's eq. 4; one observation per round,
                so it is noisy for many rounds)
``tensor``      the coordinates of one parameter tensor           ``M · T`` fp64
``worker``      all coordinates (of one DDP bucket, in hooks)     ``M`` fp64
==============  ==============================================  =========================

The pooled estimators see ``d`` (or ``numel_j``) observations per round instead of one, and in
the heterogeneous-batch setting the error rate is a property of the worker's batch size
rather than of the coordinate; ``worker`` is the default until the benchmark says otherwise.

Self-reference: ``p`` is measured against the aggregate, which contains the worker's own vote
(as eq. 4 prescribes). With few honest workers this pulls the weights toward the majority vote:
for three workers with independent sign errors the pooled estimates settle where no worker
outweighs the other two, and the LLR vote then *is* the majority vote (measured with error
rates 0.05/0.3/0.5 and 0.45/0.45/0.02). The weights change the outcome when one worker is much
worse than the rest (it is down-weighted to 0 and the others decide) or when there are many
workers, as in the paper's ``M = 15``.

``decay`` turns the running fraction into an exponential moving average of both counts,
``k ← decay·k + 1[Y ≠ U]``, ``t ← decay·t + 1`` (an effective window of ``1/(1 − decay)`` rounds),
so the estimate keeps adapting when worker quality drifts (learning-rate decay, batch-size
schedules). ``decay=1`` is eq. 4.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from lightning_pdist.sign.vote import binary_sign, majority_vote, sign_patterns, vote_table

__all__ = [
    "DEFAULT_MAX_WEIGHT",
    "ESTIMATORS",
    "LLRConfig",
    "LLRState",
    "column_ids",
    "disagreement_counts",
    "llr_observe_",
    "llr_round_",
    "llr_vote",
    "llr_weights",
    "observations_per_round",
    "pooled_vote_tables",
    "vote_weights",
    "weight_sums",
    "weighted_vote",
]

ESTIMATORS = ("coordinate", "tensor", "worker")
DEFAULT_MAX_WEIGHT = math.log(99.0)


@dataclass(frozen=True)
class LLRConfig:
    """Hyperparameters of the LLR-weighted vote; checks itself on construction.

    Attributes:
        warmup_rounds: rounds of plain majority vote before the weights are used. The
            statistics are collected from the first round. With the ``coordinate`` estimator
            a few tens of rounds are needed before ``p`` means anything; the pooled estimators
            see thousands of observations per round and need only a few.
        estimator: ``"coordinate"`` (paper), ``"tensor"`` or ``"worker"``; see the module docstring.
        decay: ``1.0`` for the running fraction of eq. 4, ``< 1`` for an exponential moving
            average (``0.99`` ≈ the last 100 rounds).
        max_weight: bound on ``|w|``; ``log((1 − ε)/ε)`` corresponds to clipping ``p`` to
            ``[ε, 1 − ε]``.
        negative_weights: allow ``w < 0`` (invert workers that are wrong more often than not).
        owner: the name used in error messages (the state or strategy building this config).
    """

    warmup_rounds: int = 10
    estimator: str = "worker"
    decay: float = 1.0
    max_weight: float = DEFAULT_MAX_WEIGHT
    negative_weights: bool = False
    owner: str = "LLRConfig"

    def __post_init__(self) -> None:
        if isinstance(self.warmup_rounds, bool) or not isinstance(self.warmup_rounds, int):
            raise TypeError(f"{self.owner}(warmup_rounds={self.warmup_rounds!r}): warmup_rounds must be an int")
        if self.warmup_rounds < 0:
            raise ValueError(f"{self.owner}(warmup_rounds={self.warmup_rounds}): warmup_rounds must be >= 0")
        if self.estimator not in ESTIMATORS:
            choices = ", ".join(repr(e) for e in ESTIMATORS)
            raise ValueError(f"{self.owner}(estimator={self.estimator!r}): estimator must be one of {choices}")
        for name in ("decay", "max_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{self.owner}({name}={value!r}): {name} must be a number (a bool or a string is not)")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"{self.owner}(decay={self.decay}): decay must be in (0, 1]")
        if not (self.max_weight > 0 and math.isfinite(self.max_weight)):
            raise ValueError(f"{self.owner}(max_weight={self.max_weight}): max_weight must be finite and > 0")

    @classmethod
    def of(cls, settings: Any, owner: str) -> LLRConfig:
        """The config of ``settings``' attributes of the same names (a hook state's or a simulator's), checked as
        ``owner``."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls) if f.name != "owner"}, owner=owner)


@dataclass
class LLRState:
    """Disagreement statistics of one vote (one DDP bucket, or one slice of it).

    Attributes:
        estimator: which estimator the shapes belong to.
        disagreements: ``k``, the (decayed) count of rounds in which ``Y ≠ U``:
            ``(M, n)`` fp32 for ``coordinate``, ``(M, G)`` fp64 for the pooled estimators
            (``G`` = 1 for ``worker``, the number of tensors for ``tensor``).
        observations: ``t``, the (decayed) number of observations behind each count:
            a 0-d fp32 tensor for ``coordinate``, ``(G,)`` fp64 otherwise.
        rounds: rounds observed so far (decides the warm-up).
    """

    estimator: str
    disagreements: Tensor
    observations: Tensor
    rounds: int = 0

    @classmethod
    def zeros(cls, estimator: str, world_size: int, num_columns: int) -> "LLRState":
        """Fresh statistics for ``world_size`` workers and ``num_columns`` coordinates or groups.

        Args:
            estimator: one of :data:`ESTIMATORS`.
            world_size: ``M``.
            num_columns: coordinates (``coordinate``), tensors (``tensor``) or 1 (``worker``).
        """
        if estimator not in ESTIMATORS:
            choices = ", ".join(repr(e) for e in ESTIMATORS)
            raise ValueError(f"LLRState.zeros(estimator={estimator!r}): estimator must be one of {choices}")
        if estimator == "worker" and num_columns != 1:
            raise ValueError(f"LLRState.zeros(num_columns={num_columns}): the 'worker' estimator has exactly 1 column")
        if estimator == "coordinate":
            return cls(estimator, torch.zeros(world_size, num_columns), torch.zeros(()))
        return cls(
            estimator,
            torch.zeros(world_size, num_columns, dtype=torch.float64),
            torch.zeros(num_columns, dtype=torch.float64),
        )

    def state_dict(self) -> dict:
        return {
            "estimator": self.estimator,
            "disagreements": self.disagreements.clone(),
            "observations": self.observations.clone(),
            "rounds": self.rounds,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore counts saved by :meth:`state_dict`; the estimator and shapes must match."""
        if state["estimator"] != self.estimator:
            raise ValueError(
                f"LLRState.load_state_dict(estimator={state['estimator']!r}): the saved statistics belong to "
                f"another estimator than this state's {self.estimator!r}"
            )
        for name in ("disagreements", "observations"):
            saved, mine = state[name], getattr(self, name)
            if tuple(saved.shape) != tuple(mine.shape):
                raise ValueError(
                    f"LLRState.load_state_dict({name}.shape={tuple(saved.shape)}): expected {tuple(mine.shape)} "
                    "(same number of workers and coordinates)"
                )
            mine.copy_(saved)
        self.rounds = int(state["rounds"])


def llr_weights(
    disagreements: Tensor,
    observations: Tensor,
    *,
    max_weight: float = DEFAULT_MAX_WEIGHT,
    negative_weights: bool = False,
) -> Tensor:
    """``w = log((1 − p)/p)`` with the Laplace estimate ``p = (k + 1)/(t + 2)``, clipped.

    ``(1 − p)/p = (t + 1 − k)/(k + 1)``, which is what is computed.

    Args:
        disagreements: ``k``, any shape.
        observations: ``t``, broadcastable to ``k``.
        max_weight: ``|w|`` bound.
        negative_weights: if False, ``w`` is clipped at 0 from below.

    Returns:
        Weights of ``k``'s shape and dtype.
    """
    w = torch.log((observations + 1.0 - disagreements) / (disagreements + 1.0))
    return w.clamp(-max_weight if negative_weights else 0.0, max_weight)


def weighted_vote(signs: Tensor, weights: Tensor) -> Tensor:
    """``U_n = sign(Σ_m w_{m,n} Y_{m,n})``; a tie falls back to the majority vote (then +1).

    A tie is a sum that is zero up to rounding: ``|Σ_m w Y| <= M·ε·Σ_m |w|`` (``ε`` the dtype's
    machine epsilon), which covers the rounding of an ``M``-term sum.

    The sum runs over the workers in order, one vectorized add per worker, so that its rounding
    does not depend on ``n`` or on the thread count: a vote over a slice of the coordinates
    equals the same slice of the vote over all of them, to the bit.

    Args:
        signs: ``(M, n)`` ``±1``.
        weights: ``(M, n)`` or ``(M, 1)`` floating weights.

    Returns:
        ``(n,)`` ``int8`` ``±1``.
    """
    if signs.dim() != 2 or weights.dim() != 2 or weights.shape[0] != signs.shape[0]:
        raise ValueError(
            f"weighted_vote(signs.shape={tuple(signs.shape)}, weights.shape={tuple(weights.shape)}): "
            "signs must be (M, n) and weights (M, n) or (M, 1)"
        )
    num_workers = signs.shape[0]
    total = torch.zeros(signs.shape[1], dtype=weights.dtype, device=signs.device)
    mass = torch.zeros(weights.shape[1], dtype=weights.dtype, device=signs.device)  # (n,) or (1,): Σ_m |w_m|
    for m in range(num_workers):
        total += weights[m] * signs[m]  # ±w exactly
        mass += weights[m].abs()
    # With integer counts, sums such as log 4 − 2·log 2 are exactly zero in real arithmetic but not in floating
    # point; anything within the rounding bound of an M-term sum is a tie.
    tie = total.abs() <= num_workers * torch.finfo(total.dtype).eps * mass
    if bool(tie.any()):
        # Replace each tie by its unweighted sum Σ_m Y_m, whose sign (0 → +1) is the majority vote. Arithmetic
        # instead of torch.where, which is several times slower on CPU.
        total.masked_fill_(tie, 0.0)
        total += tie * signs.sum(0, dtype=torch.int16 if num_workers < 2**15 else torch.int32)
    return binary_sign(total)


def column_ids(lengths: Sequence[int], start: int = 0, stop: int | None = None) -> Tensor:
    """Tensor index of coordinates ``start … stop−1`` of a bucket made of tensors of ``lengths``.

    Args:
        lengths: tensor sizes in bucket order.
        start: first coordinate.
        stop: one past the last coordinate (default: the end).

    Returns:
        ``(stop − start,)`` int64 tensor.
    """
    ids = torch.arange(len(lengths)).repeat_interleave(torch.tensor(list(lengths)))
    return ids[start:stop]


def observations_per_round(estimator: str, lengths: Sequence[int]) -> Tensor | float:
    """How much ``t`` grows per round for a bucket of tensors of ``lengths``.

    ``1`` per coordinate; ``numel_j`` per tensor; ``d`` per worker.
    """
    if estimator == "coordinate":
        return 1.0
    if estimator == "tensor":
        return torch.tensor(list(lengths), dtype=torch.float64)
    return torch.tensor([float(sum(lengths))], dtype=torch.float64)


def _state_weights(state: LLRState, config: LLRConfig) -> Tensor:
    """``w`` of every column of the state, fp32: ``(M, n)`` (coordinate) or ``(M, G)`` (pooled)."""
    return llr_weights(
        state.disagreements,
        state.observations,
        max_weight=config.max_weight,
        negative_weights=config.negative_weights,
    ).to(torch.float32)


def weight_sums(state: LLRState, config: LLRConfig) -> tuple[Tensor, Tensor]:
    """The pieces of each worker's observation-weighted mean weight: ``(Σ_c w_{m,c}·t_c, Σ_c t_c)``.

    ``w`` as the vote would use it after the warm-up, ``t`` the observations behind each column (coordinates ×
    rounds for the pooled estimators, rounds for ``coordinate``). Sums of several states (buckets, a sharded
    vote's slices) divided give one weight per worker: for the ``worker`` estimator on one bucket, its weight.

    Returns:
        ``(M,)`` and 0-d fp64 tensors.
    """
    w = _state_weights(state, config).to(torch.float64)  # (M, n) or (M, G)
    t = state.observations.to(torch.float64).expand(w.shape[1])  # (n,) or (G,)
    return (w * t).sum(1), t.sum()


def vote_weights(state: LLRState, config: LLRConfig, columns: Tensor | None = None) -> Tensor:
    """The weights ``w`` for the coordinates the state covers, as ``(M, n)`` or ``(M, 1)`` fp32.

    Args:
        state: statistics (for ``coordinate``: of exactly the coordinates being voted on).
        config: clipping settings.
        columns: for the ``tensor`` estimator, each coordinate's tensor index
            (:func:`column_ids`).
    """
    w = _state_weights(state, config)
    if state.estimator == "tensor":
        if columns is None:
            raise ValueError("vote_weights(columns=None): the 'tensor' estimator needs each coordinate's tensor index")
        return w[:, columns]
    return w


def llr_vote(
    signs: Tensor, state: LLRState, config: LLRConfig, columns: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """Eq. 3 after the warm-up, the majority vote during it. Does not update ``state``.

    Args:
        signs: ``(M, n)`` ``±1``.
        state: the statistics so far.
        config: warm-up and clipping.
        columns: tensor index per coordinate (``tensor`` estimator only).

    Returns:
        ``(U, w)``: the ``(n,)`` ``int8`` vote and the weights used (``None`` during warm-up).
    """
    if state.rounds < config.warmup_rounds:
        return majority_vote(signs), None
    w = vote_weights(state, config, columns)
    return weighted_vote(signs, w), w


def pooled_vote_tables(state: LLRState, config: LLRConfig) -> Tensor:
    """:func:`llr_vote` of each pooled group as a truth table over the ``2^M`` sign patterns.

    With a pooled estimator every coordinate of group ``j`` (a tensor, or the whole bucket) votes
    with the same weights ``w_{:,j}``, so its ``U`` depends only on its ``M`` signs; row ``j`` holds
    ``U > 0`` for each pattern (:func:`~lightning_pdist.sign.vote.sign_patterns`), computed by
    :func:`weighted_vote` itself (or the majority vote during the warm-up), hence bit-identical to
    voting coordinate by coordinate. Cost ``O(G · M · 2^M)``, independent of ``d``.

    Args:
        state: pooled statistics (``tensor`` or ``worker``).
        config: warm-up and clipping.

    Returns:
        ``(G, 2^M)`` bool.
    """
    if state.estimator == "coordinate":
        raise ValueError("pooled_vote_tables(state.estimator='coordinate'): per-coordinate weights have no table")
    num_workers, num_groups = state.disagreements.shape
    if state.rounds < config.warmup_rounds:
        return vote_table(num_workers).expand(num_groups, -1)
    w = _state_weights(state, config)  # (M, G)
    size = 2**num_workers
    # Group j's patterns are columns j·2^M … (j+1)·2^M − 1: one weighted_vote call for all groups.
    patterns = sign_patterns(num_workers).repeat(1, num_groups)  # (M, G·2^M)
    return (weighted_vote(patterns, w.repeat_interleave(size, dim=1)) > 0).view(num_groups, size)


def disagreement_counts(
    signs: Tensor, vote: Tensor, estimator: str, columns: Tensor | None = None, num_columns: int | None = None
) -> Tensor:
    """This round's ``1[Y_{m,n} ≠ U_n]``, summed as the estimator pools them.

    Args:
        signs: ``(M, n)`` ``±1``.
        vote: ``(n,)`` ``±1``.
        estimator: one of :data:`ESTIMATORS`.
        columns: tensor index per coordinate (``tensor``).
        num_columns: number of tensors (``tensor``).

    Returns:
        ``(M, n)`` bool (``coordinate``), ``(M, 1)`` int64 (``worker``) or ``(M, num_columns)``
        int64 (``tensor``).
    """
    differs = signs != vote  # (M, n) bool
    if estimator == "coordinate":
        return differs
    if estimator == "worker":
        return differs.sum(1, keepdim=True, dtype=torch.int64)
    if columns is None or num_columns is None:
        raise ValueError("disagreement_counts(columns=None): the 'tensor' estimator needs columns and num_columns")
    counts = torch.zeros(signs.shape[0], num_columns, dtype=torch.int64, device=signs.device)
    return counts.index_add_(1, columns, differs.to(torch.int64))


def llr_observe_(state: LLRState, counts: Tensor, observations: Tensor | float, decay: float = 1.0) -> None:
    """Fold one round into the statistics: ``k ← decay·k + counts``, ``t ← decay·t + observations``.

    Args:
        state: statistics to update in place; ``rounds`` grows by one.
        counts: from :func:`disagreement_counts` (summed over shards where the vote is sharded).
        observations: from :func:`observations_per_round`.
        decay: ``1`` for eq. 4's running fraction, ``< 1`` for an EMA.
    """
    if decay != 1.0:
        state.disagreements.mul_(decay)
        state.observations.mul_(decay)
    state.disagreements.add_(counts.to(state.disagreements.dtype))
    state.observations.add_(observations)
    state.rounds += 1


def llr_round_(
    signs: Tensor, state: LLRState, config: LLRConfig, lengths: Sequence[int] | None = None
) -> tuple[Tensor, Tensor | None]:
    """One complete round over all coordinates of a bucket: vote (eq. 3), then count (eq. 4).

    Args:
        signs: ``(M, d)`` ``±1``.
        state: statistics of this bucket (``coordinate``: ``d`` columns; ``tensor``:
            ``len(lengths)``; ``worker``: 1).
        config: the vote's hyperparameters.
        lengths: the bucket's tensor sizes (default: one tensor of ``d``).

    Returns:
        ``(U, w)`` as :func:`llr_vote`.
    """
    lengths = [signs.shape[1]] if lengths is None else list(lengths)
    columns = column_ids(lengths) if config.estimator == "tensor" else None
    vote, weights = llr_vote(signs, state, config, columns)
    counts = disagreement_counts(signs, vote, config.estimator, columns, len(lengths))
    llr_observe_(state, counts, observations_per_round(config.estimator, lengths), config.decay)
    return vote, weights
