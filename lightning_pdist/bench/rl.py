"""RL suite: CartPole-v1 time to solve (greedy 100-episode mean >= 475) of single-process DQN, Ape-X and Gorila.

``python -m lightning_pdist.bench rl [--quick] --out DIR [--rows dqn apex1 apex2 apex4 gorila2] [--budget S]
[--keep-from OLD.json]`` trains
``lightning_pdist.rl.DQNModule("CartPole-v1")`` (the same network, optimizer and learner settings in every row, seed
``--seed``) with each row's method, one launch per row (:mod:`~lightning_pdist.bench.rl_worker`):

* ``dqn``: the single-process baseline, the same module acting in its own data loader through a plain ``Trainer``;
* ``apex<N>``: ``ApeXStrategy(num_actors=N)``; ``gorila<L>``: ``GorilaStrategy`` on ``L`` learner ranks.

Every ``--eval-every`` seconds of training the learner (learner 0) plays ``--screen`` greedy episodes with its
current Q-network; when their mean reaches ``--threshold`` it plays the rest of ``--episodes`` (the same fixed start
states at every evaluation). ``time_to_solve_s``: the training time at which such a 100-episode mean first reached
the threshold (evaluation time stays in the clock, the same schedule for every row); a row that did not solve within
``--budget`` seconds reports the best mean it reached. ``env_steps_per_s`` and ``updates_per_s``: over the whole
training time. Writes ``DIR/rl.json``, ``DIR/rl.png`` and ``DIR/docs_section.md``; ``doc["goals"]`` judges issue 26's.
``--keep-from OLD.json`` adds the rows of an earlier run that this one does not make again (one row per command keeps
each command under 10 minutes), with that run's command, date and load in ``doc["kept"]``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from lightning_pdist.bench.cli import SuiteCli, SuiteRules
from lightning_pdist.bench.launch import SuiteRun
from lightning_pdist.bench.report import (check_rows, documented_run, failed_lines, goal_lines, keep_earlier_rows,
                                          kept_lines, markdown_table, run_lines, save_figure, subplots)  # fmt: skip

SUITE = "rl"
WORKER = "lightning_pdist.bench.rl_worker"
ROWS = ("dqn", "apex1", "apex2", "apex4", "gorila2")
ROW_KEYS = ("row", "method", "actors", "learners", "time_to_solve_s", "error")
GORILA_ACTORS = 2  # actors per Gorila learner (the recipe's)
QUICK = {"rows": ("dqn", "apex4"), "budget": 20.0}
FULL = {"rows": ROWS, "budget": 100.0}
_ROW = re.compile(r"^(dqn|apex([1-9]\d*)|gorila([1-9]\d*))$")


def parse_row(name: str) -> tuple[str, int, int]:
    """``(method, actors per learner, learners)`` of a row name: ``dqn``, ``apex<N>``, ``gorila<L>``."""
    found = _ROW.match(name)
    if not found:
        raise ValueError(f"{SUITE}(--rows): {name!r} must be dqn, apex<N> or gorila<L> with N, L >= 1")
    if name == "dqn":
        return "dqn", 1, 1
    if found.group(2):
        return "apex", int(found.group(2)), 1
    return "gorila", GORILA_ACTORS, int(found.group(3))


@dataclass(frozen=True)
class SuiteConfig(SuiteRules):
    """Everything that decides what the suite runs; validated on construction (``ValueError`` names the option)."""

    rows: tuple[str, ...] = ("dqn", "apex4")
    """runs: dqn, apex<N> (N actors), gorila<L> (L learners, 2 actors each)"""
    budget: float = 20.0
    """wall-clock seconds of training per row; a row that has not solved by then stops"""
    eval_every: float = 5.0
    """seconds of training between greedy evaluations"""
    screen: int = 10
    """greedy episodes of each evaluation; the rest of --episodes only when their mean reaches --threshold"""
    episodes: int = 100
    """greedy episodes whose mean must reach --threshold"""
    threshold: float = 475.0
    """the mean return that counts as solved"""
    hidden: int = 64
    """width of the Q-network's two hidden layers"""
    lr: float = 1e-3
    """Adam learning rate"""
    batch_size: int = 32
    """transitions per learner update"""
    target_every: int = 500
    """learner updates between target-network syncs"""
    learning_starts: int = 500
    """transitions in a replay before its learner's first update"""
    seed: int = 0
    """seed of the network, the actors and the replays"""
    timeout: float = 300.0
    """seconds per launch, beyond --budget"""
    keep_from: str | None = None
    """an earlier rl.json: its rows this run does not make again are kept (it must have the same settings)"""
    quick: bool = True
    SUITE: ClassVar[str] = SUITE

    def __post_init__(self) -> None:
        self.distinct("rows")
        for name in self.rows:
            try:
                parse_row(name)
            except ValueError:
                rule = f"each value must be dqn, apex<N> or gorila<L> (N, L >= 1), not {name!r}"
                raise self.bad("rows", self.rows, rule) from None
        self.positive("budget", "eval_every", "timeout", unit=" seconds")
        self.positive("lr", "threshold")
        self.ints("screen", "episodes", "hidden", "batch_size", "target_every", "learning_starts")
        self.ints("seed", low=0)
        if self.episodes < self.screen:
            raise self.bad("episodes", self.episodes, f"must be >= --screen ({self.screen})")
        self.earlier()


def worker_spec(config: SuiteConfig, name: str) -> dict[str, Any]:
    """The spec of one row's launch (:class:`~lightning_pdist.bench.rl_worker.Spec`)."""
    method, actors, learners = parse_row(name)
    return {"method": method, "num_actors": actors, "learners": learners, "budget_s": float(config.budget),
            "eval_every_s": float(config.eval_every), "screen_episodes": config.screen,
            "solve_episodes": config.episodes, "threshold": float(config.threshold), "seed": config.seed,
            "hidden": config.hidden, "lr": config.lr, "batch_size": config.batch_size, "n_step": 3, "gamma": 0.99,
            "target_every": config.target_every, "learning_starts": config.learning_starts, "capacity": 50_000,
            "steps_per_update": 1, "dqn_epsilon_start": 1.0, "dqn_epsilon_end": 0.05, "dqn_epsilon_steps": 1_000}  # fmt: skip


# -- time to solve ---------------------------------------------------------------------------------


def solved(evaluation: Sequence[Any], threshold: float) -> bool:
    """An evaluation ``[t_s, updates, env_steps, screen_mean, full_mean]`` solves when its full mean (``None`` where
    the screen fell short) reaches ``threshold``."""
    return evaluation[4] is not None and evaluation[4] >= threshold


def time_to_solve(evals: Sequence[Sequence[Any]], threshold: float) -> tuple[float, int, int] | None:
    """``(t_s, updates, env_steps)`` of the first evaluation that solved; ``None`` if none did."""
    return next(((e[0], e[1], e[2]) for e in evals if solved(e, threshold)), None)


def best_means(evals: Sequence[Sequence[Any]]) -> tuple[float | None, float | None]:
    """``(best full-evaluation mean, best screen mean)``; ``None`` where there was none."""
    full = [e[4] for e in evals if e[4] is not None]
    return (max(full) if full else None, max((e[3] for e in evals), default=None))


# -- rows ------------------------------------------------------------------------------------------


def build_row(name: str, config: dict[str, Any], got: Any) -> dict[str, Any]:
    """One row from a launch (``got``: :class:`~lightning_pdist.bench.launch.Launched`; its results one per learner)."""
    method, actors, learners = parse_row(name)
    row = {"row": name, "method": method, "actors": actors * learners, "learners": learners,
           "budget_s": config["budget"], "error": got.error, "time_to_solve_s": None, "solve_updates": None,
           "solve_env_steps": None, "best_mean": None, "best_screen": None, "evals": [],
           "other_load_cores": got.other_load_cores}  # fmt: skip
    if got.error:
        return row
    first = got.results[0]
    train_s = max(r["train_s"] for r in got.results)
    env_steps, updates = sum(r["env_steps"] for r in got.results), sum(r["updates"] for r in got.results)
    solve = time_to_solve(first["evals"], config["threshold"])
    best, screen = best_means(first["evals"])
    row.update(evals=first["evals"], train_s=train_s, env_steps=env_steps, updates=updates,
               env_steps_per_s=round(env_steps / train_s, 1), updates_per_s=round(updates / train_s, 1),
               train_return=first["train_return"], best_mean=best, best_screen=screen,
               setup_s=max(r["setup_s"] for r in got.results))  # fmt: skip
    if solve is not None:
        row.update(time_to_solve_s=solve[0], solve_updates=solve[1], solve_env_steps=solve[2])
    return row


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``vs_dqn``: the single-process DQN's time to solve over the row's (in place; ``None`` unless both solved)."""
    dqn = next((r for r in rows if r["method"] == "dqn" and r["time_to_solve_s"]), None)
    for r in rows:
        r["vs_dqn"] = round(dqn["time_to_solve_s"] / r["time_to_solve_s"], 2) if dqn and r["time_to_solve_s"] else None
    return rows


def solve_cell(row: dict[str, Any]) -> str:
    """``12.3`` when solved; ``not solved in B s`` otherwise."""
    if row.get("error"):
        return "failed"
    if row["time_to_solve_s"] is not None:
        return f"{row['time_to_solve_s']:.1f}"
    return f"not solved in {row['budget_s']:g} s"


def best_cell(row: dict[str, Any], config: dict[str, Any] | None = None) -> str:
    """The best full-evaluation mean, or the best screening mean where no full evaluation ran, with its episodes."""
    full, screen = (config or {}).get("episodes", 100), (config or {}).get("screen", 10)
    if row.get("best_mean") is not None:
        return f"{row['best_mean']:.1f} ({full} ep)"
    if row.get("best_screen") is not None:
        return f"{row['best_screen']:.1f} ({screen} ep)"
    return "–"


def goals(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 26's goal, ``{"goal", "met", "measured"}`` (``met`` None where the rows cannot tell)."""
    by = {r["row"]: r for r in rows}
    dqn, apex = by.get("dqn"), by.get("apex4")
    goal = "Ape-X with 4 actors solves CartPole-v1 >= 2x sooner in wall time than single-process DQN"
    if dqn is None or apex is None or dqn["error"] or apex["error"]:
        return [{"goal": goal, "met": None, "measured": "the dqn or apex4 row did not run"}]
    if apex["time_to_solve_s"] is None:
        dqn_said = (f"solved after {dqn['time_to_solve_s']:.1f} s" if dqn["time_to_solve_s"] is not None
                    else f"did not solve within {dqn['budget_s']:g} s")  # fmt: skip
        return [{"goal": goal, "met": False, "measured": f"Ape-X with 4 actors did not solve within {apex['budget_s']:g} s "
                 f"(best greedy mean {best_cell(apex)}); DQN {dqn_said} (best greedy mean {best_cell(dqn)})"}]  # fmt: skip
    if dqn["time_to_solve_s"] is None:  # DQN needs more than its budget: met if Ape-X took at most half of it
        t, budget = apex["time_to_solve_s"], dqn["budget_s"]
        met = True if 2 * t <= budget else None
        return [{"goal": goal, "met": met, "measured": f"Ape-X with 4 actors solved after {t:.1f} s; DQN did not "
                 f"solve within {budget:g} s" + ("" if met else ", so the ratio is unknown")}]  # fmt: skip
    ratio = dqn["time_to_solve_s"] / apex["time_to_solve_s"]
    return [{"goal": goal, "met": ratio >= 2, "measured": f"Ape-X with 4 actors solved after {apex['time_to_solve_s']:.1f} s, "
             f"DQN after {dqn['time_to_solve_s']:.1f} s ({ratio:.2f}x sooner)"}]  # fmt: skip


#: The settings every row's figures depend on: rows kept from an earlier run must share them.
KEEP_SETTINGS = ("budget", "eval_every", "screen", "episodes", "threshold", "hidden", "lr", "batch_size", "target_every",
                 "learning_starts", "seed")  # fmt: skip


def keep_rows(doc: dict[str, Any], old: dict[str, Any], config: SuiteConfig) -> None:
    """Add to ``doc`` the rows of ``old`` (an earlier rl.json) whose names this run did not make, in :data:`ROWS`
    order, and ``doc["kept"]``: per earlier command, the rows it made and its command, date, load and wall time
    (an earlier run's own kept rows keep their entries).

    Raises:
        ValueError: ``old`` is another suite's, or ran with other :data:`KEEP_SETTINGS`.
    """
    order = {name: i for i, name in enumerate(ROWS)}
    keep_earlier_rows(doc, old, SUITE, config.keep_from, lambda r: r["row"], lambda _: KEEP_SETTINGS,
                      lambda r: order.get(r["row"], len(ROWS)))


def run_suite(config: SuiteConfig, out: str | Path, command: str, log=print) -> dict[str, Any]:  # noqa: ANN001
    """Run every row, one launch each; write ``rl.json`` and ``rl.png``; return the document."""
    with SuiteRun(SUITE, config, out, command, log, timeout=config.budget + config.timeout) as run:
        doc, launcher = run.doc, run.launcher
        for name in config.rows:
            spec = worker_spec(config, name)
            log(f"{SUITE}: {name} ({spec['method']}, {spec['num_actors']} actor(s) x {spec['learners']} learner(s))")
            got = launcher.run(WORKER, spec, spec["learners"], errors=400)
            row = build_row(name, doc["config"], got)
            log(f"{SUITE}: {name}: time to solve {solve_cell(row)}, best {best_cell(row)}, "
                f"{row.get('env_steps_per_s')} env steps/s, {row.get('updates_per_s')} updates/s"
                + (f", error {row['error']}" if row["error"] else ""))  # fmt: skip
            doc["rows"].append(row)
    if config.keep_from is not None:
        keep_rows(doc, json.loads(Path(config.keep_from).read_text()), config)
    compare(doc["rows"])
    check_rows(doc["rows"], ROW_KEYS, SUITE)
    doc["goals"] = goals(doc["rows"])
    return run.finish(plot)


COLUMNS = [("row", "row", None), ("actors", "actors", None), ("learners", "learners", None),
           ("s to solve", "time_to_solve_s", lambda v: f"{v:.1f}"), ("best greedy mean", "best_mean", None),
           ("× sooner than dqn", "vs_dqn", ".2f"), ("env steps at solve", "solve_env_steps", None),
           ("env steps/s", "env_steps_per_s", ".0f"), ("updates/s", "updates_per_s", ".0f"),
           ("train return (last 100)", "train_return", ".1f"), ("other load", "other_load_cores", ".2f")]  # fmt: skip


def table(rows: Sequence[dict[str, Any]], config: dict[str, Any]) -> str:
    shown = [{**r, "time_to_solve_s": solve_cell(r), "best_mean": best_cell(r, config)} for r in rows]
    cols = [(h, k, None if k in ("time_to_solve_s", "best_mean") else f) for h, k, f in COLUMNS]
    return markdown_table(shown, cols)


def docs_section(doc: dict[str, Any], json_path: str) -> str:
    """The docs/benchmarks.md body of a run: settings, the table, failures and the goal."""
    cfg, rows = doc["config"], doc["rows"]
    load = [r["other_load_cores"] for r in rows if r.get("other_load_cores") is not None]
    lines = [*run_lines(doc, json_path), *kept_lines(doc), "",
             f"Module: `DQNModule(\"CartPole-v1\", hidden={cfg['hidden']}, lr={cfg['lr']:g})`, double DQN with 3-step "
             f"returns, γ 0.99, batches of {cfg['batch_size']}, target sync every {cfg['target_every']} updates, "
             f"first update after {cfg['learning_starts']} transitions, seed {cfg['seed']}; dqn: prioritized replay "
             "(α 0.6) like Ape-X's, one ε-greedy step per update, ε from 1 to 0.05 over 1000 steps; Ape-X: ε_i = "
             f"0.4^(1+7i/(N−1)); Gorila: {GORILA_ACTORS} actors per learner with ε 0.1, uniform replay, 2 "
             "parameter servers. Solved: the greedy policy's mean return over "
             f"{cfg['episodes']} fixed start states reaches {cfg['threshold']:g} (tested every {cfg['eval_every']:g} s "
             f"once {cfg['screen']} of them reach it; evaluation time is in the clock). Budget {cfg['budget']:g} s of "
             "training per row. Every process has one thread; the machine has "
             f"{doc['host']['cpus']} cores (\"other load\": cores other work kept busy during the row"
             + (f"; {min(load):.2f} to {max(load):.2f} in this run" if load else "") + ").", "",
             table(rows, cfg)]  # fmt: skip
    lines += [*failed_lines(rows, lambda r: r["row"]), "", "Goal (issue 26):", "", *goal_lines(doc["goals"])]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str | Path) -> Path:
    """Greedy screening mean against training time per row; env steps/s and updates/s against the actors."""
    ok = [r for r in doc["rows"] if not r["error"]]
    fig, (ax_ret, ax_rate) = subplots(1, 2, figsize=(13, 5))
    for i, r in enumerate(ok):
        line, = ax_ret.plot([e[0] for e in r["evals"]], [e[3] for e in r["evals"]], marker=".", color=f"C{i}", label=r["row"])
        full = [(e[0], e[4]) for e in r["evals"] if e[4] is not None]
        if full:
            ax_ret.scatter(*zip(*full), marker="*", s=90, color=line.get_color())
    ax_ret.axhline(doc["config"]["threshold"], color="gray", linestyle=":")
    ax_ret.set_xlabel("training time (s)")
    ax_ret.set_ylabel(f"greedy mean return ({doc['config']['screen']} episodes; ★ {doc['config']['episodes']})")
    ax_ret.grid(True, alpha=0.3)
    if ax_ret.lines:
        ax_ret.legend(fontsize=8)
    labels = [r["row"] for r in ok]
    x = range(len(ok))
    ax_rate.bar([i - 0.2 for i in x], [r["env_steps_per_s"] for r in ok], width=0.4, label="env steps/s")
    ax_rate.bar([i + 0.2 for i in x], [r["updates_per_s"] for r in ok], width=0.4, label="learner updates/s")
    ax_rate.set_xticks(list(x), labels)
    ax_rate.set_ylabel("per second of training (all actors / learners)")
    ax_rate.grid(True, axis="y", alpha=0.3)
    ax_rate.legend(fontsize=8)
    return save_figure(fig, path, title=f"rl suite (CartPole-v1), {doc['created']}")


CLI = SuiteCli(config=SuiteConfig, quick=QUICK, full=FULL, out="rl.json, rl.png and docs_section.md")


run = documented_run(SUITE, run_suite, docs_section)
