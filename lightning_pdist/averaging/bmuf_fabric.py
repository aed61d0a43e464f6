"""BMUF (blockwise model-update filtering) as a Lightning Fabric strategy."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from typing_extensions import override

from lightning_pdist.averaging.bmuf import BMUFConfig, BMUFState, bmuf_block_update_, bmuf_global_model
from lightning_pdist.averaging.schedule import PeriodicSchedule
from lightning_pdist.averaging.fabric import ModelAveragingFabricStrategy

__all__ = ["BMUFFabricStrategy"]


class BMUFFabricStrategy(ModelAveragingFabricStrategy):
    """BMUF: local SGD whose block updates are filtered with (Nesterov) block momentum.

    The rule of :class:`~lightning_pdist.averaging.bmuf_strategy.BMUFStrategy` (Chen & Huo, ICASSP 2016), at each block end
    (:mod:`lightning_pdist.averaging.bmuf` has the derivation)::

        G = mean_i(A - W_i);  Δ ← η·Δ + ζ·G;  W_g = A - Δ;  S = W_g - η·Δ (nesterov) or W_g
        every rank loads S;   A ← S

    The consensus (``consensus_weights``, ``load_consensus``, the saved model) is the global model ``W_g``, with an
    open block closed early on a copy.

    Args:
        period: local steps per block (8).
        block_momentum: ``η`` in ``[0, 1)``; ``None`` means ``1 - 1/world_size``.
        block_lr: ``ζ > 0`` (1.0).
        nesterov: start blocks from the look-ahead ``W_g - η·Δ`` (True, the paper's NBM).
        warmup_steps: leading steps that run as plain DDP; the first block starts after them.
        **kwargs: passed to Fabric's :class:`~lightning.fabric.strategies.DDPStrategy`.
    """

    strategy_name = "bmuf"
    one_rank_behaviour = "block momentum and block_lr still act on top of local training"

    def __init__(
        self,
        period: int = 8,
        block_momentum: float | None = None,
        block_lr: float = 1.0,
        nesterov: bool = True,
        warmup_steps: int = 0,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        schedule = PeriodicSchedule(period=period, warmup_steps=warmup_steps, owner=owner)
        self.config = BMUFConfig(block_momentum=block_momentum, block_lr=block_lr, nesterov=nesterov, owner=owner)
        super().__init__(schedule=schedule, **kwargs)
        self.period = period
        self.warmup_steps = warmup_steps
        self.bmuf_state: BMUFState | None = None

    @property
    def block_momentum(self) -> float:
        """The block momentum in force (resolved against the world size)."""
        return self.config.momentum_for(self.rank_world[1])

    @override
    def setup_algorithm(self) -> None:
        super().setup_algorithm()
        self.bmuf_state = BMUFState.starting_from(self.local_vector())

    @override
    def after_warmup_step(self) -> None:
        self.bmuf_state.anchor.copy_(self.local_vector())

    @override
    def reduce_replicas(self) -> Tensor:
        return self.average_of_replicas(count=True)

    @override
    def apply_sync(self, combined: Tensor) -> None:
        cfg, state = self.config, self.bmuf_state
        bmuf_block_update_(state.anchor, state.delta, combined, self.block_momentum, cfg.block_lr, cfg.nesterov)
        self.load_vector(state.anchor)

    @override
    def consensus(self) -> Tensor:
        block_open = self.step > self.warmup_steps and not self.schedule.syncs_after(self.step)
        mean_local = self.average_of_replicas() if block_open else self.local_vector()
        cfg, state = self.config, self.bmuf_state
        return bmuf_global_model(state.anchor, state.delta, mean_local, self.block_momentum, cfg.block_lr,
                                 block_open=block_open, nesterov=cfg.nesterov)  # fmt: skip

    @override
    def algorithm_state_dict(self) -> dict:
        return self.bmuf_state.state_dict()

    @override
    def load_algorithm_state_dict(self, state: dict) -> None:
        self.bmuf_state.load_state_dict(state)
