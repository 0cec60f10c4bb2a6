"""Gradient accumulation into caller buffers on the CPU: machmoe.moe(..., accumulate_grads_into=...) and
MoE(accumulate_into_main_grad=True) (Megatron-style main_grad), with the split backward, torch.compile, zero-token
experts, and the errors for bad buffers."""
import pytest
import torch

import machmoe
from layer_inputs import make, rel

NAMES = ("router_weight", "w1", "w2", "b1", "b2")


def _weights(rw, w1, w2, b1, b2):
    return dict(router_weight=rw, w1=w1, w2=w2, b1=b1, b2=b2)


def _micro_batch(seed, T=20, d=8, E=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, d, generator=g, dtype=torch.float64), torch.randn(T, d, generator=g, dtype=torch.float64)


def _plain_grads(params, x, go, **opts):
    """The weight gradients of <moe(x), go> by an ordinary backward."""
    out, _, _ = machmoe.moe(x, params["router_weight"], params["w1"], params["w2"], params["b1"], params["b2"], **opts)
    grads = torch.autograd.grad((out * go).sum(), [params[n] for n in NAMES])
    return dict(zip(NAMES, grads))


def _accumulate(params, x, go, into, **opts):
    x = x.clone().requires_grad_()
    out, _, _ = machmoe.moe(x, params["router_weight"], params["w1"], params["w2"], params["b1"], params["b2"],
                            accumulate_grads_into=into, **opts)
    (out * go).sum().backward()
    return x.grad


@pytest.mark.parametrize("routing", ["topk", "token_rounding"])
def test_accumulating_twice_equals_the_sum_of_two_backward_passes(routing):
    _, rw, w1, w2, b1, b2 = make(T=20)
    params = _weights(rw, w1, w2, b1, b2)
    opts = dict(top_k=2, routing=routing, tile=8)
    batches = [_micro_batch(1), _micro_batch(2)]
    plain = [_plain_grads(params, x, go, **opts) for x, go in batches]
    g = torch.Generator().manual_seed(3)
    init = {n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in params.items()}
    into = {n: t.clone() for n, t in init.items()}
    dxs = [_accumulate(params, x, go, into, **opts) for x, go in batches]
    for n in NAMES:  # same additions in the same order: bitwise
        assert torch.equal(into[n], init[n] + plain[0][n] + plain[1][n]), n
        assert params[n].grad is None, f"{n}: the gradient went into the buffer, not .grad"
    # The input gradient is returned as usual.
    x0 = batches[0][0].clone().requires_grad_()
    out, _, _ = machmoe.moe(x0, rw, w1, w2, b1, b2, **opts)
    (out * batches[0][1]).sum().backward()
    assert torch.equal(dxs[0], x0.grad)


def test_fp32_buffers_round_once_per_micro_batch():
    """fp64 data into fp32 buffers (the CPU's stand-in for bf16 data with fp32 main grads): each sum is taken in
    fp64 and rounded once; fp32 data into fp32 buffers is within fp32 rounding of the float64 sum."""
    _, rw, w1, w2, b1, b2 = make(T=20)
    params = _weights(rw, w1, w2, b1, b2)
    batches = [_micro_batch(4), _micro_batch(5)]
    plain = [_plain_grads(params, x, go, top_k=2) for x, go in batches]
    g = torch.Generator().manual_seed(6)
    init = {n: torch.randn(p.shape, generator=g, dtype=torch.float32) for n, p in params.items()}
    into = {n: t.clone() for n, t in init.items()}
    for x, go in batches:
        _accumulate(params, x, go, into, top_k=2)
    for n in NAMES:
        expected = ((init[n].double() + plain[0][n]).float().double() + plain[1][n]).float()
        assert torch.equal(into[n], expected), n
    params32 = {n: p.detach().float().requires_grad_() for n, p in params.items()}
    into32 = {n: t.clone() for n, t in init.items()}
    for x, go in batches:
        _accumulate(params32, x.float(), go.float(), into32, top_k=2)
    for n in NAMES:
        assert rel(into32[n].double(), init[n].double() + plain[0][n] + plain[1][n]) < 1e-5, n


def test_caller_routing_and_grouped_experts_accumulate():
    x, _, w1, w2, b1, b2 = make(T=10)
    tok = torch.tensor([0, 0, 1, 3, 3, 4, 6, 7, 7, 9])
    exp = torch.tensor([1, 3, 0, 2, 1, 3, 0, 2, 3, 1])
    sc = torch.rand(10, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    go = torch.randn(10, 8, dtype=torch.float64)
    out, _ = machmoe.moe_from_routing(x, w1, w2, tok, exp, sc, b1, b2, max_experts_per_token=2)
    ref = dict(zip(("w1", "w2", "b1", "b2"), torch.autograd.grad((out * go).sum(), [w1, w2, b1, b2])))
    into = {n: torch.ones_like(t) for n, t in ref.items()}
    out, _ = machmoe.moe_from_routing(x, w1, w2, tok, exp, sc, b1, b2, max_experts_per_token=2,
                                      accumulate_grads_into=into)
    (out * go).sum().backward()
    for n in ref:
        assert torch.equal(into[n], 1 + ref[n]), n
    counts = torch.tensor([3, 0, 4, 2])
    y = machmoe.grouped_experts(x[:9], counts, w1, w2)
    ref_w1 = torch.autograd.grad(y.sum(), [w1])[0]
    into = {"w1": torch.zeros_like(w1)}
    machmoe.grouped_experts(x[:9], counts, w1, w2, accumulate_grads_into=into).sum().backward()
    assert torch.equal(into["w1"], ref_w1)
    assert torch.equal(into["w1"][1], torch.zeros_like(w1[1])), "expert 1 has no rows"


def test_zero_token_experts_and_empty_batches_leave_the_buffer_unchanged():
    _, rw, w1, w2, b1, b2 = make(T=3, E=8)
    x, go = _micro_batch(7, T=3)
    g = torch.Generator().manual_seed(8)
    init = {n: torch.randn(p.shape, generator=g, dtype=torch.float32)
            for n, p in _weights(rw, w1, w2, b1, b2).items()}
    into = {n: t.clone() for n, t in init.items()}
    x_ = x.clone().requires_grad_()
    out, _, counts = machmoe.moe(x_, rw, w1, w2, b1, b2, top_k=1, accumulate_grads_into=into)
    (out * go).sum().backward()
    empty = (counts == 0).nonzero().flatten().tolist()
    assert len(empty) >= 5
    for e in range(8):
        for n in ("w1", "w2", "b1", "b2"):
            assert torch.equal(into[n][e], init[n][e]) == (e in empty), (n, e)
    into = {n: t.clone() for n, t in init.items()}
    none = torch.zeros(0, 8, dtype=torch.float64, requires_grad=True)
    out, _, _ = machmoe.moe(none, rw, w1, w2, b1, b2, top_k=1, accumulate_grads_into=into)
    out.sum().backward()
    for n in init:
        assert torch.equal(into[n], init[n]), n


def _module_pair(**kw):
    torch.manual_seed(11)
    plain = machmoe.MoE(16, 8, 4, 2, dtype=torch.float64, bias=True, **kw)
    acc = machmoe.MoE(16, 8, 4, 2, dtype=torch.float64, bias=True, accumulate_into_main_grad=True, **kw)
    acc.load_state_dict(plain.state_dict())
    return plain, acc


def test_module_accumulates_into_main_grad_created_on_first_use():
    plain, acc = _module_pair()
    xs = [torch.randn(2, 5, 16, dtype=torch.float64) for _ in range(3)]
    for x in xs:
        plain(x).output.square().sum().backward()
    # 1F1B-like order: both forwards first, then the backwards (a buffer changes between a forward and its backward).
    outs = [acc(x).output for x in xs[:2]]
    for o in outs:
        o.square().sum().backward()
    acc(xs[2]).output.square().sum().backward()
    for name, p in acc.named_parameters():
        assert p.grad is None, name
        assert p.main_grad.dtype == torch.float32 and p.main_grad.shape == p.shape, name
        assert rel(p.main_grad.double(), dict(plain.named_parameters())[name].grad) < 1e-6, name
    # main_grads() returns the same buffers; a caller's own buffer (bf16 of fp64 params is refused, the params'
    # dtype is accepted) is used as it is.
    assert all(b is getattr(acc, n).main_grad for n, b in acc.main_grads().items())
    acc.w1.main_grad = torch.zeros_like(acc.w1)
    acc(xs[0]).output.square().sum().backward()
    assert acc.w1.main_grad.dtype == torch.float64 and acc.w1.main_grad.abs().sum() > 0
    acc.w2.main_grad = torch.zeros(acc.w2.shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"'w2.main_grad'.*torch.float64 \(the dtype of w2\) or torch.float32"):
        acc(xs[0])


def test_autograd_grad_gives_the_input_gradient_and_none_for_accumulated_parameters():
    # As the docstring says: the parameters' gradients go into main_grad, so torch.autograd.grad has nothing to
    # return for them (unused without allow_unused=True, None with it); the input's gradient is the plain one's.
    plain, acc = _module_pair()
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    gx_plain, gw1_plain = torch.autograd.grad(plain(x).output.square().sum(), [x, plain.w1])
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(acc(x).output.square().sum(), [x, acc.w1])
    # autograd raises that after its backward ran: main_grad holds one gradient already.
    assert rel(acc.w1.main_grad.double(), gw1_plain) < 1e-6
    acc.w1.main_grad.zero_()
    gx, gw1 = torch.autograd.grad(acc(x).output.square().sum(), [x, acc.w1], allow_unused=True)
    assert gw1 is None and acc.w1.grad is None
    assert rel(gx, gx_plain) < 1e-12
    assert rel(acc.w1.main_grad.double(), gw1_plain) < 1e-6


def test_module_main_grad_dtype_option_and_frozen_parameters():
    _, acc = _module_pair(main_grad_dtype=torch.float64)
    acc.router_weight.requires_grad_(False)
    acc(torch.randn(7, 16, dtype=torch.float64)).output.sum().backward()
    assert not hasattr(acc.router_weight, "main_grad"), "frozen: no buffer, no gradient"
    assert acc.w1.main_grad.dtype == torch.float64
    with pytest.raises(TypeError, match="'accumulate_into_main_grad'"):
        machmoe.MoE(16, 8, 4, 2, accumulate_into_main_grad="yes")
    with pytest.raises(TypeError, match="'main_grad_dtype'"):
        machmoe.MoE(16, 8, 4, 2, main_grad_dtype=torch.int32)
    # A floating dtype that is neither fp32 nor the parameters' is refused at the first forward, and with fp32
    # parameters the message names one dtype, not fp32 twice.
    fp16_grads = machmoe.MoE(16, 8, 4, 2, accumulate_into_main_grad=True, main_grad_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"'router_weight.main_grad': expected dtype torch.float32, got torch.float16"):
        fp16_grads(torch.randn(7, 16))


def test_module_creates_no_main_grad_without_gradients_nor_one_of_a_refused_dtype():
    """An evaluation under no_grad or inference_mode creates no main_grad, and the training step after it accumulates
    as usual into buffers that are ordinary tensors (main_grads() inside inference_mode makes ordinary ones too). A
    main_grad_dtype that is refused attaches nothing, so that setting it right afterwards is enough."""
    plain, acc = _module_pair()
    x = torch.randn(9, 16, dtype=torch.float64)
    with torch.inference_mode():
        acc(x)
    with torch.no_grad():
        acc(x)
    assert not any(hasattr(p, "main_grad") for p in acc.parameters())
    acc(x).output.square().sum().backward()
    plain(x).output.square().sum().backward()
    ref = dict(plain.named_parameters())
    for name, p in acc.named_parameters():
        assert not p.main_grad.is_inference() and rel(p.main_grad.double(), ref[name].grad) < 1e-6, name
    _, fresh = _module_pair()
    with torch.inference_mode():
        made = fresh.main_grads()
    assert len(made) == 5 and not any(b.is_inference() for b in made.values())
    fp16_grads = machmoe.MoE(16, 8, 4, 2, accumulate_into_main_grad=True, main_grad_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"'router_weight.main_grad': expected dtype torch.float32, got torch.float16 "
                                         r"\(main_grad_dtype; no buffer was created\)"):
        fp16_grads(torch.randn(7, 16))
    assert not any(hasattr(p, "main_grad") for p in fp16_grads.parameters())
    fp16_grads.main_grad_dtype = torch.float32
    fp16_grads(torch.randn(7, 16)).output.sum().backward()
    assert all(p.main_grad.dtype == torch.float32 and p.main_grad.abs().sum() > 0 for p in fp16_grads.parameters())


def test_module_with_defer_weight_grads():
    plain, acc = _module_pair()
    x = torch.randn(20, 16, dtype=torch.float64)
    plain(x).output.square().sum().backward()
    acc.main_grads()
    with machmoe.defer_weight_grads() as deferred:
        acc(x).output.square().sum().backward()
    ref = dict(plain.named_parameters())
    assert torch.equal(acc.router_weight.main_grad, ref["router_weight"].grad.float()), "the router's share: now"
    assert acc.w1.main_grad.abs().sum() == 0 and len(deferred) == 1, "the experts' share: queued"
    deferred.run()
    for name, p in acc.named_parameters():
        assert p.grad is None, name
        assert rel(p.main_grad.double(), ref[name].grad) < 1e-6, name


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_module_accumulates_like_eager(backend):
    torch._dynamo.reset()
    eager_m, compiled_m = _module_pair()
    eager_m.accumulate_into_main_grad = True
    eager_m.main_grads(), compiled_m.main_grads()  # created before tracing
    step = lambda m, inp: m(inp).output.square().sum()
    compiled = torch.compile(lambda inp: step(compiled_m, inp), fullgraph=True, backend=backend)
    for seed in range(2):
        x = torch.randn(3, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        step(eager_m, x).backward()
        compiled(x).backward()
    for name, p in compiled_m.named_parameters():
        assert p.grad is None, name
        assert rel(p.main_grad, dict(eager_m.named_parameters())[name].main_grad) < 1e-6, name


def test_bad_buffers_raise_clear_errors():
    x, rw, w1, w2, b1, b2 = make(T=6)
    good = {"w1": torch.zeros_like(w1).detach()}
    machmoe.moe(x, rw, w1, w2, b1, b2, top_k=2, accumulate_grads_into=good)
    cases = [
        ({"w1": torch.zeros(w1.shape, dtype=torch.float16)},
         r"'accumulate_grads_into\['w1'\]'.*dtype torch.float64 \(the dtype of w1\) or torch.float32, got "
         r"torch.float16"),
        ({"w2": torch.zeros(4, 4, 8, dtype=torch.float64)},
         r"'accumulate_grads_into\['w2'\]'.*shape \(4, 8, 4\) \(the shape of w2\), got shape \(4, 4, 8\)"),
        ({"w3": torch.zeros(1)}, r"'accumulate_grads_into'.*keys among \['router_weight', 'w1', 'b1', 'w2', "
                                 r"'b2'\].*got 'w3'"),
        ({"b1": torch.zeros(b1.shape, dtype=torch.float64).t().contiguous().t()}, "contiguous"),
        ({"w1": torch.zeros(w1.shape, dtype=torch.float64, requires_grad=True)}, "does not require grad"),
        ({"w1": torch.zeros(w1.shape, dtype=torch.float64, device="meta")}, "a tensor on cpu"),
    ]
    for into, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            machmoe.moe(x, rw, w1, w2, b1, b2, top_k=2, accumulate_grads_into=into)
    with pytest.raises(TypeError, match="'accumulate_grads_into'.*dict"):
        machmoe.moe(x, rw, w1, w2, top_k=2, accumulate_grads_into=[torch.zeros_like(w1)])
    with pytest.raises(TypeError, match=r"'accumulate_grads_into\['w1'\]'.*torch.Tensor"):
        machmoe.moe(x, rw, w1, w2, top_k=2, accumulate_grads_into={"w1": 0.0})
    with pytest.raises(ValueError, match=r"keys among \['w1', 'w2'\].*'router_weight'"):
        machmoe.moe_from_routing(x, w1, w2, torch.tensor([0]), torch.tensor([1]), torch.ones(1, dtype=torch.float64),
                                 max_experts_per_token=2, accumulate_grads_into={"router_weight": torch.zeros_like(rw)})


def test_operator_checks_its_buffers():
    """The operators check the buffers too (callers of torch.ops.machmoe directly), then the library."""
    x, rw, w1, w2, _, _ = [t.detach() if t is not None else None for t in make(T=6, bias=False)]
    opts = (2, 0, 0, 0, 0, 0, 128, 0)
    _, _, _, saved = torch.ops.machmoe.layer_forward(x, rw, w1, None, w2, None, None, None, None, *opts)
    go = torch.randn_like(x)
    args = (go, None, x, rw, w1, None, w2, None, None, None, None, saved, *opts)
    with pytest.raises(ValueError, match=r"layer_backward: argument 'into_w1': expected shape \(4, 8, 8\)"):
        torch.ops.machmoe.layer_backward(*args, into_w1=torch.zeros(4, 8, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"argument 'into_w2': expected dtype Double \(the dtype of x\) or Float"):
        torch.ops.machmoe.layer_backward(*args, into_w2=torch.zeros(w2.shape, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"argument 'into_b1': expected None \(the layer has no b1\)"):
        torch.ops.machmoe.layer_backward(*args, into_b1=torch.zeros(4, 8, dtype=torch.float64))
    into = torch.zeros_like(w1)
    res = torch.ops.machmoe.layer_backward(*args, into_w1=into)
    assert res[2].numel() == 0 and into.abs().sum() > 0
    assert res[3].numel() == 0 and res[4].shape == w2.shape, "the other gradients are returned (from zero)"
    plain = torch.ops.machmoe.layer_backward(*args)
    assert torch.equal(into, plain[2]) and torch.equal(res[4], plain[4]) and torch.equal(res[1], plain[1])
    # consume_saved lets the GPU backward write into `saved`; the CPU reference only reads it, and outside a
    # backward (no autograd graph task) the operator never consumes: same results, the buffer unchanged.
    before = saved.clone()
    consumed = torch.ops.machmoe.layer_backward(*args, consume_saved=True)
    assert all(torch.equal(a, b) for a, b in zip(consumed, plain)) and torch.equal(saved, before)
