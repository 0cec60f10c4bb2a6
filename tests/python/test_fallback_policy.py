"""machmoe.set_fallback_policy / fallback_policy (docs/ARCHITECTURE.md, "What takes the fast path"): the switch on the
CPU, and (marked gpu) a layer whose hidden size breaks 16-byte rows raising under "error" and running under "warn",
and a gpt-oss-like odd shape (multiples of 8) running on the Hopper kernels under "error"."""
import pytest
import torch

import machmoe


def test_fallback_policy_switch():
    before = machmoe.fallback_policy()
    try:
        machmoe.set_fallback_policy("error")
        assert machmoe.fallback_policy() == "error"
        machmoe.set_fallback_policy("warn")
        assert machmoe.fallback_policy() == "warn"
        with pytest.raises(ValueError, match="'policy'.*'warn' or 'error'"):
            machmoe.set_fallback_policy("loud")
        with pytest.raises(ValueError, match="'warn' or 'error'"):
            torch.ops.machmoe.set_fallback_policy("loud")
        assert machmoe.fallback_policy() == "warn"
    finally:
        machmoe.set_fallback_policy(before)


@pytest.mark.gpu
def test_error_policy_on_the_gpu():
    assert torch.cuda.is_available(), "GPU test run on a machine without a usable CUDA device"
    before = machmoe.fallback_policy()
    try:
        machmoe.set_fallback_policy("error")
        # d = n = 200: multiples of 8 (edge tiles): every GEMM on the Hopper kernels, no error.
        moe = machmoe.MoE(200, 200, 8, 2, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(64, 200, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        moe(x).output.float().square().mean().backward()
        torch.cuda.synchronize()
        # d = 100: rows of 200 bytes are not 16-byte multiples; the up-projection would fall back: an error.
        odd = machmoe.MoE(100, 64, 8, 2, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="reference GEMM.*K = 100"):
            odd(torch.randn(64, 100, device="cuda", dtype=torch.bfloat16))
        machmoe.set_fallback_policy("warn")
        odd(torch.randn(64, 100, device="cuda", dtype=torch.bfloat16))  # runs, with a warning on stderr
        torch.cuda.synchronize()
    finally:
        machmoe.set_fallback_policy(before)
