"""torch.compile with dynamic token and row counts, fake implementations of the split-backward operators, inputs
with overlapping rows, and the version counters of the caller buffers (into_*) the backward operators write.

Before: the fake of layer_forward passed T (and P) to saved_nbytes, which guarded it to the traced value (a
ConstraintViolationError under mark_dynamic; FailOnRecompileLimitHit after 8 distinct T with fullgraph=True);
grouped_expert_index took an int row count (the same for P); layer_backward_input/_weight had no fake; MoE passed an
expanded input to the operators, which refused it; and the into_* buffers were written without a version bump, so
autograd missed the modification of a tensor it had saved."""
import pytest
import torch
from torch._dynamo.utils import counters

import machmoe
from layer_inputs import make, rel

ops = torch.ops.machmoe


def _module():
    torch.manual_seed(0)
    return machmoe.MoE(16, 8, 4, 2, dtype=torch.float64, bias=True, aux_loss_coef=0.01)


def _grads(m, step, x):
    out, aux = step(x)
    wrt = [x, m.router_weight, m.w1, m.w2, m.b1, m.b2]
    return [out] + list(torch.autograd.grad(out.square().sum() + aux, wrt))


def _compare(m, compiled, x):
    def step(inp):
        o = m(inp)
        return o.output, o.aux_loss

    eager = _grads(m, step, x)
    got = _grads(m, compiled, x)
    for name, a, b in zip(["out", "x", "router_weight", "w1", "w2", "b1", "b2"], got, eager):
        assert rel(a, b) < 1e-12, (x.shape[0], name, rel(a, b))


def _backends():
    backends = ["aot_eager"]
    try:  # inductor compiles C++ on the CPU: needs a working host compiler
        torch.compile(lambda t: t * 2, backend="inductor", fullgraph=True)(torch.ones(3))
        backends.append("inductor")
    except Exception:  # noqa: BLE001  (no compiler: aot_eager only)
        pass
    return backends


@pytest.fixture(params=_backends())
def backend(request):
    return request.param


def _compiled_module_step(backend):
    """A fresh module, and its forward (output, aux loss) compiled with fullgraph=True after the compile caches and
    counters are cleared."""
    m = _module()

    def step(inp):
        o = m(inp)
        return o.output, o.aux_loss

    torch._dynamo.reset()
    counters.clear()
    return m, torch.compile(step, fullgraph=True, backend=backend)


def test_module_compiles_over_many_token_counts_without_hitting_the_recompile_limit(backend):
    m, compiled = _compiled_module_step(backend)
    token_counts = list(range(5, 5 + torch._dynamo.config.recompile_limit + 4))  # more than the recompile limit
    for T in token_counts:
        _compare(m, compiled, torch.randn(T, 16, dtype=torch.float64, requires_grad=True))
    # The first T is compiled static, the second makes T dynamic (automatic dynamic shapes); no more after that.
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


def test_mark_dynamic_token_count_compiles_once(backend):
    m, compiled = _compiled_module_step(backend)
    for T in (5, 7, 9, 12):
        x = torch.randn(T, 16, dtype=torch.float64, requires_grad=True)
        torch._dynamo.mark_dynamic(x, 0)
        _compare(m, compiled, x)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_grouped_experts_with_dynamic_rows_compiles_once():
    _, _, w1, w2, b1, b2 = make(T=4)

    def f(x, counts):
        return machmoe.grouped_experts(x, counts, w1, w2, b1, b2)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for P in (7, 9, 12, 15):
        x = torch.randn(P, 8, dtype=torch.float64, requires_grad=True)
        counts = torch.tensor([2, 0, P - 4, 2])
        torch._dynamo.mark_dynamic(x, 0)
        got, want = compiled(x, counts), f(x, counts)
        assert rel(got, want) == 0
        go = torch.randn_like(want)
        g = torch.autograd.grad((got * go).sum(), [x, w1, w2])
        r = torch.autograd.grad((want * go).sum(), [x, w1, w2])
        assert max(rel(a, b) for a, b in zip(g, r)) < 1e-12
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_grouped_expert_index_takes_a_symbolic_row_count():
    # (Its fake receiving a SymInt is exercised by the mark_dynamic test above.)
    assert "SymInt rows" in str(ops.grouped_expert_index.default._schema)


# ---- inputs with overlapping rows -----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(6, 8), (2, 3, 8)])
def test_module_accepts_an_expanded_input(shape):
    m = machmoe.MoE(8, 4, 4, 2, dtype=torch.float64, bias=True)
    x = torch.randn(1, 8, dtype=torch.float64).expand(*shape)
    out = m(x).output
    xc = x.contiguous()
    assert rel(out, m(xc).output) == 0
    g = torch.autograd.grad(out.square().sum(), [m.w1])[0]
    assert rel(g, torch.autograd.grad(m(xc).output.square().sum(), [m.w1])[0]) == 0


def test_functional_reports_overlapping_rows_of_x():
    x, rw, w1, w2, b1, b2 = (t.detach() for t in make(T=6))
    expanded = x[:1].expand(6, 8)
    with pytest.raises(ValueError, match=r"x.*rows that do not overlap.*strides \(0, 1\)"):
        machmoe.moe(expanded, rw, w1, w2, b1, b2, top_k=2)
    # One row (T = 1) cannot overlap with another: accepted as it is.
    out = machmoe.moe(x[:1].expand(1, 8), rw, w1, w2, b1, b2, top_k=2)[0]
    assert rel(out, machmoe.moe(x[:1].contiguous(), rw, w1, w2, b1, b2, top_k=2)[0]) == 0


# ---- fake implementations of the split backward -----------------------------------------------------------------------

TOPK_OPTIONS = (2, 0, 0, 0, 0, 0, 8, 0, 1.702, 7.0)  # top_k, swiglu, interleaved, softmax_topk, topk, nearest, 8, preact
CALLER_OPTIONS = (2, 0, 0, 0, 2, 0, 128, 0, 1.702, 7.0)


def _split_backward_args(caller, bias):
    x, rw, w1, w2, b1, b2 = (None if t is None else t.detach() for t in make(T=10, bias=bias))
    if caller:
        rw = None
        tok = torch.tensor([0, 0, 1, 3, 3, 4, 6, 7, 7, 9])
        exp = torch.tensor([1, 3, 0, 2, 1, 3, 0, 2, 3, 1])
        sc = torch.rand(10, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        opts = CALLER_OPTIONS
    else:
        tok = exp = sc = None
        opts = TOPK_OPTIONS
    out, logits, _, saved = ops.layer_forward(x, rw, w1, b1, w2, b2, tok, exp, sc, *opts)
    go = torch.randn_like(out)
    gl = None if caller else torch.randn_like(logits)
    inputs = (go, gl, x, rw, w1, b1, w2, b2, tok, exp, sc, saved, *opts)
    *_, deferred = ops.layer_backward_input(*inputs)
    weights = (go, x, rw, w1, b1, w2, b2, tok, exp, sc, saved, deferred, *opts)
    return inputs, weights, (rw, w1, b1, w2, b2)


FAKE_TESTS = ("test_schema", "test_faketensor")


@pytest.mark.parametrize("caller", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_backward_operators_have_fake_implementations(caller, bias):
    inputs, weights, (rw, w1, b1, w2, b2) = _split_backward_args(caller, bias)
    torch.library.opcheck(ops.layer_backward, inputs, test_utils=FAKE_TESTS)  # the full backward's fake too
    torch.library.opcheck(ops.layer_backward_input, inputs, test_utils=FAKE_TESTS)
    torch.library.opcheck(ops.layer_backward_weight, weights, test_utils=FAKE_TESTS)
    # With caller buffers (into_*): their gradients are returned empty.
    if not caller:
        torch.library.opcheck(ops.layer_backward_input, inputs + (torch.zeros_like(rw),), test_utils=FAKE_TESTS)
    into = (torch.zeros_like(w1), None, None, None if b2 is None else torch.zeros_like(b2))  # w1 (and b2)
    torch.library.opcheck(ops.layer_backward_weight, weights + into, test_utils=FAKE_TESTS)


# ---- version counters of the into_* buffers ---------------------------------------------------------------------

def test_into_buffer_write_is_seen_by_autograd():
    x, rw, w1, w2, b1, b2 = make(T=6)
    buf = torch.zeros_like(w1).detach()  # e.g. a main_grad buffer
    a = torch.ones_like(buf, requires_grad=True)
    y = (a * buf).sum()  # autograd saves buf (the gradient of a)
    out = machmoe.moe(x, rw, w1, w2, b1, b2, top_k=2, accumulate_grads_into={"w1": buf})[0]
    out.square().sum().backward()  # adds dL/dw1 into buf
    assert buf.abs().sum() > 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(y, a)


def test_main_grad_versions_increase_after_backward():
    m = machmoe.MoE(8, 4, 4, 2, dtype=torch.float64, accumulate_into_main_grad=True)
    mg = m.main_grads()
    before = {k: v._version for k, v in mg.items()}
    m(torch.randn(6, 8, dtype=torch.float64)).output.sum().backward()
    assert all(mg[k]._version > before[k] for k in mg), {k: (before[k], v._version) for k, v in mg.items()}


@pytest.mark.parametrize("op", ["layer_backward", "split"])
def test_backward_operators_bump_every_present_into_buffer(op):
    inputs, weights, (rw, w1, b1, w2, b2) = _split_backward_args(False, True)
    into = [torch.zeros_like(t) for t in (rw, w1, b1, w2, b2)]
    if op == "layer_backward":
        ops.layer_backward(*inputs, *into)
    else:
        ops.layer_backward_input(*inputs, into[0])
        ops.layer_backward_weight(*weights, *into[1:])
    assert [t._version for t in into] == [1] * 5
    assert all(t.abs().sum() > 0 for t in into)
    # An absent buffer is left alone (and a present one is bumped once per call).
    ops.layer_backward(*inputs, None, into[1])
    assert [t._version for t in into] == [1, 2, 1, 1, 1]
