"""Every figure the README and the method cards quote comes from a results file, a named command, or a citation.

A *figure* is a number written with a decimal point (``0.786``, ``34.0``) or with thousands separators (``66,056``) in
the prose of README.md or docs/algorithms/*.md: outside fenced code blocks, code spans, and link targets. Each one
must be, at the precision shown:

1. **measured**: a number in one of the results files the document is about (:data:`SOURCES`, under docs/results/)
   that rounds to it at the decimals shown; with a unit written right after the figure, the file's number in base
   units is converted first: ``MB``/``kB``/``GB`` (bytes / 10^6, 10^3, 10^9), ``MiB``/``KiB`` (/ 2^20, 2^10),
   ``ms``/``µs`` (seconds × 10^3, 10^6), ``%`` (fraction × 100); an integer with separators must equal the file's
   integer exactly;
2. **computed** by a named command: ``docs/results/bytes.json`` (``python -m lightning_pdist.bench bytes``, the byte
   models) is a source of every document;
3. **worked out in the text**: the result of an arithmetic identity written in the line, ``a × b = c``,
   ``a + b + c = d``, ``40.76 ms / 34.03 ms = 1.20`` (``×``, ``·``, ``*``, ``+``, ``−``, ``/`` between numbers, each
   optionally with its unit): the identity must hold at the result's precision (the operands are figures
   themselves and are checked by these rules);
4. **cited or set by hand**, and marked so: the figure stands inside a bracket that opens with a marker word,
   ``(paper 003: 0.705)``, ``(published: ...)``, ``(default: 0.5)``, ``(chosen: ...)``, ``(by hand: ...)`` (the
   marker is the bracket's first word; a nested bracket inherits it), or on a line (a table row) carrying an HTML
   comment that opens with a marker word, ``<!-- by hand: unit-time simulation of the schedule -->``; such a figure
   is checked against no file, so the marker says where it comes from instead. ``recipe run`` marks a figure from a
   run of a recipe that no results file keeps, ``simulated`` one from a simulation the text describes.

Anything else fails, naming the file, the line and the figure: a figure typed in, or left behind when a results file
was regenerated. :func:`test_a_changed_figure_fails` shows that one digit changed by hand in a card is caught.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
ALWAYS = ("bytes.json",)  # python -m lightning_pdist.bench bytes
AVERAGING = ("averaging.json", "averaging_overhead.json")
SOURCES: dict[str, tuple[str, ...]] = {
    "README.md": (*AVERAGING, "pipeline.json", "sign.json", "ps_sharding.json", "tensor_parallel.json"),
    "docs/algorithms/pdist_ddp.md": AVERAGING,
    "docs/algorithms/local_sgd.md": AVERAGING,
    "docs/algorithms/bmuf.md": AVERAGING,
    "docs/algorithms/easgd.md": AVERAGING,
    "docs/algorithms/simuparallel_sgd.md": AVERAGING,
    "docs/algorithms/signsgd.md": ("sign.json", "sign_estimator_coordinate.json", "sign_estimator_tensor.json", "sign_lr.json"),
    "docs/algorithms/parameter_server.md": ("ps_sharding.json", "ps_sharding_spread.json", "ps_sharding_paced_4.json",
                                            "ps_sharding_paced_8.json", "ps_sharding_ab8_old_replies.json",
                                            "ps_sharding_ab8_paced_replies.json", "ps_sharding_turns_turns_propagate.json",
                                            "ps_sharding_turns_main_propagate.json", "ps_sharding_final_4_raise.json",
                                            "ps_sharding_final_4_propagate.json",
                                            "ps_sharding_final_8_propagate.json", "ps_sharding_final_8_raise.json"),
    "docs/algorithms/sandblaster.md": (),
    "docs/algorithms/pipeline.md": ("pipeline.json", "pipeline_run1.json", "pipeline_run2.json", "pipeline_speed.json",
                                   "pipeline_speed_run1.json"),
    "docs/algorithms/tensor_parallel.md": ("tensor_parallel.json",),
    "docs/algorithms/compression.md": ("compression.json",),
    "docs/algorithms/diloco.md": ("diloco.json",),
    "docs/algorithms/dpsgd.md": (),  # no benchmark yet
    "docs/algorithms/hogwild.md": (),  # no benchmark yet
    "docs/algorithms/apex.md": ("rl.json",),
    "docs/algorithms/parallax.md": (),  # no benchmark yet (issue 23 item 5)
}
MARKERS = ("paper", "published", "default", "chosen", "by hand", "recipe run", "simulated")
COMMENT = re.compile(r"<!--\s*(.*?)-->")

# not part of a word, a version (2.13.0), a longer number or a path; a trailing "x" (1.20x) is a ratio's sign
FIGURE = re.compile(r"(?<![\w.,/])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+)(?![^\Wx]|x\w|[.,]\d)")
UNIT = re.compile(r"\s?(MB|kB|GB|MiB|KiB|ms|µs|%)(?![A-Za-z])")
SCALES = {"MB": (1e-6,), "kB": (1e-3,), "GB": (1e-9,), "MiB": (2.0**-20,), "KiB": (2.0**-10,), "ms": (1e3,),
          "µs": (1e6,), "%": (100.0,)}  # fmt: skip
NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
UNITS = r"(?:\s?(?:MB|kB|GB|MiB|KiB|ms|µs|B))?"  # an operand may carry its unit: 40.76 ms / 34.03 ms = 1.20
IDENTITY = re.compile(rf"((?:{NUMBER}){UNITS}(?:\s*[×·*+−\-/]\s*\(?(?:{NUMBER}){UNITS}\)?)+)\s*=\s*({NUMBER})")


def _numbers(value, out: list[float]) -> None:
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, (int, float)):
        out.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _numbers(v, out)
    elif isinstance(value, list):
        for v in value:
            _numbers(v, out)
    elif isinstance(value, str):
        out.extend(float(m) for m in re.findall(r"-?\d+\.\d+|-?\d+", value))


def source_numbers(names: Iterable[str]) -> list[float]:
    out: list[float] = []
    for name in names:
        _numbers(json.loads((RESULTS / name).read_text()), out)
    return out


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, text)`` outside fenced blocks, with code spans (also across lines), link targets and URLs blanked
    (same length); a line whose HTML comment opens with a marker word is left out as a whole."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            kept.append("")
            continue
        kept.append("" if fenced else line)
    blank = lambda m: re.sub(r"[^\n]", " ", m.group())  # noqa: E731
    prose = re.sub(r"`[^`]*`", blank, "\n".join(kept))
    lines = []
    for number, line in enumerate(prose.split("\n"), 1):
        if any(c.lower().startswith(MARKERS) for c in COMMENT.findall(line)):
            continue  # a line marked as a whole
        line = re.sub(r"\]\([^)]*\)", blank, line)
        line = re.sub(r"https?://\S+", blank, line)
        lines.append((number, COMMENT.sub(blank, line)))
    return lines


def _value(token: str) -> float:
    return float(token.replace(",", ""))


def _evaluate(expression: str) -> float | None:
    expression = re.sub(r"(?<=\d)\s?(?:MB|kB|GB|MiB|KiB|ms|µs|B)\b", "", expression)
    python = re.sub(NUMBER, lambda m: repr(_value(m.group())), expression)
    python = python.replace("×", "*").replace("·", "*").replace("−", "-")
    if not re.fullmatch(r"[\d.\s*+\-/()e]+", python):
        return None
    try:
        return eval(python, {"__builtins__": {}})  # noqa: S307  (digits and operators only, checked above)
    except (SyntaxError, ZeroDivisionError):
        return None


def worked_out(line: str) -> set[tuple[int, int]]:
    """Spans of the figures that are results of arithmetic identities holding exactly in ``line``."""
    spans = set()
    for m in IDENTITY.finditer(line):
        got = _evaluate(m.group(1))
        if got is not None and math.isclose(got, _value(m.group(2)), rel_tol=0, abs_tol=10 ** -_decimals(m.group(2)) / 2):
            spans.add(m.span(2))
    return spans


def _decimals(token: str) -> int:
    return len(token.split(".")[1]) if "." in token else 0


def marked(line: str, start: int) -> bool:
    """Whether position ``start`` lies inside a bracket (or a bracket inside one) whose first word is a marker."""
    stack: list[bool] = []
    for i, ch in enumerate(line[:start]):
        if ch == "(":
            head = line[i + 1 :].lstrip().lower()
            stack.append(any(head.startswith(m) for m in MARKERS) or (bool(stack) and stack[-1]))
        elif ch == ")" and stack:
            stack.pop()
    return bool(stack) and stack[-1]


def found(token: str, unit: str | None, numbers: list[float]) -> bool:
    shown, places = _value(token), _decimals(token)
    exact = "," in token and places == 0
    scales = (1.0, *SCALES.get(unit or "", ()))
    for v in numbers:
        for scale in scales:
            x = v * scale
            if exact and scale == 1.0:
                if x == shown:
                    return True
            elif round(x, places) == shown or math.isclose(round(x, places), shown, rel_tol=1e-12):
                return True
    return False


def unsupported(doc: str, text: str | None = None) -> list[str]:
    """The figures of ``doc`` (a path under the repo) that no rule accounts for, as ``file:line: figure``."""
    text = (ROOT / doc).read_text() if text is None else text
    numbers = source_numbers((*SOURCES[doc], *ALWAYS))
    bad = []
    for number, line in prose_lines(text):
        derived = worked_out(line)
        for m in FIGURE.finditer(line):
            if m.span(1) in derived or marked(line, m.start(1)):
                continue
            unit = UNIT.match(line, m.end(1))
            if not found(m.group(1), unit.group(1) if unit else None, numbers):
                bad.append(f"{doc}:{number}: {m.group(1)}  ({line.strip()[:120]})")
    return bad


@pytest.mark.parametrize("doc", sorted(SOURCES))
def test_every_quoted_figure_has_a_source(doc):
    bad = unsupported(doc)
    assert not bad, f"{len(bad)} figures in {doc} come from no results file of {SOURCES[doc]} nor bytes.json:\n" + "\n".join(bad)


def test_every_card_is_checked():
    cards = {f"docs/algorithms/{p.name}" for p in (ROOT / "docs" / "algorithms").glob("*.md")}
    assert cards <= set(SOURCES), f"method cards without a SOURCES entry: {sorted(cards - set(SOURCES))}"


def test_a_changed_figure_fails():
    """A figure changed by hand in a card is caught: the pipeline card's bytes per step (computed) and the first
    three measured figures of its "Measured" section, each with its last digit changed; the rules hold too."""
    doc = "docs/algorithms/pipeline.md"
    text = (ROOT / doc).read_text()
    assert not unsupported(doc, text)
    measured_at = text.index("## Measured")
    first = [m for m in FIGURE.finditer(text, measured_at)][:3]
    targets = [(text.index("**66,056 bytes**") + 2, "66,056")] + [(m.start(1), m.group(1)) for m in first]
    for start, figure in targets:
        changed = figure[:-1] + str((int(figure[-1]) + 1) % 10)
        edited = text[:start] + changed + text[start + len(figure) :]
        assert any(f": {changed}  (" in b for b in unsupported(doc, edited)), f"{figure} -> {changed} not caught"
    assert worked_out("4 × 2,402 = 9,608") and not worked_out("4 × 2,402 = 9,609")
    assert marked("BERT (paper 003: 0.705) vs", 17) and not marked("BERT (measured: 0.705)", 17)
