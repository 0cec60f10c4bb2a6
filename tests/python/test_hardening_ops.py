"""Every torch.ops.machmoe operator called directly, as a careless or hostile caller would: every integer argument
out of range (negative, past the enum, values that only look valid once narrowed to 32 bits, 2^63 - 1), and tensors
of the wrong dtype, layout, rank or device. Each must raise ValueError naming the operator and the argument and
printing the value given; none may crash the interpreter or be accepted.

Before the operators checked their arguments, routing code 77 segfaulted, cache code 5 was accepted and activation
code 99 was reported as a W1 shape error; activation 2^32 was narrowed to 0 (swiglu) and ran."""
import re

import pytest
import torch

import machmoe  # noqa: F401  (loads the operator library)

ops = torch.ops.machmoe
T, D, N, E, K = 6, 8, 3, 4, 2
INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)

# Codes of python/machmoe/_options.py (the enum values of include/machmoe/problem.hpp).
SWIGLU, INTERLEAVED, SOFTMAX_TOPK, TOPK, TOKEN_ROUNDING, CALLER, NEAREST, PREACT = 0, 0, 0, 0, 1, 2, 0, 0

# Per integer option: values that must be rejected. 2^32 + c would be narrowed to the valid code c by a 32-bit
# conversion; INT64_MIN and INT64_MAX are the extremes.
BAD_OPTIONS = {
    "top_k": [0, -1, E + 1, 2**32 + K, INT64_MAX, INT64_MIN],
    "activation": [-1, 8, 77, 99, 2**31, 2**32, INT64_MAX, INT64_MIN],
    "weight_layout": [-1, 2, 2**32 + 1, INT64_MAX, INT64_MIN],
    "score": [-1, 3, 2**32, INT64_MAX, INT64_MIN],
    "routing": [-1, 3, 77, 2**32, 2**32 + CALLER, INT64_MAX, INT64_MIN],
    "rounding": [-1, 3, 2**32 + 1, INT64_MAX, INT64_MIN],
    "tile": [0, -8, 12, 4096 + 8, 2**32 + 128, INT64_MAX, INT64_MIN],
    "cache": [-1, 2, 5, 2**32 + 1, INT64_MAX, INT64_MIN],
}
OPTION_NAMES = list(BAD_OPTIONS)


def options(**override):
    o = dict(top_k=K, activation=SWIGLU, weight_layout=INTERLEAVED, score=SOFTMAX_TOPK, routing=TOPK,
             rounding=NEAREST, tile=128, cache=PREACT)
    o.update(override)
    return [o[name] for name in OPTION_NAMES]


class Layer:
    """A valid fp64 layer (T=6, d=8, n=3, E=4, K=2, swiglu, no biases) and its forward's saved and deferred
    buffers; each test breaks one argument of one operator."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) * 0.3
        self.x, self.rw, self.w1, self.w2 = r(T, D), r(E, D), r(E, 2 * N, D), r(E, D, N)
        self.go = r(T, D)
        out, logits, counts, self.saved = ops.layer_forward(self.x, self.rw, self.w1, None, self.w2, None,
                                                            None, None, None, *options())
        assert out.shape == (T, D) and int(counts.sum()) == T * K
        *_, self.deferred = ops.layer_backward_input(self.go, None, self.x, self.rw, self.w1, None, self.w2, None,
                                                     None, None, None, self.saved, *options())

    # Each operator with its tensors as keyword overrides and its integer options as a list.
    def forward(self, opts, **t):
        a = dict(x=self.x, router_weight=self.rw, w1=self.w1, b1=None, w2=self.w2, b2=None, token_index=None,
                 expert_index=None, scores=None)
        a.update(t)
        return ops.layer_forward(*a.values(), *opts)

    def _backward_tensors(self, t):
        a = dict(grad_out=self.go, grad_logits=None, x=self.x, router_weight=self.rw, w1=self.w1, b1=None,
                 w2=self.w2, b2=None, token_index=None, expert_index=None, scores=None, saved=self.saved)
        a.update(t)
        return a

    def backward(self, opts, **t):
        return ops.layer_backward(*self._backward_tensors(t).values(), *opts)

    def backward_input(self, opts, **t):
        return ops.layer_backward_input(*self._backward_tensors(t).values(), *opts)

    def backward_weight(self, opts, **t):
        a = dict(grad_out=self.go, x=self.x, router_weight=self.rw, w1=self.w1, b1=None, w2=self.w2, b2=None,
                 token_index=None, expert_index=None, scores=None, saved=self.saved, deferred=self.deferred)
        a.update(t)
        return ops.layer_backward_weight(*a.values(), *opts)


LAYER_OPS = {"layer_forward": "forward", "layer_backward": "backward", "layer_backward_input": "backward_input",
             "layer_backward_weight": "backward_weight"}


@pytest.fixture(scope="module")
def layer():
    return Layer()


def call(layer, op, opts, **tensors):
    return getattr(layer, LAYER_OPS[op])(opts, **tensors)


def expect(op, arg, *fragments):
    """pytest.raises for ValueError naming the operator and the argument, with every fragment in the message."""
    pattern = re.escape(f"machmoe::{op}: argument '{arg}': expected") + ".*" + ".*".join(map(re.escape, fragments))
    return pytest.raises(ValueError, match=pattern)


@pytest.mark.parametrize("op", LAYER_OPS)
def test_valid_calls_pass(layer, op):
    """The baseline each test breaks in one place is itself accepted, so a rejection is the bad argument's."""
    results = call(layer, op, options())
    assert all(isinstance(r, torch.Tensor) for r in results)


@pytest.mark.parametrize("op", LAYER_OPS)
@pytest.mark.parametrize("arg,value", [(a, v) for a, vs in BAD_OPTIONS.items() for v in vs])
def test_layer_ops_reject_every_bad_integer(layer, op, arg, value):
    with expect(op, arg, f"got {value}"):
        call(layer, op, options(**{arg: value}))


@pytest.mark.parametrize("op", LAYER_OPS)
def test_option_messages_list_the_valid_codes(layer, op):
    with expect(op, "activation", "swiglu = 0", "silu = 6", "got 99"):
        call(layer, op, options(activation=99))
    with expect(op, "routing", "topk = 0, token_rounding = 1, caller = 2", "got 77"):
        call(layer, op, options(routing=77))
    with expect(op, "cache", "preact = 0, input_only = 1", "got 5"):
        call(layer, op, options(cache=5))
    with expect(op, "top_k", "[1, 4]", "got 5"):
        call(layer, op, options(top_k=5))
    with expect(op, "tile", "multiple of 8 in [8, 4096]", "got 12"):
        call(layer, op, options(tile=12))


def test_invalid_activation_is_not_reported_as_a_shape(layer):
    # Activation 4 (relu) needs a W1 of n rows, not 2n: a shape error is right for it, but not for code 99.
    with pytest.raises(ValueError, match="'weights.w1'"):
        layer.forward(options(activation=4))
    with pytest.raises(ValueError) as e:
        layer.forward(options(activation=99))
    assert "'activation'" in str(e.value) and "shape" not in str(e.value)


@pytest.mark.parametrize("op", LAYER_OPS)
def test_layer_ops_check_tensor_dtype_and_rank(layer, op):
    with expect(op, "x", "a (T, d) tensor", "got shape (1, 6, 8)"):
        call(layer, op, options(), x=layer.x[None])
    with expect(op, "w1", "(E, 2n or n, d)", "got shape (4, 6)"):
        call(layer, op, options(), w1=layer.w1[:, :, 0])
    with expect(op, "w2", "(E, d, n)", "got shape (1, 4, 8, 3)"):
        call(layer, op, options(), w2=layer.w2[None])
    with expect(op, "w1", "E in [1, 65536]", "got shape (0, 6, 8)"):
        call(layer, op, options(), w1=layer.w1[:0], w2=layer.w2[:0])
    with expect(op, "x", "dtype bfloat16, float16, float32, float64, int32 or int64", "got ComplexDouble"):
        call(layer, op, options(), x=layer.x.to(torch.complex128))
    with expect(op, "router_weight", "dtype", "got Bool"):
        call(layer, op, options(), router_weight=layer.rw.bool())
    with expect(op, "b1", "rank <= 4", "got rank 5"):
        call(layer, op, options(), b1=torch.zeros(1, 1, 1, 1, 1, dtype=torch.float64))


@pytest.mark.parametrize("op", LAYER_OPS)
def test_routing_triples_only_with_routing_caller(layer, op):
    tok = torch.tensor([0, 1]), torch.tensor([0, 1]), torch.ones(2, dtype=torch.float64)
    with expect(op, "token_index", "None for routing 'topk'", "got a tensor of shape (2,)"):
        call(layer, op, options(), token_index=tok[0])
    with expect(op, "scores", "None for routing 'token_rounding'"):
        call(layer, op, options(routing=TOKEN_ROUNDING), scores=tok[2])
    with expect(op, "token_index", "a (P,) tensor for routing 'caller'", "got None"):
        call(layer, op, options(routing=CALLER))
    with expect(op, "scores", "for routing 'caller'", "got None"):
        call(layer, op, options(routing=CALLER), token_index=tok[0], expert_index=tok[1])
    with expect(op, "token_index", "a 1-D (P,) tensor", "got shape ()"):
        call(layer, op, options(routing=CALLER), token_index=torch.tensor(0), expert_index=tok[1], scores=tok[2])


@pytest.mark.parametrize("op", ["layer_backward", "layer_backward_input", "layer_backward_weight"])
def test_saved_buffer_is_the_forwards(layer, op):
    # The library reads `saved` through a raw pointer and a byte count: a float tensor would be measured in
    # elements, a non-contiguous one read with gaps, one on another device dereferenced on the wrong side.
    with expect(op, "saved", "a uint8 tensor", "got Float"):
        call(layer, op, options(), saved=layer.saved.float())
    with expect(op, "saved", "a 1-D tensor", "got shape (1, "):
        call(layer, op, options(), saved=layer.saved[None])
    with expect(op, "saved", "a contiguous tensor", "got stride 2"):
        call(layer, op, options(), saved=torch.cat([layer.saved, layer.saved])[::2])


def test_deferred_buffer_is_backward_inputs(layer):
    with expect("layer_backward_weight", "deferred", "a uint8 tensor", "got Double"):
        layer.backward_weight(options(), deferred=layer.deferred.double())
    with expect("layer_backward_weight", "deferred", "a contiguous tensor"):
        layer.backward_weight(options(), deferred=torch.cat([layer.deferred, layer.deferred])[::2])


def test_grad_logits_of_routing_caller_is_not_dropped_silently(layer):
    tok, exp = torch.tensor([0, 1, 2, 3, 4, 5]), torch.tensor([0, 1, 2, 3, 0, 1])
    sc = torch.ones(6, dtype=torch.float64)
    _, _, _, saved = layer.forward(options(routing=CALLER), router_weight=None, token_index=tok, expert_index=exp,
                                   scores=sc)
    args = dict(router_weight=None, token_index=tok, expert_index=exp, scores=sc, saved=saved)
    dx_none = layer.backward(options(routing=CALLER), grad_logits=None, **args)[0]
    dx_empty = layer.backward(options(routing=CALLER), grad_logits=torch.zeros(0, dtype=torch.float64), **args)[0]
    assert torch.equal(dx_none, dx_empty)
    with expect("layer_backward", "grad_logits", "None or an empty tensor", "got a tensor of shape (6, 4)"):
        layer.backward(options(routing=CALLER), grad_logits=torch.ones(T, E, dtype=torch.float64), **args)


# ---- saved_nbytes (the fake implementation's helper) ----------------------------------------------------------------

NBYTES_ARGS = ["T", "d", "n", "E", "K", "num_pairs", "activation", "score", "routing", "tile", "cache", "elem_size",
               "rounding"]


def nbytes_args(**override):
    a = dict(T=T, d=D, n=N, E=E, K=K, num_pairs=0, activation=SWIGLU, score=SOFTMAX_TOPK, routing=TOPK, tile=128,
             cache=PREACT, elem_size=8, rounding=NEAREST)
    a.update(override)
    return [a[name] for name in NBYTES_ARGS]


BAD_NBYTES = {
    "T": [-1, 2**31, INT64_MAX, INT64_MIN],  # T = 0 is the core's rule (empty inputs), not tested here
    "d": [0, -1, 2**20 + 1, 2**32 + D, INT64_MAX, INT64_MIN],
    "n": [0, -1, 2**20 + 1, 2**32 + N, INT64_MAX, INT64_MIN],
    "E": [0, -1, 65537, 2**32 + E, INT64_MAX, INT64_MIN],
    "K": [0, -1, E + 1, 2**32 + K, INT64_MAX, INT64_MIN],
    "num_pairs": [-1, 2**31, INT64_MAX, INT64_MIN],
    "activation": [-1, 8, 99, 2**32, INT64_MAX, INT64_MIN],
    "score": [-1, 3, 2**32, INT64_MAX, INT64_MIN],
    "routing": [-1, 3, 77, 2**32 + CALLER, INT64_MAX, INT64_MIN],
    "tile": [0, -8, 12, 4104, 2**32 + 128, INT64_MAX, INT64_MIN],
    "cache": [-1, 2, 5, 2**32 + 1, INT64_MAX, INT64_MIN],
    "elem_size": [0, -2, 1, 3, 16, 2**32 + 4, INT64_MAX, INT64_MIN],
    "rounding": [-1, 3, 2**32 + 1, INT64_MAX, INT64_MIN],
}


def test_saved_nbytes_matches_the_forward(layer):
    assert ops.saved_nbytes(*nbytes_args()) == layer.saved.numel()


def test_saved_nbytes_follows_the_rounding_rule():
    """Token rounding reserves routed pairs by its rule (nearest, up, down bound them differently), so the size the
    fake implementation gives torch.compile must know the rule: it must equal what the forward allocates."""
    g = torch.Generator().manual_seed(1)
    t, tile = 64, 8  # T*K = 128 pairs; the rules reserve 140 (nearest), 156 (up), 128 (down) of at most T*E = 256
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) * 0.3
    x, rw, w1, w2 = r(t, D), r(E, D), r(E, 2 * N, D), r(E, D, N)
    sizes = []
    for rule in (0, 1, 2):  # nearest, up, down
        opts = options(routing=TOKEN_ROUNDING, rounding=rule, tile=tile)
        saved = ops.layer_forward(x, rw, w1, None, w2, None, None, None, None, *opts)[3]
        nbytes = ops.saved_nbytes(*nbytes_args(T=t, routing=TOKEN_ROUNDING, tile=tile, rounding=rule))
        assert nbytes == saved.numel(), rule
        sizes.append(nbytes)
    assert len(set(sizes)) == 3, sizes  # the rules do reserve differently here


@pytest.mark.parametrize("arg,value", [(a, v) for a, vs in BAD_NBYTES.items() for v in vs])
def test_saved_nbytes_rejects_every_bad_integer(arg, value):
    with expect("saved_nbytes", arg, f"got {value}"):
        ops.saved_nbytes(*nbytes_args(**{arg: value}))


def test_saved_nbytes_checks_how_arguments_combine():
    with expect("saved_nbytes", "problem.num_pairs", "0 unless routing is 'caller'", "got 3"):
        ops.saved_nbytes(*nbytes_args(num_pairs=3))
    with expect("saved_nbytes", "problem.num_pairs", "got 13"):
        ops.saved_nbytes(*nbytes_args(routing=CALLER, num_pairs=T * K + 1))
    with expect("saved_nbytes", "problem.T*K", "int32"):
        ops.saved_nbytes(*nbytes_args(T=2**30, E=8, K=4))
    with expect("saved_nbytes", "elem_size", "2, 4 or 8"):
        ops.saved_nbytes(*nbytes_args(elem_size=3))


# ---- the same on the GPU (run on the GPU machine) -------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_ops_reject_bad_codes_and_host_buffers(cuda):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.3).to(device=cuda, dtype=torch.bfloat16)
    x, rw, w1, w2, go = r(64, 128), r(8, 128), r(8, 256, 128), r(8, 128, 128), r(64, 128)
    for arg, value in (("activation", 99), ("routing", 77), ("cache", 5), ("activation", 2**32), ("tile", 0)):
        with expect("layer_forward", arg, f"got {value}"):
            ops.layer_forward(x, rw, w1, None, w2, None, None, None, None, *options(**{arg: value}))
    out, logits, counts, saved = ops.layer_forward(x, rw, w1, None, w2, None, None, None, None, *options())
    torch.cuda.synchronize()
    # A saved buffer on the host would be dereferenced by the device (an illegal address, a sticky CUDA error).
    with expect("layer_backward", "saved", "a tensor on cuda:0 (the device of x)", "got a tensor on cpu"):
        ops.layer_backward(go, None, x, rw, w1, None, w2, None, None, None, None, saved.cpu(), *options())
    dx = ops.layer_backward(go, None, x, rw, w1, None, w2, None, None, None, None, saved, *options())[0]
    torch.cuda.synchronize()
    assert torch.isfinite(dx.float()).all()
