"""machmoe installs beside upstream SonicMoE: importing it creates no `sonicmoe` module and no `torch.ops.sonicmoe`
operator namespace, and everything it registers lives under `machmoe`."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path


def test_import_creates_no_sonicmoe_names():
    # A fresh interpreter, so that nothing imported by other tests can hide or fake the result.
    code = textwrap.dedent("""
        import sys
        import torch
        before = set(torch.ops._dir)
        import machmoe
        assert machmoe.MoE is not None
        leaked = sorted(m for m in sys.modules if m == "sonicmoe" or m.startswith("sonicmoe."))
        assert not leaked, f"importing machmoe imported {leaked}"
        added = set(torch.ops._dir) - before
        assert "sonicmoe" not in added, "importing machmoe created torch.ops.sonicmoe"
        assert torch.ops.machmoe.layer_forward.default is not None
        ops = [name for name in torch._C._dispatch_get_all_op_names() if name.startswith("sonicmoe::")]
        assert not ops, f"operators registered under sonicmoe: {ops}"
        assert any(name.startswith("machmoe::") for name in torch._C._dispatch_get_all_op_names())
        print("ok")
    """)
    env = dict(os.environ)
    if env.get("MACHMOE_IN_TREE") == "1":  # the checkout's sources, as conftest.py arranges for this process
        tree = str(Path(__file__).resolve().parents[2] / "python")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("ok")
