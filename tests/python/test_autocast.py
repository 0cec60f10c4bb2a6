"""The layer under torch.autocast (functional._autocast_dtype): x is cast to autocast's dtype, as torch's matmuls
cast theirs; float32 weights under a bf16/fp16 autocast go to the operators as master weights (cast there for the
call, float32 gradients straight from the kernels), weights of other dtypes are cast too. On the CPU, whose reference
computes in float32 and float64 while CPU autocast asks for bfloat16, the layer computes in float32. Marked gpu:
float32 parameters under CUDA autocast run the bf16 Hopper kernels (the fallback policy "error" would raise on the
float32 reference path) with the forward and input gradient of the bf16 layer, bitwise."""
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


def _meta_layer(weight_dtype, bias=True):
    kw = dict(device="meta", dtype=weight_dtype, requires_grad=True)
    return (torch.empty(E, D, **kw), torch.empty(E, 2 * N, D, **kw), torch.empty(E, D, N, **kw),
            torch.empty(E, 2 * N, **kw) if bias else None, torch.empty(E, D, **kw) if bias else None)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
def test_float32_master_weights_of_a_half_x_get_float32_gradients(x_dtype):
    """float32 weights with a bf16/fp16 x (what the layer passes under autocast): the layer computes in x's dtype and
    the weights' gradients are float32. On meta (the operators' fake kernels, which torch.compile traces too),
    through the functional API's checks and the layer's C++ autograd node, for moe and moe_from_routing (grouped_experts
reads CPU counts, which meta tensors do not have)."""
    x = torch.empty(24, D, device="meta", dtype=x_dtype, requires_grad=True)
    rw, w1, w2, b1, b2 = _meta_layer(torch.float32)
    out, logits, counts = machmoe.moe(x, rw, w1, w2, b1, b2, top_k=K)
    assert out.dtype == x_dtype and logits.dtype == x_dtype and counts.dtype == torch.int32
    (out.sum() + logits.sum()).backward()
    assert x.grad.dtype == x_dtype
    for name, t in zip(("router_weight", "w1", "w2", "b1", "b2"), (rw, w1, w2, b1, b2)):
        assert t.grad is not None and t.grad.dtype == torch.float32 and t.grad.shape == t.shape, name

    token = torch.arange(24, device="meta").repeat_interleave(2)
    scores = torch.empty(48, device="meta")
    _, w1, w2, b1, b2 = _meta_layer(torch.float32)
    routed, _ = machmoe.moe_from_routing(x, w1, w2, token, token, scores, b1, b2, max_experts_per_token=2)
    routed.sum().backward()
    assert all(t.grad.dtype == torch.float32 for t in (w1, w2, b1, b2))


def test_weights_of_another_dtype_are_refused_and_the_message_names_master_weights_where_they_apply():
    x = torch.empty(24, D, device="meta", dtype=torch.bfloat16)
    rw, w1, w2, b1, b2 = _meta_layer(torch.float16, bias=False)
    with pytest.raises(ValueError, match=r"argument 'w1': expected dtype torch.bfloat16 \(the dtype of x\) or "
                                         r"torch.float32 \(float32 master weights: the layer computes in the dtype "
                                         r"of x\), got torch.float16$"):
        machmoe.moe(x, rw, w1, w2, top_k=K)
    _, w1, _, _, _ = _meta_layer(torch.float32, bias=False)
    with pytest.raises(ValueError, match=r"argument 'router_weight': expected dtype torch.bfloat16 \(the dtype of "
                                         r"x\) or torch.float32"):
        machmoe.moe(x, rw, w1, w1.new_empty(E, D, N), top_k=K)
    # float32 x: no master weights (the CPU reference computes in float32 and float64)
    rw, w1, w2 = torch.randn(E, D), torch.randn(E, 2 * N, D, dtype=torch.float64), torch.randn(E, D, N)
    with pytest.raises(ValueError, match=r"argument 'w1': expected dtype torch.float32 \(the dtype of x\), got "
                                         r"torch.float64$"):
        machmoe.moe(torch.randn(24, D), rw, w1, w2, top_k=K)


def test_the_operators_refuse_weights_of_another_dtype_naming_the_argument():
    """The binding's own check (the operators are public): float32 weights are master weights of a bf16/fp16 x
    only."""
    ops = torch.ops.machmoe
    options = (K, 0, 0, 0, 0, 0, 128, 0, 1.702, 7.0)
    x = torch.randn(12, D)
    rw, w1, w2 = torch.randn(E, D), torch.randn(E, 2 * N, D), torch.randn(E, D, N)
    with pytest.raises(ValueError, match=r"machmoe::layer_forward: argument 'w2': expected dtype Float \(the dtype "
                                         r"of x\), got Double$"):
        ops.layer_forward(x, rw, w1, None, w2.double(), None, None, None, None, *options)
    with pytest.raises(ValueError, match=r"machmoe::layer_forward: argument 'router_weight': expected dtype Float "
                                         r"\(the dtype of x\), got BFloat16$"):
        ops.layer_forward(x, rw.bfloat16(), w1, None, w2, None, None, None, None, *options)


def test_grouped_experts_take_float32_master_weights_of_a_half_x():
    """machmoe.parallel.GroupedExperts (the expert-parallel layer's experts) passes float32 weights with a bf16 x to
    the operators as master weights, as machmoe.MoE does under autocast: float32 gradients, the output in x's dtype.
    On meta (the operators' fake kernels), in the modes that do not read counts on the host: rows by expert index, and
    pairs (the expert-parallel layer's default)."""
    experts = parallel.GroupedExperts(D, N, E, bias=True, device="meta", dtype=torch.float32)
    x = torch.empty(24, D, device="meta", dtype=torch.bfloat16, requires_grad=True)
    y = experts(x, expert_index=torch.zeros(24, dtype=torch.int64, device="meta"))
    token = torch.arange(24, device="meta").repeat_interleave(2)
    pairs = parallel.ExpertPairs(token, token % E, torch.empty(48, device="meta"), 2)
    z = experts(x, pairs=pairs)
    assert y.dtype == z.dtype == torch.bfloat16
    (y.sum() + z.sum()).backward()
    assert x.grad.dtype == torch.bfloat16
    for name, p in experts.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and p.grad.shape == p.shape, name
    experts.half()
    with pytest.raises(ValueError, match=r"argument 'w1': expected dtype torch.bfloat16 \(the dtype of x\) or "
                                         r"torch.float32 \(float32 master weights"):
        experts(x, pairs=pairs)


def test_torchtitan_experts_pass_float32_weights_with_a_half_x_as_master_weights(monkeypatch):
    """torchtitan's experts (TorchTitanGroupedExperts, torchtitan_experts_forward) with float32 weights and a bf16 x,
    as autocast hands them over: x reaches the layer as it is (no float32 copy that the layer would cast back), the
    concatenated gate/up weight and the down weight as float32 master weights. The layer is recorded, not run (the
    counts mode reads the counts on the host, which meta cannot); test_torchtitan_experts_with_float32_weights_under_
    cuda_autocast_run_the_bf16_kernels runs it on the GPU."""
    seen = []

    def recording(x, counts, w1, w2, *args, **kwargs):
        seen.append((x, w1.dtype, w2.dtype))
        return torch.zeros_like(x)

    monkeypatch.setattr(parallel, "grouped_experts", recording)
    tt = parallel.TorchTitanGroupedExperts(D, N, E, device="meta", dtype=torch.float32)
    x = torch.empty(24, D, device="meta", dtype=torch.bfloat16)
    assert tt(x, torch.full((E,), 3, dtype=torch.int64, device="meta")).dtype == torch.bfloat16
    assert len(seen) == 1 and seen[0][0] is x and seen[0][1:] == (torch.float32, torch.float32)
    x16 = x.half()  # fp16 too; a float32 x with bf16 weights is still cast to the weights' dtype
    tt(x16, torch.full((E,), 3, dtype=torch.int64, device="meta"))
    assert seen[1][0] is x16
    low = parallel.TorchTitanGroupedExperts(D, N, E, device="meta", dtype=torch.bfloat16)
    assert low(x.float(), torch.full((E,), 3, dtype=torch.int64, device="meta")).dtype == torch.float32
    assert seen[2][0].dtype == torch.bfloat16
    cpu = parallel.TorchTitanGroupedExperts(D, N, E, dtype=torch.float32)  # the CPU's reference takes float32 x
    assert cpu(torch.empty(24, D, dtype=torch.bfloat16), torch.full((E,), 3)).dtype == torch.bfloat16
    assert seen[3][0].dtype == torch.float32


def test_the_operators_take_a_master_weights_buffer_in_float32_only():
    """accumulate_grads_into for a float32 master weight: a float32 buffer (as the Python layer asks), refused in x's
    dtype by the operator too, before any work, naming the buffer."""
    ops = torch.ops.machmoe
    options = (K, 0, 0, 0, 0, 0, 128, 0, 1.702, 7.0)
    x = torch.randn(12, D).bfloat16()
    rw, w1, w2 = torch.randn(E, D), torch.randn(E, 2 * N, D), torch.randn(E, D, N)
    with pytest.raises(ValueError, match=r"machmoe::layer_forward: argument 'into_w1': expected dtype Float \(the "
                                         r"gradient of a float32 master weight\), got BFloat16$"):
        ops.layer_forward(x, rw, w1, None, w2, None, None, None, None, *options, None,
                          torch.zeros(E, 2 * N, D, dtype=torch.bfloat16), None, None, None)
    with pytest.raises(ValueError, match=r"argument 'accumulate_grads_into\['w1'\]': expected dtype torch.float32, "
                                         r"got torch.bfloat16$"):
        meta = lambda t: t.to("meta")  # (the functional API refuses a bf16 x on the CPU first)
        machmoe.moe(meta(x), meta(rw), meta(w1), meta(w2), top_k=K,
                    accumulate_grads_into={"w1": torch.zeros(E, 2 * N, D, dtype=torch.bfloat16, device="meta")})
    # a bf16 weight's buffer: bf16 or float32 (only the library's CPU reference refuses bf16 x, after the checks)
    with pytest.raises(ValueError, match=r"machmoe::forward: argument 'x': expected dtype fp32 or fp64 on cpu"):
        ops.layer_forward(x, rw, w1.bfloat16(), None, w2, None, None, None, None, *options, None,
                          torch.zeros(E, 2 * N, D, dtype=torch.bfloat16), None, None, None)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.gpu
def test_float32_parameters_under_cuda_autocast_run_the_bf16_kernels():
    """The forward and the input gradient are the bf16 layer's, bitwise (the operator casts the float32 weights as
    autocast would); the weight gradients come out of the kernels in float32, unrounded, near the bf16 layer's and
    the float64 reference's."""
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
        # The bf16 layer's gradient is this one rounded to bf16 (up to the order of the fp32 sums): 2^-9 at most
        # per element.
        assert rel(g, low_grads[name]) < 4e-3, (name, rel(g, low_grads[name]))
        if name in ("w1", "w2", "router_weight"):  # written in float32, not bf16 values widened
            assert not torch.equal(g, g.bfloat16().float()), name
    # Against the float64 reference on the same (bf16-rounded) inputs, relative Frobenius error, with the routing
    # pinned to the GPU's logits: bf16 logits can reorder near-ties, and a float64 router would then pick other
    # experts for a few tokens (2.8e-2 unpinned on an H100, though every value above was bitwise right).
    w = {name: t.detach().to("cpu", torch.float64).requires_grad_() for name, t in low.named_parameters()}
    tok, exp, s = route(out.router_logits.detach().to("cpu", torch.float64), k, "softmax_topk")
    expect = reference_experts(xb.detach().to("cpu", torch.float64), tok, exp, s, w["w1"], w["w2"], None, None,
                               "swiglu", "interleaved")
    err = rel(out.output.cpu(), expect)
    assert err < 1e-2, err
    expect.backward(dy.to("cpu", torch.float64))
    got = grads(m)
    for name in ("w1", "w2"):
        err = rel(got[name].cpu(), w[name].grad)
        assert err < 1e-2, (name, err)


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_torchtitan_experts_with_float32_weights_under_cuda_autocast_run_the_bf16_kernels(x_dtype):
    """torchtitan's experts with float32 weights under autocast, x in bf16 (autocast's matmul output) or float32 (the
    residual stream): the bf16 kernels with the float32 weights as master weights. The output is the bf16 experts',
    bitwise, in x's dtype; the input gradient too; the weight gradients float32, near the bf16 experts'."""
    assert torch.cuda.is_available(), "GPU test run on a machine without a usable CUDA device"
    d, n, experts, rows = 256, 128, 8, 1000
    torch.manual_seed(12)
    tt = parallel.TorchTitanGroupedExperts(d, n, experts, device="cuda", dtype=torch.float32)
    tt.init_weights(0.02)
    low = copy.deepcopy(tt).to(torch.bfloat16)
    counts = torch.tensor([300, 0, 17, 250, 1, 128, 200, 64], device="cuda")  # 40 alignment-padding rows
    x = torch.randn(rows, d, device="cuda").to(x_dtype)
    dy = torch.randn(rows, d, device="cuda")
    before = machmoe.fallback_policy()
    try:
        machmoe.set_fallback_policy("error")  # a float32 reference GEMM would raise
        xa = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = tt(xa, counts)
        out.backward(dy.to(x_dtype))
        xb = x.bfloat16().requires_grad_()
        ref = low(xb, counts)
        ref.backward(dy.bfloat16())
        torch.cuda.synchronize()
    finally:
        machmoe.set_fallback_policy(before)
    assert out.dtype == x_dtype and torch.equal(out, ref.to(x_dtype))
    assert xa.grad.dtype == x_dtype and torch.equal(xa.grad, xb.grad.to(x_dtype))
    for (name, p), q in zip(tt.named_parameters(), low.parameters()):
        assert p.grad.dtype == torch.float32, name
        assert rel(p.grad, q.grad) < 4e-3, (name, rel(p.grad, q.grad))


@pytest.mark.gpu
def test_autocast_keeps_no_bf16_copy_of_the_weights_between_forward_and_backward():
    """The float32 parameters reach the operator as they are: what autograd saves for the backward holds them by
    reference, and no bf16 copy of w1 or w2 (which the backward casts again)."""
    assert torch.cuda.is_available(), "GPU test run on a machine without a usable CUDA device"
    torch.manual_seed(12)
    m = machmoe.MoE(256, 128, 8, 2, device="cuda", dtype=torch.float32)
    x = torch.randn(512, 256, device="cuda", requires_grad=True)
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype, t.data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = m(x)
    weight_shapes = {tuple(m.w1.shape), tuple(m.w2.shape)}
    assert (tuple(m.w1.shape), torch.float32, m.w1.data_ptr()) in saved, saved
    assert (tuple(m.w2.shape), torch.float32, m.w2.data_ptr()) in saved, saved
    assert not [s for s in saved if s[0] in weight_shapes and s[1] == torch.bfloat16], saved
    out.output.float().square().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in m.parameters())


@pytest.mark.gpu
def test_defer_weight_grads_under_autocast_defers_the_float32_parameters():
    """Under autocast the parameters are leaves of the graph (no cast in between), so defer_weight_grads defers
    their gradients, which then equal the undeferred backward's bitwise."""
    assert torch.cuda.is_available(), "GPU test run on a machine without a usable CUDA device"
    torch.manual_seed(13)
    m = machmoe.MoE(256, 128, 8, 2, device="cuda", dtype=torch.float32)
    plain = copy.deepcopy(m)
    x = torch.randn(700, 256, device="cuda")
    dy = torch.randn(700, 256, device="cuda", dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, ref = m(x).output, plain(x).output
    ref.backward(dy)
    with machmoe.defer_weight_grads() as deferred:
        out.backward(dy)
    assert len(deferred) == 1 and m.w1.grad is None and m.w2.grad is None
    deferred.run()
    for name, g in grads(m).items():
        assert g.dtype == torch.float32 and torch.equal(g, grads(plain)[name]), name


def test_compiled_module_under_autocast_is_the_eager_one():
    """torch.compile traces the autocast query (fullgraph: no graph break) and gives the eager results."""
    m = layer()
    x = torch.randn(20, D).bfloat16()
    step = torch.compile(lambda inp: m(inp).output, fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled = step(x)
        eager = m(x).output
    assert compiled.dtype == torch.float32 and torch.equal(compiled, eager)


@pytest.mark.gpu
def test_compiled_module_under_cuda_autocast_is_the_eager_one():
    """torch.compile traces the master-weight path (the fakes give float32 weight gradients) and gives the eager
    results, forward and gradients, bitwise."""
    assert torch.cuda.is_available(), "GPU test run on a machine without a usable CUDA device"
    torch.manual_seed(14)
    m = machmoe.MoE(256, 128, 8, 2, device="cuda", dtype=torch.float32)
    x = torch.randn(300, 256, device="cuda")
    dy = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    step = torch.compile(lambda inp: m(inp).output, fullgraph=True, backend="aot_eager")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        compiled = step(x)
    compiled.backward(dy)
    compiled_grads = {name: g.clone() for name, g in grads(m).items()}
    m.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = m(x).output
    eager.backward(dy)
    assert compiled.dtype == torch.bfloat16 and torch.equal(compiled, eager)
    for name, g in grads(m).items():
        assert g.dtype == torch.float32 and torch.equal(compiled_grads[name], g), name
