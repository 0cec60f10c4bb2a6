"""The Python API refuses what it cannot do, and says so: autograd beyond first-order reverse mode, deferred weight
gradients (per thread, version-checked, hooks after run()), explicit checkpoint layouts, and argument messages that
name the argument and the bad value. CPU tests in float64 unless the case is about something else; the GPU part is
marked gpu."""
import threading

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD

import machmoe
from layer_inputs import make, rel
from reference import GLU, experts


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
FORWARD_AD = "machmoe: forward-mode AD .* is not supported"


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


def test_forward_mode_ad_raises_instead_of_a_zero_tangent():
    m = module()
    x = torch.randn(5, 16, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match=FORWARD_AD):
        torch.func.jvp(lambda a: m(a).output, (x,), (torch.ones_like(x),))
    # A tangent on a weight only (the input is a plain tensor) is refused too.
    rw, w1, w2 = (t.detach() for t in (m.router_weight, m.w1, m.w2))
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match=FORWARD_AD):
        machmoe.moe(x, rw, fwAD.make_dual(w1, torch.ones_like(w1)), w2, top_k=2)
    # ... and on caller-supplied scores.
    x6, _, w1, w2, _, _ = (t.detach() if t is not None else None for t in make(T=6))
    tok, exp = torch.tensor([0, 2, 3]), torch.tensor([1, 0, 2])
    sc = torch.rand(3, dtype=torch.float64)
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match=FORWARD_AD):
        machmoe.moe_from_routing(x6, w1, w2, tok, exp, fwAD.make_dual(sc, torch.ones_like(sc)),
                                 max_experts_per_token=1)
    # Inside a dual level, tensors without tangents run as usual.
    with fwAD.dual_level():
        assert torch.equal(m(x).output, module()(x).output)


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


@pytest.mark.parametrize("hooks", ["save_on_cpu", "checkpoint"])
def test_deferred_hooks_under_saved_tensor_hooks_act_on_the_parameter(hooks):
    """Under saved-tensor hooks (save_on_cpu, non-reentrant activation checkpointing) the backward unpacks other
    tensor objects for the weights: the parameters' own hooks are held back all the same (none is called with
    grad=None during the backward), and an in-place change of a parameter is still caught by run()."""
    import torch.utils.checkpoint as cp
    m = module()
    x = torch.randn(20, 16, dtype=torch.float64, requires_grad=True)

    def forward():
        if hooks == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu():
                return m(x).output
        return cp.checkpoint(lambda x_: m(x_).output, x, use_reentrant=False)

    ref = plain_grads(m, x, lambda o: o.square().sum())
    seen = []
    m.w1.register_hook(lambda g: seen.append(("tensor hook", g is None)) or 2 * g)  # (2 * None would raise)
    m.w2.register_post_accumulate_grad_hook(lambda p: seen.append(("post-accumulate", p.grad is None)))
    with machmoe.defer_weight_grads() as deferred:
        forward().square().sum().backward()
    assert seen == [] and m.w1.grad is None
    deferred.run()
    assert seen == [("tensor hook", False), ("post-accumulate", False)]
    assert torch.equal(m.w1.grad, 2 * ref["w1"]) and torch.equal(m.w2.grad, ref["w2"])
    m.zero_grad(set_to_none=True)
    with machmoe.defer_weight_grads() as deferred:
        forward().square().sum().backward()
    with torch.no_grad():
        m.w2.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        deferred.run()


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


# ---- 4. loading and state -------------------------------------------------------------------------------------------

def _hf_experts(E, n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    return [r(n, d) for _ in range(E)], [r(n, d) for _ in range(E)], [r(d, n) for _ in range(E)], r(E, d)


@pytest.mark.parametrize("module_layout", ["interleaved", "concatenated"])
@pytest.mark.parametrize("gate_up_layout", ["concatenated", "interleaved"])
@pytest.mark.parametrize("transposed", [False, True])
def test_fused_gate_up_read_as_told_when_d_equals_2n(module_layout, gate_up_layout, transposed):
    d, n, E = 16, 8, 4  # d == 2n: (E, 2n, d) and (E, d, 2n) have the same shape, so the layout cannot be guessed
    gate, up, down, router = _hf_experts(E, n, d)
    expected = machmoe.MoE(d, n, E, 2, dtype=torch.float64, weight_layout=module_layout).load_hf_experts(
        gate, up, down, router=router)
    G, U = torch.stack(gate), torch.stack(up)
    fused = torch.cat([G, U], 1) if gate_up_layout == "concatenated" else torch.stack([G, U], 2).reshape(E, 2 * n, d)
    downs = torch.stack(down)
    if transposed:  # stored (in, out) for x @ W, as gpt-oss and Llama 4 do
        fused, downs = fused.transpose(1, 2).contiguous(), downs.transpose(1, 2).contiguous()
    m = machmoe.MoE(d, n, E, 2, dtype=torch.float64, weight_layout=module_layout).load_hf_experts(
        gate_up_proj=fused, down_proj=downs, router=router, gate_up_layout=gate_up_layout, transposed=transposed)
    assert torch.equal(m.w1, expected.w1) and torch.equal(m.w2, expected.w2)
    assert torch.equal(m.router_weight, expected.router_weight)


def test_per_expert_lists_transposed():
    d, n, E = 16, 8, 4
    gate, up, down, router = _hf_experts(E, n, d)
    expected = machmoe.MoE(d, n, E, 2, dtype=torch.float64).load_hf_experts(gate, up, down, router=router)
    m = machmoe.MoE(d, n, E, 2, dtype=torch.float64).load_hf_experts(
        [g.T for g in gate], [u.T for u in up], [w.T for w in down], router=router, transposed=True)
    assert torch.equal(m.w1, expected.w1) and torch.equal(m.w2, expected.w2)


@pytest.mark.parametrize("case", ["gate_proj", "up_proj", "down_proj", "router", "gate_up_proj", "count", "both",
                                  "layout", "only gate"])
def test_load_hf_experts_checks_every_shape_before_writing(case):
    d, n, E = 16, 8, 4
    gate, up, down, router = _hf_experts(E, n, d)
    kwargs = dict(gate_proj=gate, up_proj=up, down_proj=down, router=router)
    expect = {
        # Each of these broadcasts into every row with copy_ and used to load without complaint.
        "gate_proj": (ValueError, "argument 'gate_proj\\[1\\]': expected shape \\(8, 16\\), got shape \\(1, 16\\)"),
        "up_proj": (ValueError, "argument 'up_proj\\[3\\]': expected shape \\(8, 16\\), got shape \\(16,\\)"),
        "down_proj": (ValueError, "argument 'down_proj\\[0\\]': expected shape \\(16, 8\\), got shape \\(16, 1\\)"),
        "router": (ValueError, "argument 'router': expected shape \\(4, 16\\), got shape \\(1, 16\\)"),
        "gate_up_proj": (ValueError, "argument 'gate_up_proj': expected shape \\(4, 16, 16\\), got shape "
                                     "\\(4, 16, 1\\)"),
        "count": (ValueError, "argument 'down_proj': expected 4 weights \\(one per expert\\), got 3"),
        "both": (ValueError, "either gate_up_proj or gate_proj and up_proj, got both"),
        "layout": (ValueError, "argument 'gate_up_layout': expected one of \\['concatenated', 'interleaved'\\], "
                               "got 'gate_up'"),
        "only gate": (ValueError, "expected gate_proj and up_proj .* or gate_up_proj, got only gate_proj"),
    }[case]
    if case == "gate_proj":
        kwargs["gate_proj"] = gate[:1] + [torch.ones(1, d, dtype=torch.float64)] + gate[2:]
    elif case == "up_proj":
        kwargs["up_proj"] = up[:3] + [torch.ones(d, dtype=torch.float64)]
    elif case == "down_proj":
        kwargs["down_proj"] = [torch.ones(d, 1, dtype=torch.float64)] + down[1:]
    elif case == "router":
        kwargs["router"] = torch.ones(1, d, dtype=torch.float64)
    elif case == "gate_up_proj":
        kwargs = dict(gate_up_proj=torch.ones(E, 2 * n, 1, dtype=torch.float64), down_proj=down)
    elif case == "count":
        kwargs["down_proj"] = down[:3]
    elif case == "both":
        kwargs["gate_up_proj"] = torch.ones(E, 2 * n, d, dtype=torch.float64)
    elif case == "layout":
        kwargs = dict(gate_up_proj=torch.ones(E, 2 * n, d, dtype=torch.float64), gate_up_layout="gate_up")
    else:
        del kwargs["up_proj"]
    m = machmoe.MoE(d, n, E, 2, dtype=torch.float64)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(expect[0], match=expect[1]):
        m.load_hf_experts(**kwargs)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items()), "a failed load changed the module"


def test_load_hf_experts_refuses_sources_a_copy_cannot_read_before_writing():
    """fp8 weights (their checkpoints keep a separate scale), meta tensors (offloaded weights) and DTensors were
    accepted by the checks and failed, or loaded raw fp8 values, while writing, after earlier weights had changed."""
    d, n, E = 16, 8, 4
    gate, up, down, router = _hf_experts(E, n, d)
    cases = [
        ([w.to(torch.float8_e4m3fn) for w in down], "argument 'down_proj\\[0\\]': expected a float16, bfloat16, "
         "float32 or float64 tensor \\(dequantize fp8 weights first"),
        ([w.to("meta") for w in down], "argument 'down_proj\\[0\\]': expected a tensor with data"),
        ([torch.ones(d, n, dtype=torch.int32)] * E, "expected a float16, bfloat16, float32 or float64 tensor, got "
         "torch.int32"),
    ]
    for bad_down, message in cases:
        m = machmoe.MoE(d, n, E, 2, dtype=torch.float64)
        before = {k: v.clone() for k, v in m.state_dict().items()}
        with pytest.raises(ValueError, match=message):
            m.load_hf_experts(gate, up, bad_down, router=router)
        assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items()), "a failed load changed the module"


def test_loading_into_a_meta_module_is_refused():
    """copy_ into a meta parameter stores nothing: loading there used to pass silently, and a module made real
    afterwards (to_empty) held uninitialised memory."""
    d, n, E = 16, 8, 4
    gate, up, down, router = _hf_experts(E, n, d)
    with torch.device("meta"):
        m = machmoe.MoE(d, n, E, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="cannot load 'w1': the module is on the meta device"):
        m.load_hf_experts(gate, up, down, router=router)
    m.to_empty(device="cpu")
    m.load_hf_experts(gate, up, down, router=router)
    assert torch.equal(m.w2, torch.stack(down))


def test_a_load_pre_hook_on_the_module_runs_before_the_layout_check():
    """The layout mismatch says to convert the w1/b1 rows between layouts before loading; a load pre-hook registered
    on the MoE itself can do that (it used to be refused before the hook ran)."""
    saved = module(weight_layout="concatenated")
    x = torch.randn(6, 16, dtype=torch.float64)
    target = module(seed=1, weight_layout="interleaved")

    def to_interleaved(state_dict, prefix, *_):
        for name in ("w1", "b1"):
            t = state_dict[prefix + name]
            n = t.shape[1] // 2
            state_dict[prefix + name] = torch.stack([t[:, :n], t[:, n:]], 2).reshape(t.shape)
        state_dict[prefix + "_extra_state"] = target.get_extra_state()
    target._register_load_state_dict_pre_hook(to_interleaved)
    target.load_state_dict(saved.state_dict())
    assert torch.allclose(target(x).output, saved(x).output, rtol=1e-12, atol=1e-12)


def test_load_hf_experts_non_tensor_and_non_glu():
    d, n, E = 16, 8, 4
    gate, up, down, _ = _hf_experts(E, n, d)
    with pytest.raises(TypeError, match="argument 'gate_proj\\[0\\]': expected a torch.Tensor, got numpy.ndarray"):
        machmoe.MoE(d, n, E, 2, dtype=torch.float64).load_hf_experts([g.numpy() for g in gate], up)
    with pytest.raises(ValueError, match="load_hf_experts: expected a MoE with a gated activation .* got "
                                         "activation='relu'"):
        machmoe.MoE(d, n, E, 2, dtype=torch.float64, activation="relu").load_hf_experts(gate, up, down)


def test_state_dict_records_layout_and_refuses_another():
    saved = module(weight_layout="interleaved")
    state = saved.state_dict()
    target = module(seed=1, weight_layout="concatenated")
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(RuntimeError, match="machmoe: state dict entry '_extra_state': the weights were saved by a MoE "
                                           "with weight_layout='interleaved', activation='swiglu'; this module has "
                                           "weight_layout='concatenated'"):
        target.load_state_dict(state)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items()), "a refused load changed weights"
    with pytest.raises(RuntimeError, match="saved by a MoE with weight_layout='interleaved', activation='swiglu'; "
                                           "this module has weight_layout='interleaved', activation='geglu'"):
        module(seed=1, activation="geglu").load_state_dict(state)
    # Nested modules report their own key.
    wrapper = torch.nn.Sequential(module(seed=1, weight_layout="concatenated"))
    with pytest.raises(RuntimeError, match="entry '0._extra_state'"):
        wrapper.load_state_dict({"0." + k: v for k, v in state.items()})
    # Same options: loads, strict.
    same = module(seed=1)
    same.load_state_dict(state)
    assert torch.equal(same.w1, saved.w1)


def test_state_dict_without_layout_record_still_loads():
    saved = module(weight_layout="concatenated")
    old = {k: v for k, v in saved.state_dict().items() if k != "_extra_state"}  # as saved before the record existed
    target = module(seed=1, weight_layout="concatenated")
    result = target.load_state_dict(old, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(target.w1, saved.w1) and torch.equal(target.b2, saved.b2)


def test_layout_record_is_a_tensor():
    # Tensor-only checkpoint formats (safetensors) can hold it.
    record = module().state_dict()["_extra_state"]
    assert isinstance(record, torch.Tensor) and record.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64, "float32"])
def test_module_dtype_that_no_device_takes_is_refused_by_name(dtype):
    with pytest.raises(TypeError, match=r"argument 'dtype': expected None or one of .* on the CPU\), got "):
        machmoe.MoE(16, 8, 4, 2, dtype=dtype)


def test_layout_record_survives_a_dtype_conversion_of_the_state_dict():
    """A state dict converted as a whole to another dtype (a usual checkpoint step) carries the record's small codes
    exactly: it loads, and a converted record of another layout is still refused. A record that is not whole
    numbers is refused as before."""
    saved = module(weight_layout="concatenated")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        state = {k: v.to(dtype) for k, v in saved.state_dict().items()}
        target = module(seed=1, weight_layout="concatenated")
        target.load_state_dict(state)
        assert torch.equal(target.w1, state["w1"].to(target.w1.dtype)), dtype
        with pytest.raises(RuntimeError, match="saved by a MoE with weight_layout='concatenated', activation='swiglu'"):
            module(seed=1, weight_layout="interleaved").load_state_dict(state)
    state = dict(saved.state_dict(), _extra_state=saved.state_dict()["_extra_state"].to(torch.int32))
    module(seed=1, weight_layout="concatenated").load_state_dict(state)
    state["_extra_state"] = torch.tensor([1.0, 1.5, 0.0])
    with pytest.raises(RuntimeError, match="expected the weight-layout record of a machmoe.MoE"):
        module(seed=1, weight_layout="concatenated").load_state_dict(state)


# ---- 5. messages that name the argument and the bad value ---------------------------------------------------------

def test_grouped_experts_counts_messages():
    x, _, w1, w2, b1, b2 = make(T=9)
    with pytest.raises(ValueError, match="argument 'expert_counts': expected counts summing to 9 \\(the rows of "
                                         "x_grouped\\), got a sum of 8"):
        machmoe.grouped_experts(x, torch.tensor([3, 0, 3, 2]), w1, w2)
    with pytest.raises(ValueError, match="argument 'expert_counts': expected counts summing to 9 .* got a sum of 10"):
        machmoe.grouped_experts(x, torch.tensor([3, 1, 4, 2]), w1, w2)
    with pytest.raises(ValueError, match="argument 'expert_counts': expected non-negative counts, got "
                                         "expert_counts\\[1\\] = -1"):
        machmoe.grouped_experts(x, torch.tensor([5, -1, 3, 2]), w1, w2)
    with pytest.raises(ValueError, match="argument 'expert_counts': expected integer counts .* got torch.float32"):
        machmoe.grouped_experts(x, torch.tensor([3.5, 0.0, 3.5, 2.0]), w1, w2)
    with pytest.raises(ValueError, match="argument 'expert_counts': expected shape \\(4,\\)"):
        machmoe.grouped_experts(x, torch.tensor([9]), w1, w2)


def test_grouped_experts_non_tensor_arguments():
    x, _, w1, w2, _, _ = make(T=9)
    counts = torch.tensor([3, 0, 4, 2])
    with pytest.raises(TypeError, match="argument 'x_grouped': expected a torch.Tensor, got list"):
        machmoe.grouped_experts(x.tolist(), counts, w1, w2)
    with pytest.raises(TypeError, match="argument 'expert_counts': expected a torch.Tensor, got list"):
        machmoe.grouped_experts(x, [3, 0, 4, 2], w1, w2)
    with pytest.raises(TypeError, match="argument 'w2': expected a torch.Tensor, got numpy.ndarray"):
        machmoe.grouped_experts(x, counts, w1, w2.detach().numpy())
    with pytest.raises(ValueError, match="argument 'w1': expected dtype torch.float64 \\(the dtype of x_grouped\\)"):
        machmoe.grouped_experts(x, counts, w1.float(), w2)


def test_grouped_experts_unchanged_for_valid_counts():
    x, _, w1, w2, b1, b2 = make(T=9)
    counts = torch.tensor([3, 0, 4, 2], dtype=torch.int32)
    y = machmoe.grouped_experts(x, counts, w1, w2, b1, b2)
    exp = torch.repeat_interleave(torch.arange(4), counts.long())
    ref = experts(x, torch.arange(9), exp, torch.ones(9, dtype=torch.float64), w1, w2, b1, b2, "swiglu",
                  "interleaved")
    assert rel(y, ref) < 1e-12


@pytest.mark.parametrize("args,name,message", [
    ((16, 0, 2, 1), "intermediate_size", "expected an integer >= 1, got 0"),
    ((16, 8, 0, 1), "num_experts", "expected an integer >= 1, got 0"),
    ((0, 8, 4, 1), "hidden_size", "expected an integer >= 1, got 0"),
    ((16, 8, 4, 5), "top_k", "expected an integer in \\[1, 4\\] \\(the number of experts\\), got 5"),
    ((16, 8, 4, 0), "top_k", "expected an integer in \\[1, 4\\] \\(the number of experts\\), got 0"),
])
def test_module_sizes_named(args, name, message):
    with pytest.raises(ValueError, match=f"machmoe: argument '{name}': {message}"):
        machmoe.MoE(*args)


@pytest.mark.parametrize("value,shown", [(True, "True \\(bool\\)"), (2.0, "2.0 \\(float\\)"), ("2", "'2' \\(str\\)"),
                                         (torch.tensor(2.0), "tensor\\(2.\\) \\(torch.Tensor\\)")])
def test_top_k_wrong_types(value, shown):
    with pytest.raises(TypeError, match=f"argument 'top_k': expected an integer, got {shown}"):
        machmoe.MoE(16, 8, 4, value)
    x, rw, w1, w2, _, _ = make()
    with pytest.raises(TypeError, match=f"argument 'top_k': expected an integer, got {shown}"):
        machmoe.moe(x, rw, w1, w2, top_k=value)


@pytest.mark.parametrize("top_k", [torch.tensor(2), np.int64(2), np.int32(2)])
def test_integer_like_top_k_accepted(top_k):
    torch.manual_seed(0)
    m = machmoe.MoE(16, 8, 4, top_k, dtype=torch.float64)
    assert type(m.top_k) is int and m.top_k == 2
    x = torch.randn(5, 16, dtype=torch.float64)
    torch.manual_seed(0)
    assert torch.equal(m(x).output, machmoe.MoE(16, 8, 4, 2, dtype=torch.float64)(x).output)
    xs, rw, w1, w2, b1, b2 = make()
    assert torch.equal(machmoe.moe(xs, rw, w1, w2, b1, b2, top_k=top_k, tile=np.int64(16))[0],
                       machmoe.moe(xs, rw, w1, w2, b1, b2, top_k=2, tile=16)[0])
    with pytest.raises(ValueError, match="argument 'top_k': expected an integer in \\[1, 4\\] .*, got 7$"):
        machmoe.moe(xs, rw, w1, w2, top_k=type(top_k)(7) if not isinstance(top_k, torch.Tensor) else torch.tensor(7))


def test_dtype_mismatch_under_autocast_says_float64_is_not_cast():
    m = module()  # float64 parameters: autocast leaves them as they are (test_autocast.py has the casts themselves)
    x = torch.randn(5, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"argument 'x': expected dtype torch.float64 \(the dtype of this MoE's "
                                         r"parameters\), got torch.float32$"):
        m(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match=r"parameters; under torch.autocast the layer computes in torch.float32, "
                                             r"and float64 tensors are not cast\), got torch.float32"):
            m(torch.nn.functional.linear(x, torch.eye(16)))  # an autocast op's bf16 output, cast to float32


def test_integer_argument_on_a_device_is_refused():
    """A 0-d tensor off the CPU (a CUDA one would be read with a synchronisation inside the call; meta stands in
    for it here) is refused by name, in the module and in the functional call."""
    on_meta = torch.tensor(2, device="meta")
    with pytest.raises(TypeError, match="argument 'top_k': expected an integer .* a 0-d CPU tensor: a tensor on meta "
                                        r"would have to be read back to the host\), got a tensor on meta"):
        machmoe.MoE(16, 8, 4, on_meta)
    xs, rw, w1, w2, b1, b2 = make()
    with pytest.raises(TypeError, match="argument 'top_k': expected an integer .* got a tensor on meta"):
        machmoe.moe(xs, rw, w1, w2, b1, b2, top_k=on_meta)


def test_module_input_messages():
    m = module()
    with pytest.raises(ValueError, match="argument 'x': expected a tensor of shape \\(..., 16\\), got shape \\(\\)"):
        m(torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(TypeError, match="argument 'x': expected a torch.Tensor, got numpy.ndarray"):
        m(np.zeros((3, 16)))
    with pytest.raises(ValueError, match="argument 'x': expected dtype torch.float64 \\(the dtype of this MoE's "
                                         "parameters\\), got torch.float32"):
        m(torch.randn(3, 16))


def test_numpy_weight_reported_as_a_type_problem():
    x, rw, w1, w2, _, _ = make()
    with pytest.raises(TypeError, match="argument 'w1': expected a torch.Tensor, got numpy.ndarray"):
        machmoe.moe(x, rw, w1.detach().numpy(), w2, top_k=2)
    with pytest.raises(TypeError, match="argument 'router_weight': expected a torch.Tensor, got numpy.ndarray"):
        machmoe.moe(x, rw.detach().numpy(), w1, w2, top_k=2)
    with pytest.raises(TypeError, match="argument 'b2': expected a torch.Tensor or None, got list"):
        machmoe.moe(x, rw, w1, w2, None, [0.0], top_k=2)


def test_moe_from_routing_names_max_experts_per_token():
    x, _, w1, w2, _, _ = make(T=6)
    tok, exp, sc = torch.tensor([0, 2]), torch.tensor([1, 0]), torch.ones(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="argument 'max_experts_per_token': expected an integer in \\[1, 4\\] .*, "
                                         "got 0"):
        machmoe.moe_from_routing(x, w1, w2, tok, exp, sc, max_experts_per_token=0)
    with pytest.raises(TypeError, match="argument 'token_index': expected a torch.Tensor, got list"):
        machmoe.moe_from_routing(x, w1, w2, [0, 2], exp, sc, max_experts_per_token=1)
    with pytest.raises(ValueError, match="argument 'expert_index': expected shape \\(2,\\) \\(one entry per pair, "
                                         "as token_index\\), got shape \\(3,\\)"):
        machmoe.moe_from_routing(x, w1, w2, tok, torch.tensor([1, 0, 2]), sc, max_experts_per_token=1)


@pytest.mark.parametrize("name", ["aux_loss_coef", "z_loss_coef"])
def test_loss_coefficients_checked(name):
    with pytest.raises(ValueError, match=f"argument '{name}': expected a finite real number >= 0 .*, got -0.01"):
        machmoe.MoE(16, 8, 4, 2, **{name: -0.01})
    with pytest.raises(ValueError, match=f"argument '{name}': expected a finite real number >= 0 .*, got nan"):
        machmoe.MoE(16, 8, 4, 2, **{name: float("nan")})
    with pytest.raises(TypeError, match=f"argument '{name}': expected a real number >= 0, got '0.1' \\(str\\)"):
        machmoe.MoE(16, 8, 4, 2, **{name: "0.1"})
    m = machmoe.MoE(16, 8, 4, 2, **{name: np.float32(0.5)})
    assert getattr(m, name) == 0.5
    with pytest.raises(ValueError, match=f"argument '{name}'.*got -1"):
        setattr(m, name, -1)  # set later: checked too, where forward would have skipped the loss
    assert getattr(m, name) == 0.5


def test_tile_bounded_as_in_the_operators():
    """tile=8192 used to construct, and then every forward failed in the operator ('[8, 4096]')."""
    with pytest.raises(ValueError, match="machmoe: argument 'tile': expected a multiple of 8 in \\[8, 4096\\], got "
                                         "8192"):
        machmoe.MoE(16, 8, 4, 2, routing="token_rounding", tile=8192)
    with pytest.raises(ValueError, match="argument 'tile': expected a multiple of 8 in \\[8, 4096\\], got 0"):
        machmoe.MoE(16, 8, 4, 2, tile=0)
    assert machmoe.MoE(16, 8, 4, 2, tile=np.int64(4096)).tile == 4096
    x, rw, w1, w2, _, _ = make()
    with pytest.raises(ValueError, match="argument 'tile': expected a multiple of 8 in \\[8, 4096\\], got 8192"):
        machmoe.moe(x, rw, w1, w2, top_k=2, tile=8192)


@pytest.mark.parametrize("value", ["no", 0, 1, None, np.bool_(True)])
def test_bias_must_be_a_bool(value):
    """bias="no" used to create biases (any truthy object did)."""
    with pytest.raises(TypeError, match="machmoe: argument 'bias': expected a bool, got "):
        machmoe.MoE(16, 8, 4, 2, bias=value)
    assert machmoe.MoE(16, 8, 4, 2, bias=False).b1 is None and machmoe.MoE(16, 8, 4, 2, bias=True).b1 is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_module_in_a_gpu_dtype_is_built_for_moving(dtype):
    """A MoE built on the CPU in bf16/fp16 is what loading a checkpoint on the host and then moving the module to a
    GPU does (MoE.from_gpt_oss takes the device of its tensors): it is built; only a forward on the CPU refuses the
    dtype, naming it."""
    m = machmoe.MoE(16, 8, 4, 2, device="cpu", dtype=dtype)
    assert m.w1.dtype == dtype and m.w1.device.type == "cpu"
    with pytest.raises(ValueError, match=r"argument 'x': expected one of \(torch.float32, torch.float64\) on cpu"):
        m(torch.randn(3, 16, dtype=dtype))


def non_unit_inner_stride(t):
    """t's values in a view whose last dimension is not unit-stride: 2-D as x.t().contiguous().t() (a transposed
    activation), otherwise every other column of a buffer twice as wide."""
    if t.dim() == 2:
        return t.t().contiguous().t()
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


@pytest.mark.parametrize("shape", [(12, 16), (3, 4, 16), (16,)])
def test_module_input_with_non_unit_inner_stride(shape):
    """A transposed 2-D input used to fail with 'expected unit stride in the last dimension' (3-D ones were
    reshaped); MoE.forward now copies x when its inner stride is not 1, so a strided input gives the contiguous
    input's output and input gradient, bitwise."""
    m = module(3)
    base = torch.randn(*shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    go = torch.randn(*shape, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    results = []
    for x in (base.clone(), non_unit_inner_stride(base)):
        x.requires_grad_()
        out = m(x).output
        (dx,) = torch.autograd.grad((out * go).sum(), [x])
        results.append((x.stride(-1), out, dx))
    (contiguous_stride, out_c, dx_c), (strided, out_s, dx_s) = results
    assert contiguous_stride == 1 and strided != 1
    assert out_s.shape == out_c.shape == shape and dx_s.shape == shape
    assert torch.equal(out_s, out_c) and torch.equal(dx_s, dx_c)


def test_functional_api_leaves_the_copy_to_the_caller():
    x, rw, w1, w2, _, _ = make()
    with pytest.raises(ValueError, match="argument 'x': expected unit stride in the last dimension"):
        machmoe.moe(non_unit_inner_stride(x), rw, w1, w2, top_k=2)


def test_option_strings_checked_before_lookup():
    x, rw, w1, w2, _, _ = make()
    with pytest.raises(ValueError, match="argument 'activation': expected one of .*, got \\['swiglu'\\]"):
        machmoe.moe(x, rw, w1, w2, top_k=2, activation=["swiglu"])  # unhashable: not a TypeError from dict lookup
    with pytest.raises(ValueError, match="argument 'weight_layout': expected 'interleaved' for the non-GLU "
                                         "activation 'relu'"):
        machmoe.MoE(16, 8, 4, 2, activation="relu", weight_layout="concatenated")
    with pytest.raises(ValueError, match="argument 'tile': expected a multiple of 8 in \\[8, 4096\\], got 12"):
        machmoe.MoE(16, 8, 4, 2, routing="token_rounding", tile=12)


def test_loss_functions_check_their_arguments():
    logits = torch.randn(6, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="argument 'expert_counts': expected shape \\(4,\\) .*, got shape \\(1,\\)"):
        machmoe.load_balancing_loss(logits, torch.tensor([12]))  # would broadcast into a wrong loss
    with pytest.raises(TypeError, match="argument 'router_logits': expected a torch.Tensor, got list"):
        machmoe.router_z_loss(logits.tolist())
    with pytest.raises(ValueError, match="argument 'router_logits': expected a floating-point \\(tokens, experts\\)"):
        machmoe.load_balancing_loss(logits[0], torch.tensor([1, 2, 1, 2]))


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


@pytest.mark.gpu
def test_gpu_grouped_experts_rows_past_the_counts_are_padding(cuda):
    """On the GPU the counts stay on the device: rows past their sum are skipped (zero output), where
    repeat_interleave used to trip a device-side assert."""
    host = [t.detach().to(torch.bfloat16).double() for t in make(T=64, d=64, n=32, E=4, bias=False)[:4]]
    x, _, w1, w2 = (t.to(cuda, torch.bfloat16) for t in host)
    counts = torch.tensor([10, 0, 20, 14], device=cuda)  # 44 of 64 rows
    y = machmoe.grouped_experts(x, counts, w1, w2)
    exp = torch.repeat_interleave(torch.arange(4), counts.cpu())
    ref = experts(host[0][:44], torch.arange(44), exp, torch.ones(44, dtype=torch.float64), host[2], host[3], None,
                  None, "swiglu", "interleaved")
    assert rel(y[:44].double().cpu(), ref) < 1e-2
    assert not y[44:].any()


def test_loaders_write_parametrized_weights_through_their_right_inverse():
    """A parametrized weight reads as a tensor computed from its original: the loaders assign it (the
    parametrization's right_inverse) instead of writing into that temporary, where the load would be lost."""
    class Scale(torch.nn.Module):
        def forward(self, w):
            return 2 * w

        def right_inverse(self, w):
            return w / 2

    d, n, E = 16, 8, 4
    gate, up, down, router = _hf_experts(E, n, d)
    expected = machmoe.MoE(d, n, E, 2, dtype=torch.float64).load_hf_experts(gate, up, down, router=router)
    m = machmoe.MoE(d, n, E, 2, dtype=torch.float64)
    for name in ("w1", "w2", "router_weight"):
        torch.nn.utils.parametrize.register_parametrization(m, name, Scale())
    m.load_hf_experts(gate, up, down, router=router)
    for name in ("w1", "w2", "router_weight"):
        assert torch.equal(getattr(m, name), getattr(expected, name)), name
        assert torch.equal(m.parametrizations[name].original, getattr(expected, name) / 2), name

    class NoInverse(torch.nn.Module):
        def forward(self, w):
            return w.clone()

    m = machmoe.MoE(d, n, E, 2, dtype=torch.float64)
    torch.nn.utils.parametrize.register_parametrization(m, "w2", NoInverse())
    before = m.w1.clone()
    with pytest.raises(ValueError, match="cannot load 'w2': it is parametrized by NoInverse without right_inverse"):
        m.load_hf_experts(gate, up, down)
    assert torch.equal(m.w1, before)  # refused before anything was written


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_meta_device_takes_every_training_dtype(dtype):
    """A model built on the meta device (shape and FLOP passes before materialising it) in its training dtype: bf16
    and fp16 as well as the CPU reference's float32 and float64, forward and backward."""
    m = machmoe.MoE(16, 8, 4, 2, device="meta", dtype=dtype)
    x = torch.randn(5, 16, device="meta", dtype=dtype, requires_grad=True)
    out = m(x)
    assert out.output.shape == (5, 16) and out.output.dtype == dtype and out.output.device.type == "meta"
    out.output.sum().backward()
    assert x.grad.shape == x.shape and m.w1.grad.shape == m.w1.shape and m.w1.grad.dtype == dtype
    w = [torch.zeros(s, device="meta", dtype=torch.int32) for s in ((4, 16), (4, 16, 16), (4, 16, 8))]
    with pytest.raises(ValueError, match="argument 'x': expected one of .* on meta, got torch.int32"):
        machmoe.moe(torch.zeros(5, 16, device="meta", dtype=torch.int32), w[0], w[1], w[2], top_k=2)


def test_mismatched_expert_weights_name_the_one_that_disagrees():
    """The number of experts is w1's (as for the router's weight) and n is w2's last dimension: a w2 with another
    number of experts is named w2 (it used to be reported as a wrong w1), a w1 whose rows do not match w2's n says
    where that n came from."""
    x, rw = torch.randn(5, 16, dtype=torch.float64), torch.randn(4, 16, dtype=torch.float64)
    w1, w2 = torch.randn(4, 16, 16, dtype=torch.float64), torch.randn(4, 16, 8, dtype=torch.float64)
    machmoe.moe(x, rw, w1, w2, top_k=2)  # consistent
    with pytest.raises(ValueError, match=r"argument 'w2': expected 4 experts in its first dimension \(as w1 of "
                                         r"shape \(4, 16, 16\)\), got shape \(3, 16, 8\)"):
        machmoe.moe(x, rw, w1, w2[:3], top_k=2)
    with pytest.raises(ValueError, match=r"argument 'w1': expected 20 rows in its second dimension \(2n with n = 10, "
                                         r"the last dimension of w2 of shape \(4, 16, 10\)"):
        machmoe.moe(x, rw, w1, torch.randn(4, 16, 10, dtype=torch.float64), top_k=2)
    with pytest.raises(ValueError, match=r"argument 'w1': expected 8 rows .*\(n with n = 8.*'relu'\)"):
        machmoe.moe(x, rw, w1, w2, top_k=2, activation="relu")


def test_hidden_size_one_takes_any_stride_of_its_last_dimension():
    """With hidden = 1 a transposed x has a last-dimension stride other than 1, which torch calls contiguous (so
    .contiguous() leaves it as it is): the functional API and the module take it, with the same result as a copy."""
    torch.manual_seed(3)
    m = machmoe.MoE(1, 4, 4, 2, dtype=torch.float64)
    x = torch.randn(1, 6, dtype=torch.float64).t()
    assert x.stride() == (1, 6) and x.is_contiguous()
    expected = m(x.clone(memory_format=torch.contiguous_format).reshape(6, 1).clone()).output
    assert torch.equal(m(x).output, expected)
    out, _, _ = machmoe.moe(x, m.router_weight, m.w1, m.w2, top_k=2)
    assert torch.equal(out, expected)


def test_functional_errors_name_the_callers_arguments():
    """Sizes the operator would report under its own names (problem.d, problem.n, problem.num_pairs) are checked
    first, in the caller's terms."""
    E = 4
    rw, w1, w2 = torch.randn(E, 0, dtype=torch.float64), torch.randn(E, 16, 0, dtype=torch.float64), \
        torch.randn(E, 0, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="argument 'x': expected a \\(tokens, hidden\\) tensor with hidden >= 1"):
        machmoe.moe(torch.randn(5, 0, dtype=torch.float64), rw, w1, w2, top_k=2)
    w1, w2 = torch.randn(E, 0, 16, dtype=torch.float64), torch.randn(E, 16, 0, dtype=torch.float64)
    with pytest.raises(ValueError, match="argument 'w2': expected an \\(experts, hidden, n\\) tensor with n >= 1"):
        machmoe.moe(torch.randn(5, 16, dtype=torch.float64), torch.randn(E, 16, dtype=torch.float64), w1, w2,
                    top_k=2)
    x, w1, w2 = (torch.randn(5, 16, dtype=torch.float64), torch.randn(E, 16, 16, dtype=torch.float64),
                 torch.randn(E, 16, 8, dtype=torch.float64))
    ti = torch.arange(5).repeat_interleave(2)
    ei, sc = torch.tensor([0, 1] * 5), torch.rand(10, dtype=torch.float64)
    with pytest.raises(ValueError, match="argument 'token_index': expected at most T \\* max_experts_per_token = "
                                         "5 \\* 1 pairs .*got 10 pairs"):
        machmoe.moe_from_routing(x, w1, w2, ti, ei, sc, max_experts_per_token=1)
    out, _ = machmoe.moe_from_routing(x, w1, w2, ti, ei, sc, max_experts_per_token=2)  # the same pairs, K = 2
    assert out.shape == (5, 16)


@pytest.mark.parametrize("through", ["backward", "autograd.grad", "create_graph"])
def test_an_argument_the_backward_refuses_is_a_value_error_through_autograd(through):
    # Outside autograd the operators' refusals (machmoe::Error) are ValueError; a refusal inside loss.backward()
    # passes autograd's engine, which made it a RuntimeError until the backward rethrew it as a c10::ValueError.
    # (create_graph=True takes the backward's Python form, whose operator calls raise ValueError themselves.)
    x, rw, w1, w2, b1, b2 = make(T=12)
    buf = torch.zeros_like(w1)
    out, _, _ = machmoe.moe(x, rw, w1, w2, b1, b2, top_k=2, accumulate_grads_into={"w1": buf})
    buf.resize_(3)  # the buffer the backward adds w1's gradient into, no longer of w1's shape
    with pytest.raises(ValueError, match=r"layer_backward: argument 'into_w1': expected shape \(4, 8, 8\)"):
        if through == "backward":
            out.sum().backward()
        else:  # (a buffer whose gradient is not asked for is not read: w1's is)
            torch.autograd.grad(out.sum(), [x, w1], create_graph=through == "create_graph")
    assert buf.numel() == 3 and not buf.any()  # untouched: refused before anything was written
    if through == "backward":
        assert x.grad is None
