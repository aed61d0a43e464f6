"""Tier 3 (standalone): every recipe parses, and runs end to end through the `pdist` console script."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _ranks import held_port

from lightning_pdist.cli import main

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
#: DQN recipes: no data module (the module paces its own loop), no validation; trained by their own test below.
RL_RECIPES = {"apex_cartpole", "gorila_cartpole"}
SUPERVISED = [p for p in RECIPES if p.stem not in RL_RECIPES]
PDIST = Path(sys.executable).with_name("pdist")


def test_every_strategy_has_a_recipe():
    """recipes/ holds a YAML for the DDP baseline and every averaging strategy."""
    names = {p.stem for p in RECIPES}
    assert {"ddp", "local_sgd", "simuparallel_sgd", "bmuf", "easgd", "tensor_parallel"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_parses_and_names_its_strategy(recipe, capsys):
    """`pdist fit --config <recipe> --print_config` resolves the strategy's class_path and init args."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(recipe), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["strategy"]["class_path"].startswith("lightning_pdist.")
    if recipe.stem in RL_RECIPES:
        assert printed["model"]["class_path"] == "lightning_pdist.rl.DQNModule" and printed["data"] is None
        return
    assert printed["model"]["class_path"] == "lightning_pdist.models.ClassifierModule"
    data = "IMDBDataModule" if recipe.stem in ("tensor_parallel", "pipeline_bert", "parallax") else "DigitsDataModule"  # text: an encoder, an embedding table
    assert printed["data"]["class_path"] == f"lightning_pdist.data.{data}"


def _run_pdist(recipe: Path, tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")  # MASTER_PORT: the test's held port
    cmd = [str(PDIST), "fit", "--config", str(recipe), "--trainer.max_steps=9", "--trainer.limit_val_batches=2", "--trainer.val_check_interval=4",
           f"--trainer.default_root_dir={tmp_path}", *overrides]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every recipe trained in turn by one 2-rank popen launch (``_several_recipes.py``: ``pdist fit --config`` per
    recipe, in the same two processes, each with a CSVLogger); {recipe: its log folder}. One launch instead of one per
    recipe: each launch re-imports torch and Lightning in two processes (~7 s of CPU each), the recipes' 9 steps
    cost ~1 s. The ``pdist`` console script itself, as a user runs it, is the wandb test below."""
    out = tmp_path_factory.mktemp("recipes")
    with held_port() as port:  # module scope: no test's port is held yet
        env = dict(os.environ, MASTER_PORT=str(port), WANDB_MODE="offline", WANDB_SILENT="true")
        for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "PDIST_LAUNCHER_PID"):
            env.pop(name, None)
        cmd = [sys.executable, str(Path(__file__).with_name("_several_recipes.py")), str(out), *map(str, SUPERVISED)]
        result = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=600)
    return out, result


@pytest.mark.standalone
@pytest.mark.parametrize("recipe", SUPERVISED, ids=lambda p: p.stem)
def test_recipe_trains_with_two_popen_ranks_and_logs_comm_bytes(recipe, trained):
    """The user path: `pdist fit --config`, 2 popen ranks; the logger receives pdist/comm_bytes and val/acc."""
    out, result = trained
    errors = sorted(out.glob("*.error"))
    assert not (out / f"{recipe.stem}.error").exists(), (out / f"{recipe.stem}.error").read_text()[-3000:]
    done = [(out / f"{recipe.stem}.done.rank{r}").exists() for r in range(2)]
    assert done == [True, True], (f"recipe {recipe.stem} did not finish on both ranks {done}; failed first: "
                                  f"{[e.stem for e in errors]}; exit code {result.returncode}:\n{result.stderr[-3000:]}")  # fmt: skip
    rows = list(csv.DictReader(open(next((out / recipe.stem).glob("*/version_*/metrics.csv")))))
    hparams = yaml.safe_load(next((out / recipe.stem).glob("*/version_*/hparams.yaml")).read_text())
    recipe_strategy = yaml.safe_load(recipe.read_text())["trainer"]["strategy"]["class_path"]
    assert hparams["config"]["trainer"]["strategy"]["class_path"] == recipe_strategy  # the CLI's whole config
    assert hparams["pdist"]["world_size"] == 2  # the strategy's resolved settings
    logged = {k for row in rows for k, v in row.items() if v != ""}
    assert {"pdist/comm_bytes", "pdist/comm_bytes_total", "train/loss", "val/acc"} <= logged
    totals = [float(r["pdist/comm_bytes_total"]) for r in rows if r.get("pdist/comm_bytes_total")]
    assert totals == sorted(totals)
    # never sampled: the logged per-interval bytes add up to the run's total (the last point of the series)
    assert sum(float(r["pdist/comm_bytes"]) for r in rows if r.get("pdist/comm_bytes")) == totals[-1]
    assert totals[-1] > 0 or recipe.stem == "hogwild"  # Hogwild! shares memory: no byte goes on a network


@pytest.mark.standalone
def test_every_recipe_ran_in_one_launch(trained):
    """The launch ended cleanly after the last recipe (no rank left behind, exit code 0)."""
    out, result = trained
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.standalone
def test_recipe_writes_an_offline_wandb_run(tmp_path):
    """With the recipe's own WandbLogger (offline), a run file appears that `wandb sync` can upload,
    holding the loss, accuracy and comm-bytes series."""
    _run_pdist(ROOT / "recipes" / "bmuf.yaml", tmp_path, f"--trainer.logger.init_args.save_dir={tmp_path}")
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = run_file.read_bytes()  # protobuf records; metric keys are stored as plain UTF-8
    for key in (b"pdist/comm_bytes", b"pdist/comm_bytes_total", b"train/loss", b"val/acc"):
        assert key in records, f"{key!r} missing from {run_file}"
    # the strategy's resolved settings are in the run's config, stored as JSON (block_momentum=None -> 1 - 1/2)
    start = records.index(b'{"strategy":"bmuf"')
    settings = json.loads(records[start : records.index(b"}", start) + 1])
    assert settings["block_momentum"] == 0.5 and settings["period"] == 8 and settings["world_size"] == 2


@pytest.mark.standalone
@pytest.mark.parametrize("recipe", sorted(RL_RECIPES))
def test_rl_recipe_trains_through_pdist_and_logs_episode_returns(recipe, tmp_path):
    """`pdist fit --config <DQN recipe>` as a user runs it, cut to 6 updates after 64 transitions and one actor (gorila:
    one learner and one server process; two learners through the Trainer are tests/rl/test_gorila.py's); the offline
    W&B run holds the loss and the episode returns."""
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")  # MASTER_PORT: the test's held port
    cmd = [str(PDIST), "fit", "--config", str(ROOT / "recipes" / f"{recipe}.yaml"), "--trainer.max_steps=6",
           "--trainer.log_every_n_steps=1", f"--trainer.default_root_dir={tmp_path}",
           f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.strategy.init_args.num_actors=1",
           "--trainer.strategy.init_args.learning_starts=64", "--trainer.strategy.init_args.batch_size=8",
           "--model.init_args.hidden=16"]  # fmt: skip
    if recipe == "gorila_cartpole":  # each learner is a fresh Python process, each server another (~10 s of CPU each)
        cmd += ["--trainer.devices=1", "--trainer.strategy.init_args.num_servers=1"]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = run_file.read_bytes()
    for key in (b"train/loss", b"rl/episode_return", b"rl/env_steps"):
        assert key in records, f"{key!r} missing from {run_file}"
