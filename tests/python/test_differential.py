"""Randomized differential test: machmoe against the pure-PyTorch float64 reference (reference.py) over random
shapes, options and dtypes, from a seeded generator, so every run checks the same cases and a failure can be
replayed.

Budget: MACHMOE_DIFF_CASES cases (CPU default 120, about 15 s; GPU default 96); MACHMOE_DIFF_SEED picks
another family of cases. A failing case is shrunk greedily (fewer tokens, experts, smaller sizes, while it still
fails) and printed as a reproducer: MACHMOE_DIFF_REPRO='<json>' python3 -m pytest tests/python/test_differential.py.
"""
import json
import math
import os
import random

import pytest
import torch

import machmoe
from reference import GLU, experts, route

ACTIVATIONS = ["swiglu", "geglu", "reglu", "relu_squared", "relu", "gelu", "silu"]
SCORES = ["softmax_topk", "topk_softmax", "topk_softmax_renorm"]


def draw_case(rng: random.Random, gpu: bool) -> dict:
    act = rng.choice(ACTIVATIONS)
    E = rng.choice([1, 2, 3, 4, 5, 8, 16])
    routing = rng.choice(["topk", "topk", "token_rounding", "caller"])
    case = dict(
        # On the GPU no T = 1: with one pair, dS is a single bf16-noisy dot product whose relative error says nothing
        # (the GPU suite covers T = 1 on its own).
        T=rng.choice([0, 1, 2, 7, 13, 32, 57]) if not gpu else rng.choice([0, 2, 33, 257, 1000]),
        d=rng.choice([8, 16, 24, 40]) if not gpu else rng.choice([64, 128, 192, 256]),
        n=rng.choice([4, 8, 12, 16]) if not gpu else rng.choice([64, 128, 256]),
        E=E,
        K=rng.randint(1, E),
        activation=act,
        weight_layout=rng.choice(["interleaved", "concatenated"]) if act in GLU else "interleaved",
        bias=rng.choice([False, True]),
        score=rng.choice(SCORES),
        routing=routing,
        rounding=rng.choice(["nearest", "up", "down"]),
        tile=rng.choice([8, 16]) if not gpu else 128,
        cache=rng.choice(["preact", "input_only"]),
        dtype=rng.choice(["float64", "float32"]) if not gpu else "bfloat16",
        seed=rng.randrange(1 << 30),
    )
    return case


def tolerance(dtype: str) -> float:
    return {"float64": 1e-10, "float32": 2e-5, "bfloat16": 1e-2}[dtype]


def rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    if b.numel() == 0:
        return 0.0 if a.numel() == 0 else math.inf
    den = b.norm().item()
    if den == 0.0:
        return a.norm().item()
    return (a - b).norm().item() / den


def run_case(c: dict, device: str) -> list:
    """The (name, relative error, tolerance) of every output and gradient of case c; raises on a crash."""
    g = torch.Generator().manual_seed(c["seed"])
    T, d, n, E, K = c["T"], c["d"], c["n"], c["E"], c["K"]
    rows = 2 * n if c["activation"] in GLU else n
    r64 = lambda *s, std=1.0: torch.randn(*s, generator=g, dtype=torch.float64) * std
    # Realistic magnitudes: x ~ N(0, 1), weights ~ N(0, 1 / fan_in).
    x64, rw64 = r64(T, d), r64(E, d, std=1 / math.sqrt(d))
    w1_64, w2_64 = r64(E, rows, d, std=1 / math.sqrt(d)), r64(E, d, n, std=1 / math.sqrt(n))
    b1_64 = r64(E, rows, std=0.1) if c["bias"] else None
    b2_64 = r64(E, d, std=0.1) if c["bias"] else None
    go64 = r64(T, d)
    dt = getattr(torch, c["dtype"])
    # The reference runs in float64 on exactly the values the library sees (rounded to its dtype).
    ref_in = [v.to(dt).double() if v is not None else None for v in (x64, rw64, w1_64, w2_64, b1_64, b2_64)]
    ref_in = [v.requires_grad_() if v is not None else None for v in ref_in]
    lib_in = [v.detach().to(device=device, dtype=dt).requires_grad_() if v is not None else None for v in ref_in]
    opts = dict(activation=c["activation"], weight_layout=c["weight_layout"])
    names = ["x", "router_weight", "w1", "w2", "b1", "b2"]
    if c["routing"] == "caller":
        cg = torch.Generator().manual_seed(c["seed"] + 1)
        per_token = torch.randint(0, K + 1, (T,), generator=cg)  # 0..K pairs per token, distinct experts
        tok = torch.repeat_interleave(torch.arange(T), per_token)
        exp = torch.cat([torch.randperm(E, generator=cg)[: int(k)] for k in per_token]) if T else torch.zeros(0, dtype=torch.long)
        s64 = torch.rand(tok.numel(), generator=cg, dtype=torch.float64)
        s_ref = s64.clone().requires_grad_()
        s_lib = s64.to(device=device, dtype=torch.float32 if c["dtype"] == "bfloat16" else dt).requires_grad_()
        x, _, w1, w2, b1, b2 = lib_in
        out, counts = machmoe.moe_from_routing(x, w1, w2, tok.to(device), exp.to(device), s_lib, b1, b2,
                                                max_experts_per_token=max(K, 1), activation_memory=c["cache"], **opts)
        xr, _, w1r, w2r, b1r, b2r = ref_in
        ref_out = experts(xr, tok, exp, s_ref, w1r, w2r, b1r, b2r, c["activation"], c["weight_layout"])
        ref_counts = torch.bincount(exp, minlength=E)
        lib_params = [v for v in (x, w1, w2, b1, b2, s_lib) if v is not None]
        ref_params = [v for v in (xr, w1r, w2r, b1r, b2r, s_ref) if v is not None]
        pnames = [nm for nm, v in zip(["x", "w1", "w2", "b1", "b2", "scores"], (x, w1, w2, b1, b2, s_lib)) if v is not None]
        loss = (out.double() * go64.to(device)).sum()
        ref_loss = (ref_out * go64).sum()
        results = [("out", rel(out, ref_out), tolerance(c["dtype"]))]
    else:
        ropts = dict(top_k=K, score=c["score"], routing=c["routing"], rounding=c["rounding"], tile=c["tile"], **opts)
        out, logits, counts = machmoe.moe(*lib_in, activation_memory=c["cache"], **ropts)
        xr, rwr, w1r, w2r, b1r, b2r = ref_in
        ref_logits = xr @ rwr.T
        # The selection is discontinuous: in bf16 the library's logits are rounded, and near-ties pick other experts
        # than float64 logits would. So the reference routes with the library's logits (their values; the gradient
        # still flows through the float64 logits), and the logits themselves are compared on their own below.
        sel_logits = ref_logits + (logits.detach().double().cpu() - ref_logits).detach() if c["dtype"] == "bfloat16" \
            else ref_logits
        tok, exp, sc = route(sel_logits, K, c["score"], c["routing"], c["rounding"], c["tile"])
        ref_out = experts(xr, tok, exp, sc, w1r, w2r, b1r, b2r, c["activation"], c["weight_layout"])
        ref_counts = torch.bincount(exp, minlength=E)
        gl64 = torch.randn(T, E, generator=g, dtype=torch.float64)
        lib_params = [v for v in lib_in if v is not None]
        ref_params = [v for v in ref_in if v is not None]
        pnames = [nm for nm, v in zip(names, lib_in) if v is not None]
        loss = (out.double() * go64.to(device)).sum() + (logits.double() * gl64.to(device)).sum()
        ref_loss = (ref_out * go64).sum() + (ref_logits * gl64).sum()
        results = [("out", rel(out, ref_out), tolerance(c["dtype"])),
                   ("router_logits", rel(logits, ref_logits), tolerance(c["dtype"]))]
    results.append(("expert_counts", 0.0 if torch.equal(counts.long().cpu(), ref_counts) else math.inf, 0.0))
    grads = torch.autograd.grad(loss, lib_params, allow_unused=True)
    # With no pairs the reference output is a constant (experts contribute nothing): every gradient is zero.
    ref_grads = (torch.autograd.grad(ref_loss, ref_params, allow_unused=True) if ref_loss.requires_grad
                 else [None] * len(ref_params))
    for nm, a, b in zip(pnames, grads, ref_grads):
        a = torch.zeros_like(lib_params[pnames.index(nm)]) if a is None else a
        b = torch.zeros_like(ref_params[pnames.index(nm)]) if b is None else b
        results.append((f"d{nm}", rel(a, b), tolerance(c["dtype"])))
    return results


def failures(c: dict, device: str) -> list:
    try:
        return [r for r in run_case(c, device) if not (r[1] <= r[2])]
    except Exception as e:  # a crash or an error on valid input is a failure too
        return [("exception", f"{type(e).__name__}: {e}", None)]


def shrink(c: dict, device: str) -> dict:
    """Greedy: make sizes smaller while the case still fails."""
    smaller = {"T": [0, 1, 2, 4], "E": [1, 2, 3], "d": [8, 16], "n": [4, 8], "K": [1, 2]}
    changed = True
    while changed:
        changed = False
        for key, values in smaller.items():
            for v in values:
                if v >= c[key]:
                    break
                trial = dict(c, **{key: v})
                trial["K"] = min(trial["K"], trial["E"])
                if failures(trial, device):
                    c, changed = trial, True
                    break
    return c


def check(c: dict, device: str) -> None:
    bad = failures(c, device)
    if bad:
        small = shrink(c, device)
        raise AssertionError(f"machmoe disagrees with the float64 reference: {bad}\n"
                             f"minimal reproducer: MACHMOE_DIFF_REPRO='{json.dumps(small)}' "
                             f"python3 -m pytest tests/python/test_differential.py"
                             + (" -m gpu" if device == "cuda" else ""))


def cases(gpu: bool):
    repro = os.environ.get("MACHMOE_DIFF_REPRO")
    if repro:
        return [json.loads(repro)]
    rng = random.Random(int(os.environ.get("MACHMOE_DIFF_SEED", "20261123")) + (1 if gpu else 0))
    count = int(os.environ.get("MACHMOE_DIFF_CASES", "96" if gpu else "120"))
    out = [draw_case(rng, gpu) for _ in range(count)]
    if not gpu:
        for c in out:  # the CPU path computes in the tensors' dtype; bf16 is a GPU dtype
            c["dtype"] = c["dtype"] if c["dtype"] != "bfloat16" else "float32"
    return out


CPU_CASES = cases(gpu=False)


@pytest.mark.parametrize("case", CPU_CASES, ids=[f"cpu{i}" for i in range(len(CPU_CASES))])
def test_random_case_matches_float64_reference_cpu(case):
    check(case, "cpu")


GPU_CASES = cases(gpu=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"gpu{i}" for i in range(len(GPU_CASES))])
def test_random_case_matches_float64_reference_gpu(case, cuda):
    check(case, "cuda")
