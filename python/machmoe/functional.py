"""Functional API of the machmoe layer.

Shapes: x (T, d); router_weight (E, d); w1 (E, 2n, d) for GLU activations, (E, n, d) otherwise; w2 (E, d, n); b1
(E, 2n | n); b2 (E, d) — nn.Linear (out, in) per expert. With weight_layout="interleaved" the rows of w1 alternate
gate, up, gate, up...; with "concatenated" rows [0, n) are gate and [n, 2n) up (HF gate_up_proj). No host
synchronisation: expert counts stay on the device.

Activations: "swiglu" (silu(gate) up), "geglu", "reglu", "relu_squared", "relu", "gelu", "silu", and "gptoss_swiglu",
gpt-oss's expert MLP: g = min(gate, limit), u = clamp(up, -limit, limit), a = g sigmoid(alpha g) (u + 1), with
swiglu_alpha (default 1.702) and swiglu_limit (default 7.0; float('inf') turns the clamps off). Its gradient follows
torch.clamp's (passed where min <= x <= max, 0 outside). swiglu_alpha/swiglu_limit must be None for the others.
"""
import contextlib
import warnings
from collections.abc import Mapping
from typing import Dict, Optional, Tuple

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor

from ._options import (ACTIVATIONS, ACTIVATION_MEMORY, GLU_ACTIVATIONS, ROUNDINGS, ROUTINGS, SCORES, WEIGHT_LAYOUTS,
                       activation_parameters, code, tile_option)
from ._validation import as_int, caller_stacklevel, fail as _fail, require_tensor

_CPU_DTYPES = (torch.float32, torch.float64)
_CUDA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_META_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # shapes only: a model built on meta
# The dtypes of x whose weights may be float32 master weights (_is_master).
_HALF_DTYPES = (torch.bfloat16, torch.float16)


def _dtypes_for(device: torch.device) -> tuple:
    """The data dtypes the layer takes on a device: the CUDA kernels' on cuda, the reference's elsewhere, and on meta
    (no data: shape and FLOP passes over a model in its training dtype) either."""
    return _CUDA_DTYPES if device.type == "cuda" else _META_DTYPES if device.type == "meta" else _CPU_DTYPES
_INDEX_DTYPES = (torch.int32, torch.int64)


def _autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The dtype the layer computes in on `device` under torch.autocast, or None where autocast is off there.

    The layer follows autocast as torch's matmuls do: its floating inputs other than float64 (x, the router, the
    expert weights and biases) are cast to autocast's dtype, so fp32 parameters under torch.autocast("cuda",
    torch.bfloat16) run the bf16 Hopper kernels (as master weights: _autocast_layer). Where the
    layer has no kernels in that dtype (the CPU's reference takes float32 and float64, and CPU autocast asks for
    bfloat16), it computes in float32 instead, as autocast's float32 ops do."""
    kind = device.type
    if kind not in ("cuda", "cpu") or not torch.is_autocast_enabled(kind):
        return None
    dtype = torch.get_autocast_dtype(kind)
    return dtype if dtype in _dtypes_for(device) else torch.float32


def _autocast_cast(dtype: torch.dtype, *tensors):
    """The tensors with those autocast casts (float64 and non-floating tensors, and None, as they are)."""
    return tuple(t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != dtype and
                 t.dtype != torch.float64 else t for t in tensors)


def _is_master(w, x_dtype: torch.dtype) -> bool:
    """Whether w is a master weight for an x of x_dtype: float32 with bfloat16 or float16 x. The operators take such
    weights as they are, compute in x's dtype (casting the weights for the call, in the forward and again in the
    backward) and give their gradients in float32 (bindings/torch/machmoe_ops.cpp, master_weight)."""
    return isinstance(w, Tensor) and w.dtype == torch.float32 and x_dtype in _HALF_DTYPES


def _autocast_layer(dtype: torch.dtype, x, *weights):
    """(x, *weights) as a layer operator takes them under autocast to `dtype`: x cast, the weights cast as well
    unless they are master weights (_is_master), which the operator casts itself. So float32 parameters reach the
    operator as they are: nothing holds a bf16 copy of them between the forward and the backward, their gradients
    come out of the weight-gradient kernels in float32 (never rounded to bf16, no cast kernel), and they stay leaf
    tensors (defer_weight_grads can defer them)."""
    if dtype not in _HALF_DTYPES:
        return _autocast_cast(dtype, x, *weights)
    (x,) = _autocast_cast(dtype, x)
    return (x, *(w if _is_master(w, dtype) else _autocast_cast(dtype, w)[0] for w in weights))


def _under_autocast(x, *tensors, master: bool = False):
    """(x, *tensors) as the layer computes with them: cast to _autocast_dtype(x.device) where autocast is on there
    (with master=True, through _autocast_layer: float32 weights left to the operator), as they are otherwise (and
    where x is not a tensor: the checks that follow name it)."""
    cast = _autocast_dtype(x.device) if isinstance(x, Tensor) else None
    if cast is None:
        return (x, *tensors)
    return _autocast_layer(cast, x, *tensors) if master else _autocast_cast(cast, x, *tensors)


def _check_tensor(name: str, t: Tensor, shape, ref: Tensor, *, ref_name: str = "x",
                  inner_stride_only: bool = False, master: bool = False) -> None:
    """master: t may be a float32 master weight of ref (_is_master)."""
    require_tensor(name, t)
    if t.device != ref.device:
        _fail(name, f"a tensor on {ref.device} (the device of {ref_name})", f"a tensor on {t.device}")
    if t.dtype != ref.dtype and not (master and _is_master(t, ref.dtype)):
        also = (" or torch.float32 (float32 master weights: the layer computes in the dtype of "
                f"{ref_name})") if master and ref.dtype in _HALF_DTYPES else ""
        _fail(name, f"dtype {ref.dtype} (the dtype of {ref_name}){also}", t.dtype)
    if tuple(t.shape) != tuple(shape):
        _fail(name, f"shape {tuple(shape)}", tuple(t.shape))
    # (A last dimension of size 1 has no stride to speak of: torch calls such a tensor contiguous whatever it is, so
    # .contiguous() would not change it, and the operators take it as it is.)
    ok = (t.stride(-1) == 1 or t.shape[-1] == 1) if inner_stride_only else t.is_contiguous()
    if not ok:
        _fail(name, "a contiguous tensor (call .contiguous())" if not inner_stride_only
              else "unit stride in the last dimension", f"strides {t.stride()}")
    if inner_stride_only and t.dim() == 2 and t.stride(0) < t.shape[1] and t.shape[0] > 1:
        # Rows that overlap (an expanded, broadcast tensor: stride 0) are refused by the operators, which view x as
        # rows of its own; say so here, in the caller's terms. (stride first: no guard on a dynamic T.)
        _fail(name, f"rows that do not overlap (a stride >= {t.shape[1]} in dimension 0; call .contiguous())",
              f"strides {t.stride()}")


def _check_common(x: Tensor, w1: Tensor, w2: Tensor, b1, b2, activation: str, weight_layout: str, top_k,
                  *, x_name: str = "x", top_k_name: str = "top_k", swiglu_alpha=None, swiglu_limit=None):
    """Checks x, the expert weights and biases, the activation/layout (and its parameters) and the per-token expert
    count; returns (activation code, layout code, top_k as an int, (swiglu_alpha, swiglu_limit) as floats)."""
    for name, t, optional in ((x_name, x, False), ("w1", w1, False), ("w2", w2, False), ("b1", b1, True),
                              ("b2", b2, True)):
        require_tensor(name, t, optional=optional)
    if x.dim() != 2:
        _fail(x_name, "a (tokens, hidden) tensor", f"shape {tuple(x.shape)}")
    allowed = _dtypes_for(x.device)
    if x.dtype not in allowed:
        _fail(x_name, f"one of {allowed} on {x.device.type}", x.dtype)
    halves = w1.dim() == 4 and weight_layout == "concatenated" and activation in GLU_ACTIVATIONS
    if w1.dim() != 3 and not halves:
        _fail("w1", "a 3-D (experts, 2n | n, hidden) tensor" + (
              ", or a 4-D (experts, 2, n, hidden) view of its gate and up halves"
              if weight_layout == "concatenated" else ""), f"shape {tuple(w1.shape)}")
    if w2.dim() != 3:
        _fail("w2", "a 3-D (experts, hidden, n) tensor", f"shape {tuple(w2.shape)}")
    T, d = x.shape
    E, n = w2.shape[0], w2.shape[2]
    if E < 1:
        _fail("w2", "at least one expert (a first dimension >= 1)", f"shape {tuple(w2.shape)}")
    if d < 1:
        _fail(x_name, "a (tokens, hidden) tensor with hidden >= 1", f"shape {tuple(x.shape)}")
    if n < 1:
        _fail("w2", "an (experts, hidden, n) tensor with n >= 1", f"shape {tuple(w2.shape)}")
    act = code(ACTIVATIONS, activation, "activation")
    act_params = activation_parameters(activation, swiglu_alpha, swiglu_limit)
    layout = code(WEIGHT_LAYOUTS, weight_layout, "weight_layout")
    if weight_layout == "concatenated" and activation not in GLU_ACTIVATIONS:
        _fail("weight_layout", f"'interleaved' for the non-GLU activation {activation!r}", repr(weight_layout))
    rows = 2 * n if activation in GLU_ACTIVATIONS else n
    # The number of experts is w1's (as for the router's weight), n is w2's last dimension: the weight that disagrees
    # is named, with where the expected size came from (w1 used to be blamed for a w2 with the wrong E).
    if w2.shape[0] != w1.shape[0]:
        _fail("w2", f"{w1.shape[0]} experts in its first dimension (as w1 of shape {tuple(w1.shape)})",
              f"shape {tuple(w2.shape)}")
    if halves:
        # Gate and up halves that may lie apart (torchtitan's w1 and w3: parallel._join_gate_up): each half a
        # contiguous (E, n, d) tensor, the up half after the gate half (the library checks that they do not overlap).
        _check_tensor("w1[:, 0]", w1[:, 0], (E, n, d), x, ref_name=x_name, master=True)
        _check_tensor("w1[:, 1]", w1[:, 1], (E, n, d), x, ref_name=x_name, master=True)
        if w1.stride(1) <= 0:
            _fail("w1", "its up half w1[:, 1] after its gate half w1[:, 0] in memory (a positive stride in dimension "
                        "1)", f"strides {w1.stride()}")
    elif w1.shape[1] != rows:
        _fail("w1", f"{rows} rows in its second dimension ({'2n' if rows != n else 'n'} with n = {n}, the last "
                    f"dimension of w2 of shape {tuple(w2.shape)}, for the activation {activation!r})",
              f"shape {tuple(w1.shape)}")
    _check_tensor(x_name, x, (T, d), x, ref_name=x_name, inner_stride_only=True)
    if not halves:
        _check_tensor("w1", w1, (E, rows, d), x, ref_name=x_name, master=True)
    _check_tensor("w2", w2, (E, d, n), x, ref_name=x_name, master=True)
    if b1 is not None:
        _check_tensor("b1", b1, (E, rows), x, ref_name=x_name, master=True)
    if b2 is not None:
        _check_tensor("b2", b2, (E, d), x, ref_name=x_name, master=True)
    top_k = as_int(top_k_name, top_k, low=1, high=E, what="(the number of experts)")
    return act, layout, top_k, act_params


_INTO_NAMES = ("router_weight", "w1", "b1", "w2", "b2")
_NO_INTO = (None,) * len(_INTO_NAMES)
_INTO_ARG = "accumulate_grads_into"


def _into_dtypes_text(name: str, weight_dtype: torch.dtype) -> str:
    """What a gradient-accumulation buffer of weight `name` may be, for messages: its dtype or fp32."""
    return ("dtype torch.float32" if weight_dtype == torch.float32
            else f"dtype {weight_dtype} (the dtype of {name}) or torch.float32")


def _check_into(into, weights: Dict[str, Optional[Tensor]],
                arg_format: str = _INTO_ARG + "['{}']") -> Tuple[Optional[Tensor], ...]:
    """The gradient-accumulation buffers (accumulate_grads_into: weight name -> buffer), checked against the weights
    of this call; returns them in the operator's order (router_weight, w1, b1, w2, b2), None where absent. A buffer
    is named in messages by arg_format.format(weight name)."""
    if into is None:
        return (None,) * len(_INTO_NAMES)
    if not isinstance(into, Mapping):
        raise TypeError(f"machmoe: argument '{_INTO_ARG}': expected a dict mapping weight names to gradient buffers "
                        f"or None, got {type(into).__name__}")
    present = [name for name in _INTO_NAMES if weights.get(name) is not None]
    for name, buf in into.items():
        if name not in present:
            _fail(_INTO_ARG, f"keys among {present} (the weights of this call)", repr(name))
        arg = arg_format.format(name)
        require_tensor(arg, buf)
        w = weights[name]
        if buf.device != w.device:
            _fail(arg, f"a tensor on {w.device} (the device of {name})", f"a tensor on {buf.device}")
        if buf.dtype not in (w.dtype, torch.float32):
            _fail(arg, _into_dtypes_text(name, w.dtype), buf.dtype)
        if tuple(buf.shape) != tuple(w.shape):
            _fail(arg, f"shape {tuple(w.shape)} (the shape of {name})", f"shape {tuple(buf.shape)}")
        if not buf.is_contiguous():
            _fail(arg, "a contiguous tensor", f"strides {buf.stride()}")
        if buf.requires_grad:
            _fail(arg, "a buffer that does not require grad (gradients are added into it, not through it)",
                  "a tensor with requires_grad=True")
        if buf.is_inference() and not torch.is_inference_mode_enabled():
            # The backward would write it and only then fail to bump its version (torch refuses that for an
            # inference tensor outside inference mode, as it refuses an in-place op on it).
            _fail(arg, "a tensor with a version counter (not an inference tensor: create the buffer outside "
                  "torch.inference_mode(), or clone it)", "an inference tensor")
    return tuple(into.get(name) for name in _INTO_NAMES)


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


_warned_small_batch_rounding = False


def _warn_if_rounding_empties_experts(tokens: int, tile: int, rounding: str) -> None:
    """Token rounding on a batch of fewer tokens than one tile: no expert can reach a tile (a token picks an expert at
    most once), so 'down' rounds every expert to zero and the output is zero, and 'nearest' keeps only experts chosen
    by more than half of the tokens. Decided from the shapes alone (the counts stay on the device); said once per
    process, in eager mode (a warning inside torch.compile(fullgraph=True) would break the graph). docs/ROUTING.md,
    "Small batches"."""
    global _warned_small_batch_rounding
    if torch.compiler.is_compiling():
        return
    if _warned_small_batch_rounding or not 0 < tokens < tile or rounding not in ("down", "nearest"):
        return
    _warned_small_batch_rounding = True
    warnings.warn(
        f"machmoe: token rounding with tile={tile} on a batch of {tokens} tokens (fewer than one tile): rounding "
        f"'down' drops every pair, so the output is zero; 'nearest' keeps only the experts chosen by more than half "
        f"of the tokens and drops the rest. Use routing='topk' or a smaller tile for small batches (said once).",
        RuntimeWarning, stacklevel=caller_stacklevel())


def moe(x: Tensor, router_weight: Tensor, w1: Tensor, w2: Tensor, b1: Optional[Tensor] = None,
        b2: Optional[Tensor] = None, *, top_k: int, activation: str = "swiglu", score: str = "softmax_topk",
        routing: str = "topk", rounding: str = "nearest", tile: int = 128, weight_layout: str = "interleaved",
        activation_memory: str = "preact", accumulate_grads_into: Optional[Dict[str, Tensor]] = None,
        swiglu_alpha: Optional[float] = None, swiglu_limit: Optional[float] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """The whole MoE layer: router, routing, experts, aggregation. Returns (out (T, d), router_logits (T, E),
    expert_counts (E,) int32 on the device). Differentiable w.r.t. x, router_weight, w1, w2, b1, b2 (first-order
    reverse mode only: double backward and forward-mode AD raise). Integer options accept Python and numpy integers
    and 0-d integer tensors on the CPU. The weights (router_weight, w1, w2, b1, b2) are in x's dtype, or float32 with
    a bfloat16/float16 x (master weights: the layer computes in x's dtype, casting them for the call, and returns
    their gradients in float32).

    accumulate_grads_into: gradient accumulation (Megatron-style main_grad), a dict mapping weight names
    ('router_weight', 'w1', 'b1', 'w2', 'b2') to buffers of the weight's shape, of its dtype or torch.float32,
    contiguous, on its device. The backward adds those weights' gradients into the buffers (inside the weight-gradient
    kernels: the sum in fp32, rounded once to the buffer's dtype, no extra kernel or copy) instead of returning them,
    so their .grad is left as it was. Experts that receive no token leave their part of the buffers unchanged.

    swiglu_alpha, swiglu_limit: the parameters of activation="gptoss_swiglu" (None: gpt-oss's 1.702 and 7.0); None
    for every other activation.

    Under torch.autocast the layer computes in autocast's dtype (_autocast_dtype): x is cast to it, and so are
    router_weight and the expert weights, but for float32 ones under a bfloat16/float16 autocast, which are passed
    as master weights (_autocast_layer)."""
    x, router_weight, w1, w2, b1, b2 = _under_autocast(x, router_weight, w1, w2, b1, b2, master=True)
    return _moe(x, router_weight, w1, w2, b1, b2, top_k, activation, score, routing, rounding, tile, weight_layout,
                activation_memory, accumulate_grads_into, None, swiglu_alpha, swiglu_limit)


# ---- the host path of moe() ------------------------------------------------------------------------------------
# Host time before the first kernel is GPU idle time when the stream is idle (target T14), and the checks below are
# most of the Python part of it. They are made cheap, never skipped: one pass that only answers "all fine?" over
# the tensors' metadata, and the option codes of combinations already validated; anything else (a failure, an
# unusual argument type, tracing) takes the full checks, which raise the first failure with its usual message.

_OPTION_CACHE: Dict[tuple, tuple] = {}  # option values -> (glu, act, layout, score, routing, rounding, tile, cache,
_OPTION_CACHE_SIZE = 64                 #                   alpha, limit); only combinations that passed the checks


def _option_key(activation, weight_layout, score, routing, rounding, tile, activation_memory, swiglu_alpha,
                swiglu_limit):
    """The cache key of a combination, or None where a cache hit could accept what the checks refuse: the key is
    compared by ==, and 128.0 == 128, True == 1.0. Strings equal to a valid name are that name."""
    if type(tile) is not int or not (swiglu_alpha is None or type(swiglu_alpha) is float) or \
            not (swiglu_limit is None or type(swiglu_limit) is float):
        return None
    return (activation, weight_layout, score, routing, rounding, tile, activation_memory, swiglu_alpha, swiglu_limit)


def _tensors_pass(x, router_weight, w1, w2, b1, b2, glu: bool) -> bool:
    """Whether x (2-D), the router and the expert weights pass every check that _check_common and moe() make of them
    (types, ranks, x's dtype for its device and inner stride, every tensor's device, dtype, shape and contiguity).
    True lets those checks be skipped; False only sends the caller to them."""
    if not (isinstance(x, Tensor) and isinstance(router_weight, Tensor) and isinstance(w1, Tensor) and
            isinstance(w2, Tensor) and (b1 is None or isinstance(b1, Tensor)) and
            (b2 is None or isinstance(b2, Tensor))):
        return False
    xs, ws = x.shape, w2.shape
    if len(xs) != 2 or len(ws) != 3:
        return False
    device, dtype = x.device, x.dtype
    if dtype not in _dtypes_for(device) or x.stride(-1) != 1:
        return False
    d = xs[1]
    if x.stride(0) < d and xs[0] > 1:  # overlapping rows (e.g. expanded): _check_common reports them
        return False
    E, n = ws[0], ws[2]
    if E < 1 or ws[1] != d or d < 1 or n < 1:
        return False
    rows = 2 * n if glu else n
    for t, shape in ((w1, (E, rows, d)), (w2, ws), (router_weight, (E, d)), (b1, (E, rows)), (b2, (E, d))):
        if t is not None and (t.device != device or (t.dtype != dtype and not _is_master(t, dtype)) or
                              t.shape != shape or not t.is_contiguous()):
            return False
    return True


def _moe(x, router_weight, w1, w2, b1, b2, top_k, activation, score, routing, rounding, tile, weight_layout,
         activation_memory, accumulate_grads_into, into_checked, swiglu_alpha, swiglu_limit):
    """moe(). into_checked: the buffers in the operator's order, already checked by the caller (MoE's main_grad
    path), used instead of accumulate_grads_into; None otherwise."""
    key = None if torch.compiler.is_compiling() else _option_key(
        activation, weight_layout, score, routing, rounding, tile, activation_memory, swiglu_alpha, swiglu_limit)
    try:
        opts = _OPTION_CACHE.get(key) if key is not None else None
    except TypeError:  # an unhashable option value: the checks below name it
        key = opts = None
    if opts is not None and type(top_k) is int and _tensors_pass(x, router_weight, w1, w2, b1, b2, opts[0]) and \
            1 <= top_k <= w2.shape[0]:
        act, layout, *codes, alpha, limit = opts[1:]
        act_params = (alpha, limit)
    else:
        act, layout, top_k, act_params = _check_common(x, w1, w2, b1, b2, activation, weight_layout, top_k,
                                                       swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
        if routing not in ("topk", "token_rounding"):
            _fail("routing", "'topk' or 'token_rounding' (use moe_from_routing for caller-supplied routing)",
                  repr(routing))
        _check_tensor("router_weight", router_weight, (w1.shape[0], x.shape[1]), x, master=True)
        tile = tile_option(tile)
        codes = [code(SCORES, score, "score"), code(ROUTINGS, routing, "routing"),
                 code(ROUNDINGS, rounding, "rounding"), tile, code(ACTIVATION_MEMORY, activation_memory,
                                                                   "activation_memory")]
        if key is not None:  # every option of this combination passed
            if len(_OPTION_CACHE) >= _OPTION_CACHE_SIZE:
                _OPTION_CACHE.clear()
            _OPTION_CACHE[key] = (activation in GLU_ACTIVATIONS, act, layout, *codes, *act_params)
    if routing == "token_rounding":
        _warn_if_rounding_empties_experts(x.shape[0], tile, rounding)
    if into_checked is not None:
        into = into_checked
    elif accumulate_grads_into is None:
        into = _NO_INTO
    else:
        into = _check_into(accumulate_grads_into, dict(router_weight=router_weight, w1=w1, b1=b1, w2=w2, b2=b2))
    _reject_forward_ad(x, router_weight, w1, w2, b1, b2)
    out, logits, counts, _ = torch.ops.machmoe.layer_forward(
        x, router_weight, w1, b1, w2, b2, None, None, None, top_k, act, layout, *codes, *act_params, *into)
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
                     activation_memory: str = "preact",
                     accumulate_grads_into: Optional[Dict[str, Tensor]] = None, swiglu_alpha: Optional[float] = None,
                     swiglu_limit: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """The layer from caller-supplied (token, expert, score) triples. Returns (out (T, d), expert_counts (E,) int32).
    Differentiable w.r.t. x, w1, w2, b1, b2 and scores (in the caller's order). No pairs (or no tokens) give a zero
    output. accumulate_grads_into, swiglu_alpha, swiglu_limit: as for moe() (keys 'w1', 'b1', 'w2', 'b2').
    token_index and expert_index: contiguous int32 or int64 (P,) tensors on x's device; scores: a contiguous (P,)
    float32 tensor on x's device (float64 when x is float64); anything else raises ValueError.

    The routing contract (docs/ROUTING.md, "Caller-supplied triples"): token_index ascending (the pairs sorted by
    token; a token's pairs in any expert order, duplicates counting twice), token in [0, T), expert in [0, E), at
    most max_experts_per_token (K) pairs per token.
      * CPU: every index is checked before anything is computed; a violation raises ValueError naming the pair.
      * GPU: the indices stay on the device and are not read back (that would synchronise). A pair whose token or
        expert is out of range is skipped (never read out of bounds): it contributes nothing, which is how
        expert-parallel callers mark sentinel pairs. A token below an earlier valid one, or a (K+1)-th pair of a
        token, is skipped the same way, deterministically, without moving the other pairs: those give the results
        they would give alone.
      * GPU with index checking on (MACHMOE_CHECK_INDICES=1 in the environment, read at the first call, or
        machmoe.set_index_checking(True)): the kernel that reads the triples records the first violation of the
        CPU's rules (range, sentinels included, order, more than K per token) on the device, without a host
        synchronisation, and the next machmoe call on that device, or machmoe.check_device_errors(), raises
        ValueError naming the argument, the position and the value. The call that launched the bad triples has
        already returned (bad pairs skipped): discard its outputs.

    Under torch.autocast, and for the weights' dtypes: as moe() (scores stay float32)."""
    x, w1, w2, b1, b2 = _under_autocast(x, w1, w2, b1, b2, master=True)
    act, layout, top_k, act_params = _check_common(x, w1, w2, b1, b2, activation, weight_layout,
                                                   max_experts_per_token, top_k_name="max_experts_per_token",
                                                   swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
    _check_routing(x, token_index, expert_index, scores)
    if token_index.shape[0] > x.shape[0] * top_k:  # (the operator would name its own problem.num_pairs)
        _fail("token_index", f"at most T * max_experts_per_token = {x.shape[0]} * {top_k} pairs (at most K pairs a "
              "token)", f"{token_index.shape[0]} pairs")
    cache = code(ACTIVATION_MEMORY, activation_memory, "activation_memory")
    into = _check_into(accumulate_grads_into, dict(w1=w1, b1=b1, w2=w2, b2=b2))
    _reject_forward_ad(x, w1, w2, b1, b2, scores)
    out, _, counts, _ = torch.ops.machmoe.layer_forward(
        x, None, w1, b1, w2, b2, token_index, expert_index, scores, top_k, act, layout, 0, ROUTINGS["caller"], 0, 128,
        cache, *act_params, *into)
    return out, counts


def _check_expert_counts(x_grouped: Tensor, expert_counts, w1) -> None:
    require_tensor("x_grouped", x_grouped)
    require_tensor("expert_counts", expert_counts)
    require_tensor("w1", w1)
    if x_grouped.dim() != 2:
        _fail("x_grouped", "a (rows, hidden) tensor", f"shape {tuple(x_grouped.shape)}")
    if w1.dim() not in (3, 4):
        _fail("w1", "a 3-D (experts, 2n | n, hidden) tensor", f"shape {tuple(w1.shape)}")
    E, P = w1.shape[0], x_grouped.shape[0]
    if tuple(expert_counts.shape) != (E,):
        _fail("expert_counts", f"shape ({E},) (one count per expert)", f"shape {tuple(expert_counts.shape)}")
    if expert_counts.dtype not in (torch.int32, torch.int64):
        _fail("expert_counts", "integer counts (dtype int32 or int64)", expert_counts.dtype)
    if expert_counts.device != x_grouped.device:
        _fail("expert_counts", f"a tensor on {x_grouped.device} (the device of x_grouped)",
              f"a tensor on {expert_counts.device}")
    # Reading CPU counts costs no device synchronisation. Under torch.compile the values are not known while tracing;
    # the grouped_expert_index operator checks them when the graph runs (same rules, its own message).
    if not expert_counts.is_cuda and not torch.compiler.is_compiling():
        negative = (expert_counts < 0).nonzero()
        if negative.numel():
            e = int(negative[0, 0])
            _fail("expert_counts", "non-negative counts", f"expert_counts[{e}] = {int(expert_counts[e])}")
        total = int(expert_counts.sum())
        if total != P:
            _fail("expert_counts", f"counts summing to {P} (the rows of x_grouped)", f"a sum of {total}")


def grouped_experts(x_grouped: Tensor, expert_counts: Tensor, w1: Tensor, w2: Tensor, b1: Optional[Tensor] = None,
                    b2: Optional[Tensor] = None, *, activation: str = "swiglu", weight_layout: str = "interleaved",
                    activation_memory: str = "preact",
                    accumulate_grads_into: Optional[Dict[str, Tensor]] = None, swiglu_alpha: Optional[float] = None,
                    swiglu_limit: Optional[float] = None) -> Tensor:
    """The expert computation on pre-dispatched tokens: rows of x_grouped (P, d) already grouped by expert, with
    expert_counts (E,) int32/int64 on the device (sum = P). Returns (P, d), row i = expert(i)'s MLP of row i. This is
    the seam of expert-parallel dispatchers (torchtitan GroupedExperts, DeepEP): no host synchronisation. P = 0 (a rank
    that received no tokens) returns a (0, d) output and zero weight gradients. On the CPU, counts that are negative
    or do not sum to P raise; on the GPU they cannot be checked without a synchronisation: rows past the counts'
    total get zero output, and with machmoe.set_index_checking(True) the counts are validated on the device and
    the error is raised at the next layer call or machmoe.check_device_errors(). accumulate_grads_into,
    swiglu_alpha, swiglu_limit: as for moe() (keys 'w1', 'b1', 'w2', 'b2'); under torch.autocast, as moe()."""
    x_grouped, w1, w2, b1, b2 = _under_autocast(x_grouped, w1, w2, b1, b2, master=True)
    _check_expert_counts(x_grouped, expert_counts, w1)
    act, layout, _, act_params = _check_common(x_grouped, w1, w2, b1, b2, activation, weight_layout, 1,
                                               x_name="x_grouped", swiglu_alpha=swiglu_alpha,
                                               swiglu_limit=swiglu_limit)
    cache = code(ACTIVATION_MEMORY, activation_memory, "activation_memory")
    into = _check_into(accumulate_grads_into, dict(w1=w1, b1=b1, w2=w2, b2=b2))
    _reject_forward_ad(x_grouped, w1, w2, b1, b2)
    P = x_grouped.shape[0]
    idx_dtype = torch.int32 if P < 2**31 else torch.int64
    token_index = torch.arange(P, device=x_grouped.device, dtype=idx_dtype)
    # Our operator rather than repeat_interleave(output_size=P), which writes past its output when the counts sum to
    # more than P: it reads only the E counts and writes exactly P experts (rows past the counts' total get the
    # out-of-range expert E and a zero output).
    expert_index = torch.ops.machmoe.grouped_expert_index(expert_counts.contiguous(), P)
    scores = torch.ones(P, device=x_grouped.device,
                        dtype=torch.float64 if x_grouped.dtype == torch.float64 else torch.float32)
    out, _, _, _ = torch.ops.machmoe.layer_forward(
        x_grouped, None, w1, b1, w2, b2, token_index, expert_index, scores, 1, act, layout, 0, ROUTINGS["caller"], 0,
        128, cache, *act_params, *into)
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
    device-side counts (not differentiated). Differentiable w.r.t. the logits. No tokens (T = 0): 0, with a zero
    gradient (there is no load to balance; the formula would divide 0 by 0)."""
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
    if z.shape[0] == 0:
        return z.sum()  # 0, still attached to the logits
    P = torch.softmax(z, dim=-1).sum(0)
    f = expert_counts.to(z.dtype)
    return E * torch.sum((P / P.sum()) * (f / f.sum().clamp_min(1.0)))


def router_z_loss(router_logits: Tensor) -> Tensor:
    """Router z-loss: mean over tokens of logsumexp(z_t)^2; 0 (zero gradient) with no tokens, where the mean of
    nothing would be NaN."""
    _check_logits(router_logits, any_leading_dims=True)
    if router_logits.numel() == 0:
        return _loss_precision(router_logits).sum()
    return torch.logsumexp(_loss_precision(router_logits), dim=-1).square().mean()


# ---- index checking (docs/ARCHITECTURE.md, "Index checking") -------------------------------------------------------

def set_index_checking(enabled: bool) -> None:
    """Switches device-side validation of caller indices on or off for the process (default: off, or on when the
    environment sets MACHMOE_CHECK_INDICES=1). While on, the GPU kernels that read caller indices (moe_from_routing's
    token and expert indices, grouped_experts' counts) record the first entry that breaks the CPU's rules (out of
    range, tokens not ascending, more than max_experts_per_token pairs of a token, bad counts) without a host
    synchronisation; the next machmoe call on that device, or check_device_errors(), raises ValueError naming
    the argument, the position and the value. Out-of-range entries are never read out of bounds either way."""
    if not isinstance(enabled, bool):
        raise TypeError(f"machmoe: argument 'enabled': expected a bool, got {type(enabled).__name__}")
    torch.ops.machmoe.set_index_checking(enabled)


def index_checking_enabled() -> bool:
    """Whether device-side index checking is on (set_index_checking)."""
    return torch.ops.machmoe.index_checking_enabled()


# ---- fallback policy (docs/ARCHITECTURE.md, "What takes the fast path") -----------------------------------------

def set_fallback_policy(policy: str) -> None:
    """What a GPU expert GEMM does when the Hopper kernels cannot take it and it would run on the slow GPU reference
    GEMM (hidden_size or intermediate_size not a multiple of 8, unaligned tensors, fp16/fp32 data):
    "warn" (the default) runs it and prints one warning per stage and reason to stderr; "error" raises ValueError
    with the same message instead, before the call launches anything (the environment's MACHMOE_FALLBACK=error sets
    it at start-up). The reference path chosen on purpose (MACHMOE_DISABLE_HOPPER_KERNELS=1,
    MACHMOE_HOPPER_BACKWARD=0) is never an error."""
    if policy not in ("warn", "error"):
        raise ValueError(f"machmoe: argument 'policy': expected 'warn' or 'error', got {policy!r}")
    torch.ops.machmoe.set_fallback_policy(policy)


def fallback_policy() -> str:
    """The current fallback policy, "warn" or "error" (set_fallback_policy)."""
    return torch.ops.machmoe.fallback_policy()


# ---- SM margin (docs/ARCHITECTURE.md, "The SM margin") --------------------------------------------------------------

def set_sm_margin(sms: int) -> None:
    """Leaves `sms` SMs of the GPU free for kernels on other streams while the layer's expert GEMMs run (0, the
    default: they take every SM). The expert GEMMs run persistent grids, one CTA or cluster on every SM, so a kernel
    launched meanwhile on another stream (an expert-parallel all-to-all overlapped with the experts) waits until the
    GEMM ends; with a margin it runs beside it. Process-wide, read by each expert GEMM of a forward or backward when
    it is launched (autograd's backward thread included); a CUDA graph (torch.compile's "reduce-overhead" mode
    included) replays the grids of its capture, so capture under the margin its replays should have. The
    environment's MACHMOE_SM_MARGIN sets it at start-up. Results are bitwise the same with any margin; the GEMMs run
    on fewer SMs. A GPU call whose device has fewer than sms + 2 SMs raises ValueError before it launches anything."""
    if isinstance(sms, bool) or not isinstance(sms, int):
        raise TypeError(f"machmoe: argument 'sms': expected an int, got {type(sms).__name__}")
    if sms < 0:
        raise ValueError(f"machmoe: argument 'sms': expected a number of SMs >= 0, got {sms}")
    torch.ops.machmoe.set_sm_margin(sms)


def sm_margin() -> int:
    """The SMs the layer's expert GEMMs leave to other streams (set_sm_margin)."""
    return torch.ops.machmoe.sm_margin()


@contextlib.contextmanager
def sm_margin_scope(sms: int):
    """set_sm_margin(sms) for the block, then the margin before it again (even when the block raises). The setting is
    process-wide, not per thread: a backward that autograd runs after the block ends uses the margin of that time."""
    previous = sm_margin()
    set_sm_margin(sms)
    try:
        yield
    finally:
        torch.ops.machmoe.set_sm_margin(previous)


def check_device_errors(device=None) -> None:
    """Waits for the current stream of a CUDA device (default: the current device) and raises ValueError for an index
    violation that a checked kernel recorded there (set_index_checking); returns None when there is none. A no-op
    for a CPU device (CPU calls validate their indices up front), and for device=None when CUDA is unavailable; a
    CUDA device named on a machine without CUDA is an error."""
    if device is None:
        if not torch.cuda.is_available():
            return
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type == "cpu":
        return
    if device.type != "cuda":
        _fail("device", "a cuda or cpu device", device)
    torch.ops.machmoe.check_device_errors(device.index if device.index is not None else torch.cuda.current_device())
