"""A pure-PyTorch reference MoE layer (written from docs/SPEC.md §2-§5), used to check machmoe's operators."""
import torch
import torch.nn.functional as F

GLU = {"swiglu", "geglu", "reglu"}


def act_fn(name, h):
    if name in ("swiglu", "silu"):
        return F.silu(h)
    if name in ("geglu", "gelu"):
        return F.gelu(h, approximate="tanh")
    if name in ("reglu", "relu"):
        return F.relu(h)
    if name == "relu_squared":
        return F.relu(h).square()
    raise ValueError(name)


def rounded_count(f, T, M, rule):
    down = (f // M) * M
    up = min(-(-f // M) * M, T)
    return {"down": down, "up": up, "nearest": up if up - f < f - down else down}[rule]


def route(logits, top_k, score, routing="topk", rounding="nearest", tile=128):
    """(token, expert, score) triples sorted by (token, then choice order for top-K / expert for token rounding)."""
    T, E = logits.shape
    # Ties to the lower expert: stable sort of the negated logits.
    order = torch.sort(-logits.detach(), dim=-1, stable=True).indices[:, :top_k]
    sel = logits.gather(1, order)
    if score == "topk_softmax":
        s = torch.softmax(logits, -1).gather(1, order)
    else:  # softmax over the selection (== renormalised top-K of the full softmax)
        s = torch.softmax(sel, -1)
    if routing == "topk":
        tok = torch.arange(T).repeat_interleave(top_k)
        return tok, order.reshape(-1), s.reshape(-1)
    p = torch.softmax(logits, -1)
    s_pref = (p - 1).detach().clone()
    chosen = torch.zeros(T, E, dtype=torch.bool)
    tc_score = torch.zeros(T, E, dtype=logits.dtype)
    rows = torch.arange(T).unsqueeze(1).expand(-1, top_k)
    chosen[rows, order] = True
    s_pref[rows, order] = s.detach()
    tc_score = tc_score.index_put((rows, order), s)
    f = chosen.sum(0)
    keep = torch.zeros(T, E, dtype=torch.bool)
    for e in range(E):
        r = rounded_count(int(f[e]), T, tile, rounding)
        ranked = torch.sort(-s_pref[:, e], stable=True).indices
        keep[ranked[:r], e] = True
    tok, exp = keep.nonzero(as_tuple=True)
    scores = torch.where(chosen[tok, exp], tc_score[tok, exp], p[tok, exp])
    return tok, exp, scores


def experts(x, tok, exp, scores, w1, w2, b1, b2, activation, weight_layout):
    T, d = x.shape
    E, _, n = w2.shape
    out = torch.zeros(T, d, dtype=x.dtype)
    for e in range(E):
        m = exp == e
        if not bool(m.any()):
            continue
        t = tok[m]
        h = x[t] @ w1[e].T + (b1[e] if b1 is not None else 0)
        if activation in GLU:
            gate, up = (h[:, 0::2], h[:, 1::2]) if weight_layout == "interleaved" else (h[:, :n], h[:, n:])
            a = act_fn(activation, gate) * up
        else:
            a = act_fn(activation, h)
        y = a @ w2[e].T + (b2[e] if b2 is not None else 0)
        out = out.index_add(0, t, scores[m].unsqueeze(1) * y)
    return out


def reference_moe(x, router_weight, w1, w2, b1, b2, *, top_k, activation="swiglu", score="softmax_topk",
                  routing="topk", rounding="nearest", tile=128, weight_layout="interleaved", **_):
    logits = x @ router_weight.T
    tok, exp, s = route(logits, top_k, score, routing, rounding, tile)
    return experts(x, tok, exp, s, w1, w2, b1, b2, activation, weight_layout), logits, torch.bincount(exp, minlength=w1.shape[0])
