"""Empty work is normal work: no tokens ((0, d), (B, 0, d)), no routed pairs and no grouped rows give empty or zero
outputs, zero parameter gradients and finite (zero) aux losses, on the CPU and (marked gpu) on the GPU. Also the
small-batch token-rounding warning and device-side index checking (docs/ARCHITECTURE.md, "Index checking")."""
import math
import warnings

import pytest
import torch

import machmoe
import machmoe.functional as mf

ROUTINGS = [("topk", "nearest"), ("token_rounding", "nearest"), ("token_rounding", "up"), ("token_rounding", "down")]


def params(m):
    return dict(m.named_parameters())


def assert_zero_grads(named, where=""):
    for name, p in named.items():
        assert p.grad is not None, f"{where} {name}: no gradient"
        assert p.grad.shape == p.shape
        assert torch.count_nonzero(p.grad) == 0, f"{where} {name}: gradient not zero"


def weights(E=4, d=8, n=4, activation="swiglu", bias=True, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * n if activation in ("swiglu", "geglu", "reglu") else n
    t = lambda *s, std=1.0: (torch.randn(*s, generator=g, dtype=torch.float64) * std).to(device, dtype)
    out = [t(E, d, std=1 / math.sqrt(d)), t(E, rows, d, std=1 / math.sqrt(d)), t(E, d, n, std=1 / math.sqrt(n)),
           t(E, rows, std=0.5) if bias else None, t(E, d, std=0.5) if bias else None]
    return [v.requires_grad_() if v is not None else None for v in out]


# ---- CPU ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(0, 16), (3, 0, 16), (0, 5, 16)])
@pytest.mark.parametrize("routing,rounding", ROUTINGS)
@pytest.mark.parametrize("cache", ["preact", "input_only"])
def test_module_with_no_tokens(shape, routing, rounding, cache):
    m = machmoe.MoE(16, 8, 4, 2, bias=True, routing=routing, rounding=rounding, tile=8, activation_memory=cache,
                    aux_loss_coef=0.01, z_loss_coef=0.001, dtype=torch.float64)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    o = m(x)
    assert o.output.shape == shape and o.router_logits.shape == (0, 4)
    assert o.expert_counts.tolist() == [0, 0, 0, 0]
    assert torch.isfinite(o.aux_loss) and o.aux_loss.item() == 0.0
    assert torch.isfinite(o.z_loss) and o.z_loss.item() == 0.0
    (o.output.sum() + o.aux_loss + o.z_loss).backward()
    assert x.grad is not None and x.grad.shape == shape
    assert_zero_grads(params(m), f"{shape} {routing}/{rounding}")


@pytest.mark.parametrize("split", [False, True])
def test_module_with_no_tokens_split_backward(split):
    m = machmoe.MoE(16, 8, 4, 2, bias=True, dtype=torch.float64)
    x = torch.randn(0, 16, dtype=torch.float64, requires_grad=True)
    if split:
        with machmoe.defer_weight_grads() as deferred:
            m(x).output.sum().backward()
        assert m.w1.grad is None and len(deferred) == 1
        deferred.run()
    else:
        m(x).output.sum().backward()
    assert_zero_grads(params(m))


@pytest.mark.parametrize("routing,rounding", ROUTINGS)
def test_functional_moe_with_no_tokens(routing, rounding):
    rw, w1, w2, b1, b2 = weights()
    x = torch.randn(0, 8, dtype=torch.float64, requires_grad=True)
    out, logits, counts = machmoe.moe(x, rw, w1, w2, b1, b2, top_k=2, routing=routing, rounding=rounding, tile=8)
    assert out.shape == (0, 8) and logits.shape == (0, 4) and counts.dtype == torch.int32
    assert counts.tolist() == [0, 0, 0, 0]
    grads = torch.autograd.grad(out.sum() + logits.sum(), [x, rw, w1, w2, b1, b2])
    assert grads[0].shape == (0, 8)
    for g in grads[1:]:
        assert torch.count_nonzero(g) == 0


def test_moe_from_routing_with_no_pairs():
    _, w1, w2, b1, b2 = weights()
    for T in (0, 5):
        x = torch.randn(T, 8, dtype=torch.float64, requires_grad=True)
        tok, exp = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32)
        scores = torch.zeros(0, dtype=torch.float64, requires_grad=True)
        out, counts = machmoe.moe_from_routing(x, w1, w2, tok, exp, scores, b1, b2, max_experts_per_token=2)
        # No pair: the experts (and their biases) contribute nothing, so every token's output is zero.
        assert out.shape == (T, 8) and torch.count_nonzero(out) == 0
        assert counts.tolist() == [0, 0, 0, 0]
        go = torch.randn(T, 8, dtype=torch.float64)
        gx, gw1, gw2, gb1, gb2, gs = torch.autograd.grad((out * go).sum(), [x, w1, w2, b1, b2, scores])
        assert gx.shape == (T, 8) and torch.count_nonzero(gx) == 0
        assert gs.shape == (0,)
        for g in (gw1, gw2, gb1, gb2):
            assert torch.count_nonzero(g) == 0


def test_grouped_experts_with_no_rows():
    _, w1, w2, b1, b2 = weights()
    x = torch.randn(0, 8, dtype=torch.float64, requires_grad=True)
    y = machmoe.grouped_experts(x, torch.zeros(4, dtype=torch.int32), w1, w2, b1, b2)
    assert y.shape == (0, 8)
    for g in torch.autograd.grad(y.sum(), [w1, w2, b1, b2]):
        assert torch.count_nonzero(g) == 0


def test_grouped_experts_rejects_bad_counts_on_cpu():
    _, w1, w2, _, _ = weights()
    x = torch.randn(6, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"'expert_counts'.*non-negative counts, got expert_counts\[1\] = -1"):
        machmoe.grouped_experts(x, torch.tensor([4, -1, 2, 1]), w1, w2)
    with pytest.raises(ValueError, match=r"'expert_counts'.*summing to 6 .*got a sum of 5"):
        machmoe.grouped_experts(x, torch.tensor([4, 0, 1, 0]), w1, w2)
    with pytest.raises(ValueError, match=r"'expert_counts'.*summing to 6 .*got a sum of 14"):
        machmoe.grouped_experts(x, torch.tensor([4, 0, 1, 9]), w1, w2)
    with pytest.raises(ValueError, match=r"'expert_counts'.*int32 or int64"):
        machmoe.grouped_experts(x, torch.tensor([4.0, 0, 1, 1]), w1, w2)


def test_grouped_experts_compiles_fullgraph():
    _, w1, w2, b1, b2 = weights()
    x = torch.randn(9, 8, dtype=torch.float64)
    counts = torch.tensor([3, 0, 4, 2], dtype=torch.int32)
    f = lambda inp, c: machmoe.grouped_experts(inp, c, w1, w2, b1, b2)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, counts), f(x, counts))


def test_losses_with_no_tokens_are_zero_with_zero_gradient():
    z = torch.zeros(0, 4, dtype=torch.float64, requires_grad=True)
    counts = torch.zeros(4, dtype=torch.int32)
    aux = machmoe.load_balancing_loss(z, counts)
    zl = machmoe.router_z_loss(z)
    assert aux.item() == 0.0 and zl.item() == 0.0
    (gz,) = torch.autograd.grad(aux + zl, [z])
    assert gz.shape == (0, 4)
    zb = torch.zeros(0, 4, dtype=torch.bfloat16)
    assert machmoe.load_balancing_loss(zb, counts).dtype == torch.float32  # the usual loss precision
    assert machmoe.router_z_loss(zb).dtype == torch.float32


def test_token_rounding_on_a_batch_smaller_than_a_tile_warns_once():
    rw, w1, w2, _, _ = weights()
    x = torch.randn(16, 8, dtype=torch.float64)
    opts = dict(top_k=2, routing="token_rounding", tile=128)
    mf._warned_small_batch_rounding = False
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        # No warning where no expert can round to zero for lack of tokens: 'up', T >= tile, T = 0.
        machmoe.moe(x, rw, w1, w2, rounding="up", **opts)
        machmoe.moe(torch.randn(128, 8, dtype=torch.float64), rw, w1, w2, rounding="down", **opts)
        machmoe.moe(torch.randn(0, 8, dtype=torch.float64), rw, w1, w2, rounding="down", **opts)
        assert not [w for w in seen if "token rounding" in str(w.message)]
        out, _, counts = machmoe.moe(x, rw, w1, w2, rounding="down", **opts)
        machmoe.moe(x, rw, w1, w2, rounding="nearest", **opts)
    said = [w for w in seen if "token rounding" in str(w.message)]
    assert len(said) == 1, "said once per process"
    assert issubclass(said[0].category, RuntimeWarning)
    assert "tile=128" in str(said[0].message) and "16 tokens" in str(said[0].message)
    assert torch.count_nonzero(out) == 0 and counts.sum().item() == 0  # what the warning says
    # It points at the caller's line (here, this file), not into machmoe or torch.nn.
    assert said[0].filename == __file__, said[0].filename
    mf._warned_small_batch_rounding = False
    with pytest.warns(RuntimeWarning, match="fewer than one tile") as through_module:
        machmoe.MoE(8, 4, 4, 2, routing="token_rounding", rounding="nearest", tile=64,
                    dtype=torch.float64)(torch.randn(2, 3, 8, dtype=torch.float64))
    assert through_module[0].filename == __file__, through_module[0].filename


def test_small_batch_rounding_compiles_fullgraph_without_the_warning():
    m = machmoe.MoE(16, 8, 4, 2, routing="token_rounding", rounding="down", tile=128, dtype=torch.float64)
    x = torch.randn(16, 16, dtype=torch.float64)
    mf._warned_small_batch_rounding = False
    torch._dynamo.reset()
    compiled = torch.compile(lambda inp: m(inp).output, fullgraph=True, backend="aot_eager")
    assert torch.count_nonzero(compiled(x)) == 0
    assert mf._warned_small_batch_rounding is False  # eager calls still say it once
    with pytest.warns(RuntimeWarning, match="fewer than one tile"):
        m(x)


def test_index_checking_switch():
    before = machmoe.index_checking_enabled()
    try:
        machmoe.set_index_checking(True)
        assert machmoe.index_checking_enabled() is True
        machmoe.set_index_checking(False)
        assert machmoe.index_checking_enabled() is False
        with pytest.raises(TypeError, match="'enabled'.*bool"):
            machmoe.set_index_checking(1)
        machmoe.check_device_errors("cpu")  # CPU calls validate up front: nothing to raise
    finally:
        machmoe.set_index_checking(before)


# ---- GPU ----------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(0, 256), (4, 0, 256)])
@pytest.mark.parametrize("routing,rounding", ROUTINGS)
def test_gpu_module_with_no_tokens(cuda, shape, routing, rounding):
    m = machmoe.MoE(256, 128, 16, 4, bias=True, routing=routing, rounding=rounding, tile=64, aux_loss_coef=0.01,
                    z_loss_coef=0.001, device=cuda, dtype=torch.bfloat16)
    # Fill the caching allocator's blocks with NaN first, so that a gradient the layer does not write shows.
    torch.full((1 << 20,), float("nan"), device=cuda)
    x = torch.randn(*shape, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    o = m(x)
    assert o.output.shape == shape and o.expert_counts.tolist() == [0] * 16
    assert o.aux_loss.item() == 0.0 and o.z_loss.item() == 0.0
    (o.output.float().sum() + o.aux_loss + o.z_loss).backward()
    assert_zero_grads(params(m), f"{shape} {routing}/{rounding}")


@pytest.mark.gpu
def test_gpu_moe_from_routing_and_grouped_experts_with_nothing_routed(cuda):
    _, w1, w2, b1, b2 = weights(E=8, d=128, n=64, dtype=torch.bfloat16, device=cuda)
    x = torch.randn(5, 128, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    empty_i = torch.zeros(0, dtype=torch.int32, device=cuda)
    scores = torch.zeros(0, device=cuda, requires_grad=True)
    out, counts = machmoe.moe_from_routing(x, w1, w2, empty_i, empty_i, scores, b1, b2, max_experts_per_token=2)
    assert out.shape == (5, 128) and torch.count_nonzero(out) == 0 and counts.sum().item() == 0
    grads = torch.autograd.grad(out.float().sum(), [x, w1, w2, b1, b2])
    assert all(torch.count_nonzero(g) == 0 for g in grads)
    xg = torch.randn(0, 128, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    y = machmoe.grouped_experts(xg, torch.zeros(8, dtype=torch.int64, device=cuda), w1, w2, b1, b2)
    assert y.shape == (0, 128)
    assert all(torch.count_nonzero(g) == 0 for g in torch.autograd.grad(y.float().sum(), [w1, w2, b1, b2]))


@pytest.fixture
def checking():
    before = machmoe.index_checking_enabled()
    machmoe.set_index_checking(True)
    yield
    machmoe.set_index_checking(before)


@pytest.mark.gpu
def test_gpu_index_checking_raises_for_caller_indices(cuda, checking):
    _, w1, w2, _, _ = weights(E=4, d=64, n=32, dtype=torch.bfloat16, device=cuda)
    x = torch.randn(6, 64, device=cuda, dtype=torch.bfloat16)
    sc = torch.full((6,), 0.5, device=cuda)
    call = lambda tok, exp: machmoe.moe_from_routing(x, w1, w2, torch.tensor(tok, device=cuda),
                                                      torch.tensor(exp, device=cuda), sc, max_experts_per_token=2)
    call([0, 0, 1, 3, 3, 5], [1, 2, 0, 9, 1, 2])  # recorded on the device; the call itself does not wait
    with pytest.raises(ValueError, match=r"'routing.expert_index\[3\]'.*\[0, 4\), got 9"):
        machmoe.check_device_errors()
    machmoe.check_device_errors()  # cleared once raised
    call([0, 0, 1, 3, 3, 6], [1, 2, 0, 3, 1, 2])
    with pytest.raises(ValueError, match=r"'routing.token_index\[5\]'.*\[0, 6\), got 6"):
        machmoe.check_device_errors(cuda)
    call([0, 0, 0, 3, 3, 5], [1, 2, 0, 3, 1, 2])  # three pairs for token 0, max_experts_per_token=2
    with pytest.raises(ValueError, match=r"'routing.token_index\[2\]'.*at most K = 2.*at least 3 pairs for token 0"):
        machmoe.check_device_errors()
    call([0, 0, 2, 1, 3, 5], [1, 2, 0, 3, 1, 2])
    torch.cuda.synchronize()
    # The next machmoe call on the device raises what the completed launch recorded.
    with pytest.raises(ValueError, match=r"'routing.token_index\[3\]'.*ascending.*got 1"):
        call([0, 0, 1, 3, 3, 5], [1, 2, 0, 3, 1, 2])
    call([0, 0, 1, 3, 3, 5], [1, 2, 0, 3, 1, 2])
    machmoe.check_device_errors()


@pytest.mark.gpu
def test_gpu_index_checking_raises_for_grouped_counts(cuda, checking):
    _, w1, w2, _, _ = weights(E=4, d=64, n=32, dtype=torch.bfloat16, device=cuda)
    x = torch.randn(6, 64, device=cuda, dtype=torch.bfloat16)
    # The violation is raised at the next synchronisation point the library controls: the layer's own entry right
    # after the index kernel (if that kernel has finished by then) or check_device_errors().
    with pytest.raises(ValueError, match=r"'expert_counts\[1\]'.*count >= 0, got -1"):
        machmoe.grouped_experts(x, torch.tensor([4, -1, 2, 1], device=cuda), w1, w2)
        machmoe.check_device_errors()
    machmoe.check_device_errors()  # raising cleared the record
    with pytest.raises(ValueError, match=r"'expert_counts'.*summing to the 6 grouped rows, got a sum of 14"):
        machmoe.grouped_experts(x, torch.tensor([4, 0, 1, 9], device=cuda), w1, w2)
        machmoe.check_device_errors()


@pytest.mark.gpu
def test_gpu_default_mode_skips_bad_indices_silently(cuda):
    before = machmoe.index_checking_enabled()
    machmoe.set_index_checking(False)
    try:
        _, w1, w2, _, _ = weights(E=4, d=64, n=32, dtype=torch.bfloat16, device=cuda)
        x = torch.randn(6, 64, device=cuda, dtype=torch.bfloat16)
        # Counts summing to 3 of 6 rows: the last 3 rows belong to no expert and come out zero.
        y = machmoe.grouped_experts(x, torch.tensor([2, 0, 1, 0], device=cuda), w1, w2)
        assert torch.count_nonzero(y[3:]) == 0 and torch.count_nonzero(y[:3]) > 0
        machmoe.check_device_errors()
    finally:
        machmoe.set_index_checking(before)
