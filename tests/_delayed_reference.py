"""Plain-torch, one-process references for the delayed-gradient pipeline schedules, written from their rules alone.

PipeDream's timing (``tests/_pipeline_reference.py``): stage ``s`` of ``K`` runs micro-batch ``k``'s forward after
``v = max(0, k-K+s+1)`` of its updates (counted again from the last drain ``d``: ``d + max(0, k-d-K+s+1)``) and its
backward after ``k``; each backward is followed by the stage's momentum-SGD update (torch's rule: ``V = g`` at the
first step, then ``V = μ·V + g``; ``W ← W − lr·V``).

* ``spectrain``: forward and backward of ``k`` on ``ŵ = W_s(v) − (k−v)·lr·V_s(v)`` (``ŵ = W_s(v)`` before any step);
* ``ddg``: forward on ``W_s(v)`` keeping each layer's input; backward by hand (Linear/Tanh only) through those
  stored inputs with the current ``W_s(k)``;
* ``features_replay``: forward on ``W_s(v)`` keeping the stage's input; backward = the stage recomputed on that input
  with ``W_s(k)``, the delayed gradient pulled back through it by autograd.
"""

from __future__ import annotations

import torch
from torch import nn

LR, MU = 0.1, 0.9


def make_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))




def layer_forward(layer, ws, x):
    return nn.functional.linear(x, *ws) if isinstance(layer, nn.Linear) else torch.tanh(x)


def stage_forward(layers, ws, x, keep=None):
    """``ws[i]``: layer ``i``'s tensors; ``keep`` collects each layer's input (DDG's stored activations)."""
    for i, layer in layers:
        if keep is not None:
            keep[i] = x.detach()
        x = layer_forward(layer, ws[i], x)
    return x


def manual_backward(layers, stored, ws, delta):
    """Backprop by hand through Linear/Tanh layers: stored inputs (forward-time activations), weights ``ws``."""
    grads = {}
    for i, layer in reversed(layers):
        if isinstance(layer, nn.Linear):
            grads[i] = [delta.T @ stored[i], delta.sum(0)]
            delta = delta @ ws[i][0]
        else:
            grads[i] = []
            delta = delta * (1 - torch.tanh(stored[i]) ** 2)
    return grads, delta


def reference(rule, bounds, mbs, drains=(), lr=LR, mu=MU):
    """Stage weights after training on ``mbs`` under ``rule`` with momentum-SGD updates in PipeDream's timing."""
    net = make_net()
    n_stages = len(bounds)
    stages = [[(i, net[i]) for i in range(a, b)] for a, b in bounds]
    W = [[{i: [p.detach().clone() for p in layer.parameters()] for i, layer in st}] for st in stages]
    V = [[{i: None for i, _ in st}] for st in stages]
    for k, (x, y) in enumerate(mbs):
        mark = max([d for d in drains if d <= k], default=0)
        h, leaves, inputs, stored = x, [], [], []
        for s, st in enumerate(stages):
            v = mark + max(0, k - mark - n_stages + s + 1)
            ws = {i: [w.clone() for w in W[s][v][i]] for i, _ in st}
            if rule == "spectrain" and k - v > 0:
                ws = {i: [w - (k - v) * lr * m if m is not None else w for w, m in zip(ws[i], V[s][v][i] or [None] * 2)]
                      for i, _ in st}  # fmt: skip
            ws = {i: [w.detach().requires_grad_() for w in ws[i]] for i in ws}
            inputs.append(h.detach())
            stored.append({})
            h = stage_forward(st, ws, h if rule == "spectrain" else h.detach(), stored[-1])
            leaves.append(ws)
        out = h if rule == "spectrain" else h.detach().requires_grad_()
        loss = nn.functional.mse_loss(out, y)
        if rule == "spectrain":
            flat = [w for ws in leaves for i in sorted(ws) for w in ws[i]]
            g = iter(torch.autograd.grad(loss, flat))
            grads = [{i: [next(g) for _ in ws[i]] for i in sorted(ws)} for ws in leaves]
        else:
            (delta,) = torch.autograd.grad(loss, out)
            grads = [None] * n_stages
            for s in reversed(range(n_stages)):
                now = W[s][k]  # the backward runs after k updates of this stage
                if rule == "ddg":
                    grads[s], delta = manual_backward(stages[s], stored[s], now, delta)
                else:  # features replay: the stage again on its stored input, with the current weights
                    ws = {i: [w.clone().requires_grad_() for w in now[i]] for i in now}
                    x_in = inputs[s].clone().requires_grad_(s > 0)
                    rep = stage_forward(stages[s], ws, x_in)
                    flat = [w for i in sorted(ws) for w in ws[i]] + ([x_in] if s > 0 else [])
                    g = list(torch.autograd.grad(rep, flat, delta))
                    delta = g.pop() if s > 0 else None
                    g = iter(g)
                    grads[s] = {i: [next(g) for _ in ws[i]] for i in sorted(ws)}
        for s, st in enumerate(stages):
            new_w, new_v = {}, {}
            for i, _ in st:
                buf = V[s][k][i]
                new_v[i] = [gg.clone() if buf is None else mu * b + gg for b, gg in zip(buf or [None] * 2, grads[s][i])]
                new_w[i] = [w - lr * b for w, b in zip(W[s][k][i], new_v[i])]
            W[s].append(new_w)
            V[s].append(new_v)
    return [[t for i, _ in st for t in W[s][-1][i]] for s, st in enumerate(stages)]


def momentum_sgd(mbs, lr=LR, mu=MU):
    """Backprop: one momentum-SGD step per micro-batch on the whole network (torch's optimizer)."""
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=mu)
    for x, y in mbs:
        optimizer.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
    return [p.detach() for p in net.parameters()]


