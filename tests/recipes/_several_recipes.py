"""Several recipes in one popen launch: ``python _several_recipes.py OUT RECIPE.yaml ...`` (tests/recipes/test_recipes.py).

Rank 0 runs ``pdist fit --config RECIPE`` (:func:`lightning_pdist.cli.main`, what the ``pdist`` console script
calls) for each recipe in turn, each with a CSVLogger in ``OUT/<recipe>``. The first fit's popen launcher starts rank
1 by running this script again with the same arguments (as it re-runs ``pdist``); from then on both processes hold
the job's process group and go through the same recipes, as a user's script with several Trainers would. A recipe
that fails writes ``OUT/<recipe>.error`` (its traceback) and ends the process: its peer then fails too, and the test
names the recipes that never ran. Each recipe that ends writes ``OUT/<recipe>.done.rank<r>``.
"""

import os
import sys
import traceback
from pathlib import Path

from lightning_pdist.cli import main

OVERRIDES = ["--trainer.max_steps=9", "--trainer.limit_val_batches=2", "--trainer.val_check_interval=4",
             "--trainer.logger=lightning.pytorch.loggers.CSVLogger"]  # fmt: skip


def run(out: Path, recipes: list[str]) -> None:
    for recipe in recipes:
        name = Path(recipe).stem
        rank = os.environ.get("LOCAL_RANK", "0")
        try:
            main(["fit", "--config", recipe, *OVERRIDES, f"--trainer.default_root_dir={out / name}",
                  f"--trainer.logger.init_args.save_dir={out / name}"])  # fmt: skip
        except BaseException:  # noqa: BLE001  (named in a file the test reads, then this process ends)
            (out / f"{name}.error").write_text(f"rank {rank}:\n{traceback.format_exc()}")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        (out / f"{name}.done.rank{rank}").touch()


if __name__ == "__main__":
    run(Path(sys.argv[1]), sys.argv[2:])
