"""One rank of a DeepSpeed AutoTP training run (paper 003's tensor-parallel baseline) on CPU over gloo.

``python -m lightning_pdist.bench.tp_deepspeed --spec JSON --out-dir DIR`` (the spec: :func:`run_rank`'s keywords,
``tp_size`` ``null`` for ``WORLD_SIZE``) is started once per rank by :func:`~lightning_pdist.bench.netns.launch_ranks`
or ``torchrun``; :func:`run_rank` trains :class:`~lightning_pdist.models.encoder.EncoderClassifier` (transformers'
BERT or ALBERT) under ``{"tensor_parallel": {"autotp_size": tp_size}}`` and each rank writes ``DIR/rank<r>.json``
(read them with :func:`~lightning_pdist.bench.launch.read_results` ``(DIR, "rank", world_size, suite)``).

**AutoTP trains here** (checked with deepspeed 0.19.8, torch 2.13.0+cpu, transformers 5.23, 2 ranks, gloo):
BERT and ALBERT, ZeRO stages 0, 1 and 2 (3 ran too, but ZeRO-3 empties ``param.data``, so it is not offered),
SGD and Adam. AutoTP replaces query/key/value and the FFN's first linear with column-parallel ``LinearLayer``
and the attention output and FFN output with row-parallel ``LinearAllreduce``; embeddings, LayerNorms, the
pooler and the classifier stay replicated. A tiny BERT (hidden 32, 2 layers) holds 13,698 of its 22,050
parameters per rank, and with dropout 0 its losses equal :func:`reference_losses` (one process, no DeepSpeed)
to 1e-6 (bit for bit with SGD). Four things had to be right:

* ``train_batch_size`` must be left out of the config: DeepSpeed checks it against the *world* size
  (``AssertionError: Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu *
  gradient_acc_step * world_size 4 != 4 * 1 * 2``), although the TP ranks share one batch.
* DeepSpeed 0.19.8 clips gradients to norm 1.0 unless ``gradient_clipping`` says otherwise; the config sets it
  explicitly (0 = off, the default here) so the reference can do the same.
* SGD under ZeRO 1/2 needs ``"zero_allow_untested_optimizer": true``; Adam uses ``torch_adam`` so that no C++
  op is JIT-built (``fused_adam`` takes ~80 s on first use, see ``machine-and-network.md`` section 6).
* The ranks of one TP group must see the same batch and draw the same dropout masks: every rank seeds torch
  with ``seed`` before building the model and again before the first step.

``family="transformer"``: Lightning's demo Transformer (``lightning.pytorch.demos.Transformer(**model_kwargs)``,
an encoder-decoder language model of ``nn.Transformer`` layers) on the same token batches, NLL of the next token; a
failure of AutoTP on it is raised as DeepSpeed raises it (the suite records it in the row).

DeepSpeed builds a ``(data_parallel, tensor_parallel)`` mesh, so rank ``r`` is TP rank ``r % tp_size`` of
replica ``r // tp_size``; ``tp_size < world_size`` gives replica ``d`` rows ``d*B .. (d+1)*B`` of a global batch
of ``B * world_size / tp_size`` rows. ``tp_size == world_size`` is the pure-TP baseline.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

from lightning_pdist.bench.launch import worker_main
from lightning_pdist.bench.worker import read_tx

OPTIMIZERS = ("sgd", "adam")
FAMILIES = ("bert", "albert", "transformer")
ZERO_STAGES = (0, 1, 2)


def _model_arg(model_kwargs: dict[str, Any], name: str) -> Any:
    """``model_kwargs[name]``, else ``EncoderClassifier``'s default (kept in one place, its signature)."""
    import inspect

    from lightning_pdist.models.encoder import EncoderClassifier

    return model_kwargs.get(name, inspect.signature(EncoderClassifier).parameters[name].default)


def _check(family: str, model_kwargs: dict[str, Any], batch_size: int, seq_len: int, steps: int, warmup_steps: int,
           tp_size: int, seed: int, zero_stage: int, optimizer: str, lr: float,
           gradient_clipping: float) -> None:  # fmt: skip
    """Raise ``ValueError`` naming the argument, its value and the rule (before any process group exists)."""
    for arg, value, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 1), ("steps", steps, 1),
                            ("warmup_steps", warmup_steps, 0), ("tp_size", tp_size, 1), ("seed", seed, 0)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"run_rank({arg}={value!r}): {arg} must be an int >= {low}")
    if family == "transformer":
        max_len, num_heads = seq_len, model_kwargs.get("nhead", 2)  # positional encoding to 5000 tokens
    else:
        max_len, num_heads = _model_arg(model_kwargs, "max_len"), _model_arg(model_kwargs, "num_heads")
    if seq_len > max_len:
        raise ValueError(f"run_rank(seq_len={seq_len}): seq_len must be <= the model's max_len ({max_len})")
    if num_heads % tp_size:
        raise ValueError(f"run_rank(tp_size={tp_size}): tp_size must divide the model's num_heads ({num_heads})")
    if family not in FAMILIES:
        raise ValueError(f"run_rank(family={family!r}): family must be one of {FAMILIES}")
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"run_rank(zero_stage={zero_stage!r}): zero_stage must be one of {ZERO_STAGES}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"run_rank(optimizer={optimizer!r}): optimizer must be one of {OPTIMIZERS}")
    if not lr > 0:
        raise ValueError(f"run_rank(lr={lr!r}): lr must be > 0")
    if not gradient_clipping >= 0:
        raise ValueError(f"run_rank(gradient_clipping={gradient_clipping!r}): gradient_clipping must be >= 0 (0 = off)")


def imdb_like_batches(vocab_size: int, num_classes: int, batch_size: int, seq_len: int, count: int, seed: int) -> list:
    """``count`` batches ``(tokens (B, L) int64, labels (B,) int64)`` shaped like tokenised IMDB reviews.

    Each row holds between ``L // 2`` and ``L`` word ids in ``[2, vocab_size)`` (0 is padding, 1 unknown, as in
    :mod:`lightning_pdist.data.imdb`), then padding; labels are uniform in ``[0, num_classes)``. The same
    ``seed`` gives the same batches in every process.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(2, vocab_size, (batch_size, seq_len), generator=g)
        lengths = torch.randint(seq_len // 2, seq_len + 1, (batch_size, 1), generator=g).clamp_(min=1)
        tokens[torch.arange(seq_len).expand(batch_size, -1) >= lengths] = 0
        out.append((tokens, torch.randint(0, num_classes, (batch_size,), generator=g)))
    return out


def deepspeed_config(batch_size: int, tp_size: int, zero_stage: int, optimizer: str, lr: float,
                     gradient_clipping: float) -> dict[str, Any]:  # fmt: skip
    """The DeepSpeed config of one run (no ``train_batch_size``: DeepSpeed would check it against the world size)."""
    params = {"lr": lr} if optimizer == "sgd" else {"lr": lr, "torch_adam": True, "adam_w_mode": False}
    return {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": gradient_clipping,  # deepspeed 0.19.8 clips to 1.0 when this is absent
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,  # torch SGD under ZeRO 1/2
        "tensor_parallel": {"autotp_size": tp_size},
        "optimizer": {"type": "SGD" if optimizer == "sgd" else "Adam", "params": params},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _build(family: str, model_kwargs: dict[str, Any], seed: int) -> Any:
    import torch

    from lightning_pdist.models.encoder import EncoderClassifier

    torch.manual_seed(seed)  # every rank builds the same full model before AutoTP cuts it
    if family == "transformer":
        from lightning.pytorch.demos import Transformer

        return Transformer(**model_kwargs)
    return EncoderClassifier(family, **model_kwargs)


def _loss(model: Any, family: str, tokens: Any, labels: Any) -> Any:
    """Cross-entropy of the class (encoders); the demo Transformer's NLL of each next token (``labels`` unused)."""
    from torch.nn import functional as F

    if family == "transformer":
        inputs, target = tokens[:, :-1], tokens[:, 1:]
        return F.nll_loss(model(inputs, target), target.reshape(-1))
    return F.cross_entropy(model(tokens), labels)


def _batches(family: str, model_kwargs: dict[str, Any], batch_size: int, seq_len: int, count: int, seed: int) -> list:
    """:func:`imdb_like_batches` (one token more per row for the demo Transformer: inputs and next-token targets)."""
    classes = 2 if family == "transformer" else _model_arg(model_kwargs, "num_classes")
    return imdb_like_batches(_model_arg(model_kwargs, "vocab_size"), classes, batch_size,
                             seq_len + (family == "transformer"), count, seed)  # fmt: skip


def reference_losses(family: str, model_kwargs: dict[str, Any], batch_size: int, seq_len: int, steps: int,
                     warmup_steps: int, seed: int, *, optimizer: str = "sgd", lr: float = 0.01,
                     gradient_clipping: float = 0.0) -> list[float]:  # fmt: skip
    """The losses of :func:`run_rank` with ``tp_size == world_size``, from one process without DeepSpeed.

    Same model, batches, seeds and update rule (torch's SGD or Adam, ``clip_grad_norm_`` when
    ``gradient_clipping > 0``). With ``dropout=0`` a real tensor-parallel run matches it to float rounding.
    """
    import torch

    _check(family, model_kwargs, batch_size, seq_len, steps, warmup_steps, 1, seed, 0, optimizer, lr, gradient_clipping)
    model = _build(family, model_kwargs, seed)
    opt_cls = torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam
    opt = opt_cls(model.parameters(), lr=lr)
    data = _batches(family, model_kwargs, batch_size, seq_len, warmup_steps + steps, seed)
    torch.manual_seed(seed)
    losses = []
    for tokens, labels in data:
        loss = _loss(model, family, tokens, labels)
        opt.zero_grad()
        loss.backward()
        if gradient_clipping > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), gradient_clipping)
        opt.step()
        losses.append(loss.item())
    return losses


def run_rank(family: str, model_kwargs: dict[str, Any], batch_size: int, seq_len: int, steps: int, warmup_steps: int,
             tp_size: int, seed: int, *, zero_stage: int = 0, optimizer: str = "sgd", lr: float = 0.01,
             gradient_clipping: float = 0.0) -> dict[str, Any]:  # fmt: skip
    """Train this rank for ``warmup_steps`` untimed then ``steps`` timed optimizer steps under DeepSpeed AutoTP.

    Needs ``RANK`` and ``WORLD_SIZE`` and either ``MASTER_ADDR``/``MASTER_PORT`` (``env://``) or
    ``PDIST_INIT_METHOD`` (e.g. ``file:///tmp/x/rendezvous``, no port to pick); runs once per process and
    destroys its process group before returning. Cross-entropy on :func:`imdb_like_batches` of ``batch_size`` rows.

    Returns:
        ``losses`` (every step, warm-up first, this replica's batch), ``step_s`` (each timed step) and
        ``median_step_s``; ``loop_s``, ``t_start`` / ``t_end`` (``time.time()`` around the timed loop, between
        barriers, for a harness reading link counters); ``tx_bytes`` / ``tx_packets`` sent during it (kernel
        counters of ``GLOO_SOCKET_IFNAME``; ``None`` on loopback); ``params_full``, ``params_local`` and
        ``sharded`` (``name: [local_shape, full_shape]``); ``config``; versions; ranks and sizes.

    Raises:
        ValueError: an argument breaks its rule, or ``tp_size`` does not divide ``WORLD_SIZE``.
        RuntimeError: a process group already exists (one run per process), or AutoTP left the model unsharded.
        Whatever DeepSpeed raises when AutoTP fails: it is not caught.
    """
    _check(family, model_kwargs, batch_size, seq_len, steps, warmup_steps, tp_size, seed, zero_stage, optimizer, lr,
           gradient_clipping)  # fmt: skip
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size % tp_size:
        raise ValueError(f"run_rank(tp_size={tp_size}): tp_size must divide WORLD_SIZE ({world_size})")
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("run_rank: a process group already exists; run_rank makes its own, once per process "
                           "(DeepSpeed keeps its TP groups in module globals)")  # fmt: skip
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # what it would detect here; fixed so a GPU box runs the same
    import deepspeed
    import transformers

    # As in pipeline_worker.job_deepspeed: the CPU backend's shared-memory all-reduce op takes 75-80 s to JIT-build
    # and would bypass gloo (and the emulated links); off, so every collective goes over gloo.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo", init_method=os.environ.get("PDIST_INIT_METHOD", "env://"),
                               rank=rank, world_size=world_size, auto_mpi_discovery=False, verbose=False)  # fmt: skip
    try:
        model = _build(family, model_kwargs, seed)
        full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        config = deepspeed_config(batch_size, tp_size, zero_stage, optimizer, lr, gradient_clipping)
        engine, engine_optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                              config=config)  # fmt: skip
        local_shapes = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
        sharded = {n: [list(s), list(full_shapes[n])] for n, s in local_shapes.items() if s != full_shapes[n]}
        params_local = sum(p.numel() for p in engine.module.parameters())
        params_full = sum(torch.Size(s).numel() for s in full_shapes.values())
        if tp_size > 1 and not sharded:
            raise RuntimeError(f"run_rank(tp_size={tp_size}): AutoTP left every parameter of the {family} model whole "
                               f"({params_local} of {params_full} on rank {rank})")  # fmt: skip
        dp_size, dp_rank = world_size // tp_size, rank // tp_size
        data = _batches(family, model_kwargs, batch_size * dp_size, seq_len, warmup_steps + steps, seed)
        rows = slice(dp_rank * batch_size, (dp_rank + 1) * batch_size)
        torch.manual_seed(seed)  # the same dropout masks on every rank of a TP group
        engine.train()
        losses, step_s = [], []

        def step(tokens: torch.Tensor, labels: torch.Tensor) -> None:
            t0 = time.perf_counter()
            loss = _loss(engine, family, tokens[rows], labels[rows])
            engine.backward(loss)
            engine.step()
            step_s.append(time.perf_counter() - t0)
            losses.append(loss.item())

        for tokens, labels in data[:warmup_steps]:
            step(tokens, labels)
        step_s.clear()
        ifname = os.environ.get("GLOO_SOCKET_IFNAME")
        dist.barrier()
        tx0, t_start, t0 = read_tx(ifname), time.time(), time.perf_counter()
        for tokens, labels in data[warmup_steps:]:
            step(tokens, labels)
        dist.barrier()  # every rank's last sends have left before the counters are read
        loop_s, t_end, tx1 = time.perf_counter() - t0, time.time(), read_tx(ifname)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {
        "rank": rank, "world_size": world_size, "tp_size": tp_size, "tp_rank": rank % tp_size, "dp_size": dp_size,
        "dp_rank": dp_rank, "family": family, "model_kwargs": model_kwargs, "batch_size": batch_size,
        "seq_len": seq_len, "steps": steps, "warmup_steps": warmup_steps, "seed": seed, "zero_stage": zero_stage,
        "optimizer": optimizer, "lr": lr, "gradient_clipping": gradient_clipping, "config": config,
        "losses": losses, "step_s": step_s, "median_step_s": statistics.median(step_s), "loop_s": loop_s,
        "t_start": t_start, "t_end": t_end,
        "tx_bytes": None if tx0 is None or tx1 is None else tx1[0] - tx0[0],
        "tx_packets": None if tx0 is None or tx1 is None else tx1[1] - tx0[1],
        "params_full": params_full, "params_local": params_local, "sharded": sharded,
        "engine_optimizer": type(engine_optimizer).__name__, "deepspeed_version": deepspeed.__version__,
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
    }  # fmt: skip


def run(spec: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """One rank of the launch: :func:`run_rank` with the spec's keywords; its result (``rank<r>.json``)."""
    return run_rank(**{**spec, "tp_size": spec.get("tp_size") or int(os.environ["WORLD_SIZE"])})


if __name__ == "__main__":
    raise SystemExit(worker_main("lightning_pdist.bench.tp_deepspeed", __doc__, lambda spec: spec, run))
