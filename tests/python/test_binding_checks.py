"""Argument checks of the PyTorch binding found by a review: operands on mixed devices in the fake (meta) kernels,
inference tensors as accumulation buffers, check_device_errors' device argument, the forward's into_* buffers, and
the bytes of the forward's `saved` buffer on the CPU."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import machmoe
from layer_inputs import make

ops = torch.ops.machmoe
# top_k, activation, weight_layout, score, routing, rounding, tile, cache, swiglu_alpha, swiglu_limit
TOPK = (2, 0, 0, 0, 0, 0, 8, 0, 1.702, 7.0)
TOKEN_ROUNDING = (2, 0, 0, 0, 1, 0, 8, 0, 1.702, 7.0)
CALLER = (2, 0, 0, 0, 2, 0, 128, 0, 1.702, 7.0)


def _layer(T=10, bias=True):
    return [t.detach() if t is not None else None for t in make(T=T, bias=bias)]


def _caller_triples(T=10, E=4):
    token_index = torch.arange(T).repeat_interleave(2)
    expert_index = torch.arange(2 * T) % E
    return token_index, expert_index, torch.rand(2 * T, dtype=torch.float64)


# ---- 1. the fake kernels (also the Meta kernels) refuse operands on another device than x ----------------------

def test_fake_kernel_refuses_a_meta_weight_with_a_cpu_x():
    # Meta wins dispatch when any operand is on meta: the fake used to return uninitialised CPU tensors.
    x, rw, w1, w2, b1, b2 = _layer()
    with pytest.raises(ValueError, match=r"machmoe::layer_forward: argument 'router_weight': expected a tensor on "
                                         r"cpu \(the device of x\), got a tensor on meta"):
        ops.layer_forward(x, rw.to("meta"), w1, b1, w2, b2, None, None, None, *TOPK)
    with pytest.raises(ValueError, match=r"argument 'w1': expected a tensor on meta \(the device of x\), got a tensor "
                                         r"on cpu"):
        ops.layer_forward(x.to("meta"), rw.to("meta"), w1, b1.to("meta"), w2.to("meta"), b2.to("meta"), None, None,
                          None, *TOPK)
    with pytest.raises(ValueError, match=r"argument 'into_w1': expected a tensor on cpu"):
        ops.layer_forward(x, rw, w1, b1, w2, b2, None, None, None, *TOPK, None, torch.zeros_like(w1, device="meta"))


def test_fake_backward_and_combine_kernels_refuse_mixed_devices():
    x, rw, w1, w2, b1, b2 = _layer()
    out, logits, counts, saved = ops.layer_forward(x, rw, w1, b1, w2, b2, None, None, None, *TOPK)
    with pytest.raises(ValueError, match=r"machmoe::layer_backward: argument 'saved': expected a tensor on cpu"):
        ops.layer_backward(torch.ones_like(out), None, x, rw, w1, b1, w2, b2, None, None, None, saved.to("meta"),
                           *TOPK)
    rows, scores, row_of_pair = torch.randn(6, 8), torch.rand(6), torch.arange(6)
    with pytest.raises(ValueError, match=r"machmoe::combine_rows: argument 'scores': expected a tensor on cpu \(the "
                                         r"device of rows\), got a tensor on meta"):
        ops.combine_rows(rows, scores.to("meta"), row_of_pair, None, 2, 3)


def test_fake_kernels_still_take_operands_all_on_meta_or_all_fake():
    x, rw, w1, w2, b1, b2 = _layer()
    meta = [t.to("meta") for t in (x, rw, w1, b1, w2, b2)]
    out, logits, counts, saved = ops.layer_forward(*meta, None, None, None, *TOPK)
    assert out.device.type == "meta" and out.shape == x.shape and saved.dtype == torch.uint8
    # torch.compile's FakeTensorMode: every tensor fake, on its real device.
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (x, rw, w1, b1, w2, b2)]
        out, logits, counts, saved = ops.layer_forward(*fake, None, None, None, *TOPK)
        assert out.device == x.device and out.shape == x.shape and logits.shape == (10, 4)


# ---- 2. an inference tensor as an accumulation buffer is refused before anything is written ----------------------

def test_inference_buffer_refused_by_moe_before_anything_is_written():
    x, rw, w1, w2, b1, b2 = make(T=10)
    with torch.inference_mode():
        buf = torch.zeros_like(w1)
    with pytest.raises(ValueError, match=r"argument 'accumulate_grads_into\['w1'\]': expected a tensor with a version "
                                         r"counter \(not an inference tensor.*got an inference tensor"):
        machmoe.moe(x, rw, w1, w2, b1, b2, top_k=2, accumulate_grads_into={"w1": buf})
    assert not buf.any()


@pytest.mark.parametrize("operator", ["layer_forward", "layer_backward", "layer_backward_weight"])
def test_inference_buffer_refused_by_the_operators_before_anything_is_written(operator):
    x, rw, w1, w2, b1, b2 = _layer()
    with torch.inference_mode():
        buf = torch.zeros_like(w2)
    out, _, _, saved = ops.layer_forward(x, rw, w1, b1, w2, b2, None, None, None, *TOPK)
    go = torch.ones_like(out)
    match = rf"machmoe::{operator}: argument 'into_w2': expected a tensor with a version counter.*got an inference"
    with pytest.raises(ValueError, match=match):
        if operator == "layer_forward":
            ops.layer_forward(x, rw, w1, b1, w2, b2, None, None, None, *TOPK, into_w2=buf)
        elif operator == "layer_backward":
            ops.layer_backward(go, None, x, rw, w1, b1, w2, b2, None, None, None, saved, *TOPK, into_w2=buf)
        else:
            _, _, _, deferred = ops.layer_backward_input(go, None, x, rw, w1, b1, w2, b2, None, None, None, saved,
                                                         *TOPK)
            ops.layer_backward_weight(go, x, rw, w1, b1, w2, b2, None, None, None, saved, deferred, *TOPK,
                                      into_w2=buf)
    assert not buf.any()


def test_inference_buffer_accepted_inside_inference_mode():
    # As torch allows an in-place op on an inference tensor there (nothing records a graph to protect).
    x, rw, w1, w2, b1, b2 = _layer()
    with torch.inference_mode():
        buf = torch.zeros_like(w1)
        out, _, _, saved = ops.layer_forward(x, rw, w1, b1, w2, b2, None, None, None, *TOPK, into_w1=buf)
        ops.layer_backward(torch.ones_like(out), None, x, rw, w1, b1, w2, b2, None, None, None, saved, *TOPK,
                           into_w1=buf)
    assert buf.any()


# ---- 3. check_device_errors checks its device before it narrows it or asks torch for a stream ------------------

@pytest.mark.parametrize("device", [2**32, 2**32 + 1, 128, -1])
def test_check_device_errors_refuses_an_ordinal_out_of_range(device):
    with pytest.raises(ValueError, match=rf"machmoe::check_device_errors: argument 'device': expected an integer in "
                                         rf"\[0, 127\] \(a CUDA device ordinal\), got {device}"):
        ops.check_device_errors(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without a usable CUDA device")
def test_check_device_errors_without_a_gpu_gives_the_library_message():
    with pytest.raises(ValueError, match=r"machmoe::check_device_errors: argument 'device': expected (cpu \(this "
                                         r"build has no CUDA support|a usable CUDA device)"):
        ops.check_device_errors(0)


# ---- 4. the forward checks its into_* buffers as the backward does -------------------------------------------------

@pytest.mark.parametrize("bad, match", [
    (torch.zeros(3, dtype=torch.float16), r"argument 'into_w1': expected dtype Double \(the dtype of x\) or Float"),
    (torch.zeros(3, dtype=torch.float64), r"argument 'into_w1': expected shape \(4, 8, 8\) \(the weight's shape\), "
                                          r"got shape \(3,\)"),
    (torch.zeros(4, 8, 8, dtype=torch.float64, device="meta"),
     r"argument 'into_w1': expected a tensor on cpu \(the device of x\), got a tensor on meta"),
    (torch.zeros(4, 8, 8, dtype=torch.float64).transpose(1, 2),
     r"argument 'into_w1': expected a contiguous tensor, got strides \(64, 1, 8\)"),
])
def test_forward_refuses_a_malformed_buffer(bad, match):
    x, rw, w1, w2, _, _ = make(T=10, bias=False)  # requires grad: the buffer would only be read by backward()
    with pytest.raises(ValueError, match=r"machmoe::layer_forward: " + match):
        ops.layer_forward(x, rw, w1, None, w2, None, None, None, None, *TOPK, into_w1=bad)


@pytest.mark.parametrize("arg, match", [
    ("into_b1", r"argument 'into_b1': expected None \(the layer has no b1\), got a tensor of shape \(4, 8\)"),
    ("into_b2", r"argument 'into_b2': expected None \(the layer has no b2\), got a tensor of shape \(4, 8\)"),
])
def test_forward_refuses_a_buffer_for_an_absent_bias(arg, match):
    # The backward used to drop it silently: the caller's buffer never received a gradient.
    x, rw, w1, w2, _, _ = make(T=10, bias=False)
    with pytest.raises(ValueError, match=r"machmoe::layer_forward: " + match):
        ops.layer_forward(x, rw, w1, None, w2, None, None, None, None, *TOPK, **{arg: torch.zeros(4, 8,
                                                                                                 dtype=x.dtype)})


def test_forward_refuses_a_router_buffer_without_a_router():
    x, _, w1, w2, _, _ = make(T=10, bias=False)
    with pytest.raises(ValueError, match=r"machmoe::layer_forward: argument 'into_router_weight': expected None "
                                         r"\(routing 'caller' has no router\)"):
        ops.layer_forward(x, None, w1, None, w2, None, *_caller_triples(), *CALLER,
                          into_router_weight=torch.zeros(4, 8, dtype=x.dtype))


def test_forward_accepts_well_formed_buffers():
    x, rw, w1, w2, b1, b2 = make(T=10)
    into = [torch.zeros(w.shape, dtype=torch.float32) for w in (rw, w1, b1, w2, b2)]
    out, *_ = ops.layer_forward(x, rw, w1, b1, w2, b2, None, None, None, *TOPK, *into)
    out.sum().backward()
    assert all(buf.any() for buf in into)


# ---- 5. the forward's saved buffer has no uninitialised bytes on the CPU ----------------------------------------

@pytest.mark.parametrize("routing", ["topk", "token_rounding", "caller"])
def test_identical_forwards_save_identical_bytes_on_the_cpu(routing):
    x, rw, w1, w2, b1, b2 = _layer()
    if routing == "caller":
        args = (x, None, w1, b1, w2, b2, *_caller_triples(), *CALLER)
    else:
        args = (x, rw, w1, b1, w2, b2, None, None, None, *(TOPK if routing == "topk" else TOKEN_ROUNDING))
    saved = []
    for i in range(3):
        # Freed memory of recent sizes full of non-zero bytes, for the allocator to hand out again.
        junk = [torch.full((n,), 0xA5 + i, dtype=torch.uint8) for n in (1024, 2560, 4096, 8192)]
        del junk
        saved.append(ops.layer_forward(*args)[3])
    assert all(torch.equal(saved[0], s) for s in saved[1:])


def test_opcheck_aot_dispatch_dynamic_of_the_forward():
    x, rw, w1, w2, b1, b2 = make(T=10)
    torch.library.opcheck(ops.layer_forward, (x, rw, w1, b1, w2, b2, None, None, None, *TOPK),
                          test_utils="test_aot_dispatch_dynamic")
