"""machmoe.parallel on the CPU: expert parallelism over gloo with 2, 4 and 8 processes, against the single-process
machmoe.MoE with the same weights (float64 reference path), plus the grouped-experts adapters in one process.

The multi-process scenarios run in one spawn per group size (spawning costs seconds; CI has 2 cores): every
worker runs every scenario in order, records "ok" or the traceback per scenario, and each scenario is reported as
its own test below. A failure stops that worker's later scenarios (their collectives would no longer pair up with
the other ranks'), which then fail as "not run".
"""
import datetime
from dataclasses import dataclass
import gc
import json
import math
import os
import socket
import time
import traceback
import warnings
import weakref
import zlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import machmoe
from machmoe.parallel import (ExpertParallelMoE, GroupedExperts, TorchTitanGroupedExperts, check_capacity,
                              expert_parallel_moe, route, shard_experts_fsdp2, torchtitan_experts_forward)
from reference import GLU, experts as reference_experts, route as reference_route
from layer_inputs import place_gate_up

D, N = 8, 4


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def assert_close(name, a, b, tol):
    assert a is not None, f"{name}: no gradient"
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    if b.norm() == 0:
        assert a.abs().max() == 0 if a.numel() else True, f"{name}: expected exact zeros"
    else:
        err = rel(a, b)
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"


def gen(*seed):
    # crc32, not hash(): string hashing is randomised per process, and every rank must draw the same data.
    return torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))


def make_layer(seed, dtype=torch.float64, *, E=4, K=2, bias=True, **opts):
    torch.manual_seed(seed)
    m = machmoe.MoE(D, N, E, K, bias=bias, dtype=dtype, **opts)
    if bias:  # non-zero biases, so that their gradients mean something
        with torch.no_grad():
            m.b1.normal_(0, 0.5, generator=gen(seed, "b1"))
            m.b2.normal_(0, 0.5, generator=gen(seed, "b2"))
    return m


def per_rank(sizes, world):
    """Token counts for `world` ranks from a list written for up to len(sizes) ranks. Beyond it the list repeats,
    scaled by the number of repeats: the scenarios use E = 2·world experts and route per rank, so this keeps the
    pairs per expert (and token rounding's tiles) as they are at 4 ranks. Each rank still draws its own tokens."""
    scale = -(-world // len(sizes))
    return [scale * sizes[r % len(sizes)] for r in range(world)]


def make_inputs(seed, sizes, dtype=torch.float64):
    return [torch.randn(T, D, generator=gen(seed, "x", r), dtype=torch.float64).to(dtype)
            for r, T in enumerate(sizes)]


def upstream(seed, r, T, E, dtype):
    return (torch.randn(T, D, generator=gen(seed, "go", r), dtype=torch.float64).to(dtype),
            torch.randn(T, E, generator=gen(seed, "gl", r), dtype=torch.float64).to(dtype))


def run_ep(ep, x, seed, rank):
    """One EP forward and backward; the router gradient summed over the group (it is replicated)."""
    x = x.clone().requires_grad_()
    ep.zero_grad(set_to_none=True)
    o = ep(x)
    go, gl = upstream(seed, rank, x.shape[0], ep.num_experts, x.dtype)
    ((o.output * go).sum() + (o.router_logits * gl).sum()).backward()
    dist.all_reduce(ep.router_weight.grad, group=ep.group)
    return o, x.grad


def run_reference(moe, xs, seed):
    """The single-process layer on each rank's tokens (routing is per rank, as in EP); gradients summed."""
    moe.zero_grad(set_to_none=True)
    outs = []
    for r, x in enumerate(xs):
        if x.shape[0] == 0:
            outs.append(None)
            continue
        x = x.clone().requires_grad_()
        o = moe(x)
        go, gl = upstream(seed, r, x.shape[0], moe.num_experts, x.dtype)
        ((o.output * go).sum() + (o.router_logits * gl).sum()).backward()
        outs.append((o, x.grad))
    return outs


def check_against_single_process(rank, world, *, seed, sizes, dtype=torch.float64, tol=1e-12, capacity=None,
                                 group=None, layer=None, **opts):
    moe = layer if layer is not None else make_layer(seed, dtype, **opts)
    xs = make_inputs(seed, sizes, dtype)
    ep = ExpertParallelMoE.from_moe(moe, capacity=capacity, group=group)
    o, dx = run_ep(ep, xs[rank], seed, rank)
    refs = run_reference(moe, xs, seed)
    if refs[rank] is not None:
        ref, ref_dx = refs[rank]
        assert_close("output", o.output, ref.output, tol)
        assert_close("router_logits", o.router_logits, ref.router_logits, tol)
        assert torch.equal(o.expert_counts, ref.expert_counts), (o.expert_counts, ref.expert_counts)
        assert_close("grad x", dx, ref_dx, tol)
    else:
        assert o.output.shape == (0, D) and dx.shape == (0, D)
    assert_close("grad router_weight", ep.router_weight.grad, moe.router_weight.grad, tol)
    local = slice(ep.expert_offset, ep.expert_offset + ep.num_local_experts)
    for name in ("w1", "w2", "b1", "b2"):
        if getattr(moe, name) is not None:
            assert_close(f"grad {name}", getattr(ep.experts, name).grad, getattr(moe, name).grad[local], tol)
    return ep, o, moe, xs


def global_counts(o, group=None):
    c = o.expert_counts.to(torch.int64).clone()
    dist.all_reduce(c, group=group)
    return c


# ---- scenarios (run inside the workers) -------------------------------------------------------------------------

def scenario_topk_float64(rank, world):
    _, o, moe, _ = check_against_single_process(rank, world, seed=1, sizes=per_rank([12, 7, 9, 5], world),
                                                E=2 * world, aux_loss_coef=0.1, z_loss_coef=0.01)
    assert o.aux_loss is not None and o.z_loss is not None and o.dropped_rows is None


def scenario_topk_float32_geglu_concatenated(rank, world):
    check_against_single_process(rank, world, seed=2, sizes=per_rank([10, 13, 6, 8], world), dtype=torch.float32,
                                 tol=2e-6, E=2 * world, activation="geglu", weight_layout="concatenated", bias=False,
                                 score="topk_softmax")


def scenario_token_rounding_float64(rank, world):
    check_against_single_process(rank, world, seed=3, sizes=per_rank([20, 16, 24, 9], world), E=2 * world,
                                 routing="token_rounding", tile=8)


def scenario_token_rounding_up_relu(rank, world):
    check_against_single_process(rank, world, seed=4, sizes=per_rank([18, 11, 7, 3], world),
                                 E=2 * world, routing="token_rounding", rounding="up", tile=8, activation="relu",
                                 score="topk_softmax_renorm")


def skewed_layer(seed, E, world, strength, **opts):
    """A router under which tokens (built with a shared direction u) prefer rank 0's experts by `strength`."""
    m = make_layer(seed, E=E, **opts)
    u = torch.ones(D, dtype=torch.float64) / math.sqrt(D)
    El = E // world
    with torch.no_grad():
        m.router_weight[:El] += strength * u
        m.router_weight[El:] -= strength * u
    return m


def skewed_inputs(seed, sizes, spread=1.0):
    """Tokens spread * N(0, 1) around 2u: with a small spread every token's component along u is positive."""
    u = torch.ones(D, dtype=torch.float64) / math.sqrt(D)
    return [spread * x + 2.0 * u for x in make_inputs(seed, sizes)]


def scenario_skewed_routing(rank, world):
    # Strengths chosen so that rank 0's experts get most of the rows and the other ranks still some: at 2 ranks 96%
    # (top-K) and 80% (token rounding, whose tile-8 rounding makes the split coarse); at 8 ranks 84% and 88%.
    strengths = {2: (0.5, 0.3), 4: (0.5, 0.3), 8: (0.7, 0.5)}[world]
    for routing, strength in zip(("topk", "token_rounding"), strengths):
        seed, sizes, E = 5, per_rank([24, 16, 12, 20], world), 2 * world
        layer = skewed_layer(seed, E, world, strength, routing=routing, tile=8)
        _, o, _, _ = check_against_single_process_inputs(rank, world, layer, skewed_inputs(seed, sizes), seed)
        counts = global_counts(o)
        rank0 = int(counts[:E // world].sum())
        assert 0.75 * int(counts.sum()) <= rank0 < int(counts.sum()), (routing, counts)  # skewed, not all


def check_against_single_process_inputs(rank, world, moe, xs, seed, tol=1e-12, capacity=None):
    ep = ExpertParallelMoE.from_moe(moe, capacity=capacity)
    o, dx = run_ep(ep, xs[rank], seed, rank)
    refs = run_reference(moe, xs, seed)
    if refs[rank] is not None:
        assert_close("output", o.output, refs[rank][0].output, tol)
        assert_close("grad x", dx, refs[rank][1], tol)
    assert_close("grad router_weight", ep.router_weight.grad, moe.router_weight.grad, tol)
    local = slice(ep.expert_offset, ep.expert_offset + ep.num_local_experts)
    for name in ("w1", "w2", "b1", "b2"):
        if getattr(moe, name) is not None:
            assert_close(f"grad {name}", getattr(ep.experts, name).grad, getattr(moe, name).grad[local], tol)
    return ep, o, moe, xs


def scenario_rank_without_tokens(rank, world):
    for routing in ("topk", "token_rounding"):
        sizes = per_rank([14, 0, 9, 0], world)
        for capacity in (None, 64):
            check_against_single_process(rank, world, seed=6, sizes=sizes, E=2 * world, routing=routing, tile=8,
                                         capacity=capacity)


def scenario_rank_receives_nothing(rank, world):
    # capacity: above the largest number of pairs one rank sends (every pair goes to rank 0), so nothing is dropped
    for routing, capacity in (("topk", None), ("token_rounding", None), ("topk", 32 * -(-world // 4))):
        seed, sizes, E = 7, per_rank([10, 12, 8, 6], world), 2 * world
        layer = skewed_layer(seed, E, world, 8.0, routing=routing, tile=8)
        ep, o, _, _ = check_against_single_process_inputs(rank, world, layer, skewed_inputs(seed, sizes, 0.2), seed,
                                                          capacity=capacity)
        counts = global_counts(o)
        assert int(counts[E // world:].sum()) == 0, counts  # no row for any other rank's experts
        assert o.dropped_rows is None or int(o.dropped_rows) == 0
        if rank > 0:  # its experts received nothing: zero gradients, not missing ones
            for p in ep.experts.parameters():
                assert p.grad is not None and p.grad.abs().max() == 0


def scenario_num_experts_not_divisible(rank, world):
    E = 2 * world + 1
    try:
        ExpertParallelMoE(D, N, E, 2)
    except ValueError as e:
        assert f"argument 'num_experts': expected a multiple of the expert-parallel group size {world}" in str(e)
        assert f"got {E}" in str(e)
    else:
        raise AssertionError("no error for num_experts not divisible by the group size")
    m = make_layer(8, E=E)
    x = make_inputs(8, [5])[0]
    before = [t.clone() for t in (x, m.router_weight, m.w1, m.w2)]
    try:
        expert_parallel_moe(x, m.router_weight, m.w1, m.w2, top_k=2)
    except ValueError as e:
        assert "'num_experts'" in str(e) and f"group size {world}" in str(e), str(e)
    else:
        raise AssertionError("no error from the functional form")
    assert all(torch.equal(a, b) for a, b in zip(before, (x, m.router_weight, m.w1, m.w2)))


def scenario_argument_errors(rank, world):
    m = make_layer(9, E=2 * world)
    x = make_inputs(9, [6])[0]
    El = 2
    try:  # all experts passed where this rank's share is expected
        expert_parallel_moe(x, m.router_weight, m.w1, m.w2, top_k=2)
    except ValueError as e:
        assert f"'w1': expected the {El} local experts of rank {rank}" in str(e), str(e)
    else:
        raise AssertionError("no error for the full expert weights")
    for bad in (0, -3, 2.5, True):  # wrong values raise ValueError, wrong kinds TypeError
        try:
            ExpertParallelMoE(D, N, 2 * world, 2, capacity=bad)
        except (ValueError, TypeError) as e:
            assert "argument 'capacity'" in str(e)
            assert isinstance(e, ValueError if isinstance(bad, int) and not isinstance(bad, bool) else TypeError)
        else:
            raise AssertionError(f"capacity={bad!r} accepted")
    try:
        ExpertParallelMoE.from_moe(m)(torch.randn(3, D + 1, dtype=torch.float64))
    except ValueError as e:
        assert "argument 'x'" in str(e) and f"(..., {D})" in str(e)
    else:
        raise AssertionError("wrong hidden size accepted")


def scenario_functional_equals_module(rank, world):
    m = make_layer(10, E=2 * world)
    x = make_inputs(10, per_rank([9, 11, 4, 7], world))[rank]
    ep = ExpertParallelMoE.from_moe(m)
    o = ep(x)
    out, logits, counts, dropped = expert_parallel_moe(
        x, ep.router_weight, ep.experts.w1, ep.experts.w2, ep.experts.b1, ep.experts.b2, top_k=2)
    assert torch.equal(out, o.output) and torch.equal(logits, o.router_logits)
    assert torch.equal(counts, o.expert_counts) and dropped is None


def scenario_bitwise_reruns(rank, world):
    for routing, capacity in (("topk", None), ("token_rounding", None), ("topk", 8), ("token_rounding", 8)):
        m = make_layer(11, E=2 * world, routing=routing, tile=8)
        x = make_inputs(11, per_rank([16, 13, 10, 12], world))[rank]
        ep = ExpertParallelMoE.from_moe(m, capacity=capacity)
        runs = []
        for _ in range(2):
            o, dx = run_ep(ep, x, 11, rank)
            runs.append([o.output, o.router_logits, dx] + [p.grad.clone() for p in ep.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*runs)), (routing, capacity)


def scenario_capacity_without_overflow(rank, world):
    for routing in ("topk", "token_rounding"):
        m = make_layer(12, E=2 * world, routing=routing, tile=8)
        x = make_inputs(12, per_rank([16, 13, 10, 12], world))[rank]
        plain, dx_plain = run_ep(ExpertParallelMoE.from_moe(m), x, 12, rank)
        ep = ExpertParallelMoE.from_moe(m, capacity=64)
        capped, dx_capped = run_ep(ep, x, 12, rank)
        assert_close("output", capped.output, plain.output, 1e-13)
        assert_close("grad x", dx_capped, dx_plain, 1e-13)
        assert capped.dropped_rows.dtype == torch.int64 and capped.dropped_rows.dim() == 0
        assert capped.check_capacity() == 0 and check_capacity(capped, all_ranks=True, group=ep.group) == 0


def dropped_by_capacity(expert, El, world, capacity):
    """The capacity rule, written out: to each destination rank, the first `capacity` pairs in (expert, pair)
    order are sent."""
    kept = torch.zeros(expert.shape[0], dtype=torch.bool)
    order = torch.sort(expert, stable=True).indices.tolist()
    for dest in range(world):
        mine = [i for i in order if int(expert[i]) // El == dest]
        kept[mine[:capacity]] = True
    return kept


def scenario_capacity_overflow(rank, world):
    capacity = 3
    for routing in ("topk", "token_rounding"):
        seed, sizes, E = 13, per_rank([12, 9, 10, 7], world), 2 * world
        m = make_layer(seed, E=E, routing=routing, tile=8)
        xs = make_inputs(seed, sizes)
        ep = ExpertParallelMoE.from_moe(m, capacity=capacity)
        o, dx = run_ep(ep, xs[rank], seed, rank)
        # Reference: the pure-PyTorch layer without the pairs the capacity rule drops, on every rank's tokens.
        params = [p.detach().clone().requires_grad_() for p in (m.router_weight, m.w1, m.w2, m.b1, m.b2)]
        rw, w1, w2, b1, b2 = params
        loss, ref_out, ref_x, dropped_total = 0, None, None, 0
        for r, x in enumerate(xs):
            x = x.clone().requires_grad_()
            logits = x @ rw.T
            tok, exp, s = reference_route(logits, 2, "softmax_topk", routing, "nearest", 8)
            kept = dropped_by_capacity(exp, E // world, world, capacity)
            dropped_total += int((~kept).sum())
            out = reference_experts(x, tok[kept], exp[kept], s[kept], w1, w2, b1, b2, "swiglu", "interleaved")
            go, gl = upstream(seed, r, x.shape[0], E, x.dtype)
            loss = loss + (out * go).sum() + (logits * gl).sum()
            if r == rank:
                ref_out, ref_x, ref_dropped = out, x, int((~kept).sum())
        grads = torch.autograd.grad(loss, [ref_x] + params)
        assert dropped_total > 0, "the scenario must overflow"
        assert int(o.dropped_rows) == ref_dropped, (int(o.dropped_rows), ref_dropped)
        assert_close("output", o.output, ref_out.detach(), 1e-12)
        assert_close("grad x", dx, grads[0], 1e-12)
        assert_close("grad router_weight", ep.router_weight.grad, grads[1], 1e-12)
        local = slice(ep.expert_offset, ep.expert_offset + ep.num_local_experts)
        for name, g in zip(("w1", "w2", "b1", "b2"), grads[2:]):
            assert_close(f"grad {name}", getattr(ep.experts, name).grad, g[local], 1e-12)
        # The report: this rank's count, the group's total, raise / warn / ignore.
        assert check_capacity(o.dropped_rows, action="ignore", all_ranks=True) == dropped_total
        assert o.check_capacity(action="ignore", all_ranks=True) == dropped_total
        if ref_dropped:
            try:
                o.check_capacity()
            except RuntimeError as e:
                assert f"capacity overflow: {ref_dropped} routed rows were not sent on this rank" in str(e)
            else:
                raise AssertionError("check_capacity did not raise")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert o.check_capacity(action="warn") == ref_dropped
            assert any("capacity overflow" in str(w.message) for w in caught)
        else:
            assert o.check_capacity() == 0


class HostReads:
    """Counts host reads of tensor values (tolist, item, bool, int, float) while active, except those of
    grouped_experts' validation of CPU counts (machmoe.functional._check_expert_counts), which reads host memory and
    does not run on CUDA tensors: on the GPU it is no synchronisation (the GPU test checks with CUDA's sync debug
    mode)."""
    names = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")

    @staticmethod
    def _from_cpu_count_validation() -> bool:
        import sys
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_name == "_check_expert_counts":
                return True
            frame = frame.f_back
        return False

    def __enter__(self):
        self.calls = {}
        self.saved = {n: getattr(torch.Tensor, n) for n in self.names}
        for n, f in self.saved.items():
            def counted(*a, _n=n, _f=f, **k):
                if not HostReads._from_cpu_count_validation():
                    self.calls[_n] = self.calls.get(_n, 0) + 1
                return _f(*a, **k)
            setattr(torch.Tensor, n, counted)
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


def scenario_host_synchronisations(rank, world):
    """The default mode reads the split sizes once per forward (one tolist) and nothing in backward; capacity mode
    reads nothing at all (docs/PARALLEL.md)."""
    for routing in ("topk", "token_rounding"):
        m = make_layer(14, E=2 * world, routing=routing, tile=8)
        x = make_inputs(14, per_rank([10, 12, 9, 8], world))[rank].requires_grad_()
        for capacity, expected in ((None, {"tolist": 1}), (16, {})):
            ep = ExpertParallelMoE.from_moe(m, capacity=capacity)
            with HostReads() as fwd:
                o = ep(x)
            with HostReads() as bwd:
                o.output.square().sum().backward()
            assert fwd.calls == expected and bwd.calls == {}, (routing, capacity, fwd.calls, bwd.calls)


def scenario_input_requires_grad_on_one_rank_only(rank, world):
    """Rank 0's input needs a gradient, the others' do not: every rank must still run every backward exchange, or
    rank 0 would wait for partners that skipped them (gloo: an error at the timeout; NCCL: a hang). With the router
    trained and frozen (fine-tuning the experts only: the router weight can then not tie the ranks' graphs together),
    in the default and the capacity mode, the staged API included."""
    for frozen in (False, True):
        for capacity in (None, 64):
            m = make_layer(15, E=2 * world)
            m.router_weight.requires_grad_(not frozen)
            xs = make_inputs(15, per_rank([9, 7, 8, 6], world))
            ep = ExpertParallelMoE.from_moe(m, capacity=capacity)
            ep.router_weight.requires_grad_(not frozen)
            for staged in (False, True):
                x = xs[rank].clone().requires_grad_(rank == 0)
                if staged:
                    d = ep.dispatch(x)
                    o = ep.combine(d, ep.experts(d.x_grouped, d.tokens_per_expert))
                else:
                    o = ep(x)
                go, _ = upstream(15, rank, x.shape[0], 2 * world, x.dtype)
                ep.zero_grad(set_to_none=True)
                (o.output * go).sum().backward()
                m.zero_grad(set_to_none=True)
                ref_x = xs[0].clone().requires_grad_()
                loss = (m(ref_x).output * upstream(15, 0, xs[0].shape[0], 2 * world, x.dtype)[0]).sum()
                for r in range(1, world):
                    loss = loss + (m(xs[r]).output * upstream(15, r, xs[r].shape[0], 2 * world, x.dtype)[0]).sum()
                loss.backward()
                what = f"(router {'frozen' if frozen else 'trained'}, capacity {capacity}, staged {staged})"
                if rank == 0:
                    assert_close(f"grad x {what}", x.grad, ref_x.grad, 1e-12)
                local = slice(ep.expert_offset, ep.expert_offset + ep.num_local_experts)
                assert_close(f"grad w1 {what}", ep.experts.w1.grad, m.w1.grad[local], 1e-12)
                assert (ep.router_weight.grad is None) == frozen, what
                import machmoe.parallel as P
                assert all(a.grad is None for a in P._FROZEN_ROUTER_ANCHORS.values()), what  # read by nothing
                assert len(P._FROZEN_ROUTER_ANCHORS) <= 1  # one per device, made once


def scenario_default_mode_keeps_no_returned_rows(rank, world):
    """The default mode's combine saves the row -> token index for its backward, not the rows that came back
    (R x d: the size of the layer's output again, or more, held until the backward)."""
    m = make_layer(16, E=2 * world)
    x = make_inputs(16, per_rank([9, 7, 8, 6], world))[rank].requires_grad_()
    out = ExpertParallelMoE.from_moe(m)(x).output
    seen, stack, saved = set(), [out.grad_fn], {}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        saved.setdefault(type(node).__name__, []).append(node)
        stack.extend(f for f, _ in node.next_functions)
    assert "_SumRowsPerTokenBackward" in saved and "_CombineRowsBackward" not in saved, sorted(saved)
    (node,) = saved["_SumRowsPerTokenBackward"]
    assert [(t.dim(), t.dtype) for t in node.saved_tensors] == [(1, torch.int64)]


def scenario_staged_micro_batches_interleaved(rank, world):
    """The overlap schedule's order (docs/PARALLEL.md): dispatch A, experts A, dispatch B, combine A, experts B,
    combine B — equals the stages one micro-batch after the other bitwise, gradients included, and two plain
    forwards: bitwise in capacity mode (the same rows, in the same order), to rounding in the default mode (whose
    forward sums a token's pairs per rank before the exchange back, the stages after it); and combine rejects a
    wrong y_grouped."""
    def staged(ep, x):
        d = ep.dispatch(x)
        return ep.combine(d, ep.experts(d.x_grouped, d.tokens_per_expert)).output

    for capacity in (None, 24):
        m = make_layer(18, E=2 * world)
        xa, xb = (make_inputs(s, per_rank([9, 7, 8, 6], world))[rank].requires_grad_() for s in (18, 19))
        ep = ExpertParallelMoE.from_moe(m, capacity=capacity)
        params = [xa, xb] + list(ep.parameters())
        plain = [ep(xa).output, ep(xb).output]
        g_plain = torch.autograd.grad(plain[0].square().sum() + plain[1].sum(), params)
        one_after_other = [staged(ep, xa), staged(ep, xb)]
        g_one = torch.autograd.grad(one_after_other[0].square().sum() + one_after_other[1].sum(), params)
        da = ep.dispatch(xa)
        ya = ep.experts(da.x_grouped, da.tokens_per_expert)
        db = ep.dispatch(xb)
        oa = ep.combine(da, ya)
        yb = ep.experts(db.x_grouped, db.tokens_per_expert)
        ob = ep.combine(db, yb)
        g = torch.autograd.grad(oa.output.square().sum() + ob.output.sum(), params)
        assert torch.equal(oa.output, one_after_other[0]) and torch.equal(ob.output, one_after_other[1])
        assert all(torch.equal(u, v) for u, v in zip(g, g_one))
        for name, u, v in zip(["out a", "out b"] + [f"grad {i}" for i in range(len(g))], [oa.output, ob.output] + list(g),
                              plain + list(g_plain)):
            if capacity is None:
                assert_close(name, u, v, 1e-13)
            else:
                assert torch.equal(u, v), name
    try:
        ep.combine(da, ya[:-1])
    except ValueError as e:
        assert "argument 'y_grouped': expected a tensor shaped like dispatched.x_grouped" in str(e)
    else:
        raise AssertionError("combine accepted a wrong y_grouped")


class Block(torch.nn.Module):
    """A residual block around the EP layer, as torch.compile would see it in a model."""

    def __init__(self, ep):
        super().__init__()
        self.proj = torch.nn.Linear(D, D, dtype=torch.float64)
        self.moe = ep

    def forward(self, x):
        return x + self.moe(torch.tanh(self.proj(x))).output


def scenario_torch_compile(rank, world):
    """The block compiled (aot_eager: the same autograd graphs inductor gets, without its CPU compile time) equals
    the eager block; capacity mode compiles as one graph (fullgraph=True), the default mode breaks the graph at
    its split-size read. With a frozen router too (the exchanges then hang on a fresh anchor leaf made in the
    graph)."""
    for routing, capacity, frozen in (("topk", None, False), ("topk", 32, False), ("token_rounding", 32, False),
                                      ("topk", None, True), ("topk", 32, True)):
        torch._dynamo.reset()
        m = make_layer(16, E=2 * world, routing=routing, tile=8)
        torch.manual_seed(16)
        block = Block(ExpertParallelMoE.from_moe(m, capacity=capacity))
        block.moe.router_weight.requires_grad_(not frozen)
        x = make_inputs(16, per_rank([10, 9, 8, 7], world))[rank].requires_grad_()
        names = ["x", "proj", "w1", "b2"] + ([] if frozen else ["router"])
        params = [x, block.proj.weight, block.moe.experts.w1, block.moe.experts.b2] + \
            ([] if frozen else [block.moe.router_weight])
        eager = block(x)
        g_eager = torch.autograd.grad(eager.square().sum(), params)
        compiled = torch.compile(block, backend="aot_eager", fullgraph=capacity is not None)
        for _ in range(2):  # the second call runs the cached graphs
            out = compiled(x)
            g = torch.autograd.grad(out.square().sum(), params)
            assert_close("compiled output", out, eager, 1e-13)
            for name, a, b in zip(names, g, g_eager):
                assert_close(f"compiled grad {name}", a, b, 1e-13)
    import machmoe.parallel as P
    assert all(a.grad is None for a in P._FROZEN_ROUTER_ANCHORS.values())  # compiled too: no gradient kept
    torch._dynamo.reset()


def check_fsdp2_training(rank, world, ep_mesh, expert_mesh, dp_mesh, sizes, E=4):
    """Three SGD steps of the EP layer under FSDP2 (shard_experts_fsdp2, then fully_shard over the data-parallel
    ranks) equal those of the single-process layer on all ranks' tokens with the mean of the ranks' losses."""
    from torch.distributed.fsdp import fully_shard
    m = make_layer(17, E=E, aux_loss_coef=0.1)
    xs = make_inputs(17, sizes)
    ep = ExpertParallelMoE.from_moe(m, group=ep_mesh.get_group())
    ignored = shard_experts_fsdp2(ep, expert_mesh)
    fully_shard(ep, mesh=dp_mesh, ignored_params=ignored)
    opt = torch.optim.SGD(ep.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(m.parameters(), lr=0.5)
    for step in range(3):
        o = ep(xs[rank])
        loss = o.output.square().mean() + o.aux_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_opt.zero_grad()
        ref_losses = []
        for x in xs:
            r = m(x)
            ref_losses.append(r.output.square().mean() + r.aux_loss)
        (sum(ref_losses) / world).backward()
        ref_opt.step()
        assert_close(f"step {step} loss", loss.detach(), ref_losses[rank].detach(), 1e-12)
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
    local = slice(ep.expert_offset, ep.expert_offset + ep.num_local_experts)
    assert_close("router after 3 steps", full(ep.router_weight), m.router_weight.detach(), 1e-12)
    for name in ("w1", "w2", "b1", "b2"):
        assert_close(f"{name} after 3 steps", full(getattr(ep.experts, name)), getattr(m, name).detach()[local],
                     1e-12)


def scenario_fsdp2_two_dimensional_mesh(rank, world):
    """4 ranks: EP groups {0,1}, {2,3}; experts sharded by FSDP2 across the EP groups ({0,2}, {1,3}); the router
    over all 4. 8 ranks: EP groups {0..3}, {4..7}, experts sharded over {r, r+4}."""
    from torch.distributed.device_mesh import init_device_mesh
    assert world in (4, 8)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("expert_fsdp", "ep"))
    dp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    check_fsdp2_training(rank, world, mesh["ep"], mesh["expert_fsdp"], dp, per_rank([8, 6, 7, 9], world),
                         E=2 * (world // 2))


def scenario_fsdp2_experts_outside_fsdp(rank, world):
    """EP over the whole data-parallel group: FSDP2 shards the router over it, the experts stay whole."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    check_fsdp2_training(rank, world, mesh, None, mesh, per_rank([8, 6, 7, 9], world))


def scenario_torchtitan_experts_fsdp2(rank, world):
    """torchtitan's GroupedExperts on machmoe under FSDP2 with reshard_after_forward: the backward concatenates the
    gate and up weights again from the parameters FSDP2 gathers once more (their versions unchanged by that), and
    each rank's gradients equal the single process's mean over the ranks' inputs; twice, so the second step's
    gathers are checked too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(23)
    whole = TorchTitanGroupedExperts(D, N, 4, dtype=torch.float64)
    with torch.no_grad():
        whole.init_weights(0.3)
    sharded = TorchTitanGroupedExperts(D, N, 4, dtype=torch.float64)
    sharded.load_state_dict(whole.state_dict())
    fully_shard(sharded, mesh=init_device_mesh("cpu", (world,)), reshard_after_forward=True)
    import machmoe.parallel as P
    parts = []
    original_parts = P._Parts

    class RecordingParts(original_parts):
        __slots__ = ()

        def __init__(self, p, *rest):
            super().__init__(p, *rest)
            parts.append(p)

    counts = [torch.tensor([3, 0, 5, 2]), torch.tensor([1, 4, 0, 4])]
    xs = [torch.randn(11, D, dtype=torch.float64, generator=gen(30 + r)) for r in range(world)]
    gos = [torch.randn(11, D, dtype=torch.float64, generator=gen(40 + r)) for r in range(world)]
    for step in range(2):
        sharded.zero_grad(set_to_none=True)
        whole.zero_grad(set_to_none=True)
        parts.clear()
        P._Parts = RecordingParts
        try:
            y = sharded(xs[rank], counts[rank % 2])
        finally:
            P._Parts = original_parts
        # The hooks took the gathered parameters, whose storage FSDP2 frees after the forward and gathers again for
        # the backward, which concatenates them from there.
        assert len(parts) == 1 and all(p.untyped_storage().nbytes() == 0 for p in parts[0]), parts
        (y * gos[rank]).sum().backward()
        for r in range(world):
            (whole(xs[r], counts[r % 2]) * gos[r]).sum().div(world).backward()
        for name in ("w1", "w2", "w3"):
            ours = getattr(sharded, name).grad.full_tensor()
            assert_close(f"step {step} {name}", ours, getattr(whole, name).grad, 1e-12)


def scenario_fsdp2_moe_sharded_inside_a_model(rank, world):
    """A plain machmoe.MoE sharded by FSDP2 on its own inside a model (not the root), with reshard_after_forward:
    FSDP2 frees its gathered parameters after the forward and gathers them again for its backward from hooks on the
    tensors of its output, which it finds by walking that output (an MoEOutput) as a pytree. Each rank's gradients
    equal the single process's mean over the ranks' inputs; two steps, so the second step's gathers are checked
    too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Block(torch.nn.Module):
        def __init__(self, moe):
            super().__init__()
            self.proj = torch.nn.Linear(D, D, dtype=torch.float64)
            self.moe = moe

        def forward(self, x):
            return self.moe(self.proj(x)).output

    torch.manual_seed(71)
    whole = Block(make_layer(71))
    sharded = Block(make_layer(71))
    sharded.load_state_dict(whole.state_dict())
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(sharded.moe, mesh=mesh, reshard_after_forward=True)
    fully_shard(sharded, mesh=mesh)
    sizes = per_rank([9, 6, 11, 7], world)
    xs = make_inputs(72, sizes)
    gos = [torch.randn(T, D, dtype=torch.float64, generator=gen(73, r)) for r, T in enumerate(sizes)]
    gathered = []  # the parameters the MoE's forward read: FSDP2's gathered ones (its pre-forward hook ran first)
    sharded.moe.register_forward_pre_hook(lambda m, args: gathered.append(list(m.parameters(recurse=False))))
    for step in range(2):
        sharded.zero_grad(set_to_none=True)
        whole.zero_grad(set_to_none=True)
        gathered.clear()
        y = sharded(xs[rank])
        # Freed once the MoE's forward was done: its backward needs FSDP2's gather again.
        assert len(gathered) == 1 and all(p.untyped_storage().nbytes() == 0 for p in gathered[0]), gathered
        (y * gos[rank]).sum().backward()
        for r in range(world):
            (whole(xs[r]) * gos[r]).sum().div(world).backward()
        for name, p in whole.named_parameters():
            ours = dict(sharded.named_parameters())[name].grad.full_tensor()
            assert_close(f"step {step} {name}", ours, p.grad, 1e-12)


def scenario_fsdp2_meta_device_initialisation(rank, world):
    """FSDP2's deferred initialisation (build on meta, shard, to_empty, reset_parameters). With the experts sharded
    over the ranks (an EP group of one, so a 1 x world mesh; 3 experts over 2 ranks: uneven shards), every expert
    gets its documented draw, from a generator seeded with the layer's seed plus its index, and nothing is left as
    to_empty found it. With EP over the whole group, the experts' gradients are divided by ep_size as in the eager
    flow (to_empty replaces the parameters, and hooks on them would be lost)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("expert_fsdp", "ep"))
    with torch.device("meta"):
        ep = ExpertParallelMoE(D, N, 3, 2, group=mesh["ep"].get_group(), dtype=torch.float64)
    shard_experts_fsdp2(ep, mesh["expert_fsdp"])
    fully_shard(ep, mesh=init_device_mesh("cpu", (world,)))
    ep.to_empty(device="cpu")
    with torch.no_grad():
        ep.experts.w1.zero_()
        ep.experts.w2.zero_()
    seed = 1234
    ep.experts.reset_parameters(seed=seed)  # as ep.reset_parameters() does, with the seed it draws
    w1, w2 = ep.experts.w1.full_tensor(), ep.experts.w2.full_tensor()
    for i in range(3):
        g = torch.Generator().manual_seed(seed + i)
        assert torch.equal(w1[i], torch.empty_like(w1[i]).normal_(0.0, 1.0 / math.sqrt(D), generator=g)), i
        assert torch.equal(w2[i], torch.empty_like(w2[i]).normal_(0.0, 1.0 / math.sqrt(N), generator=g)), i

    dp = init_device_mesh("cpu", (world,))
    grads = {}
    for flow in ("eager", "meta"):
        with torch.device("meta" if flow == "meta" else "cpu"):
            layer = ExpertParallelMoE(D, N, 2 * world, 2, dtype=torch.float64)
        fully_shard(layer, mesh=dp, ignored_params=shard_experts_fsdp2(layer))
        if flow == "meta":
            layer.to_empty(device="cpu")
        torch.manual_seed(6)
        ref = ExpertParallelMoE(D, N, 2 * world, 2, dtype=torch.float64)
        with torch.no_grad():
            for name in ("w1", "w2"):
                getattr(layer.experts, name).copy_(getattr(ref.experts, name))
            layer.router_weight.copy_(torch.distributed.tensor.distribute_tensor(
                ref.router_weight, dp, layer.router_weight.placements))
        x = torch.randn(6, D, dtype=torch.float64, generator=gen(7, rank))
        layer(x).output.square().sum().backward()
        grads[flow] = layer.experts.w1.grad.clone()
    assert_close("expert gradient, meta flow against eager", grads["meta"], grads["eager"], 1e-15)


def scenario_initialisation_independent_of_ep_size(rank, world):
    """For one seed, the router is machmoe.MoE's and every expert the same whatever the EP group's size."""
    solo = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    torch.manual_seed(0)
    whole = ExpertParallelMoE(D, N, 2 * world, 2, group=solo, dtype=torch.float64)
    torch.manual_seed(0)
    split = ExpertParallelMoE(D, N, 2 * world, 2, dtype=torch.float64)
    torch.manual_seed(0)
    m = machmoe.MoE(D, N, 2 * world, 2, dtype=torch.float64)
    assert torch.equal(whole.router_weight, m.router_weight) and torch.equal(split.router_weight, m.router_weight)
    local = slice(split.expert_offset, split.expert_offset + split.num_local_experts)
    assert torch.equal(whole.experts.w1[local], split.experts.w1)
    assert torch.equal(whole.experts.w2[local], split.experts.w2)


def scenario_deepcopy_shares_the_process_group(rank, world):
    """copy.deepcopy (torch.optim.swa_utils.AveragedModel's) of a layer on an explicit group: the group is shared,
    the parameters copied, and the copy computes what the layer does."""
    import copy
    group = dist.new_group(list(range(world)))
    ep = ExpertParallelMoE.from_moe(make_layer(8), group=group)
    twin = copy.deepcopy(ep)
    assert twin.group is group and twin.experts.w1 is not ep.experts.w1
    assert torch.equal(twin.experts.w1, ep.experts.w1)
    x = make_inputs(8, per_rank([5, 3], world))[rank]
    assert torch.equal(twin(x).output, ep(x).output)


def scenario_rank_outside_the_group(rank, world):
    """A layer built on a group this rank is not in is refused by name (the group's size reads as -1 there)."""
    others = dist.new_group([r for r in range(world) if r != 0])
    if rank == 0:
        with pytest.raises(ValueError, match="argument 'group': expected a process group this rank belongs to"):
            ExpertParallelMoE(D, N, 4, 2, group=others)


def scenario_autocast_and_expanded_inputs_route_as_machmoe(rank, world):
    """Under torch.autocast the layer computes in machmoe.MoE's dtype (float32 on the CPU, where CPU autocast asks for
    bf16), its router too, so both route alike, for float32 and for bf16 inputs (an autocast Linear's output); an
    input with overlapping rows (expand) is taken, as machmoe.MoE takes it."""
    torch.manual_seed(9)
    m = machmoe.MoE(64, 16, 4 * world, 2, dtype=torch.float32)
    ep = ExpertParallelMoE.from_moe(m)
    x = torch.randn(256, 64, generator=gen(9, rank))
    plain = ep(x)
    xb = x.bfloat16()
    plain_b = ep(xb.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = ep(x)
        ref = m(x)
        mixed_b = ep(xb)
        ref_b = m(xb)
    assert mixed.router_logits.dtype == torch.float32
    assert torch.equal(mixed.expert_counts, plain.expert_counts) and torch.equal(mixed.output, plain.output)
    assert torch.equal(mixed.expert_counts, ref.expert_counts)
    assert mixed_b.output.dtype == torch.float32 and torch.equal(mixed_b.output, plain_b.output)
    assert torch.equal(mixed_b.expert_counts, ref_b.expert_counts)
    assert_close("bf16 input under autocast", mixed_b.output, ref_b.output, 1e-6)
    row = torch.randn(1, 64, generator=gen(10, rank)).expand(5, 64)
    assert_close("expanded input", ep(row).output, m(row.contiguous()).output, 1e-6)


def scenario_one_row_per_token_and_rank(rank, world):
    """The default mode sends a token's row once to each rank that owns at least one of its experts, not once per
    pair, and gets one row back from each: the two row exchanges of the forward carry exactly the distinct
    (token, rank) pairs of the routing (docs/PARALLEL.md). Capacity mode keeps one row per pair."""
    import machmoe.parallel as P
    for routing, capacity in (("topk", None), ("token_rounding", None), ("topk", 64)):
        m = make_layer(21, E=2 * world, K=3, routing=routing, tile=8)
        x = make_inputs(21, per_rank([11, 9, 13, 7], world))[rank]
        ep = ExpertParallelMoE.from_moe(m, capacity=capacity)
        calls, original = [], P._all_to_all

        def recording(rows, out_splits, in_splits, group):
            calls.append((tuple(rows.shape), rows.dtype, out_splits, in_splits))
            return original(rows, out_splits, in_splits, group)

        P._all_to_all = recording
        try:
            ep(x)
        finally:
            P._all_to_all = original
        token, expert, _, _ = route(x @ m.router_weight.t(), top_k=3, routing=routing, rounding=m.rounding, tile=8)
        dest = torch.div(expert, m.num_experts // world, rounding_mode="floor")
        row_calls = [c for c in calls if len(c[0]) == 2 and c[0][1] == D and c[1] == x.dtype]
        assert len(row_calls) == 2, calls  # rows out, rows back
        if capacity is None:
            distinct = torch.unique(token * world + dest)
            rows_to = torch.bincount(distinct % world, minlength=world).tolist()
            assert row_calls[0][3] == rows_to and row_calls[1][2] == rows_to, (routing, row_calls, rows_to)
            if world == 2 and routing == "topk":  # 3 experts on 2 ranks: every token has two pairs on one rank
                assert sum(rows_to) == x.shape[0] * 2 - int((dest.view(-1, 3) == dest.view(-1, 3)[:, :1]).all(1).sum())
                assert sum(rows_to) < token.shape[0]
        else:
            assert row_calls[0][0][0] == world * capacity  # the static blocks of one row per pair


def scenario_fsdp2_mixed_precision_keeps_scores(rank, world):
    """FSDP2 mixed precision on the experts (float32 compute for a float64 layer, as bf16 for float32 would be on
    GPUs): the rows reach the experts cast, the pairs' scores as the routing made them (ExpertPairs is not walked by
    FSDP2's input cast; a keyword tensor would be rounded), and output and input gradient match the float64 layer
    to float32's level."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    import machmoe.parallel as P
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("expert_fsdp", "ep"))
    m = make_layer(23, E=2 * (world // 2))
    x = make_inputs(23, per_rank([8, 6, 7, 9], world))[rank].requires_grad_()
    ep = ExpertParallelMoE.from_moe(m, group=mesh["ep"].get_group())
    shard_experts_fsdp2(ep, mesh["expert_fsdp"], mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
    seen, original = [], P._run_pairs

    def spy(rows, token_index, expert_index, scores, *args, **kwargs):
        seen.append((rows.dtype, scores.dtype))
        return original(rows, token_index, expert_index, scores, *args, **kwargs)

    P._run_pairs = spy
    try:
        out = ep(x).output
    finally:
        P._run_pairs = original
    assert seen == [(torch.float32, torch.float64)], seen
    g = upstream(23, rank, x.shape[0], 2, torch.float64)[0]
    (dx,) = torch.autograd.grad((out * g).sum(), [x])
    ref_x = x.detach().clone().requires_grad_()
    ref = m(ref_x).output
    (ref_dx,) = torch.autograd.grad((ref * g).sum(), [ref_x])
    assert out.dtype == torch.float32
    assert_close("output", out.double(), ref, 1e-5)
    assert_close("grad x", dx, ref_dx, 1e-5)
    # Capacity mode (no overflow at this capacity) combines the returned float32 rows with the float64 routing's
    # scores cast to the rows' score dtype, as the default mode does.
    ep_cap = ExpertParallelMoE.from_moe(m, group=mesh["ep"].get_group(), capacity=64)
    shard_experts_fsdp2(ep_cap, mesh["expert_fsdp"], mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
    out_cap = ep_cap(x).output
    (dx_cap,) = torch.autograd.grad((out_cap * g).sum(), [x])
    assert out_cap.dtype == torch.float32
    assert_close("capacity output", out_cap.double(), ref, 1e-5)
    assert_close("capacity grad x", dx_cap, ref_dx, 1e-5)


# ---- argument checks: every rank raises, before any communication ----------------------------------------------
# These run in a group with a short timeout (CHECKS_TIMEOUT_S): a rank that does not raise while the others do waits
# in a collective for them, and the timeout turns that hang into a failure.

CHECKS_TIMEOUT_S = 10


def rank0_only_layer(seed, world):
    """A layer and inputs under which rank 0 alone has tokens, all routed to rank 0's experts: every other rank
    receives no rows and skips the experts call (the case where checks made only there would not be made)."""
    E = 2 * world
    m = skewed_layer(seed, E, world, 8.0, bias=False)
    x = skewed_inputs(seed, [6] + [0] * (world - 1), 0.2)
    return m, E, x


def expect_raised_on_every_rank(rank, error, match, fn):
    """fn() raises error (message matching `match`) on this rank, promptly: well before the group's timeout, which a
    rank still waiting in a collective for a rank that raised would reach. Then a collective that every rank enters
    shows that none is still inside one."""
    import re
    start = time.monotonic()
    try:
        fn()
    except error as e:
        assert re.search(match, str(e)), f"rank {rank}: {e}"
    else:
        raise AssertionError(f"rank {rank}: no {error.__name__} matching {match!r}")
    elapsed = time.monotonic() - start
    assert elapsed < CHECKS_TIMEOUT_S / 2, f"rank {rank}: raised after {elapsed:.1f} s (waited in a collective?)"
    flag = torch.ones(1)
    dist.all_reduce(flag)
    assert int(flag) == dist.get_world_size()


def scenario_options_checked_on_every_rank(rank, world):
    m, E, xs = rank0_only_layer(30, world)
    El = E // world
    x = xs[rank]
    local = slice(rank * El, (rank + 1) * El)
    w1, w2 = m.w1[local].detach(), m.w2[local].detach()
    _, _, counts, _ = expert_parallel_moe(x, m.router_weight, w1, w2, top_k=2)
    c = counts.to(torch.int64)
    dist.all_reduce(c)
    assert int(c[:El].sum()) == int(c.sum()) > 0, c  # as intended: only rank 0 receives rows
    expect_raised_on_every_rank(rank, ValueError, "argument 'activation_memory': expected one of .*, got 'bogus'",
                                lambda: expert_parallel_moe(x, m.router_weight, w1, w2, top_k=2,
                                                            activation_memory="bogus"))
    # relu experts have n rows in w1: the shapes are right, the layout is not (a GLU-only option).
    w1_relu = w1[:, :N].contiguous()
    expect_raised_on_every_rank(rank, ValueError, "argument 'weight_layout': expected 'interleaved' for the non-GLU "
                                "activation 'relu'",
                                lambda: expert_parallel_moe(x, m.router_weight, w1_relu, w2, top_k=2,
                                                            activation="relu", weight_layout="concatenated"))
    for capacity in (None, 16):
        expect_raised_on_every_rank(rank, ValueError, "argument 'activation_memory'",
                                    lambda: expert_parallel_moe(x, m.router_weight, w1, w2, top_k=2,
                                                                capacity=capacity, activation_memory="bogus"))
    out, _, _, _ = expert_parallel_moe(x, m.router_weight, w1, w2, top_k=2)  # the group still works
    assert out.shape == x.shape


def scenario_module_experts_checked_on_every_rank(rank, world):
    m, _, xs = rank0_only_layer(31, world)
    for capacity in (None, 16):
        ep = ExpertParallelMoE.from_moe(m, capacity=capacity)
        ep.experts.float()  # experts in float32 under a float64 router and input: refused on every rank
        expect_raised_on_every_rank(rank, ValueError, "argument 'experts.w1': expected dtype torch.float64 \\(the "
                                    "dtype of x\\), got torch.float32", lambda: ep(xs[rank]))
        # Where a pre-forward hook may change the experts (FSDP2 gathers and casts there), the experts call checks
        # them instead, on every rank, the one without rows included.
        handle = ep.experts.register_forward_pre_hook(lambda module, args: None)
        expect_raised_on_every_rank(rank, ValueError, "argument 'w1': expected dtype torch.float64",
                                    lambda: ep(xs[rank]))
        handle.remove()
        ep.experts.double()
        assert ep(xs[rank]).output.shape == xs[rank].shape


def scenario_loss_coefficients_checked(rank, world):
    for name in ("aux_loss_coef", "z_loss_coef"):
        with pytest.raises(ValueError, match=f"argument '{name}': expected a finite real number >= 0 .*, got -0.01"):
            ExpertParallelMoE(D, N, 2 * world, 2, **{name: -0.01})
        with pytest.raises(TypeError, match=f"argument '{name}': expected a real number >= 0, got '0.1' \\(str\\)"):
            ExpertParallelMoE(D, N, 2 * world, 2, **{name: "0.1"})
        ep = ExpertParallelMoE(D, N, 2 * world, 2, **{name: np.float32(0.5)})
        assert getattr(ep, name) == 0.5 and type(getattr(ep, name)) is float
        with pytest.raises(ValueError, match=f"argument '{name}'.*got -1"):
            setattr(ep, name, -1)  # set later: checked too, where forward would have skipped the loss
        with pytest.raises(TypeError, match=f"argument '{name}'"):
            setattr(ep, name, "0.1")
        assert getattr(ep, name) == 0.5


def scenario_integer_like_options(rank, world):
    m = make_layer(32, E=2 * world, routing="token_rounding", tile=8)
    x = make_inputs(32, per_rank([9, 11, 4, 7], world))[rank]
    for capacity in (None, 32):
        ref = ExpertParallelMoE.from_moe(m, capacity=capacity)(x).output
        for cast in (np.int64, np.int32, torch.tensor):
            ep = ExpertParallelMoE(cast(D), cast(N), cast(2 * world), cast(2), routing="token_rounding",
                                   tile=cast(8), capacity=None if capacity is None else cast(capacity),
                                   dtype=torch.float64, bias=True)
            assert all(type(v) is int for v in (ep.hidden_size, ep.num_experts, ep.top_k, ep.tile))
            assert capacity is None or type(ep.capacity) is int
            ep.load_state_dict(ExpertParallelMoE.from_moe(m, capacity=capacity).state_dict())
            assert torch.equal(ep(x).output, ref)
            out, _, _, _ = expert_parallel_moe(x, ep.router_weight, ep.experts.w1, ep.experts.w2, ep.experts.b1,
                                               ep.experts.b2, top_k=cast(2), routing="token_rounding", tile=cast(8),
                                               capacity=None if capacity is None else cast(capacity))
            assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="argument 'top_k': expected an integer in \\[1, 4\\] \\(the number of "
                                         "experts\\), got 5"):
        ExpertParallelMoE(D, N, 4, np.int64(5))
    with pytest.raises(TypeError, match="argument 'top_k': expected an integer, got 2.0"):
        ExpertParallelMoE(D, N, 4, 2.0)
    # The same bound on the tile as machmoe.MoE (and the operators): refused at construction, not in forward.
    with pytest.raises(ValueError, match="argument 'tile': expected a multiple of 8 in \\[8, 4096\\], got 8192"):
        ExpertParallelMoE(D, N, 4, 2, tile=8192)
    with pytest.raises(ValueError, match="argument 'tile'"):
        expert_parallel_moe(x, m.router_weight, m.w1[:2], m.w2[:2], top_k=2, tile=8192)


def scenario_repr_names_the_rank(rank, world):
    m = ExpertParallelMoE(D, N, 2 * world, 2, capacity=16, routing="token_rounding", tile=8, bias=True)
    want = (f"ExpertParallelMoE(\n  hidden_size={D}, intermediate_size={N}, num_experts={2 * world}, top_k=2, "
            f"ep_size={world}, ep_rank={rank}, capacity=16, routing='token_rounding', tile=8\n"
            f"  (experts): GroupedExperts(hidden_size={D}, intermediate_size={N}, num_experts=2, activation='swiglu', "
            f"bias=True)\n)")
    assert repr(m) == want, repr(m)


def scenario_input_messages(rank, world):
    ep = ExpertParallelMoE.from_moe(make_layer(33, E=2 * world))
    with pytest.raises(TypeError, match="argument 'x': expected a torch.Tensor, got NoneType"):
        ep(None)
    with pytest.raises(ValueError, match=f"argument 'x': expected a tensor of shape \\(..., {D}\\), got shape "
                                         "\\(\\)"):
        ep(torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(TypeError, match="argument 'x': expected a torch.Tensor, got list"):
        ep.dispatch([[0.0] * D])


SCENARIOS_2_CHECKS = ["options_checked_on_every_rank", "module_experts_checked_on_every_rank",
                      "loss_coefficients_checked", "integer_like_options", "input_messages", "repr_names_the_rank"]


SCENARIOS_2 = [
    "topk_float64", "topk_float32_geglu_concatenated", "token_rounding_float64", "token_rounding_up_relu",
    "skewed_routing", "rank_without_tokens", "rank_receives_nothing", "num_experts_not_divisible",
    "argument_errors", "functional_equals_module", "bitwise_reruns", "capacity_without_overflow",
    "capacity_overflow", "host_synchronisations", "input_requires_grad_on_one_rank_only", "torch_compile",
    "staged_micro_batches_interleaved", "fsdp2_experts_outside_fsdp", "one_row_per_token_and_rank",
    "torchtitan_experts_fsdp2", "default_mode_keeps_no_returned_rows", "fsdp2_moe_sharded_inside_a_model",
    "fsdp2_meta_device_initialisation", "initialisation_independent_of_ep_size", "deepcopy_shares_the_process_group",
    "rank_outside_the_group", "autocast_and_expanded_inputs_route_as_machmoe",
]
SCENARIOS_4 = ["topk_float64", "token_rounding_float64", "rank_without_tokens", "capacity_overflow",
               "fsdp2_two_dimensional_mesh", "one_row_per_token_and_rank", "fsdp2_mixed_precision_keeps_scores"]
# 8 ranks (the size of one 8-GPU host): the layer against the single process, skewed routing, ranks without tokens
# and ranks whose experts receive nothing, capacity overflow, bitwise reruns, FSDP2 on a 2 x 4 mesh.
SCENARIOS_8 = ["topk_float64", "token_rounding_float64", "skewed_routing", "rank_without_tokens",
               "rank_receives_nothing", "capacity_overflow", "bitwise_reruns", "fsdp2_two_dimensional_mesh"]


# ---- the process harness ------------------------------------------------------------------------------------------

def _worker(rank, world, port, module_name, names, out_dir, backend, timeout_s=120):
    """One rank: runs module_name's scenario_<name>(rank, world) for every name, recording each outcome."""
    import importlib
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=torch.device("cuda", rank) if backend == "nccl" else None)
    module = importlib.import_module(module_name)
    results, failed = {}, None
    path = os.path.join(out_dir, f"rank{rank}.json")
    for name in names:
        if failed is not None:
            results[name] = f"not run: scenario {failed!r} failed before it on rank {rank}"
        else:
            try:
                getattr(module, "scenario_" + name)(rank, world)
                results[name] = "ok"
            except BaseException:  # noqa: B902 — recorded and reported by the parent
                results[name] = traceback.format_exc()
                failed = name
        with open(path, "w") as f:
            json.dump(results, f)
    if failed is None:
        dist.barrier()
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_scenarios(world, module_name, names, out_dir, backend="gloo", timeout_s=120):
    """Runs the scenarios on `world` processes, whose collectives fail after timeout_s; returns
    ({rank: {name: "ok" | traceback}}, error or None)."""
    error = None
    try:
        mp.spawn(_worker, args=(world, _free_port(), module_name, names, out_dir, backend, timeout_s), nprocs=world,
                 join=True)
    except Exception as e:  # a crashed worker: its scenarios show up as missing
        error = f"worker processes failed: {e}"
    results = {}
    for rank in range(world):
        path = os.path.join(out_dir, f"rank{rank}.json")
        results[rank] = json.load(open(path)) if os.path.exists(path) else {}
    return results, error


def assert_scenario(results_and_error, name):
    results, error = results_and_error
    problems = [f"rank {r}: {res.get(name, 'no result (worker died?)')}" for r, res in results.items()
                if res.get(name) != "ok"]
    assert not problems, "\n".join(problems + ([error] if error else []))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn_scenarios(2, __name__, SCENARIOS_2, str(tmp_path_factory.mktemp("ep2")))


@pytest.fixture(scope="module")
def two_ranks_checks(tmp_path_factory):
    return spawn_scenarios(2, __name__, SCENARIOS_2_CHECKS, str(tmp_path_factory.mktemp("ep2checks")),
                           timeout_s=CHECKS_TIMEOUT_S)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return spawn_scenarios(4, __name__, SCENARIOS_4, str(tmp_path_factory.mktemp("ep4")))


@pytest.fixture(scope="module")
def eight_ranks(tmp_path_factory):
    return spawn_scenarios(8, __name__, SCENARIOS_8, str(tmp_path_factory.mktemp("ep8")))


@pytest.mark.parametrize("name", SCENARIOS_2)
def test_two_ranks(two_ranks, name):
    assert_scenario(two_ranks, name)


@pytest.mark.parametrize("name", SCENARIOS_2_CHECKS)
def test_two_ranks_argument_checks(two_ranks_checks, name):
    assert_scenario(two_ranks_checks, name)


@pytest.mark.parametrize("name", SCENARIOS_4)
def test_four_ranks(four_ranks, name):
    assert_scenario(four_ranks, name)


@pytest.mark.parametrize("name", SCENARIOS_8)
def test_eight_ranks(eight_ranks, name):
    assert_scenario(eight_ranks, name)


# ---- in one process ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("score", ["softmax_topk", "topk_softmax", "topk_softmax_renorm"])
@pytest.mark.parametrize("routing,rounding", [("topk", "nearest"), ("token_rounding", "nearest"),
                                              ("token_rounding", "up"), ("token_rounding", "down")])
def test_route_is_the_library_routing(score, routing, rounding):
    """EP routes in PyTorch on each rank; moe_from_routing on those triples must be machmoe.moe (values, counts,
    and the router gradient through the scores)."""
    m = make_layer(15, E=6, K=2)
    x = make_inputs(15, [40])[0].requires_grad_()
    opts = dict(top_k=2, score=score, routing=routing, rounding=rounding, tile=8)
    out, logits, counts = machmoe.moe(x, m.router_weight, m.w1, m.w2, m.b1, m.b2, **opts)
    tok, exp, s, c = route(x @ m.router_weight.T, **opts)
    out2, _ = machmoe.moe_from_routing(x, m.w1, m.w2, tok, exp, s, m.b1, m.b2, max_experts_per_token=6)
    assert torch.equal(c, counts.long())
    assert_close("output", out2, out, 1e-13)
    go = torch.randn_like(out)
    params = [x, m.router_weight, m.w1, m.b2]
    for name, a, b in zip(["x", "router", "w1", "b2"], torch.autograd.grad((out2 * go).sum(), params),
                          torch.autograd.grad((out * go).sum(), params)):
        assert_close(name, a, b, 1e-12)


def test_route_breaks_ties_to_the_lower_expert_and_ranks_nan_last():
    logits = torch.tensor([[1.0, 3.0, 3.0, float("nan")], [2.0, 2.0, 2.0, 2.0]], dtype=torch.float64)
    tok, exp, _, counts = route(logits, top_k=2)
    assert exp.tolist() == [1, 2, 0, 1] and tok.tolist() == [0, 0, 1, 1] and counts.tolist() == [1, 2, 1, 0]


def test_token_rounding_ranks_candidates_by_p_itself_in_float32():
    """Padded candidates rank by p = softmax(z)[e] itself, as the library's keys do (docs/ROUTING.md), not by p - 1,
    whose float32 rounding ties every p within 6e-8: here p grows with the token, ~1e-11 apart, and rounding up must
    pad with the largest, in float32 as in float64."""
    T = 16
    logits = torch.zeros(T, 2, dtype=torch.float64)
    logits[:, 1] = -25.0 + 0.1 * torch.arange(T)
    logits[T - 1, 1] = 5.0  # token 15 alone chooses expert 1: one pair, rounded up to the tile of 8
    for dtype in (torch.float64, torch.float32):
        tok, exp, _, _ = route(logits.to(dtype), top_k=1, routing="token_rounding", rounding="up", tile=8)
        assert tok[exp == 1].tolist() == list(range(8, 16)), dtype


def test_token_rounding_ranks_nan_first_within_its_class():
    """A row of NaN logits (every p NaN; top-K gives it expert 0) ranks first among expert 1's padded candidates,
    before the finite ones, which follow by p."""
    logits = torch.stack([torch.zeros(9), -30.0 + torch.arange(9.0)], 1)  # p of expert 1 grows with the token
    logits[2] = float("nan")
    logits[4, 1] = 5.0  # token 4 alone chooses expert 1: rounded up to 8, all but one of the others padded
    tok, exp, _, _ = route(logits, top_k=1, routing="token_rounding", rounding="up", tile=8)
    assert tok[exp == 1].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]  # token 0, of the smallest p, left out; not the NaN


def grouped_reference(x, counts, w1, w2, b1, b2, activation, layout):
    """Row i through expert(i)'s MLP, rows beyond sum(counts) zero."""
    counts = [int(c) for c in counts]
    exp = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    real = sum(counts)
    ones = torch.ones(real, dtype=x.dtype)
    y = reference_experts(x[:real], torch.arange(real), exp, ones, w1, w2, b1, b2, activation, layout)
    return torch.cat([y, x.new_zeros(x.shape[0] - real, x.shape[1])])


@pytest.mark.parametrize("activation,layout", [("swiglu", "interleaved"), ("geglu", "concatenated"),
                                               ("relu", "interleaved")])
def test_grouped_experts_module_with_padding_rows(activation, layout):
    torch.manual_seed(16)
    ge = GroupedExperts(D, N, 3, activation, bias=True, weight_layout=layout, dtype=torch.float64)
    with torch.no_grad():
        ge.b1.normal_()
        ge.b2.normal_()
    counts = torch.tensor([4, 0, 3])
    x = torch.randn(10, D, dtype=torch.float64, requires_grad=True)  # 3 padding rows at the end
    y = ge(x, counts)
    ref = grouped_reference(x, counts, ge.w1, ge.w2, ge.b1, ge.b2, activation, layout)
    assert_close("output", y, ref, 1e-13)
    assert y[7:].abs().max() == 0
    go = torch.randn_like(y)
    params = [x] + list(ge.parameters())
    for a, b in zip(torch.autograd.grad((y * go).sum(), params), torch.autograd.grad((ref * go).sum(), params)):
        assert_close("grad", a, b, 1e-12)


def test_grouped_experts_module_zero_rows():
    ge = GroupedExperts(D, N, 2, bias=True, dtype=torch.float64)
    x = torch.zeros(0, D, dtype=torch.float64, requires_grad=True)
    y = ge(x, torch.zeros(2, dtype=torch.int64))
    assert y.shape == (0, D)
    y.sum().backward()
    for p in ge.parameters():  # zero gradients, not None: the optimizer and FSDP see a gradient every step
        assert p.grad is not None and p.grad.abs().max() == 0
    assert x.grad is not None and x.grad.shape == (0, D)


@pytest.mark.parametrize("activation,layout", [("swiglu", "interleaved"), ("geglu", "concatenated")])
def test_grouped_experts_module_rows_in_any_order(activation, layout):
    """expert_index instead of counts (what ExpertParallelMoE's forward uses on the rows as they arrive): row i goes
    through expert expert_index[i]; the result and every gradient equal the grouped call on the same rows sorted by
    expert (stably), bitwise, and the float64 reference."""
    torch.manual_seed(21)
    ge = GroupedExperts(D, N, 3, activation, bias=True, weight_layout=layout, dtype=torch.float64)
    with torch.no_grad():
        ge.b1.normal_()
        ge.b2.normal_()
    expert = torch.tensor([2, 0, 2, 1, 0, 0, 2, 2, 1])  # no expert is contiguous
    x = torch.randn(expert.shape[0], D, dtype=torch.float64, requires_grad=True)
    y = ge(x, expert_index=expert)
    order = torch.sort(expert, stable=True).indices
    y_grouped = ge(x[order], torch.bincount(expert, minlength=3))
    ref = torch.empty_like(y_grouped).index_copy_(0, order, y_grouped)
    assert torch.equal(y, ref)
    expected = reference_experts(x, torch.arange(x.shape[0]), expert, torch.ones(x.shape[0], dtype=x.dtype),
                                 ge.w1, ge.w2, ge.b1, ge.b2, activation, layout)
    assert_close("output", y, expected, 1e-13)
    go = torch.randn_like(y)
    params = [x] + list(ge.parameters())
    for a, b in zip(torch.autograd.grad((y * go).sum(), params), torch.autograd.grad((ref * go).sum(), params)):
        assert torch.equal(a, b)
    empty = ge(x[:0], expert_index=expert[:0])  # no rows: zero gradients, not None
    assert empty.shape == (0, D)
    assert all(g is not None and g.abs().max() == 0
               for g in torch.autograd.grad(empty.sum(), list(ge.parameters()), allow_unused=True))


def test_grouped_experts_module_errors():
    ge = GroupedExperts(D, N, 2, dtype=torch.float64)
    x = torch.randn(4, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="'num_tokens_per_expert': expected a \\(2,\\) tensor"):
        ge(x, torch.tensor([1, 2, 1]))
    with pytest.raises(ValueError, match=f"'x': expected a \\(rows, {D}\\) tensor"):
        ge(x[:, :3], torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="'weight_layout'"):
        GroupedExperts(D, N, 2, "relu", weight_layout="concatenated")
    with pytest.raises(ValueError, match="'expert_index': expected a \\(4,\\) tensor \\(one expert per row of x\\)"):
        ge(x, expert_index=torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match="'expert_index': expected integer indices"):
        ge(x, expert_index=torch.zeros(4))
    with pytest.raises(ValueError, match="'num_tokens_per_expert': expected None when expert_index is given"):
        ge(x, torch.tensor([2, 2]), expert_index=torch.tensor([0, 1, 1, 0]))


def test_grouped_experts_sizes_and_bias_checked():
    """Sizes as machmoe.MoE takes them: numpy integers and 0-d tensors become ints; anything else is refused with
    the argument's name, not a torch.empty error."""
    ge = GroupedExperts(np.int64(D), torch.tensor(N), np.int32(2), dtype=torch.float64)
    assert (ge.hidden_size, ge.intermediate_size, ge.num_experts) == (D, N, 2)
    assert all(type(v) is int for v in (ge.hidden_size, ge.intermediate_size, ge.num_experts))
    assert ge.w1.shape == (2, 2 * N, D)
    with pytest.raises(ValueError, match="machmoe: argument 'hidden_size': expected an integer >= 1, got 0"):
        GroupedExperts(0, N, 2)
    with pytest.raises(ValueError, match="machmoe: argument 'num_experts': expected an integer >= 1, got -2"):
        GroupedExperts(D, N, -2)
    with pytest.raises(TypeError, match="machmoe: argument 'intermediate_size': expected an integer, got 4.0"):
        GroupedExperts(D, 4.0, 2)
    with pytest.raises(TypeError, match="machmoe: argument 'bias': expected a bool, got str"):
        GroupedExperts(D, N, 2, bias="no")  # would have created biases


@pytest.mark.parametrize("cast", [np.int64, np.int32, torch.tensor])
def test_route_takes_integer_like_options(cast):
    """top_k and tile as machmoe.MoE takes them (numpy integers, 0-d tensors), not only Python ints: np.int64(2) was
    refused with 'expected an integer in [1, 4], got 2'."""
    logits = torch.randn(20, 4, generator=gen("route-int"), dtype=torch.float64)
    for routing in ("topk", "token_rounding"):
        ref = route(logits, top_k=2, routing=routing, tile=8)
        got = route(logits, top_k=cast(2), routing=routing, tile=cast(8))
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), routing
    with pytest.raises(ValueError, match="argument 'top_k': expected an integer in \\[1, 4\\] \\(the number of "
                                         "experts\\), got 5"):
        route(logits, top_k=cast(5))
    with pytest.raises(ValueError, match="argument 'tile': expected a multiple of 8 in \\[8, 4096\\], got 8192"):
        route(logits, top_k=2, tile=cast(8192))
    with pytest.raises(TypeError, match="argument 'top_k': expected an integer, got True"):
        route(logits, top_k=True)


def titan_reference(x, num_tokens_per_expert, w1, w2, w3):
    """torchtitan's GroupedExperts semantics in plain PyTorch: per expert, w2(silu(w1 x) * w3 x); padding rows 0."""
    counts = [int(c) for c in num_tokens_per_expert]
    outs, start = [], 0
    for e, c in enumerate(counts):
        xe = x[start:start + c]
        outs.append((torch.nn.functional.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
        start += c
    outs.append(x.new_zeros(x.shape[0] - start, x.shape[1]))
    return torch.cat(outs)


def test_torchtitan_adapter_matches_pure_pytorch_grouped_experts():
    torch.manual_seed(17)
    tt = TorchTitanGroupedExperts(D, N, 4, use_grouped_mm=True, dtype=torch.float64)
    tt.init_weights(0.3)
    assert [name for name, _ in tt.named_parameters()] == ["w1", "w2", "w3"]
    assert tt.w1.shape == (4, N, D) and tt.w2.shape == (4, D, N) and tt.w3.shape == (4, N, D)
    counts = torch.tensor([3.0, 0.0, 5.0, 2.0])  # float, as torchtitan's histc gives them
    x = torch.randn(12, D, dtype=torch.float64, requires_grad=True)  # 2 alignment-padding rows
    y = tt(x, counts)
    ref = titan_reference(x, counts, tt.w1, tt.w2, tt.w3)
    assert_close("output", y, ref, 1e-13)
    go = torch.randn_like(y)
    params = [x, tt.w1, tt.w2, tt.w3]
    for name, a, b in zip(["x", "w1", "w2", "w3"], torch.autograd.grad((y * go).sum(), params),
                          torch.autograd.grad((ref * go).sum(), params)):
        assert_close(name, a, b, 1e-12)


class TorchTitan03GroupedExperts(torch.nn.Module):
    """torchtitan 0.3's GroupedExperts as far as the forward is concerned (torchtitan/models/common/moe.py): built from
    a Config, weights w1_EFD (gate), w2_EDF (down), w3_EFD (up); its forward transcribed per expert in float64 (it
    runs torch._grouped_mm in bf16). torchtitan 0.3 itself needs tyro, spmd_types and more to import."""

    @dataclass
    class Config:
        dim: int
        hidden_dim: int
        num_experts: int

    def __init__(self, config):
        super().__init__()
        E, F, Dm = config.num_experts, config.hidden_dim, config.dim
        self.w1_EFD = torch.nn.Parameter(torch.randn(E, F, Dm, dtype=torch.float64) / math.sqrt(Dm))
        self.w2_EDF = torch.nn.Parameter(torch.randn(E, Dm, F, dtype=torch.float64) / math.sqrt(F))
        self.w3_EFD = torch.nn.Parameter(torch.randn(E, F, Dm, dtype=torch.float64) / math.sqrt(Dm))

    def forward(self, x_RD, num_tokens_per_expert_E):
        return titan_reference(x_RD, num_tokens_per_expert_E, self.w1_EFD, self.w2_EDF, self.w3_EFD)


def test_torchtitan_03_forward_on_machmoe():
    """torchtitan 0.3 users replace GroupedExperts.forward with machmoe's (their Config, initialisation and sharding
    stay): the same output and gradients, padding rows zero, and the weights keep their names."""
    torch.manual_seed(19)
    experts = TorchTitan03GroupedExperts(TorchTitan03GroupedExperts.Config(dim=D, hidden_dim=N, num_experts=4))
    counts = torch.tensor([2.0, 5.0, 0.0, 3.0])
    x = torch.randn(11, D, dtype=torch.float64, requires_grad=True)  # 1 alignment-padding row
    ref = experts(x, counts)

    class Patched(TorchTitan03GroupedExperts):
        forward = torchtitan_experts_forward

    patched = Patched(TorchTitan03GroupedExperts.Config(dim=D, hidden_dim=N, num_experts=4))
    patched.load_state_dict(experts.state_dict())
    assert [n for n, _ in patched.named_parameters()] == ["w1_EFD", "w2_EDF", "w3_EFD"]
    y = patched(x, counts)
    assert_close("output", y, ref, 1e-13)
    assert y[10].abs().max() == 0
    go = torch.randn_like(y)
    ours = torch.autograd.grad((y * go).sum(), [x] + list(patched.parameters()))
    theirs = torch.autograd.grad((ref * go).sum(), [x] + list(experts.parameters()))
    for name, a, b in zip(["x", "w1_EFD", "w2_EDF", "w3_EFD"], ours, theirs):
        assert_close(name, a, b, 1e-12)
    assert_close("as a function", torchtitan_experts_forward(experts, x, counts), ref, 1e-13)


def test_torchtitan_experts_forward_errors():
    lin = torch.nn.Linear(D, D)
    with pytest.raises(TypeError, match=r"torchtitan's GroupedExperts weights \(w1, w2, w3, or w1_EFD, w2_EDF, "
                                        r"w3_EFD\), got Linear with parameters \['weight', 'bias'\]"):
        torchtitan_experts_forward(lin, torch.randn(3, D), torch.tensor([3, 0, 0, 0]))
    bad = TorchTitanGroupedExperts(D, N, 4, dtype=torch.float64)
    bad.w3 = torch.nn.Parameter(torch.zeros(4, N + 1, D, dtype=torch.float64))
    with pytest.raises(ValueError, match="gate and up weights"):
        torchtitan_experts_forward(bad, torch.randn(3, D, dtype=torch.float64), torch.tensor([3, 0, 0, 0]))
    tt = TorchTitanGroupedExperts(D, N, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="num_tokens_per_expert"):
        torchtitan_experts_forward(tt, torch.randn(3, D, dtype=torch.float64), torch.tensor([3, 0, 0]))
    # Counts beyond the rows: refused on the CPU, in the caller's terms (the padding rows' count would otherwise
    # absorb a small excess silently, or come out negative under another argument's name).
    x10 = torch.randn(10, D, dtype=torch.float64)
    for counts, shown in (([3, 3, 3, 3], "summing to 12"), ([5, 5, 5, 0], "summing to 15"),
                          ([2.0, -1.0, 3.0, 0.0], "summing to 4")):
        with pytest.raises(ValueError, match=f"'num_tokens_per_expert': expected non-negative counts summing to at "
                                             f"most 10 .*{shown}"):
            torchtitan_experts_forward(tt, x10, torch.tensor(counts))
        with pytest.raises(ValueError, match="'num_tokens_per_expert': expected non-negative counts"):
            GroupedExperts(D, N, 4, dtype=torch.float64)(x10, torch.tensor(counts))
    assert torchtitan_experts_forward(tt, x10, torch.tensor([3.0, 3.0, 4.0, 0.0])).shape == (10, D)  # histc floats


def _titan_case(seed):
    torch.manual_seed(seed)
    tt = TorchTitanGroupedExperts(D, N, 4, dtype=torch.float64)
    with torch.no_grad():
        tt.init_weights(0.3)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(11, D, dtype=torch.float64, requires_grad=True)  # 1 alignment-padding row
    return tt, counts, x, torch.randn(11, D, dtype=torch.float64)


def _titan_grads(tt, x, y, go, **kwargs):
    return torch.autograd.grad((y * go).sum(), [x, tt.w1, tt.w2, tt.w3], **kwargs)


def test_torchtitan_reads_gate_and_up_weights_in_place(monkeypatch):
    """w3 after w1 in memory (as two allocations in a row, or FSDP2's gathered parameters, give it): the layer reads
    both in place as the halves of one view, with no [w1; w3] copy in the forward or the backward, w1's and w3's
    gradients are contiguous tensors of their own (no split copy), and everything equals the concatenating form
    bitwise (w3 placed before w1) and torchtitan's math to 1e-12."""
    import machmoe.parallel as P
    tt, counts, x, go = _titan_case(21)
    place_gate_up(tt, up_after_gate=False)
    P._CONCATENATION_NOTED.discard("cpu")
    with pytest.warns(UserWarning, match="cannot be read in place"):
        y_cat = tt(x, counts)
    cat_grads = _titan_grads(tt, x, y_cat, go)
    place_gate_up(tt, up_after_gate=True)
    assert P._halves_viewable(tt.w1, tt.w3)
    copies = []
    cat, stack = torch.cat, torch.stack

    def recording(f):
        def call(tensors, dim=0, **kw):
            copies.append(f.__name__)
            return f(tensors, dim=dim, **kw)
        return call

    monkeypatch.setattr(torch, "cat", recording(cat))
    monkeypatch.setattr(torch, "stack", recording(stack))
    y = tt(x, counts)
    grads = _titan_grads(tt, x, y, go)
    monkeypatch.setattr(torch, "cat", cat)
    monkeypatch.setattr(torch, "stack", stack)
    assert copies == [], copies
    assert grads[1].is_contiguous() and grads[3].is_contiguous()
    assert grads[1].untyped_storage().data_ptr() == grads[3].untyped_storage().data_ptr()  # halves of one gradient
    assert torch.equal(y, y_cat)
    for name, a, b in zip(["x", "w1", "w2", "w3"], grads, cat_grads):
        assert torch.equal(a, b), name
    ref = titan_reference(x, counts, tt.w1, tt.w2, tt.w3)
    for name, a, b in zip(["x", "w1", "w2", "w3"], grads, _titan_grads(tt, x, ref, go)):
        assert_close(name, a, b, 1e-12)
    # Saved as the parts: the view the backward reads is taken again from the parameters as they are then; moved
    # meanwhile (here: w3 now before w1), W1 is stacked into the forward's (E, 2, n, d) form, whose shape autograd
    # holds its gradient to.
    y = tt(x, counts)
    place_gate_up(tt, up_after_gate=False)
    for name, a, b in zip(["x", "w1", "w2", "w3"], _titan_grads(tt, x, y, go), cat_grads):
        assert torch.equal(a, b), name


def test_w1_halves_view_and_the_layer_check_it():
    """_w1_halves_view: the (E, 2, n, d) view of gate and up weights (no copy: it aliases both), refused for halves
    the library cannot view so (up before gate, other strides, shapes or dtypes); grouped_experts takes such a view
    in the concatenated layout only, and names a half that is not contiguous."""
    buf = torch.randn(2, 4, N, D, dtype=torch.float64)
    v = torch.ops.machmoe._w1_halves_view(buf[0], buf[1])
    assert v.shape == (4, 2, N, D) and v.data_ptr() == buf.data_ptr()
    assert torch.equal(v, buf.transpose(0, 1))
    with pytest.raises(ValueError, match="'up'.*after gate's"):
        torch.ops.machmoe._w1_halves_view(buf[1], buf[0])
    with pytest.raises(ValueError, match="'up'.*strides"):
        torch.ops.machmoe._w1_halves_view(buf[0], buf[1].transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(ValueError, match="'up'"):
        torch.ops.machmoe._w1_halves_view(buf[0], buf[1].float())
    with pytest.raises(ValueError, match="'gate'"):
        torch.ops.machmoe._w1_halves_view(buf[0, 0], buf[1, 0])
    x = torch.randn(6, D, dtype=torch.float64)
    counts = torch.tensor([2, 0, 3, 1])
    w2 = torch.randn(4, D, N, dtype=torch.float64)
    joined = torch.cat([buf[0], buf[1]], dim=1)
    y = machmoe.functional.grouped_experts(x, counts, v, w2, activation="swiglu", weight_layout="concatenated")
    assert torch.equal(y, machmoe.functional.grouped_experts(x, counts, joined, w2, activation="swiglu",
                                                             weight_layout="concatenated"))
    with pytest.raises(ValueError, match="'w1'.*3-D"):
        machmoe.functional.grouped_experts(x, counts, v, w2, activation="swiglu", weight_layout="interleaved")
    padded = torch.randn(2, 4, N, D + 8, dtype=torch.float64)[..., :D]  # rows of D + 8: halves not contiguous
    with pytest.raises(ValueError, match=r"'w1\[:, 0\]'.*contiguous"):
        machmoe.functional.grouped_experts(x, counts, torch.ops.machmoe._w1_halves_view(padded[0], padded[1]), w2,
                                           activation="swiglu", weight_layout="concatenated")


def test_torchtitan_forward_keeps_no_copy_of_the_gate_up_weights(monkeypatch):
    """With w3 before w1 (the concatenating form): the forward's [w1; w3] copy is dead once the forward returns (the
    backward concatenates the two again), and the gradients are bitwise those of the form that keeps the copy
    (taken here under an outer saved-tensor hook, where the adapter leaves the saving to that hook)."""
    tt, counts, x, go = _titan_case(21)
    place_gate_up(tt, up_after_gate=False)
    copies = []
    cat = torch.cat

    def recording_cat(tensors, dim=0, **kw):
        out = cat(tensors, dim=dim, **kw)
        if tuple(out.shape) == (4, 2 * N, D):
            copies.append(weakref.ref(out))
        return out

    monkeypatch.setattr(torch, "cat", recording_cat)
    gc.disable()  # freed by reference counting, not by the cycle collector
    try:
        y = tt(x, counts)
        assert len(copies) == 1 and copies[0]() is None, "the concatenated gate/up weights outlived the forward"
    finally:
        gc.enable()
    ours = _titan_grads(tt, x, y, go)
    assert len(copies) == 2  # concatenated again by the backward
    monkeypatch.setattr(torch, "cat", cat)

    packed = []

    def outer_pack(t):
        packed.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(outer_pack, lambda t: t):
        y_kept = tt(x, counts)
    assert (4, 2 * N, D) in packed  # the outer hook was given the copy itself: the adapter stood aside
    for name, a, b in zip(["x", "w1", "w2", "w3"], ours, _titan_grads(tt, x, y_kept, go)):
        assert torch.equal(a, b), name
    ref = titan_reference(x, counts, tt.w1, tt.w2, tt.w3)
    for name, a, b in zip(["x", "w1", "w2", "w3"], ours, _titan_grads(tt, x, ref, go)):
        assert_close(name, a, b, 1e-12)


def test_saved_as_parts_leaves_no_reference_cycle():
    """An op that saves its own output (exp) inside the hooks: the output is freed by reference counting once the
    graph goes, as without the hooks (a hook that kept it with its grad_fn would close a cycle through C++)."""
    from machmoe.parallel import _saved_as_parts
    a = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    cat = torch.cat([a, b], dim=1)
    gc.disable()
    try:
        with _saved_as_parts(cat, a, b):
            z = (cat * 2).exp()
        ref = weakref.ref(z)
        grad = torch.autograd.grad(z.sum(), [a, b], retain_graph=True)
        assert torch.equal(grad[0], 2 * z[:, :3].detach()) and torch.equal(grad[1], 2 * z[:, 3:].detach())
        del z
        assert ref() is None, "a tensor saved through the hooks outlived its graph"
    finally:
        gc.enable()


def test_torchtitan_adapter_stands_aside_without_grad_and_under_other_hooks():
    """No hooks without grad (nothing is saved) or with saved-tensor hooks disabled; the same output either way."""
    tt, counts, x, _ = _titan_case(24)
    y = tt(x, counts)
    with torch.no_grad():
        assert torch.equal(tt(x, counts), y.detach())
    with torch.autograd.graph.disable_saved_tensors_hooks("machmoe test: hooks disabled"):
        y_off = tt(x, counts)
    assert torch.equal(y_off, y)
    assert y_off.grad_fn is not None


def test_torchtitan_backward_sees_in_place_changes_and_can_run_twice():
    """The saved-tensor hooks keep autograd's check for tensors changed in place between the forward and the
    backward (the gate and up weights, and the others the layer saves), and a retained graph runs its backward
    twice with the same result."""
    tt, counts, x, go = _titan_case(22)
    y = tt(x, counts)
    first = _titan_grads(tt, x, y, go, retain_graph=True)
    for name, a, b in zip(["x", "w1", "w2", "w3"], first, _titan_grads(tt, x, y, go)):
        assert torch.equal(a, b), name
    for name in ("w1", "w3", "w2"):
        y = tt(x, counts)
        with torch.no_grad():
            getattr(tt, name).mul_(1.0)  # same values, a new version
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            _titan_grads(tt, x, y, go)
    y = tt(x, counts)
    with torch.no_grad():
        x.add_(0.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _titan_grads(tt, x, y, go)


def test_torchtitan_adapter_matches_torchtitan():
    """Against torchtitan 0.2.2's own GroupedExperts (scripts/setup.sh installs it, with the two packages its import
    needs); fails rather than skips without it, as a skipped comparison would pass unseen (it did until session 68,
    when it first ran: its init_weights then needed no_grad, as torchtitan calls it)."""
    try:
        import torchtitan.models.moe.moe as moe_module
    except ImportError as e:
        pytest.fail(f"torchtitan 0.2.2 does not import ({e}): run scripts/setup.sh, which installs it")
    torch.manual_seed(18)
    theirs = moe_module.GroupedExperts(D, N, 4, use_grouped_mm=False).to(torch.float64)
    ours = TorchTitanGroupedExperts(D, N, 4, dtype=torch.float64)
    with torch.no_grad():  # torchtitan initialises under no_grad (its init_weights writes the parameters in place)
        theirs.init_weights(0.3)
    ours.load_state_dict(theirs.state_dict())
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, D, dtype=torch.float64, requires_grad=True)
    y, ref = ours(x, counts), theirs(x, counts)
    assert_close("output", y, ref, 1e-12)
    go = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad((y * go).sum(), [x, ours.w1, ours.w2, ours.w3]),
                    torch.autograd.grad((ref * go).sum(), [x, theirs.w1, theirs.w2, theirs.w3])):
        assert_close("grad", a, b, 1e-12)


def test_torchtitan_init_weights_in_bf16_is_the_truncated_normal():
    """In bf16, init_weights samples in fp32 and rounds (as torchtitan's own trunc_normal_ does): sampling in bf16
    put about 0.4 % of the weights at +-2, the truncation bounds (the inverse erf of uniform samples rounded to +-1),
    a std of 0.13 for 0.02. In fp32 it is nn.init.trunc_normal_ itself."""
    torch.manual_seed(19)
    tt = TorchTitanGroupedExperts(256, 128, 8, dtype=torch.bfloat16)
    tt.init_weights(0.02)
    for w in (tt.w1, tt.w2, tt.w3):  # std 0.02 each (w1's always)
        assert w.abs().max().item() < 0.2 and abs(w.float().std().item() - 0.02) < 0.001
    torch.manual_seed(20)
    fp32 = TorchTitanGroupedExperts(D, N, 4, dtype=torch.float32)
    fp32.init_weights(0.3)
    torch.manual_seed(20)
    TorchTitanGroupedExperts(D, N, 4, dtype=torch.float32)  # the constructor's draws, if any
    expect = torch.empty_like(fp32.w1)
    torch.nn.init.trunc_normal_(expect, mean=0.0, std=0.02)
    assert torch.equal(fp32.w1, expect)


def test_expert_parallel_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="initialised torch.distributed process group"):
        ExpertParallelMoE(D, N, 4, 2)


def test_from_moe_refuses_a_main_grad_layer():
    """ExpertParallelMoE has no main_grad mode: a MoE that accumulates into main_grad is refused by name rather than
    converted into one whose gradients go to .grad, where a main_grad optimiser would never read them."""
    m = machmoe.MoE(16, 8, 4, 2, accumulate_into_main_grad=True)
    with pytest.raises(ValueError, match=r"argument 'moe': expected a MoE with accumulate_into_main_grad=False .*"
                                         r"got accumulate_into_main_grad=True$"):
        ExpertParallelMoE.from_moe(m)


def test_check_capacity_reports():
    assert check_capacity(None) == 0
    assert check_capacity(torch.tensor(0)) == 0
    with pytest.raises(RuntimeError, match="5 routed rows were not sent on this rank"):
        check_capacity(torch.tensor(5))
    with pytest.warns(RuntimeWarning, match="capacity overflow"):
        assert check_capacity(torch.tensor(2), action="warn") == 2
    assert check_capacity(torch.tensor(2), action="ignore") == 2
    with pytest.raises(ValueError, match="argument 'action'"):
        check_capacity(torch.tensor(0), action="log")


def test_grouped_experts_on_pairs_takes_integer_like_max_pairs_per_row():
    """GroupedExperts(rows, pairs=ExpertPairs(...)): the layer on caller routing over the rows (the expert-parallel
    layer's receiving side), equal to machmoe.moe_from_routing on the same weights; max_pairs_per_row taken as every
    integer argument is (numpy integers, 0-d tensors), and refused with its name otherwise."""
    from machmoe.parallel import ExpertPairs
    torch.manual_seed(3)
    ge = GroupedExperts(D, N, 4, dtype=torch.float64)
    with torch.no_grad():
        for p in ge.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(5, D, dtype=torch.float64)
    token_index = torch.tensor([0, 0, 1, 2, 2, 4])
    expert_index = torch.tensor([1, 3, 0, 2, 3, 1])
    scores = torch.rand(6, dtype=torch.float64)
    ref, _ = machmoe.moe_from_routing(x, ge.w1, ge.w2, token_index, expert_index, scores, ge.b1, ge.b2,
                                      max_experts_per_token=2)
    for k in (2, np.int64(2), torch.tensor(2)):
        out = ge(x, pairs=ExpertPairs(token_index, expert_index, scores, k))
        assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="'max_pairs_per_row': expected an integer in \\[1, 4\\] \\(the number of "
                                         "experts\\), got 0"):
        ge(x, pairs=ExpertPairs(token_index, expert_index, scores, 0))
    with pytest.raises(TypeError, match="'max_pairs_per_row': expected an integer, got 1.5"):
        ge(x, pairs=ExpertPairs(token_index, expert_index, scores, 1.5))


def test_torchtitan_forward_takes_x_in_another_dtype_or_layout():
    """As torchtitan's grouped_mm path (bf16 inside, the result in x's dtype): an x of another dtype than the weights
    is computed in theirs and returned in its own, with gradients to both; a transposed x is copied, not refused."""
    tt, counts, x, go = _titan_case(5)
    ref = torchtitan_experts_forward(tt, x, counts)
    ref_grads = _titan_grads(tt, x, ref, go)
    x32 = x.detach().float().requires_grad_()
    out = torchtitan_experts_forward(tt, x32, counts)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref.float())
    g = torch.autograd.grad((out * go.float()).sum(), [x32, tt.w1, tt.w2, tt.w3])
    assert g[0].dtype == torch.float32 and g[1].dtype == torch.float64
    for a, b in zip(g, ref_grads):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-5, atol=1e-6)
    xt = x.detach().t().contiguous().t()  # the same values, column-major
    assert xt.stride(-1) != 1
    torch.testing.assert_close(torchtitan_experts_forward(tt, xt, counts), ref, rtol=0, atol=0)
    tt.w2 = torch.nn.Parameter(tt.w2.detach().float())
    with pytest.raises(ValueError, match="'experts': expected gate, up and down weights of one dtype"):
        torchtitan_experts_forward(tt, x, counts)
