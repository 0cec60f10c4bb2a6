"""Inputs and measures shared by the PyTorch test files: layer tensors at realistic magnitudes (x ~ N(0, 1),
weights ~ N(0, 1/fan_in)), the relative Frobenius error, a block's gradients with and without activation
checkpointing, and torchtitan experts' gate and up weights placed in memory."""
import math

import torch
import torch.utils.checkpoint

from reference import GLU


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def make(T=12, d=8, n=4, E=4, activation="swiglu", bias=True, dtype=torch.float64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * n if activation in GLU else n
    t = lambda *s, std=1.0: (torch.randn(*s, generator=g, dtype=torch.float64) * std).to(dtype=dtype, device=device)
    x = t(T, d)
    rw = t(E, d, std=1 / math.sqrt(d))
    w1 = t(E, rows, d, std=1 / math.sqrt(d))
    w2 = t(E, d, n, std=1 / math.sqrt(n))
    b1 = t(E, rows, std=0.5) if bias else None
    b2 = t(E, d, std=0.5) if bias else None
    return [v.requires_grad_() if v is not None else None for v in (x, rw, w1, w2, b1, b2)]


def place_gate_up(tt, up_after_gate: bool):
    """tt's w1 and w3 (values kept) moved into one buffer on their device: w3 right after w1, where the layer reads
    the two in place as one (E, 2, n, d) view, or w3 before w1, where it must concatenate them."""
    buf = torch.empty((2,) + tuple(tt.w1.shape), dtype=tt.w1.dtype, device=tt.w1.device)
    gate, up = (buf[0], buf[1]) if up_after_gate else (buf[1], buf[0])
    with torch.no_grad():
        gate.copy_(tt.w1)
        up.copy_(tt.w3)
    tt.w1.data, tt.w3.data = gate, up


def plain_and_checkpointed_grads(block, x, params, go, use_reentrant):
    """The gradients of block(x) (upstream go) w.r.t. params, computed plainly and under torch.utils.checkpoint,
    through .backward() (the reentrant checkpoint refuses torch.autograd.grad)."""
    def grads(run):
        for p in params:
            p.grad = None
        run().backward(go)
        return [p.grad for p in params]

    plain = grads(lambda: block(x))
    checkpointed = grads(lambda: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=use_reentrant))
    return plain, checkpointed
