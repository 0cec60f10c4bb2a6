"""TorchTitanGroupedExperts' forward + backward with w1 and w3 read in place (w3 right after w1 in one buffer: one
(E, 2, h, dim) view of both, no copy) and with them concatenated (w3 placed before w1: [w1; w3] copied in the
forward, again in the backward, and the (E, 2h, dim) gradient split back), against GroupedExperts with the weights
already concatenated (weight_layout="concatenated"), same rows, counts and upstream gradient (session 109's change;
session 108's torchtitan_copies.py, which this replaces, had only the copying form). CUDA events (machmoe.benchmark's time_ms), median over at least 300 ms after 300 ms of warm-up; peak =
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
    print("| shape | TT in place ms | TT concatenating ms | GroupedExperts ms | in place / GE | concatenating / GE | "
          "peak MiB in place / concatenating / GE |")
    print("|---|---|---|---|---|---|---|")
    for name, E, h, dim, rows in SHAPES:
        counts = torch.full((E,), rows // E, dtype=torch.int64, device=dev)
        counts[: rows % E] += 1
        x = torch.randn(rows, dim, device=dev, dtype=dt, requires_grad=True)
        g = torch.randn(rows, dim, device=dev, dtype=dt)
        tt = TorchTitanGroupedExperts(dim, h, E, device=dev, dtype=dt)
        tt.init_weights(0.02)
        tc = TorchTitanGroupedExperts(dim, h, E, device=dev, dtype=dt)
        buf_in_place = torch.empty((2, E, h, dim), device=dev, dtype=dt)
        buf_copied = torch.empty((2, E, h, dim), device=dev, dtype=dt)
        with torch.no_grad():
            buf_in_place[0].copy_(tt.w1), buf_in_place[1].copy_(tt.w3)
            buf_copied[1].copy_(tt.w1), buf_copied[0].copy_(tt.w3)
            tc.w2.copy_(tt.w2)
        tt.w1.data, tt.w3.data = buf_in_place[0], buf_in_place[1]  # w3 after w1: read in place
        tc.w1.data, tc.w3.data = buf_copied[1], buf_copied[0]  # w3 before w1: concatenated
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
        step_of(tc)()
        same = same and all(torch.equal(a, b) for a, b in
                            zip(ref, (x.grad, torch.cat([tc.w1.grad, tc.w3.grad], dim=1), tc.w2.grad)))
        r = []
        for rnd in range(2):  # the three in turn, twice
            r.append(tuple(time_ms(step_of(m), x.device, warmup=1, iters=10, warmup_ms=300, min_ms=300)
                           for m in (tt, tc, ge)))
        t = [statistics.mean(v[i] for v in r) for i in range(3)]
        pk = [peak(step_of(m)) for m in (tt, tc, ge)]
        cells = " | ".join(" / ".join(f"{v[i]:.3f}" for v in r) for i in range(3))
        print(f"| {name} | {cells} | {t[0] / t[2]:.3f} | {t[1] / t[2]:.3f} | "
              f"{pk[0]:.0f} / {pk[1]:.0f} / {pk[2]:.0f} | bitwise equal: {same}")
        del tt, tc, ge, x, g, ref, buf_in_place, buf_copied
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
