"""machmoe.MoE: a drop-in Mixture-of-Experts layer."""
import functools
import inspect
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch
from torch import Tensor, nn

from . import functional as F
from ._options import (GLU_ACTIVATIONS, ACTIVATIONS, ACTIVATION_MEMORY, ROUNDINGS, SCORES, SWIGLU_ALPHA_DEFAULT,
                       SWIGLU_LIMIT_DEFAULT, WEIGHT_LAYOUTS, activation_parameters, code, name_of, tile_option)
from ._validation import as_int, as_nonnegative_real, fail, require_tensor, type_name


@dataclass
class MoEOutput:
    output: Tensor                      # same shape as the input
    router_logits: Tensor               # (tokens, experts)
    expert_counts: Tensor               # (experts,) int32, on the device
    aux_loss: Optional[Tensor] = None   # Switch load-balancing loss, when aux_loss_coef > 0 (scaled; 0 for no tokens)
    z_loss: Optional[Tensor] = None     # router z-loss, when z_loss_coef > 0 (scaled; 0 for no tokens)


# A pytree node, so that what walks a module's outputs finds the tensors inside. FSDP2 gathers a sharded module's
# parameters again for its backward from hooks on the tensors of that module's output (with reshard_after_forward);
# as a plain dataclass the output would hide them, and a MoE sharded on its own would run its backward on freed
# parameters. (ExpertParallelOutput, its subclass in parallel.py, is registered the same way.)
torch.utils._pytree.register_dataclass(MoEOutput)


_LAYOUT_RECORD_FORMAT = 1  # first entry of the state-dict record of the weight layout (get_extra_state)


class _LossCoefficients:
    """aux_loss_coef and z_loss_coef of a layer (MoE, ExpertParallelMoE), checked whenever they are set: forward
    computes a loss only for a coefficient > 0, so a negative one (or a string) would otherwise be skipped
    silently."""

    def __setstate__(self, state):
        for name in ("aux_loss_coef", "z_loss_coef"):  # modules pickled when these were plain attributes
            if name in state:
                state["_" + name] = state.pop(name)
        super().__setstate__(state)

    @property
    def aux_loss_coef(self) -> float:
        return self._aux_loss_coef

    @aux_loss_coef.setter
    def aux_loss_coef(self, value) -> None:
        self._aux_loss_coef = as_nonnegative_real("aux_loss_coef", value)

    @property
    def z_loss_coef(self) -> float:
        return self._z_loss_coef

    @z_loss_coef.setter
    def z_loss_coef(self, value) -> None:
        self._z_loss_coef = as_nonnegative_real("z_loss_coef", value)


@functools.lru_cache(maxsize=None)
def _constructor_defaults(cls) -> Dict[str, object]:
    """The default of each argument of cls.__init__ that has one: the one definition of the defaults, which the
    modules' reprs compare with."""
    return {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}


def _options_repr(m: nn.Module, cls, always, optional=(), extra=()) -> str:
    """A module's extra_repr, as nn.Linear and nn.Conv2d show theirs (strings quoted): the (name, value) pairs of
    `always`, then each constructor argument of cls named in `optional` whose value on the module is not its default
    in cls's signature, then the (name, value, default) triples of `extra` whose value is not the default. gpt-oss's
    alpha and limit count as defaults for activation 'gptoss_swiglu' (what None gives there). getattr with the
    default: a module pickled before an option existed does not have it."""
    defaults = dict(_constructor_defaults(cls))
    if getattr(m, "activation", None) == "gptoss_swiglu":
        defaults.update(swiglu_alpha=SWIGLU_ALPHA_DEFAULT, swiglu_limit=SWIGLU_LIMIT_DEFAULT)
    candidates = [(name, getattr(m, name, defaults[name]), defaults[name]) for name in optional] + list(extra)
    shown = list(always) + [(name, value) for name, value, default in candidates if value != default]
    return ", ".join(f"{name}={value!r}" for name, value in shown)


# The options of the layer and of its experts that the reprs show where they are not the default.
_ROUTING_OPTIONS = ("score", "routing", "rounding", "tile", "aux_loss_coef", "z_loss_coef")
_EXPERT_OPTIONS = ("weight_layout", "activation_memory", "swiglu_alpha", "swiglu_limit")


class MoE(_LossCoefficients, nn.Module):
    """Token-choice MoE layer with gated (or plain) expert MLPs.

    Parameters are plain nn.Parameters (FSDP2's fully_shard shards them like any other): router_weight (E, d),
    w1 (E, 2n | n, d), w2 (E, d, n), and b1 (E, 2n | n), b2 (E, d) when bias=True.
    forward(x) takes (..., hidden_size) and returns MoEOutput. An input with no tokens ((0, d), (B, 0, d), ...) is
    ordinary: an empty output, zero parameter gradients, and aux_loss / z_loss defined as 0 (not NaN).

    activation="gptoss_swiglu" is gpt-oss's expert MLP (g = min(gate, limit), u = clamp(up, -limit, limit),
    a = g sigmoid(alpha g) (u + 1)) with swiglu_alpha / swiglu_limit (None: gpt-oss's 1.702 and 7.0); they must be
    None for other activations. MoE.from_gpt_oss / load_gpt_oss_experts read HF gpt-oss checkpoints.

    The state dict records the layout of w1 and the activation (entry `_extra_state`, a small int64 tensor), so that
    weights saved by a module of another layout or activation, which have the same shapes, are refused on loading
    rather than silently misread. State dicts saved before this record existed load as before.

    Gradient accumulation into main_grad (``accumulate_into_main_grad=True``, or set the attribute later): Megatron's
    fp32 ``main_grad`` scheme (its ``gradient_accumulation_fusion``). The backward adds the gradient of every parameter
    that requires grad (router_weight, w1, w2, b1, b2) into that parameter's ``main_grad`` attribute instead of
    producing ``.grad``: inside the weight-gradient kernels (the sum in fp32, rounded once to the buffer's dtype), with
    no extra kernel, copy or gradient-sized temporary. ``.grad`` is left as it was (None), so Megatron's DDP hooks,
    which add a non-None ``.grad`` into ``main_grad``, count nothing twice. For the same reason
    ``torch.autograd.grad`` asked for those parameters has no gradient to return and reports them as unused, after
    its backward has already added into ``main_grad``: pass ``allow_unused=True`` (None for them; the gradients are
    in ``main_grad``). A parameter without ``main_grad`` gets one
    on first use (a forward with gradients enabled): zeros of ``main_grad_dtype`` (torch.float32 by default, or the
    parameters' dtype), or call
    ``main_grads()`` to create them ahead of time (needed before torch.compile traces the module, which cannot add
    attributes to parameters). A ``main_grad`` set by the caller (e.g. Megatron's DDP, a view into its contiguous
    gradient buffer) is used as it is: the parameter's shape, its dtype or fp32, contiguous, same device. Zeroing the
    buffers between optimizer steps is the caller's (``main_grad.zero_()``, as Megatron's DDP does). Works with
    torch.compile (the buffers are operands of the traced backward, updated in place), CUDA graphs (no host sync) and
    defer_weight_grads (the expert weights' share is added by ``run()``). Not for FSDP2, which reduces ``.grad``
    itself (its parameters are re-created each step and carry no ``main_grad``).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 activation: str = "swiglu", bias: bool = False, score: str = "softmax_topk",
                 routing: str = "topk", rounding: str = "nearest", tile: int = 128,
                 weight_layout: str = "interleaved", activation_memory: str = "preact",
                 aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, device=None, dtype=None,
                 accumulate_into_main_grad: bool = False, main_grad_dtype: torch.dtype = torch.float32,
                 swiglu_alpha: Optional[float] = None, swiglu_limit: Optional[float] = None):
        super().__init__()
        hidden_size = as_int("hidden_size", hidden_size, low=1)
        intermediate_size = as_int("intermediate_size", intermediate_size, low=1)
        num_experts = as_int("num_experts", num_experts, low=1)
        top_k = as_int("top_k", top_k, low=1, high=num_experts, what="(the number of experts)")
        for table, value, name in ((ACTIVATIONS, activation, "activation"), (SCORES, score, "score"),
                                   (ROUNDINGS, rounding, "rounding"), (WEIGHT_LAYOUTS, weight_layout, "weight_layout"),
                                   (ACTIVATION_MEMORY, activation_memory, "activation_memory")):
            code(table, value, name)
        if routing not in ("topk", "token_rounding"):
            fail("routing", "'topk' or 'token_rounding'", repr(routing))
        alpha_limit = activation_parameters(activation, swiglu_alpha, swiglu_limit)
        # Floats for gptoss_swiglu (read by forward), None for activations without parameters.
        self.swiglu_alpha, self.swiglu_limit = alpha_limit if activation == "gptoss_swiglu" else (None, None)
        if weight_layout == "concatenated" and activation not in GLU_ACTIVATIONS:
            fail("weight_layout", f"'interleaved' for the non-GLU activation {activation!r}", repr(weight_layout))
        tile = tile_option(tile)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.activation, self.score, self.routing, self.rounding, self.tile = activation, score, routing, rounding, tile
        self.weight_layout, self.activation_memory = weight_layout, activation_memory
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        for name, flag in (("bias", bias), ("accumulate_into_main_grad", accumulate_into_main_grad)):
            if not isinstance(flag, bool):  # bias="no" would create biases
                raise TypeError(f"machmoe: argument '{name}': expected a bool, got {type_name(flag)}")
        if not isinstance(main_grad_dtype, torch.dtype) or not main_grad_dtype.is_floating_point:
            raise TypeError(f"machmoe: argument 'main_grad_dtype': expected a floating-point torch.dtype "
                            f"(torch.float32, or the parameters' dtype: checked at the first forward against the "
                            f"parameters' dtype then), got {main_grad_dtype!r}")
        self.accumulate_into_main_grad, self.main_grad_dtype = accumulate_into_main_grad, main_grad_dtype
        if dtype is not None and dtype not in F._META_DTYPES:
            # (one the layer takes on some device: a module is often made in one dtype and device and moved after)
            raise TypeError(f"machmoe: argument 'dtype': expected None or one of {F._META_DTYPES} (bf16, fp16 or fp32 "
                            f"on CUDA; fp32 or fp64 on the CPU), got {dtype!r}")
        rows = 2 * intermediate_size if activation in GLU_ACTIVATIONS else intermediate_size
        kw = dict(device=device, dtype=dtype)
        self.router_weight = nn.Parameter(torch.empty(num_experts, hidden_size, **kw))
        self.w1 = nn.Parameter(torch.empty(num_experts, rows, hidden_size, **kw))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **kw))
        self.b1 = nn.Parameter(torch.empty(num_experts, rows, **kw)) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden_size, **kw)) if bias else None
        self.reset_parameters()

    def extra_repr(self) -> str:
        return _options_repr(
            self, MoE,
            [("hidden_size", self.hidden_size), ("intermediate_size", self.intermediate_size),
             ("num_experts", self.num_experts), ("top_k", self.top_k), ("activation", self.activation),
             ("bias", self.b1 is not None)],
            _ROUTING_OPTIONS + _EXPERT_OPTIONS + ("accumulate_into_main_grad", "main_grad_dtype"))

    def main_grads(self, create: bool = True) -> Dict[str, Tensor]:
        """The ``main_grad`` buffer of every parameter that requires grad, by name ('router_weight', 'w1', 'w2', 'b1',
        'b2'). With ``create``, a parameter without one gets zeros of ``main_grad_dtype`` (on its device, its
        shape) as its ``main_grad``; otherwise it is left out. A ``main_grad_dtype`` that is neither fp32 nor the
        parameter's dtype raises before any buffer is created."""
        trained = [(name, p) for name, p in self.named_parameters(recurse=False) if p.requires_grad]
        missing = [(name, p) for name, p in trained if create and getattr(p, "main_grad", None) is None]
        for name, p in missing:
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    f"machmoe: MoE with accumulate_into_main_grad=True: parameter '{name}' has no main_grad, and "
                    f"one cannot be created while torch.compile traces the module. Create them before compiling "
                    f"(moe.main_grads()) or let the first step run eagerly.")
            if self.main_grad_dtype not in (p.dtype, torch.float32):
                # Checked for every parameter before any buffer is attached: a refused buffer left on a parameter
                # would be "the caller's own" from then on, and setting main_grad_dtype right would not replace it.
                fail(f"{name}.main_grad", F._into_dtypes_text(name, p.dtype),
                     f"{self.main_grad_dtype} (main_grad_dtype; no buffer was created)")
        for name, p in missing:
            # Outside inference mode even when called in it: an inference tensor could not be added into later.
            with torch.inference_mode(False), torch.no_grad():
                p.main_grad = torch.zeros(p.shape, dtype=self.main_grad_dtype, device=p.device)
        return {name: p.main_grad for name, p in trained if getattr(p, "main_grad", None) is not None}

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.router_weight.normal_(0.0, 1.0 / math.sqrt(self.hidden_size))
            self.w1.normal_(0.0, 1.0 / math.sqrt(self.hidden_size))
            self.w2.normal_(0.0, 1.0 / math.sqrt(self.intermediate_size))
            if self.b1 is not None:
                self.b1.zero_()
                self.b2.zero_()

    def forward(self, x: Tensor) -> MoEOutput:
        require_tensor("x", x)
        # The parameters from the module's parameter dict: self.w1 goes through nn.Module.__getattr__, a Python
        # call per name. A name missing there (moved by torch.nn.utils.parametrize, or replaced by a plain
        # attribute) is read as an attribute, as before.
        params = self._parameters
        if len(params) == 5 and "b2" in params:  # (with router_weight, w1, w2, b1: every name the module registers)
            router_weight, w1, w2, b1, b2 = (params["router_weight"], params["w1"], params["w2"], params["b1"],
                                             params["b2"])
        else:
            router_weight, w1, w2, b1, b2 = self.router_weight, self.w1, self.w2, self.b1, self.b2
        shape = x.shape
        if len(shape) == 0 or shape[-1] != self.hidden_size:
            fail("x", f"a tensor of shape (..., {self.hidden_size})", f"shape {tuple(shape)}")
        # Named after x, which the caller passed, rather than after the parameters the functional API compares it to.
        if x.device != w1.device:
            fail("x", f"a tensor on {w1.device} (the device of this MoE's parameters)", f"a tensor on {x.device}")
        # Under torch.autocast, x in autocast's dtype (F._autocast_dtype), and the parameters too, but for float32
        # ones under a bf16/fp16 autocast: those go to the operator as they are, as master weights that it casts for
        # the call and whose gradients it gives in float32 (F._autocast_layer). `params` keeps the parameters
        # themselves, whose main_grad buffers the accumulate-into path uses.
        cast = F._autocast_dtype(x.device)
        if cast is not None:
            x, router_weight, w1, w2, b1, b2 = F._autocast_layer(cast, x, router_weight, w1, w2, b1, b2)
        if x.dtype != w1.dtype and not (cast is not None and F._is_master(w1, x.dtype)):
            hint = ""
            if cast is not None:  # float64 on one side: autocast leaves it as it is
                hint = f"; under torch.autocast the layer computes in {cast}, and float64 tensors are not cast"
            fail("x", f"dtype {w1.dtype} (the dtype of this MoE's parameters{hint})", x.dtype)
        # A (tokens, hidden) input is passed as it is: reshape costs a view and an autograd node each way, a
        # measurable share of the host time of a call (tests/python/test_overhead.py).
        flat = x if len(shape) == 2 else x.reshape(-1, self.hidden_size)
        if flat.stride(-1) != 1 or (flat.stride(0) < self.hidden_size and flat.shape[0] > 1):
            # The operators read rows with unit inner stride, rows that do not overlap. reshape copies some strided
            # inputs and views others, a 2-D one (a transpose) is not reshaped at all, and an expanded (broadcast)
            # input has stride-0 rows: copy here so that every layout of x is accepted, as for the other PyTorch
            # layers. The functional API leaves the copy to its caller. (stride first: no guard on a dynamic T.)
            flat = flat.contiguous()
        attrs = self.__dict__  # (getattr with a default: modules pickled before these options existed)
        into = None
        # Only a call that can take gradients gets the buffers: an evaluation under no_grad or inference_mode creates
        # none (they would be gradient-sized allocations that no backward uses).
        if attrs.get("accumulate_into_main_grad", False) and torch.is_grad_enabled():
            into = self._main_grad_buffers(params)
            if into is None:
                into = F._check_into(self.main_grads(), dict(self.named_parameters(recurse=False)),
                                     "{}.main_grad")
        out, logits, counts = F._moe(flat, router_weight, w1, w2, b1, b2, self.top_k, self.activation, self.score,
                                     self.routing, self.rounding, self.tile, self.weight_layout,
                                     self.activation_memory, None, into, attrs.get("swiglu_alpha"),
                                     attrs.get("swiglu_limit"))
        result = MoEOutput(out if len(shape) == 2 else out.reshape(shape), logits, counts)
        if self.aux_loss_coef > 0:
            result.aux_loss = self.aux_loss_coef * F.load_balancing_loss(logits, counts)
        if self.z_loss_coef > 0:
            result.z_loss = self.z_loss_coef * F.router_z_loss(logits)
        return result

    def _main_grad_buffers(self, params) -> Optional[tuple]:
        """The main_grad buffers in the operator's order, when every parameter that requires grad has one that
        passes F._check_into's checks and the parameters are the module's five distinct ones (None, b1, b2
        included); otherwise None, and forward takes main_grads() and F._check_into, which create missing buffers
        and raise for bad ones with their messages."""
        if len(params) != 5:
            return None
        into = []
        seen = set()
        for name in F._INTO_NAMES:
            p = params.get(name)
            if p is None:
                into.append(None)
                continue
            if id(p) in seen:  # a parameter registered twice: named_parameters() lists it once
                return None
            seen.add(id(p))
            if not p.requires_grad:
                into.append(None)
                continue
            buf = getattr(p, "main_grad", None)
            if not isinstance(buf, Tensor) or buf.device != p.device or \
                    (buf.dtype != p.dtype and buf.dtype != torch.float32) or buf.shape != p.shape or \
                    not buf.is_contiguous() or buf.requires_grad:
                return None
            into.append(buf)
        return tuple(into)

    # ---- state dict: the weight layout and activation travel with the weights ----------------------------------

    def get_extra_state(self) -> Tensor:
        # A tensor rather than a dict, so that tensor-only formats (safetensors) can store the state dict.
        return torch.tensor([_LAYOUT_RECORD_FORMAT, WEIGHT_LAYOUTS[self.weight_layout], ACTIVATIONS[self.activation]],
                            dtype=torch.int64)

    def _layout_mismatch(self, record) -> Optional[str]:
        """Why weights saved with `record` cannot be loaded into this module, or None when they can. A record in
        another real dtype with whole values is the same record: a state dict converted as a whole (e.g.
        {k: v.to(torch.bfloat16)}) carries its small codes exactly."""
        converted = isinstance(record, Tensor) and tuple(record.shape) == (3,) and \
            record.dtype not in (torch.int64, torch.bool) and not record.dtype.is_complex
        if converted and (not record.dtype.is_floating_point or bool((record == record.float().round()).all())):
            record = record.to(torch.int64)
        if not isinstance(record, Tensor) or record.dtype != torch.int64 or tuple(record.shape) != (3,) or \
                int(record[0]) != _LAYOUT_RECORD_FORMAT:
            return (f"expected the weight-layout record of a machmoe.MoE (an int64 tensor [{_LAYOUT_RECORD_FORMAT}, "
                    f"layout, activation]), got {record!r}")
        layout, activation = name_of(WEIGHT_LAYOUTS, int(record[1])), name_of(ACTIVATIONS, int(record[2]))
        if (layout, activation) == (self.weight_layout, self.activation):
            return None
        return (f"the weights were saved by a MoE with weight_layout={layout!r}, activation={activation!r}; this "
                f"module has weight_layout={self.weight_layout!r}, activation={self.activation!r}. The tensors "
                f"have the same shapes but mean different things: build the module with the saved options (or "
                f"convert the w1/b1 rows between layouts before loading).")

    def set_extra_state(self, state) -> None:
        problem = self._layout_mismatch(state)
        if problem is not None:
            raise ValueError(f"machmoe: MoE.set_extra_state: {problem}")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # The module's own load pre-hooks first, as nn.Module runs them (at the start of this method): one may convert
        # the entries (e.g. the w1/b1 rows between layouts, as the mismatch message suggests) before the check.
        hooks = self._load_state_dict_pre_hooks
        for hook in hooks.values():
            hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        key = prefix + "_extra_state"
        if key in state_dict:
            problem = self._layout_mismatch(state_dict[key])
            if problem is not None:  # reported before anything is copied: the module keeps its weights
                error_msgs.append(f"machmoe: state dict entry '{key}': {problem}")
                return
        self._load_state_dict_pre_hooks = OrderedDict()  # they ran above: not twice
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
        finally:
            self._load_state_dict_pre_hooks = hooks
        if key not in state_dict and key in missing_keys:
            missing_keys.remove(key)  # saved before the record existed: load it as before

    # ---- checkpoints in other layouts ---------------------------------------------------------------------------

    @torch.no_grad()
    def load_hf_experts(self, gate_proj: Sequence[Tensor] = None, up_proj: Sequence[Tensor] = None,
                        down_proj: Sequence[Tensor] = None, gate_up_proj: Optional[Tensor] = None,
                        router: Optional[Tensor] = None, *, gate_up_layout: str = "concatenated",
                        transposed: bool = False) -> "MoE":
        """Loads expert weights from the usual checkpoint layouts into this module's layout (interleaved or
        concatenated), without keeping copies. Every tensor is checked before anything is written: its shape, a dtype
        of float16, bfloat16, float32 or float64 (fp8 weights need their scales applied first), data to read (not a
        meta tensor; a DTensor as its full_tensor()); and the module must not be on the meta device (to_empty first).

        Experts: either gate_proj and up_proj, E tensors (n, d) each (a list, or one stacked (E, n, d) tensor), or
        gate_up_proj, one fused (E, 2n, d) tensor whose rows are [gate; up] (gate_up_layout="concatenated": rows
        [0, n) gate, [n, 2n) up, as HF's fused Mixtral/Qwen-MoE experts) or alternate gate, up
        (gate_up_layout="interleaved"). down_proj: E tensors (d, n) (or (E, d, n)). router: (E, d). down_proj and
        router are optional: None keeps the module's w2 or router weight. The biases of a bias=True module (b1, b2)
        are not touched: load_gpt_oss_experts loads gpt-oss's, other checkpoints' are copied into them directly.
        transposed=True: the expert tensors are stored (in, out) for x @ W (gate/up (d, n), fused (E, d, 2n) with the
        gate/up order along the last dimension, down (n, d)), as gpt-oss ("interleaved") and Llama 4
        ("concatenated") store them. The layout is never guessed from the shapes (they agree when d == 2n).
        """
        n, d, E = self.intermediate_size, self.hidden_size, self.num_experts
        if self.activation not in GLU_ACTIVATIONS:
            raise ValueError(f"machmoe: load_hf_experts: expected a MoE with a gated activation "
                             f"({sorted(GLU_ACTIVATIONS)}), got activation={self.activation!r}")
        if gate_up_layout not in WEIGHT_LAYOUTS:
            fail("gate_up_layout", f"one of {sorted(WEIGHT_LAYOUTS)}", repr(gate_up_layout))
        if not isinstance(transposed, bool):
            raise TypeError(f"machmoe: argument 'transposed': expected a bool, got {transposed!r}")
        def linear(out_features, in_features):  # the stored shape of one expert's (out, in) weight
            return (in_features, out_features) if transposed else (out_features, in_features)

        if gate_up_proj is not None:
            if gate_proj is not None or up_proj is not None:
                raise ValueError("machmoe: load_hf_experts: expected either gate_up_proj or gate_proj and up_proj, "
                                 "got both")
            _check_weight("gate_up_proj", gate_up_proj, (E, *linear(2 * n, d)))
            fused = gate_up_proj.transpose(1, 2) if transposed else gate_up_proj  # (E, 2n, d)
            if gate_up_layout == "concatenated":
                gate, up = fused[:, :n], fused[:, n:]
            else:
                gate, up = fused[:, 0::2], fused[:, 1::2]
        else:
            if gate_proj is None or up_proj is None:
                given = "only gate_proj" if gate_proj is not None else "only up_proj" if up_proj is not None else \
                    "none of them"
                raise ValueError(f"machmoe: load_hf_experts: expected gate_proj and up_proj ({E} weights each) or "
                                 f"gate_up_proj, got {given}")
            gate = _stack_experts("gate_proj", gate_proj, E, linear(n, d), transposed)
            up = _stack_experts("up_proj", up_proj, E, linear(n, d), transposed)
        down = _stack_experts("down_proj", down_proj, E, linear(d, n), transposed) if down_proj is not None else None
        if router is not None:
            _check_weight("router", router, (E, d))
        self._check_writable(["w1"] + (["w2"] if down is not None else []) + (["router_weight"] if router is not None
                                                                                 else []))
        # Everything checked: now write.
        def write_w1(w1):
            if self.weight_layout == "interleaved":
                w1.view(E, n, 2, d)[:, :, 0].copy_(gate)
                w1.view(E, n, 2, d)[:, :, 1].copy_(up)
            else:
                w1[:, :n].copy_(gate)
                w1[:, n:].copy_(up)
        self._write_parameter("w1", write_w1)
        if down is not None:
            self._write_parameter("w2", lambda w2: w2.copy_(down))
        if router is not None:
            self._write_parameter("router_weight", lambda rw: rw.copy_(router))
        return self

    def _check_writable(self, names) -> None:
        """Raises, before anything is written, for a weight among `names` that a load cannot fill: one on the meta
        device (copy_ into it does nothing), or a parametrized one that cannot be assigned (a parametrization without
        right_inverse). A load must not stop half way, nor do nothing silently."""
        for name in names:
            if getattr(self, name).is_meta:
                raise ValueError(f"machmoe: cannot load '{name}': the module is on the meta device, where a copy "
                                 f"stores nothing (call to_empty(device=...) first, then load)")
            if nn.utils.parametrize.is_parametrized(self, name):
                missing = [type(p).__name__ for p in self.parametrizations[name] if not hasattr(p, "right_inverse")]
                if missing:
                    raise ValueError(f"machmoe: cannot load '{name}': it is parametrized by {', '.join(missing)} "
                                     f"without right_inverse, so a loaded value cannot be assigned to it (load the "
                                     f"weights before registering the parametrization)")

    def _write_parameter(self, name: str, write) -> None:
        """write(t) fills parameter `name` in place. A parametrized one (torch.nn.utils.parametrize) reads as a
        tensor computed from its original, so writing into that would change nothing: it is filled as a copy and
        assigned, which goes through the parametrization's right_inverse (and raises if it has none)."""
        if nn.utils.parametrize.is_parametrized(self, name):
            value = getattr(self, name).detach().clone()
            write(value)
            setattr(self, name, value)
        else:
            write(getattr(self, name))


    # ---- gpt-oss (HF transformers GptOssExperts / GptOssTopKRouter) -----------------------------------------------

    @classmethod
    def from_gpt_oss(cls, gate_up_proj: Tensor, gate_up_proj_bias: Tensor, down_proj: Tensor,
                     down_proj_bias: Tensor, router_weight: Tensor, *, top_k: int, router_bias: Optional[Tensor],
                     swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, device=None, dtype=None,
                     **options) -> "MoE":
        """A MoE computing gpt-oss's MoE block from its HF tensors (shapes as in ``load_gpt_oss_experts``): sizes
        from the tensors, activation="gptoss_swiglu" with the given alpha and limit (gpt-oss: 1.702 and
        config.swiglu_limit = 7.0), bias=True, score="softmax_topk" (HF GptOssTopKRouter: top-k of the logits, then a
        softmax over the k selected), top_k = config.num_experts_per_tok. device/dtype default to gate_up_proj's.
        Other keyword arguments go to MoE() (weight_layout, activation_memory, aux_loss_coef, ...).

        router_bias is required (keyword): HF's GptOssTopKRouter always has a bias (router.bias, (E,)), and
        machmoe's router has none (logits = x router_weight^T), so a default of None would drop it silently. Pass
        router.bias: all zeros is accepted, anything else raises (route outside and call machmoe.moe_from_routing,
        as load_gpt_oss_experts says); pass None only for a router that has no bias."""
        require_tensor("gate_up_proj", gate_up_proj)
        require_tensor("down_proj", down_proj)
        require_tensor("router_weight", router_weight)  # None would leave the new module's router random
        require_tensor("router_bias", router_bias, optional=True)
        if gate_up_proj.dim() != 3 or gate_up_proj.shape[2] % 2:
            fail("gate_up_proj", "an (experts, hidden, 2 * intermediate) tensor", f"shape {tuple(gate_up_proj.shape)}")
        E, d, two_n = gate_up_proj.shape
        for name in ("activation", "bias", "score"):
            if name in options:
                raise TypeError(f"machmoe: MoE.from_gpt_oss: argument '{name}' is fixed by gpt-oss and cannot be "
                                f"given")
        moe = cls(d, two_n // 2, E, top_k, activation="gptoss_swiglu", bias=True, score="softmax_topk",
                  swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                  device=gate_up_proj.device if device is None else device,
                  dtype=gate_up_proj.dtype if dtype is None else dtype, **options)
        return moe.load_gpt_oss_experts(gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias,
                                        router_weight=router_weight, router_bias=router_bias)

    @torch.no_grad()
    def load_gpt_oss_experts(self, gate_up_proj: Tensor, gate_up_proj_bias: Optional[Tensor], down_proj: Tensor,
                             down_proj_bias: Optional[Tensor], *, router_weight: Optional[Tensor] = None,
                             router_bias: Optional[Tensor] = None) -> "MoE":
        """Copies HF gpt-oss expert tensors into this module (activation "gptoss_swiglu"), in either weight layout.

        HF stores the experts for x @ W: gate_up_proj (E, d, 2n) with gate = columns 0::2 and up = columns 1::2,
        gate_up_proj_bias (E, 2n) in the same column order, down_proj (E, n, d), down_proj_bias (E, d); the router
        (GptOssTopKRouter) is router.weight (E, d) and router.bias (E,). The mapping (a one-time copy):
          w1[e] = gate_up_proj[e].T          (2n, d): row 2j gate_j, row 2j+1 up_j (weight_layout="interleaved";
                                              "concatenated" takes the gate columns into rows [0, n), up into [n, 2n))
          b1[e] = gate_up_proj_bias[e]       (same row order as w1)
          w2[e] = down_proj[e].T             (d, n)
          b2[e] = down_proj_bias[e]
          router_weight = router.weight      (E, d)
        gate_up_proj and down_proj are required. Biases: given exactly when the module has them (bias=True).
        router_weight: None keeps this module's router. router_bias: this module's router has no bias
        (logits = x router_weight^T); a router bias is accepted only if it is all zeros, and anything else raises
        (gpt-oss's trained routers have a nonzero bias: compute the routing outside and use
        machmoe.moe_from_routing for those). Every tensor is checked before anything is written."""
        E, d, n = self.num_experts, self.hidden_size, self.intermediate_size
        if self.activation != "gptoss_swiglu":
            raise ValueError(f"machmoe: load_gpt_oss_experts: expected a MoE with activation='gptoss_swiglu' (gpt-oss's "
                             f"clamped SwiGLU with (up + 1)), got activation={self.activation!r}")
        # Named here: load_hf_experts would take a None down_proj as "keep w2" and a None gate_up_proj as a call
        # with gate_proj and up_proj, neither of which this loader has.
        require_tensor("gate_up_proj", gate_up_proj)
        require_tensor("down_proj", down_proj)
        has_bias = self.b1 is not None
        for name, t in (("gate_up_proj_bias", gate_up_proj_bias), ("down_proj_bias", down_proj_bias)):
            if (t is not None) != has_bias:
                raise ValueError(f"machmoe: load_gpt_oss_experts: argument '{name}': expected "
                                 f"{'a tensor (this MoE has biases)' if has_bias else 'None (this MoE was built with bias=False; gpt-oss has expert biases: build it with bias=True)'}, "
                                 f"got {'None' if t is None else 'a tensor'}")
        if has_bias:
            _check_weight("gate_up_proj_bias", gate_up_proj_bias, (E, 2 * n))
            _check_weight("down_proj_bias", down_proj_bias, (E, d))
        if router_weight is not None:  # (load_hf_experts would name it 'router', its own argument)
            _check_weight("router_weight", router_weight, (E, d))
        if router_bias is not None:
            _check_weight("router_bias", router_bias, (E,))
            if bool(router_bias.ne(0).any()):
                fail("router_bias", "None or zeros: machmoe's router has no bias (logits = x router_weight^T); for "
                     "gpt-oss's biased router compute the top-k routing outside and call machmoe.moe_from_routing",
                     "a tensor with nonzero entries")
        self._check_writable(["b1", "b2"] if has_bias else [])
        # Checks the expert weights and the router, then writes them (interleaved gate/up columns, stored (in, out)).
        self.load_hf_experts(down_proj=down_proj, gate_up_proj=gate_up_proj, router=router_weight,
                             gate_up_layout="interleaved", transposed=True)
        if has_bias:
            def write_b1(b1):
                if self.weight_layout == "interleaved":
                    b1.copy_(gate_up_proj_bias)
                else:
                    b1[:, :n].copy_(gate_up_proj_bias[:, 0::2])
                    b1[:, n:].copy_(gate_up_proj_bias[:, 1::2])
            self._write_parameter("b1", write_b1)
            self._write_parameter("b2", lambda b2: b2.copy_(down_proj_bias))
        return self


_LOADABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_weight(name: str, t, shape) -> None:
    """An exact shape (copy_ would broadcast a smaller tensor into every row), a dtype whose values are the weights'
    (not fp8, whose checkpoints carry a separate scale), and data a copy can read: checked for every source before
    the first write, so that a refused load leaves the module as it was."""
    require_tensor(name, t)
    if tuple(t.shape) != tuple(shape):
        fail(name, f"shape {tuple(shape)}", f"shape {tuple(t.shape)}")
    if t.dtype not in _LOADABLE_DTYPES:
        fail(name, "a float16, bfloat16, float32 or float64 tensor" + (
            " (dequantize fp8 weights first: their checkpoints keep a separate scale, e.g. weight_scale_inv)"
            if t.is_floating_point() else ""), t.dtype)
    if t.is_meta:
        fail(name, "a tensor with data (not on the meta device: load or materialise the checkpoint first)",
             "a meta tensor")
    if hasattr(t, "full_tensor"):  # a DTensor (a sharded or tensor-parallel model)
        fail(name, "a plain torch.Tensor (for a DTensor, pass t.full_tensor(), on every rank)", "a DTensor")


def _stack_experts(name: str, weights, E: int, shape, transposed: bool) -> Tensor:
    """E per-expert tensors of `shape` (a list/tuple, or one stacked tensor) as one (E, out, in) view or stack."""
    if isinstance(weights, Tensor):
        _check_weight(name, weights, (E, *shape))
        stacked = weights
    else:
        if not isinstance(weights, (list, tuple)):
            raise TypeError(f"machmoe: argument '{name}': expected a list or tuple of {E} tensors or a stacked tensor, "
                            f"got {type_name(weights)}")
        if len(weights) != E:
            fail(name, f"{E} weights (one per expert)", len(weights))
        for e, w in enumerate(weights):
            _check_weight(f"{name}[{e}]", w, shape)
        stacked = torch.stack(list(weights))
    return stacked.transpose(1, 2) if transposed else stacked
