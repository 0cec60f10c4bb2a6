"""Fake (meta) implementations of the machmoe operators, and the Python side of the layer's autograd.

torch.ops.machmoe.layer_forward(...) -> (out, router_logits, expert_counts, saved) computes the layer; `saved` is
the uint8 buffer of what the backward needs (X is the input, kept by reference). Its Autograd kernel is C++
(bindings/torch/layer_autograd.cpp): the node calls torch.ops.machmoe.layer_backward itself in the common case and
the general form here (_autograd_backward, the operator machmoe::_layer_autograd_backward) under create_graph=True,
inside defer_weight_grads, and under tracing. Every operator has a fake implementation, so
torch.compile(fullgraph=True) traces through the layer without graph breaks.

The backward is first-order only: its results are wrapped so that differentiating them again (double backward)
raises instead of contributing zeros. `defer_weight_grads` splits the backward (input gradients now, expert weight
gradients later). In eager mode a backward that does not retain its graph lets layer_backward write dH over the H in
`saved` (consume_saved; docs/MEMORY.md), which autograd would free afterwards anyway, and then allocate W1's
gradient only after it has freed its workspace.
"""
import ctypes
import functools
import threading

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

_CALLER = 2


def _saved_nbytes(x, w1, w2, top_k, token_index, activation, score, routing, rounding, tile, cache):
    T, d = x.shape
    num_pairs = token_index.shape[0] if routing == _CALLER else 0
    if isinstance(T, torch.SymInt) or isinstance(num_pairs, torch.SymInt):
        # A dynamic token (or pair) count: saved_nbytes takes plain ints, so passing T would guard it to the traced
        # value (one graph per T; a ConstraintViolationError under mark_dynamic). The size is left unknown instead:
        # `saved` only travels from the forward to the backward, whose real kernels read its actual size, and the
        # real layer_forward computes and checks it.
        return torch.library.get_ctx().new_dynamic_size()
    return torch.ops.machmoe.saved_nbytes(
        T, d, w2.shape[2], w1.shape[0], top_k, num_pairs, activation, score, routing, tile, cache, x.element_size(),
        rounding
    )


def _same_device(op, x, x_name="x", **tensors):
    """Refuses a tensor operand on another device than x's, as the real kernels do. The fakes are also the operators'
    Meta kernels, which the dispatcher picks when any operand is on meta: without this a CPU x with a meta weight
    would return uninitialised CPU tensors. (Under torch.compile every operand is a fake tensor on its real device,
    so a consistent call passes.)"""
    device = x.device
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"machmoe::{op}: argument '{name}': expected a tensor on {device} (the device of "
                             f"{x_name}), got a tensor on {t.device}")


@torch.library.register_fake("machmoe::layer_forward")
def _layer_forward_fake(x, router_weight, w1, b1, w2, b2, token_index, expert_index, scores, top_k, activation,
                        weight_layout, score, routing, rounding, tile, cache, swiglu_alpha=1.702, swiglu_limit=7.0,
                        into_router_weight=None, into_w1=None, into_b1=None, into_w2=None, into_b2=None):
    _same_device("layer_forward", x, router_weight=router_weight, w1=w1, b1=b1, w2=w2, b2=b2, token_index=token_index,
                 expert_index=expert_index, scores=scores, into_router_weight=into_router_weight, into_w1=into_w1,
                 into_b1=into_b1, into_w2=into_w2, into_b2=into_b2)
    T, d = x.shape
    E = w1.shape[0]
    out = x.new_empty((T, d))
    logits = x.new_empty((0,)) if routing == _CALLER else x.new_empty((T, E))
    counts = x.new_empty((E,), dtype=torch.int32)
    nbytes = _saved_nbytes(x, w1, w2, top_k, token_index, activation, score, routing, rounding, tile, cache)
    saved = x.new_empty((nbytes,), dtype=torch.uint8)
    return out, logits, counts, saved


@torch.library.register_fake("machmoe::grouped_expert_index")
def _grouped_expert_index_fake(counts, rows):
    return counts.new_empty((rows,), dtype=torch.int32 if rows < 2**31 else torch.int64)


@torch.library.register_fake("machmoe::combine_rows")
def _combine_rows_fake(rows, scores, row_of_pair, token_offsets, top_k, num_tokens):
    _same_device("combine_rows", rows, "rows", scores=scores, row_of_pair=row_of_pair, token_offsets=token_offsets)
    return rows.new_empty((num_tokens, rows.shape[1]))


@torch.library.register_fake("machmoe::combine_rows_backward")
def _combine_rows_backward_fake(grad_out, rows, scores, row_of_pair, token_offsets, top_k, want_rows, want_scores,
                                zero_rows):
    _same_device("combine_rows_backward", rows, "rows", grad_out=grad_out, scores=scores, row_of_pair=row_of_pair,
                 token_offsets=token_offsets)
    grad_rows = torch.empty_like(rows) if want_rows else rows.new_empty((0,))
    grad_scores = scores.new_empty((row_of_pair.shape[0],)) if want_scores else scores.new_empty((0,))
    return grad_rows, grad_scores


def _score_dtype(x):
    # The scores' gradient has the score type of x (bindings/torch/machmoe_ops.cpp, score_type): fp64 for fp64 x,
    # fp32 otherwise.
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _grad_dtype(x, weight):
    """The dtype of a weight's gradient as the operators return it: float32 for a float32 master weight of a
    bfloat16/float16 x, x's dtype otherwise (bindings/torch/machmoe_ops.cpp, grad_dtype)."""
    return torch.float32 if weight.dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16) else x.dtype


def _weight_grad_fake(x, weight, into):
    """A weight gradient as the backward operators return it: empty when the weight is absent or its gradient is
    added into a caller buffer, else a contiguous tensor of the weight's shape in _grad_dtype; for W1 as an
    (E, 2, n, d) view of its halves, laid out (2, E, n, d) (machmoe_ops.cpp, new_weight_grad)."""
    if weight is None or into is not None:
        return x.new_empty((0,))
    if weight.dim() == 4:
        E, two, n, d = weight.shape
        return x.new_empty((two, E, n, d), dtype=_grad_dtype(x, weight)).permute(1, 0, 2, 3)
    return x.new_empty(weight.shape, dtype=_grad_dtype(x, weight))


@torch.library.register_fake("machmoe::layer_backward")
def _layer_backward_fake(grad_out, grad_logits, x, router_weight, w1, b1, w2, b2, token_index, expert_index, scores,
                         saved, top_k, activation, weight_layout, score, routing, rounding, tile, cache,
                         swiglu_alpha=1.702, swiglu_limit=7.0, into_router_weight=None, into_w1=None, into_b1=None,
                         into_w2=None, into_b2=None, consume_saved=False):
    _same_device("layer_backward", x, grad_out=grad_out, grad_logits=grad_logits, router_weight=router_weight, w1=w1,
                 b1=b1, w2=w2, b2=b2, token_index=token_index, expert_index=expert_index, scores=scores, saved=saved,
                 into_router_weight=into_router_weight, into_w1=into_w1, into_b1=into_b1, into_w2=into_w2,
                 into_b2=into_b2)
    caller = routing == _CALLER
    # As the operator allocates them: contiguous, x's dtype (the score gradient x's score type).
    return (
        x.new_empty(x.shape),
        _weight_grad_fake(x, None if caller else router_weight, into_router_weight),
        _weight_grad_fake(x, w1, into_w1),
        _weight_grad_fake(x, b1, into_b1),
        _weight_grad_fake(x, w2, into_w2),
        _weight_grad_fake(x, b2, into_b2),
        x.new_empty(scores.shape, dtype=_score_dtype(x)) if caller else x.new_empty((0,)),
    )


@torch.library.register_fake("machmoe::layer_backward_input")
def _layer_backward_input_fake(grad_out, grad_logits, x, router_weight, w1, b1, w2, b2, token_index, expert_index,
                               scores, saved, top_k, activation, weight_layout, score, routing, rounding, tile, cache,
                               swiglu_alpha=1.702, swiglu_limit=7.0, into_router_weight=None):
    _same_device("layer_backward_input", x, grad_out=grad_out, grad_logits=grad_logits, router_weight=router_weight,
                 w1=w1, b1=b1, w2=w2, b2=b2, token_index=token_index, expert_index=expert_index, scores=scores,
                 saved=saved, into_router_weight=into_router_weight)
    caller = routing == _CALLER
    T, d = x.shape
    # The router's gradient added into a caller buffer is returned as an empty tensor, as by layer_backward.
    dwr = _weight_grad_fake(x, None if caller else router_weight, into_router_weight)
    dscores = x.new_empty((token_index.shape[0],), dtype=_score_dtype(x)) if caller else x.new_empty((0,))
    # The deferred buffer's size (deferred_layout in the library) has no operator of its own to compute it here; it
    # only travels to layer_backward_weight, whose real kernel reads its actual size.
    deferred = x.new_empty((torch.library.get_ctx().new_dynamic_size(),), dtype=torch.uint8)
    return x.new_empty((T, d)), dwr, dscores, deferred


@torch.library.register_fake("machmoe::layer_backward_weight")
def _layer_backward_weight_fake(grad_out, x, router_weight, w1, b1, w2, b2, token_index, expert_index, scores, saved,
                                deferred, top_k, activation, weight_layout, score, routing, rounding, tile, cache,
                                swiglu_alpha=1.702, swiglu_limit=7.0, into_w1=None, into_b1=None, into_w2=None,
                                into_b2=None):
    _same_device("layer_backward_weight", x, grad_out=grad_out, router_weight=router_weight, w1=w1, b1=b1, w2=w2,
                 b2=b2, token_index=token_index, expert_index=expert_index, scores=scores, saved=saved,
                 deferred=deferred, into_w1=into_w1, into_b1=into_b1, into_w2=into_w2, into_b2=into_b2)
    return (_weight_grad_fake(x, w1, into_w1), _weight_grad_fake(x, b1, into_b1), _weight_grad_fake(x, w2, into_w2),
            _weight_grad_fake(x, b2, into_b2))


_WEIGHTS = ("w1", "b1", "w2", "b2")
_ALL_WEIGHTS = ("router_weight",) + _WEIGHTS
# top_k, activation, weight_layout, score, routing, rounding, tile, cache, swiglu_alpha, swiglu_limit
_NUM_OPTIONS = 10

_DOUBLE_BACKWARD = (
    "machmoe: double backward is not supported: a gradient computed by the backward of a machmoe layer (with "
    "create_graph=True) is being differentiated again, e.g. a gradient penalty, a Hessian-vector product or "
    "torch.autograd.functional.jvp. The layer's backward has no derivative of its own (differentiating through it "
    "would otherwise give zero); use first-order gradients only.")


class _FirstOrderOnly(torch.autograd.Function):
    """Computes a machmoe backward under create_graph=True. The resulting gradients depend on the layer's inputs and
    upstream gradient (`depends_on`), so autograd connects them to those; their own backward raises, where an
    unconnected result would have been silently treated as a constant (a zero second derivative)."""

    @staticmethod
    def forward(ctx, compute, *depends_on):
        return compute()

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(_DOUBLE_BACKWARD)


# ---- defer_weight_grads -------------------------------------------------------------------------------------------

# The stack of active defer_weight_grads contexts is per thread, and kept in torch's thread-local Python objects
# rather than a threading.local: autograd copies those into the worker threads that run a backward for the thread
# that started it (CUDA work runs on one engine thread per device, shared by every caller), so a backward sees the
# contexts of its own caller and no other thread's. A thread stashes a list when its first context opens and the
# marker _NO_STACK when its last one closes (an entry cannot be removed): the C++ autograd node compares the stashed
# object with that marker to run an ordinary backward without calling Python (bindings/torch/layer_autograd.cpp).
_STACK_KEY = "machmoe.defer_weight_grads"
_NO_STACK = object()
torch.ops.machmoe._set_no_deferral_marker(id(_NO_STACK))  # (its address; it lives as long as the process)


def _deferral_stack() -> list:
    """The contexts active in the thread that started the running backward (or in this thread), innermost last."""
    if torch._C._is_key_in_tls(_STACK_KEY):
        stack = torch._C._get_obj_in_tls(_STACK_KEY)
        if stack is not _NO_STACK:
            return stack
    return []


def _stash(obj) -> None:
    # The stash takes over a reference without adding one (c10::SafePyObject steals it) and drops it when it is
    # replaced or the thread ends; give it one of its own.
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    torch._C._stash_obj_in_tls(_STACK_KEY, obj)


def _tracing() -> bool:
    """Whether this code runs under a tracer (Dynamo, or AOTAutograd tracing the backward ahead of time) rather than
    eagerly."""
    return torch.compiler.is_compiling() or get_proxy_mode() is not None


_OPERAND_DESCRIPTIONS = {"grad_out": "the gradient of its output (grad_out)", "saved": "the buffer its forward saved"}


class _DeferredLayer:
    """One layer's queued weight-gradient work: the operands of layer_backward_weight, their versions when the
    backward queued it, the leaf weights whose .grad receives the result, and the buffers (w1, b1, w2, b2; None
    where not accumulating) that the other weights' gradients are added into."""

    _OPERANDS = ("grad_out", "x", "router_weight", "w1", "b1", "w2", "b2", "token_index", "expert_index", "scores",
                 "saved")

    def __init__(self, operands, deferred, options, targets, into):
        grad_out, _grad_logits, *rest = operands
        self.operands = (grad_out, *rest)
        self.deferred, self.options, self.targets, self.into = deferred, options, targets, into
        self.versions = [(name, t, t._version) for name, t in zip(self._OPERANDS, self.operands) if t is not None]
        # The parameters themselves too: under saved-tensor hooks the operands are unpacked copies, whose versions
        # would not see an in-place change of the parameter.
        self.versions += [(name, w, w._version) for name, w, _ in targets
                          if not any(w is t for _, t, _ in self.versions)]

    def check(self) -> None:
        for name, t, version in self.versions:
            if t._version != version:
                what = _OPERAND_DESCRIPTIONS.get(name, f"argument '{name}'")
                raise RuntimeError(
                    f"machmoe: defer_weight_grads.run(): a deferred machmoe layer reads {what}, which was modified "
                    f"in place after backward() queued the layer's weight gradients (tensor version {version}, now "
                    f"{t._version}); they would be computed from the modified values. Call run() before changing it "
                    f"(e.g. before optimizer.step()), or change a copy.")

    def run(self) -> None:
        with torch.no_grad():
            grads = dict(zip(_WEIGHTS, torch.ops.machmoe.layer_backward_weight(*self.operands, self.deferred,
                                                                                *self.options, *self.into)))
        # Through autograd, so that accumulation into .grad, the weights' tensor hooks and post-accumulate-grad hooks
        # run with the gradient as in an ordinary backward (and AccumulateGrad node hooks run again: see the class).
        # (Gradients added into caller buffers have been delivered by the operator itself.)
        if self.targets:
            torch.autograd.backward([w for _, w, _ in self.targets], [grads[name] for name, _, _ in self.targets])


class _MutedHooks:
    """A deferred weight's tensor hooks and post-accumulate-grad hooks, held back while the backward that deferred
    its gradient reaches its AccumulateGrad node with no gradient (which would call them with grad=None); they are
    put back right after that node, and run() later calls them with the real gradient."""

    _ATTRS = ("_backward_hooks", "_post_accumulate_grad_hooks")

    def __init__(self, weight, node, owner):
        self.weight, self.owner = weight, owner
        self.held = []
        for attr in self._ATTRS:
            hooks = getattr(weight, attr, None)
            if hooks:
                self.held.append((hooks, list(hooks.items())))
                hooks.clear()
        self.handle = node.register_hook(self._after_accumulate)

    def _after_accumulate(self, grad_inputs, grad_outputs):
        _unmute(self)

    def restore(self) -> None:
        self.handle.remove()
        for hooks, items in self.held:
            added = list(hooks.items())  # registered meanwhile: they keep coming after the earlier ones
            hooks.clear()
            hooks.update(items)
            hooks.update(added)


_muted_lock = threading.Lock()
_muted = {}  # id(weight) -> _MutedHooks, while its AccumulateGrad node is still to run


def _mute(weight, node, owner) -> None:
    with _muted_lock:
        if id(weight) not in _muted:  # a weight shared by several layers is held back once
            _muted[id(weight)] = _MutedHooks(weight, node, owner)


def _unmute(muted: _MutedHooks) -> None:
    with _muted_lock:
        if _muted.get(id(muted.weight)) is not muted:
            return
        del _muted[id(muted.weight)]
    muted.restore()


def _unmute_owned_by(owner) -> None:
    """Puts back hooks that a backward held back but never released (it failed before reaching the weight)."""
    with _muted_lock:
        mine = [m for m in _muted.values() if m.owner is owner]
    for muted in mine:
        _unmute(muted)


class defer_weight_grads:
    """Split backward for zero-bubble / deferred weight-gradient schedules.

    Inside ``with machmoe.defer_weight_grads() as deferred:``, the backward of machmoe layers computes the input
    gradient (and the router's and the scores' gradients) now and queues the expert weight-gradient work;
    ``deferred.run()`` does it later and accumulates into the weights' ``.grad`` through autograd, so the weights'
    tensor and post-accumulate-grad hooks run then, with the gradient, and not during the backward (hooks on their
    AccumulateGrad nodes run at both; a weight fed to several layer calls gets its hooks once per call, and a gradient
    it gets from outside machmoe in the same backward bypasses them; FSDP2 is not supported: docs/VALIDATION.md).
    Each gradient equals a plain backward's bitwise where the weight feeds one layer call and its .grad starts
    empty. Between the two, each layer
    keeps dH and A' (memory.hpp's deferred layout) and dO alive, and ``run()`` refuses to run if anything the work
    reads (x, the weights, dO, the routing) was modified in place meanwhile.

    The context is per thread: a backward started by another thread is not deferred. Only gradients that the
    backward would accumulate into ``.grad`` are deferred: those of weights it does not reach
    (``backward(inputs=...)``) are not computed, and ``torch.autograd.grad`` asking for a weight gets it at once.
    The expert weights must be leaf tensors (parameters), since a non-leaf weight's gradient would have to flow on
    to the tensors it was computed from during this backward. Eager mode only: tracing a machmoe backward with
    torch.compile or capturing a CUDA graph inside the context raises (a graph compiled outside the context computes
    its weight gradients in its own backward, undeferred).
    """

    def __init__(self):
        self._jobs = []
        self._jobs_lock = threading.Lock()  # the backward may queue from autograd's device threads

    def __enter__(self):
        stack = _deferral_stack()
        if stack:
            stack.append(self)
        else:  # a new list: a backward still running on another thread keeps the one it was started with
            _stash([self])
        return self

    def __exit__(self, *exc):
        stack = _deferral_stack()
        del stack[len(stack) - 1 - stack[::-1].index(self)]  # the innermost entry of this context
        if not stack:
            _stash(_NO_STACK)
        _unmute_owned_by(self)
        return False

    def _queue(self, job: _DeferredLayer) -> None:
        with self._jobs_lock:
            self._jobs.append(job)

    def run(self):
        """Computes every queued weight gradient, in the order the backward met the layers, and accumulates it into
        the weights' .grad. Checks first that nothing the work reads was modified in place since the backward (then
        it raises and keeps the queue as it was)."""
        _unmute_owned_by(self)
        with self._jobs_lock:
            jobs, self._jobs = self._jobs, []
        try:
            for job in jobs:
                job.check()
        except BaseException:
            with self._jobs_lock:
                self._jobs = jobs + self._jobs
            raise
        for i, job in enumerate(jobs):
            try:
                job.run()
            except BaseException:  # the failing layer is dropped; the ones after it stay queued
                with self._jobs_lock:
                    self._jobs = jobs[i + 1:] + self._jobs
                raise

    def __len__(self):
        return len(self._jobs)


def _plan_deferral(weights, x, into):
    """The weights whose gradient this backward defers into their .grad, as (name, weight, AccumulateGrad node); None
    when the layer's backward must compute its weight gradients now (torch.autograd.grad asked for one of them).
    Weights whose gradient is added into a caller buffer (`into`, by name) are deferred too, but produce no .grad:
    they are not targets."""
    if _tracing():
        raise RuntimeError(
            "machmoe: defer_weight_grads cannot defer the weight gradients of a graph that torch.compile is tracing: "
            "AOTAutograd traces the backward when it compiles the forward, so the deferral cannot be decided at "
            "backward time. Compile outside defer_weight_grads (the compiled backward then computes the weight "
            "gradients itself, undeferred) or run the machmoe layers eagerly to defer them.")
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "machmoe: defer_weight_grads cannot defer weight gradients while a CUDA graph is being captured: run() "
            "would launch the deferred work outside the graph, on memory the graph owns. Capture the backward "
            "outside defer_weight_grads.")
    targets = []
    for name, w in zip(_WEIGHTS, weights):
        if w is None or not w.requires_grad or into.get(name) is not None:
            continue
        node = torch.autograd.graph.get_gradient_edge(w).node
        try:
            needed = torch._C._will_engine_execute_node(node)
        except RuntimeError:
            # torch.autograd.grad asked for this leaf's gradient: it returns gradients rather than accumulating
            # them, so there is no .grad to fill later. Follow autograd: compute them now.
            return None
        if not needed:  # backward(inputs=...) or autograd.grad without this weight: its gradient is not wanted
            continue
        if w.grad_fn is not None:
            raise RuntimeError(
                f"machmoe: defer_weight_grads: argument '{name}' of a machmoe layer is not a leaf tensor (it was "
                f"computed from other tensors, e.g. a cast or a view of a parameter), so its gradient has to flow on "
                f"to those tensors during this backward and cannot be deferred. Pass the parameter itself, or run "
                f"this backward outside defer_weight_grads.")
        # The parameter itself, from its AccumulateGrad node: under saved-tensor hooks (save_on_cpu, non-reentrant
        # activation checkpointing) the weight this backward unpacked is another tensor object that shares the node
        # but not the parameter's hooks, which would then be muted on the wrong object and called with grad=None.
        targets.append((name, getattr(node, "variable", w), node))
    return targets


def _full_backward(operands, options, into):
    # consume_saved: dH may overwrite the saved H once nothing can read it again. The op decides (it consumes only
    # inside a backward that does not retain its graph, on the GPU, and bumps the buffer's version); a tracer, and
    # any other dispatch mode (a user's TorchDispatchMode sees the op's inputs and may keep them), gets the
    # read-only form, since the op's schema does not declare the write.
    return torch.ops.machmoe.layer_backward(*operands, *options, *(into.get(n) for n in _ALL_WEIGHTS),
                                            not (_tracing() or torch._C._len_torch_dispatch_stack() > 0))


def _split_backward(operands, options, into, owner, targets):
    dx, dwr, dscores, deferred = torch.ops.machmoe.layer_backward_input(*operands, *options,
                                                                        into.get("router_weight"))
    weight_into = tuple(into.get(name) for name in _WEIGHTS)
    if targets or any(t is not None for t in weight_into):
        owner._queue(_DeferredLayer(operands, deferred, options, targets, weight_into))
        for _, w, node in targets:
            _mute(w, node, owner)
    return dx, dwr, None, None, None, None, dscores


def _autograd_backward(grad_out, grad_logits, x, router_weight, w1, b1, w2, b2, token_index, expert_index, scores,
                       saved, *rest):
    """The general form of layer_forward's autograd backward (machmoe::_layer_autograd_backward), called by its C++
    autograd node (bindings/torch/layer_autograd.cpp) under create_graph=True, inside defer_weight_grads (a context
    open in the thread that started the backward) and under tracing; the node runs the common case itself. rest:
    the ten options, the five into_* buffers, and needs_input_grad (one flag per tensor input, x ... scores).
    Returns one gradient (or None) per tensor input."""
    options, into_args, needs_input_grad = rest[:_NUM_OPTIONS], rest[_NUM_OPTIONS:-1], rest[-1]
    caller = options[4] == _CALLER
    if grad_out is None:  # the loss uses only the logits (e.g. an aux loss alone): the output's gradient is zero
        grad_out = torch.zeros_like(x)
    if caller or (grad_logits is not None and grad_logits.numel() == 0):
        grad_logits = None
    operands = (grad_out, grad_logits, x, router_weight, w1, b1, w2, b2, token_index, expert_index, scores, saved)
    # A buffer receives its weight's gradient only when autograd wants that gradient (tensor inputs 1..5).
    into = {name: t for i, (name, t) in enumerate(zip(_ALL_WEIGHTS, into_args), start=1)
            if t is not None and needs_input_grad[i]}
    stack = _deferral_stack()
    targets = _plan_deferral((w1, b1, w2, b2), x, into) if stack else None
    if targets is None:
        compute = functools.partial(_full_backward, operands, options, into)
    else:
        compute = functools.partial(_split_backward, operands, options, into, stack[-1], targets)
    if torch.is_grad_enabled():  # create_graph=True
        depends_on = [t for t in (grad_out, grad_logits, x, router_weight, w1, b1, w2, b2, scores) if t is not None]
        dx, dwr, dw1, db1, dw2, db2, dscores = _FirstOrderOnly.apply(compute, *depends_on)
    else:
        dx, dwr, dw1, db1, dw2, db2, dscores = compute()
    # Gradients added into caller buffers are not returned: those weights' .grad stays as it was.
    return [
        dx,
        None if caller or router_weight is None or "router_weight" in into else dwr,
        None if "w1" in into else dw1,
        db1 if b1 is not None and "b1" not in into else None,
        None if "w2" in into else dw2,
        db2 if b2 is not None and "b2" not in into else None,
        None,
        None,
        dscores if caller else None,
    ]


_lib = torch.library.Library("machmoe", "FRAGMENT")  # kept alive by this module: the registration lives with it
# CompositeImplicitAutograd: under create_graph=True the operators it calls are recorded by autograd as usual, and a
# tracer traces through it.
_lib.impl("_layer_autograd_backward", _autograd_backward, "CompositeImplicitAutograd")
