"""Names of the layer's options and their integer codes (the enum values of include/machmoe/problem.hpp)."""

ACTIVATIONS = {"swiglu": 0, "geglu": 1, "reglu": 2, "relu_squared": 3, "relu": 4, "gelu": 5, "silu": 6}
GLU_ACTIVATIONS = {"swiglu", "geglu", "reglu"}
WEIGHT_LAYOUTS = {"interleaved": 0, "concatenated": 1}
SCORES = {"softmax_topk": 0, "topk_softmax": 1, "topk_softmax_renorm": 2}
ROUTINGS = {"topk": 0, "token_rounding": 1, "caller": 2}
ROUNDINGS = {"nearest": 0, "up": 1, "down": 2}
ACTIVATION_MEMORY = {"preact": 0, "input_only": 1}


def code(table: dict, name: str, argument: str) -> int:
    if not isinstance(name, str) or name not in table:  # (an unhashable value would fail the lookup itself)
        raise ValueError(f"machmoe: argument '{argument}': expected one of {sorted(table)}, got {name!r}")
    return table[name]


def name_of(table: dict, value: int) -> str:
    """The option name of an integer code (for messages)."""
    return next((name for name, c in table.items() if c == value), f"<unknown code {value}>")
