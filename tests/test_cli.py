"""The `pdist` console script: strategy choices, per-strategy help, shipped recipes by name."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

import lightning_pdist
from lightning_pdist.cli import RECIPES_DIR, main, resolve_recipe_args, shipped_recipes
from lightning_pdist.core.config import OWNED_DDP_ARGS

# Strategies that own gradient communication and refuse DDP's hook arguments.
OWNERS = ["BMUFStrategy", "EASGDStrategy", "LocalSGDStrategy", "SimuParallelSGDStrategy", "SignSGDStrategy",
          "ParameterServerStrategy", "PipelineStrategy", "HogwildStrategy", "DiLoCoStrategy", "GorilaStrategy"]  # fmt: skip


def _cli_output(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code in (0, None)
    return capsys.readouterr().out


def test_strategy_choices_offer_every_strategy_but_not_the_abstract_base(capsys):
    """`pdist fit --help` lists each strategy class and not the abstract ModelAveragingStrategy."""
    text = "".join(_cli_output(["fit", "--help"], capsys).split())  # argparse wraps long class paths
    assert "ModelAveragingStrategy" not in text
    for name in lightning_pdist.__all__:
        if name.endswith("Strategy"):
            assert f"lightning_pdist.{name}" in text, name


@pytest.mark.parametrize("strategy", OWNERS)
def test_strategy_help_leaves_out_the_arguments_it_refuses(strategy, capsys):
    """`--trainer.strategy.help <Class>` shows the strategy's own arguments, not the DDP hook arguments it refuses."""
    text = _cli_output(["fit", "--trainer.strategy.help", strategy], capsys)
    assert "--trainer.strategy.start_method" in text
    for name in OWNED_DDP_ARGS:
        assert f"--trainer.strategy.{name}" not in text, name


def test_pdist_ddp_help_keeps_the_hook_arguments(capsys):
    """PdistStrategy takes ddp_comm_hook (its comm hooks run on CPU too), so its help still offers them."""
    text = _cli_output(["fit", "--trainer.strategy.help", "PdistStrategy"], capsys)
    for name in OWNED_DDP_ARGS:
        assert f"--trainer.strategy.{name}" in text, name


@pytest.mark.parametrize("strategy", OWNERS)
def test_owned_arguments_left_unset_are_still_accepted(strategy):
    """Passing the refused arguments as None (what older configs hold) constructs the strategy as before."""
    cls = getattr(lightning_pdist, strategy)
    kwargs = {"num_stages": 2} if strategy == "PipelineStrategy" else {}
    instance = cls(**kwargs, **dict.fromkeys(OWNED_DDP_ARGS))
    assert instance._ddp_comm_hook is None


# ---------------------------------------------------------------------------- what jsonargparse reads
#: Each shell's own arguments and defaults, read from its signature (for the sign shells the one both inherit from
#: SignSGDArguments); DDP's arguments (``timeout``) reach jsonargparse through ``**kwargs``.
SIGN = {"aggregation": "majority", "warmup_rounds": 10, "estimator": "worker", "decay": 1.0, "max_weight": math.log(99),
        "negative_weights": False, "momentum": 0.0, "error_feedback": False, "nonfinite": "raise", "scale": "unit"}
BMUF = {"period": 8, "block_momentum": None, "block_lr": 1.0, "nesterov": True, "warmup_steps": 0}
SHELL_ARGUMENTS = {
    "SignSGDStrategy": SIGN, "SignSGDFabricStrategy": SIGN,
    "BMUFStrategy": BMUF | {"nonfinite": "raise", "compression": None}, "BMUFFabricStrategy": BMUF | {"compression": None},
    "EASGDStrategy": {"period": 4, "alpha": None, "warmup_steps": 0, "nonfinite": "raise"},
    "EASGDFabricStrategy": {"period": 4, "alpha": None, "warmup_steps": 0},
    "LocalSGDStrategy": {"period": 8, "warmup_steps": 0, "nonfinite": "raise", "compression": None},
    "LocalSGDFabricStrategy": {"period": 8, "warmup_steps": 0, "compression": None},
    "SimuParallelSGDStrategy": {"nonfinite": "raise"}, "SimuParallelSGDFabricStrategy": {},
    "DecentralizedStrategy": {"topology": "ring", "mode": "sync", "implicit_momentum": None, "torus_shape": None,
                              "seed": 0, "nonfinite": "raise"},
    "DecentralizedFabricStrategy": {"topology": "ring", "torus_shape": None},
    "ParameterServerStrategy": {"num_servers": None, "sharding": "memory", "mode": "sync", "staleness": 0,
                                "backup_workers": 0, "push_every": 1, "pull_every": 1, "delay_compensation": 0.0,
                                "partition_bytes": None, "server_host": None, "server_port": None,
                                "server_addresses": None, "server_secret_file": None, "allowed_networks": None,
                                "server_timeout": 300.0, "easgd_period": None, "easgd_alpha": None,
                                "implicit_momentum": None, "chunk_bytes": None, "chunks_in_flight": None,
                                "reply_buffer_bytes": None, "nonfinite": "raise", "compression": None},
    "SandblasterStrategy": {"portions": None, "backup_portions": 0, "num_servers": None, "sharding": "memory",
                            "partition_bytes": None, "server_host": None, "server_port": None, "server_addresses": None,
                            "server_secret_file": None, "allowed_networks": None, "server_timeout": 300.0},
    "PipelineStrategy": {"num_stages": None, "schedule": "1f1b", "num_microbatches": None, "balance": None,
                         "split_points": None, "network": None, "vertical_sync": False, "weight_stashing": True,
                         "max_message_bytes": 1 << 31, "nonfinite": "raise", "synthetic_gradients": False,
                         "synthetic_module": None, "synthetic_optimizer": None, "synthetic_normalize": True,
                         "synthetic_conditioning": None, "synthetic_num_classes": None, "post_ahead": False},
    "HogwildStrategy": {"lock": False, "variance_reduction": None, "snapshot_every_epochs": 1, "implicit_momentum": None,
                        "nonfinite": "raise"},
    "DiLoCoStrategy": {"sync_every": 100, "outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9,
                       "outer_kwargs": None, "nonfinite": "raise", "fault_tolerant": False, "lighthouse": None,
                       "replica_id": None, "min_replicas": 1, "ft_timeout": 60.0},
    "StreamingDiLoCoStrategy": {"sync_every": 100, "num_fragments": 2, "fragments": None, "overlap_steps": 0,
                                "fragment_alpha": 0.0, "quantize": None, "balance": "layers",
                                "outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9,
                                "outer_kwargs": None, "nonfinite": "raise"},
    "GorilaStrategy": {"num_actors": 1, "num_learners": None, "num_servers": 2, "epsilon": 0.1, "epsilon_alpha": 0.0,
                       "n_step": 3, "gamma": 0.99, "batch_size": 32, "capacity": 50_000, "learning_starts": 500,
                       "refresh_every": 16, "send_every": 16, "target_every": 500, "seed": 0, "deterministic": False,
                       "actor_timeout": 120.0, "server_timeout": 120.0},
    "ParallaxStrategy": {"sparse_params": None, "num_servers": None, "server_host": None, "server_port": None,
                         "server_addresses": None, "server_secret_file": None, "allowed_networks": None,
                         "server_timeout": 300.0},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SHELL_ARGUMENTS))
def test_jsonargparse_sees_each_shells_arguments_and_ddps(name):
    """jsonargparse (LightningCLI) offers the shell's own arguments first, in order, with their defaults (and, for the
    Trainer's, help), then DDP's through ``**kwargs`` (``timeout``, ``process_group_backend``), and none of the
    comm-hook arguments a shell owns: an inherited signature or a ``super().__init__`` chain that loses one fails."""
    from jsonargparse import ArgumentParser
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

    import lightning_pdist.fabric

    cls = getattr(lightning_pdist.fabric if "Fabric" in name else lightning_pdist, name)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "s")
    actions = {a.dest[2:]: a for a in parser._actions if a.dest.startswith("s.") and not a.dest.endswith(".help")}
    own = SHELL_ARGUMENTS[name]
    assert list(actions)[: len(own)] == list(own)
    defaults = parser.get_defaults()["s"]
    assert {arg: defaults[arg] for arg in own} == pytest.approx(own)
    assert "Fabric" in name or all(actions[arg].help for arg in own), "LightningCLI's --help documents each one"
    assert defaults["timeout"] == default_pg_timeout and defaults["process_group_backend"] is None
    assert not set(OWNED_DDP_ARGS) & set(actions)


# ---------------------------------------------------------------------------- shipped recipes
ROOT = Path(__file__).resolve().parents[1]


def test_every_checkout_recipe_ships_in_the_package():
    """lightning_pdist/recipes/ holds exactly recipes/*.yaml, with the same content (package data for the wheel)."""
    checkout = {p.stem: p.read_text() for p in (ROOT / "recipes").glob("*.yaml")}
    shipped = {name: path.read_text() for name, path in shipped_recipes().items()}
    assert shipped == checkout, "a new recipes/X.yaml needs its link: ln -s ../../recipes/X.yaml lightning_pdist/recipes/"
    assert RECIPES_DIR == ROOT / "lightning_pdist" / "recipes"


@pytest.mark.parametrize("args", [["--config", "bmuf"], ["--config=bmuf"], ["-c", "bmuf.yaml"], ["--config", "recipes/bmuf.yaml"]])
def test_a_recipe_name_resolves_to_the_shipped_file_when_no_such_file_is_here(args, tmp_path, monkeypatch):
    """`--config bmuf` (or bmuf.yaml, recipes/bmuf.yaml) outside a checkout is the shipped recipe; other args stay."""
    monkeypatch.chdir(tmp_path)
    resolved = resolve_recipe_args(["fit", *args, "--trainer.max_steps=3"])
    assert resolved[0] == "fit" and resolved[-1] == "--trainer.max_steps=3"
    assert str(RECIPES_DIR / "bmuf.yaml") in resolved[-2]


def test_a_file_in_the_working_directory_wins_over_a_shipped_recipe(tmp_path, monkeypatch):
    """A user's own bmuf.yaml (or recipes/bmuf.yaml) is used as given; inline YAML and other paths are untouched."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "bmuf.yaml").write_text("seed_everything: 1\n")
    args = ["fit", "--config", "recipes/bmuf.yaml", "--config", "{seed_everything: 2}", "--config", "other/x.yaml"]
    assert resolve_recipe_args(args) == args


def test_an_unknown_bare_name_stops_with_the_shipped_names(tmp_path, monkeypatch):
    """`--config nosuch` is neither a file nor a recipe: the error names the input and lists the shipped recipes."""
    monkeypatch.chdir(tmp_path)
    shipped = ", ".join(sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml")))
    with pytest.raises(SystemExit, match=rf"--config nosuch: no such file in .* shipped recipes: {shipped} \("):
        resolve_recipe_args(["fit", "--config", "nosuch"])


def test_a_shipped_recipe_parses_by_name_and_keeps_its_paths_relative(tmp_path, monkeypatch, capsys):
    """`pdist fit --config bmuf --print_config` in an empty folder: BMUF, and runs/bmuf relative to that folder."""
    monkeypatch.chdir(tmp_path)
    printed = yaml.safe_load(_cli_output(["fit", "--config", "bmuf", "--print_config"], capsys))
    assert printed["trainer"]["strategy"]["class_path"] == "lightning_pdist.BMUFStrategy"
    assert printed["trainer"]["default_root_dir"] == "runs/bmuf"


def test_pdist_recipes_lists_name_strategy_and_a_line_each(capsys):
    """`pdist recipes` prints one row per shipped recipe with its strategy class; `pdist recipes bmuf` its YAML."""
    main(["recipes"])
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[1:] if line.strip()}
    assert rows["bmuf"] == "BMUFStrategy" and rows["ddp"] == "PdistStrategy" and rows["it_signsgd"] == "SignSGDStrategy"
    assert set(shipped_recipes()) <= set(rows)
    main(["recipes", "bmuf"])
    assert capsys.readouterr().out == (RECIPES_DIR / "bmuf.yaml").read_text()
    with pytest.raises(SystemExit, match=r"pdist recipes nosuch: no shipped recipe of that name; shipped recipes: (\w+, )*bmuf"):
        main(["recipes", "nosuch"])


@pytest.mark.standalone
def test_the_wheel_ships_the_recipes(tmp_path):
    """A wheel built from the checkout (offline, no build isolation) holds every recipe with its content."""
    source = tmp_path / "src"
    for name in ("lightning_pdist", "recipes"):
        shutil.copytree(ROOT / name, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "wheel"), str(source)], capture_output=True, text=True, timeout=240)  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("lightning_pdist-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = {Path(n).stem: archive.read(n).decode() for n in archive.namelist() if n.startswith("lightning_pdist/recipes/")}
    assert shipped == {p.stem: p.read_text() for p in (ROOT / "recipes").glob("*.yaml")}
