"""Plain-torch, one-process references for the pipeline schedules, written from their update rules alone.

Each takes a freshly built ``nn.Sequential``, trains it in place with SGD and returns it:

* :func:`accumulation`: GPipe/1F1B (and a 1-stage pipeline): per step the mean loss over the
  micro-batches of each replica's batch, gradients averaged over replicas, one SGD step.
* :func:`pipedream`: mini-batch ``k`` (a micro-batch) runs stage ``s`` on its weights after
  ``max(0, k - K + s + 1)`` updates (vertical sync: the input stage's ``max(0, k - K + 1)``), forward and
  backward alike; then every stage takes one SGD step with that gradient. After a drain at ``d`` the
  count restarts: ``d + max(0, k - d - K + s + 1)``.
* :func:`two_bw`: ``W(t+1) = W(t) - lr * mean_j grad f_j(W(t-1))``, ``W(-1) = W(0)``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call


def _loss(net, weights, x, y):
    names = [n for n, _ in net.named_parameters()]
    return nn.functional.mse_loss(functional_call(net, dict(zip(names, weights)), (x,)), y)


def _set(net, weights):
    with torch.no_grad():
        for p, w in zip(net.parameters(), weights):
            p.copy_(w)
    return net


def accumulation(net: nn.Sequential, steps: list[list[tuple]], m: int, lr: float) -> nn.Sequential:
    """``steps[t][r]`` is replica ``r``'s batch ``(x, y)`` at step ``t``."""
    for batches in steps:
        net.zero_grad()
        for x, y in batches:
            for xm, ym in zip(x.tensor_split(m), y.tensor_split(m)):
                (nn.functional.mse_loss(net(xm), ym) / (m * len(batches))).backward()
        with torch.no_grad():
            for p in net.parameters():
                p -= lr * p.grad
    return net


def pipedream(net: nn.Sequential, bounds: list[tuple[int, int]], microbatches: list[tuple], lr: float,
              vertical_sync: bool = False, drains: tuple[int, ...] = ()) -> nn.Sequential:  # fmt: skip
    """``drains``: micro-batch counts after which the pipeline was emptied (the warm-up starts again)."""
    K = len(bounds)
    stages = [nn.Sequential(*[net[i] for i in range(a, b)]) for a, b in bounds]
    versions = [[[p.detach().clone() for p in st.parameters()]] for st in stages]
    for k, (x, y) in enumerate(microbatches):
        leaves, h = [], x
        mark = max([d for d in drains if d <= k], default=0)  # one update per earlier micro-batch up to the drain
        for s, st in enumerate(stages):
            v = mark + (max(0, k - mark - K + 1) if vertical_sync else max(0, k - mark - K + s + 1))
            w = [t.clone().requires_grad_() for t in versions[s][v]]
            h = functional_call(st, dict(zip([n for n, _ in st.named_parameters()], w)), (h,))
            leaves.append(w)
        grads = iter(torch.autograd.grad(nn.functional.mse_loss(h, y), [t for w in leaves for t in w]))
        for s in range(K):
            versions[s].append([(p - lr * next(grads)).detach() for p in versions[s][-1]])
    return _set(net, [t for s in range(K) for t in versions[s][-1]])


def two_bw(net: nn.Sequential, batches: list[tuple], m: int, lr: float) -> nn.Sequential:
    previous = current = [p.detach().clone() for p in net.parameters()]
    for x, y in batches:
        w = [p.clone().requires_grad_() for p in previous]
        loss = sum(_loss(net, w, xm, ym) for xm, ym in zip(x.tensor_split(m), y.tensor_split(m))) / m
        grads = torch.autograd.grad(loss, w)
        previous, current = current, [c - lr * g for c, g in zip(current, grads)]
    return _set(net, current)


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])
