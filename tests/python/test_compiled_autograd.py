"""The layer's backward under compiled autograd (torch._dynamo's tracing of the autograd graph, which torchtitan and
others turn on for the backward of an eager forward), with and without caller buffers for the weight gradients.

Before: the layer's autograd node kept the accumulate-into buffers in one list entry of its saved data. Compiled
autograd swaps every tensor entry of a node's saved data for a proxy while it traces, but not the tensors inside a
list, so the trace met the real buffers and failed (an AssertionError in compiled_autograd.to_proxy)."""
import pytest
import torch
from torch._dynamo import compiled_autograd

import machmoe
from machmoe import functional as F
from layer_inputs import rel

T, D, N, E, K = 11, 16, 8, 4, 2
SMALL = (T, D, N)


def _shapes(d=D, n=N):
    return {"router_weight": (E, d), "w1": (E, 2 * n, d), "w2": (E, d, n), "b1": (E, 2 * n)}


def _inputs(seed=0, device="cpu", dtype=torch.float64, dims=SMALL):
    T, D, N = dims
    g = torch.Generator().manual_seed(seed)

    def leaf(shape, scale):
        return (torch.randn(shape, dtype=torch.float64, generator=g) * scale).to(device, dtype).requires_grad_()

    return (leaf((T, D), 1.0), leaf((E, D), D ** -0.5), leaf((E, 2 * N, D), D ** -0.5), leaf((E, D, N), N ** -0.5),
            leaf((E, 2 * N), 1.0))


def _backward(loss, compiled):
    if compiled:
        torch._dynamo.reset()
        with compiled_autograd._enable(torch.compile(backend="aot_eager")):
            loss.backward()
    else:
        loss.backward()


def _functional_step(into, compiled, seed, device="cpu", dtype=torch.float64, dims=SMALL):
    x, wr, w1, w2, b1 = _inputs(seed, device, dtype, dims)
    out = F.moe(x, wr, w1, w2, b1, top_k=K, accumulate_grads_into=into)[0]
    _backward(out.square().sum(), compiled)
    return x, wr, w1, w2, b1


def test_plain_backward_matches_eager():
    eager = _functional_step(None, False, 1)
    got = _functional_step(None, True, 1)
    for name, a, b in zip(["x", "router_weight", "w1", "w2", "b1"], got, eager):
        assert a.grad is not None, name
        assert rel(a.grad, b.grad) < 1e-12, (name, rel(a.grad, b.grad))


@pytest.mark.parametrize("names", [("w1",), ("router_weight", "w1", "w2", "b1")])
def test_buffers_receive_the_gradients_and_each_call_its_own(names):
    shapes = _shapes()
    reference = {n: torch.zeros(shapes[n], dtype=torch.float64) for n in names}
    ref_tensors = _functional_step(reference, False, 2)
    # Two calls, each with buffers of its own (fresh allocations, as after a reset of the gradient buffers): each
    # call's gradients land in its own buffers, none in the other's or in .grad.
    firsts = {n: torch.full(shapes[n], 0.5, dtype=torch.float64) for n in names}
    seconds = {n: torch.zeros(shapes[n], dtype=torch.float64) for n in names}
    first_tensors = _functional_step(firsts, True, 2)
    second_tensors = _functional_step(seconds, True, 2)
    order = ["x", "router_weight", "w1", "w2", "b1"]
    for n in names:
        assert rel(firsts[n] - 0.5, reference[n]) < 1e-12, n
        assert rel(seconds[n], reference[n]) < 1e-12, n
        i = order.index(n)
        assert first_tensors[i].grad is None and second_tensors[i].grad is None, n
    assert reference["w1"].abs().sum() > 0
    # x's gradient is never accumulated into a buffer.
    assert rel(second_tensors[0].grad, ref_tensors[0].grad) < 1e-12


def test_module_main_grad_backward():
    def run(compiled):
        torch.manual_seed(0)
        m = machmoe.MoE(D, N, E, K, dtype=torch.float64, bias=True, accumulate_into_main_grad=True)
        x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
        _backward(m(x).output.square().sum(), compiled)
        return m, x

    eager_m, eager_x = run(False)
    m, x = run(True)
    for (name, p), q in zip(m.named_parameters(), eager_m.parameters()):
        assert p.grad is None, name
        assert rel(p.main_grad, q.main_grad) < 1e-12, (name, rel(p.main_grad, q.main_grad))
    assert rel(x.grad, eager_x.grad) < 1e-12


@pytest.mark.gpu
def test_buffers_on_the_gpu_are_bitwise_the_eager_ones(cuda):
    # bf16 data at a shape the Hopper kernels take, fp32 buffers; eager and compiled autograd run the same kernels.
    dims = (300, 128, 64)
    shapes = _shapes(dims[1], dims[2])
    bufs = [{n: torch.zeros(s, dtype=torch.float32, device=cuda) for n, s in shapes.items()} for _ in range(2)]
    eager = _functional_step(bufs[0], False, 3, cuda, torch.bfloat16, dims)
    compiled = _functional_step(bufs[1], True, 3, cuda, torch.bfloat16, dims)
    for n in shapes:
        assert bufs[0][n].abs().sum() > 0, n
        assert torch.equal(bufs[0][n], bufs[1][n]), n
    assert torch.equal(eager[0].grad, compiled[0].grad)
