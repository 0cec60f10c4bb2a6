"""machmoe.set_sm_margin / sm_margin / sm_margin_scope (docs/ARCHITECTURE.md, "The SM margin"): the setting and its
checks on the CPU, MACHMOE_SM_MARGIN at start-up (subprocesses), and (marked gpu) what the GPU does with it: the
expert GEMMs' persistent grids cut to the usable SMs (read from torch.profiler's kernel records), results bitwise
those of the whole device through the module's forward and backward, a margin that leaves no cluster refused."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import machmoe


@pytest.fixture
def restore_margin():
    before = machmoe.sm_margin()
    yield
    machmoe.set_sm_margin(before)


def test_set_and_read_the_margin(restore_margin):
    machmoe.set_sm_margin(16)
    assert machmoe.sm_margin() == 16
    assert torch.ops.machmoe.sm_margin() == 16
    machmoe.set_sm_margin(0)
    assert machmoe.sm_margin() == 0


@pytest.mark.parametrize("bad, error, match", [
    (-1, ValueError, "'sms'.*>= 0, got -1"),
    (True, TypeError, "'sms'.*an int, got bool"),
    (8.0, TypeError, "'sms'.*an int, got float"),
    ("8", TypeError, "'sms'.*an int, got str"),
])
def test_bad_margins_are_refused_and_change_nothing(restore_margin, bad, error, match):
    machmoe.set_sm_margin(5)
    with pytest.raises(error, match=match):
        machmoe.set_sm_margin(bad)
    assert machmoe.sm_margin() == 5


def test_the_operator_checks_the_range_before_narrowing(restore_margin):
    machmoe.set_sm_margin(3)
    # 2^32 + 7 would wrap to a valid int margin of 7 if it were narrowed first.
    for bad in (-2, 2 ** 32 + 7, 2 ** 40):
        with pytest.raises(ValueError, match=r"set_sm_margin.*'sms'.*\[0, 2147483647\]"):
            torch.ops.machmoe.set_sm_margin(bad)
    assert machmoe.sm_margin() == 3


def test_the_scope_restores_the_margin_before_it_even_when_the_block_raises(restore_margin):
    machmoe.set_sm_margin(4)
    with machmoe.sm_margin_scope(20):
        assert machmoe.sm_margin() == 20
        with machmoe.sm_margin_scope(0):
            assert machmoe.sm_margin() == 0
        assert machmoe.sm_margin() == 20
    assert machmoe.sm_margin() == 4
    with pytest.raises(RuntimeError, match="inside"):
        with machmoe.sm_margin_scope(9):
            raise RuntimeError("inside")
    assert machmoe.sm_margin() == 4
    with pytest.raises(ValueError, match=">= 0"):
        with machmoe.sm_margin_scope(-1):
            pass
    assert machmoe.sm_margin() == 4


def test_a_cpu_layer_ignores_the_margin(restore_margin):
    torch.manual_seed(0)
    moe = machmoe.MoE(32, 16, 4, 2, dtype=torch.float64)
    x = torch.randn(10, 32, dtype=torch.float64)
    expected = moe(x).output
    machmoe.set_sm_margin(1000)  # more than any GPU has: refused on a GPU, ignored on the CPU
    torch.testing.assert_close(moe(x).output, expected, rtol=0, atol=0)


ROOT = Path(__file__).resolve().parents[2]


def _margin_at_start_up(value):
    env = dict(os.environ, MACHMOE_SM_MARGIN=value)
    if env.get("MACHMOE_IN_TREE") == "1":  # the child imports this checkout's package, as conftest.py does
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python")] + [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, "-c", "import machmoe; print(machmoe.sm_margin())"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip().splitlines()[-1]), r.stderr


def test_the_environment_sets_the_margin_at_start_up():
    assert _margin_at_start_up("24") == (24, "")
    assert _margin_at_start_up("")[0] == 0
    for bad in ("-3", "abc", "12x", "99999999999"):
        margin, err = _margin_at_start_up(bad)
        assert margin == 0, bad
        assert f"MACHMOE_SM_MARGIN={bad} is not a non-negative integer; using 0" in err, err


# ---- GPU ---------------------------------------------------------------------------------------------------------

def _persistent_grids(run):
    """(kernel name, CTAs) of each launch of the Hopper family's persistent kernels that `run` made, in launch order,
    from torch.profiler."""
    import tempfile
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and "persistent_kernel" in e.get("name", "")),
                     key=lambda e: e["ts"])
    return [(e["name"], e["args"]["grid"][0] * e["args"]["grid"][1] * e["args"]["grid"][2]) for e in kernels]


def _step(moe, x, grad):
    x = x.detach().requires_grad_()
    for p in moe.parameters():
        p.grad = None
    out = moe(x).output
    out.backward(grad)
    return [out.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in moe.parameters()]


def _layer(seed=1):
    torch.manual_seed(seed)
    # 7B-like widths at a small T: every expert GEMM family (up, down, dH, dX~, dW1, dW2) on the Hopper kernels.
    moe = machmoe.MoE(1536, 256, 32, 4, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4096, 1536, device="cuda", dtype=torch.bfloat16)
    return moe, x, torch.randn_like(x)


@pytest.mark.gpu
def test_the_persistent_grids_leave_the_margin_free_and_the_results_stay_bitwise(restore_margin):
    assert torch.cuda.is_available(), "GPU test run on a machine without a usable CUDA device"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    moe, x, grad = _layer()
    machmoe.set_sm_margin(0)
    whole = _step(moe, x, grad)
    full = _persistent_grids(lambda: _step(moe, x, grad))
    assert len(full) >= 6, full  # up, down, dH, dX~, dW2, dW1
    assert max(g for _, g in full) == sms, full
    for margin in (1, 20, sms - 40):
        machmoe.set_sm_margin(margin)
        fewer = _step(moe, x, grad)
        for a, b in zip(fewer, whole):
            assert torch.equal(a, b), f"margin {margin}: results differ from the whole device's"
        cut = _persistent_grids(lambda: _step(moe, x, grad))
        assert [name for name, _ in cut] == [name for name, _ in full], margin
        # Each launch: its whole-device grid cut to the usable SMs, whole clusters of two at most one SM short.
        for (name, g), (_, g0) in zip(cut, full):
            assert min(g0, sms - margin - 1) <= g <= min(g0, sms - margin), (margin, name, g, g0)


@pytest.mark.gpu
def test_a_first_launch_under_a_margin_leaves_the_whole_grid_to_later_calls_without_one():
    # The resident clusters are cached per device at a kernel's first launch; they must count the whole device even
    # when that launch ran under a margin (a fresh process, so that every kernel's first launch does).
    assert torch.cuda.is_available(), "GPU test run on a machine without a usable CUDA device"
    code = """
import machmoe, torch, sys
sys.path.insert(0, {tests!r})
from test_sm_margin import _layer, _persistent_grids, _step
sms = torch.cuda.get_device_properties(0).multi_processor_count
moe, x, grad = _layer()
first = _persistent_grids(lambda: _step(moe, x, grad))
assert machmoe.sm_margin() == 20 and max(g for _, g in first) == sms - 20, first
machmoe.set_sm_margin(0)
later = _persistent_grids(lambda: _step(moe, x, grad))
assert max(g for _, g in later) == sms, later
print("ok")
""".format(tests=str(Path(__file__).resolve().parent))
    env = dict(os.environ, MACHMOE_SM_MARGIN="20")
    if env.get("MACHMOE_IN_TREE") == "1":
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python")] + [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


@pytest.mark.gpu
def test_a_backward_under_a_margin_that_leaves_no_cluster_is_refused_and_writes_nothing(restore_margin):
    assert torch.cuda.is_available(), "GPU test run on a machine without a usable CUDA device"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    moe, x, grad = _layer()
    machmoe.set_sm_margin(0)
    x = x.detach().requires_grad_()
    out = moe(x).output
    machmoe.set_sm_margin(sms - 1)
    with pytest.raises(ValueError, match=rf"backward.*SM margin.*at most {sms - 2}"):
        out.backward(grad)
    assert x.grad is None and all(p.grad is None for p in moe.parameters())
    machmoe.set_sm_margin(sms - 2)
    moe(x).output.backward(grad)
    torch.cuda.synchronize()
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()


@pytest.mark.gpu
def test_a_margin_that_leaves_no_cluster_is_refused_on_the_gpu(restore_margin):
    assert torch.cuda.is_available(), "GPU test run on a machine without a usable CUDA device"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    moe = machmoe.MoE(64, 64, 4, 2, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    machmoe.set_sm_margin(sms - 1)
    with pytest.raises(ValueError, match=rf"SM margin.*at most {sms - 2}.*{sms} SMs.*got {sms - 1}"):
        moe(x)
    machmoe.set_sm_margin(sms - 2)
    moe(x)
    torch.cuda.synchronize()


def test_the_overlap_benchmark_checks_its_arguments_and_needs_a_gpu(capsys):
    from machmoe.benchmark import overlap
    for bad in (["--margins", "-1"], ["--margins", "8,x"], ["--side-chunks", "0"]):
        with pytest.raises(SystemExit):
            overlap.main(bad)
    assert overlap.main(["--configs", "no-such-config"]) == 2
    assert "unknown configuration 'no-such-config'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert overlap.main(["--configs", "7B-256"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_the_overlap_benchmark_runs(tmp_path, restore_margin):
    assert torch.cuda.is_available(), "GPU test run on a machine without a usable CUDA device"
    from machmoe.benchmark import overlap
    machmoe.set_sm_margin(3)
    path = tmp_path / "overlap.json"
    assert overlap.main(["--configs", "7B-256", "--margins", "0,16", "--side-mb", "64", "--time-ms", "20",
                         "--warmup-ms", "20", "--json", str(path)]) == 0
    assert machmoe.sm_margin() == 3  # put back
    rows = json.loads(path.read_text())["rows"]
    assert [r["sm_margin"] for r in rows] == [0, 16]
    for r in rows:
        assert r["config"] == "7B-256"
        # (both is each call's later end, side done its side's: median for median, never below it)
        assert 0 < r["side_ms"] and 0 < r["layer_ms"] and 0 < r["side_done_ms"] <= r["both_ms"]
        assert r["overlap_ratio"] == pytest.approx(r["both_ms"] / (r["layer_ms"] + r["side_ms"]))
