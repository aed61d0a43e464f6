"""The ``pdist`` console script: LightningCLI with every lightning_pdist strategy registered.

Usage::

    pdist recipes                                   # the shipped recipes: name, strategy, what each runs
    pdist recipes bmuf > my_bmuf.yaml               # one recipe's YAML, to copy and change
    pdist fit --config bmuf                         # a shipped recipe by name (no checkout needed)
    pdist fit --config recipes/local_sgd.yaml --trainer.strategy.init_args.period=16
    pdist fit --trainer.strategy=easgd --trainer.devices=2 --trainer.accelerator=cpu
    pdist fit --trainer.strategy.help BMUFStrategy  # one strategy's arguments

The model is :class:`~lightning_pdist.models.ClassifierModule` by default (a recipe's ``model:`` gives its init
args) or any LightningModule named by ``class_path`` (the RL recipes: ``lightning_pdist.rl.DQNModule``, with
``data: null``: the module paces its own loop); the data module is any LightningDataModule chosen by ``class_path``
(default: the scikit-learn digits; the shipped ones are :class:`~lightning_pdist.data.PdistDataModule`'s
subclasses). Strategy names resolve because this module imports :mod:`lightning_pdist`, which registers
them; ``class_path: lightning_pdist.BMUFStrategy`` works in any LightningCLI too.

``--config NAME`` (also ``NAME.yaml`` or ``recipes/NAME.yaml``) names a shipped recipe when no such file exists
in the working directory; the recipes ship in the package (``lightning_pdist/recipes/``, links to the checkout's
``recipes/``). Paths inside a recipe (``default_root_dir: runs/bmuf``) stay relative to the working directory.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import yaml
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import lightning_pdist  # noqa: F401  (registers the strategy names)

__all__ = ["RECIPES_DIR", "LoggedConfig", "PdistCLI", "main", "resolve_recipe_args", "shipped_recipes"]

#: The recipes that ship with the package (in a checkout: links to ``recipes/*.yaml``).
RECIPES_DIR = Path(__file__).resolve().with_name("recipes")
_RECIPE_REF = re.compile(r"(?:recipes/)?([A-Za-z0-9_-]+)(?:\.ya?ml)?")  # bmuf, bmuf.yaml, recipes/bmuf.yaml


class LoggedConfig(SaveConfigCallback):
    """Lightning's config file in the log dir, and the whole resolved config in every logger (``{"config": ...}``).

    W&B, CSV (``hparams.yaml``) and TensorBoard then hold the run's configuration; the strategy adds its resolved
    settings under ``"pdist"`` (:mod:`lightning_pdist.core.run_logging`). Runs on rank 0 only.
    """

    def save_config(self, trainer, pl_module, stage) -> None:  # noqa: ANN001 - Lightning's signature
        config = yaml.safe_load(self.parser.dump(self.config, skip_none=False))
        for logger in trainer.loggers:
            logger.log_hyperparams({"config": config})


class PdistCLI(LightningCLI):
    """LightningCLI with ClassifierModule as the default model and the digits data as the default data module."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"data": {"class_path": "lightning_pdist.data.DigitsDataModule"},
                             "model": {"class_path": "lightning_pdist.models.ClassifierModule"}})  # fmt: skip


def shipped_recipes() -> dict[str, Path]:
    """Recipe name (file stem) -> its YAML in the installed package, sorted by name."""
    return {path.stem: path for path in sorted(RECIPES_DIR.glob("*.yaml"))}


def resolve_recipe_args(args: list[str]) -> list[str]:
    """``args`` with each ``--config``/``-c`` value that names a shipped recipe, and is no file here, made its path.

    A value that exists in the working directory is left alone, as is anything else (inline YAML, other paths:
    LightningCLI reports those). A bare name that is neither a file nor a shipped recipe stops with the list.
    """
    recipes = shipped_recipes()
    resolved = list(args)
    for i, arg in enumerate(args):
        if arg in ("-c", "--config") and i + 1 < len(args):
            index, prefix, value = i + 1, "", args[i + 1]
        elif arg.startswith("--config="):
            index, prefix, value = i, "--config=", arg[len("--config="):]
        else:
            continue
        match = _RECIPE_REF.fullmatch(value)
        if os.path.exists(value) or not match:
            continue
        if match[1] not in recipes:
            if value == match[1]:  # a bare word can only have meant a recipe
                sys.exit(f"pdist: --config {value}: no such file in {os.getcwd()} and no shipped recipe of that name; "
                         f"shipped recipes: {', '.join(recipes)} (`pdist recipes` describes them)")  # fmt: skip
            continue
        resolved[index] = prefix + str(recipes[match[1]])
        rank_zero_info(f"pdist: --config {value}: no such file here, using the shipped recipe {recipes[match[1]]}")
    return resolved


def _describe(path: Path) -> tuple[str, str]:
    """(strategy class, first sentence of the leading comment) of a recipe file."""
    text = path.read_text()
    comment = []
    for line in text.splitlines():
        if not line.startswith("#") or line.lstrip("# ").startswith("Run:"):
            break
        comment.append(line.lstrip("# ").strip())
    sentence = re.split(r"(?<=[a-z0-9)])\.\s+(?=[A-Z])", " ".join(comment), maxsplit=1)[0]
    if len(sentence) > 80:
        sentence = sentence[:80].rsplit(" ", 1)[0].rstrip(",;:") + " …"
    strategy = (yaml.safe_load(text).get("trainer") or {}).get("strategy")
    name = strategy.get("class_path", "") if isinstance(strategy, dict) else str(strategy or "auto")
    return name.rsplit(".", 1)[-1], sentence


def print_recipes(args: list[str]) -> None:
    """``pdist recipes``: the table of shipped recipes; ``pdist recipes NAME``: that recipe's YAML."""
    recipes = shipped_recipes()
    if args and args[0] in ("-h", "--help"):
        print("usage: pdist recipes [NAME]\n\nWithout NAME: list the shipped recipes. With NAME: print its YAML.")
        return
    if args:
        if args[0] not in recipes:
            sys.exit(f"pdist recipes {args[0]}: no shipped recipe of that name; shipped recipes: {', '.join(recipes)}")
        print(recipes[args[0]].read_text(), end="")
        return
    rows = [(name, *_describe(path)) for name, path in recipes.items()]
    width = [max(len(row[k]) for row in rows + [("recipe", "strategy", "")]) for k in (0, 1)]
    print(f"{'recipe':<{width[0]}}  {'strategy':<{width[1]}}  what it runs")
    for name, strategy, sentence in rows:
        print(f"{name:<{width[0]}}  {strategy:<{width[1]}}  {sentence}")
    print(f"\nRun one: pdist fit --config NAME (e.g. --config bmuf); show one: pdist recipes NAME. Files: {RECIPES_DIR}")


def main(args: list[str] | None = None) -> None:
    """Entry point of ``pdist``; ``args`` replaces ``sys.argv[1:]`` (for tests)."""
    if args is None:
        # In place: Lightning's popen launcher starts the other ranks with this sys.argv, so they get the path too.
        sys.argv[1:] = resolve_recipe_args(sys.argv[1:])
    else:
        args = resolve_recipe_args(args)
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["recipes"]:
        print_recipes(argv[1:])
        return
    PdistCLI(
        LightningModule,
        None,  # data not required: a DQN module paces its own loop (``data: null``); the default stays the digits
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_callback=LoggedConfig,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
