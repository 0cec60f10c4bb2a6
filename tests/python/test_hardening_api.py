"""The Python API refuses what it cannot do, and says so: autograd beyond first-order reverse mode, deferred weight
gradients (per thread, version-checked, hooks after run()). CPU tests in float64 unless the case is about something
else; the GPU part is marked gpu."""
import math
import threading

import pytest
import torch

import machmoe
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


def module(seed=0, **kw):
    torch.manual_seed(seed)
    options = dict(dtype=torch.float64, bias=True)
    options.update(kw)
    return machmoe.MoE(16, 8, 4, 2, **options)


def plain_grads(m, x, loss_fn):
    """Gradients of a plain (undeferred) backward, leaving m and x as they were."""
    params = list(m.parameters())
    grads = torch.autograd.grad(loss_fn(m(x).output), params)
    return {name: g for (name, _), g in zip(m.named_parameters(), grads)}


# ---- 2. autograd that silently lies ----------------------------------------------------------------------------------

DOUBLE_BACKWARD = "machmoe: double backward is not supported"


def test_double_backward_raises_instead_of_returning_zeros():
    m = module()
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    gx, = torch.autograd.grad(m(x).output.square().sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match=DOUBLE_BACKWARD):
        torch.autograd.grad(gx.square().sum(), x)
    # A gradient penalty on the weights meets the same error rather than a silent zero.
    gw, = torch.autograd.grad(m(x).output.square().sum(), m.w1, create_graph=True)
    with pytest.raises(NotImplementedError, match=DOUBLE_BACKWARD):
        gw.square().sum().backward()


def test_double_backward_raises_for_caller_routing_and_hessian_vector_products():
    x, _, w1, w2, b1, b2 = make(T=6)
    tok, exp = torch.tensor([0, 0, 2, 3, 5]), torch.tensor([1, 2, 0, 2, 1])
    sc = torch.rand(5, dtype=torch.float64).requires_grad_()
    out, _ = machmoe.moe_from_routing(x, w1, w2, tok, exp, sc, b1, b2, max_experts_per_token=2)
    gs, = torch.autograd.grad(out.square().sum(), sc, create_graph=True)
    with pytest.raises(NotImplementedError, match=DOUBLE_BACKWARD):
        torch.autograd.grad(gs.sum(), sc)
    m = module()
    with pytest.raises(NotImplementedError, match=DOUBLE_BACKWARD):
        torch.autograd.functional.hvp(lambda a: m(a).output.square().sum(), torch.randn(3, 16, dtype=torch.float64),
                                      torch.ones(3, 16, dtype=torch.float64))


def test_create_graph_first_order_gradients_unchanged():
    """create_graph=True alone (e.g. for another part of the model) still gives the exact first-order gradients."""
    m = module()
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    loss = lambda: m(x).output.square().sum()
    plain = torch.autograd.grad(loss(), [x, m.w1, m.router_weight])
    graph = torch.autograd.grad(loss(), [x, m.w1, m.router_weight], create_graph=True)
    for a, b in zip(graph, plain):
        assert a.requires_grad and torch.equal(a.detach(), b)


# ---- 3. defer_weight_grads ------------------------------------------------------------------------------------------

def test_deferred_hooks_fire_after_run_with_the_gradient():
    m = module()
    x = torch.randn(20, 16, dtype=torch.float64, requires_grad=True)
    loss_fn = lambda o: o.square().sum()
    ref = plain_grads(m, x, loss_fn)
    seen = []
    m.w1.register_hook(lambda g: seen.append(("tensor hook", None if g is None else g.clone())))
    m.w2.register_post_accumulate_grad_hook(lambda p: seen.append(("post-accumulate", None if p.grad is None
                                                                   else p.grad.clone())))
    with machmoe.defer_weight_grads() as deferred:
        loss_fn(m(x).output).backward()
    assert seen == [] and m.w1.grad is None and m.w2.grad is None
    deferred.run()
    assert [name for name, _ in seen] == ["tensor hook", "post-accumulate"]
    assert torch.equal(seen[0][1], ref["w1"]) and torch.equal(seen[1][1], ref["w2"])
    for name, p in m.named_parameters():
        assert torch.equal(p.grad, ref[name]), name
    # The hooks are back in place for ordinary backwards.
    seen.clear()
    m.zero_grad(set_to_none=True)
    loss_fn(m(x).output).backward()
    assert [name for name, _ in seen] == ["tensor hook", "post-accumulate"]


def test_deferred_tensor_hook_can_replace_the_gradient_as_in_plain_backward():
    m = module()
    x = torch.randn(20, 16, dtype=torch.float64)
    ref = plain_grads(m, x, lambda o: o.sum())
    m.w1.register_hook(lambda g: 2 * g)
    with machmoe.defer_weight_grads() as deferred:
        m(x).output.sum().backward()
    deferred.run()
    assert torch.equal(m.w1.grad, 2 * ref["w1"])


def test_deferred_weight_used_by_two_layers_accumulates_both():
    m = module()
    x = torch.randn(10, 16, dtype=torch.float64)
    loss_fn = lambda m_, x_: (m_(x_).output + m_(2 * x_).output).square().sum()
    params = list(m.parameters())
    ref = torch.autograd.grad(loss_fn(m, x), params)
    calls = []
    m.w1.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad is not None))
    with machmoe.defer_weight_grads() as deferred:
        loss_fn(m, x).backward()
    assert len(deferred) == 2 and calls == []
    deferred.run()
    assert calls and all(calls)
    for p, g in zip(params, ref):
        assert rel(p.grad, g) < 1e-14


@pytest.mark.parametrize("what", ["x", "w1", "grad_out"])
def test_deferred_run_refuses_inputs_modified_in_place(what):
    m = module()
    x0 = torch.randn(20, 16, dtype=torch.float64, requires_grad=True)
    h = x0 * 1.0  # a non-leaf input, which may be modified in place after the backward
    grad_out = torch.randn(20, 16, dtype=torch.float64)
    with machmoe.defer_weight_grads() as deferred:
        m(h).output.backward(grad_out)
    with torch.no_grad():
        {"x": h, "w1": m.w1, "grad_out": grad_out}[what].mul_(1.5)  # e.g. an optimizer step on w1
    name = {"x": "argument 'x'", "w1": "argument 'w1'", "grad_out": "grad_out"}[what]
    with pytest.raises(RuntimeError, match=f"defer_weight_grads.run\\(\\): a deferred machmoe layer reads .*{name}.*"
                                           f"modified in place.*version (\\d+), now (?!\\1)\\d+"):
        deferred.run()
    assert len(deferred) == 1 and m.w1.grad is None and m.w2.grad is None  # nothing accumulated, queue kept


def test_deferral_refuses_non_leaf_weights():
    m = module()
    x = torch.randn(6, 16, dtype=torch.float64)
    w1 = m.w1 * 1.0  # e.g. a cast or a view of the parameter: its gradient must reach m.w1 in this backward
    with machmoe.defer_weight_grads() as deferred:
        out = machmoe.moe(x, m.router_weight, w1, m.w2, m.b1, m.b2, top_k=2)[0]
        with pytest.raises(RuntimeError, match="defer_weight_grads: argument 'w1' .* is not a leaf tensor"):
            out.sum().backward()
    assert len(deferred) == 0 and m.w1.grad is None
    # Outside the context the same graph reaches the parameter.
    machmoe.moe(x, m.router_weight, w1, m.w2, m.b1, m.b2, top_k=2)[0].sum().backward()
    assert m.w1.grad is not None


def test_deferral_follows_autograd_grad_and_backward_inputs():
    m = module()
    x = torch.randn(12, 16, dtype=torch.float64, requires_grad=True)
    loss_fn = lambda o: o.square().sum()
    ref = plain_grads(m, x, loss_fn)
    with machmoe.defer_weight_grads() as deferred:
        # autograd.grad returns gradients instead of accumulating them: it gets w1's now, nothing is queued.
        gw1, gx = torch.autograd.grad(loss_fn(m(x).output), [m.w1, x])
        assert torch.equal(gw1, ref["w1"]) and len(deferred) == 0
        # Gradients backward(inputs=...) does not ask for are neither computed nor written later.
        loss_fn(m(x).output).backward(inputs=[x, m.w2])
    assert len(deferred) == 1
    deferred.run()
    assert m.w1.grad is None and m.b1.grad is None and torch.equal(m.w2.grad, ref["w2"])


def test_deferral_is_per_thread():
    m_other = module(seed=1)
    x_other = torch.randn(8, 16, dtype=torch.float64)
    other_started, other_done = threading.Event(), threading.Event()
    result = {}

    def ordinary_backward():
        other_started.wait()
        try:
            m_other(x_other).output.sum().backward()
            result["w1 grad"] = m_other.w1.grad is not None
        finally:
            other_done.set()

    thread = threading.Thread(target=ordinary_backward)
    thread.start()
    m = module()
    with machmoe.defer_weight_grads() as deferred:
        m(torch.randn(8, 16, dtype=torch.float64)).output.sum().backward()
        other_started.set()  # another thread's backward while this thread's context is active
        other_done.wait(60)
    thread.join(60)
    assert result == {"w1 grad": True}, "another thread's ordinary backward was deferred into this context"
    assert len(deferred) == 1

    def deferring_thread():
        with machmoe.defer_weight_grads() as d:
            m_other.zero_grad(set_to_none=True)
            m_other(x_other).output.sum().backward()
        result["thread"] = (len(d), m_other.w1.grad is None)

    thread = threading.Thread(target=deferring_thread)
    thread.start()
    thread.join(60)
    assert result["thread"] == (1, True)


class _Nested(torch.autograd.Function):
    """A backward that starts another backward, `depth` levels deep: past autograd's reentrancy limit the engine
    continues on one of its worker threads, as it always does for CUDA tensors (one thread per device)."""

    @staticmethod
    def forward(ctx, x, depth, innermost):
        ctx.depth, ctx.innermost = depth, innermost
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.depth == 0:
            ctx.innermost()
        else:
            with torch.enable_grad():
                inner = _Nested.apply(torch.ones(1, requires_grad=True), ctx.depth - 1, ctx.innermost).sum()
            inner.backward()
        return g, None, None


def test_deferral_reaches_a_backward_on_an_autograd_worker_thread():
    m = module()
    x = torch.randn(8, 16, dtype=torch.float64)
    ref = plain_grads(m, x, lambda o: o.sum())
    caller = threading.get_ident()
    threads = []

    def innermost():
        threads.append(threading.get_ident())
        with torch.enable_grad():
            loss = m(x).output.sum()
        loss.backward()

    with machmoe.defer_weight_grads() as deferred:
        _Nested.apply(torch.ones(1, requires_grad=True), 120, innermost).sum().backward()
    assert threads and threads[0] != caller  # the case this test is about
    assert len(deferred) == 1 and m.w1.grad is None
    deferred.run()
    assert torch.equal(m.w1.grad, ref["w1"])


def test_compile_inside_deferral_raises_our_error():
    torch._dynamo.reset()
    m = module()
    x = torch.randn(6, 16, dtype=torch.float64, requires_grad=True)
    step = torch.compile(lambda inp: m(inp).output, fullgraph=True, backend="aot_eager")
    with machmoe.defer_weight_grads(), pytest.raises(RuntimeError) as info:
        step(x).sum().backward()
    chain, error = [], info.value
    while error is not None:
        chain.append(error)
        error = error.__cause__ or getattr(error, "inner_exception", None)
    assert any(str(e).startswith("machmoe: defer_weight_grads cannot defer the weight gradients of a graph that "
                                 "torch.compile is tracing") for e in chain), [str(e)[:200] for e in chain]
    torch._dynamo.reset()


# ---- GPU (compiled here, run on the GPU machine) ---------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_deferral_per_thread_on_the_device_thread(cuda):
    """CUDA backwards run on autograd's device thread, shared by all callers: the context must follow the caller."""
    torch.manual_seed(0)
    m = machmoe.MoE(256, 128, 16, 4, device=cuda, dtype=torch.bfloat16)
    m_other = machmoe.MoE(256, 128, 16, 4, device=cuda, dtype=torch.bfloat16)
    x = torch.randn(512, 256, device=cuda, dtype=torch.bfloat16)
    ref = plain_grads(m, x, lambda o: o.float().square().sum())
    result, go, done = {}, threading.Event(), threading.Event()

    def ordinary():
        go.wait()
        m_other(x).output.float().sum().backward()
        result["grad"] = m_other.w1.grad is not None
        done.set()

    thread = threading.Thread(target=ordinary)
    thread.start()
    seen = []
    m.w1.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is not None))
    with machmoe.defer_weight_grads() as deferred:
        m(x).output.float().square().sum().backward()
        go.set()
        done.wait(120)
    thread.join(120)
    assert result == {"grad": True} and len(deferred) == 1 and seen == [] and m.w1.grad is None
    deferred.run()
    assert seen == [True] and torch.equal(m.w1.grad, ref["w1"])


@pytest.mark.gpu
def test_gpu_deferral_refuses_cuda_graph_capture(cuda):
    m = machmoe.MoE(256, 128, 16, 4, device=cuda, dtype=torch.bfloat16)
    x = torch.randn(256, 256, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m(x).output.float().sum().backward()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="defer_weight_grads cannot defer weight gradients while a CUDA graph is "
                                           "being captured"):
        with machmoe.defer_weight_grads(), torch.cuda.graph(graph):
            m(x).output.float().sum().backward()
