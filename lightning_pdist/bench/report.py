"""Shared output helpers of the benchmark suites: JSON documents, row checks, text tables, figures.

Every suite writes ``DIR/<suite>.json`` (a document with ``suite``, ``created``, ``command``,
``networks`` and ``rows``) and ``DIR/<suite>.png``; docs/benchmarks.md quotes the JSON. This module
imports no torch, so reports can be rebuilt from a JSON file alone.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = ["check_rows", "command_line", "documented_run", "goal_lines", "host_info", "markdown_table", "new_document", "run_documented_suite",
           "utc_now", "write_json"]


def utc_now() -> str:
    """The current time as an ISO-8601 UTC timestamp with seconds, e.g. ``2026-05-09T07:35:25Z``."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def command_line(suite: str, argv: Sequence[str]) -> str:
    """The shell command that reruns ``suite`` with ``argv``: ``python -m lightning_pdist.bench <suite> ...``."""
    return shlex.join(["python", "-m", "lightning_pdist.bench", suite, *argv])


def cpu_model() -> str | None:
    """The CPU's model name and the widest x86 vector extension torch's kernels may pick (``"AMD EPYC, avx512"``):
    the same seed and data can give other floating-point results on another CPU, and times are not comparable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or None
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), None)
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    vector = next((v for v in ("avx512f", "avx2", "avx") if v in flags), None)
    return ", ".join(x for x in (model, vector and vector.removesuffix("f")) if x) or None


def host_info() -> dict[str, Any]:
    """What the figures depend on besides the network: CPU count, load at the start, library versions."""
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
    }
    for name in ("torch", "lightning"):
        module = sys.modules.get(name)
        if module is None:
            try:
                module = __import__(name)
            except ImportError:
                module = None
        info[name] = getattr(module, "__version__", None)
    return info


def new_document(suite: str, command: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """The skeleton every suite's JSON shares; the suite fills ``networks`` and ``rows``."""
    return {
        "suite": suite,
        "created": utc_now(),
        "command": command,
        "host": host_info(),
        "config": dict(config),
        "networks": {},
        "rows": [],
    }


def check_rows(rows: Iterable[Mapping[str, Any]], required: Sequence[str], owner: str) -> None:
    """Raise ``ValueError`` naming the row and the keys if any row lacks one of ``required``."""
    for i, row in enumerate(rows):
        missing = [k for k in required if k not in row]
        if missing:
            raise ValueError(f"{owner}: row {i} ({dict(row)!r}) lacks the required keys {missing}")


def write_json(document: Mapping[str, Any], path: str | Path) -> Path:
    """Write ``document`` as indented JSON (NaN refused, so the file is strict JSON); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")
    tmp.replace(path)
    return path


def _cell(value: Any, fmt: str | Callable[[Any], str] | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if callable(fmt):
        return fmt(value)
    if fmt:
        return format(value, fmt)
    return str(value)


def markdown_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[tuple[str, str, str | Callable[[Any], str] | None]],
) -> str:
    """A GitHub-markdown table (also readable as plain text) of ``rows``.

    Args:
        rows: dicts, one per table row.
        columns: ``(header, key, fmt)``: ``fmt`` is a format spec (``".3f"``), a callable, or ``None``
            for ``str``; a missing or ``None`` value prints as ``–``.
    """
    header = [h for h, _, _ in columns]
    body = [[_cell(row.get(key), fmt) for _, key, fmt in columns] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |" for r in body]
    return "\n".join(lines)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def subplots(*args: Any, **kwargs: Any) -> Any:
    """``(fig, axes)`` of ``plt.subplots(*args, **kwargs)`` on the Agg backend."""
    return pyplot().subplots(*args, **kwargs)


def save_figure(fig: Any, path: str | Path, dpi: int = 110, title: str | None = None) -> Path:
    """Title ``fig`` (``suptitle``, font size 9, when given), lay it out tight, write it to ``path`` (creating its
    folder) and close it; return the path."""
    if title is not None:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def kept_lines(doc: Mapping[str, Any]) -> list[str]:
    """One line per earlier command whose rows a ``--keep-from`` run kept (``doc["kept"]``, :func:`kept_provenance`)."""
    return [f"Rows {', '.join(e['rows'])} kept from an earlier command: `{e['command']}` (run {e['created']}, "
            f"{e['suite_wall_s']} s, 1-min load average {e['loadavg_1m_at_start']} at its start).  "
            for e in doc.get("kept", [])]  # fmt: skip


def earlier_run(suite: str, path: str) -> dict[str, Any]:
    """The document of an earlier run of ``suite`` (``--keep-from``); ``ValueError`` if it holds another suite's."""
    old = json.loads(Path(path).read_text())
    if old.get("suite") != suite:
        raise ValueError(f"{suite}(--keep-from={path!r}): holds suite {old.get('suite')!r}, not {suite!r}")
    return old


def check_spec_keys(spec: dict[str, Any], keys: Sequence[str], who: str) -> None:
    """Raise ``ValueError`` naming ``who`` when ``spec`` lacks one of ``keys`` or has another key."""
    missing = [k for k in keys if k not in spec]
    unknown = sorted(set(spec) - set(keys))
    if missing or unknown:
        raise ValueError(f"{who} spec={spec!r}: missing keys {missing}, unknown keys {unknown}; keys are {tuple(keys)}")


def run_documented_suite(
    suite: str,
    config: Any,
    out: Path,
    argv: Sequence[str],
    run_suite: Callable[[Any, Path, str], dict[str, Any] | None],
    docs_section: Callable[[dict[str, Any], str], str],
) -> int:
    """A suite's ``run``: run it, write ``DIR/docs_section.md`` and print it.

    Returns the exit status: 1 when ``run_suite`` returned ``None`` (it could not run here and said why), 0 otherwise.
    """
    doc = run_suite(config, out, command_line(suite, argv))
    if doc is None:
        return 1
    out = Path(out)
    section = docs_section(doc, str(out / f"{suite}.json"))
    (out / "docs_section.md").write_text(section + "\n")
    print()
    print(section)
    print(f"\nwrote {out / (suite + '.json')}, {out / (suite + '.png')} and {out / 'docs_section.md'} in {doc['suite_wall_s']} s")
    return 0


def documented_run(suite: str, run_suite: Callable[[Any, Path, str], dict[str, Any] | None],
                   docs_section: Callable[[dict[str, Any], str], str]) -> Callable[[Any, Path, Sequence[str]], int]:  # fmt: skip
    """A suite's ``run(config, out, argv)``: :func:`run_documented_suite` with its ``run_suite`` and ``docs_section``."""
    return lambda config, out, argv: run_documented_suite(suite, config, out, argv, run_suite, docs_section)


def output_dir(suite: str, out: str | Path) -> Path:
    """``out`` as a directory, created if needed; ``ValueError`` naming the suite if it is a file."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{suite}(--out={str(out)!r}): --out must be a directory, and this is a file")
    out.mkdir(parents=True, exist_ok=True)
    return out


def run_lines(doc: Mapping[str, Any], json_path: str) -> list[str]:
    """The command, run and output lines every suite's docs section starts with."""
    host = doc["host"]
    return [
        f"Command: `{doc['command']}`  ",
        f"Run: {doc['created']}, {doc['suite_wall_s']} s for the whole suite, on {host['cpus']} CPUs"
        f"{' (' + host['cpu'] + ')' if host.get('cpu') else ''} (1-min load average {host['loadavg_1m_at_start']} at the start), torch {host['torch']}.  ",
        f"Output: `{json_path}`",
    ]


def network_lines(doc: Mapping[str, Any], named: bool = True, goodput: str | None = "burst") -> list[str]:
    """One markdown bullet per network of ``doc``: its detail (or why it was skipped), with its measured goodput.

    ``named`` starts each with the network's key; ``goodput`` is ``"burst"`` (the tbf burst and the measured TCP
    goodput host 0 → 1), ``"short"`` (the goodput alone) or ``None``.
    """
    lines = []
    for name, info in doc["networks"].items():
        if named:
            what = f"{name}: {info.get('detail', 'skipped: ' + str(info.get('skipped')))}"
        else:
            what = info["detail"] if "detail" in info else f"{name} skipped: {info['skipped']}"
        rate = info.get("measured_tcp_goodput_bytes_per_s")
        if rate and goodput == "burst":
            what += f" (burst {info['burst_bytes']} B; TCP goodput host 0 → 1 measured at {rate * 8 / 1e6:.1f} Mbit/s)"
        elif rate and goodput == "short":
            what += f" (TCP goodput {rate * 8 / 1e6:.1f} Mbit/s)"
        lines.append(f"- {what}")
    return lines


def goal_lines(goals: Sequence[Mapping[str, Any]]) -> list[str]:
    """Goals ``{"goal", "met", "measured"}`` as markdown bullets: met / **not met** / not measured, then the figures."""
    verdict = {True: "met", False: "**not met**", None: "not measured"}
    return [f"- {g['goal']}: {verdict[g['met']]}. {g['measured']}." for g in goals]


def failed_lines(rows: Iterable[Mapping[str, Any]], label: Callable[[Mapping[str, Any]], str]) -> list[str]:
    """``Runs that failed:`` and a bullet ``label(row): error`` per row with an error; nothing when none failed."""
    errors = [r for r in rows if r.get("error")]
    return ["", "Runs that failed:", "", *(f"- {label(r)}: {r['error']}" for r in errors)] if errors else []


def not_run_lines(doc: Mapping[str, Any]) -> list[str]:
    """``Not in this run:`` and a bullet per entry of ``doc["not_run"]``; nothing when it is empty or absent."""
    return ["", "Not in this run:", "", *(f"- {n}" for n in doc["not_run"])] if doc.get("not_run") else []


def refuse_other_settings(where: str, old: Mapping[str, Any], now: Mapping[str, Any], keys: Sequence[str], what: str,
                          advice: str = "") -> None:
    """Raise ``ValueError`` naming each of ``keys`` whose value in ``old`` (an earlier run's config) differs from ``now``:
    rows kept with ``--keep-from`` must have run with the settings of the rows made now."""
    differ = [k for k in keys if old.get(k) != now[k]]
    if differ:
        raise ValueError(f"{where}: its {what} ran with other settings ("
                         + ", ".join(f"{k}={old.get(k)!r} (now {now[k]!r})" for k in differ) + f"){advice}")


def kept_provenance(old: Mapping[str, Any], previous: Sequence[Mapping[str, Any]], kept: Sequence[str],
                    **fields: Any) -> list[dict[str, Any]]:
    """Per earlier command, the rows (by name) a ``--keep-from`` run keeps from it: ``previous`` (``old``'s own record
    of the rows it had kept) narrowed to ``kept``, then ``old``'s command, date and load (and ``fields``) with the
    rest; commands left without a row are dropped."""
    earlier = {n for e in previous for n in e["rows"]}
    entries = [{**e, "rows": [n for n in e["rows"] if n in kept]} for e in previous]
    entries.append({"rows": [n for n in kept if n not in earlier], "command": old["command"], "created": old["created"],
                    "loadavg_1m_at_start": old["host"]["loadavg_1m_at_start"], **fields})  # fmt: skip
    return [e for e in entries if e["rows"]]


def keep_earlier_rows(doc: dict[str, Any], old: Mapping[str, Any], suite: str, keep_from: str,
                      name: Callable[[Mapping[str, Any]], str],
                      settings: Callable[[list[dict[str, Any]]], Sequence[str]], order: Callable[[dict[str, Any]], Any],
                      advice: str = "", prepare: Callable[[dict[str, Any]], dict[str, Any]] = dict) -> None:  # fmt: skip
    """``--keep-from``: add to ``doc`` (in place) the rows of ``old`` (an earlier run of ``doc``'s suite) whose
    ``name`` this run did not make again (each through ``prepare``), all rows sorted by ``order``, and ``doc["kept"]``
    (:func:`kept_provenance`, with the earlier run's wall time).

    Raises:
        ValueError: naming ``suite(--keep-from=...)``: ``old`` is another suite's, or ran with other
            ``settings(kept rows)`` (:func:`refuse_other_settings`, ``advice`` appended).
    """
    where = f"{suite}(--keep-from={keep_from!r})"
    if old.get("suite") != suite:
        raise ValueError(f"{where}: holds suite {old.get('suite')!r}, not {suite!r}")
    made = {name(r) for r in doc["rows"]}
    kept = [prepare(r) for r in old["rows"] if name(r) not in made]
    refuse_other_settings(where, old["config"], doc["config"], settings(kept), "rows", advice)
    doc["rows"] = sorted(doc["rows"] + kept, key=order)
    names = list(dict.fromkeys(name(r) for r in kept))
    doc["kept"] = kept_provenance(old, old.get("kept", []), names, suite_wall_s=old.get("suite_wall_s"))


def finish_suite(doc: dict[str, Any], out: Path, suite: str, started: float, plot: Callable[[dict, Path], Any]) -> dict[str, Any]:
    """Stamp the suite's wall time (since ``started``, a ``time.perf_counter()``), write its JSON and plot."""
    import time

    doc["suite_wall_s"] = round(time.perf_counter() - started, 1)
    write_json(doc, out / f"{suite}.json")
    plot(doc, out / f"{suite}.png")
    return doc
