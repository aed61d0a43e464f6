"""Pipeline schedules as values: GPipe, 1F1B (PipeDream-Flush), PipeDream (asynchronous, stashed), 2BW, the
delayed-gradient family (SpecTrain, DDG, features replay) and decoupled neural interfaces (DNI).

A pipeline splits a network into ``K`` stages, one per process, and a batch into ``m`` micro-batches.
Each stage runs a *program*: a list of actions ``(stage, kind, microbatch)`` written ``1F3`` (stage 1,
forward of micro-batch 3), ``0B2`` (backward), ``2U5`` (optimizer update, after the backward of
micro-batch 5) or ``0S2`` (DNI only: the synthetic-gradient module trained on micro-batch 2's true gradient).
Dependencies: ``sF j`` needs ``(s-1)F j``; ``sB j`` needs ``sF j`` and ``(s+1)B j`` (DNI: ``sF j`` only, its
gradient is predicted); ``sS j`` needs ``(s+1)B j``.

One rule per stage generates every schedule here (:class:`StageCursor`). Stage ``s`` admits up to
``w_s`` micro-batches before its first backward and then alternates backward and forward:

* ``gpipe`` (Huang et al. 2019): ``w_s = ∞`` inside a batch, all forwards then all backwards, one
  update per batch after the last backward (a *flush*). Exactly large-batch SGD with gradients
  accumulated over the micro-batches. Bubble ``(K-1)/(m+K-1)``; activations of all ``m`` micro-batches live.
* ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021): ``w_s = K - s``, one flush per batch. Same update
  and bubble as GPipe, but at most ``K - s`` micro-batches' activations alive on stage ``s``.
* ``pipedream`` (Narayanan et al. 2019): ``w_s = K - s`` and *no flush*: every micro-batch is a
  mini-batch, and each stage updates right after its backward (``sB j`` then ``sU j``). Forward ``j``
  uses the newest weights, backward ``j`` must use the same version (**weight stashing**), so stage ``s``
  keeps ``K - s`` versions. ``vertical_sync``: every stage uses the version the input stage used for
  that micro-batch (its id travels with the activation); each stage then keeps ``K`` versions.
* ``2bw`` (PipeDream-2BW, Narayanan et al. 2021): the 1F1B order without flushes; gradients of the ``m``
  micro-batches of a batch are accumulated and applied after the batch's last backward. Batch ``b``
  runs on version ``max(0, b - 1)``: ``W(t+1) = W(t) - ν·∇f(W(t-1))``. Two versions per stage (``m >= K``).

* ``spectrain``, ``ddg``, ``features_replay``: ``pipedream``'s programs; what differs is the weights a backward
  computes with (``ScheduleSpec.backward_on``: a momentum prediction, the current weights through the stored
  activations, or a replay of the forward), so no stashed versions (:mod:`.spectrain`, :mod:`.delayed`).
* ``dni`` (Jaderberg et al. 2017, ``synthetic_gradients=True`` on PipeDream's timing): stage ``s < K-1`` runs
  ``sF j sB j sU j`` back to back, its backward on the gradient its synthetic module predicts from the boundary
  activation (:mod:`.dni`), and ``sS j`` (the module trained on the true gradient that stage ``s+1`` sends back)
  once two micro-batches are held (``w_s = 2``: the true gradient returns one forward and backward of stage ``s+1``
  later, whatever ``K``). The last stage runs ``F j B j U j`` on its loss.

A :class:`Schedule` is the finite program of every stage for a number of batches. :func:`validate`
simulates it in unit time (forward 1, backward ``backward_cost``, update 0), checks that every
dependency holds and nothing deadlocks, and derives the in-flight counts, the stash depth (weight
versions alive at once) and the bubble fraction. The runtime executes the same rule incrementally,
one Lightning batch (a *window*) at a time: a stage stops before the forward of a micro-batch that
has not arrived, and drains (finishes every pending backward) only when told to.
"""

from __future__ import annotations

import math
import re
from dataclasses import KW_ONLY, dataclass, field

__all__ = [
    "Action",
    "KINDS",
    "SCHEDULES",
    "SPECS",
    "Schedule",
    "ScheduleSpec",
    "ScheduleStats",
    "StageCursor",
    "bubble_formula",
    "build_schedule",
    "schedule_spec",
    "validate",
    "version_for",
]

KINDS = ("F", "B", "U", "S")
_ACTION = re.compile(r"^(\d+)([A-Z])(\d+)$")


@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule's name means: the facts the cursor, the executor and the strategy ask of it.

    Attributes:
        name: ``gpipe``, ``1f1b``, ``pipedream`` or ``2bw``.
        flushed: one update per batch after its last backward (``sB last`` then ``sU``), and nothing of the next
            batch enters before it: every rank updates in the same window (``gpipe``, ``1f1b``).
        all_forwards_first: ``w_s = ∞``, a batch's forwards all run before its first backward (``gpipe``);
            otherwise ``w_s = K - s`` and the stage alternates ``F j``, ``B j - w_s`` (1F1B order).
        updates_per_microbatch: every micro-batch is a mini-batch: ``sB j`` then ``sU j``, its loss not divided by
            ``m`` (``pipedream``).
        delayed_weights: batch ``b`` runs on version ``max(0, b - 1)``: ``W(t+1) = W(t) - ν·∇f(W(t-1))`` (``2bw``).
        allows_vertical_sync: every stage may use the version the input stage used for a micro-batch (``pipedream``).
        optional_stashing: ``weight_stashing=False`` is a meaningful ablation (``pipedream``); flushed schedules never
            update mid-flight and ``2bw`` needs its two versions.
        needs_microbatches_ge_stages: ``m >= K`` (``1f1b``: the warm-up keeps ``K - s`` in flight within a batch;
            ``2bw``: version ``b - 1`` exists on every stage only when a batch fills the pipeline).
        backward_on: the weights a backward computes with (the delayed-gradient family, all on PipeDream's timing):
            ``"forward"`` the forward's version (stashed where needed), ``"prediction"`` the forward's weights
            predicted from the momentum (``spectrain``, :mod:`.spectrain`), ``"current"`` the newest weights with the
            forward's stored activations (``ddg``), ``"replay"`` the newest weights after recomputing the forward on
            the stored input (``features_replay``; :mod:`.delayed` has both), ``"synthetic"`` the newest weights right
            after the forward, on a gradient predicted by the stage's synthetic-gradient module (``dni``, :mod:`.dni`).
        allows_synthetic_gradients: ``synthetic_gradients=True`` may run on this schedule's timing (``pipedream``:
            every micro-batch a mini-batch, no flush; DNI's decoupled update).
    """

    name: str
    _: KW_ONLY
    flushed: bool = False
    all_forwards_first: bool = False
    updates_per_microbatch: bool = False
    delayed_weights: bool = False
    allows_vertical_sync: bool = False
    optional_stashing: bool = False
    needs_microbatches_ge_stages: bool = False
    backward_on: str = "forward"
    allows_synthetic_gradients: bool = False

    @property
    def stashes(self) -> bool:
        """A backward computes with the weights its forward used (a stash where the stage updated in between)."""
        return self.backward_on == "forward"

    @property
    def predicts_weights(self) -> bool:
        """Forward and backward run on weights predicted from the optimizer's momentum (``spectrain``)."""
        return self.backward_on == "prediction"

    @property
    def replays_forward(self) -> bool:
        """The backward first recomputes the stage's forward on the stored input with the current weights."""
        return self.backward_on == "replay"

    @property
    def synthetic(self) -> bool:
        """Each stage but the last backpropagates a predicted gradient right after its forward (DNI)."""
        return self.backward_on == "synthetic"

    @property
    def scalable(self) -> bool:
        """Whether every rank can agree on a loss-scale overflow before the update it concerns: flushed schedules
        update in the same window everywhere, and ``2bw``'s new weights are first read a batch later."""
        return self.flushed or self.delayed_weights

    @property
    def defers_scaled_steps(self) -> bool:
        """Under loss scaling, a stage's step waits for the world's overflow flag until its weights are needed: the
        stages update at different moments (not flushed) but read the result only a batch later (delayed)."""
        return not self.flushed and self.delayed_weights

    def warmup(self, num_stages: int, stage: int) -> float:
        """``w_s``: micro-batches stage ``s`` admits before its first backward (DNI: before its first ``S``)."""
        if self.synthetic:
            return 2 if stage < num_stages - 1 else 1
        return math.inf if self.all_forwards_first else num_stages - stage

    def vertical_sync_refusal(self) -> str | None:
        """The rule ``vertical_sync=True`` breaks under this schedule (``None``: allowed)."""
        if self.allows_vertical_sync:
            return None
        allowed = " or ".join(repr(s.name) for s in SPECS.values() if s.allows_vertical_sync)
        return f"vertical sync applies to schedule={allowed}, not {self.name!r}"

    def synthetic_refusal(self) -> str | None:
        """The rule ``synthetic_gradients=True`` breaks under this schedule (``None``: allowed)."""
        if self.allows_synthetic_gradients or self.synthetic:
            return None
        allowed = " or ".join(repr(s.name) for s in SPECS.values() if s.allows_synthetic_gradients)
        return (f"DNI updates each stage right after its forward, one update per micro-batch and no flush: it runs on "
                f"the timing of schedule={allowed}, not {self.name!r}, "
                + ("which updates once per batch after a flush" if self.flushed else "whose backward waits for stage s+1's true gradient"))


#: Every schedule, by name.
SPECS: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", flushed=True, all_forwards_first=True),
        ScheduleSpec("1f1b", flushed=True, needs_microbatches_ge_stages=True),
        ScheduleSpec("pipedream", updates_per_microbatch=True, allows_vertical_sync=True, optional_stashing=True,
                     allows_synthetic_gradients=True),
        ScheduleSpec("2bw", delayed_weights=True, needs_microbatches_ge_stages=True),
        ScheduleSpec("spectrain", updates_per_microbatch=True, backward_on="prediction"),
        ScheduleSpec("ddg", updates_per_microbatch=True, backward_on="current"),
        ScheduleSpec("features_replay", updates_per_microbatch=True, backward_on="replay"),
        ScheduleSpec("dni", updates_per_microbatch=True, backward_on="synthetic"),
    )
}
SCHEDULES = tuple(SPECS)


def schedule_spec(name: object, owner: str, arg: str = "schedule") -> ScheduleSpec:
    """The spec of schedule ``name``; ``ValueError`` in the house format (``owner(arg=name): rule``) otherwise."""
    if not isinstance(name, str) or name not in SPECS:
        raise ValueError(f"{owner}({arg}={name!r}): {arg} must be one of {', '.join(map(repr, SCHEDULES))}")
    return SPECS[name]


@dataclass(frozen=True, order=True)
class Action:
    """One step of a stage's program: ``kind`` in ``F`` (forward), ``B`` (backward), ``U`` (update)."""

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action(kind={self.kind!r}): kind must be one of {KINDS}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"Action({self.stage}, {self.kind!r}, {self.microbatch}): stage and microbatch must be >= 0")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """The action written ``text`` (``"1F3"``); ``str(Action.parse(t)) == t``."""
        match = _ACTION.match(text.strip())
        if match is None:
            raise ValueError(f"Action.parse({text!r}): expected <stage><kind><microbatch>, e.g. '1F3'")
        return cls(int(match[1]), match[2], int(match[3]))


def version_for(spec: ScheduleSpec, batch: int, newest: int, incoming: int | None = None, clamp: bool = False) -> int:
    """Weight version the forward of a micro-batch of batch ``batch`` uses on a stage whose newest is ``newest``.

    ``pipedream``: the newest, or with vertical sync the ``incoming`` id from the input stage. ``2bw``:
    batch ``b`` uses version ``b - 1`` (the one-step delay), or the newest if a short batch left it
    behind and ``clamp`` is set (the runtime's fallback; :func:`validate` reports it instead). Flushed
    schedules: the newest (nothing updates inside a batch).
    """
    if spec.delayed_weights:
        delayed = max(0, batch - 1)
        return min(delayed, newest) if clamp else delayed
    if incoming is not None:
        return incoming
    return newest


class StageCursor:
    """Where one stage is in its program; :meth:`next_action` applies the schedule's rule.

    Feed batches with :meth:`admit` (``n`` micro-batches each); their forwards can then run. For
    flushed schedules every batch ends with its backwards and one update; for ``pipedream`` and
    ``2bw`` the stage stops before a forward that has not been admitted, unless ``draining``.
    Finished batches are forgotten, so a cursor runs for any number of batches in constant memory.
    """

    def __init__(self, schedule: str, num_stages: int, stage: int) -> None:
        self.spec = schedule_spec(schedule, "StageCursor")
        if not 0 <= stage < num_stages:
            raise ValueError(f"StageCursor(stage={stage}): stage must be in [0, {num_stages})")
        self.schedule, self.num_stages, self.stage = schedule, num_stages, stage
        self.warmup = self.spec.warmup(num_stages, stage)
        self.forwarded = 0  # next forward's micro-batch
        self.backwarded = 0  # next backward's micro-batch
        self.synthesized = 0  # DNI: next micro-batch whose true gradient trains the synthetic module
        self.synthesizes = self.spec.synthetic and stage < num_stages - 1
        self.updates = 0
        self.first_batch = 0  # absolute index of the oldest batch still held
        self.start = 0  # its first micro-batch
        self.ends: list[int] = []  # cumulative end of each held batch
        self._pending_update: int | None = None

    @property
    def available(self) -> int:
        """Micro-batches admitted so far (all forwards up to here may run)."""
        return self.ends[-1] if self.ends else self.start

    @property
    def admitted_batches(self) -> int:
        return self.first_batch + len(self.ends)

    @property
    def finished(self) -> int:
        """Micro-batches the stage is done with (DNI: its synthetic module trained on them; else backwarded)."""
        return self.synthesized if self.synthesizes else self.backwarded

    @property
    def in_flight(self) -> int:
        return self.forwarded - self.finished

    def admit(self, num_microbatches: int) -> None:
        """One more batch of ``num_microbatches`` micro-batches can enter the stage."""
        if num_microbatches < 1:
            raise ValueError(f"StageCursor.admit({num_microbatches}): a batch has at least one micro-batch")
        self.ends.append(self.available + num_microbatches)

    def batch_of(self, microbatch: int) -> int:
        """Absolute index of the held batch containing ``microbatch``."""
        for i, end in enumerate(self.ends):
            if microbatch < end:
                return self.first_batch + i
        raise ValueError(f"micro-batch {microbatch} has not been admitted (admitted: {self.available})")

    def batch_size(self, microbatch: int) -> int:
        """Micro-batches in the batch containing ``microbatch``."""
        i = self.batch_of(microbatch) - self.first_batch
        return self.ends[i] - (self.ends[i - 1] if i else self.start)

    def next_action(self, draining: bool = False) -> Action | None:
        """The next action, or ``None`` when the stage must wait for a batch (or is done)."""
        s = self.stage
        if self._pending_update is not None:
            return Action(s, "U", self._pending_update)
        if self.spec.flushed:
            # Forwards only of the oldest unfinished batch; its backwards before the next batch's forwards.
            limit, drain = (self.ends[0] if self.ends else self.start), True
        else:
            limit, drain = self.available, draining
        if self.spec.synthetic and self.backwarded < self.forwarded:
            return Action(s, "B", self.backwarded)  # DNI: the predicted gradient's backward right after the forward
        if self.in_flight < self.warmup and self.forwarded < limit:
            return Action(s, "F", self.forwarded)
        if self.in_flight < self.warmup and not drain:
            return None
        if self.synthesizes and self.synthesized < self.backwarded:
            return Action(s, "S", self.synthesized)
        if self.backwarded < self.forwarded:
            return Action(s, "B", self.backwarded)
        return None

    def advance(self, action: Action) -> None:
        """Record that ``action`` (the one :meth:`next_action` returned) ran."""
        if action.kind == "F":
            self.forwarded += 1
        elif action.kind == "B":
            j = self.backwarded
            self.backwarded += 1
            if self.spec.updates_per_microbatch or (self.ends and self.backwarded == self.ends[0]):
                self._pending_update = j
        elif action.kind == "S":
            self.synthesized += 1
        else:
            self._pending_update = None
            self.updates += 1
        while self._pending_update is None and self.ends and self.finished >= self.ends[0]:
            self.start = self.ends.pop(0)
            self.first_batch += 1

    def run(self, draining: bool = False) -> list[Action]:
        """Every action the rule allows now, in order."""
        out = []
        while (action := self.next_action(draining)) is not None:
            self.advance(action)
            out.append(action)
        return out


@dataclass(frozen=True)
class Schedule:
    """The programs of all ``num_stages`` stages for ``num_batches`` batches of ``num_microbatches``."""

    name: str
    num_stages: int
    num_microbatches: int
    num_batches: int
    programs: tuple[tuple[Action, ...], ...]
    vertical_sync: bool = False
    spec: ScheduleSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "spec", schedule_spec(self.name, "Schedule", "name"))

    @property
    def boundaries(self) -> tuple[int, ...]:
        return tuple(self.num_microbatches * (b + 1) for b in range(self.num_batches))

    def to_text(self) -> str:
        """One line per stage, actions separated by spaces (:meth:`from_text` reads it back)."""
        head = f"# {self.name} K={self.num_stages} m={self.num_microbatches} batches={self.num_batches}"
        head += " vertical_sync" if self.vertical_sync else ""
        return "\n".join([head] + [" ".join(map(str, p)) for p in self.programs])

    @classmethod
    def from_text(cls, text: str) -> "Schedule":
        lines = [line for line in text.strip().splitlines() if line.strip()]
        head = lines[0].split()
        if head[0] != "#" or len(head) < 5:
            raise ValueError(f"Schedule.from_text: first line must be '# <name> K=.. m=.. batches=..', got {lines[0]!r}")
        fields = dict(part.split("=") for part in head[2:5])
        programs = tuple(tuple(Action.parse(t) for t in line.split()) for line in lines[1:])
        return cls(head[1], int(fields["K"]), int(fields["m"]), int(fields["batches"]), programs, "vertical_sync" in head)

    def timeline(self, backward_cost: float = 1.0) -> str:
        """The programs drawn on a unit-time grid (``F`` and ``B`` one slot each by default)."""
        return validate(self, backward_cost).drawing


def build_schedule(name: str, num_stages: int, num_microbatches: int, num_batches: int = 1, vertical_sync: bool = False) -> Schedule:
    """The schedule ``name`` for ``num_batches`` batches of ``num_microbatches``, ending drained."""
    spec = schedule_spec(name, "build_schedule", "name")
    for arg, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches), ("num_batches", num_batches)):
        if value < 1:
            raise ValueError(f"build_schedule({arg}={value}): {arg} must be >= 1")
    if vertical_sync and spec.vertical_sync_refusal():
        raise ValueError(f"build_schedule(vertical_sync=True): {spec.vertical_sync_refusal()}")
    programs = []
    for stage in range(num_stages):
        cursor = StageCursor(name, num_stages, stage)
        program: list[Action] = []
        for _ in range(num_batches):
            cursor.admit(num_microbatches)
            program += cursor.run()
        program += cursor.run(draining=True)
        programs.append(tuple(program))
    return Schedule(name, num_stages, num_microbatches, num_batches, tuple(programs), vertical_sync)


def bubble_formula(num_stages: int, num_microbatches: int) -> float:
    """Idle share of a flushed pipeline with equal stages: ``(K-1)/(m+K-1)``."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


@dataclass(frozen=True)
class ScheduleStats:
    """What :func:`validate` derives from a schedule (unit-time simulation)."""

    makespan: float
    bubble_fraction: float
    max_in_flight: tuple[int, ...]
    stash_depth: tuple[int, ...]
    versions: tuple[dict[int, int], ...]  # per stage: micro-batch -> weight version its forward used
    drawing: str = field(repr=False, default="")


def _check_programs(schedule: Schedule) -> None:
    K, n = schedule.num_stages, schedule.num_microbatches * schedule.num_batches
    if len(schedule.programs) != K:
        raise ValueError(f"schedule {schedule.name!r}: {len(schedule.programs)} programs for {K} stages")
    for s, program in enumerate(schedule.programs):
        seen: dict[str, list[int]] = {"F": [], "B": [], "U": [], "S": []}
        for i, a in enumerate(program):
            if a.stage != s:
                raise ValueError(f"schedule {schedule.name!r}: action {a} is in stage {s}'s program")
            if a.kind == "B" and a.microbatch not in seen["F"]:
                raise ValueError(f"schedule {schedule.name!r}: {a} runs before stage {s}'s forward of micro-batch {a.microbatch}")
            if a.kind == "U" and (i == 0 or program[i - 1] != Action(s, "B", a.microbatch)):
                raise ValueError(f"schedule {schedule.name!r}: {a} must follow {s}B{a.microbatch}")
            if a.kind == "S" and a.microbatch not in seen["B"]:
                raise ValueError(f"schedule {schedule.name!r}: {a} runs before stage {s}'s backward of micro-batch {a.microbatch}")
            seen[a.kind].append(a.microbatch)
        synthesizes = schedule.spec.synthetic and s < K - 1
        if sorted(seen["S"]) != (list(range(n)) if synthesizes else []):
            raise ValueError(f"schedule {schedule.name!r}: stage {s} trains its synthetic module on {sorted(seen['S'])}, "
                             f"expected {'each of 0..' + str(n - 1) + ' once' if synthesizes else 'none'}")
        for kind in ("F", "B"):
            if sorted(seen[kind]) != list(range(n)):
                raise ValueError(f"schedule {schedule.name!r}: stage {s} runs {kind} for {sorted(seen[kind])}, expected each of 0..{n - 1} once")
        expected_updates = list(range(n)) if schedule.spec.updates_per_microbatch else [e - 1 for e in schedule.boundaries]
        if seen["U"] != expected_updates:
            raise ValueError(f"schedule {schedule.name!r}: stage {s} updates after {seen['U']}, expected after {expected_updates}")


def validate(schedule: Schedule, backward_cost: float = 1.0) -> ScheduleStats:
    """Check ``schedule`` and simulate it; raises ``ValueError`` naming the first violated rule.

    Rules: each stage runs F and B of every micro-batch once, B after its own F, U right after the B
    that closes an update (every B for ``pipedream``, a batch's last B otherwise); a forward needs the
    previous stage's forward, a backward the next stage's backward; the programs must not deadlock;
    a ``2bw`` forward's version must exist when it runs.
    """
    _check_programs(schedule)
    K, progs = schedule.num_stages, schedule.programs
    cost = {"F": 1.0, "B": float(backward_cost), "U": 0.0, "S": 0.0}
    done: dict[Action, float] = {}
    pc, clock = [0] * K, [0.0] * K
    busy = [0.0] * K
    cells: list[list[tuple[float, float, str]]] = [[] for _ in range(K)]
    while any(pc[s] < len(progs[s]) for s in range(K)):
        progressed = False
        for s in range(K):
            while pc[s] < len(progs[s]):
                a = progs[s][pc[s]]
                deps = []
                if a.kind == "F" and s > 0:
                    deps.append(Action(s - 1, "F", a.microbatch))
                if (a.kind == "B" and s < K - 1 and not schedule.spec.synthetic) or a.kind == "S":
                    deps.append(Action(s + 1, "B", a.microbatch))
                if any(d not in done for d in deps):
                    break
                start = max([clock[s]] + [done[d] for d in deps])
                end = start + cost[a.kind]
                done[a], clock[s], pc[s] = end, end, pc[s] + 1
                busy[s] += cost[a.kind]
                if a.kind in ("F", "B"):
                    cells[s].append((start, end, f"{a.kind}{a.microbatch}"))
                progressed = True
        if not progressed:
            stuck = [str(progs[s][pc[s]]) for s in range(K) if pc[s] < len(progs[s])]
            raise ValueError(f"schedule {schedule.name!r} deadlocks: stages wait at {', '.join(stuck)}")
    makespan = max(clock)
    bubble = 1.0 - sum(busy) / (K * makespan) if makespan > 0 else 0.0
    in_flight, depth, versions = [], [], []
    for s in range(K):
        used, top, alive_max = _versions(schedule, s, versions[0] if versions else None)
        versions.append(used)
        in_flight.append(top)
        depth.append(alive_max)
    return ScheduleStats(makespan, bubble, tuple(in_flight), tuple(depth), tuple(versions), _draw(cells, makespan))


def _versions(schedule: Schedule, s: int, input_versions: dict[int, int] | None) -> tuple[dict[int, int], int, int]:
    """(version per micro-batch, max in flight, max versions alive) for stage ``s``'s program."""
    program = schedule.programs[s]
    newest, in_flight, top, backwarded = 0, set(), 0, 0
    used: dict[int, int] = {}
    backwarded_at: dict[int, int] = {}
    for a in program:
        if a.kind == "F":
            backwarded_at[a.microbatch] = backwarded
            incoming = input_versions[a.microbatch] if (schedule.vertical_sync and input_versions is not None) else None
            v = version_for(schedule.spec, a.microbatch // schedule.num_microbatches, newest, incoming)
            if v > newest:
                raise ValueError(f"schedule {schedule.name!r}: {a} needs weight version {v}, stage {s} has made only {newest}")
            used[a.microbatch] = v
            in_flight.add(a.microbatch)
            top = max(top, len(in_flight))
        elif a.kind == "B":
            if not (schedule.spec.synthetic and s < schedule.num_stages - 1):
                in_flight.discard(a.microbatch)  # DNI keeps the boundary activation until its S
            backwarded += 1
        elif a.kind == "S":
            in_flight.discard(a.microbatch)
        else:
            newest += 1
    if schedule.spec.predicts_weights:
        from lightning_pdist.pipeline.spectrain import versions_alive  # torch only where SpecTrain is asked about

        return used, top, versions_alive(((a.kind, a.microbatch) for a in program), backwarded_at)
    if not schedule.spec.stashes:
        return used, top, 1  # every backward computes with the current weights: nothing is kept
    # A version is alive from its update until its last use (or until superseded, if never used).
    last_use: dict[int, int] = {}
    created = {0: -1}
    newest = 0
    for i, a in enumerate(program):
        if a.kind == "U":
            newest += 1
            created[newest] = i
        elif a.kind in ("F", "B"):
            v = used[a.microbatch]
            last_use[v] = i
    # Half-open lifetimes [created, end): a version lives past its last use, and the newest to the end.
    end = {v: max(last_use.get(v, -1) + 1, created.get(v + 1, len(program) + 1)) for v in created}
    alive_max = max((sum(1 for v in created if created[v] <= i < end[v]) for i in range(len(program))), default=1)
    return used, top, alive_max


def _draw(cells: list[list[tuple[float, float, str]]], makespan: float) -> str:
    """Rows of fixed-width slots, one per stage: ``F3`` forward, ``B3`` backward, ``..`` idle."""
    slots = int(math.ceil(makespan))
    width = max([len(c[2]) for row in cells for c in row] + [2])
    lines = []
    for s, row in enumerate(cells):
        grid = [".." .ljust(width)] * slots
        for start, end, label in row:
            for t in range(int(start), int(math.ceil(end))):
                grid[t] = label.ljust(width)
        lines.append(f"stage {s} | " + " ".join(grid).rstrip())
    return "\n".join(lines)
