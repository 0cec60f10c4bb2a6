"""machmoe's PyTorch operators on the CPU (float64 reference path) against a pure-PyTorch reference."""
import itertools

import pytest
import torch

import machmoe
from layer_inputs import make, rel
from reference import GLU, experts, reference_moe

ACTIVATIONS = ["swiglu", "geglu", "reglu", "relu_squared", "relu", "gelu", "silu"]


CASES = [
    (act, layout, bias, score, routing, rounding, cache)
    for act in ACTIVATIONS
    for layout in (["interleaved", "concatenated"] if act in GLU else ["interleaved"])
    for bias in (False, True)
    for score in ("softmax_topk", "topk_softmax", "topk_softmax_renorm")
    for routing, rounding in (("topk", "nearest"), ("token_rounding", "nearest"), ("token_rounding", "up"),
                              ("token_rounding", "down"))
    for cache in ("preact", "input_only")
]


@pytest.mark.parametrize("act,layout,bias,score,routing,rounding,cache", CASES)
def test_layer_matches_reference(act, layout, bias, score, routing, rounding, cache):
    T = 20 if routing == "token_rounding" else 12
    x, rw, w1, w2, b1, b2 = make(T=T, activation=act, bias=bias, seed=hash((act, bias)) % 1000)
    opts = dict(top_k=2, activation=act, score=score, routing=routing, rounding=rounding, tile=8, weight_layout=layout)
    out, logits, counts = machmoe.moe(x, rw, w1, w2, b1, b2, activation_memory=cache, **opts)
    ref_out, ref_logits, ref_counts = reference_moe(x, rw, w1, w2, b1, b2, **opts)
    assert rel(out, ref_out) < 1e-12
    assert rel(logits, ref_logits) < 1e-12
    assert torch.equal(counts.long(), ref_counts)
    go = torch.randn_like(out)
    gl = torch.randn_like(logits)
    params = [p for p in (x, rw, w1, w2, b1, b2) if p is not None]
    grads = torch.autograd.grad((out * go).sum() + (logits * gl).sum(), params)
    ref_grads = torch.autograd.grad((ref_out * go).sum() + (ref_logits * gl).sum(), params)
    for name, a, b in zip(["x", "router_weight", "w1", "w2", "b1", "b2"], grads, ref_grads):
        assert rel(a, b) < 1e-10, name


@pytest.mark.parametrize("act", ["swiglu", "relu"])
def test_caller_routing_matches_reference_including_score_gradient(act):
    x, _, w1, w2, b1, b2 = make(T=10, activation=act)
    tok = torch.tensor([0, 0, 1, 3, 3, 4, 6, 7, 7, 9])
    exp = torch.tensor([1, 3, 0, 2, 1, 3, 0, 2, 3, 1])
    scores = torch.rand(10, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    out, counts = machmoe.moe_from_routing(x, w1, w2, tok, exp, scores, b1, b2, max_experts_per_token=2,
                                            activation=act)
    ref = experts(x, tok, exp, scores, w1, w2, b1, b2, act, "interleaved")
    assert rel(out, ref) < 1e-12
    assert counts.tolist() == torch.bincount(exp, minlength=4).tolist()
    go = torch.randn_like(out)
    params = [x, w1, w2, b1, b2, scores]
    g = torch.autograd.grad((out * go).sum(), params)
    r = torch.autograd.grad((ref * go).sum(), params)
    for a, b in zip(g, r):
        assert rel(a, b) < 1e-10


def test_gradcheck_float64():
    x, rw, w1, w2, b1, b2 = make(T=6, d=5, n=3, E=3)
    f = lambda *a: machmoe.moe(*a, top_k=2, score="topk_softmax")[0]
    assert torch.autograd.gradcheck(f, (x, rw, w1, w2, b1, b2), eps=1e-6, atol=1e-7)
    tok, exp = torch.tensor([0, 0, 2, 3, 5]), torch.tensor([1, 2, 0, 2, 1])
    sc = torch.rand(5, dtype=torch.float64).requires_grad_()
    g = lambda x_, s_: machmoe.moe_from_routing(x_, w1, w2, tok, exp, s_, max_experts_per_token=2)[0]
    assert torch.autograd.gradcheck(g, (x, sc), eps=1e-6, atol=1e-7)


def test_both_layouts_bitwise_identical():
    x, rw, w1, w2, b1, b2 = make(activation="geglu")
    n = w2.shape[2]
    w1c = torch.cat([w1[:, 0::2], w1[:, 1::2]], 1).detach().requires_grad_()
    b1c = torch.cat([b1[:, 0::2], b1[:, 1::2]], 1).detach().requires_grad_()
    oi = machmoe.moe(x, rw, w1, w2, b1, b2, top_k=2, activation="geglu")[0]
    oc = machmoe.moe(x, rw, w1c, w2, b1c, b2, top_k=2, activation="geglu", weight_layout="concatenated")[0]
    assert torch.equal(oi, oc)
    go = torch.randn_like(oi)
    gi = torch.autograd.grad((oi * go).sum(), [x, w1])
    gc = torch.autograd.grad((oc * go).sum(), [x, w1c])
    assert torch.equal(gi[0], gc[0])
    assert torch.equal(torch.cat([gi[1][:, 0::2], gi[1][:, 1::2]], 1), gc[1])
    assert n == 4


def test_two_runs_bitwise_identical():
    x, rw, w1, w2, b1, b2 = make()
    a = machmoe.moe(x, rw, w1, w2, b1, b2, top_k=2, routing="token_rounding", tile=8)
    b = machmoe.moe(x, rw, w1, w2, b1, b2, top_k=2, routing="token_rounding", tile=8)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_same_results(backend):
    torch._dynamo.reset()
    m = machmoe.MoE(16, 8, 4, 2, dtype=torch.float64, bias=True, aux_loss_coef=0.01)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)

    def step(inp):
        o = m(inp)
        return o.output, o.aux_loss

    eager = step(x)
    compiled = torch.compile(step, fullgraph=True, backend=backend)(x)
    assert rel(compiled[0], eager[0]) < 1e-12 and rel(compiled[1], eager[1]) < 1e-12
    g_e = torch.autograd.grad(eager[0].sum() + eager[1], [x, m.w1])
    g_c = torch.autograd.grad(compiled[0].sum() + compiled[1], [x, m.w1])
    assert all(rel(a, b) < 1e-12 for a, b in zip(g_c, g_e))


def test_grouped_experts_on_pre_dispatched_rows():
    x, _, w1, w2, b1, b2 = make(T=9)
    counts = torch.tensor([3, 0, 4, 2])
    y = machmoe.grouped_experts(x, counts, w1, w2, b1, b2)
    exp = torch.repeat_interleave(torch.arange(4), counts)
    ref = experts(x, torch.arange(9), exp, torch.ones(9, dtype=torch.float64), w1, w2, b1, b2, "swiglu", "interleaved")
    assert rel(y, ref) < 1e-12
    g = torch.autograd.grad(y.sum(), [x, w1])
    r = torch.autograd.grad(ref.sum(), [x, w1])
    assert all(rel(a, b) < 1e-10 for a, b in zip(g, r))


@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
def test_module_loads_hf_experts(layout):
    d, n, E = 16, 8, 4
    m = machmoe.MoE(d, n, E, 2, dtype=torch.float64, weight_layout=layout)
    gate = [torch.randn(n, d, dtype=torch.float64) for _ in range(E)]
    up = [torch.randn(n, d, dtype=torch.float64) for _ in range(E)]
    down = [torch.randn(d, n, dtype=torch.float64) for _ in range(E)]
    router = torch.randn(E, d, dtype=torch.float64)
    m.load_hf_experts(gate, up, down, router=router)
    x = torch.randn(7, d, dtype=torch.float64)
    out = m(x).output
    # HF-style experts: down(silu(gate x) * up x), top-2 softmax over the selected logits.
    logits = x @ router.T
    top = torch.topk(logits, 2).indices
    w = torch.softmax(logits.gather(1, top), -1)
    ref = torch.zeros_like(x)
    for t in range(7):
        for k in range(2):
            e = int(top[t, k])
            ref[t] += w[t, k] * (down[e] @ (torch.nn.functional.silu(gate[e] @ x[t]) * (up[e] @ x[t])))
    assert rel(out, ref) < 1e-12
    fused = torch.cat([torch.stack(gate), torch.stack(up)], 1)
    m2 = machmoe.MoE(d, n, E, 2, dtype=torch.float64, weight_layout=layout).load_hf_experts(
        gate_up_proj=fused, down_proj=down, router=router)
    assert torch.equal(m2(x).output, out)


def test_module_returns_device_counts_and_losses():
    m = machmoe.MoE(16, 8, 4, 2, dtype=torch.float64, aux_loss_coef=0.5, z_loss_coef=0.25)
    o = m(torch.randn(2, 3, 16, dtype=torch.float64))
    assert o.output.shape == (2, 3, 16) and o.router_logits.shape == (6, 4)
    assert o.expert_counts.dtype == torch.int32 and int(o.expert_counts.sum()) == 12
    assert o.aux_loss is not None and o.z_loss is not None


# ---- errors --------------------------------------------------------------------------------------------------------

def test_clear_errors():
    x, rw, w1, w2, b1, b2 = make(d=10)  # d != 2n, so a transposed w1 has the wrong shape
    with pytest.raises(ValueError, match="'w1'.*dtype torch.float32 \\(the dtype of x\\)"):
        machmoe.moe(x.float(), rw, w1, w2, top_k=2)
    with pytest.raises(ValueError, match="'x'.*bfloat16|'x'.*one of"):
        machmoe.moe(x.bfloat16(), rw.bfloat16(), w1.bfloat16(), w2.bfloat16(), top_k=2)
    with pytest.raises(ValueError, match="'w1'.*shape"):
        machmoe.moe(x, rw, w1.transpose(1, 2).contiguous(), w2, top_k=2)
    with pytest.raises(ValueError, match="'w2'.*contiguous"):
        machmoe.moe(x, rw, w1, w2.transpose(1, 2).contiguous().transpose(1, 2), top_k=2)
    with pytest.raises(ValueError, match="'top_k'.*\\[1, 4\\]"):
        machmoe.moe(x, rw, w1, w2, top_k=5)
    with pytest.raises(ValueError, match="'activation'"):
        machmoe.moe(x, rw, w1, w2, top_k=2, activation="swish")
    with pytest.raises(ValueError, match="'router_weight'.*device"):
        machmoe.moe(x, rw.to("meta"), w1, w2, top_k=2)
    with pytest.raises(ValueError, match="'tile'"):
        machmoe.moe(x, rw, w1, w2, top_k=2, routing="token_rounding", tile=12)
    with pytest.raises(ValueError, match="'weight_layout'"):
        machmoe.moe(x, rw, w1[:, :4].contiguous(), w2, top_k=2, activation="relu", weight_layout="concatenated")
    tok, exp, sc = torch.tensor([0, 1, 1]), torch.tensor([0, 1, 9]), torch.ones(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="routing.expert_index\\[2\\].*\\[0, 4\\), got 9"):
        machmoe.moe_from_routing(x, w1, w2, tok, exp, sc, max_experts_per_token=2)
    with pytest.raises(ValueError, match="token_index.*ascending"):
        machmoe.moe_from_routing(x, w1, w2, torch.tensor([1, 0, 2]), torch.tensor([0, 1, 2]), sc,
                                  max_experts_per_token=2)
    with pytest.raises(ValueError, match="'scores'"):
        machmoe.moe_from_routing(x, w1, w2, tok, torch.tensor([0, 1, 2]), sc.float(), max_experts_per_token=2)
    with pytest.raises(ValueError, match="'top_k'"):
        machmoe.MoE(16, 8, 4, 5)
    with pytest.raises(ValueError, match="'x'.*\\(..., 16\\)"):
        machmoe.MoE(16, 8, 4, 2, dtype=torch.float64)(torch.randn(3, 15, dtype=torch.float64))


@pytest.mark.parametrize("routing", ["topk", "token_rounding"])
def test_split_backward_defers_weight_grads_and_matches(routing):
    torch.manual_seed(3)
    m = machmoe.MoE(16, 8, 4, 2, dtype=torch.float64, bias=True, routing=routing, tile=8)
    x = torch.randn(20, 16, dtype=torch.float64, requires_grad=True)
    m(x).output.square().sum().backward()
    full = {name: p.grad.clone() for name, p in m.named_parameters()}
    full_x = x.grad.clone()
    m.zero_grad(set_to_none=True)
    x.grad = None
    with machmoe.defer_weight_grads() as deferred:
        m(x).output.square().sum().backward()
    assert torch.equal(x.grad, full_x) and torch.equal(m.router_weight.grad, full["router_weight"])
    assert m.w1.grad is None and m.w2.grad is None and len(deferred) == 1
    deferred.run()
    for name, p in m.named_parameters():
        assert torch.equal(p.grad, full[name]), name


def test_module_reprs_show_their_sizes_and_every_option_that_is_not_the_default():
    from machmoe import parallel
    assert repr(machmoe.MoE(16, 8, 4, 2, dtype=torch.float64)) == \
        "MoE(hidden_size=16, intermediate_size=8, num_experts=4, top_k=2, activation='swiglu', bias=False)"
    m = machmoe.MoE(16, 8, 4, 2, activation="gptoss_swiglu", bias=True, score="topk_softmax",
                    routing="token_rounding", rounding="up", tile=64, weight_layout="concatenated",
                    activation_memory="input_only", aux_loss_coef=0.01, z_loss_coef=0.001,
                    accumulate_into_main_grad=True, main_grad_dtype=torch.float64, swiglu_limit=5.0)
    assert repr(m) == (  # (swiglu_alpha is gpt-oss's default, 1.702: not shown)
        "MoE(hidden_size=16, intermediate_size=8, num_experts=4, top_k=2, activation='gptoss_swiglu', bias=True, "
        "score='topk_softmax', routing='token_rounding', rounding='up', tile=64, aux_loss_coef=0.01, "
        "z_loss_coef=0.001, weight_layout='concatenated', activation_memory='input_only', swiglu_limit=5.0, "
        "accumulate_into_main_grad=True, main_grad_dtype=torch.float64)")
    m.aux_loss_coef = 0.0  # the repr reads the module as it is now
    assert "aux_loss_coef" not in repr(m)
    assert repr(parallel.GroupedExperts(16, 8, 4, "relu", weight_layout="interleaved")) == \
        "GroupedExperts(hidden_size=16, intermediate_size=8, num_experts=4, activation='relu', bias=False)"
    g = parallel.GroupedExperts(16, 8, 4, "gptoss_swiglu", swiglu_alpha=1.5)
    del g.grad_divide_factor  # as in a module pickled before the attribute existed
    assert repr(g) == ("GroupedExperts(hidden_size=16, intermediate_size=8, num_experts=4, activation='gptoss_swiglu', "
                       "bias=False, swiglu_alpha=1.5)")
    assert repr(parallel.TorchTitanGroupedExperts(16, 8, 4)) == \
        "TorchTitanGroupedExperts(dim=16, hidden_dim=8, num_experts=4)"
