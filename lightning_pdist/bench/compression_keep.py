"""``--keep-from OLD.json`` of the compression suite: rerun some launches, keep every other launch's rows.

A *launch* is one model on one network at one world size (every method in turn in the same processes: 12 rows). A run
with ``--keep-from`` makes the launches its options ask for and keeps, from the earlier ``compression.json``, the rows
of every launch it did not make, with that run's provenance (:func:`~lightning_pdist.bench.report.kept_provenance`:
per earlier command its launches, command, date, load, wall time and the networks it measured). The rows describe
themselves by network, world size and model only, so an earlier run made with other :data:`KEEP_SETTINGS` is refused
before anything is launched, naming the setting. A kept run's own kept launches keep their entries, so the plan can
be filled in pieces of under 10 minutes, each keeping the one before.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_pdist.bench.compression_worker import METHODS, MODELS
from lightning_pdist.bench.netns import parse_rate
from lightning_pdist.bench.report import kept_provenance, network_lines, refuse_other_settings

SUITE = "compression"
#: The settings every row depends on besides its network, world size and model (which it records): kept rows must
#: share them with the rows made now, whose text (docs_section) describes all of them with this run's config.
KEEP_SETTINGS = ("methods", "samples", "batch_size", "lr", "momentum", "width", "lm_lr", "lm_width", "lm_layers",
                 "lm_context", "dgc_warmup", "seed", "eval_every")  # fmt: skip
#: A line of ``doc["not_run"]`` about one launch: ``"cnn on 1gbit, 4 ranks: skipped, ..."``.
LAUNCH_LINE = re.compile(r"^(\w+) on (\S+), (\d+) ranks: ")

Launch = tuple[str, str, int]  # (model, network, world size)


def launch_of(row: Mapping[str, Any]) -> Launch:
    return row.get("model", "cnn"), row["network"], row["world_size"]


def launch_name(launch: Launch) -> str:
    """``"cnn on 1gbit, 4 ranks"`` (the words ``doc["not_run"]`` uses)."""
    model, network, ws = launch
    return f"{model} on {network}, {ws} ranks"


def _network_rank(name: str) -> float:
    if name == "loopback":
        return -1.0
    try:
        return float(parse_rate(name))
    except ValueError:
        return float("inf")


def sort_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The suite's order: loopback then slower networks first, then world size, model, method."""
    methods, models = list(METHODS), list(MODELS)
    return sorted(rows, key=lambda r: (_network_rank(r["network"]), r["world_size"], models.index(r.get("model", "cnn")),
                                       methods.index(r["method"]) if r["method"] in methods else len(methods)))  # fmt: skip


def check_keep(old: Mapping[str, Any], config: Any, where: str) -> None:
    """Refuse ``old`` (an earlier compression.json) if it is another suite's or ran with other :data:`KEEP_SETTINGS`
    than ``config`` (checked before anything is launched)."""
    if old.get("suite") != SUITE:
        raise ValueError(f"{where}: holds suite {old.get('suite')!r}, not {SUITE!r}")
    now = json.loads(json.dumps({k: getattr(config, k) for k in KEEP_SETTINGS}))  # tuples as the file's lists
    refuse_other_settings(where, old["config"], now, KEEP_SETTINGS, "rows", "; re-run those launches too, or drop --keep-from")


def keep_launches(doc: dict[str, Any], old: Mapping[str, Any]) -> None:
    """Add to ``doc`` (in place) the rows of every launch of ``old`` that ``doc`` does not hold, in :func:`sort_rows`
    order; the networks of those rows that this run did not measure (all in :func:`sort_rows` order); ``doc["kept"]``: per earlier command the launches
    it made (names of :func:`launch_name`), its command, date, load, wall time and the networks it measured; and
    ``old``'s ``not_run`` lines about launches still missing (after this run's own lines in ``doc["not_run"]``)."""
    made = {launch_of(r) for r in doc["rows"]}
    kept = [r for r in old["rows"] if launch_of(r) not in made]
    names = list(dict.fromkeys(launch_name(launch_of(r)) for r in kept))
    earlier = {n for e in old.get("kept", []) for n in e["rows"]}
    own = dict.fromkeys(r["network"] for r in kept if launch_name(launch_of(r)) not in earlier)  # measured by old's command
    measured = {n: old["networks"][n] for n in own if n in old["networks"]}
    doc["rows"] = sort_rows([*doc["rows"], *kept])
    nets = {**doc["networks"], **{n: old["networks"][n] for n in dict.fromkeys(r["network"] for r in kept)
                                  if n not in doc["networks"] and n in old["networks"]}}  # fmt: skip
    doc["networks"] = {n: nets[n] for n in sorted(nets, key=_network_rank)}
    doc["kept"] = kept_provenance(old, old.get("kept", []), names, suite_wall_s=old.get("suite_wall_s"), networks=measured)
    present = {launch_name(launch_of(r)) for r in doc["rows"]}
    still = [line for line in old.get("not_run", []) if (m := LAUNCH_LINE.match(line))
             and launch_name((m.group(1), m.group(2), int(m.group(3)))) not in present]  # fmt: skip
    mine = doc.get("not_run", [])
    doc["not_run"] = [*mine, *(line for line in still if line not in mine)]


def kept_lines(doc: Mapping[str, Any]) -> list[str]:
    """Markdown: per earlier command, the launches kept from it, its command, date, wall time, load and networks."""
    lines = []
    for e in doc.get("kept", []):
        lines.append(f"Launches kept from an earlier command ({'; '.join(e['rows'])}): `{e['command']}` (run {e['created']}, "
                     f"{e.get('suite_wall_s')} s, 1-min load average {e['loadavg_1m_at_start']} at its start"
                     + ("; its networks:" if e.get("networks") else ")."))  # fmt: skip
        if e.get("networks"):
            lines[-1] += " " + "; ".join(x[2:] for x in network_lines({"networks": e["networks"]}, named=False, goodput="short")) + ")."
    return [line + "  " for line in lines]  # one line each
