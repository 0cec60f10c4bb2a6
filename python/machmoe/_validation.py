"""Argument checks shared by the functional API and machmoe.MoE.

Every message has the form "machmoe: argument 'NAME': expected WHAT, got VALUE". The checks here raise TypeError for
a wrong kind of object and ValueError for a right kind with a wrong value (shape, dtype, range...); the option
checks (a string option given a non-string, _options.py) and the expert-parallel helpers (parallel.py) raise
ValueError for both.
"""
import math
import numbers
import operator
import os
import sys

import torch
from torch import Tensor

# Frames from these folders are not the caller's: machmoe's own and torch.nn's (Module.__call__ on the way to forward).
_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
                 os.path.dirname(os.path.abspath(torch.nn.modules.module.__file__)) + os.sep)


def caller_stacklevel() -> int:
    """warnings.warn's stacklevel for a warning issued by the function that calls this one, so that it points at the
    first frame outside machmoe and torch.nn: the user's line that called machmoe.moe(), MoE(...) or a layer of
    machmoe.parallel, however deep inside the package the warning is raised."""
    frame, level = sys._getframe(1), 1  # level 1: the function that calls warnings.warn
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def type_name(value) -> str:
    """'numpy.ndarray', 'list', 'float': enough to tell the caller what they passed."""
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def fail(name: str, expected: str, got) -> None:
    raise ValueError(f"machmoe: argument '{name}': expected {expected}, got {got}")


def require_tensor(name: str, value, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, Tensor):
        what = "a torch.Tensor or None" if optional else "a torch.Tensor"
        raise TypeError(f"machmoe: argument '{name}': expected {what}, got {type_name(value)}")


def as_int(name: str, value, *, low: int = None, high: int = None, what: str = "") -> int:
    """An integer argument: Python ints, numpy integers and 0-d CPU integer tensors (what operator.index accepts)
    are converted to int; bools, floats and other objects are rejected, as are values outside [low, high]."""
    # operator.index accepts True and bool tensors (numpy refuses its bools): a flag is not a count.
    is_bool = isinstance(value, bool) or (isinstance(value, Tensor) and value.dtype == torch.bool)
    if isinstance(value, Tensor) and value.dim() != 0:
        raise TypeError(f"machmoe: argument '{name}': expected an integer (a 0-d tensor at most), "
                        f"got a tensor of shape {tuple(value.shape)}")
    if isinstance(value, Tensor) and value.device.type != "cpu":
        # Its value would be read back to the host: a synchronisation with the device inside the call.
        raise TypeError(f"machmoe: argument '{name}': expected an integer (a Python int, or a 0-d CPU tensor: a "
                        f"tensor on {value.device} would have to be read back to the host), got a tensor on "
                        f"{value.device}")
    try:
        if is_bool:
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"machmoe: argument '{name}': expected an integer, got {value!r} ({type_name(value)})") \
            from None
    if (low is not None and number < low) or (high is not None and number > high):
        if high is None:
            expected = f"an integer >= {low}"
        elif low is None:
            expected = f"an integer <= {high}"
        else:
            expected = f"an integer in [{low}, {high}]"
        fail(name, expected + (f" {what}" if what else ""), number)
    return number


def as_nonnegative_real(name: str, value) -> float:
    """A finite real >= 0 (a loss coefficient): Python/numpy reals, not bools, strings or tensors."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"machmoe: argument '{name}': expected a real number >= 0, got {value!r} "
                        f"({type_name(value)})")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        fail(name, "a finite real number >= 0 (0 turns the loss off)", value)
    return number
