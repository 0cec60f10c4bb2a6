"""activation="gptoss_swiglu" and the gpt-oss loader against a plain PyTorch transcription of HF transformers'
GptOssTopKRouter + GptOssExperts, forward and every gradient, autograd in float64 as the reference.

Inputs: x ~ N(0, 1), and gate_up_proj scaled so that the pre-activations are of the limit's size: a good share of
gate and up values lie beyond the limit (each test asserts it), so the clamps and their zero gradients are exercised.
Errors are relative Frobenius norms. The CPU tests run machmoe's float64/float32 CPU path; the gpu-marked ones bf16.
"""
import math

import pytest
import torch

import machmoe
from reference import route


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


ALPHA, LIMIT = 1.702, 7.0


def hf_experts(x, tok, exp, scores, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias, alpha=ALPHA,
               limit=LIMIT, cached_h_dtype=None):
    """GptOssExperts.forward, transcribed: per expert, gate_up = x @ gate_up_proj[e] + bias, gate = [..., ::2],
    up = [..., 1::2], clamps, (up + 1) * gate * sigmoid(gate * alpha) @ down_proj[e] + bias, weighted, index_add.

    cached_h_dtype: the values of gate_up rounded to that dtype (gradient passed straight through), as machmoe's
    backward reads the pre-activation H it cached in the data dtype. torch.clamp's gradient is discontinuous at the
    limits, so against the exact gate_up a bf16 H moves some values across a limit and changes their gradient
    (4-6% relative Frobenius on the gradients at a fifth of values clamped); with the rounding emulated, the
    comparison measures the kernels rather than that property of a bf16 cache."""
    out = torch.zeros_like(x)
    for e in range(gate_up_proj.shape[0]):
        m = exp == e
        if not bool(m.any()):
            continue
        t = tok[m]
        gate_up = x[t] @ gate_up_proj[e]
        if gate_up_proj_bias is not None:
            gate_up = gate_up + gate_up_proj_bias[e]
        if cached_h_dtype is not None:
            gate_up = gate_up + (gate_up.to(cached_h_dtype).to(gate_up.dtype) - gate_up).detach()
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        glu = gate * torch.sigmoid(gate * alpha)
        y = ((up + 1) * glu) @ down_proj[e]
        if down_proj_bias is not None:
            y = y + down_proj_bias[e]
        out = out.index_add(0, t, scores[m].unsqueeze(1) * y)
    return out


def hf_moe(x, router_weight, router_bias, experts, top_k, alpha=ALPHA, limit=LIMIT):
    """GptOssTopKRouter (linear with bias, top-k of the logits, softmax over the k) + the experts."""
    logits = x @ router_weight.T
    if router_bias is not None:
        logits = logits + router_bias
    tok, exp, s = route(logits, top_k, "softmax_topk")
    return hf_experts(x, tok, exp, s, *experts, alpha=alpha, limit=limit), logits


def hf_tensors(E=8, d=32, n=16, bias=True, scale=LIMIT, dtype=torch.float64, seed=0):
    """Random tensors of HF gpt-oss's shapes: gate_up_proj (E, d, 2n), its bias (E, 2n), down_proj (E, n, d), its
    bias (E, d), router weight (E, d). Pre-activations ~ N(0, scale^2): about 15% of gate values above the limit and
    30% of up values beyond +-limit at scale = limit."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, std=1.0: (torch.randn(*s, generator=g, dtype=torch.float64) * std).to(dtype)
    gate_up = r(E, d, 2 * n, std=scale / math.sqrt(d + (1 if bias else 0)))
    gate_up_bias = r(E, 2 * n, std=scale / math.sqrt(d + 1)) if bias else None
    down = r(E, n, d, std=1 / math.sqrt(n) / scale)
    down_bias = r(E, d, std=0.5) if bias else None
    router = r(E, d, std=1 / math.sqrt(d))
    return gate_up, gate_up_bias, down, down_bias, router


def clamped_fractions(x, gate_up_proj, gate_up_proj_bias, limit=LIMIT):
    h = torch.einsum("td,edm->etm", x.detach(), gate_up_proj.detach())
    if gate_up_proj_bias is not None:
        h = h + gate_up_proj_bias.detach()[:, None, :]
    return (h[..., ::2] > limit).double().mean().item(), (h[..., 1::2].abs() > limit).double().mean().item()


def hf_grads_of(moe):
    """The module's parameter gradients in HF's layout (the inverse of load_gpt_oss_experts' mapping)."""
    n = moe.intermediate_size
    w1g = moe.w1.grad
    b1g = moe.b1.grad if moe.b1 is not None else None
    if moe.weight_layout == "concatenated":
        w1g = torch.stack([w1g[:, :n], w1g[:, n:]], dim=2).flatten(1, 2)  # rows gate_0, up_0, gate_1, ...
        if b1g is not None:
            b1g = torch.stack([b1g[:, :n], b1g[:, n:]], dim=2).flatten(1, 2)
    return {"gate_up_proj": w1g.transpose(1, 2), "gate_up_proj_bias": b1g, "down_proj": moe.w2.grad.transpose(1, 2),
            "down_proj_bias": moe.b2.grad if moe.b2 is not None else None, "router_weight": moe.router_weight.grad}


@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cache", ["preact", "input_only"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_module_matches_the_hf_transcription_forward_and_gradients(layout, bias, cache, dtype, tol):
    E, d, n, K, T = 8, 32, 16, 4, 64
    tensors = hf_tensors(E, d, n, bias)
    gate_up, gate_up_bias, down, down_bias, router = tensors
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    gate_frac, up_frac = clamped_fractions(x, gate_up, gate_up_bias)
    assert gate_frac > 0.08 and up_frac > 0.2, (gate_frac, up_frac)

    moe = machmoe.MoE(d, n, E, K, activation="gptoss_swiglu", bias=bias, weight_layout=layout,
                      activation_memory=cache, dtype=dtype)
    moe.load_gpt_oss_experts(gate_up, gate_up_bias, down, down_bias, router_weight=router)
    xm = x.to(dtype).requires_grad_()
    res = moe(xm)

    # Reference in float64 on the module's (rounded) values, with autograd.
    ref_params = [t.to(dtype).double().requires_grad_() if t is not None else None for t in tensors]
    xr = x.to(dtype).double().requires_grad_()
    ref_out, ref_logits = hf_moe(xr, ref_params[4], None, ref_params[:4], K)
    assert rel(res.output, ref_out) < tol
    assert rel(res.router_logits, ref_logits) < tol

    go = torch.randn(T, d, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    gl = torch.randn(T, E, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 0.1
    ((res.output.double() * go).sum() + (res.router_logits.double() * gl).sum()).backward()
    ((ref_out * go).sum() + (ref_logits * gl).sum()).backward()
    assert rel(xm.grad, xr.grad) < tol
    got = hf_grads_of(moe)
    names = ["gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias", "router_weight"]
    for name, p in zip(names, ref_params):
        if p is None:
            assert got[name] is None
            continue
        assert rel(got[name], p.grad) < tol, name


def test_alpha_and_limit_reach_the_layer():
    E, d, n, K, T = 4, 16, 8, 2, 32
    alpha, limit = 0.8, 2.5
    tensors = hf_tensors(E, d, n, True, scale=limit)
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(4), dtype=torch.float64, requires_grad=True)
    assert min(clamped_fractions(x, tensors[0], tensors[1], limit)) > 0.08
    out, logits, _ = machmoe.moe(x, tensors[4], tensors[0].transpose(1, 2).contiguous(),
                                 tensors[2].transpose(1, 2).contiguous(), tensors[1], tensors[3], top_k=K,
                                 activation="gptoss_swiglu", swiglu_alpha=alpha, swiglu_limit=limit)
    ref_out, _ = hf_moe(x, tensors[4], None, tensors[:4], K, alpha=alpha, limit=limit)
    assert rel(out, ref_out) < 1e-12
    default_out, _, _ = machmoe.moe(x, tensors[4], tensors[0].transpose(1, 2).contiguous(),
                                    tensors[2].transpose(1, 2).contiguous(), tensors[1], tensors[3], top_k=K,
                                    activation="gptoss_swiglu")
    assert rel(default_out, out) > 1e-2
    # No clamping at all with an infinite limit.
    inf_out, _, _ = machmoe.moe(x, tensors[4], tensors[0].transpose(1, 2).contiguous(),
                                tensors[2].transpose(1, 2).contiguous(), tensors[1], tensors[3], top_k=K,
                                activation="gptoss_swiglu", swiglu_limit=math.inf)
    assert rel(inf_out, hf_moe(x, tensors[4], None, tensors[:4], K, limit=math.inf)[0]) < 1e-12


def test_from_gpt_oss_builds_the_module_and_biased_routers_go_through_moe_from_routing():
    E, d, n, K, T = 8, 32, 16, 4, 48
    gate_up, gate_up_bias, down, down_bias, router = hf_tensors(E, d, n, True)
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    for layout in ("interleaved", "concatenated"):
        moe = machmoe.MoE.from_gpt_oss(gate_up, gate_up_bias, down, down_bias, router, top_k=K, router_bias=None,
                                       weight_layout=layout)
        assert (moe.num_experts, moe.hidden_size, moe.intermediate_size, moe.top_k) == (E, d, n, K)
        assert moe.activation == "gptoss_swiglu" and moe.score == "softmax_topk" and moe.b1 is not None
        assert (moe.swiglu_alpha, moe.swiglu_limit) == (ALPHA, LIMIT)
        assert moe.w1.dtype == torch.float64 and moe.w1.is_contiguous()
        ref, _ = hf_moe(x, router, None, (gate_up, gate_up_bias, down, down_bias), K)
        assert rel(moe(x).output, ref) < 1e-12
    # A zero router bias is accepted (it changes nothing); a real one is refused with the way out.
    machmoe.MoE.from_gpt_oss(gate_up, gate_up_bias, down, down_bias, router, top_k=K, router_bias=torch.zeros(E,
                             dtype=torch.float64))
    router_bias = torch.randn(E, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    with pytest.raises(ValueError, match="router_bias.*moe_from_routing"):
        machmoe.MoE.from_gpt_oss(gate_up, gate_up_bias, down, down_bias, router, top_k=K, router_bias=router_bias)
    # The way out: route outside (HF's router, bias included) and run the experts on machmoe; gradients reach the
    # router's weight and bias through the scores.
    xr = x.clone().requires_grad_()
    rw, rb = router.clone().requires_grad_(), router_bias.clone().requires_grad_()
    logits = xr @ rw.T + rb
    tok, exp, s = route(logits, K, "softmax_topk")
    moe = machmoe.MoE.from_gpt_oss(gate_up, gate_up_bias, down, down_bias, router, top_k=K, router_bias=None)
    out, _ = machmoe.moe_from_routing(xr, moe.w1, moe.w2, tok, exp, s.contiguous(), moe.b1, moe.b2,
                                      max_experts_per_token=K, activation="gptoss_swiglu")
    xh, rwh, rbh = x.clone().requires_grad_(), router.clone().requires_grad_(), router_bias.clone().requires_grad_()
    ref, _ = hf_moe(xh, rwh, rbh, (gate_up, gate_up_bias, down, down_bias), K)
    assert rel(out, ref) < 1e-12
    go = torch.randn(T, d, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    (out * go).sum().backward()
    (ref * go).sum().backward()
    for a, b in ((xr, xh), (rw, rwh), (rb, rbh)):
        assert rel(a.grad, b.grad) < 1e-12


def test_loader_checks_before_writing():
    E, d, n, K = 4, 24, 8, 2  # d != 2n: a transposed gate_up_proj has another shape
    gate_up, gate_up_bias, down, down_bias, router = hf_tensors(E, d, n, True)
    moe = machmoe.MoE(d, n, E, K, activation="gptoss_swiglu", bias=True, dtype=torch.float64)
    before = {k: v.clone() for k, v in moe.state_dict().items()}

    def unchanged():
        return all(torch.equal(before[k], v) for k, v in moe.state_dict().items())

    with pytest.raises(ValueError, match="gate_up_proj.*shape"):
        moe.load_gpt_oss_experts(gate_up.transpose(1, 2), gate_up_bias, down, down_bias)  # (E, 2n, d): not HF's
    with pytest.raises(ValueError, match="down_proj_bias.*shape"):
        moe.load_gpt_oss_experts(gate_up, gate_up_bias, down, down_bias[:, :-1])
    with pytest.raises(ValueError, match="gate_up_proj_bias.*expected a tensor"):
        moe.load_gpt_oss_experts(gate_up, None, down, down_bias)
    with pytest.raises(ValueError, match="router_bias"):
        moe.load_gpt_oss_experts(gate_up, gate_up_bias, down, down_bias, router_weight=router,
                                 router_bias=torch.ones(E, dtype=torch.float64))
    assert unchanged()
    no_bias = machmoe.MoE(d, n, E, K, activation="gptoss_swiglu", dtype=torch.float64)
    with pytest.raises(ValueError, match="bias=True"):
        no_bias.load_gpt_oss_experts(gate_up, gate_up_bias, down, down_bias)
    swiglu = machmoe.MoE(d, n, E, K, activation="swiglu", bias=True, dtype=torch.float64)
    with pytest.raises(ValueError, match="gptoss_swiglu"):
        swiglu.load_gpt_oss_experts(gate_up, gate_up_bias, down, down_bias)
    with pytest.raises(TypeError, match="fixed by gpt-oss"):
        machmoe.MoE.from_gpt_oss(gate_up, gate_up_bias, down, down_bias, router, top_k=K, router_bias=None,
                                 activation="swiglu")


def test_from_gpt_oss_requires_router_bias():
    """gpt-oss's router always has a bias, which machmoe's router cannot take: leaving router_bias out must not
    drop it silently. None said explicitly still means a router without bias."""
    E, d, n, K = 4, 16, 8, 2
    gate_up, gate_up_bias, down, down_bias, router = hf_tensors(E, d, n, True)
    with pytest.raises(TypeError, match="router_bias"):
        machmoe.MoE.from_gpt_oss(gate_up, gate_up_bias, down, down_bias, router, top_k=K)
    moe = machmoe.MoE.from_gpt_oss(gate_up, gate_up_bias, down, down_bias, router, top_k=K, router_bias=None)
    assert torch.equal(moe.router_weight, router)
    with pytest.raises(TypeError, match="machmoe: argument 'router_bias': expected a torch.Tensor or None, got list"):
        machmoe.MoE.from_gpt_oss(gate_up, gate_up_bias, down, down_bias, router, top_k=K, router_bias=[0.0] * E)


@pytest.mark.parametrize("missing", ["router_weight", "gate_up_proj", "down_proj"])
def test_from_gpt_oss_requires_every_weight(missing):
    E, d, n, K = 4, 16, 8, 2
    tensors = dict(zip(["gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias", "router_weight"],
                       hf_tensors(E, d, n, True)))
    tensors[missing] = None  # a None router_weight used to keep the random router
    with pytest.raises(TypeError, match=f"machmoe: argument '{missing}': expected a torch.Tensor, got NoneType"):
        machmoe.MoE.from_gpt_oss(**tensors, top_k=K, router_bias=None)


@pytest.mark.parametrize("missing", ["gate_up_proj", "down_proj"])
def test_load_gpt_oss_experts_requires_the_expert_weights(missing):
    """A None down_proj used to leave w2 random, a None gate_up_proj was reported as missing gate_proj and up_proj
    (arguments this loader does not have); neither writes anything now."""
    E, d, n, K = 4, 24, 8, 2
    gate_up, gate_up_bias, down, down_bias, router = hf_tensors(E, d, n, True)
    moe = machmoe.MoE(d, n, E, K, activation="gptoss_swiglu", bias=True, dtype=torch.float64)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    args = dict(gate_up_proj=gate_up, gate_up_proj_bias=gate_up_bias, down_proj=down, down_proj_bias=down_bias)
    args[missing] = None
    with pytest.raises(TypeError, match=f"machmoe: argument '{missing}': expected a torch.Tensor, got NoneType"):
        moe.load_gpt_oss_experts(**args, router_weight=router)
    assert all(torch.equal(before[k], v) for k, v in moe.state_dict().items())
    # The router is named as this loader's argument, and checked before the experts are written.
    with pytest.raises(ValueError, match="argument 'router_weight': expected shape \\(4, 24\\)"):
        moe.load_gpt_oss_experts(gate_up, gate_up_bias, down, down_bias, router_weight=router[:, :-1])
    assert all(torch.equal(before[k], v) for k, v in moe.state_dict().items())


def test_parameters_are_validated_and_belong_to_gptoss_swiglu():
    x = torch.randn(4, 8, dtype=torch.float64)
    rw, w1, w2 = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, 8, dtype=torch.float64), \
        torch.randn(4, 8, 4, dtype=torch.float64)
    ok = dict(top_k=2, activation="gptoss_swiglu")
    machmoe.moe(x, rw, w1, w2, **ok, swiglu_limit=math.inf)
    for kw, err, match in [(dict(swiglu_limit=0.0), ValueError, "swiglu_limit.*> 0"),
                           (dict(swiglu_limit=-1), ValueError, "swiglu_limit"),
                           (dict(swiglu_limit=math.nan), ValueError, "swiglu_limit"),
                           (dict(swiglu_alpha=math.inf), ValueError, "swiglu_alpha.*finite"),
                           # finite doubles that fp32, which the kernels compute in, cannot hold
                           (dict(swiglu_alpha=1e39), ValueError, "swiglu_alpha.*fp32.*got 1e\\+39"),
                           (dict(swiglu_limit=1e-50), ValueError, "swiglu_limit.*fp32.*got 1e-50"),
                           (dict(swiglu_limit=1e39), ValueError, "swiglu_limit.*fp32.*got 1e\\+39"),
                           (dict(swiglu_alpha=True), TypeError, "swiglu_alpha"),
                           (dict(swiglu_limit="7"), TypeError, "swiglu_limit")]:
        with pytest.raises(err, match=match):
            machmoe.moe(x, rw, w1, w2, **ok, **kw)
        with pytest.raises(err, match=match):
            machmoe.MoE(8, 4, 4, 2, activation="gptoss_swiglu", dtype=torch.float64, **kw)
    # Given with another activation: refused, naming the activation they belong to.
    for kw in (dict(swiglu_limit=7.0), dict(swiglu_alpha=1.702)):
        with pytest.raises(ValueError, match="gptoss_swiglu"):
            machmoe.moe(x, rw, w1, w2, top_k=2, activation="swiglu", **kw)
        with pytest.raises(ValueError, match="gptoss_swiglu"):
            machmoe.MoE(8, 4, 4, 2, activation="swiglu", **kw)
    assert machmoe.MoE(8, 4, 4, 2, activation="swiglu").swiglu_limit is None
    # The operator checks them too (its own callers pass validated floats).
    with pytest.raises(ValueError, match="swiglu_limit"):
        torch.ops.machmoe.layer_forward(x, rw, w1, None, w2, None, None, None, None, 2, 7, 0, 0, 0, 0, 128, 0, 1.702,
                                        -1.0)
    with pytest.raises(ValueError, match="swiglu_alpha.*a float"):
        torch.ops.machmoe.layer_forward(x, rw, w1, None, w2, None, None, None, None, 2, 7, 0, 0, 0, 0, 128, 0, 1e39,
                                        7.0)
    with pytest.raises(ValueError, match="swiglu_limit.*gptoss_swiglu"):
        torch.ops.machmoe.layer_forward(x, rw, w1, None, w2, None, None, None, None, 2, 0, 0, 0, 0, 0, 128, 0, 1.702,
                                        5.0)


# ---- GPU ----------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("layout,bias,cache", [("interleaved", True, "preact"), ("concatenated", True, "input_only"),
                                               ("interleaved", False, "input_only"), ("concatenated", False, "preact")])
def test_bf16_gpu_module_matches_the_hf_transcription(cuda, layout, bias, cache):
    """The Hopper kernels' path (bf16, n and d multiples of 128) against the float64 transcription, with the routing
    pinned to the GPU's logits (bf16 rounding may reorder near-ties)."""
    E, d, n, K, T = 16, 256, 256, 4, 1024
    tensors = hf_tensors(E, d, n, bias, dtype=torch.bfloat16)
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    assert min(clamped_fractions(x.double(), tensors[0].double(),
                                 tensors[1].double() if bias else None)) > 0.08
    moe = machmoe.MoE.from_gpt_oss(*tensors, top_k=K, router_bias=None, weight_layout=layout,
                                   activation_memory=cache, device=cuda) if bias else machmoe.MoE(d, n, E, K, activation="gptoss_swiglu", weight_layout=layout,
                                 activation_memory=cache, device=cuda, dtype=torch.bfloat16).load_gpt_oss_experts(
                                     tensors[0], None, tensors[2], None, router_weight=tensors[4])
    xg = x.to(cuda).requires_grad_()
    res = moe(xg)
    ref_params = [t.double().requires_grad_() if t is not None else None for t in tensors]
    xr = x.double().requires_grad_()
    z = res.router_logits.detach().double().cpu()
    z = z + (xr @ ref_params[4].T - (xr @ ref_params[4].T).detach())  # the GPU's values, the exact gradient
    tok, exp, s = route(z, K, "softmax_topk")
    ref_out = hf_experts(xr, tok, exp, s, *ref_params[:4], cached_h_dtype=torch.bfloat16)
    assert rel(res.output, hf_experts(xr, tok, exp, s, *ref_params[:4]).detach()) < 1e-2  # exact H: forward only
    assert rel(res.output, ref_out) < 1e-2
    go = torch.randn(T, d, dtype=torch.float64)
    (res.output.double() * go.to(cuda)).sum().backward()
    (ref_out * go).sum().backward()
    assert rel(xg.grad, xr.grad) < 1e-2
    got = hf_grads_of(moe)
    for name, p in zip(["gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias", "router_weight"],
                       ref_params):
        if p is not None:
            assert rel(got[name], p.grad) < 1e-2, name
