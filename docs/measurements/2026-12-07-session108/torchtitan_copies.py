"""What TorchTitanGroupedExperts' copies cost: its forward + backward (w1, w2, w3 apart: [w1; w3] concatenated in the
forward, again in the backward, and the (E, 2h, dim) gradient split back into w1's and w3's) against GroupedExperts
with the same weights already concatenated (weight_layout="concatenated": no copy), same rows, counts and upstream
gradient. CUDA events (machmoe.benchmark's time_ms), median over at least 300 ms after 300 ms of warm-up; peak =
max_memory_allocated over one step above what was allocated before it. Run on a GPU with the in-tree build:
  MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=build/lib/libmachmoe_torch.so PYTHONPATH=python python3 THIS_FILE"""
import statistics

import torch

from machmoe.benchmark.baselines import time_ms
from machmoe.parallel import GroupedExperts, TorchTitanGroupedExperts

# (name, E, hidden, dim, routed rows): torchtitan-style experts, rows = tokens x top-k on one GPU.
SHAPES = [
    ("deepseek-v2-lite-like E=64 h=1408 d=2048, 16384 tok x 6", 64, 1408, 2048, 16384 * 6),
    ("same, 4096 tok x 6", 64, 1408, 2048, 4096 * 6),
    ("qwen3-30b-a3b-like E=128 h=768 d=2048, 16384 tok x 8", 128, 768, 2048, 16384 * 8),
    ("mixtral-like E=8 h=14336 d=4096, 8192 tok x 2", 8, 14336, 4096, 8192 * 2),
]


def peak(step):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main():
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    print(torch.cuda.get_device_name(), torch.__version__)
    print("| shape | TorchTitanGroupedExperts ms | GroupedExperts, concatenated ms | ratio | peak MiB, TT / GE |")
    print("|---|---|---|---|---|")
    for name, E, h, dim, rows in SHAPES:
        counts = torch.full((E,), rows // E, dtype=torch.int64, device=dev)
        counts[: rows % E] += 1
        x = torch.randn(rows, dim, device=dev, dtype=dt, requires_grad=True)
        g = torch.randn(rows, dim, device=dev, dtype=dt)
        tt = TorchTitanGroupedExperts(dim, h, E, device=dev, dtype=dt)
        tt.init_weights(0.02)
        ge = GroupedExperts(dim, h, E, weight_layout="concatenated", device=dev, dtype=dt)
        with torch.no_grad():
            ge.w1.copy_(torch.cat([tt.w1, tt.w3], dim=1))
            ge.w2.copy_(tt.w2)

        def step_of(m):
            def step():
                for p in m.parameters():
                    p.grad = None
                x.grad = None
                m(x, counts).backward(g)
            return step

        # Same math: outputs and every gradient agree (bitwise: the same kernels on the same operands).
        step_of(tt)()
        ref = (x.grad.clone(), torch.cat([tt.w1.grad, tt.w3.grad], dim=1), tt.w2.grad.clone())
        step_of(ge)()
        same = all(torch.equal(a, b) for a, b in zip(ref, (x.grad, ge.w1.grad, ge.w2.grad)))
        r = []
        for rnd in range(2):  # the two in turn, twice
            r.append(tuple(time_ms(step_of(m), x.device, warmup=1, iters=10, warmup_ms=300, min_ms=300)
                           for m in (tt, ge)))
        t_tt = statistics.mean(a for a, _ in r)
        t_ge = statistics.mean(b for _, b in r)
        p_tt, p_ge = peak(step_of(tt)), peak(step_of(ge))
        print(f"| {name} | {' / '.join(f'{a:.3f}' for a, _ in r)} | {' / '.join(f'{b:.3f}' for _, b in r)} | "
              f"{t_tt / t_ge:.3f} | {p_tt:.0f} / {p_ge:.0f} | bitwise equal: {same}")
        del tt, ge, x, g, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
