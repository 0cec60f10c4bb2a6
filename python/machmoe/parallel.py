"""Expert parallelism over torch.distributed: machmoe.parallel.

Each rank of an expert-parallel (EP) process group routes its own tokens with the replicated router and sends
them to the ranks that own their experts (all-to-all); each rank runs its E / ep_size local experts on the rows it
received, the results go back (the reverse all-to-all) and are combined with the routing scores. Every row movement
is an autograd Function whose backward is the reverse movement, so gradients reach x, the router and the experts.
docs/PARALLEL.md describes the design; the same code runs over gloo (CPU tensors, the CPU reference) and NCCL (CUDA
tensors).

Two exchange modes:
  * capacity=None (default): a token's row goes once to each rank that owns at least one of its experts, with its
    pairs (row, local expert, score); that rank runs the library's whole layer on its rows (the pairs' sum with
    their scores included) and returns one partial sum per row, which the token's rank adds over ranks
    (_rows_forward). The per-destination counts are exchanged on the device, then copied to the host once per
    forward (the split sizes of the all-to-alls must be host integers). That copy is the layer's only host
    synchronisation; the reverse exchanges and the whole backward reuse the split sizes.
  * capacity=C: one row per (token, expert) pair, and a static bound of C rows per (source rank, destination rank)
    pair. Every shape is static and nothing is copied to the host (meant for CUDA-graph capture). Rows beyond the
    bound are not sent: they contribute nothing to the output (like a capacity-factor token drop), and the number of
    dropped rows is reported on the device (ExpertParallelOutput.dropped_rows, check_capacity()).

Row order conventions (docs/SPEC.md §1): *pair order* is token-major (top-K: p = t*K + k; token rounding: (token,
expert) ascending); *expert order* is the pairs stably sorted by global expert, which also groups them by
destination rank because rank r owns experts [r*E_local, (r+1)*E_local). No floating-point atomics: every gather
has an explicit inverse for its backward, and rows that meet (a token's K results, a token's K input gradients) are
summed per token in a fixed order.
"""
import contextlib
import copy
import math
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from ._options import (ACTIVATION_MEMORY, ACTIVATIONS, GLU_ACTIVATIONS, ROUNDINGS, SCORES, WEIGHT_LAYOUTS,
                       activation_parameters, code, tile_option)
from ._validation import as_int, require_tensor, type_name
from .functional import (_autocast_cast, _autocast_dtype, _check_common, _check_tensor, _dtypes_for, _fail,
                         _is_master, _under_autocast, grouped_experts, index_checking_enabled, load_balancing_loss,
                         moe_from_routing, router_z_loss)
from .module import _EXPERT_OPTIONS, _ROUTING_OPTIONS, MoE, MoEOutput, _LossCoefficients, _options_repr

__all__ = ["ExpertParallelMoE", "ExpertParallelOutput", "ExpertParallelDispatch", "ExpertPairs", "GroupedExperts",
           "TorchTitanGroupedExperts", "torchtitan_experts_forward", "expert_parallel_moe", "expert_parallel_dispatch",
           "expert_parallel_combine", "check_capacity", "route", "shard_experts_fsdp2"]

_CPU_DTYPES = (torch.float32, torch.float64)
_CUDA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores and row sums: float64 for float64 data, float32 otherwise (the library's score dtype)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- routing (the library's rules, docs/ROUTING.md) ------------------------------------------------------------

@dataclass
class _Routing:
    """One rank's routing in dense form, before the pair list is built (its length may need the host sync)."""
    counts: Tensor                        # (E,) int64: pairs per expert
    top_k_order: Optional[Tensor] = None  # top-K: (T, K) chosen experts, best first
    top_k_scores: Optional[Tensor] = None  # top-K: (T, K) scores (differentiable)
    keep: Optional[Tensor] = None         # token rounding: (T, E) bool, the kept pairs
    dense_scores: Optional[Tensor] = None  # token rounding: (T, E) scores of every (token, expert) (differentiable)
    per_token: Optional[Tensor] = None    # token rounding: (T,) pairs per token


def _rounded_counts(f: Tensor, T: int, tile: int, rounding: str) -> Tensor:
    down = torch.div(f, tile, rounding_mode="floor") * tile
    up = torch.clamp(torch.div(f + tile - 1, tile, rounding_mode="floor") * tile, max=T)
    if rounding == "down":
        return down
    if rounding == "up":
        return up
    return torch.where(up - f < f - down, up, down)  # nearest; ties round down (docs/ROUTING.md)


def _route_dense(logits: Tensor, top_k: int, score: str, routing: str, rounding: str, tile: int) -> _Routing:
    T, E = logits.shape
    z = logits.to(_acc_dtype(logits.dtype))
    # Selection: descending, equal logits rank the lower expert first (stable sort), NaN ranks last.
    ranked = torch.nan_to_num(z.detach(), nan=float("-inf"))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, :top_k]
    if score == "topk_softmax":
        probs = torch.softmax(z, dim=-1)
        s = probs.gather(1, order)
    else:  # softmax_topk, and topk_softmax_renorm computed as the same function (docs/ROUTING.md)
        probs = None
        s = torch.softmax(z.gather(1, order), dim=-1)
    if routing == "topk":
        # Counting by scatter_add of int64 ones: exact and deterministic, and unlike bincount no host sync.
        counts = torch.zeros(E, dtype=torch.int64, device=logits.device)
        counts.scatter_add_(0, order.reshape(-1), torch.ones(T * top_k, dtype=torch.int64, device=logits.device))
        return _Routing(counts=counts, top_k_order=order, top_k_scores=s)
    # Token rounding (docs/SPEC.md §5): keep the top r_e tokens of each expert by preference S'.
    if probs is None:
        probs = torch.softmax(z, dim=-1)
    chosen = torch.zeros(T, E, dtype=torch.bool, device=logits.device).scatter_(1, order, True)
    tc_dense = torch.zeros(T, E, dtype=s.dtype, device=logits.device).scatter(1, order, s)
    r = _rounded_counts(chosen.sum(0), T, tile, rounding)
    # Per expert, the order of the library's ranking keys (docs/ROUTING.md): every chosen pair before every other,
    # chosen pairs by TC score and the others by p itself (not by S' = p - 1, whose rounding in the float32 score
    # dtype ties every p within 6e-8 of another), NaN first within its class, ties to the lower token. Two stable
    # sorts: by value, then by class.
    value = torch.nan_to_num(torch.where(chosen, tc_dense, probs).detach(), nan=float("inf"))  # p, TC <= 1
    by_value = torch.sort(value, dim=0, descending=True, stable=True).indices
    by_class = torch.sort(chosen.gather(0, by_value).to(torch.uint8), dim=0, descending=True, stable=True).indices
    by_preference = by_value.gather(0, by_class)
    rank = torch.empty_like(by_preference).scatter_(
        0, by_preference, torch.arange(T, device=logits.device).unsqueeze(1).expand(T, E).contiguous())
    keep = rank < r.unsqueeze(0)
    return _Routing(counts=keep.sum(0), keep=keep, dense_scores=torch.where(chosen, tc_dense, probs),
                    per_token=keep.sum(1))


@dataclass
class _Pairs:
    """The routed pairs in pair (token-major) order."""
    token: Tensor     # (P,) int64 (0 for padding entries)
    expert: Tensor    # (P,) int64; E for padding entries (they sort last and go to no rank)
    score: Tensor     # (P,) score dtype (0 for padding entries)
    top_k: int        # > 0: exactly top_k pairs per token (p = t*K + k); 0: `per_token` segments
    per_token: Optional[Tensor] = None  # (T + 1,): pairs per token, then the padding entries


def _pairs(rt: _Routing, T: int, E: int, num_pairs: Optional[int], exact: bool = True) -> _Pairs:
    """The pair list. Token rounding: `num_pairs` entries, the exact count (exact=True) or a static bound whose
    unused entries come last (expert E, score 0, their own final segment)."""
    device = rt.counts.device
    if rt.top_k_order is not None:
        K = rt.top_k_order.shape[1]
        token = torch.arange(T, device=device).repeat_interleave(K, output_size=T * K)
        return _Pairs(token, rt.top_k_order.reshape(-1), rt.top_k_scores.reshape(-1), K)
    nz = torch.nonzero_static(rt.keep, size=num_pairs, fill_value=-1)  # row-major: (token, expert) ascending
    padding = (num_pairs - rt.per_token.sum()).reshape(1)
    per_token = torch.cat([rt.per_token, padding])
    if exact:
        token, expert = nz[:, 0].contiguous(), nz[:, 1].contiguous()
        return _Pairs(token, expert, rt.dense_scores[token, expert], 0, per_token)
    valid = nz[:, 0] >= 0
    token = torch.where(valid, nz[:, 0], 0)
    expert_in_range = torch.where(valid, nz[:, 1], 0)
    score = torch.where(valid, rt.dense_scores[token, expert_in_range], 0)
    return _Pairs(token, torch.where(valid, nz[:, 1], E), score, 0, per_token)


def route(logits: Tensor, *, top_k: int, score: str = "softmax_topk", routing: str = "topk",
          rounding: str = "nearest", tile: int = 128):
    """The library's routing (docs/ROUTING.md) in PyTorch: returns (token_index, expert_index, scores, counts) in
    pair order, scores differentiable w.r.t. the logits; machmoe.moe_from_routing on them computes what machmoe.moe
    computes. Top-K needs no host synchronisation; token rounding synchronises once for its pair count."""
    if not isinstance(logits, Tensor) or logits.dim() != 2:
        _fail("logits", "a (tokens, experts) tensor", getattr(logits, "shape", logits))
    top_k, tile = _check_routing_options(top_k, logits.shape[1], score, routing, rounding, tile)
    rt = _route_dense(logits, top_k, score, routing, rounding, tile)
    num_pairs = None if routing == "topk" else int(rt.counts.sum())
    pairs = _pairs(rt, logits.shape[0], logits.shape[1], num_pairs, exact=True)
    return pairs.token, pairs.expert, pairs.score, rt.counts


def _check_routing_options(top_k, E, score, routing, rounding, tile):
    """Checks the routing options as machmoe.MoE does; returns (top_k, tile) as ints (numpy integers and 0-d
    tensors are accepted, as there)."""
    code(SCORES, score, "score")
    code(ROUNDINGS, rounding, "rounding")
    if routing not in ("topk", "token_rounding"):
        _fail("routing", "'topk' or 'token_rounding'", repr(routing))
    return as_int("top_k", top_k, low=1, high=E, what="(the number of experts)"), tile_option(tile)


def _check_expert_options(activation, weight_layout, activation_memory, swiglu_alpha, swiglu_limit):
    """The experts' options, checked as the library's experts call checks them; returns (swiglu_alpha,
    swiglu_limit) as floats."""
    code(ACTIVATIONS, activation, "activation")
    alpha_limit = activation_parameters(activation, swiglu_alpha, swiglu_limit)
    code(WEIGHT_LAYOUTS, weight_layout, "weight_layout")
    code(ACTIVATION_MEMORY, activation_memory, "activation_memory")
    if weight_layout == "concatenated" and activation not in GLU_ACTIVATIONS:
        _fail("weight_layout", f"'interleaved' for the non-GLU activation {activation!r}", repr(weight_layout))
    return alpha_limit


def _check_expert_call(x, w1, w2, b1, b2, max_pairs_per_row, *, activation, weight_layout, activation_memory,
                       swiglu_alpha, swiglu_limit) -> None:
    """What the library's experts call (moe_from_routing, grouped_experts) checks of its arguments, for a rank that
    has no rows and skips that call. Checked there too so that every rank of an expert-parallel group raises at the
    same point: a rank that skipped the checks would go on to the return all-to-all and wait there for ranks that
    raised (gloo: until the group's timeout; NCCL: for ever)."""
    _check_common(x, w1, w2, b1, b2, activation, weight_layout, max_pairs_per_row,
                  top_k_name="max_experts_per_token", swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
    code(ACTIVATION_MEMORY, activation_memory, "activation_memory")


# ---- row movements with explicit backward ----------------------------------------------------------------------

def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t.to(dtype), but t itself when it already has that dtype. Returning the no-op t.to(t.dtype) from an
    autograd.Function's forward makes torch.compile (dynamo, torch 2.11) drop the Function's gradients."""
    return t if t.dtype == dtype else t.to(dtype)


def _select(src: Tensor, index: Tensor) -> Tensor:
    """src[index]; from an empty src (a rank without pairs, whose empty slots still hold index 0) all zeros."""
    if src.shape[0] == 0:
        return src.new_zeros((index.shape[0],) + tuple(src.shape[1:]))
    return src.index_select(0, index)


def _gather_rows(src: Tensor, index: Tensor, valid: Optional[Tensor]) -> Tensor:
    rows = _select(src, index)
    return rows if valid is None else torch.where(valid.unsqueeze(1), rows, rows.new_zeros(()))


class _RowPermute(torch.autograd.Function):
    """out[i] = src[index[i]] (0 where not valid). `index` must be injective on the valid rows and `inverse` its
    inverse (inverse[j] = i with index[i] = j; invalid where no i reads row j): the backward is then a gather too."""

    @staticmethod
    def forward(ctx, src, index, valid, inverse, inverse_valid):
        ctx.save_for_backward(inverse, inverse_valid)
        ctx.has_inverse_valid = inverse_valid is not None
        return _gather_rows(src, index, valid)

    @staticmethod
    def backward(ctx, grad):
        inverse, inverse_valid = ctx.saved_tensors
        return _gather_rows(grad.contiguous(), inverse, inverse_valid if ctx.has_inverse_valid else None), \
            None, None, None, None


class _DispatchRows(torch.autograd.Function):
    """The send buffer: row j = x[slot_token[j]] (0 for empty slots). A token fills up to K slots, so the backward
    sums each token's slot gradients in pair order (the library's combine_rows without scores: one pass over the
    slots as they are, fp32 sums, no scatter-add)."""

    @staticmethod
    def forward(ctx, x, slot_token, slot_valid, pair_row, token_offsets, top_k):
        ctx.save_for_backward(pair_row, token_offsets)
        ctx.flags = (top_k, x.shape[0])
        return _gather_rows(x, slot_token, slot_valid)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        pair_row, token_offsets = ctx.saved_tensors
        top_k, T = ctx.flags
        dx = torch.ops.machmoe.combine_rows(grad.contiguous(), None, pair_row, token_offsets, top_k, T)
        return dx, None, None, None, None, None


class _CombineRows(torch.autograd.Function):
    """out[t] = sum over t's pairs p of score_p * y_sent[row_of_pair[p]] (-1: a pair that was not sent), by the
    library's combine_rows: one pass over the returned rows as they came back from the exchange (no gathered copy in
    pair order), the products and the sum in fp32, in pair order, rounded once. Its backward is one pass too: each
    row's gradient score_p * grad_out[t] and each pair's score gradient <grad_out[t], y_p> (fp32, fixed order).
    Saves y_sent and the scores only. zero_rows: some rows are read by no pair (capacity mode's empty slots), so
    their gradient starts as zeros."""

    @staticmethod
    def forward(ctx, y_sent, score, row_of_pair, token_offsets, top_k, T, zero_rows):
        ctx.save_for_backward(y_sent, score, row_of_pair, token_offsets)
        ctx.flags = (top_k, zero_rows)
        return torch.ops.machmoe.combine_rows(y_sent, score, row_of_pair, token_offsets, top_k, T)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        y_sent, score, row_of_pair, token_offsets = ctx.saved_tensors
        top_k, zero_rows = ctx.flags
        want_rows, want_scores = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if score is None:  # a plain sum (the default mode's sum over ranks): every score 1
            score = torch.ones(row_of_pair.shape[0], dtype=_acc_dtype(y_sent.dtype), device=y_sent.device)
        grad_rows, grad_scores = torch.ops.machmoe.combine_rows_backward(
            grad_out.contiguous(), y_sent, score, row_of_pair, token_offsets, top_k, want_rows, want_scores,
            zero_rows)
        return (grad_rows if want_rows else None, grad_scores if want_scores else None, None, None, None, None,
                None)


class _SumRowsPerToken(torch.autograd.Function):
    """The default mode's combine: out[t] = the sum of the rows token t sent out, as they came back (row_of_pair: t's
    row per rank, -1 where it sent none), by combine_rows without scores (fp32 sums in a fixed order). Each returned
    row belongs to one token (row_token[row] = t), so the backward is a gather of dO, bitwise what combine_rows'
    backward gives with unit scores, and only the row -> token index is saved, not the returned rows (R x d that
    _CombineRows would keep until the backward)."""

    @staticmethod
    def forward(ctx, rows, row_of_pair, top_k, T, row_token):
        ctx.save_for_backward(row_token)
        return torch.ops.machmoe.combine_rows(rows, None, row_of_pair, None, top_k, T)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        (row_token,) = ctx.saved_tensors
        return _gather_rows(grad_out.contiguous(), row_token, None), None, None, None, None


def _all_to_all(rows: Tensor, out_splits, in_splits, group) -> Tensor:
    """all_to_all_single as a functional collective: a new tensor, not a write into a buffer. torch.compile traces
    it in forward and backward alike (it mis-traces the in-place dist.all_to_all_single inside an autograd.Function
    backward: the write is lost, torch 2.11). Gloo and NCCL both run it; the wait makes it ordinary for what
    follows (on CUDA the wait is a stream dependency, not a host synchronisation)."""
    out = funcol.all_to_all_single(rows.contiguous(), out_splits, in_splits, group if group is not None
                                   else dist.group.WORLD)
    return funcol.wait_tensor(out)


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks that own them; the backward sends the gradients back along the same splits, reversed.

    `anchor` (_anchor) is a tensor that requires grad on every rank of the group while gradients are recorded: it
    puts this node in every rank's graph, so every rank runs the backward collective even where its own rows need no
    gradient (a rank with no tokens, or whose input needs none), and no rank waits for a partner that skipped it."""

    @staticmethod
    def forward(ctx, rows, anchor, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(rows, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None, None


_FROZEN_ROUTER_ANCHORS = {}  # device -> a 0-d leaf that requires grad, read by nothing (_anchor)


def _anchor(router_weight: Tensor, like: Tensor) -> Optional[Tensor]:
    """The anchor of one layer call's exchanges (see _AllToAll): a tensor that requires grad on every rank of the
    group whenever gradients are recorded, so that every rank's graph holds every exchange node. The replicated router
    weight, while it is trained (its requires_grad is the same on every rank). With a frozen router (only the experts
    or other layers trained), a 0-d leaf of this module's, one per device, that nothing reads: without it, a rank
    whose input needs no gradient would skip the backward exchanges its partners run, and they would wait for it
    (NCCL: for ever). The leaf is made outside torch.compile (dynamo cannot make a tensor that requires grad inside a
    graph; a compiled region reads the one an eager call made, as a graph input): a first call that is compiled has
    no anchor with a frozen router, as before the leaf existed."""
    if not torch.is_grad_enabled():
        return None
    if router_weight.requires_grad:
        return router_weight
    anchor = _FROZEN_ROUTER_ANCHORS.get(like.device)
    if anchor is None and not torch.compiler.is_compiling():
        anchor = _FROZEN_ROUTER_ANCHORS[like.device] = torch.zeros((), device=like.device, requires_grad=True)
    return anchor


def _exchange(rows: Tensor, anchor: Optional[Tensor], out_splits, in_splits, group) -> Tensor:
    if dist.get_world_size(group) == 1:
        return rows  # a group of one sends every row to itself: no copy, no collective (and no peer to wait for)
    if anchor is not None and torch.is_grad_enabled() and anchor.requires_grad:
        return _AllToAll.apply(rows, anchor, out_splits, in_splits, group)
    return _AllToAll.apply(rows, None, out_splits, in_splits, group)


class _DispatchExchange(torch.autograd.Function):
    """The default mode's dispatch in one autograd node: the rows (one per token and destination rank) and, with
    them, each pair's (row within its source's block, local expert) and score, whose gradient goes back. One node
    for both exchanges keeps their backward collectives in one fixed order on every rank (two nodes could be run in
    either order by the autograd engine, and NCCL needs the same order everywhere). `anchor` as in _AllToAll."""

    @staticmethod
    def forward(ctx, rows, scores, pair_info, anchor, row_splits, pair_splits, group):
        send_rows, recv_rows = row_splits
        send_pairs, recv_pairs = pair_splits
        ctx.splits, ctx.group = (row_splits, pair_splits), group
        received = _all_to_all(rows, recv_rows, send_rows, group)
        # Scores travel with the int32 pair info, as raw bits (one exchange for both).
        bits = scores.detach().contiguous().view(torch.int32).reshape(scores.shape[0], scores.element_size() // 4)
        info = _all_to_all(torch.cat([pair_info, bits], 1), recv_pairs, send_pairs, group)
        recv_scores = info[:, 2:].contiguous().view(scores.dtype).reshape(-1)
        recv_info = info[:, :2].contiguous()
        ctx.mark_non_differentiable(recv_info)
        return received, recv_scores, recv_info

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows, grad_scores, _):
        (send_rows, recv_rows), (send_pairs, recv_pairs) = ctx.splits
        d_rows = _all_to_all(grad_rows, send_rows, recv_rows, ctx.group)
        d_scores = _all_to_all(grad_scores, send_pairs, recv_pairs, ctx.group)
        return d_rows, d_scores, None, None, None, None, None


# ---- the grouped experts (the pre-dispatched seam) -------------------------------------------------------------

def _empty_rows_linked(x: Tensor, params: Sequence[Optional[Tensor]]) -> Tensor:
    """The expert output for zero rows: (0, d), linked to every parameter so that they get a zero gradient (not
    None, which optimizers and FSDP would treat as 'no gradient this step')."""
    out = x.new_zeros((0, x.shape[1]))
    for p in params:
        if p is not None and p.requires_grad:
            out = out + p.sum() * 0
    if x.requires_grad:
        out = out + x.sum() * 0
    return out


def _run_grouped(x: Tensor, counts: Tensor, w1: Tensor, w2: Tensor, b1: Optional[Tensor], b2: Optional[Tensor],
                 *, activation: str, weight_layout: str, activation_memory: str, zero_padding: bool,
                 swiglu_alpha: Optional[float] = None, swiglu_limit: Optional[float] = None) -> Tensor:
    """machmoe.grouped_experts on rows grouped by expert, where rows beyond sum(counts) are padding (torchtitan's
    aligned dispatch, the capacity mode's empty slots). The padding rows are computed by the last expert (no host
    sync to find where they start) and, with zero_padding, their output is set to zero."""
    P = x.shape[0]
    if P == 0:
        # Nothing to compute (grouped_experts would return (0, d) and zero gradients), but the parameters stay in the
        # graph so that they get zero gradients rather than None.
        _check_expert_call(x, w1, w2, b1, b2, 1, activation=activation, weight_layout=weight_layout,
                           activation_memory=activation_memory, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
        return _empty_rows_linked(x, (w1, w2, b1, b2))
    counts = counts.to(device=x.device, dtype=torch.int64)
    real = counts.sum()
    padded = counts.clone()
    padded[-1] += P - real
    y = grouped_experts(x, padded, w1, w2, b1, b2, activation=activation, weight_layout=weight_layout,
                        activation_memory=activation_memory, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
    if zero_padding:
        y = torch.where((torch.arange(P, device=x.device) < real).unsqueeze(1), y, y.new_zeros(()))
    return y


def _run_indexed(x: Tensor, expert_index: Tensor, w1: Tensor, w2: Tensor, b1: Optional[Tensor],
                 b2: Optional[Tensor], *, activation: str, weight_layout: str, activation_memory: str,
                 swiglu_alpha: Optional[float] = None, swiglu_limit: Optional[float] = None) -> Tensor:
    """Row i of x through expert expert_index[i]'s MLP, rows in any order: the layer with one (row, expert, 1.0)
    triple per row, whose up-projection gathers the rows by expert itself and whose aggregation puts the results
    back in row order. The expert-parallel layer calls its experts so on the rows as they arrive, which spares the
    two permutations of the grouped form (to expert order and back, and both again in backward). Within an expert
    the rows keep their order, so the results equal the grouped form's bitwise. Rows whose expert is out of range
    (GPU only: capacity mode's empty slots) are skipped and get zeros."""
    R = x.shape[0]
    if R == 0:
        _check_expert_call(x, w1, w2, b1, b2, 1, activation=activation, weight_layout=weight_layout,
                           activation_memory=activation_memory, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
        return _empty_rows_linked(x, (w1, w2, b1, b2))
    index_dtype = torch.int32 if R < 2**31 else torch.int64
    token_index = torch.arange(R, device=x.device, dtype=index_dtype)
    scores = torch.ones(R, device=x.device, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    y, _ = moe_from_routing(x, w1, w2, token_index, expert_index.to(index_dtype), scores, b1, b2,
                            max_experts_per_token=1, activation=activation, weight_layout=weight_layout,
                            activation_memory=activation_memory, swiglu_alpha=swiglu_alpha,
                            swiglu_limit=swiglu_limit)
    return y


def _run_pairs(x: Tensor, token_index: Tensor, expert_index: Tensor, scores: Tensor, max_pairs_per_row: int,
               w1: Tensor, w2: Tensor, b1: Optional[Tensor], b2: Optional[Tensor], *, activation: str,
               weight_layout: str, activation_memory: str, swiglu_alpha: Optional[float] = None,
               swiglu_limit: Optional[float] = None) -> Tensor:
    """out[i] = sum over the pairs p with token_index[p] = i of scores[p] * expert_{expert_index[p]}(x[i]): the
    library's layer on caller routing (gather in the up-projection, the scores' products and the per-row sum in its
    aggregation), rows of x as its tokens. The expert-parallel layer's receiving side: one row per (token, rank), its
    pairs on this rank's experts, the weighted partial sum sent back. token_index ascending."""
    R = x.shape[0]
    # The library's score dtype for x (the routing's scores may be float64 where FSDP2 runs the experts in float32).
    scores = _cast(scores, _acc_dtype(x.dtype))
    if R == 0 or token_index.shape[0] == 0:
        _check_expert_call(x, w1, w2, b1, b2, max_pairs_per_row, activation=activation, weight_layout=weight_layout,
                           activation_memory=activation_memory, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
        out = _empty_rows_linked(x, (w1, w2, b1, b2, scores))
        return out if R == 0 else out.new_zeros((R, x.shape[1])) + out.sum() * 0
    index_dtype = torch.int32 if R < 2**31 else torch.int64
    y, _ = moe_from_routing(x, w1, w2, token_index.to(index_dtype).contiguous(),
                            expert_index.to(index_dtype).contiguous(), scores.contiguous(), b1, b2,
                            max_experts_per_token=max_pairs_per_row, activation=activation,
                            weight_layout=weight_layout, activation_memory=activation_memory,
                            swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
    return y


def _local(t: Optional[Tensor]) -> Optional[Tensor]:
    """Plain tensors from DTensor parameters (FSDP2 gathers them before forward; torchtitan's EP plan leaves them
    as DTensors sharded on the expert dimension)."""
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


def _local_experts(w: Tensor):
    """(the tensor holding this rank's rows of w, the index along dim 0 of its first row): w itself and 0 for a plain
    tensor; for a DTensor (experts sharded by FSDP2 or torchtitan's plan) its local shard and where that starts.
    Indexing a sharded DTensor (w[i]) would give a replicated copy, and writes into it would be lost."""
    if not hasattr(w, "to_local"):
        return w, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)
    local = w.to_local()
    if tuple(local.shape) != tuple(shape) or tuple(shape[1:]) != tuple(w.shape[1:]) or any(offset[1:]):
        raise NotImplementedError(f"machmoe: GroupedExperts.reset_parameters(seed=...) on a DTensor sharded other "
                                  f"than along the expert dimension (placements {w.placements})")
    return local, offset[0]


class _DivideGrad(torch.autograd.Function):
    """The identity, whose backward divides the gradient by `factor` (shard_experts_fsdp2's 1 / ep_size)."""

    @staticmethod
    def forward(ctx, t, factor):
        ctx.factor = factor
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.factor, None


class ExpertPairs:
    """The pairs form of GroupedExperts.forward: (token_index, expert_index, scores) of P pairs, token_index
    ascending into the rows of x, at most max_pairs_per_row pairs per row. A plain class on purpose, not a tuple,
    dict or dataclass: FSDP2's mixed precision (cast_forward_inputs) casts every floating-point tensor it can reach
    in a module's forward arguments to the parameters' dtype, which would round float32 scores to bf16."""
    __slots__ = ("token_index", "expert_index", "scores", "max_pairs_per_row")

    def __init__(self, token_index: Tensor, expert_index: Tensor, scores: Tensor, max_pairs_per_row: int):
        self.token_index, self.expert_index, self.scores = token_index, expert_index, scores
        self.max_pairs_per_row = max_pairs_per_row


class GroupedExperts(nn.Module):
    """E experts in machmoe's layout (w1 (E, 2n | n, d), w2 (E, d, n), b1, b2 — as machmoe.MoE), called like
    torchtitan's GroupedExperts: forward(x, num_tokens_per_expert) with rows of x grouped by expert. Rows beyond
    sum(num_tokens_per_expert) are padding and return zeros; the sum must not exceed the rows (checked on the CPU,
    ValueError; not on the GPU, where it would need a host synchronisation). No host synchronisation.
    grad_divide_factor (1.0): what the weights' gradients are divided by (shard_experts_fsdp2 sets it)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, activation: str = "swiglu",
                 bias: bool = False, weight_layout: str = "interleaved", activation_memory: str = "preact",
                 device=None, dtype=None, *, swiglu_alpha: Optional[float] = None,
                 swiglu_limit: Optional[float] = None, _defer_init: bool = False):
        super().__init__()
        # As machmoe.MoE: sizes as ints (numpy integers and 0-d tensors too), the options by name.
        hidden_size = as_int("hidden_size", hidden_size, low=1)
        intermediate_size = as_int("intermediate_size", intermediate_size, low=1)
        num_experts = as_int("num_experts", num_experts, low=1)
        if not isinstance(bias, bool):  # bias="no" would create biases
            raise TypeError(f"machmoe: argument 'bias': expected a bool, got {type_name(bias)}")
        alpha_limit = _check_expert_options(activation, weight_layout, activation_memory, swiglu_alpha, swiglu_limit)
        self.swiglu_alpha, self.swiglu_limit = alpha_limit if activation == "gptoss_swiglu" else (None, None)
        self.hidden_size, self.intermediate_size, self.num_experts = hidden_size, intermediate_size, num_experts
        self.activation, self.weight_layout, self.activation_memory = activation, weight_layout, activation_memory
        rows = 2 * intermediate_size if activation in GLU_ACTIVATIONS else intermediate_size
        kw = dict(device=device, dtype=dtype)
        self.w1 = nn.Parameter(torch.empty(num_experts, rows, hidden_size, **kw))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **kw))
        self.b1 = nn.Parameter(torch.empty(num_experts, rows, **kw)) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden_size, **kw)) if bias else None
        # What the weights' gradients are divided by (shard_experts_fsdp2 sets ep_size where FSDP2 does not divide
        # them). Applied in forward rather than by hooks on the parameters, which to_empty (FSDP2's meta-device
        # initialisation) would replace along with the parameters.
        self.grad_divide_factor = 1.0
        if not _defer_init:
            self.reset_parameters()

    def extra_repr(self) -> str:
        return _options_repr(
            self, GroupedExperts,
            [("hidden_size", self.hidden_size), ("intermediate_size", self.intermediate_size),
             ("num_experts", self.num_experts), ("activation", self.activation), ("bias", self.b1 is not None)],
            _EXPERT_OPTIONS, [("grad_divide_factor", getattr(self, "grad_divide_factor", 1.0), 1.0)])

    def reset_parameters(self, seed: Optional[int] = None, first_expert: int = 0) -> None:
        """machmoe.MoE's initialisation. With `seed`, expert i is drawn from its own generator seeded with
        seed + first_expert + i, so an expert's initial weights do not depend on how experts are split over ranks."""
        if self.w1.device.type == "meta":
            return
        with torch.no_grad():
            if self.b1 is not None:
                self.b1.zero_()
                self.b2.zero_()
            if seed is None:
                self.w1.normal_(0.0, 1.0 / math.sqrt(self.hidden_size))
                self.w2.normal_(0.0, 1.0 / math.sqrt(self.intermediate_size))
                return
            # Sharded experts (FSDP2 after to_empty): each rank draws the experts it holds, into its shard.
            (w1, first1), (w2, first2) = _local_experts(self.w1), _local_experts(self.w2)
            if first1 != first2 or w1.shape[0] != w2.shape[0]:
                raise NotImplementedError("machmoe: GroupedExperts.reset_parameters(seed=...) with w1 and w2 "
                                          "sharded differently along the expert dimension")
            for j in range(w1.shape[0]):
                g = torch.Generator(device=w1.device).manual_seed(seed + first_expert + first1 + j)
                w1[j].normal_(0.0, 1.0 / math.sqrt(self.hidden_size), generator=g)
                w2[j].normal_(0.0, 1.0 / math.sqrt(self.intermediate_size), generator=g)

    def _weights(self):
        """w1, w2, b1, b2 as the call uses them: plain tensors, their gradients divided by grad_divide_factor."""
        factor = getattr(self, "grad_divide_factor", 1.0)  # (a module pickled before the attribute existed)
        out = []
        for w in (self.w1, self.w2, self.b1, self.b2):
            w = _local(w)
            if factor != 1.0 and w is not None and w.requires_grad and torch.is_grad_enabled():
                w = _DivideGrad.apply(w, factor)
            out.append(w)
        return out

    def forward(self, x: Tensor, num_tokens_per_expert: Optional[Tensor] = None, *, zero_padding: bool = True,
                expert_index: Optional[Tensor] = None, pairs: Optional[ExpertPairs] = None) -> Tensor:
        """zero_padding=False leaves the padding rows' output unspecified (finite), for callers that discard it.
        With expert_index (rows,) instead of num_tokens_per_expert, the rows may come in any order: row i goes
        through expert expert_index[i] (capacity mode of ExpertParallelMoE, on the rows as they arrive).
        With pairs=ExpertPairs(token_index, expert_index, scores, max_pairs_per_row) instead — token_index
        ascending, at most max_pairs_per_row pairs per row — row i of the result is the sum over its pairs p of
        scores[p] * expert_{expert_index[p]}(x[i]), differentiable w.r.t. the scores too (ExpertParallelMoE's
        default mode: one row per token and rank, its pairs on this rank's experts). The scores are used in the
        library's score dtype for x (float32; float64 for float64 x)."""
        weights = self._weights()
        # Under torch.autocast, x in autocast's dtype and float32 weights passed as they are, as master weights
        # (functional._autocast_layer, as machmoe.MoE passes its parameters): the operator casts them for the call,
        # nothing holds a bf16 copy of them from the forward to the backward, and their gradients come out of the
        # kernels in float32. Cast here, before the checks of an empty call compare x's dtype with the weights'.
        x, *weights = _under_autocast(x, *weights, master=True)
        if pairs is not None:
            if num_tokens_per_expert is not None or expert_index is not None:
                _fail("pairs", "no num_tokens_per_expert or expert_index beside it", "both")
            if not isinstance(pairs, ExpertPairs):
                raise TypeError(f"machmoe: argument 'pairs': expected a machmoe.parallel.ExpertPairs, got "
                                f"{type(pairs).__name__}")
            token_index, expert_index, scores = pairs.token_index, pairs.expert_index, pairs.scores
            max_pairs_per_row = pairs.max_pairs_per_row
            max_pairs_per_row = _check_pairs_call(x, token_index, expert_index, scores, max_pairs_per_row,
                                                  self.num_experts, self.hidden_size)
            return _run_pairs(x, token_index, expert_index, scores, max_pairs_per_row, *weights,
                              activation=self.activation, weight_layout=self.weight_layout,
                              activation_memory=self.activation_memory,
                              swiglu_alpha=getattr(self, "swiglu_alpha", None),
                              swiglu_limit=getattr(self, "swiglu_limit", None))
        if expert_index is not None:
            if num_tokens_per_expert is not None:
                _fail("num_tokens_per_expert", "None when expert_index is given", "a tensor")
            _check_indexed_call(x, expert_index, self.hidden_size)
            return _run_indexed(x, expert_index, *weights, activation=self.activation,
                                weight_layout=self.weight_layout, activation_memory=self.activation_memory,
                                swiglu_alpha=getattr(self, "swiglu_alpha", None),
                                swiglu_limit=getattr(self, "swiglu_limit", None))
        _check_grouped_call(x, num_tokens_per_expert, self.num_experts, self.hidden_size)
        return _run_grouped(x, num_tokens_per_expert, *weights, activation=self.activation,
                            weight_layout=self.weight_layout, activation_memory=self.activation_memory,
                            zero_padding=zero_padding,
                            swiglu_alpha=getattr(self, "swiglu_alpha", None),
                            swiglu_limit=getattr(self, "swiglu_limit", None))


def _check_indexed_call(x, expert_index, hidden):
    if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != hidden:
        _fail("x", f"a (rows, {hidden}) tensor", getattr(x, "shape", type(x).__name__))
    if not isinstance(expert_index, Tensor) or tuple(expert_index.shape) != (x.shape[0],):
        _fail("expert_index", f"a ({x.shape[0]},) tensor (one expert per row of x)",
              getattr(expert_index, "shape", type(expert_index).__name__))
    if expert_index.dtype not in (torch.int32, torch.int64):
        _fail("expert_index", "integer indices (dtype int32 or int64)", expert_index.dtype)
    if expert_index.device != x.device:
        _fail("expert_index", f"a tensor on {x.device} (the device of x)", f"a tensor on {expert_index.device}")


def _check_pairs_call(x, token_index, expert_index, scores, max_pairs_per_row, num_experts, hidden):
    if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != hidden:
        _fail("x", f"a (rows, {hidden}) tensor", getattr(x, "shape", type(x).__name__))
    for name, t in (("token_index", token_index), ("expert_index", expert_index), ("scores", scores)):
        if not isinstance(t, Tensor) or t.dim() != 1:
            _fail(name, "a 1-D tensor (one entry per pair; token_index, expert_index and scores go together)",
                  getattr(t, "shape", type(t).__name__))
        if t.device != x.device:
            _fail(name, f"a tensor on {x.device} (the device of x)", f"a tensor on {t.device}")
    P = token_index.shape[0]
    for name, t in (("expert_index", expert_index), ("scores", scores)):
        if t.shape[0] != P:
            _fail(name, f"({P},) entries (as token_index)", f"shape {tuple(t.shape)}")
    for name, t in (("token_index", token_index), ("expert_index", expert_index)):
        if t.dtype not in (torch.int32, torch.int64):
            _fail(name, "integer indices (dtype int32 or int64)", t.dtype)
    # An int, a numpy integer or a 0-d integer tensor, as every other integer argument (returned as an int).
    return as_int("max_pairs_per_row", max_pairs_per_row, low=1, high=num_experts, what="(the number of experts)")


def _check_grouped_call(x, counts, num_experts, hidden):
    if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != hidden:
        _fail("x", f"a (rows, {hidden}) tensor grouped by expert", getattr(x, "shape", type(x).__name__))
    if not isinstance(counts, Tensor) or tuple(counts.shape) != (num_experts,):
        _fail("num_tokens_per_expert", f"a ({num_experts},) tensor", getattr(counts, "shape", type(counts).__name__))
    if counts.device != x.device:
        _fail("num_tokens_per_expert", f"a tensor on {x.device} (the device of x)", f"a tensor on {counts.device}")
    if counts.device.type == "cpu" and not torch.compiler.is_compiling():
        # On the CPU the values cost no synchronisation to read. (On a GPU they are not read: rows past the counts'
        # sum are taken as padding, and counts summing to more than the rows are the caller's contract.)
        c = counts.detach().to(torch.float64)
        if bool((c < 0).any()) or float(c.sum()) > x.shape[0]:
            shown = counts.tolist()
            shown = f"{shown[:8]}{' ...' if len(shown) > 8 else ''}"
            _fail("num_tokens_per_expert", f"non-negative counts summing to at most {x.shape[0]} (the rows of x; rows "
                  "beyond the sum are padding)", f"{shown}, summing to {float(c.sum()):g}")


class TorchTitanGroupedExperts(nn.Module):
    """Drop-in for torchtitan's GroupedExperts before 0.3 (torchtitan/models/moe/moe.py; for 0.3's Config-built
    GroupedExperts, whose weights are w1_EFD/w2_EDF/w3_EFD, see torchtitan_experts_forward): the same constructor,
    parameters w1 (E, hidden_dim, dim) (gate), w2 (E, dim, hidden_dim) (down), w3 (E, hidden_dim, dim) (up), the same
    forward(x, num_tokens_per_expert) (rows grouped by expert, padding rows beyond the counts return zeros, counts
    may be float as torchtitan's histc gives them) and init_weights(init_std). SwiGLU experts on machmoe's kernels.

    machmoe's kernels read w1 and w3 in place as the two halves of one weight where w3 lies after w1 in memory
    (torchtitan_experts_forward); elsewhere each forward concatenates [w1; w3] (a copy of 2*E*hidden_dim*dim
    elements, whose gradient autograd splits back), and says so once."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True, device=None,
                 dtype=None):
        super().__init__()
        self.num_experts, self.dim, self.hidden_dim = num_experts, dim, hidden_dim
        self.use_grouped_mm = use_grouped_mm  # accepted for signature compatibility; machmoe always groups
        kw = dict(device=device, dtype=dtype)
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **kw))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim, **kw))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **kw))

    def extra_repr(self) -> str:
        return _options_repr(self, TorchTitanGroupedExperts,
                             [("dim", self.dim), ("hidden_dim", self.hidden_dim), ("num_experts", self.num_experts)])

    def init_weights(self, init_std: float) -> None:
        # Sampled in float32 and then rounded, as torchtitan's own trunc_normal_ does: in bf16 the inverse-erf step
        # of trunc_normal_ meets uniform samples rounded to +-1, and about 0.4 % of the weights came out at +-2.
        with torch.no_grad():
            for w, std in ((self.w1, 0.02), (self.w2, init_std), (self.w3, init_std)):
                if w.dtype in (torch.float32, torch.float64):
                    nn.init.trunc_normal_(w, mean=0.0, std=std)
                else:
                    w.copy_(nn.init.trunc_normal_(w.float(), mean=0.0, std=std))

    def forward(self, x: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
        return torchtitan_experts_forward(self, x, num_tokens_per_expert)


# torchtitan's GroupedExperts names its weights w1/w2/w3 up to 0.2 and w1_EFD/w2_EDF/w3_EFD (a Config-built Module)
# from 0.3 on; the math is the same: silu(x w1^T) * (x w3^T), then w2.
_TORCHTITAN_WEIGHT_NAMES = (("w1", "w2", "w3"), ("w1_EFD", "w2_EDF", "w3_EFD"))


def torchtitan_experts_forward(experts: nn.Module, x: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
    """The forward of torchtitan's GroupedExperts on machmoe's kernels, for any module holding its weights: gate w1
    (E, hidden, dim), down w2 (E, dim, hidden), up w3 (E, hidden, dim), named w1/w2/w3 (torchtitan up to 0.2, and
    TorchTitanGroupedExperts) or w1_EFD/w2_EDF/w3_EFD (torchtitan 0.3). x: rows grouped by expert; rows beyond the
    counts (alignment padding) return zeros; float counts (torchtitan's histc) are accepted; DTensor weights are used
    through to_local(). With torchtitan 0.3, whose GroupedExperts is built from a Config (its initialisation and
    sharding stay as they are), use it as the class's forward:

        from torchtitan.models.common.moe import GroupedExperts
        GroupedExperts.forward = machmoe.parallel.torchtitan_experts_forward

    Where w3 lies after w1 in memory by a multiple of 16 bytes, with the same contiguous layout, the layer reads the
    two in place as the halves of one (E, 2, hidden, dim) view (_join_gate_up), and their gradients come back as two
    contiguous halves of one buffer: nothing is copied. Otherwise each call concatenates [w1; w3] (a copy of the
    gate/up weights, whose gradient autograd splits back), and says so once per process. Either way the backward
    joins w1 and w3 again from the parameters as they are then (_saved_as_parts): no copy lives until the backward,
    and FSDP2 may free and gather them in between.

    Like torchtitan's grouped_mm path, which computes in bf16 and returns the result in x's dtype, an x whose dtype
    differs from the weights' is cast to theirs and the result back to x's; an x without unit stride along dim is
    copied first. On a GPU, float32 weights with a bf16 or fp16 x (what torch.autocast hands over) are master
    weights instead: the layer computes in x's dtype without a cast of x and gives float32 gradients."""
    for names in _TORCHTITAN_WEIGHT_NAMES:
        if all(isinstance(getattr(experts, n, None), Tensor) for n in names):
            w1, w2, w3 = (_local(getattr(experts, n)) for n in names)
            break
    else:
        raise TypeError("machmoe: torchtitan_experts_forward: expected a module with torchtitan's GroupedExperts "
                        "weights (w1, w2, w3, or w1_EFD, w2_EDF, w3_EFD), got "
                        f"{type(experts).__name__} with parameters {[n for n, _ in experts.named_parameters()]}")
    if w1.dim() != 3 or w2.dim() != 3 or w3.shape != w1.shape or tuple(w2.shape) != (w1.shape[0], w1.shape[2],
                                                                                      w1.shape[1]):
        _fail("experts", "gate and up weights (E, hidden, dim) and a down weight (E, dim, hidden)",
              f"{tuple(w1.shape)}, {tuple(w3.shape)} and {tuple(w2.shape)}")
    if not (w1.dtype == w2.dtype == w3.dtype):
        _fail("experts", "gate, up and down weights of one dtype", f"{w1.dtype}, {w3.dtype} and {w2.dtype}")
    _check_grouped_call(x, num_tokens_per_expert, w1.shape[0], w1.shape[2])
    master = _is_master(w1, x.dtype) and x.dtype in _dtypes_for(x.device)  # (the CPU's reference: float32 x)
    if x.is_floating_point() and x.dtype != w1.dtype and not master:
        rows = x.to(w1.dtype)
    else:
        rows = x  # (an integer x is refused below, in grouped_experts' terms)
    if rows.stride(-1) != 1 or (rows.stride(0) < rows.shape[1] and rows.shape[0] > 1):
        rows = rows.contiguous()
    gate_up = _join_gate_up(w1, w3)  # machmoe's "concatenated" layout: w1 and w3 read in place where they allow
    with _saved_as_parts(gate_up, w1, w3):
        out = _run_grouped(rows, num_tokens_per_expert, gate_up, w2, None, None, activation="swiglu",
                           weight_layout="concatenated", activation_memory="preact", zero_padding=True)
    return out if out.dtype == x.dtype or not x.is_floating_point() else out.to(x.dtype)


def _halves_viewable(gate: Tensor, up: Tensor) -> bool:
    """Whether the library can read gate and up weights (E, n, d) in place as the halves of one (E, 2, n, d) view
    (torch.ops.machmoe._w1_halves_view): the same shape, strides, dtype and device, each contiguous, up's data after
    gate's by a positive multiple of 16 bytes below 2^40 (the GPU kernels' tensor maps take such strides only; two
    allocations of the caching allocator in a row, or w1 and w3 gathered by FSDP2 in that order, give one).
    Not under torch.compile, which traces the concatenation instead (the view's operator has no fake kernel)."""
    if torch.compiler.is_compiling() or gate.device.type not in ("cpu", "cuda"):
        return False
    if gate.shape != up.shape or gate.stride() != up.stride() or gate.dtype != up.dtype or gate.device != up.device:
        return False
    if not (gate.is_contiguous() and up.is_contiguous()) or gate.numel() == 0:
        return False
    apart = up.data_ptr() - gate.data_ptr()
    return 0 < apart < 2**40 and apart % 16 == 0  # (a tensor map's strides stay below 2^40 bytes)


_CONCATENATION_NOTED = set()


def _note_concatenation(gate: Tensor, up: Tensor) -> None:
    """The slow path, said once per process and device type: each call copies [w1; w3]."""
    if torch.compiler.is_compiling() or gate.device.type in _CONCATENATION_NOTED or gate.device.type == "meta":
        return
    _CONCATENATION_NOTED.add(gate.device.type)
    apart = up.data_ptr() - gate.data_ptr()
    warnings.warn(
        f"machmoe: the torchtitan experts' gate and up weights (w1 {tuple(gate.shape)} strides {gate.stride()}, w3 "
        f"strides {up.stride()}, w3 {apart} bytes after w1) cannot be read in place as one view (they need the same "
        "contiguous layout, w3 after w1 by a multiple of 16 bytes), so each forward and backward concatenates them "
        "(a copy of 2 * E * hidden * dim elements, and a split copy of their gradient). Said once per process.",
        stacklevel=3)


class _JoinGateUp(torch.autograd.Function):
    """[w1; w3] as machmoe's concatenated layout without a copy: the (E, 2, n, d) view of both
    (_w1_halves_view). The layer's W1 gradient arrives laid out (2, E, n, d), so each half's gradient is contiguous
    and autograd hands it to w1 and w3 as it is; a gradient of the joined (E, 2n, d) form (a backward whose saved
    weights were concatenated, _saved_as_parts) is split."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.n = gate.shape[1]
        return torch.ops.machmoe._w1_halves_view(gate, up)

    @staticmethod
    def backward(ctx, grad):
        if grad.dim() == 3:
            return grad[:, :ctx.n], grad[:, ctx.n:]
        return grad[:, 0], grad[:, 1]


def _join_gate_up(gate: Tensor, up: Tensor) -> Tensor:
    """The gate and up weights (E, n, d) as the layer's W1 in the concatenated layout: a view of both where they
    allow it (_halves_viewable), else their concatenation (E, 2n, d), a copy, which is said once."""
    if _halves_viewable(gate, up):
        return _JoinGateUp.apply(gate, up)
    _note_concatenation(gate, up)
    return torch.cat([gate, up], dim=1)  # rows [0, h) gate, [h, 2h) up


def _rejoin(parts, halves: bool) -> Tensor:
    """The saved W1 again, from its parts as they are now (their storage may have moved since the forward: FSDP2
    frees and gathers it again), in the forward's form, whose shape autograd holds W1's gradient to: with `halves`
    (E, 2, n, d), the view where the parts allow it now, else a stacked copy; otherwise the concatenation
    (E, 2n, d). No autograd history."""
    gate, up = parts
    if not halves:
        return torch.cat(parts, dim=1)
    if _halves_viewable(gate, up):
        return torch.ops.machmoe._w1_halves_view(gate, up)
    return torch.stack(parts, dim=1)


class _Parts:
    """What _saved_as_parts keeps for the concatenation: its parts (detached), their versions, and whether it was
    the (E, 2, n, d) view of them (_join_gate_up) rather than a concatenation."""
    __slots__ = ("parts", "versions", "halves")

    def __init__(self, parts, halves: bool):
        self.parts = parts
        self.versions = tuple(p._version for p in parts)
        self.halves = halves


def _check_version(t: Tensor, version: int) -> None:
    # Saved-tensor hooks turn off autograd's own check (it cannot see through a hook), so the hooks make it.
    if t._version != version:
        raise RuntimeError("one of the variables needed for gradient computation has been modified by an inplace "
                           f"operation: [{t.dtype}, {tuple(t.shape)}] is at version {t._version}; expected version "
                           f"{version} instead (machmoe: a tensor saved by the torchtitan experts' forward)")


@contextlib.contextmanager
def _saved_as_parts(cat: Tensor, *parts: Tensor):
    """While the layer's forward runs: the concatenation `cat` of `parts` (along dim 1), if the layer saves it for
    its backward, is saved as the parts and concatenated again when the backward unpacks it. Otherwise the copy
    would stay alive from the forward to the backward: E * 2 * hidden * dim elements per layer (738 MB in bf16 at
    E = 64, hidden = 1408, dim = 2048), and under FSDP2 an unsharded copy of weights that the module resharded
    after its forward. The price is one more concatenation in the backward. Every other saved tensor is kept as
    it is, with autograd's check for in-place changes made here. So a part changed in place between the forward and
    the backward is an error, as for any other saved tensor (the copy used to hide that change). Not done under
    torch.compile, without grad, or inside another saved-tensor hook (activation checkpointing, offloading: those
    decide what is kept)."""
    if (not torch.is_grad_enabled() or torch.compiler.is_compiling() or
            not torch._C._autograd._saved_tensors_hooks_is_enabled() or
            torch._C._autograd._top_saved_tensors_default_hooks(False) is not None):
        yield
        return
    key = (cat.data_ptr(), cat.shape, cat.stride(), cat.dtype, cat.device)
    halves = cat.dim() == 4  # (not `cat` itself inside the hooks: their closures would keep the copy alive)
    parts = tuple(p.detach() for p in parts)  # no autograd history is kept through the hooks

    def pack(t: Tensor):
        # t may be the saved tensor itself or an alias of it: compared by what it points at. Kept detached (the same
        # storage and version counter): an op's output saved with its grad_fn would close a reference cycle through
        # the graph, which Python's collector cannot see.
        if (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device) == key:
            return _Parts(parts, halves)
        return t.detach(), t._version

    def unpack(packed):
        if isinstance(packed, _Parts):
            for p, v in zip(packed.parts, packed.versions):
                _check_version(p, v)
            return _rejoin(packed.parts, packed.halves)
        t, version = packed
        _check_version(t, version)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


# ---- the expert-parallel layer ---------------------------------------------------------------------------------

def _group_size_rank(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("machmoe: expert parallelism needs an initialised torch.distributed process group "
                           "(call torch.distributed.init_process_group first)")
    rank = dist.get_rank(group)
    if rank < 0:  # get_world_size answers -1 there, which would pass the divisibility check and fail later, obscurely
        _fail("group", "a process group this rank belongs to", f"a group without global rank {dist.get_rank()}")
    return dist.get_world_size(group), rank


def _check_divisible(num_experts: int, ep_size: int) -> None:
    if num_experts % ep_size:
        _fail("num_experts", f"a multiple of the expert-parallel group size {ep_size} (each rank owns "
              "num_experts / ep_size experts)", num_experts)


def _check_capacity_arg(capacity) -> Optional[int]:
    """capacity as None or an int >= 1 (numpy integers and 0-d tensors accepted, as for the other sizes)."""
    if capacity is None:
        return None
    return as_int("capacity", capacity, low=1, what="or None (rows per source/destination rank pair)")


@dataclass
class _Plan:
    """Everything the exchange needs after routing. A *slot* is a row of the send buffer: in the default mode the
    pairs in expert order; in capacity mode ep_size blocks of `capacity` rows, block r for rank r."""
    pairs: _Pairs
    slot_token: Tensor                  # slot -> token (dispatch gather)
    slot_valid: Optional[Tensor]        # capacity mode: slots that hold a row
    send_splits: Optional[list]         # rows to each rank (host ints); None in capacity mode (equal blocks)
    recv_splits: Optional[list]
    recv_to_grouped: Optional[Tensor]   # received row -> row in expert-grouped order (None without group_rows)
    grouped_to_recv: Optional[Tensor]
    tokens_per_expert: Tensor           # (E_local,) rows received per local expert
    dropped_rows: Optional[Tensor]      # capacity mode: this rank's pairs that were not sent (0-d int64)
    # Received row -> local expert, for the experts called on the rows in the order they arrived (the layer's own
    # forward). Capacity mode's empty slots: E_local on the GPU (an out-of-range expert: the GPU layer skips the
    # row, so the slot costs no expert work), the last local expert where out-of-range experts are errors (the CPU,
    # and the GPU with index checking on); their outputs are discarded by the sender either way.
    recv_expert: Optional[Tensor] = None
    # The combine's indices (int32): pair -> row of the returned send buffer (-1: not sent), and with token
    # rounding each token's first pair (T + 1 offsets; the padding entries after the last token's are ignored).
    pair_row: Optional[Tensor] = None
    token_offsets: Optional[Tensor] = None


def _plan(rt: _Routing, T: int, E: int, ep_size: int, capacity: Optional[int], group, top_k: int,
          tile: int, group_rows: bool = True) -> _Plan:
    """group_rows: the permutations between the received rows and expert order (the staged API's grouped rows);
    without it they are None and only recv_expert is built (the layer's forward)."""
    device = rt.counts.device
    W, El = ep_size, E // ep_size
    per_dest_expert = rt.counts.view(W, El)
    if capacity is None:
        sent = rt.counts
        dropped = None
    else:
        # A destination takes the first `capacity` of its rows in expert order; the rest are not sent.
        before = per_dest_expert.cumsum(1) - per_dest_expert
        sent = torch.minimum(torch.clamp(capacity - before, min=0), per_dest_expert).reshape(E)
        dropped = rt.counts.sum() - sent.sum()
    # Rows each source rank sends to each of my local experts: recv[s, e].
    recv = (sent if W == 1 else _all_to_all(sent, None, None, group)).view(W, El)
    if capacity is None:
        # THE host synchronisation of the layer: the row all-to-all takes its split sizes as host integers.
        sizes = torch.cat([per_dest_expert.sum(1), recv.sum(1)]).tolist()
        send_splits, recv_splits = sizes[:W], sizes[W:]
        pairs = _pairs(rt, T, E, sum(send_splits), exact=True)
        received = sum(recv_splits)
    else:
        send_splits = recv_splits = None
        # Static bound on the pairs of token rounding: each expert adds at most tile - 1 padded pairs.
        pairs = _pairs(rt, T, E, min(T * E, T * top_k + E * (tile - 1)), exact=False)
        received = W * capacity
    P = pairs.token.shape[0]
    pair = torch.arange(P, device=device)

    # Pairs in expert order; within an expert, ascending pair order (stable sort).
    by_expert = torch.sort(pairs.expert, stable=True).indices
    if capacity is None:
        slot_pair, slot_valid, pair_valid = by_expert, None, None
        pair_slot = _inverse_of(by_expert)
    else:
        dest = torch.div(pairs.expert.index_select(0, by_expert), El, rounding_mode="floor")  # W: padding entry
        dest_rows = torch.cat([per_dest_expert.sum(1), (P - rt.counts.sum()).reshape(1)])
        position = pair - (dest_rows.cumsum(0) - dest_rows).index_select(0, dest)
        sent_sorted = (dest < W) & (position < capacity)
        slots = W * capacity
        slot = torch.where(sent_sorted, dest * capacity + position, slots)  # index `slots`: not sent, discarded
        # Written with a trailing discard row; duplicate writes go only there.
        slot_pair = torch.zeros(slots + 1, dtype=torch.int64, device=device).scatter_(0, slot, by_expert)[:slots]
        slot_valid = torch.zeros(slots + 1, dtype=torch.bool, device=device).scatter_(0, slot, sent_sorted)[:slots]
        pair_slot = torch.empty_like(by_expert).scatter_(0, by_expert, torch.clamp(slot, max=slots - 1))
        pair_valid = torch.empty_like(sent_sorted).scatter_(0, by_expert, sent_sorted)
    slot_token = _select(pairs.token, slot_pair)

    # Received rows arrive source-major (source s, then local expert e); grouped, they are expert-major. In capacity
    # mode each source block ends with its empty slots; they are grouped last (padding rows).
    padding = (capacity - recv.sum(1)) if capacity is not None else torch.zeros_like(recv[:, 0])
    segments = torch.cat([recv, padding.unsqueeze(1)], dim=1)                  # (W, El + 1), source-major
    seg_sizes = segments.reshape(-1)
    seg_of_row = torch.repeat_interleave(torch.arange(W * (El + 1), device=device), seg_sizes,
                                         output_size=received)
    recv_to_grouped = grouped_to_recv = None
    if group_rows:
        seg_start = seg_sizes.cumsum(0) - seg_sizes
        grouped_sizes = segments.t().reshape(-1)                               # expert-major
        grouped_start = (grouped_sizes.cumsum(0) - grouped_sizes).view(El + 1, W).t().reshape(-1)
        row = torch.arange(received, device=device)
        recv_to_grouped = grouped_start.index_select(0, seg_of_row) + row - seg_start.index_select(0, seg_of_row)
        grouped_to_recv = _inverse_of(recv_to_grouped)
    recv_expert = torch.remainder(seg_of_row, El + 1)  # El: an empty slot
    if capacity is not None and (device.type != "cuda" or torch.compiler.is_compiling() or index_checking_enabled()):
        recv_expert = torch.clamp(recv_expert, max=El - 1)
    pair_row = (pair_slot if pair_valid is None else torch.where(pair_valid, pair_slot, -1)).to(torch.int32)
    token_offsets = None
    if not pairs.top_k:
        token_offsets = torch.cat([pairs.per_token.new_zeros(1), pairs.per_token[:T].cumsum(0)]).to(torch.int32)
    return _Plan(pairs, slot_token, slot_valid, send_splits, recv_splits,
                 recv_to_grouped, grouped_to_recv, recv.sum(0), dropped, recv_expert, pair_row, token_offsets)


def _inverse_of(perm: Tensor) -> Tensor:
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.shape[0], device=perm.device))


@dataclass
class ExpertParallelDispatch:
    """The dispatch stage's result on this rank: the rows this rank's experts must process, grouped by local expert
    (x_grouped, tokens_per_expert: what GroupedExperts / torchtitan's GroupedExperts take), and what the combine
    stage needs. In capacity mode x_grouped ends with padding rows (zeros) beyond sum(tokens_per_expert)."""
    x_grouped: Tensor
    tokens_per_expert: Tensor            # (E_local,) int64, on the device
    router_logits: Tensor                # (T, E)
    expert_counts: Tensor                # (E,) int32: pairs of this rank's tokens per expert
    dropped_rows: Optional[Tensor]       # capacity mode: this rank's pairs not sent (0-d int64)
    plan: _Plan = field(repr=False)
    group: object = field(default=None, repr=False)
    anchor: Optional[Tensor] = field(default=None, repr=False)
    input_shape: Optional[torch.Size] = field(default=None, repr=False)
    x_received: Optional[Tensor] = field(default=None, repr=False)  # the rows as they arrived (source-major)


def _route_tokens(x: Tensor, router_weight: Tensor, top_k: int, score: str, routing: str, rounding: str,
                  tile: int):
    """(x with unit stride along d, the router logits, the dense routing) for this rank's tokens; the options as
    _check_routing_options returns them."""
    if x.stride(-1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[1]):  # overlapping rows: as machmoe.MoE
        x = x.contiguous()
    # The router in the dtype of x (already autocast's, under torch.autocast), as machmoe.MoE's inside the library's
    # operator: autocast would otherwise pick the matmul's dtype itself (e.g. bf16 for float32 data on the CPU, where
    # machmoe.MoE computes in float32) and route differently.
    with torch.autocast(x.device.type, enabled=False):
        logits = x @ router_weight.t()
    return x, logits, _route_dense(logits, top_k, score, routing, rounding, tile)


def _dispatch(x: Tensor, router_weight: Tensor, *, ep_size: int, top_k: int, group, capacity: Optional[int],
              score: str, routing: str, rounding: str, tile: int, group_rows: bool = True) -> ExpertParallelDispatch:
    """Route this rank's tokens, exchange the counts (and, by default, read the split sizes: the host sync), send
    the rows to their experts' ranks and (group_rows) group the received rows by local expert. Without group_rows,
    x_grouped is None and the experts take x_received as it arrived, with plan.recv_expert (_run_indexed)."""
    E = router_weight.shape[0]
    capacity = _check_capacity_arg(capacity)
    top_k, tile = _check_routing_options(top_k, E, score, routing, rounding, tile)
    x, logits, rt = _route_tokens(x, router_weight, top_k, score, routing, rounding, tile)
    plan = _plan(rt, x.shape[0], E, ep_size, capacity, group, top_k, tile, group_rows)
    pairs = plan.pairs
    send = _DispatchRows.apply(x, plan.slot_token, plan.slot_valid, plan.pair_row, plan.token_offsets, pairs.top_k)
    anchor = _anchor(router_weight, x)
    received = _exchange(send, anchor, plan.recv_splits, plan.send_splits, group)
    x_grouped = _RowPermute.apply(received, plan.grouped_to_recv, None, plan.recv_to_grouped, None) \
        if group_rows else None
    return ExpertParallelDispatch(x_grouped, plan.tokens_per_expert, logits, rt.counts.to(torch.int32),
                                  plan.dropped_rows, plan, group, anchor, x_received=received)


def expert_parallel_combine(dispatched: ExpertParallelDispatch, y_grouped: Tensor) -> Tensor:
    """The combine stage: y_grouped (rows of dispatched.x_grouped through their experts) back to the tokens' ranks,
    summed per token with the routing scores. Returns (T, d)."""
    if not isinstance(dispatched, ExpertParallelDispatch):
        raise TypeError("machmoe: argument 'dispatched': expected the ExpertParallelDispatch of the dispatch stage, "
                        f"got {type(dispatched).__name__}")
    expected = tuple(dispatched.x_grouped.shape)
    if not isinstance(y_grouped, Tensor) or tuple(y_grouped.shape) != expected:
        _fail("y_grouped", f"a tensor shaped like dispatched.x_grouped {expected}",
              getattr(y_grouped, "shape", type(y_grouped).__name__))
    if y_grouped.dtype != dispatched.x_grouped.dtype or y_grouped.device != dispatched.x_grouped.device:
        _fail("y_grouped", f"dtype {dispatched.x_grouped.dtype} on {dispatched.x_grouped.device}",
              f"{y_grouped.dtype} on {y_grouped.device}")
    plan = dispatched.plan
    y_received = _RowPermute.apply(y_grouped, plan.recv_to_grouped, None, plan.grouped_to_recv, None)
    return _combine_received(dispatched, y_received)


def _combine_received(dispatched: ExpertParallelDispatch, y_received: Tensor) -> Tensor:
    """The combine stage from the experts' outputs in the order the rows arrived."""
    plan, pairs = dispatched.plan, dispatched.plan.pairs
    y_sent = _exchange(y_received, dispatched.anchor, plan.send_splits, plan.recv_splits, dispatched.group)
    T = dispatched.router_logits.shape[0]
    # The library's score dtype for the returned rows (the routing's scores are float64 for float64 x, the experts'
    # rows float32 where FSDP2 runs them in float32), as _run_pairs casts them in the default mode.
    score = _cast(pairs.score, _acc_dtype(y_sent.dtype))
    return _CombineRows.apply(y_sent.contiguous(), score, plan.pair_row, plan.token_offsets, pairs.top_k, T,
                              plan.slot_valid is not None)


# Eager inside torch.compile: the split sizes are host integers read mid-layer, so the graph breaks there anyway;
# breaking around the whole layer instead keeps the integer bookkeeping out of inductor (whose Triton code generator
# failed on this function's graph, torch 2.11: "list indices must be integers or slices, not NoneType"). Capacity
# mode (static shapes, no host read) is what compiles into one graph.
@torch.compiler.disable
def _rows_forward(x: Tensor, router_weight: Tensor, experts, *, ep_size: int, top_k: int, group, score: str,
                  routing: str, rounding: str, tile: int):
    """The layer's forward in the default mode: route, then send each token's row once to every rank that owns at
    least one of its experts (not once per pair), with the pairs' (row, local expert, score); that rank runs the
    whole single-GPU layer on the rows it received (`experts(rows, pairs=ExpertPairs(...))`: gather, expert MLPs,
    and the score-weighted sum of each row's pairs) and sends one partial sum per row back, which the token's rank
    adds up over ranks (combine_rows, in rank order). A token routed to k_r of rank r's experts thus crosses the
    links once instead of k_r times each way: with random routing a top-8 token of 128 experts reaches about 2.0 of
    2 ranks, 3.6 of 4 and 5.3 of 8 (docs/PARALLEL.md).
    Returns (out (T, d), router_logits, expert_counts (E,) int32)."""
    T, E = x.shape[0], router_weight.shape[0]
    W, El = ep_size, E // ep_size
    top_k, tile = _check_routing_options(top_k, E, score, routing, rounding, tile)
    x, logits, rt = _route_tokens(x, router_weight, top_k, score, routing, rounding, tile)
    counts = rt.counts.to(torch.int32)
    # At most this many pairs of one token meet on one rank.
    per_row = min(top_k, El) if routing == "topk" else El
    if W == 1:
        # A group of one: the tokens are the rows, nothing moves (top-K needs no host synchronisation at all).
        num_pairs = None if routing == "topk" else rt.counts.sum().tolist()
        pairs = _pairs(rt, T, E, num_pairs, exact=True)
        out = experts(x, pairs=ExpertPairs(pairs.token, pairs.expert, pairs.score, per_row))
        return out, logits, counts
    device = x.device
    # uses[r, t]: token t has a pair on rank r's experts, i.e. a row to send there. Rank-major, so that the running
    # count below scans along the inner dimension (a scan down the outer dimension of a (T, W) tensor runs one
    # thread per column: 4 ms for T = 24576, W = 4 on an H100).
    if rt.top_k_order is not None:
        dest_of_choice = torch.div(rt.top_k_order, El, rounding_mode="floor")
        uses = torch.zeros(W, T, dtype=torch.bool, device=device).scatter_(0, dest_of_choice.t(), True)
    else:
        uses = rt.keep.view(T, W, El).any(2).t().contiguous()
    uses_count = uses.to(torch.int64)
    rows_to = uses_count.sum(1)
    pairs_to = rt.counts.view(W, El).sum(1)
    # What each source sends me: pairs per local expert (for the record) and rows, in one exchange of counts.
    recv = _all_to_all(torch.cat([rt.counts.view(W, El), rows_to.unsqueeze(1)], 1).reshape(-1), None, None,
                       group).view(W, El + 1)
    recv_pairs_from, recv_rows_from = recv[:, :El].sum(1), recv[:, El]
    # THE host synchronisation of the layer: the exchanges take their split sizes as host integers.
    sizes = torch.cat([pairs_to, rows_to, recv_pairs_from, recv_rows_from]).tolist()
    send_pairs, send_rows = sizes[:W], sizes[W:2 * W]
    recv_pairs, recv_rows = sizes[2 * W:3 * W], sizes[3 * W:]
    pairs = _pairs(rt, T, E, sum(send_pairs), exact=True)

    # Send rows: destination-major, tokens ascending within a destination.
    within = uses_count.cumsum(1) - uses_count                       # (W, T): row of (r, t) within r's block
    row = within + (rows_to.cumsum(0) - rows_to).unsqueeze(1)        # (W, T): row of (r, t) in the send buffer
    token_rank_row = torch.where(uses, row, -1).t().to(torch.int32).reshape(-1)  # (t, r) order
    R_send = sum(send_rows)
    slot = torch.where(uses, row, R_send).reshape(-1)  # R_send: a discarded slot
    row_token = torch.empty(R_send + 1, dtype=torch.int64, device=device).scatter_(
        0, slot, torch.arange(T, device=device).repeat(W))[:R_send]
    # Pairs: destination-major, pair (token-major) order within a destination (stable sort), so that on the
    # receiving rank the pairs' rows ascend.
    dest = torch.div(pairs.expert, El, rounding_mode="floor")
    order = torch.sort(dest, stable=True).indices
    dest_sorted, token_sorted = dest.index_select(0, order), pairs.token.index_select(0, order)
    pair_info = torch.stack([within.reshape(-1).index_select(0, dest_sorted * T + token_sorted),
                             pairs.expert.index_select(0, order) - dest_sorted * El], 1).to(torch.int32)
    send = _DispatchRows.apply(x, row_token, None, token_rank_row, None, W)
    score_sorted = _RowPermute.apply(pairs.score, order, None, _inverse_of(order), None)
    anchor = _anchor(router_weight, x)
    received, recv_scores, recv_info = _DispatchExchange.apply(
        send, score_sorted, pair_info, anchor, (send_rows, recv_rows), (send_pairs, recv_pairs), group)

    # My pairs' rows in the receive buffer: the source's block start + the row within the block.
    P_recv = recv_info.shape[0]
    source = torch.repeat_interleave(torch.arange(W, device=device), recv_pairs_from, output_size=P_recv)
    block_start = recv_rows_from.cumsum(0) - recv_rows_from
    token_index = recv_info[:, 0].to(torch.int64) + block_start.index_select(0, source)
    y = experts(received, pairs=ExpertPairs(token_index, recv_info[:, 1], recv_scores, per_row))
    y_back = _exchange(y, anchor, send_rows, recv_rows, group)
    out = _SumRowsPerToken.apply(y_back.contiguous(), token_rank_row, W, T, row_token)
    return out, logits, counts


def expert_parallel_moe(x: Tensor, router_weight: Tensor, w1: Tensor, w2: Tensor, b1: Optional[Tensor] = None,
                        b2: Optional[Tensor] = None, *, top_k: int, group=None, capacity: Optional[int] = None,
                        activation: str = "swiglu", score: str = "softmax_topk", routing: str = "topk",
                        rounding: str = "nearest", tile: int = 128, weight_layout: str = "interleaved",
                        activation_memory: str = "preact", swiglu_alpha: Optional[float] = None,
                        swiglu_limit: Optional[float] = None):
    """The expert-parallel layer on this rank. x (T, d) are this rank's tokens (T may differ between ranks, and be
    0); router_weight (E, d) is replicated; w1, w2, b1, b2 hold this rank's E / ep_size experts (global experts
    [rank * E_local, (rank + 1) * E_local)), in machmoe.moe's layout. Returns (out (T, d), router_logits (T, E),
    expert_counts (E,) int32: pairs of this rank's tokens per expert, dropped_rows: None, or in capacity mode a
    0-d int64 device tensor). Differentiable w.r.t. x, router_weight and the local experts; the router weight's
    gradient is this rank's part (sum it over the group, as for any replicated parameter)."""
    ep_size, ep_rank = _group_size_rank(group)
    _check_x(x)
    E = _check_router(x, router_weight, ep_size)
    El, d = E // ep_size, x.shape[1]
    # Everything the experts call checks, checked here, before any communication and the same way on every rank:
    # that call is skipped on a rank that received no rows, and if the others raised there it would wait for them
    # in the return all-to-all (gloo: until the group's timeout; NCCL: for ever).
    top_k, tile = _check_routing_options(top_k, E, score, routing, rounding, tile)
    capacity = _check_capacity_arg(capacity)
    _check_expert_options(activation, weight_layout, activation_memory, swiglu_alpha, swiglu_limit)
    if not isinstance(w2, Tensor) or w2.dim() != 3:
        _fail("w2", "an (E_local, d, n) tensor", getattr(w2, "shape", type(w2).__name__))
    rows = 2 * w2.shape[2] if activation in GLU_ACTIVATIONS else w2.shape[2]
    if not isinstance(w1, Tensor) or w1.dim() != 3 or w1.shape[0] != El:
        _fail("w1", f"the {El} local experts of rank {ep_rank} (E / ep_size = {E} / {ep_size}) as an "
              f"({El}, {rows}, {d}) tensor", getattr(w1, "shape", type(w1).__name__))
    _check_tensor("w1", w1, (El, rows, d), x, master=True)
    _check_tensor("w2", w2, (El, d, w2.shape[2]), x, master=True)
    if b1 is not None:
        _check_tensor("b1", b1, (El, rows), x, master=True)
    if b2 is not None:
        _check_tensor("b2", b2, (El, d), x, master=True)

    if capacity is None:
        def experts(rows, pairs):
            return _run_pairs(rows, pairs.token_index, pairs.expert_index, pairs.scores, pairs.max_pairs_per_row,
                              w1, w2, b1, b2, activation=activation,
                              weight_layout=weight_layout, activation_memory=activation_memory,
                              swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
        out, logits, counts = _rows_forward(x, router_weight, experts, ep_size=ep_size, top_k=top_k, group=group,
                                            score=score, routing=routing, rounding=rounding, tile=tile)
        return out, logits, counts, None
    dispatched = _dispatch(x, router_weight, ep_size=ep_size, top_k=top_k, group=group, capacity=capacity,
                           score=score, routing=routing, rounding=rounding, tile=tile, group_rows=False)
    y = _run_indexed(dispatched.x_received, dispatched.plan.recv_expert, w1, w2, b1, b2, activation=activation,
                     weight_layout=weight_layout, activation_memory=activation_memory,
                     swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
    return (_combine_received(dispatched, y), dispatched.router_logits, dispatched.expert_counts,
            dispatched.dropped_rows)


def expert_parallel_dispatch(x: Tensor, router_weight: Tensor, *, top_k: int, group=None,
                             capacity: Optional[int] = None, score: str = "softmax_topk", routing: str = "topk",
                             rounding: str = "nearest", tile: int = 128) -> ExpertParallelDispatch:
    """The first stage of expert_parallel_moe (route, exchange, group by local expert); run the local experts on
    its x_grouped, then expert_parallel_combine. The stages let a schedule interleave micro-batches, e.g. one
    micro-batch's exchange with another's experts (docs/PARALLEL.md, "Overlap")."""
    ep_size, _ = _group_size_rank(group)
    _check_x(x)
    _check_router(x, router_weight, ep_size)
    return _dispatch(x, router_weight, ep_size=ep_size, top_k=top_k, group=group, capacity=capacity, score=score,
                     routing=routing, rounding=rounding, tile=tile)


def _check_x(x):
    if not isinstance(x, Tensor):
        raise TypeError(f"machmoe: argument 'x': expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        _fail("x", "a (tokens, hidden) tensor", f"shape {tuple(x.shape)}")
    allowed = _CUDA_DTYPES if x.is_cuda else _CPU_DTYPES
    if x.dtype not in allowed:
        _fail("x", f"one of {allowed} on {x.device.type}", x.dtype)


def _check_router(x, router_weight, ep_size) -> int:
    if not isinstance(router_weight, Tensor) or router_weight.dim() != 2:
        _fail("router_weight", "an (E, d) tensor", getattr(router_weight, "shape", type(router_weight).__name__))
    E = router_weight.shape[0]
    _check_divisible(E, ep_size)
    _check_tensor("router_weight", router_weight, (E, x.shape[1]), x)
    return E


# ---- FSDP2 composition ------------------------------------------------------------------------------------------

def shard_experts_fsdp2(layer: "ExpertParallelMoE", expert_mesh=None, **fully_shard_kwargs) -> set:
    """Prepares an ExpertParallelMoE for FSDP2 (docs/PARALLEL.md): call it before the fully_shard that encloses
    the layer (its block, or the root), which then shards the router with the other non-expert parameters.

    Gradient convention: data-parallel training averages gradients over the data-parallel ranks (FSDP2 divides its
    reduce-scatter by the mesh size). An expert's gradient already sums the contributions of the ep_size ranks
    whose tokens it served, so it needs one more division by ep_size:
      * expert_mesh (a 1-D DeviceMesh of the ranks holding the same experts, one per EP group) of size F > 1: the
        experts are sharded over it with fully_shard (extra keyword arguments go to that call) and divide by
        F * ep_size. Returns an empty set.
      * expert_mesh None or of size 1 (EP spans the data-parallel group): the experts stay whole, and their
        forward divides their gradients by ep_size (layer.experts.grad_divide_factor; FSDP2 applies no divide factor
        on a 1-rank mesh; set in forward, not by hooks on the parameters, so that it outlives to_empty). Returns
        the experts' parameters: pass them as ignored_params to the enclosing fully_shard, which must not shard them
        over the EP ranks."""
    from torch.distributed.fsdp import fully_shard
    if not isinstance(layer, ExpertParallelMoE):
        raise TypeError(f"machmoe: argument 'layer': expected an ExpertParallelMoE, got {type(layer).__name__}")
    if expert_mesh is not None and expert_mesh.size() > 1:
        fully_shard(layer.experts, mesh=expert_mesh, **fully_shard_kwargs)
        layer.experts.set_gradient_divide_factor(float(expert_mesh.size() * layer.ep_size))
        # Sum, then divide, on every backend. With a divide factor other than the mesh size, FSDP2 would reduce
        # fp32/bf16 gradients with NCCL's PREMUL_SUM(1 / factor), which (a) gloo refuses ("Cannot use
        # ReduceOp.PREMUL_SUM with Gloo", torch 2.11) and (b) over bf16 on NCCL silently returns all zeros when the
        # factor is a power of two, as F * ep_size usually is (torch passes the factor as a 4-byte float where NCCL
        # reads 2 bytes; pytorch/pytorch#190745; torch 2.11 has it): the 4-GPU EP 2 x expert-FSDP 2 training
        # test measured zero expert gradients (relative error 1.00) before this, 3e-3 after (H200, 2026-11-26).
        # The cost is one division of the reduced shard.
        layer.experts.set_force_sum_reduction_for_comms(True)
        return set()
    layer.experts.grad_divide_factor = float(layer.ep_size)  # applied in the experts' forward (GroupedExperts)
    return set(layer.experts.parameters())


# ---- capacity overflow ------------------------------------------------------------------------------------------

def check_capacity(dropped_rows: Union[Tensor, "ExpertParallelOutput", None], *, action: str = "raise",
                   all_ranks: bool = False, group=None) -> int:
    """Reads the capacity mode's overflow report (a host synchronisation: call it outside captured graphs, e.g.
    once per step). Returns the number of dropped rows: this rank's, or with all_ranks=True the total over `group`
    (None: the default group, as in torch.distributed; a collective, so call it on every rank). action="raise"
    raises RuntimeError when rows were dropped, "warn" warns, "ignore" only returns the count."""
    if action not in ("raise", "warn", "ignore"):
        _fail("action", "'raise', 'warn' or 'ignore'", repr(action))
    if isinstance(dropped_rows, ExpertParallelOutput):
        dropped_rows = dropped_rows.dropped_rows
    if dropped_rows is None:  # the default mode sends every row
        return 0
    total = dropped_rows.detach().to(torch.int64).clone()
    if all_ranks:
        dist.all_reduce(total, group=group)
    n = int(total)
    if n and action != "ignore":
        # all_ranks sums over `group` as given (None: the default group), which need not be the layer's.
        where = "over the ranks of the group summed" if all_ranks else "on this rank"
        msg = (f"machmoe: expert-parallel capacity overflow: {n} routed rows were not sent {where} (their experts' "
               "contributions are missing from the output); raise `capacity` or use capacity=None")
        if action == "raise":
            raise RuntimeError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return n


@dataclass
class ExpertParallelOutput(MoEOutput):
    dropped_rows: Optional[Tensor] = None  # capacity mode: this rank's pairs not sent (0-d int64, on the device)

    def check_capacity(self, action: str = "raise", all_ranks: bool = False, group=None) -> int:
        """check_capacity(self.dropped_rows, ...); with all_ranks, pass the layer's group (None: default group)."""
        return check_capacity(self.dropped_rows, action=action, all_ranks=all_ranks, group=group)


# A pytree node, so that what walks a module's outputs finds the tensors inside: FSDP2 hooks the backward of the
# root module's outputs to reduce-scatter its gradients afterwards, and a plain dataclass would hide them.
torch.utils._pytree.register_dataclass(ExpertParallelOutput)


class ExpertParallelMoE(_LossCoefficients, nn.Module):
    """machmoe.MoE with its experts spread over an expert-parallel process group.

    Parameters: router_weight (E, d), replicated on every rank (data-parallel over the group: reduce its gradient
    over the group, as FSDP2/DDP do), and `experts` (a GroupedExperts holding this rank's E / ep_size experts, w1,
    w2, b1, b2 in machmoe.MoE's layout; global experts [ep_rank * E_local, (ep_rank + 1) * E_local)). Keeping the
    experts in a submodule lets FSDP2 shard them on a different mesh than the router (docs/PARALLEL.md).
    capacity=None: one host synchronisation per forward; capacity=C: none, at most C rows per rank pair.
    forward(x) takes (..., hidden_size) and returns ExpertParallelOutput.

    Initialisation: the router as machmoe.MoE's, from the default generator (seed every rank identically, as
    data-parallel training requires, or load the weights); each expert from its own generator seeded from the
    default generator plus its global index, so ranks sharing a seed get distinct experts and the initial
    weights do not depend on ep_size."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *, group=None,
                 capacity: Optional[int] = None, activation: str = "swiglu", bias: bool = False,
                 score: str = "softmax_topk", routing: str = "topk", rounding: str = "nearest", tile: int = 128,
                 weight_layout: str = "interleaved", activation_memory: str = "preact", aux_loss_coef: float = 0.0,
                 z_loss_coef: float = 0.0, device=None, dtype=None, swiglu_alpha: Optional[float] = None,
                 swiglu_limit: Optional[float] = None):
        super().__init__()
        self.ep_size, self.ep_rank = _group_size_rank(group)
        hidden_size = as_int("hidden_size", hidden_size, low=1)
        intermediate_size = as_int("intermediate_size", intermediate_size, low=1)
        num_experts = as_int("num_experts", num_experts, low=1)
        _check_divisible(num_experts, self.ep_size)
        capacity = _check_capacity_arg(capacity)
        top_k, tile = _check_routing_options(top_k, num_experts, score, routing, rounding, tile)
        self.group, self.capacity = group, capacity
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.num_local_experts = num_experts // self.ep_size
        self.expert_offset = self.ep_rank * self.num_local_experts
        self.activation, self.score, self.routing, self.rounding, self.tile = activation, score, routing, rounding, tile
        self.weight_layout, self.activation_memory = weight_layout, activation_memory
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.router_weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        # The experts' own initialisation is skipped: reset_parameters draws them from per-expert generators, after
        # the router, so that the router is machmoe.MoE's for the same seed and nothing depends on ep_size.
        self.experts = GroupedExperts(hidden_size, intermediate_size, self.num_local_experts, activation, bias,
                                      weight_layout, activation_memory, device=device, dtype=dtype,
                                      swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, _defer_init=True)
        self.reset_parameters()

    def extra_repr(self) -> str:  # (the experts' own options: the `experts` submodule's line)
        return _options_repr(
            self, ExpertParallelMoE,
            [("hidden_size", self.hidden_size), ("intermediate_size", self.intermediate_size),
             ("num_experts", self.num_experts), ("top_k", self.top_k), ("ep_size", self.ep_size),
             ("ep_rank", self.ep_rank)],
            ("capacity",) + _ROUTING_OPTIONS)

    def __deepcopy__(self, memo):
        """A copy (e.g. torch.optim.swa_utils.AveragedModel's) shares the process group, which cannot be copied."""
        if self.group is not None:
            memo[id(self.group)] = self.group
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        return new

    def reset_parameters(self) -> None:
        if self.router_weight.device.type == "meta":
            return
        with torch.no_grad():
            self.router_weight.normal_(0.0, 1.0 / math.sqrt(self.hidden_size))
        seed = int(torch.randint(0, 2**62, (1,)))  # the default (CPU) generator: the same on equally seeded ranks
        self.experts.reset_parameters(seed=seed, first_expert=self.expert_offset)

    @classmethod
    def from_moe(cls, moe: MoE, *, group=None, capacity: Optional[int] = None) -> "ExpertParallelMoE":
        """This rank's share of a machmoe.MoE: the same options, the router copied, the local experts sliced."""
        if not isinstance(moe, MoE):
            raise TypeError(f"machmoe: argument 'moe': expected a machmoe.MoE, got {type(moe).__name__}")
        if getattr(moe, "accumulate_into_main_grad", False):
            # Its gradients would go to .grad instead of main_grad, which a main_grad optimiser would never read.
            _fail("moe", "a MoE with accumulate_into_main_grad=False (ExpertParallelMoE's gradients go to .grad, "
                  "where FSDP2 and DDP reduce them; it has no main_grad mode)", "accumulate_into_main_grad=True")
        ep = cls(moe.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k, group=group, capacity=capacity,
                 activation=moe.activation, bias=moe.b1 is not None, score=moe.score, routing=moe.routing,
                 rounding=moe.rounding, tile=moe.tile, weight_layout=moe.weight_layout,
                 activation_memory=moe.activation_memory, aux_loss_coef=moe.aux_loss_coef,
                 z_loss_coef=moe.z_loss_coef, device=moe.w1.device, dtype=moe.w1.dtype,
                 swiglu_alpha=getattr(moe, "swiglu_alpha", None), swiglu_limit=getattr(moe, "swiglu_limit", None))
        local = slice(ep.expert_offset, ep.expert_offset + ep.num_local_experts)
        with torch.no_grad():
            ep.router_weight.copy_(moe.router_weight)
            for name in ("w1", "w2", "b1", "b2"):
                src = getattr(moe, name)
                if src is not None:
                    getattr(ep.experts, name).copy_(src[local])
        return ep

    def dispatch(self, x: Tensor) -> ExpertParallelDispatch:
        """Stage 1 of forward: route x (..., hidden_size), send its rows to their experts' ranks."""
        return self._dispatch(x, group_rows=True)

    def _checked_input(self, x: Tensor):
        """(x as (tokens, hidden), the router weight as a plain tensor), both checked, and the local experts'
        weights against x."""
        require_tensor("x", x)
        if x.dim() == 0 or x.shape[-1] != self.hidden_size:
            _fail("x", f"a tensor of shape (..., {self.hidden_size})", f"shape {tuple(x.shape)}")
        flat = x.reshape(-1, self.hidden_size)
        router_weight = _local(self.router_weight)
        # Under torch.autocast the rows travel and the router runs in autocast's dtype, as in machmoe.MoE; the
        # experts' call casts their weights likewise.
        cast = _autocast_dtype(flat.device)
        if cast is not None:
            flat, router_weight = _autocast_cast(cast, flat, router_weight)
        _check_x(flat)
        _check_router(flat, router_weight, self.ep_size)
        self._check_experts_for(flat, autocast=cast is not None)
        return flat, router_weight

    def _check_experts_for(self, x: Tensor, autocast: bool = False) -> None:
        """The local experts' weights against x's device and dtype, before any communication: the experts call that
        checks them is skipped on a rank that received no rows, which would then wait in the return all-to-all for
        the ranks that raised. Left to that call (which checks them on every rank, _check_expert_call) where a
        forward pre-hook runs on the experts: FSDP2 gathers their shards and casts their input there, so what they
        hold now is not what the call will use."""
        experts = self.experts
        if not isinstance(experts, GroupedExperts) or experts._forward_pre_hooks:
            return
        for name in ("w1", "w2", "b1", "b2"):
            w = getattr(experts, name)
            if w is None:
                continue
            if not isinstance(w, Tensor) or hasattr(w, "to_local"):  # DTensors: sharded, used through to_local()
                return
            if autocast:  # (the experts' call casts weights of other dtypes; float32 ones are master weights)
                if w.device != x.device:
                    _fail(f"experts.{name}", f"a tensor on {x.device} (the device of x)", f"a tensor on {w.device}")
            else:  # device and dtype, as the experts' call checks them (float32 master weights of a bf16/fp16 x)
                _check_tensor(f"experts.{name}", w, tuple(w.shape), x, master=True)

    def _dispatch(self, x: Tensor, group_rows: bool) -> ExpertParallelDispatch:
        flat, router_weight = self._checked_input(x)
        shape = x.shape
        dispatched = _dispatch(flat, router_weight, ep_size=self.ep_size, top_k=self.top_k, group=self.group,
                               capacity=self.capacity, score=self.score, routing=self.routing,
                               rounding=self.rounding, tile=self.tile, group_rows=group_rows)
        dispatched.input_shape = shape
        return dispatched

    def combine(self, dispatched: ExpertParallelDispatch, y_grouped: Tensor) -> ExpertParallelOutput:
        """Stage 3 of forward (stage 2: y_grouped = self.experts(d.x_grouped, d.tokens_per_expert))."""
        return self._output(dispatched, expert_parallel_combine(dispatched, y_grouped))

    def _output(self, dispatched: ExpertParallelDispatch, out: Tensor) -> ExpertParallelOutput:
        return self._result(out.reshape(dispatched.input_shape), dispatched.router_logits, dispatched.expert_counts,
                            dispatched.dropped_rows)

    def _result(self, out: Tensor, logits: Tensor, counts: Tensor, dropped: Optional[Tensor]) -> ExpertParallelOutput:
        result = ExpertParallelOutput(out, logits, counts, dropped_rows=dropped)
        if self.aux_loss_coef > 0:
            result.aux_loss = self.aux_loss_coef * load_balancing_loss(logits, counts)
        if self.z_loss_coef > 0:
            result.z_loss = self.z_loss_coef * router_z_loss(logits)
        return result

    def forward(self, x: Tensor) -> ExpertParallelOutput:
        # The experts are called as a module, so that hooks on it run (FSDP2 gathers their shards here).
        if self.capacity is None:
            # One row per (token, rank) each way; the receiving rank sums a row's pairs (_rows_forward).
            flat, router_weight = self._checked_input(x)
            out, logits, counts = _rows_forward(flat, router_weight, self.experts, ep_size=self.ep_size,
                                                top_k=self.top_k, group=self.group, score=self.score,
                                                routing=self.routing, rounding=self.rounding, tile=self.tile)
            return self._result(out.reshape(x.shape), logits, counts, None)
        # Capacity mode: one row per pair in static blocks; the rows go through the experts in the order they
        # arrive (no permutation to expert order and back; the same results as the staged dispatch / experts /
        # combine, bitwise). Its empty slots are discarded by their sender.
        dispatched = self._dispatch(x, group_rows=False)
        y = self.experts(dispatched.x_received, expert_index=dispatched.plan.recv_expert)
        return self._output(dispatched, _combine_received(dispatched, y))
