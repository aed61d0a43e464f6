"""Plain-torch, one-process reference of decoupled neural interfaces (DNI) on a pipeline, written from the rule alone.

Micro-batches in order; for micro-batch ``j`` each stage ``s`` in turn: forward on its current weights (``j`` updates
made), then its weight gradient from ``ĝ = M_s(h_s)`` (stages ``s < K−1``) or from the loss (the last stage), one
momentum-SGD step (torch's rule), and the input gradient ``δ_{s−1}`` it computes goes to stage ``s−1``'s queue.
``M_s`` (a zero-initialised ``Linear``) trains on ``½‖M_s(h) − δ‖²`` for the queued micro-batches in order (with
``normalize``: ``σ`` = rms(δ) at the first target, then ``0.99·σ + 0.01·rms(δ)``, and ``½‖M_s(h/‖h‖) − δ/σ‖²``;
predictions ``σ·M_s(h/‖h‖)``, ``σ = 0`` before the first target); when it
predicts for ``j`` it has trained on every ``i < max(j − 1, d)``, ``d`` the last drain at or before ``j`` (the
true gradient of ``j−1`` is still on its way), and after the last micro-batch on all.

cDNI (``labels``: micro-batch ``j``'s class indices, ``num_classes`` C): ``M_s`` is a zero ``Linear(d + C, d)`` over
``[h/‖h‖, onehot(y_j)]`` (the one-hot repeated over any middle dimension), in its predictions and its training alike.
"""

from __future__ import annotations

import torch
from torch import nn

from _delayed_reference import make_net


def zero_linear(width: int, extra: int = 0) -> nn.Linear:
    layer = nn.Linear(width + extra, width)
    with torch.no_grad():
        layer.weight.zero_()
        layer.bias.zero_()
    return layer


def dni_reference(bounds, mbs, lr, mu, synthetic_optimizer, drains=(), stages=None, normalize=True, labels=None,
                  num_classes=0):  # fmt: skip
    """(stage weights, synthetic modules' weights) after DNI training on ``mbs``; ``stages`` (modules, in order)
    replaces ``make_net`` cut at ``bounds``. Each ``M_s`` is a zero ``Linear`` over ``h_s``'s last dimension;
    ``labels`` (one tensor of class indices per micro-batch) and ``num_classes``: cDNI."""
    if stages is None:
        net = make_net()
        stages = [nn.Sequential(*[net[i] for i in range(a, b)]) for a, b in bounds]
    K = len(stages)
    optimizers = [torch.optim.SGD(st.parameters(), lr=lr, momentum=mu) for st in stages]
    synth, synth_opt = [None] * (K - 1), [None] * (K - 1)  # built at the first boundary (its width known then)
    queue = [[] for _ in synth]  # per boundary: (micro-batch, h, true gradient) not trained on yet
    sigma, trained = [0.0] * (K - 1), [0] * (K - 1)

    def seen(h, j):  # what M_s reads for micro-batch j
        x = nn.functional.normalize(h, dim=-1) if normalize else h
        if labels is None:
            return x
        c = torch.zeros(*x.shape[:-1], num_classes)  # sample b's row of every position: 1 at its class
        c[torch.arange(len(labels[j])), ..., labels[j]] = 1.0
        return torch.cat([x, c], dim=-1)

    def train_until(s, upto):
        while queue[s] and queue[s][0][0] < upto:
            i, h, target = queue[s].pop(0)
            if normalize:
                rms = float(target.pow(2).mean().sqrt())
                sigma[s] = rms if trained[s] == 0 else 0.99 * sigma[s] + 0.01 * rms
                target = target / sigma[s] if sigma[s] > 0 else target
            trained[s] += 1
            synth_opt[s].zero_grad()
            (0.5 * (synth[s](seen(h, i)) - target).pow(2).sum()).backward()
            synth_opt[s].step()

    for j, (x, y) in enumerate(mbs):
        mark = max([d for d in drains if d <= j], default=0)
        h_in = x
        for s, st in enumerate(stages):
            x_leaf = h_in.detach().requires_grad_(s > 0)
            h = st(x_leaf)
            params = list(st.parameters()) + ([x_leaf] if s > 0 else [])
            if s < K - 1:
                if synth[s] is None:
                    synth[s] = zero_linear(h.shape[-1], num_classes if labels is not None else 0)
                    synth_opt[s] = synthetic_optimizer(synth[s].parameters())
                train_until(s, max(j - 1, mark))
                with torch.no_grad():
                    g_hat = synth[s](seen(h.detach(), j))
                    g_hat = g_hat * sigma[s] if normalize else g_hat
                grads = torch.autograd.grad(h, params, g_hat)
            else:
                grads = torch.autograd.grad(nn.functional.mse_loss(h, y), params)
            grads = list(grads)
            if s > 0:
                queue[s - 1].append((j, h_in.detach(), grads.pop()))
            for p, g in zip(st.parameters(), grads):
                p.grad = g
            optimizers[s].step()
            h_in = h
    for s in range(K - 1):
        train_until(s, len(mbs))
    return ([[p.detach() for p in st.parameters()] for st in stages],
            [[p.detach() for p in m.parameters()] for m in synth])  # fmt: skip
