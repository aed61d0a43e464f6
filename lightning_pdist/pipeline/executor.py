"""One pipeline stage at run time: schedule actions dispatched to forward, backward and update.

:class:`StageExecutor` owns a :class:`~lightning_pdist.pipeline.schedule.StageCursor`
and interprets each action through a dispatch table (``{"F": forward, "B": backward, "U": update}``;
anything else is refused). Activations and gradients travel through
:class:`~lightning_pdist.pipeline.p2p.P2P`.

**Weight stashing under autograd.** Updating a stage's weights in place while a micro-batch's
backward is pending either trips autograd's version counter or, through ``.data``, silently gives
wrong gradients. Here a forward never records the parameters themselves: it runs
``torch.func.functional_call`` with *alias* leaves (``p.data``: the same storage, a fresh version
counter). Before an update, if the current version is still needed (a pending backward, or a
forward to come under vertical sync / 2BW), the parameters move to a copy of their storage
(``p.data = p.data.clone()``) and the optimizer then updates the copy in place; pending graphs keep
the old storage. So the memory of a stage's weights is one copy per version alive, exactly what the
schedule's stash depth says (:meth:`StageExecutor.weight_versions` measures it from the storages).
With ``weight_stashing=False`` the parameters never move: a pending backward then computes with the
newest weights and the forward's activations (PipeDream's "no stashing" baseline), on purpose.

**The delayed-gradient family** (the spec's ``backward_on``): ``ddg`` never stashes either (its rule *is* the
backward on the newest weights through the stored activations, :mod:`.delayed`); ``features_replay`` keeps only the
stage's input and rewound random stream per micro-batch and replays the forward on the current weights at the
backward (:func:`~lightning_pdist.pipeline.delayed.replay_backward`); ``spectrain`` runs a micro-batch's forward and
backward on fresh predicted weights from ``weight_predictor`` (:mod:`.spectrain`), held by its graph only.

**Synthetic gradients** (``dni``, :mod:`.dni`): a stage's ``B j`` follows its ``F j`` at once and backpropagates the
gradient its :class:`~lightning_pdist.pipeline.dni.SyntheticGradient` predicts from the output (the last stage: the
loss), sending the input gradient back as usual; only the detached output is kept, until ``S j`` receives the
gradient stage ``s+1`` sent for it and trains the synthetic module on it. Conditioned on labels (cDNI), ``label_fn(j)``
gives micro-batch ``j``'s class indices at ``B j`` (this rank's own copy of the batch: every stage of a replica loads
the same batches, so no message carries them), and they are kept with the output for ``S j``.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn
from torch.func import functional_call

from lightning_pdist.pipeline.delayed import replay_backward
from lightning_pdist.pipeline.dni import SyntheticGradient
from lightning_pdist.pipeline.schedule import Action, StageCursor, version_for
from lightning_pdist.pipeline.spectrain import staleness
from lightning_pdist.pipeline.p2p import BACKWARD, EVAL, FORWARD, P2P

__all__ = ["StageExecutor"]


@dataclass
class _InFlight:
    """What a micro-batch's backward needs: its input leaf, output (or loss) and weight leaves."""

    inputs: Tensor | None
    output: Tensor | None
    weights: dict[str, Tensor]
    version: int  # -1: the weights are not a stored version (a prediction, or none kept: features replay)
    replay: tuple[Tensor, Any] | None = None  # features replay: (the stage's input, its random stream before the forward)


class StageExecutor:
    """Executes stage ``stage`` of a ``num_stages``-stage pipeline (see the module docstring).

    Args:
        module: this stage's layers (called as ``module(x)``).
        schedule: ``gpipe``, ``1f1b``, ``pipedream`` or ``2bw``.
        p2p: transport; ``prev_rank``/``next_rank`` are the neighbours' global ranks (``None`` at the ends).
        input_fn: first stage of a multi-stage pipeline: micro-batch id -> the network's input.
        loss_fn: last stage: ``loss_fn(j, forward)`` returns micro-batch ``j``'s loss, where ``forward(x)``
            runs this stage (``x`` is used only by a one-stage pipeline; later stages use what arrived).
        update_fn: applies one optimizer step from the parameters' ``.grad`` (and may all-reduce them);
            the executor fills ``.grad`` from its accumulators just before and clears it after.
        weight_stashing: keep the forward's weights for its backward (see the module docstring).
        vertical_sync: ``pipedream``: use the input stage's version for every micro-batch.
        seed: the stage's own random stream for its layers (dropout); stages seeded alike would draw the
            same masks in lockstep. ``None`` uses the process's global stream.
        forward_context: entered around each forward's computation (and the loss), never around a backward:
            e.g. the precision plugin's autocast, which on CPU would otherwise recast the backward's matmuls
            too (backward runs in the calling thread, under its autocast state).
        settle_fn: called before the newest weights are read (a forward on them, or the next update's stash): an
            ``update_fn`` may defer its optimizer step (``2bw`` under loss scaling waits for the other stages'
            overflow flag), and that step must land first.
        weight_predictor: ``spectrain``: ``(params, s) -> ŵ`` (fresh tensors), the weights ``s`` updates ahead.
        synthetic: ``dni``, every stage but the last: the boundary's synthetic-gradient module and its optimizer.
        label_fn: a conditioned ``synthetic`` (cDNI): micro-batch id -> its class indices.
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        num_stages: int,
        schedule: str,
        p2p: P2P,
        prev_rank: int | None,
        next_rank: int | None,
        input_fn: Callable[[int], Tensor] | None,
        loss_fn: Callable[[int, Callable[[Any], Tensor]], Tensor] | None,
        update_fn: Callable[[], None],
        weight_stashing: bool = True,
        vertical_sync: bool = False,
        seed: int | None = None,
        forward_context: Callable[[], AbstractContextManager] = nullcontext,
        settle_fn: Callable[[], None] | None = None,
        weight_predictor: Callable[[dict[str, Tensor], int], dict[str, Tensor]] | None = None,
        synthetic: SyntheticGradient | None = None,
        label_fn: Callable[[int], Tensor] | None = None,
    ) -> None:
        self.module, self.stage, self.num_stages, self.schedule = module, stage, num_stages, schedule
        self.p2p, self.prev_rank, self.next_rank = p2p, prev_rank, next_rank
        self.input_fn, self.loss_fn, self.update_fn = input_fn, loss_fn, update_fn
        self.weight_stashing, self.vertical_sync = weight_stashing, vertical_sync
        self.forward_context, self.settle_fn = forward_context, settle_fn
        self.cursor = StageCursor(schedule, num_stages, stage)
        self.spec = self.cursor.spec
        if self.spec.predicts_weights and weight_predictor is None:
            raise ValueError(f"StageExecutor(schedule={schedule!r}): needs a weight_predictor (the weights s updates ahead)")
        self.weight_predictor = weight_predictor
        if self.cursor.synthesizes and synthetic is None:
            raise ValueError(f"StageExecutor(schedule={schedule!r}): stage {stage} needs a synthetic-gradient module")
        self.synthetic = synthetic if self.cursor.synthesizes else None
        if self.synthetic is not None and self.synthetic.conditioned and label_fn is None:
            raise ValueError(f"StageExecutor(stage={stage}): its synthetic module is conditioned on labels and no "
                             "label_fn gives them")  # fmt: skip
        self.label_fn = label_fn
        # dni: detached outputs (and cDNI's labels) waiting for their true gradient
        self.boundary: dict[int, tuple[Tensor, Tensor | None]] = {}
        self._last_backward_weights: dict[str, Tensor] = {}  # the leaves the last backward accumulated into
        self.params: dict[str, nn.Parameter] = dict(module.named_parameters())
        self.handlers: dict[str, Callable[[int], None]] = {"F": self.forward, "B": self.backward, "U": self.update,
                                                            "S": self.synthesize}
        self.newest = 0  # updates applied: the newest weight version's id
        self.stashed: dict[int, list[Tensor]] = {}  # older versions a forward may still need
        self.in_flight: dict[int, _InFlight] = {}
        # One set of weight leaves per version in use; backwards accumulate into their .grad (not the
        # parameters'), so Lightning's zero_grad after each training_step cannot wipe a 2BW batch whose
        # backwards span two windows. Every micro-batch an update sums over ran on one version.
        self.leaves: dict[int, dict[str, Tensor]] = {}
        self._last_backward_version = 0
        self._drain_mark = (0, 0)  # (micro-batch, version) where the pipeline was last empty
        self._warned_clamp = False
        self.rng_state = torch.Generator().manual_seed(seed).get_state() if seed is not None else None
        self.max_versions = 1  # most weight versions alive at once (measured at every forward and update)
        self.max_held = 0  # most micro-batches held at once (activations, or dni's boundary outputs), at forwards

    # ------------------------------------------------------------------ schedule
    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def admit(self, num_microbatches: int) -> None:
        """A new batch of ``num_microbatches`` micro-batches may enter."""
        self.cursor.admit(num_microbatches)
        self._post(FORWARD, self.cursor.forwarded)
        self._post(BACKWARD, self.cursor.backwarded)

    def _post(self, stream: int, microbatch: int) -> None:
        """Post the receive of ``microbatch`` on ``stream`` ahead (:meth:`P2P.post`) if it is admitted and comes to
        this stage: activations from ``prev``, gradients from ``next`` (not under ``dni``, whose ``S`` takes them)."""
        peer = self.prev_rank if stream == FORWARD else None if self.synthetic is not None else self.next_rank
        if self.p2p.post_ahead and peer is not None and microbatch < self.cursor.available:
            self.p2p.post(peer, stream, microbatch)

    def run(self, draining: bool = False) -> list[Action]:
        """Run every action the schedule allows now (``draining``: finish all pending backwards)."""
        ran = []
        while (action := self.cursor.next_action(draining)) is not None:
            self.dispatch(action)
            self.cursor.advance(action)
            ran.append(action)
        if draining:
            self.p2p.wait_all()
            self._drain_mark = (self.cursor.forwarded, self.newest)
            self._release()
        return ran

    def dispatch(self, action: Action) -> None:
        """Run one action through the dispatch table."""
        handler = self.handlers.get(action.kind)
        if handler is None or action.stage != self.stage:
            raise ValueError(f"StageExecutor(stage={self.stage}): cannot run action {action} (known kinds: {sorted(self.handlers)})")
        handler(action.microbatch)

    def scale(self, microbatch: int) -> float:
        """Loss factor: ``1/m_b`` (mean over the batch's micro-batches), ``1`` where a micro-batch is a mini-batch."""
        return 1.0 if self.spec.updates_per_microbatch else 1.0 / self.cursor.batch_size(microbatch)

    # ------------------------------------------------------------------ weight versions
    def _weights(self, version: int) -> dict[str, Tensor]:
        if version not in self.leaves:
            if version == self.newest:
                if self.settle_fn is not None:
                    self.settle_fn()
                # Same storage as the parameter, fresh version counter: an update moves the parameter away first.
                self.leaves[version] = {name: p.data.requires_grad_(p.requires_grad) for name, p in self.params.items()}
            else:
                self.leaves[version] = {name: t.detach().requires_grad_(p.requires_grad)
                                        for (name, p), t in zip(self.params.items(), self.stashed[version])}  # fmt: skip
        return self.leaves[version]

    def _future_floor(self) -> int:
        """Lowest version a forward still to come can use."""
        if self.spec.delayed_weights:
            nxt = self.cursor.forwarded
            batch = self.cursor.batch_of(nxt) if nxt < self.cursor.available else self.cursor.admitted_batches
            return max(0, batch - 1)
        if self.vertical_sync:
            return self._input_version(self.cursor.forwarded)
        return self.newest + 1 if self.spec.updates_per_microbatch else self.newest

    def _input_version(self, microbatch: int) -> int:
        """Version the input stage uses for ``microbatch`` under ``pipedream``'s rule: one update per earlier
        backward, ``K - 1`` micro-batches in flight after the last drain (the id in the header must agree)."""
        mark_mb, mark_version = self._drain_mark
        return mark_version + max(0, microbatch - mark_mb - self.num_stages + 1)

    def _release(self) -> None:
        used = {rec.version for rec in self.in_flight.values()}
        floor = self._future_floor()
        for v in [v for v in self.stashed if v not in used and v < floor]:
            del self.stashed[v]

    def _drop_leaves(self) -> None:
        """After an update consumed their gradients: leaves no pending backward or coming forward uses."""
        used, floor = {rec.version for rec in self.in_flight.values()}, self._future_floor()
        for v in [v for v in self.leaves if v not in used and v < min(floor, self.newest)]:
            del self.leaves[v]

    def _version_sets(self) -> dict[int, list[Tensor]]:
        """The weight tensors of every version still referenced, keyed by the storage of their first tensor."""
        sets = [list(self.params.values()), *self.stashed.values(), *(list(w.values()) for w in self.leaves.values()),
                *(list(r.weights.values()) for r in self.in_flight.values() if r.version < 0 and r.weights)]  # fmt: skip
        return {tensors[0].untyped_storage().data_ptr(): tensors for tensors in sets}

    def weight_versions(self) -> tuple[int, int]:
        """(versions alive, bytes they hold), counted from the distinct storages still referenced."""
        if not self.params:
            return 1, 0
        sets = self._version_sets()
        return len(sets), sum(t.numel() * t.element_size() for tensors in sets.values() for t in tensors)

    def _measure(self) -> None:
        # Runs at every forward and update: count storages only, no byte sums.
        if self.params:
            self.max_versions = max(self.max_versions, len(self._version_sets()))

    @contextmanager
    def stage_rng(self) -> Iterator[None]:
        """Run the stage's layers on its own CPU random stream (the process's stream is left as it was)."""
        if self.rng_state is None:
            yield
            return
        outer = torch.get_rng_state()
        torch.set_rng_state(self.rng_state)
        try:
            yield
        finally:
            self.rng_state = torch.get_rng_state()
            torch.set_rng_state(outer)

    # ------------------------------------------------------------------ actions
    def forward(self, j: int) -> None:
        incoming = None
        x: Tensor | None = None
        if not self.is_first:
            message = self.p2p.recv(self.prev_rank, FORWARD, j)
            self._post(FORWARD, j + 1)
            x = message.tensor
            if x.is_floating_point():
                x.requires_grad_()
            incoming = message.version
            # prev ran its forward j, so (1F1B order: F x follows B x-w) it took our gradients up to j - w_prev.
            if not self.spec.all_forwards_first:
                self.p2p.release(self.prev_rank, BACKWARD, j - (self.num_stages - self.stage + 1))
            if self.vertical_sync and incoming != self._input_version(j):
                raise RuntimeError(
                    f"pipeline stage {self.stage}: micro-batch {j} arrived with version {incoming}, the schedule says "
                    f"{self._input_version(j)}"
                )
        elif not self.is_last:
            x = self.input_fn(j)
        batch = self.cursor.batch_of(j)
        version = version_for(self.spec, batch, self.newest, incoming if self.vertical_sync else None, clamp=True)
        if self.spec.delayed_weights and version != max(0, batch - 1) and not self._warned_clamp:
            self._warned_clamp = True
            warnings.warn(
                f"pipeline stage {self.stage} ({self.schedule}): batch {batch} runs on weight version {version}, not {batch - 1}: the batch "
                "before it had fewer micro-batches than the pipeline holds, so the one-step delay could not be kept "
                "(use drop_last=True or a batch size that num_microbatches divides)",
                stacklevel=2,
            )
        weights = self._weights(version)
        if self.spec.predicts_weights and (s := staleness(j, self.cursor.backwarded)) > 0:
            predicted = self.weight_predictor(self.params, s)
            weights = {name: predicted[name].requires_grad_(p.requires_grad) for name, p in self.params.items()}
            version = -1
        replay = None
        if self.spec.replays_forward and not self.is_last:
            # Only the input and the random stream are kept; the backward replays the forward on newer weights.
            replay, version = (x, self._rng_snapshot()), -1

        def run_stage(user_input: Any = None) -> Tensor:
            with self.stage_rng():
                return functional_call(self.module, weights, (user_input if self.num_stages == 1 else x,))

        if self.is_last:
            with self.forward_context():
                output = self.loss_fn(j, run_stage)
            if not isinstance(output, Tensor) or output.ndim != 0:
                raise RuntimeError(f"pipeline stage {self.stage}: the loss of micro-batch {j} must be a scalar tensor, got {type(output).__name__}")
        else:
            with self.forward_context(), (torch.no_grad() if replay is not None else nullcontext()):
                output = run_stage()
            if not isinstance(output, Tensor):
                raise RuntimeError(
                    f"pipeline stage {self.stage}: its output is a {type(output).__name__}; a stage boundary carries one tensor"
                )
            self.p2p.send(output, self.next_rank, FORWARD, j, version=version if self.is_first else incoming)
        if replay is not None:
            self.in_flight[j] = _InFlight(None, None, {}, -1, replay)
        else:
            self.in_flight[j] = _InFlight(x if x is not None and x.requires_grad else None, output, weights, version)
        self.max_held = max(self.max_held, len(self.in_flight) + len(self.boundary))
        self._measure()

    def synthesize(self, j: int) -> None:
        """``dni``: the gradient stage ``s+1`` sent for micro-batch ``j`` trains the synthetic module on ``(h_j, δ_j)``."""
        target = self.p2p.recv(self.next_rank, BACKWARD, j).tensor
        self.p2p.release(self.next_rank, FORWARD, j)  # next ran its backward j, hence its forward j
        h, labels = self.boundary.pop(j)
        self.synthetic.train(h, target, *([labels] if labels is not None else []))

    def backward(self, j: int) -> None:
        record = self.in_flight.pop(j)
        if self.is_last:
            outputs, grad_outputs = (record.output * self.scale(j) if record.output is not None else None), None
        elif self.synthetic is not None:  # dni: the predicted gradient now; the true one trains the module at S j
            labels = self.label_fn(j) if self.synthetic.conditioned else None
            outputs, grad_outputs = record.output, self.synthetic.predict(record.output, *([labels] if labels is not None else []))
            self.boundary[j] = (record.output.detach(), labels)
        else:
            outputs, grad_outputs = record.output, self.p2p.recv(self.next_rank, BACKWARD, j).tensor
            self._post(BACKWARD, j + 1)
            self.p2p.release(self.next_rank, FORWARD, j)  # next ran its backward j, hence its forward j
        if record.replay is not None:
            g_in, self._last_backward_weights = self._replay(record, grad_outputs)
        else:
            inputs = [w for w in record.weights.values() if w.requires_grad] + ([record.inputs] if record.inputs is not None else [])
            if outputs.requires_grad and inputs:
                # Accumulates into the version's leaves (and the input leaf): C++ accumulation, no copies.
                torch.autograd.backward(outputs, grad_tensors=grad_outputs, inputs=inputs)
            self._last_backward_weights = record.weights
            g_in = None
            if record.inputs is not None:
                g_in = record.inputs.grad if record.inputs.grad is not None else torch.zeros_like(record.inputs)
        self._last_backward_version = record.version
        if g_in is not None and not self.is_first:
            self.p2p.send(g_in, self.prev_rank, BACKWARD, j, version=record.version)
        del record
        self._release()

    def _rng_snapshot(self) -> Any:
        """The stage's random stream as a forward is about to draw from it (the process's, without a seed)."""
        return self.rng_state if self.rng_state is not None else torch.get_rng_state()

    def _replay(self, record: _InFlight, grad_output: Tensor) -> tuple[Tensor | None, dict[str, Tensor]]:
        """Features replay: the forward again on the stored input with the current weights, then ``δ`` through it."""
        x, rng = record.replay
        weights = self._weights(self.newest)

        @contextmanager
        def rewound() -> Iterator[None]:
            with torch.random.fork_rng(devices=[]):  # the stage's own stream (or the process's) is left as it was
                torch.set_rng_state(rng)
                yield

        def run(leaf: Tensor, w: dict[str, Tensor]) -> Tensor:
            return functional_call(self.module, w, (leaf,))

        return replay_backward(run, x, weights, grad_output, rewound, self.forward_context, not self.is_first), weights

    def update(self, j: int) -> None:
        if self.settle_fn is not None:
            self.settle_fn()  # the previous update's step, if deferred, lands before its weights are stashed
        # The gradient first, then forget versions nobody needs: a stash copy made before that would briefly
        # hold one copy of the weights more than the schedule's depth.
        leaves = self._last_backward_weights
        for name, p in self.params.items():
            leaf = leaves.get(name)
            p.grad = leaf.grad if leaf is not None else None
            if leaf is not None:
                leaf.grad = None
        del leaves
        self._last_backward_weights = {}
        self._drop_leaves()
        if self.weight_stashing and self.spec.stashes and self._current_version_needed():
            self.stashed[self.newest] = [p.data for p in self.params.values()]
            for p in self.params.values():
                p.data = p.data.clone()
        self._measure()
        self.update_fn()
        for p in self.params.values():
            p.grad = None
        if self.newest not in self.stashed:
            self.leaves.pop(self.newest, None)  # they alias the storage the optimizer just changed in place
        self.newest += 1
        if self.spec.flushed:
            # A flushed batch is over here: every neighbour takes what we sent before it needs anything more.
            self.p2p.wait_all()
        self._release()
        self._drop_leaves()

    def _current_version_needed(self) -> bool:
        if any(rec.version == self.newest for rec in self.in_flight.values()):
            return True
        if self.spec.delayed_weights or self.vertical_sync:
            return self._future_floor() <= self.newest
        return False

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def forward_only(self, num_microbatches: int, input_fn: Callable[[int], Tensor] | None) -> list[Tensor]:
        """GPipe-style forward of ``num_microbatches`` with the current weights; outputs on the last stage."""
        outputs = []
        for j in range(num_microbatches):
            x = input_fn(j) if self.is_first else self.p2p.recv(self.prev_rank, EVAL, j).tensor
            with self.stage_rng():
                y = self.module(x)
            if self.is_last:
                outputs.append(y)
            else:
                self.p2p.send(y, self.next_rank, EVAL, j, count=False)
        self.p2p.wait_all()
        return outputs

    @property
    def drained(self) -> bool:
        return not self.in_flight and not self.boundary and self.cursor.forwarded == self.cursor.available

    def state_dict(self) -> dict:
        """Schedule position, version counter and the older versions a later forward needs (2BW).

        Taken on a drained stage (nothing in flight); tensors are copies.
        """
        if not self.drained:
            raise RuntimeError(f"StageExecutor(stage={self.stage}).state_dict(): drain the pipeline first")
        return {
            "schedule": self.schedule,
            "newest": self.newest,
            "batches": self.cursor.admitted_batches,
            "microbatches": self.cursor.available,
            "stashed": {v: [t.detach().clone() for t in ts] for v, ts in self.stashed.items()},
            "rng_state": self.rng_state,
            **({"synthetic": self.synthetic.state_dict()} if self.synthetic is not None else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["schedule"] != self.schedule:
            raise ValueError(f"pipeline checkpoint was written by schedule {state['schedule']!r}, this run uses {self.schedule!r}")
        self.newest = int(state["newest"])
        c = self.cursor
        c.first_batch, c.start, c.ends = int(state["batches"]), int(state["microbatches"]), []
        c.forwarded = c.backwarded = c.synthesized = c.start
        c.updates = self.newest
        self._drain_mark = (c.forwarded, self.newest)
        self.stashed = {int(v): [t.clone() for t in ts] for v, ts in state["stashed"].items()}
        if state.get("rng_state") is not None:
            self.rng_state = state["rng_state"]
        if self.synthetic is not None:
            if "synthetic" not in state:
                raise ValueError("pipeline checkpoint holds no synthetic-gradient module for this stage; resume a "
                                 "synthetic_gradients=True run from one of its own checkpoints")  # fmt: skip
            self.synthetic.load_state_dict(state["synthetic"])
