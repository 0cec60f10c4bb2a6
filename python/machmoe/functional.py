"""Functional API of the machmoe layer.

Shapes: x (T, d); router_weight (E, d); w1 (E, 2n, d) for GLU activations, (E, n, d) otherwise; w2 (E, d, n); b1
(E, 2n | n); b2 (E, d) — nn.Linear (out, in) per expert. With weight_layout="interleaved" the rows of w1 alternate
gate, up, gate, up...; with "concatenated" rows [0, n) are gate and [n, 2n) up (HF gate_up_proj). No host
synchronisation: expert counts stay on the device.
"""
from typing import Optional, Tuple

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor

from ._options import (ACTIVATIONS, ACTIVATION_MEMORY, GLU_ACTIVATIONS, ROUNDINGS, ROUTINGS, SCORES, WEIGHT_LAYOUTS,
                       code)
from ._validation import as_int, fail as _fail, require_tensor

_CPU_DTYPES = (torch.float32, torch.float64)
_CUDA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_tensor(name: str, t: Tensor, shape, ref: Tensor, *, ref_name: str = "x",
                  inner_stride_only: bool = False) -> None:
    require_tensor(name, t)
    if t.device != ref.device:
        _fail(name, f"a tensor on {ref.device} (the device of {ref_name})", f"a tensor on {t.device}")
    if t.dtype != ref.dtype:
        _fail(name, f"dtype {ref.dtype} (the dtype of {ref_name})", t.dtype)
    if tuple(t.shape) != tuple(shape):
        _fail(name, f"shape {tuple(shape)}", tuple(t.shape))
    ok = t.stride(-1) == 1 if inner_stride_only else t.is_contiguous()
    if not ok:
        _fail(name, "a contiguous tensor (call .contiguous())" if not inner_stride_only
              else "unit stride in the last dimension", f"strides {t.stride()}")


def _check_common(x: Tensor, w1: Tensor, w2: Tensor, b1, b2, activation: str, weight_layout: str, top_k,
                  *, x_name: str = "x", top_k_name: str = "top_k"):
    """Checks x, the expert weights and biases, the activation/layout and the per-token expert count; returns
    (activation code, layout code, top_k as an int)."""
    for name, t, optional in ((x_name, x, False), ("w1", w1, False), ("w2", w2, False), ("b1", b1, True),
                              ("b2", b2, True)):
        require_tensor(name, t, optional=optional)
    if x.dim() != 2:
        _fail(x_name, "a (tokens, hidden) tensor", f"shape {tuple(x.shape)}")
    allowed = _CUDA_DTYPES if x.is_cuda else _CPU_DTYPES
    if x.dtype not in allowed:
        _fail(x_name, f"one of {allowed} on {x.device.type}", x.dtype)
    if w1.dim() != 3:
        _fail("w1", "a 3-D (experts, 2n | n, hidden) tensor", f"shape {tuple(w1.shape)}")
    if w2.dim() != 3:
        _fail("w2", "a 3-D (experts, hidden, n) tensor", f"shape {tuple(w2.shape)}")
    T, d = x.shape
    E, n = w2.shape[0], w2.shape[2]
    if E < 1:
        _fail("w2", "at least one expert (a first dimension >= 1)", f"shape {tuple(w2.shape)}")
    act = code(ACTIVATIONS, activation, "activation")
    layout = code(WEIGHT_LAYOUTS, weight_layout, "weight_layout")
    if weight_layout == "concatenated" and activation not in GLU_ACTIVATIONS:
        _fail("weight_layout", f"'interleaved' for the non-GLU activation {activation!r}", repr(weight_layout))
    rows = 2 * n if activation in GLU_ACTIVATIONS else n
    _check_tensor(x_name, x, (T, d), x, ref_name=x_name, inner_stride_only=True)
    _check_tensor("w1", w1, (E, rows, d), x, ref_name=x_name)
    _check_tensor("w2", w2, (E, d, n), x, ref_name=x_name)
    if b1 is not None:
        _check_tensor("b1", b1, (E, rows), x, ref_name=x_name)
    if b2 is not None:
        _check_tensor("b2", b2, (E, d), x, ref_name=x_name)
    top_k = as_int(top_k_name, top_k, low=1, high=E, what="(the number of experts)")
    return act, layout, top_k


def _reject_forward_ad(*tensors) -> None:
    """Forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) has no rule for the layer: without this check a
    dual input would come out with a zero or missing tangent."""
    if _forward_ad._current_level < 0:  # no dual level entered: the common case, decided without touching tensors
        return
    for t in tensors:
        if t is not None and _forward_ad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                "machmoe: forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) is not supported by machmoe "
                "layers, and an input of this layer carries a tangent. Use reverse mode (backward() or "
                "torch.autograd.grad) instead.")


def moe(x: Tensor, router_weight: Tensor, w1: Tensor, w2: Tensor, b1: Optional[Tensor] = None,
        b2: Optional[Tensor] = None, *, top_k: int, activation: str = "swiglu", score: str = "softmax_topk",
        routing: str = "topk", rounding: str = "nearest", tile: int = 128, weight_layout: str = "interleaved",
        activation_memory: str = "preact") -> Tuple[Tensor, Tensor, Tensor]:
    """The whole MoE layer: router, routing, experts, aggregation. Returns (out (T, d), router_logits (T, E),
    expert_counts (E,) int32 on the device). Differentiable w.r.t. x, router_weight, w1, w2, b1, b2 (first-order
    reverse mode only: double backward and forward-mode AD raise). Integer options accept Python and numpy integers
    and 0-d integer tensors."""
    act, layout, top_k = _check_common(x, w1, w2, b1, b2, activation, weight_layout, top_k)
    if routing not in ("topk", "token_rounding"):
        _fail("routing", "'topk' or 'token_rounding' (use moe_from_routing for caller-supplied routing)", repr(routing))
    _check_tensor("router_weight", router_weight, (w1.shape[0], x.shape[1]), x)
    tile = as_int("tile", tile, low=8)
    if tile % 8:
        _fail("tile", "a positive multiple of 8", tile)
    codes = (code(SCORES, score, "score"), code(ROUTINGS, routing, "routing"), code(ROUNDINGS, rounding, "rounding"),
             tile, code(ACTIVATION_MEMORY, activation_memory, "activation_memory"))
    _reject_forward_ad(x, router_weight, w1, w2, b1, b2)
    out, logits, counts, _ = torch.ops.machmoe.layer_forward(
        x, router_weight, w1, b1, w2, b2, None, None, None, top_k, act, layout, *codes)
    return out, logits, counts


def _check_routing(x: Tensor, token_index, expert_index, scores) -> None:
    for name, t in (("token_index", token_index), ("expert_index", expert_index), ("scores", scores)):
        require_tensor(name, t)
    if token_index.dim() != 1:
        _fail("token_index", "a 1-D tensor with one entry per (token, expert) pair",
              f"shape {tuple(token_index.shape)}")
    P = token_index.shape[0]
    for name, t in (("token_index", token_index), ("expert_index", expert_index)):
        if tuple(t.shape) != (P,):
            _fail(name, f"shape ({P},) (one entry per pair, as token_index)", f"shape {tuple(t.shape)}")
        if t.dtype not in _INDEX_DTYPES:
            _fail(name, "dtype int32 or int64", t.dtype)
        if t.device != x.device:
            _fail(name, f"a tensor on {x.device} (the device of x)", f"a tensor on {t.device}")
        if not t.is_contiguous():
            _fail(name, "a contiguous tensor", f"strides {t.stride()}")
    score_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    if tuple(scores.shape) != (P,) or scores.dtype != score_dtype or scores.device != x.device or \
            not scores.is_contiguous():
        _fail("scores", f"a contiguous ({P},) {score_dtype} tensor on {x.device}",
              f"{'a contiguous' if scores.is_contiguous() else 'a non-contiguous'} {tuple(scores.shape)} "
              f"{scores.dtype} tensor on {scores.device}")


def moe_from_routing(x: Tensor, w1: Tensor, w2: Tensor, token_index: Tensor, expert_index: Tensor, scores: Tensor,
                     b1: Optional[Tensor] = None, b2: Optional[Tensor] = None, *, max_experts_per_token: int,
                     activation: str = "swiglu", weight_layout: str = "interleaved",
                     activation_memory: str = "preact") -> Tuple[Tensor, Tensor]:
    """The layer from caller-supplied (token, expert, score) triples, token indices ascending and at most
    max_experts_per_token per token. Returns (out (T, d), expert_counts (E,) int32). Differentiable w.r.t. x, w1, w2,
    b1, b2 and scores (in the caller's order). On the GPU, pairs whose expert or token is out of range are skipped
    (expert-parallel sentinels); on the CPU they raise."""
    act, layout, top_k = _check_common(x, w1, w2, b1, b2, activation, weight_layout, max_experts_per_token,
                                       top_k_name="max_experts_per_token")
    _check_routing(x, token_index, expert_index, scores)
    cache = code(ACTIVATION_MEMORY, activation_memory, "activation_memory")
    _reject_forward_ad(x, w1, w2, b1, b2, scores)
    out, _, counts, _ = torch.ops.machmoe.layer_forward(
        x, None, w1, b1, w2, b2, token_index, expert_index, scores, top_k, act, layout, 0, ROUTINGS["caller"], 0, 128,
        cache)
    return out, counts


def _check_expert_counts(x_grouped: Tensor, expert_counts, w1) -> None:
    require_tensor("x_grouped", x_grouped)
    require_tensor("expert_counts", expert_counts)
    require_tensor("w1", w1)
    if x_grouped.dim() != 2:
        _fail("x_grouped", "a (rows, hidden) tensor", f"shape {tuple(x_grouped.shape)}")
    if w1.dim() != 3:
        _fail("w1", "a 3-D (experts, 2n | n, hidden) tensor", f"shape {tuple(w1.shape)}")
    E, P = w1.shape[0], x_grouped.shape[0]
    if tuple(expert_counts.shape) != (E,):
        _fail("expert_counts", f"shape ({E},) (one count per expert)", f"shape {tuple(expert_counts.shape)}")
    if expert_counts.dtype not in (torch.int32, torch.int64):
        _fail("expert_counts", "integer counts (dtype int32 or int64)", expert_counts.dtype)
    if expert_counts.device != x_grouped.device:
        _fail("expert_counts", f"a tensor on {x_grouped.device} (the device of x_grouped)",
              f"a tensor on {expert_counts.device}")
    if not expert_counts.is_cuda:  # reading CPU counts costs no device synchronisation
        negative = (expert_counts < 0).nonzero()
        if negative.numel():
            e = int(negative[0, 0])
            _fail("expert_counts", "non-negative counts", f"expert_counts[{e}] = {int(expert_counts[e])}")
        total = int(expert_counts.sum())
        if total != P:
            _fail("expert_counts", f"counts summing to {P} (the rows of x_grouped)", f"a sum of {total}")


def grouped_experts(x_grouped: Tensor, expert_counts: Tensor, w1: Tensor, w2: Tensor, b1: Optional[Tensor] = None,
                    b2: Optional[Tensor] = None, *, activation: str = "swiglu", weight_layout: str = "interleaved",
                    activation_memory: str = "preact") -> Tensor:
    """The expert computation on pre-dispatched tokens: rows of x_grouped (P, d) already grouped by expert, with
    expert_counts (E,) int32/int64 on the same device (sum = P). Returns (P, d), row i = expert(i)'s MLP of row i.
    This is the seam of expert-parallel dispatchers (torchtitan GroupedExperts, DeepEP): no host synchronisation.
    On the CPU, negative counts or a sum other than P raise; on the GPU the counts are not read back (that would
    synchronise): rows past sum(expert_counts) are padding, skipped like out-of-range pairs (their output is zero)."""
    _check_expert_counts(x_grouped, expert_counts, w1)
    act, layout, _ = _check_common(x_grouped, w1, w2, b1, b2, activation, weight_layout, 1, x_name="x_grouped")
    cache = code(ACTIVATION_MEMORY, activation_memory, "activation_memory")
    _reject_forward_ad(x_grouped, w1, w2, b1, b2)
    P = x_grouped.shape[0]
    idx_dtype = torch.int32 if P < 2**31 else torch.int64
    token_index = torch.arange(P, device=x_grouped.device, dtype=idx_dtype)
    # Row i belongs to the first expert whose running count exceeds i; rows past the total get expert E, the
    # out-of-range sentinel. Unlike repeat_interleave (which needs the total on the host, or asserts on the device),
    # this never needs the counts to sum to P.
    ends = torch.cumsum(expert_counts.to(torch.int64), 0)
    expert_index = torch.searchsorted(ends, torch.arange(P, device=x_grouped.device, dtype=torch.int64), right=True,
                                      out_int32=idx_dtype == torch.int32)
    scores = torch.ones(P, device=x_grouped.device,
                        dtype=torch.float64 if x_grouped.dtype == torch.float64 else torch.float32)
    out, _, _, _ = torch.ops.machmoe.layer_forward(
        x_grouped, None, w1, b1, w2, b2, token_index, expert_index, scores, 1, act, layout, 0, ROUTINGS["caller"], 0,
        128, cache)
    return out


def _loss_precision(router_logits: Tensor) -> Tensor:
    """bf16/fp16 logits are upcast to fp32 for the losses; fp32/fp64 keep their precision."""
    return router_logits if router_logits.dtype in (torch.float32, torch.float64) else router_logits.float()


def _check_logits(router_logits, *, any_leading_dims: bool = False) -> None:
    require_tensor("router_logits", router_logits)
    if not router_logits.is_floating_point() or (router_logits.dim() < 1 if any_leading_dims
                                                 else router_logits.dim() != 2):
        _fail("router_logits", "a floating-point (..., experts) tensor" if any_leading_dims
              else "a floating-point (tokens, experts) tensor",
              f"a {router_logits.dtype} tensor of shape {tuple(router_logits.shape)}")


def load_balancing_loss(router_logits: Tensor, expert_counts: Tensor) -> Tensor:
    """Switch load-balancing loss E * sum_e (P_e / sum P) (f_e / sum f), P_e = sum_t softmax(z_t)_e, from the
    device-side counts (not differentiated). Differentiable w.r.t. the logits."""
    _check_logits(router_logits)
    require_tensor("expert_counts", expert_counts)
    E = router_logits.shape[1]
    if tuple(expert_counts.shape) != (E,):  # any other shape would broadcast into a wrong loss
        _fail("expert_counts", f"shape ({E},) (one count per expert, as router_logits)",
              f"shape {tuple(expert_counts.shape)}")
    if expert_counts.device != router_logits.device:
        _fail("expert_counts", f"a tensor on {router_logits.device} (the device of router_logits)",
              f"a tensor on {expert_counts.device}")
    z = _loss_precision(router_logits)
    P = torch.softmax(z, dim=-1).sum(0)
    f = expert_counts.to(z.dtype)
    return E * torch.sum((P / P.sum()) * (f / f.sum().clamp_min(1.0)))


def router_z_loss(router_logits: Tensor) -> Tensor:
    """Router z-loss: mean over tokens of logsumexp(z_t)^2."""
    _check_logits(router_logits, any_leading_dims=True)
    return torch.logsumexp(_loss_precision(router_logits), dim=-1).square().mean()
