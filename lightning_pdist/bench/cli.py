"""The suites' command line, generated from each suite's ``SuiteConfig`` with jsonargparse.

A suite states its options once, as the fields of its frozen ``SuiteConfig`` dataclass, each with a
docstring (the option's help) and a default; :class:`SuiteCli` turns the fields into options of a
``jsonargparse.ArgumentParser`` (``world_sizes`` → ``--world-sizes``, a ``tuple`` field takes one or more
values, a ``Literal`` its choices) and parsed arguments back into a validated config. ``--quick`` picks the
small plan: a field the user did not give takes its value from the ``quick`` or ``full`` plan where that
names it, else the dataclass default. The config's ``__post_init__`` checks the rules and its
``ValueError`` names the option, the value and the rule.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal

__all__ = ["SuiteCli", "SuiteRules", "field_help", "suite_parser"]


def _flag(flags: Mapping[str, str], name: str) -> str:
    return flags.get(name, "--" + name.replace("_", "-"))


class SuiteRules:
    """What a suite's ``SuiteConfig`` inherits: rule checks whose ``ValueError`` names the option, value and rule.

    ``SUITE`` opens every message (``pipeline(--steps=0): must be an int >= 1``); ``FLAGS`` maps a field to its
    option where that is not ``--`` + the field's name with dashes (the CLI reads the same map).
    """

    SUITE: ClassVar[str]
    FLAGS: ClassVar[Mapping[str, str]] = {}

    def bad(self, name: str, value: Any, rule: str) -> ValueError:
        """The error for field ``name`` (or an option, ``--...``) holding ``value``."""
        option = name if name.startswith("--") else _flag(self.FLAGS, name)
        return ValueError(f"{self.SUITE}({option}={value!r}): {rule}")

    def ints(self, *names: str, low: int = 1) -> None:
        """Each field of ``names`` is an int (not a bool) >= ``low``."""
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise self.bad(name, value, f"must be an int >= {low}")

    def positive(self, *names: str, unit: str = "") -> None:
        """Each field of ``names`` is > 0."""
        for name in names:
            if not getattr(self, name) > 0:
                raise self.bad(name, getattr(self, name), f"must be > 0{unit}")

    def distinct(self, name: str, allowed: Any = None) -> None:
        """Field ``name`` holds at least one value, none repeated, each in ``allowed`` (when given)."""
        values = getattr(self, name)
        if not values or len(set(values)) != len(values):
            raise self.bad(name, values, "give at least one value, none repeated")
        if allowed is not None and any(v not in allowed for v in values):
            raise self.bad(name, values, f"each value must be one of {allowed}")

    def earlier(self) -> None:
        """``keep_from``, unless ``None``, is an existing file (an earlier ``<SUITE>.json``)."""
        keep_from = getattr(self, "keep_from")
        if keep_from is not None and not Path(keep_from).is_file():
            raise self.bad("keep_from", keep_from, f"must be an existing {self.SUITE}.json")


def field_help(config: type) -> dict[str, str]:
    """The attribute docstrings of ``config``'s fields (what jsonargparse shows as their help)."""
    import docstring_parser

    doc = docstring_parser.parse_from_object(config)
    return {p.arg_name: " ".join((p.description or "").split()) for p in doc.params if p.args[:1] == ["attribute"]}


def suite_parser(prog: str, description: str | None) -> Any:
    """A jsonargparse parser whose help is each option's own text (it already names its default)."""
    from jsonargparse import ArgumentParser, DefaultHelpFormatter

    class Help(argparse.RawDescriptionHelpFormatter, DefaultHelpFormatter):
        def _get_help_string(self, action: Any) -> str:
            return action.help or ""

    return ArgumentParser(prog=prog, description=description, formatter_class=Help)


def _show(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)


@dataclass(frozen=True)
class SuiteCli:
    """How a suite's ``SuiteConfig`` becomes its options and back.

    Args:
        config: the suite's config dataclass (every field has a default and a docstring).
        quick: field → value of the ``--quick`` plan.
        full: field → value of the plan without ``--quick``.
        out: what ``--out`` receives, for its help.
        either: field → its values: the option takes one of them, or ``both`` for all.
        parsers: field → the function that reads one of its values (``argparse.ArgumentTypeError`` on a bad one).
        derive: ``(kwargs, given) -> kwargs``: a last adjustment, knowing which options were given.
    """

    config: type
    quick: Mapping[str, Any]
    full: Mapping[str, Any]
    out: str
    either: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    parsers: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)
    derive: Callable[[dict[str, Any], set[str]], dict[str, Any]] | None = None

    def flag(self, name: str) -> str:
        """The option of field ``name``."""
        return _flag(getattr(self.config, "FLAGS", {}), name)

    def _default(self, f: Any) -> str:
        if f.name in self.quick:
            return f"default: {_show(self.quick[f.name])} quick, {_show(self.full[f.name])} full"
        if f.name in self.either:
            return "default both"
        return f"default {_show(f.default)}"

    def add_arguments(self, parser: Any) -> None:
        """Add ``--quick``, ``--out`` and one option per config field to ``parser`` (a jsonargparse parser)."""
        docs, hints = field_help(self.config), typing.get_type_hints(self.config)
        plans = lambda plan: ", ".join(f"{k}={_show(v)}" for k, v in plan.items())  # noqa: E731
        parser.add_argument("--quick", action="store_true",
                            help=f"the small plan ({plans(self.quick)}). Without it: {plans(self.full)}")  # fmt: skip
        parser.add_argument("--out", required=True, help=f"directory for {self.out}")
        for f in fields(self.config):
            if f.name == "quick":
                continue
            hint, kwargs = hints[f.name], {}
            if f.name in self.either:
                kwargs["type"] = Literal[(*self.either[f.name], "both")]  # type: ignore[misc]
            elif typing.get_origin(hint) is tuple:
                kwargs.update(type=self.parsers.get(f.name, typing.get_args(hint)[0]), nargs="+")
            else:
                kwargs["type"] = self.parsers.get(f.name, hint)
            help = f"{docs.get(f.name, f.name)} ({self._default(f)})".replace("%", "%%")
            parser.add_argument(self.flag(f.name), dest=f.name, default=None, help=help, **kwargs)

    def config_of(self, args: Any) -> Any:
        """The validated config of parsed ``args`` (``ValueError`` names a bad option, its value and the rule)."""
        plan = self.quick if args.quick else self.full
        kwargs, given = {}, set()
        for f in fields(self.config):
            if f.name == "quick":
                kwargs["quick"] = bool(args.quick)
                continue
            value = getattr(args, f.name)
            if value is None:
                value = plan[f.name] if f.name in plan else (f.default if f.default is not MISSING else f.default_factory())
            else:
                given.add(f.name)
                if f.name in self.either:
                    value = self.either[f.name] if value == "both" else (value,)
                elif isinstance(value, list):
                    value = tuple(value)
            kwargs[f.name] = value
        if self.derive is not None:
            kwargs = self.derive(kwargs, given)
        return self.config(**kwargs)
