import os
import sys
from pathlib import Path

import pytest
import torch

# MACHMOE_IN_TREE=1 tests the sources of this checkout (with MACHMOE_TORCH_LIBRARY or build/lib); otherwise the
# installed package (scripts/test.sh installs it first).
if os.environ.get("MACHMOE_IN_TREE") == "1":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; fails (does not skip) without one")
    config.addinivalue_line("markers", "multigpu: needs 2 CUDA GPUs (also marked gpu); fails (does not skip) with "
                            "fewer. Single-GPU runs deselect it (-m 'not multigpu'); run it on the 2-GPU machine "
                            "with -m multigpu")


@pytest.fixture
def cuda():
    """The CUDA device; a GPU test asked to run without one fails."""
    if not torch.cuda.is_available():
        pytest.fail("GPU test run on a machine without a CUDA device")
    return torch.device("cuda")
