"""What every strategy's settings share: exact int checks, the error format, and the DDP arguments a strategy owns.

Errors echo the input and state the rule (``docs/architecture.md``, house rule 4):
``ValueError("PipelineStrategy(num_stages=0): num_stages must be >= 1")``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OWNED_DDP_ARGS", "ConfigErrors", "is_int", "refuse_owned_ddp_args"]

#: DDPStrategy arguments that configure gradient communication, which our strategies replace.
OWNED_DDP_ARGS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


def is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def refuse_owned_ddp_args(owner: str, kwargs: dict[str, Any], reason: str) -> None:
    """``ValueError`` naming the first DDP gradient-communication argument set in ``kwargs``; removes the unset ones.

    The caller then passes every :data:`OWNED_DDP_ARGS` name to ``super().__init__`` explicitly as ``None``
    (``super().__init__(ddp_comm_state=None, ..., **kwargs)``): jsonargparse, which builds LightningCLI's options
    by following ``**kwargs``, leaves out arguments a class gives explicitly, so ``--trainer.strategy.help``
    does not offer the arguments the strategy refuses.
    """
    for name in OWNED_DDP_ARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"{owner}({name}={kwargs[name]!r}): {reason}; {name} must be left unset")
    for name in OWNED_DDP_ARGS:
        kwargs.pop(name, None)


class ConfigErrors:
    """Mixin for frozen config dataclasses with an ``owner`` field: ``_fail(arg, rule)`` raises in the house format."""

    owner: str

    def _fail(self, arg: str, rule: str, error: type = ValueError) -> None:
        raise error(f"{self.owner}({arg}={getattr(self, arg)!r}): {rule}")
