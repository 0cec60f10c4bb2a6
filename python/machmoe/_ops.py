"""Fake (meta) implementations and autograd of the machmoe operators.

torch.ops.machmoe.layer_forward(...) -> (out, router_logits, expert_counts, saved) computes the layer; `saved` is
the uint8 buffer of what the backward needs (X is the input, kept by reference). Its autograd calls
torch.ops.machmoe.layer_backward. Both have fake implementations, so torch.compile(fullgraph=True) traces through
the layer without graph breaks.
"""
import torch

_CALLER = 2


def _saved_nbytes(x, w1, w2, top_k, token_index, activation, score, routing, tile, cache):
    T, d = x.shape
    num_pairs = token_index.shape[0] if routing == _CALLER else 0
    return torch.ops.machmoe.saved_nbytes(
        T, d, w2.shape[2], w1.shape[0], top_k, num_pairs, activation, score, routing, tile, cache, x.element_size()
    )


@torch.library.register_fake("machmoe::layer_forward")
def _layer_forward_fake(x, router_weight, w1, b1, w2, b2, token_index, expert_index, scores, top_k, activation,
                        weight_layout, score, routing, rounding, tile, cache):
    T, d = x.shape
    E = w1.shape[0]
    out = x.new_empty((T, d))
    logits = x.new_empty((0,)) if routing == _CALLER else x.new_empty((T, E))
    counts = x.new_empty((E,), dtype=torch.int32)
    nbytes = _saved_nbytes(x, w1, w2, top_k, token_index, activation, score, routing, tile, cache)
    saved = x.new_empty((nbytes,), dtype=torch.uint8)
    return out, logits, counts, saved


@torch.library.register_fake("machmoe::grouped_expert_index")
def _grouped_expert_index_fake(counts, rows):
    return counts.new_empty((rows,), dtype=torch.int32 if rows < 2**31 else torch.int64)


@torch.library.register_fake("machmoe::layer_backward")
def _layer_backward_fake(grad_out, grad_logits, x, router_weight, w1, b1, w2, b2, token_index, expert_index, scores,
                         saved, top_k, activation, weight_layout, score, routing, rounding, tile, cache):
    caller = routing == _CALLER
    empty = x.new_empty((0,))
    return (
        torch.empty_like(x),
        empty if caller else torch.empty_like(router_weight),
        torch.empty_like(w1),
        torch.empty_like(b1) if b1 is not None else empty,
        torch.empty_like(w2),
        torch.empty_like(b2) if b2 is not None else empty,
        scores.new_empty(scores.shape) if caller else empty,
    )


class defer_weight_grads:
    """Split backward for zero-bubble / deferred weight-gradient schedules.

    Inside ``with machmoe.defer_weight_grads() as deferred:``, the backward of machmoe layers computes the input
    gradient (and the router's and the scores' gradients) now and queues the expert weight-gradient work;
    ``deferred.run()`` does it later and accumulates into the parameters' ``.grad``. The results equal a plain
    backward bitwise. Between the two, each layer keeps dH and A' (memory.hpp's deferred layout) and dO alive.
    Eager mode only (not inside torch.compile or a captured CUDA graph).
    """

    _active = []

    def __init__(self):
        self.jobs = []

    def __enter__(self):
        defer_weight_grads._active.append(self)
        return self

    def __exit__(self, *exc):
        defer_weight_grads._active.remove(self)
        return False

    def run(self):
        """Computes every queued weight gradient, in the order the backward met the layers."""
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            job()

    def __len__(self):
        return len(self.jobs)


def _accumulate(param, grad):
    if param is None or not param.requires_grad:
        return
    param.grad = grad if param.grad is None else param.grad + grad


def _setup_context(ctx, inputs, output):
    x, router_weight, w1, b1, w2, b2, token_index, expert_index, scores = inputs[:9]
    ctx.options = inputs[9:]
    ctx.weights = (w1, b1, w2, b2)  # for deferred accumulation into .grad
    ctx.save_for_backward(x, router_weight, w1, b1, w2, b2, token_index, expert_index, scores, output[3])


def _backward(ctx, grad_out, grad_logits, grad_counts, grad_saved):
    x, router_weight, w1, b1, w2, b2, token_index, expert_index, scores, saved = ctx.saved_tensors
    caller = ctx.options[4] == _CALLER
    if grad_out is None:
        grad_out = torch.zeros_like(x)
    if caller or (grad_logits is not None and grad_logits.numel() == 0):
        grad_logits = None
    if defer_weight_grads._active:
        dx, dwr, dscores, deferred = torch.ops.machmoe.layer_backward_input(
            grad_out, grad_logits, x, router_weight, w1, b1, w2, b2, token_index, expert_index, scores, saved,
            *ctx.options)
        weights, options = ctx.weights, ctx.options

        def weight_job():
            dw1, db1_, dw2, db2_ = torch.ops.machmoe.layer_backward_weight(
                grad_out, x, router_weight, w1, b1, w2, b2, token_index, expert_index, scores, saved, deferred,
                *options)
            for param, grad in zip(weights, (dw1, db1_, dw2, db2_)):
                _accumulate(param, grad)

        defer_weight_grads._active[-1].jobs.append(weight_job)
        return (dx, None if caller or router_weight is None else dwr, None, None, None, None, None, None,
                dscores if caller else None) + (None,) * len(ctx.options)
    dx, dwr, dw1, db1, dw2, db2, dscores = torch.ops.machmoe.layer_backward(
        grad_out, grad_logits, x, router_weight, w1, b1, w2, b2, token_index, expert_index, scores, saved,
        *ctx.options)
    return (
        dx,
        None if caller or router_weight is None else dwr,
        dw1,
        db1 if b1 is not None else None,
        dw2,
        db2 if b2 is not None else None,
        None,
        None,
        dscores if caller else None,
    ) + (None,) * len(ctx.options)


torch.library.register_autograd("machmoe::layer_forward", _backward, setup_context=_setup_context)
