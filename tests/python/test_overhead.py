"""What the PyTorch path adds on top of the C++ layer (target T14): the autograd kernel's per-call costs, and
python -m machmoe.benchmark.overhead's arguments and report (CPU; the GPU run is in test_overhead_gpu.py)."""
from collections import Counter

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import machmoe

# ---- the module path itself --------------------------------------------------------------------------------------


def _step_ops(m, x, go, loss=None):
    """aten/machmoe operators run by one forward + backward of the module (after a warm-up step)."""
    def step():
        m.zero_grad(set_to_none=True)
        x.grad = None
        o = m(x)
        (o.output if loss is None else loss(o)).backward(go if loss is None else None)
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return Counter(e.name for e in prof.events() if e.name.startswith(("aten::", "machmoe::")))


FILLS_AND_COPIES = {"aten::zeros", "aten::zeros_like", "aten::zero_", "aten::fill_", "aten::full", "aten::copy_",
                    "aten::clone", "aten::to", "aten::_to_copy", "aten::contiguous", "aten::add_", "aten::add"}


def test_module_step_runs_no_fill_or_copy_besides_the_layer():
    """The gradients of the outputs the loss does not use (router logits, counts, the saved buffer) reach the
    backward as None: autograd.Function's default would zero-fill each of them, `saved` (H included) every step."""
    torch.manual_seed(0)
    m = machmoe.MoE(64, 32, 8, 2)
    x = torch.randn(16, 64, requires_grad=True)
    ops = _step_ops(m, x, torch.randn(16, 64))
    assert ops["machmoe::layer_forward"] == 1 and ops["machmoe::layer_backward"] == 1
    assert not FILLS_AND_COPIES & set(ops), ops
    # Outputs, workspaces and gradients: 5 in the forward (out, logits, counts, saved, workspace), 8 in the
    # backward (grad_x, router, w1, w2 gradients, workspace, three empty placeholders); nothing else.
    assert ops["aten::empty"] == 13, ops


def test_logits_only_loss_gets_a_zero_output_gradient():
    """With grads no longer materialised, a loss on the logits alone reaches the backward with grad_out None; the
    output's gradient is then zero (one zeros_like), and the router still gets its gradient."""
    torch.manual_seed(1)
    m = machmoe.MoE(64, 32, 8, 2, aux_loss_coef=0.1)
    x = torch.randn(16, 64, requires_grad=True)
    o = m(x)
    o.aux_loss.backward()
    assert m.router_weight.grad is not None and m.router_weight.grad.abs().sum() > 0
    assert torch.count_nonzero(m.w1.grad) == 0 and torch.count_nonzero(m.w2.grad) == 0  # no output gradient
    assert x.grad is not None


def test_autograd_kernel_does_not_fill_defaults_per_call(monkeypatch):
    """torch.library.register_autograd's generic kernel calls torch._library.utils.fill_defaults on every forward
    (70-200 us of host time for this schema); ours fills the dropped defaults from a tuple read once."""
    import torch._library.utils as lib_utils

    def forbidden(*args, **kwargs):
        raise AssertionError("fill_defaults called per forward")

    monkeypatch.setattr(lib_utils, "fill_defaults", forbidden)
    m = machmoe.MoE(64, 32, 8, 2, bias=True)
    x = torch.randn(16, 64, requires_grad=True)
    m(x).output.sum().backward()
    assert m.w1.grad is not None and m.b1.grad is not None and x.grad is not None


def test_dropped_default_arguments_reach_setup_context():
    """The dispatcher drops trailing arguments equal to their defaults (the into_* buffers); accumulation into a
    buffer passed explicitly still works, and one left out gives an ordinary gradient."""
    torch.manual_seed(2)
    m = machmoe.MoE(64, 32, 8, 2, accumulate_into_main_grad=True)
    x = torch.randn(16, 64, requires_grad=True)
    m(x).output.sum().backward()
    grads = m.main_grads()
    assert all(torch.count_nonzero(g) > 0 for g in grads.values())
    assert m.w1.grad is None
