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
    config.addinivalue_line("markers", "multigpu: needs 2 or more CUDA GPUs (also marked gpu); fails (does not skip) "
                            "with fewer. Single-GPU runs deselect it (-m 'gpu and not multigpu'); on 2 GPUs run "
                            "-m 'multigpu and not gpus4 and not gpus8', on 4 -m 'multigpu and not gpus8', on 8 "
                            "-m multigpu")
    config.addinivalue_line("markers", "gpus4: needs 4 CUDA GPUs (also marked multigpu)")
    config.addinivalue_line("markers", "gpus8: needs 8 CUDA GPUs (also marked multigpu)")


@pytest.hookimpl(trylast=True)  # after -m has deselected, so that the shards share the selected tests
def pytest_collection_modifyitems(config, items):
    """MACHMOE_PYTEST_SHARD="i/n": run only shard i of n (sharding.py), e.g. the GPU tests in three processes side by
    side on one GPU (scripts/ab.sh pyg)."""
    spec = os.environ.get("MACHMOE_PYTEST_SHARD")
    if not spec:
        return
    from sharding import parse_shard, split

    try:
        index, total = parse_shard(spec)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    kept, dropped = split(items, index, total)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture
def cuda():
    """The CUDA device; a GPU test asked to run without one fails."""
    if not torch.cuda.is_available():
        pytest.fail("GPU test run on a machine without a CUDA device")
    return torch.device("cuda")
