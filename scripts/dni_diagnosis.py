"""One-process diagnosis of DNI on the pipeline benchmark's digits CNN (docs/algorithms/pipeline.md, DNI section).

The benchmark's settings in one process: ``SmallCNN(width=16)`` cut in 2 stages by parameters (stage 0: the
convolutions up to the flatten, stage 1: the linear head), every micro-batch of 8 an update (PipeDream's timing),
SGD lr 0.02 with momentum 0.9 on both stages, 3 epochs over 80% of scikit-learn's digits. Stage 0 steps on
``ĝ`` from :class:`~lightning_pdist.pipeline.dni.SyntheticGradient` (by default ``σ·M(h/‖h‖)``; ``--raw``:
``M(h)``, the rule before ``normalize``), which trains on the true gradient of the micro-batch before (the one in
flight on 2 ranks); ``--conditioning labels``: cDNI, ``M`` also sees the micro-batch's one-hot labels. ``--mode backprop``
steps on the true gradient, ``frozen`` on ``ĝ = 0``. ``--trace N`` prints the
first N micro-batches (``|ĝ|/|δ|`` and the boundary's ``‖h‖₁`` per sample). Prints, per epoch, validation accuracy, the mean cosine between
``ĝ`` and the true ``δ`` and the median and largest ``|ĝ|/|δ|``.

    python scripts/dni_diagnosis.py --mode dni --optimizer adam --lr 1e-4
    python scripts/dni_diagnosis.py --mode dni --optimizer adam --lr 1e-3 --raw --trace 8
    python scripts/dni_diagnosis.py --mode dni --conditioning labels
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
from torch import nn

from lightning_pdist.models.cnn import SmallCNN
from lightning_pdist.pipeline.dni import SyntheticGradient
from lightning_pdist.pipeline.partition import list_layers, partition


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("dni", "backprop", "frozen"), default="dni")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="the synthetic module's")
    parser.add_argument("--lr", type=float, default=1e-4, help="the synthetic module's learning rate")
    parser.add_argument("--raw", action="store_true", help="synthetic module without normalize (ĝ = M(h), trained on δ)")
    parser.add_argument("--trace", type=int, default=0, help="print the first N micro-batches")
    parser.add_argument("--conditioning", choices=("none", "labels"), default="none", help="labels: cDNI")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    from sklearn.datasets import load_digits

    torch.manual_seed(0)
    torch.set_num_threads(1)
    digits = load_digits()
    x_all = torch.tensor(digits.images, dtype=torch.float32).div(16).unsqueeze(1)
    y_all = torch.tensor(digits.target)
    perm = torch.randperm(len(x_all))
    val, train = perm[:360], perm[360:]
    layers = list_layers(SmallCNN(width=16), "")
    stages = [nn.Sequential(*[layer for _, layer in layers[a:b]]) for a, b in partition(layers, 2).bounds]
    optimizers = [torch.optim.SGD(s.parameters(), lr=0.02, momentum=0.9) for s in stages]
    make_opt = torch.optim.Adam if args.optimizer == "adam" else torch.optim.SGD
    synthetic = SyntheticGradient(optimizer_factory=lambda p: make_opt(p, lr=args.lr), normalize=not args.raw,
                                  num_classes=10 if args.conditioning == "labels" else None)
    with_labels = (lambda y: (y,)) if args.conditioning == "labels" else (lambda y: ())  # noqa: E731
    pending, seen = None, 0
    for epoch in range(args.epochs):
        cosines, ratios = [], []
        order = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(epoch))]
        for i in range(0, len(order) - 7, 8):
            x, y = x_all[order[i : i + 8]], y_all[order[i : i + 8]]
            h = stages[0](x)
            if args.mode == "dni":
                if pending is not None:
                    synthetic.train(*pending)
                g_hat = synthetic.predict(h, *with_labels(y))
            h_in = h.detach().requires_grad_()
            optimizers[1].zero_grad()
            nn.functional.cross_entropy(stages[1](h_in), y).backward()
            optimizers[1].step()
            delta = h_in.grad
            g_hat = delta if args.mode == "backprop" else torch.zeros_like(h) if args.mode == "frozen" else g_hat
            optimizers[0].zero_grad()
            h.backward(g_hat)
            optimizers[0].step()
            pending = (h.detach(), delta, *with_labels(y))
            cosines.append(nn.functional.cosine_similarity(g_hat.flatten(), delta.flatten(), dim=0).item())
            ratios.append((g_hat.norm() / delta.norm()).item())
            seen += 1
            if seen <= args.trace:
                print(f"micro-batch {seen}: |ĝ|/|δ| {ratios[-1]:.3g}, ‖h‖₁ per sample {h.detach().abs().sum(1).mean():.3g}")
        with torch.no_grad():
            acc = (stages[1](stages[0](x_all[val])).argmax(1) == y_all[val]).float().mean().item()
        finite = [r for r in ratios if math.isfinite(r)]
        print(f"{args.mode}{' raw' if args.raw else ''}{' cdni' if args.conditioning == 'labels' else ''} {args.optimizer} lr {args.lr:g} epoch {epoch + 1}: val_acc {acc:.4f}, "
              f"mean cos(ĝ, δ) {statistics.fmean(cosines):.3f}, |ĝ|/|δ| median {statistics.median(ratios):.3g} "
              f"max {max(finite, default=float('nan')):.3g}, non-finite {len(ratios) - len(finite)}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
