"""Names of the layer's options and their integer codes (the enum values of include/machmoe/problem.hpp)."""

import math
import numbers

from ._validation import as_int, fail

ACTIVATIONS = {"swiglu": 0, "geglu": 1, "reglu": 2, "relu_squared": 3, "relu": 4, "gelu": 5, "silu": 6,
               "gptoss_swiglu": 7}
GLU_ACTIVATIONS = {"swiglu", "geglu", "reglu", "gptoss_swiglu"}
# gpt-oss's expert MLP (HF GptOssExperts): g = min(gate, limit), u = clamp(up, -limit, limit),
# a = g sigmoid(alpha g) (u + 1). Its two parameters and gpt-oss's values for them (machmoe::kGptOssSwiGLU*).
SWIGLU_ALPHA_DEFAULT = 1.702
SWIGLU_LIMIT_DEFAULT = 7.0
WEIGHT_LAYOUTS = {"interleaved": 0, "concatenated": 1}
SCORES = {"softmax_topk": 0, "topk_softmax": 1, "topk_softmax_renorm": 2}
ROUTINGS = {"topk": 0, "token_rounding": 1, "caller": 2}
ROUNDINGS = {"nearest": 0, "up": 1, "down": 2}
ACTIVATION_MEMORY = {"preact": 0, "input_only": 1}
# The largest token-rounding tile, machmoe::Limits::kMaxTileM (include/machmoe/problem.hpp): the operators refuse a
# larger one, so a module built with it would fail in every forward rather than at construction.
MAX_TILE = 4096


def code(table: dict, name: str, argument: str) -> int:
    if not isinstance(name, str) or name not in table:  # (an unhashable value would fail the lookup itself)
        raise ValueError(f"machmoe: argument '{argument}': expected one of {sorted(table)}, got {name!r}")
    return table[name]


def tile_option(tile) -> int:
    """The token-rounding tile as an int: a multiple of 8 in [8, MAX_TILE], whatever the routing (as the operators
    check it)."""
    tile = as_int("tile", tile)
    if not 8 <= tile <= MAX_TILE or tile % 8:
        fail("tile", f"a multiple of 8 in [8, {MAX_TILE}]", tile)
    return tile


def name_of(table: dict, value: int) -> str:
    """The option name of an integer code (for messages)."""
    return next((name for name, c in table.items() if c == value), f"<unknown code {value}>")


_FLOAT32_MAX, _FLOAT32_MIN = 3.4028234663852886e38, 1.1754943508222875e-38  # largest finite, smallest normal


def activation_parameters(activation: str, swiglu_alpha, swiglu_limit):
    """(alpha, limit) as floats for the operators. They are parameters of 'gptoss_swiglu' only: None there means
    gpt-oss's default; with another activation they must be None (a limit given with activation='swiglu' would
    otherwise be silently ignored). alpha: a finite real; limit: a real > 0 (float('inf') turns the clamps off);
    both in fp32's range."""
    if activation != "gptoss_swiglu":
        for name, value in (("swiglu_alpha", swiglu_alpha), ("swiglu_limit", swiglu_limit)):
            if value is not None:
                raise ValueError(f"machmoe: argument '{name}': expected None for activation {activation!r} "
                                 f"(swiglu_alpha and swiglu_limit are parameters of activation 'gptoss_swiglu' "
                                 f"only), got {value!r}")
        return SWIGLU_ALPHA_DEFAULT, SWIGLU_LIMIT_DEFAULT
    values = []
    for name, value, default in (("swiglu_alpha", swiglu_alpha, SWIGLU_ALPHA_DEFAULT),
                                 ("swiglu_limit", swiglu_limit, SWIGLU_LIMIT_DEFAULT)):
        if value is None:
            values.append(default)
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"machmoe: argument '{name}': expected a real number or None, got {value!r} "
                            f"({type(value).__name__})")
        values.append(float(value))
    alpha, limit = values
    # The kernels compute with them as fp32 values: beyond its range alpha would become inf (NaN outputs) and a
    # limit below its smallest normal 0 or a denormal (the operator refuses them too).
    if not abs(alpha) <= _FLOAT32_MAX:  # NaN and inf fail too
        raise ValueError(f"machmoe: argument 'swiglu_alpha': expected a finite real number of at most "
                         f"{_FLOAT32_MAX:.8g} in magnitude (an fp32 value), got {swiglu_alpha!r}")
    if not (limit == math.inf or _FLOAT32_MIN <= limit <= _FLOAT32_MAX):  # NaN fails too
        raise ValueError(f"machmoe: argument 'swiglu_limit': expected a real number > 0 that fp32 holds, in "
                         f"[{_FLOAT32_MIN:.8g}, {_FLOAT32_MAX:.8g}] (float('inf'): no clamping), got {swiglu_limit!r}")
    return alpha, limit
