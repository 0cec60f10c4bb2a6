"""layer_forward's Autograd kernel (bindings/torch/layer_autograd.cpp): the forward and the common backward run in
C++ with no Python frame of machmoe's autograd; create_graph, defer_weight_grads and tracing take the general form in
Python (machmoe._ops._autograd_backward), which gives the same gradients bitwise; and the C++ path works in a
process that loads the operator library without importing machmoe."""
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import machmoe
from layer_inputs import make, plain_and_checkpointed_grads

OPS_FILE = os.path.join(os.path.dirname(machmoe.__file__), "_ops.py")


class _OpsCalls:
    """Names of the Python functions of machmoe/_ops.py called in this thread while active."""

    def __init__(self):
        self.names = []

    def _profile(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename == OPS_FILE:
            self.names.append(frame.f_code.co_name)

    def __enter__(self):
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        return False


def _module(**kw):
    torch.manual_seed(0)
    return machmoe.MoE(16, 8, 4, 2, dtype=torch.float64, **kw)


def test_forward_and_common_backward_call_no_python_of_the_autograd():
    m = _module(bias=True)
    x = torch.randn(10, 16, dtype=torch.float64, requires_grad=True)
    m(x).output.sum().backward()  # warm-up (first-call imports)
    with _OpsCalls() as calls:
        out = m(x)
        out.output.sum().backward()
    assert calls.names == [], calls.names
    assert "LayerFunction" in out.output.grad_fn.name()


def test_create_graph_takes_the_general_form():
    m = _module()
    x = torch.randn(10, 16, dtype=torch.float64, requires_grad=True)
    with _OpsCalls() as calls:
        torch.autograd.grad(m(x).output.sum(), [x], create_graph=True)
    assert "_autograd_backward" in calls.names


def test_only_an_open_deferral_context_takes_the_python_form():
    """A thread's deferral stack stays stashed after its contexts close (torch cannot remove the entry); the node
    must take the C++ backward again then, and the Python form while any context (nested ones too) is open, in this
    thread and in another."""
    m = _module()
    x = torch.randn(10, 16, dtype=torch.float64, requires_grad=True)

    def python_calls():
        with _OpsCalls() as calls:
            m(x).output.sum().backward()
        return "_autograd_backward" in calls.names

    def scenario(result):
        with machmoe.defer_weight_grads() as outer:
            with machmoe.defer_weight_grads() as inner:
                result.append(python_calls())
            result.append(python_calls())  # the outer context is still open
        result.append(python_calls())
        inner.run()
        outer.run()

    result = []
    scenario(result)
    thread_result = []
    t = threading.Thread(target=scenario, args=(thread_result,))
    t.start()
    t.join(60)
    assert result == [True, True, False] and thread_result == [True, True, False]


# Each case: keyword arguments of machmoe.moe (or "caller" for moe_from_routing), and the loss.
CASES = {
    "topk_bias": (dict(bias=True), "output"),
    "topk_no_bias_logits_loss": (dict(bias=False), "output+logits"),
    "logits_only": (dict(bias=True), "logits"),
    "token_rounding": (dict(bias=True, routing="token_rounding", tile=8), "output"),
    "input_only": (dict(bias=True, activation_memory="input_only"), "output"),
    "relu_interleaved": (dict(bias=True, activation="relu"), "output"),
    "accumulate": (dict(bias=True, accumulate=True), "output"),
    "caller": (dict(bias=True, caller=True), "output"),
}


def _run(case, mode):
    """Gradients of one case's loss w.r.t. every input that requires grad (and the accumulation buffers' contents),
    by a plain backward, by create_graph=True, or by torch.autograd.grad inside defer_weight_grads (the general form:
    a gradient asked for by autograd.grad is computed at once, nothing is queued)."""
    kw, loss_kind = CASES[case]
    kw = dict(kw)
    accumulate, caller = kw.pop("accumulate", False), kw.pop("caller", False)
    activation = kw.get("activation", "swiglu")
    x, rw, w1, w2, b1, b2 = make(T=12, d=16, n=8, E=4, activation=activation, bias=kw.pop("bias"), seed=3)
    into = {name: torch.full(t.shape, 0.25, dtype=t.dtype) for name, t in (("w1", w1), ("w2", w2))} \
        if accumulate else None
    if caller:
        tok = torch.tensor([0, 0, 1, 3, 3, 5, 7, 7, 8, 11])
        exp = torch.tensor([1, 2, 0, 3, 1, 2, 0, 1, 3, 2])
        scores = torch.rand(10, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).requires_grad_()
        out, _ = machmoe.moe_from_routing(x, w1, w2, tok, exp, scores, b1, b2, max_experts_per_token=2,
                                          activation=activation)
        logits = None
        inputs = [t for t in (x, w1, w2, b1, b2, scores) if t is not None]
    else:
        out, logits, _ = machmoe.moe(x, rw, w1, w2, b1, b2, top_k=2, accumulate_grads_into=into, **kw)
        inputs = [t for t in (x, rw, w1, w2, b1, b2) if t is not None]
        if accumulate:
            inputs = [t for t in inputs if t is not w1 and t is not w2]
    g = torch.Generator().manual_seed(5)
    loss = 0
    if "output" in loss_kind:
        loss = loss + (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()
    if "logits" in loss_kind:
        loss = loss + (logits * torch.randn(logits.shape, generator=g, dtype=logits.dtype)).sum()
    if mode == "open_context":
        with machmoe.defer_weight_grads() as deferred, _OpsCalls() as calls:
            grads = torch.autograd.grad(loss, inputs, allow_unused=True)
        assert "_autograd_backward" in calls.names and len(deferred) == 0
    else:
        grads = torch.autograd.grad(loss, inputs, allow_unused=True, create_graph=mode == "create_graph")
    grads = [None if gr is None else gr.detach() for gr in grads]
    return grads + ([into["w1"], into["w2"]] if accumulate else [])


@pytest.mark.parametrize("mode", ["create_graph", "open_context"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_general_form_equals_the_cpp_backward_bitwise(case, mode):
    cpp, general = _run(case, "plain"), _run(case, mode)
    assert len(cpp) == len(general)
    for i, (a, b) in enumerate(zip(cpp, general)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert torch.equal(a, b), (case, mode, i)


def test_the_library_alone_runs_the_forward_and_the_common_backward(tmp_path):
    """A process that loads libmachmoe_torch with torch.ops.load_library and never imports machmoe (a C++ or
    TorchScript deployment) gets the same gradients as machmoe's, and a clear error for the Python-only forms."""
    library = [p for p in torch.ops.loaded_libraries if "machmoe_torch" in os.path.basename(p)]
    assert len(library) == 1, torch.ops.loaded_libraries
    x, rw, w1, w2, b1, b2 = make(T=12, d=16, n=8, E=4, bias=True, seed=6)
    go = torch.randn(12, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    torch.save({"inputs": [t.detach() for t in (x, rw, w1, w2, b1, b2)], "go": go}, tmp_path / "inputs.pt")
    code = textwrap.dedent(f"""
        import sys
        import torch
        torch.ops.load_library({library[0]!r})
        assert "machmoe" not in sys.modules
        d = torch.load({str(tmp_path / "inputs.pt")!r})
        x, rw, w1, w2, b1, b2 = [t.requires_grad_() for t in d["inputs"]]
        codes = (2, 0, 0, 0, 0, 0, 128, 0)
        out = torch.ops.machmoe.layer_forward(x, rw, w1, b1, w2, b2, None, None, None, *codes)[0]
        grads = torch.autograd.grad(out, (x, rw, w1, w2, b1, b2), d["go"], retain_graph=True)
        torch.save({{"out": out.detach(), "grads": grads}}, {str(tmp_path / "grads.pt")!r})
        try:
            torch.autograd.grad(out, (x,), d["go"], create_graph=True)
        except RuntimeError as e:
            print("create_graph:", str(e).splitlines()[0])
    """)
    env = dict(os.environ)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "implemented in Python: import machmoe" in result.stdout, result.stdout
    theirs = torch.load(tmp_path / "grads.pt")
    out = torch.ops.machmoe.layer_forward(x, rw, w1, b1, w2, b2, None, None, None, 2, 0, 0, 0, 0, 0, 128, 0)[0]
    ours = torch.autograd.grad(out, (x, rw, w1, w2, b1, b2), go)
    assert torch.equal(out.detach(), theirs["out"])
    for a, b in zip(ours, theirs["grads"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_gives_the_plain_gradients_bitwise(use_reentrant):
    """torch.utils.checkpoint around a block holding the layer (as HF, torchtitan and Megatron wrap transformer
    blocks): the saved tensors go through checkpoint's hooks and the forward runs again inside the backward; the
    gradients are those of the plain block, bitwise."""
    m = _module(bias=True)
    x = torch.randn(24, 16, dtype=torch.float64, requires_grad=True)
    go = torch.randn(24, 16, dtype=torch.float64)

    def block(inp):
        o = m(inp)
        return inp + o.output

    plain, checkpointed = plain_and_checkpointed_grads(block, x, [x] + list(m.parameters()), go, use_reentrant)
    for a, b in zip(plain, checkpointed):
        assert a is not None and torch.equal(a, b)
