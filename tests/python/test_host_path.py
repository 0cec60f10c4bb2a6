"""The cheap host path of machmoe.moe / MoE.forward (option codes cached per combination, one-pass tensor checks,
main_grad buffers read without named_parameters): every input it lets through is one the full checks accept, and
every input they refuse is still refused with their message, also right after the same options succeeded (the
cache is warm)."""
import pytest
import torch
from torch import nn

import machmoe
from machmoe import functional as F

d, n, E, K = 16, 8, 4, 2


def weights(glu=True, dtype=torch.float32, bias=False):
    torch.manual_seed(0)
    rows = 2 * n if glu else n
    w = dict(router_weight=torch.randn(E, d, dtype=dtype), w1=torch.randn(E, rows, d, dtype=dtype),
             w2=torch.randn(E, d, n, dtype=dtype))
    if bias:
        w.update(b1=torch.randn(E, rows, dtype=dtype), b2=torch.randn(E, d, dtype=dtype))
    return w


def call(x, w, **kw):
    return F.moe(x, w["router_weight"], w["w1"], w["w2"], w.get("b1"), w.get("b2"), **{"top_k": K, **kw})


def warm(**kw):
    """A successful call with these options, so that their codes are cached."""
    w = weights(bias=True)
    call(torch.randn(5, d), w, **kw)
    return w


@pytest.mark.parametrize("kw,exc,match", [
    (dict(tile=128.0), TypeError, "argument 'tile': expected an integer"),  # 128.0 == 128 in the cache's key
    (dict(tile=True), TypeError, "argument 'tile': expected an integer"),
    (dict(top_k=2.0), TypeError, "argument 'top_k': expected an integer"),
    (dict(top_k=True), TypeError, "argument 'top_k': expected an integer"),
    (dict(top_k=E + 1), ValueError, "argument 'top_k': expected an integer in"),
    (dict(top_k=0), ValueError, "argument 'top_k': expected an integer in"),
    (dict(routing="caller"), ValueError, "argument 'routing'"),
    (dict(score=["softmax_topk"]), ValueError, "argument 'score'"),  # unhashable: the cache lookup itself fails
])
def test_warm_cache_still_refuses_bad_options(kw, exc, match):
    w = warm()
    with pytest.raises(exc, match=match):
        call(torch.randn(5, d), w, **kw)


def test_warm_cache_still_refuses_non_float_swiglu_parameters():
    w = weights()
    call(torch.randn(5, d), w, activation="gptoss_swiglu", swiglu_alpha=1.0)
    with pytest.raises(TypeError, match="argument 'swiglu_alpha': expected a real number"):
        call(torch.randn(5, d), w, activation="gptoss_swiglu", swiglu_alpha=True)  # True == 1.0
    with pytest.raises(ValueError, match="argument 'swiglu_limit'"):
        call(torch.randn(5, d), w, activation="swiglu", swiglu_limit=7.0)


@pytest.mark.parametrize("break_it,exc,match", [
    (lambda w, x: w.update(w1=w["w1"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
     "argument 'w1': expected a contiguous tensor"),
    (lambda w, x: w.update(w2=w["w2"][:, :d - 1]), ValueError, "argument 'w2': expected shape"),
    (lambda w, x: w.update(router_weight=w["router_weight"].double()), ValueError,
     "argument 'router_weight': expected dtype torch.float32"),
    (lambda w, x: w.update(b1=w["b1"][:, :-1]), ValueError, "argument 'b1': expected shape"),
    (lambda w, x: w.update(b2=w["b2"].tolist()), TypeError, "argument 'b2': expected a torch.Tensor or None"),
    # non-GLU rows: named with the n they miss and where it came from
    (lambda w, x: w.update(w1=w["w1"][:, :n]), ValueError,
     "argument 'w1': expected " + str(2 * n) + r" rows in its second dimension \(2n with n = " + str(n)),
])
def test_warm_cache_still_refuses_bad_tensors(break_it, exc, match):
    w = warm()
    x = torch.randn(5, d)
    break_it(w, x)
    with pytest.raises(exc, match=match):
        call(x, w)


def test_warm_cache_still_refuses_bad_inputs():
    w = warm()
    with pytest.raises(ValueError, match="argument 'x': expected one of"):
        call(torch.randn(5, d).to(torch.int32), w)
    with pytest.raises(ValueError, match="argument 'x': expected unit stride"):
        call(torch.randn(d, 5).t(), w)
    with pytest.raises(ValueError, match="argument 'x': expected a \\(tokens, hidden\\) tensor"):
        call(torch.randn(2, 5, d), w)
    with pytest.raises(ValueError, match="argument 'w1': expected dtype torch.float64"):
        call(torch.randn(5, d, dtype=torch.float64), w)


def test_fast_and_full_paths_compute_the_same():
    """The same call through the cached path and through the full checks (first sight of the options)."""
    w = weights(bias=True)
    x = torch.randn(7, d)
    F._OPTION_CACHE.clear()
    first = call(x, w, rounding="up", routing="token_rounding", tile=8)
    assert F._OPTION_CACHE  # cached by the full path
    second = call(x, w, rounding="up", routing="token_rounding", tile=8)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_module_refuses_a_changed_parameter_after_success():
    m = machmoe.MoE(d, n, E, K)
    m(torch.randn(5, d))
    m.w2.data = m.w2.data.double()  # same Parameter object, another dtype
    with pytest.raises(ValueError, match="argument 'w2': expected dtype torch.float32"):
        m(torch.randn(5, d))


def test_module_reads_parametrized_weights():
    """A parametrization moves w1 out of _parameters: the module reads the attribute, as before."""
    class Scale(nn.Module):
        def forward(self, w):
            return 2 * w

    m = machmoe.MoE(d, n, E, K)
    x = torch.randn(5, d)
    ref = machmoe.moe(x, m.router_weight, 2 * m.w1, m.w2, top_k=K)[0]
    torch.nn.utils.parametrize.register_parametrization(m, "w1", Scale())
    torch.testing.assert_close(m(x).output, ref)


def test_main_grad_fast_path_refuses_bad_buffers_after_success():
    m = machmoe.MoE(d, n, E, K, accumulate_into_main_grad=True)
    x = torch.randn(5, d, requires_grad=True)
    m(x).output.sum().backward()
    assert m.w1.grad is None and torch.count_nonzero(m.w1.main_grad) > 0
    m.w1.main_grad = torch.zeros(E, 2 * n, d + 1)
    with pytest.raises(ValueError, match="argument 'w1.main_grad': expected shape"):
        m(x)
    m.w1.main_grad = torch.zeros(E, 2 * n, d, requires_grad=True)
    with pytest.raises(ValueError, match="argument 'w1.main_grad': expected a buffer that does not require grad"):
        m(x)
    del m.w2.main_grad  # created again on the next call, as main_grads() does
    m.w1.main_grad = torch.zeros(E, 2 * n, d, dtype=torch.float64)
    with pytest.raises(ValueError, match="argument 'w1.main_grad': expected dtype"):
        m(x)
    m.w1.main_grad = torch.zeros(E, 2 * n, d)
    m(x).output.sum().backward()
    assert torch.count_nonzero(m.w2.main_grad) > 0 and m.w2.grad is None


def test_main_grad_frozen_parameter_gets_ordinary_treatment():
    m = machmoe.MoE(d, n, E, K, accumulate_into_main_grad=True)
    m.router_weight.requires_grad_(False)
    x = torch.randn(5, d, requires_grad=True)
    m(x).output.sum().backward()
    assert not hasattr(m.router_weight, "main_grad") and m.router_weight.grad is None
    assert torch.count_nonzero(m.w1.main_grad) > 0
