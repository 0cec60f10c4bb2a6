"""The layer under torch.autocast (functional._autocast_dtype): x, the router and the expert weights are cast to
autocast's dtype, as torch's matmuls cast theirs, and the casts' backward returns the gradients to the parameters in
their own dtype. On the CPU, whose reference computes in float32 and float64 while CPU autocast asks for bfloat16, the
layer computes in float32. Marked gpu: float32 parameters under CUDA autocast run the bf16 Hopper kernels (the
fallback policy "error" would raise on the float32 reference path) with the results of the bf16 layer, bitwise."""
import copy

import pytest
import torch

import machmoe
from machmoe import parallel
from reference import experts as reference_experts, route

D, N, E, K = 32, 16, 8, 2


def layer(dtype=torch.float32, device="cpu", **kw):
    torch.manual_seed(3)
    return machmoe.MoE(D, N, E, K, device=device, dtype=dtype, **kw)


def grads(m):
    return {name: p.grad for name, p in m.named_parameters()}


def test_module_on_the_cpu_computes_in_float32_under_bf16_autocast():
    m = layer()
    plain = copy.deepcopy(m)
    x = torch.randn(40, D).bfloat16()  # what an autocast Linear before the layer returns
    xa = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(xa)
    assert out.output.dtype == torch.float32 and out.router_logits.dtype == torch.float32
    xp = x.clone().requires_grad_()
    ref = plain(xp.float())
    assert torch.equal(out.output, ref.output) and torch.equal(out.expert_counts, ref.expert_counts)
    out.output.square().sum().backward()
    ref.output.square().sum().backward()
    assert xa.grad.dtype == torch.bfloat16 and torch.equal(xa.grad, xp.grad)
    for name, g in grads(m).items():
        assert g is not None and g.dtype == torch.float32, name
        assert torch.equal(g, grads(plain)[name]), name


def test_autocast_off_inside_an_autocast_region_is_the_plain_layer():
    m = layer()
    x = torch.randn(12, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autocast("cpu", enabled=False):
            inner = m(x).output
    assert torch.equal(inner, m(x).output)


def test_float64_is_not_cast_and_a_mismatch_says_so():
    m = layer(torch.float64)
    x = torch.randn(5, D, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m(x).output.dtype == torch.float64  # float64 throughout: nothing cast
        with pytest.raises(ValueError, match=r"argument 'x': expected dtype torch.float64 \(the dtype of this MoE's "
                                             r"parameters; under torch.autocast the layer computes in torch.float32, "
                                             r"and float64 tensors are not cast\), got torch.float32$"):
            m(torch.randn(5, D).bfloat16())


def test_functional_calls_follow_autocast():
    torch.manual_seed(5)
    x = torch.randn(24, D)
    rw = torch.randn(E, D) / D ** 0.5
    w1 = torch.randn(E, 2 * N, D) / D ** 0.5
    w2 = torch.randn(E, D, N) / N ** 0.5
    xb = x.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, logits, counts = machmoe.moe(xb, rw, w1, w2, top_k=K)
    ref = machmoe.moe(xb.float(), rw, w1, w2, top_k=K)
    assert out.dtype == torch.float32 and torch.equal(out, ref[0]) and torch.equal(counts, ref[2])

    token = torch.arange(24).repeat_interleave(2)
    expert = torch.stack([torch.arange(24) % E, (torch.arange(24) + 3) % E], 1).reshape(-1)
    scores = torch.rand(48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routed, _ = machmoe.moe_from_routing(xb, w1, w2, token, expert, scores, max_experts_per_token=2)
    assert torch.equal(routed, machmoe.moe_from_routing(xb.float(), w1, w2, token, expert, scores,
                                                        max_experts_per_token=2)[0])

    counts = torch.tensor([3, 0, 5, 4, 2, 6, 1, 3])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grouped = machmoe.grouped_experts(xb, counts, w1, w2)
    assert torch.equal(grouped, machmoe.grouped_experts(xb.float(), counts, w1, w2))


def test_accumulate_into_main_grad_under_autocast():
    m = layer(accumulate_into_main_grad=True)
    plain = layer()
    x = torch.randn(30, D).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(x).output.square().sum().backward()
    plain(x.float()).output.square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is None, name
        assert torch.equal(p.main_grad, dict(plain.named_parameters())[name].grad), name


def test_grouped_experts_module_follows_autocast():
    experts = parallel.GroupedExperts(D, N, E)
    counts = torch.tensor([3, 0, 5, 4, 2, 6, 1, 3])
    x = torch.randn(24, D).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = experts(x, counts)
        empty = experts(x[:0], torch.zeros(E, dtype=torch.int64))  # the empty call's checks, after the casts
    assert y.dtype == torch.float32 and torch.equal(y, experts(x.float(), counts))
    assert empty.shape == (0, D)


@pytest.mark.gpu
def test_float32_parameters_under_cuda_autocast_run_the_bf16_kernels():
    assert torch.cuda.is_available(), "GPU test run on a machine without a usable CUDA device"
    d, n, experts, k, tokens = 256, 128, 16, 4, 2048
    torch.manual_seed(11)
    m = machmoe.MoE(d, n, experts, k, device="cuda", dtype=torch.float32)
    low = copy.deepcopy(m).to(torch.bfloat16)  # the same weights, rounded as autocast rounds them
    x = torch.randn(tokens, d, device="cuda")
    before = machmoe.fallback_policy()
    try:
        machmoe.set_fallback_policy("error")  # the float32 reference path would raise
        with pytest.raises(ValueError, match="reference GEMM"):
            m(x)
        xa = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = m(xa)
        dy = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
        out.output.backward(dy)
        xb = x.bfloat16().requires_grad_()
        ref = low(xb)
        ref.output.backward(dy)
        torch.cuda.synchronize()
    finally:
        machmoe.set_fallback_policy(before)
    assert out.output.dtype == torch.bfloat16
    assert torch.equal(out.output, ref.output) and torch.equal(out.expert_counts, ref.expert_counts)
    assert xa.grad.dtype == torch.float32 and torch.equal(xa.grad, xb.grad.float())
    low_grads = grads(low)
    for name, g in grads(m).items():
        assert g.dtype == torch.float32, name
        assert torch.equal(g, low_grads[name].float()), name
    # And against the float64 reference on the same (bf16-rounded) inputs, relative Frobenius error, with the routing
    # pinned to the GPU's logits: bf16 logits can reorder near-ties, and a float64 router would then pick other
    # experts for a few tokens (2.8e-2 unpinned on an H100, though every value above was bitwise right).
    w = {name: t.detach().to("cpu", torch.float64) for name, t in low.named_parameters()}
    tok, exp, s = route(out.router_logits.detach().to("cpu", torch.float64), k, "softmax_topk")
    expect = reference_experts(xb.detach().to("cpu", torch.float64), tok, exp, s, w["w1"], w["w2"], None, None,
                               "swiglu", "interleaved")
    err = ((out.output.double().cpu() - expect).norm() / expect.norm()).item()
    assert err < 1e-2, err


def test_compiled_module_under_autocast_is_the_eager_one():
    """torch.compile traces the autocast query (fullgraph: no graph break) and gives the eager results."""
    m = layer()
    x = torch.randn(20, D).bfloat16()
    step = torch.compile(lambda inp: m(inp).output, fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled = step(x)
        eager = m(x).output
    assert compiled.dtype == torch.float32 and torch.equal(compiled, eager)
