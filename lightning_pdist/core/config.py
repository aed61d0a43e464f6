"""What every strategy's settings share: exact int checks, the error format, and the DDP arguments a strategy owns.

Errors echo the input and state the rule (``docs/architecture.md``, house rule 4):
``ValueError("PipelineStrategy(num_stages=0): num_stages must be >= 1")``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OWNED_DDP_ARGS", "ConfigErrors", "OwnedDDPArguments", "is_int", "register_variants"]

#: DDPStrategy arguments that configure gradient communication, which our strategies replace.
OWNED_DDP_ARGS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


def is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


class OwnedDDPArguments:
    """Mixin of the Trainer strategies that own gradient communication, placed between a family's arguments class
    and ``PdistStrategy``: a set :data:`OWNED_DDP_ARGS` argument is refused, ``ValueError`` naming the first one,
    the reason from :attr:`owned_reason`; each is then passed to ``super().__init__`` explicitly as None.

    jsonargparse, which builds LightningCLI's options by following ``**kwargs``, leaves out arguments a class gives
    explicitly, so ``--trainer.strategy.help`` does not offer the arguments the strategy refuses.
    """

    #: The refusal's reason; ``{owner}`` is the class name.
    owned_reason = "{owner} owns gradient communication"

    def __init__(self, **kwargs: Any) -> None:
        self._refuse_owned(kwargs)
        super().__init__(ddp_comm_state=None, ddp_comm_hook=None, ddp_comm_wrapper=None, model_averaging_period=None,
                         **kwargs)

    def _refuse_owned(self, kwargs: dict[str, Any]) -> None:
        """``ValueError`` naming the first owned argument set in ``kwargs``; removes the unset ones. Not inlined in
        ``__init__``: jsonargparse reads that loop's ``kwargs.pop`` there, then offers the owned arguments and loses
        DDP's (``tests/test_cli.py`` checks the view)."""
        owner = type(self).__name__
        for name in OWNED_DDP_ARGS:
            if kwargs.get(name) is not None:
                reason = self.owned_reason.format(owner=owner)
                raise ValueError(f"{owner}({name}={kwargs[name]!r}): {reason}; {name} must be left unset")
            kwargs.pop(name, None)


class ConfigErrors:
    """Mixin for frozen config dataclasses with an ``owner`` field: ``_fail(arg, rule)`` raises in the house format."""

    owner: str

    def _fail(self, arg: str, rule: str, error: type = ValueError) -> None:
        raise error(f"{self.owner}({arg}={getattr(self, arg)!r}): {rule}")


def register_variants(
    registry: Any, cls: type, name: str, description: str, find_unused: bool = True, **init_kwargs: Any
) -> None:
    """Register ``name`` with its ``_fork``/``_spawn`` and ``_find_unused_parameters_true`` variants."""
    for suffix, start_method in (("", None), ("_fork", "fork"), ("_spawn", "spawn")):
        kwargs = dict(init_kwargs, **({"start_method": start_method} if start_method else {}))
        how = f" with the {start_method} start method" if start_method else ""
        registry.register(f"{name}{suffix}", cls, description=description if not how else f"{name}{how}",
                          override=True, **kwargs)  # fmt: skip
        if find_unused:
            registry.register(f"{name}{suffix}_find_unused_parameters_true", cls, override=True,
                              description=f"{name}{how} with find_unused_parameters=True",
                              find_unused_parameters=True, **kwargs)  # fmt: skip
