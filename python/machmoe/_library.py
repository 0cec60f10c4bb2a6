"""Finds and loads libmachmoe_torch (the TORCH_LIBRARY operators)."""
import os
from pathlib import Path

import torch

_NAME = "libmachmoe_torch.so"


def _candidates():
    env = os.environ.get("MACHMOE_TORCH_LIBRARY")
    if env:
        yield Path(env)
    here = Path(__file__).resolve().parent
    yield here / "_lib" / _NAME  # installed by `pip install .`
    yield here.parents[1] / "build" / "lib" / _NAME  # a source checkout built with scripts/build.sh


def load_library() -> Path:
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.is_file():
            torch.ops.load_library(str(path))
            return path
    raise ImportError(
        "machmoe: the operator library was not found; install the package (pip install --no-build-isolation .) "
        "or build it (MACHMOE_BUILD_TORCH=ON) and set MACHMOE_TORCH_LIBRARY. Looked in: " + ", ".join(tried)
    )
