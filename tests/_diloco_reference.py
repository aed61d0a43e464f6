"""A plain-torch (Streaming) DiLoCo written from the papers' equations, for the tests; no lightning_pdist import."""

from __future__ import annotations

import torch
from _helpers import make_net, rank_batches, regression_data
from torch import nn


def _q_roundtrip(x: torch.Tensor, bits: int, block: int = 64) -> torch.Tensor:
    """Block-wise symmetric integer quantization and back: scale = max|x| / (2^(bits-1) - 1) per block of 64."""
    qmax = 2 ** (bits - 1) - 1
    out = torch.empty_like(x)
    for start in range(0, x.numel(), block):
        chunk = x[start : start + block]
        scale = chunk.abs().max() / qmax
        out[start : start + block] = 0.0 if scale == 0 else torch.round(chunk / scale).clamp(-qmax, qmax) * scale
    return out


def diloco_reference(world, steps, H, outer, P=1, tau=0, alpha=0.0, bits=None, lr=0.1, momentum=0.0, n=64, bs=4):
    """Every replica after every inner step ({t: [flat θ_r]}) and the final global model.

    ``outer(param)`` builds the outer optimizer over one fragment's flat θ_global. Fragment p of the TinyRegression
    net is its p-th block of layers (P=2: net.0 | net.2). Fragment p starts after step t with t mod H = p·H/P, its
    mean pseudo-gradient is applied τ steps later, then θ_r ← α·θ_r + (1−α)·θ_global.
    """
    data = regression_data(n)
    per_epoch = len(rank_batches(data, 0, world, bs))
    nets = [make_net() for _ in range(world)]
    inner = [torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum) for net in nets]
    layers = [[0, 1], [2, 3]] if P == 2 else [[0, 1, 2, 3]]

    def frag(net, p):
        params = list(net.parameters())
        return [params[i] for i in layers[p]]

    flat = lambda ts: torch.cat([t.detach().reshape(-1) for t in ts])  # noqa: E731
    glob = [nn.Parameter(flat(frag(nets[0], p)).clone()) for p in range(P)]
    opts = [outer(g) for g in glob]
    pending, history = {}, {}
    for t in range(1, steps + 1):
        for r, net in enumerate(nets):
            epoch, i = divmod(t - 1, per_epoch)
            x, y = rank_batches(data, r, world, bs, epoch)[i]
            inner[r].zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            inner[r].step()
        for p in range(P):
            if t % H == p * H // P:
                deltas = [glob[p].detach() - flat(frag(net, p)) for net in nets]
                if bits is not None:
                    deltas = [_q_roundtrip(d, bits) for d in deltas]
                pending[p] = torch.stack(deltas).mean(0)
        for p in range(P):
            if t - tau >= 1 and (t - tau) % H == p * H // P:
                glob[p].grad = pending.pop(p)
                opts[p].step()
                with torch.no_grad():
                    for net in nets:
                        local = flat(frag(net, p))
                        torch.nn.utils.vector_to_parameters(alpha * local + (1 - alpha) * glob[p].detach(), frag(net, p))
        history[t] = [flat(net.parameters()).clone() for net in nets]
    for p in list(pending):  # the end of training completes the exchanges in flight
        glob[p].grad = pending.pop(p)
        opts[p].step()
    return history, torch.cat([g.detach() for g in glob])


def nesterov(lr=0.7, momentum=0.9):
    return lambda p: torch.optim.SGD([p], lr=lr, momentum=momentum, nesterov=True)


def heavy_ball(lr, momentum):
    return lambda p: torch.optim.SGD([p], lr=lr, momentum=momentum)
