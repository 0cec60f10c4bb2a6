"""The float64 check of an implementation's output and gradients (docs/TARGETS.md T10: relative Frobenius error
<= 1e-2 against float64 for the output and every gradient).

The implementation runs forward on all T tokens and backward with an upstream gradient that is zero outside a
sample S of tokens; the reference computes, in float64, the output on S and the gradients of <out[S], dO[S]> with
respect to x[S], the router weight, W1 and W2. The routing decisions are pinned to the implementation's (its
selected experts where it reports them, else its router logits under machmoe's rules: ties to the lower expert,
token rounding as docs/ROUTING.md), because bf16 rounding reorders near-ties; the scores are recomputed in float64
from the implementation's logit values, differentiably, and their gradient reaches the router as that of x W_r^T
(as the GPU tests do). The experts are evaluated one at a time with an explicit backward, so no float64 copy of all
weights is ever held: the check costs a few float64 GEMMs over |S| K rows.
"""
import math
from typing import Dict, Optional

import torch
from torch import Tensor

T10 = 1e-2  # docs/TARGETS.md T10


def _sum_sq(t: Tensor) -> float:
    return float(t.double().square().sum())


def pinned_scores(z: Tensor, K: int, routing: str, tile: int, rounding: str = "nearest",
                  selection: Optional[Tensor] = None):
    """(token, expert, score) per pair, scores differentiable w.r.t. z (T, E) float64. Top-K with `selection`
    (T, K) uses it; otherwise machmoe's routing rules (machmoe.parallel.route, tested against the library)."""
    from ..parallel import route
    if routing == "topk" and selection is not None:
        T = z.shape[0]
        sel = selection.to(device=z.device, dtype=torch.int64)
        s = torch.softmax(z.gather(1, sel), dim=-1)            # score 'softmax_topk'
        tok = torch.arange(T, device=z.device).repeat_interleave(K)
        return tok, sel.reshape(-1), s.reshape(-1)
    tok, exp, s, _ = route(z, top_k=K, score="softmax_topk", routing=routing, rounding=rounding, tile=tile)
    return tok, exp, s


def check(x: Tensor, grad_x: Optional[Tensor], grad_out: Tensor, tokens: Tensor, weights: Dict[str, Tensor],
          output: Tensor, logits: Tensor, grads: Dict[str, Optional[Tensor]], *, K: int, routing: str = "topk",
          tile: int = 128, selection: Optional[Tensor] = None, counts: Optional[Tensor] = None) -> dict:
    """Relative Frobenius errors of output[S], grad_x[S] and the weight gradients (machmoe's layout) against the
    float64 reference. grad_out must be zero outside `tokens` (S)."""
    dev = x.device
    T, d = x.shape
    rw, w1, w2 = weights["router_weight"], weights["w1"], weights["w2"]
    E, n = w2.shape[0], w2.shape[2]
    S = tokens.to(dev)
    x64, rw64 = x.detach().double(), rw.detach().double()
    z = logits.detach().double().clone().requires_grad_()
    tok, exp, s = pinned_scores(z, K, routing, tile, selection=selection)
    routing_matches = None
    if counts is not None:
        pinned = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(0, exp, torch.ones_like(exp))
        routing_matches = bool(torch.equal(pinned, counts.detach().to(dev, torch.int64)))
    pos = torch.full((T,), -1, dtype=torch.int64, device=dev)
    pos[S] = torch.arange(S.numel(), device=dev)
    in_s = pos.index_select(0, tok) >= 0
    pair_ids = torch.nonzero(in_s).squeeze(1)
    ptok, pexp = tok.index_select(0, pair_ids), exp.index_select(0, pair_ids)
    ps = s.detach().index_select(0, pair_ids)
    order = torch.sort(pexp, stable=True).indices
    per_expert = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(0, pexp, torch.ones_like(pexp)).tolist()
    go64 = grad_out.detach().double()
    out_ref = torch.zeros(S.numel(), d, dtype=torch.float64, device=dev)
    dx_ref = torch.zeros(S.numel(), d, dtype=torch.float64, device=dev)
    ds = torch.zeros(pair_ids.numel(), dtype=torch.float64, device=dev)
    acc = {"w1": [0.0, 0.0], "w2": [0.0, 0.0]}  # [squared difference, squared reference]
    gw1, gw2 = grads.get("w1"), grads.get("w2")
    start = 0
    for e, m in enumerate(per_expert):
        if m == 0:
            for name, g in (("w1", gw1), ("w2", gw2)):
                if g is not None:
                    acc[name][0] += _sum_sq(g[e])
            continue
        idx = order[start:start + m]
        start += m
        t_e, s_e = ptok.index_select(0, idx), ps.index_select(0, idx)
        W1, W2 = w1[e].detach().double(), w2[e].detach().double()
        xs = x64.index_select(0, t_e)
        H = xs @ W1.t()
        g, u = H[:, 0::2], H[:, 1::2]
        sg = torch.sigmoid(g)
        silu = g * sg
        A = silu * u
        Y = A @ W2.t()
        out_ref.index_add_(0, pos.index_select(0, t_e), s_e.unsqueeze(1) * Y)
        G = go64.index_select(0, t_e)
        dY = s_e.unsqueeze(1) * G
        ds.index_copy_(0, idx, (G * Y).sum(1))
        dW2 = dY.t() @ A
        dA = dY @ W2
        dH = torch.stack([dA * u * sg * (1 + g * (1 - sg)), dA * silu], dim=-1).reshape(m, 2 * n)
        dW1 = dH.t() @ xs
        dx_ref.index_add_(0, pos.index_select(0, t_e), dH @ W1)
        for name, ref, g_impl in (("w1", dW1, gw1), ("w2", dW2, gw2)):
            acc[name][1] += _sum_sq(ref)
            acc[name][0] += _sum_sq(ref - g_impl[e].double()) if g_impl is not None else _sum_sq(ref)
    # Score gradients to the logits, then to x and the router as d(x W_r^T).
    ds_all = torch.zeros_like(s, dtype=torch.float64).index_copy(0, pair_ids, ds)
    (dz,) = torch.autograd.grad(s, z, ds_all.to(s.dtype), allow_unused=True)
    dz = torch.zeros_like(z) if dz is None else dz.detach()
    dx_ref += dz.index_select(0, S) @ rw64
    drw_ref = dz.t() @ x64

    def rel(a: Optional[Tensor], b: Tensor) -> float:
        if a is None:
            return float("inf")
        den = float(b.norm())
        return float((a.detach().double() - b).norm()) / max(den, 1e-300)

    errors = {
        "output": rel(output.detach().index_select(0, S), out_ref),
        "grad_x": rel(grad_x.index_select(0, S) if grad_x is not None else None, dx_ref),
        "grad_router_weight": rel(grads.get("router_weight"), drw_ref),
        "grad_w1": (acc["w1"][0] ** 0.5) / max(acc["w1"][1] ** 0.5, 1e-300),
        "grad_w2": (acc["w2"][0] ** 0.5) / max(acc["w2"][1] ** 0.5, 1e-300),
    }
    # A NaN error fails (max() would step over it: every comparison with NaN is False), reported as inf.
    worst = math.inf if any(not math.isfinite(v) for v in errors.values()) else max(errors.values())
    return {"errors": errors, "max": worst, "tolerance": T10, "ok": bool(worst <= T10),
            "tokens_checked": int(S.numel()), "routing_matches_counts": routing_matches}
