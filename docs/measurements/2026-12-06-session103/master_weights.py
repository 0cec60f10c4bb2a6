"""float32 master weights under torch.autocast("cuda", dtype=torch.bfloat16): the layer as it now takes them (the
float32 parameters passed to the operator, which casts them for the call, in the forward and again in the backward,
and writes float32 weight gradients from its kernels) against the way it took them before (the parameters cast to
bf16 in the autograd graph, the copies saved for the backward, bf16 gradients cast back to float32), and against bf16
parameters. The old way is reproduced in the same build by passing the casts explicitly: machmoe.moe then sees bf16
weights, exactly what MoE.forward passed before. One training step (forward + backward, gradients set to None
first): CUDA-event median over at least --time-ms of steps after --warmup-ms untimed, the three in turn, --rounds
rounds; the allocator's memory held from the forward to the backward (allocated after the forward minus before: what
each layer of a model adds until its backward) and the step's peak over what was allocated before it."""
import argparse
import statistics

import torch

import machmoe

CONFIGS = {"7B-256": (24576, 1536, 256, 128, 8), "30B-256": (32768, 4096, 1024, 256, 16)}  # T, d, n, E, K
BF16 = torch.bfloat16


def make(T, d, n, E, K):
    torch.manual_seed(0)
    m = machmoe.MoE(d, n, E, K, device="cuda", dtype=torch.float32)
    return m, [m.router_weight, m.w1, m.w2]


def forward(way, params, x, K):
    """params: one layer's (router_weight, w1, w2), or several layers' in a row (a stack: each layer's output is
    the next one's input)."""
    for i in range(0, len(params), 3):
        rw, w1, w2 = params[i:i + 3]
        if way == "before: casts in the graph":
            rw, w1, w2 = rw.to(BF16), w1.to(BF16), w2.to(BF16)
        with torch.autocast("cuda", dtype=BF16, enabled=way != "bf16 parameters"):
            x = machmoe.moe(x, rw, w1, w2, top_k=K)[0]
    return x


def measure(way, params, x, dy, K, warmup_ms, time_ms):
    def step():
        for p in params:
            p.grad = None
        forward(way, params, x, K).backward(dy)

    def run_for(ms, timed):
        times, spent = [], 0.0
        while spent < ms or (timed and len(times) < 10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            t = a.elapsed_time(b)
            spent += t
            times.append(t)
        return times

    run_for(warmup_ms, False)
    for p in params:
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = forward(way, params, x, K)
    torch.cuda.synchronize()
    held = (torch.cuda.memory_allocated() - base) / 2**20
    out.backward(dy)
    del out
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    # (kept for the comparison below where they are small: 30B's would not fit beside the rest)
    grads = [p.grad.clone() for p in params] if sum(p.numel() for p in params) < 2**29 else None
    for p in params:
        p.grad = None
    return statistics.median(run_for(time_ms, True)), held, peak, grads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="7B-256,30B-256")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup-ms", type=float, default=300)
    ap.add_argument("--time-ms", type=float, default=300)
    ap.add_argument("--layers", default="1,4", help="layers in a row, one row of results each (4 on 7B-256 only)")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    ways = ("bf16 parameters", "before: casts in the graph", "now: master weights")
    runs = [(name, layers) for name in a.configs.split(",") for layers in map(int, a.layers.split(","))
            if layers == 1 or name == "7B-256"]
    for name, layers in runs:
        T, d, n, E, K = CONFIGS[name]
        fp32 = [p for _ in range(layers) for p in make(T, d, n, E, K)[1]]
        bf16 = [p.detach().to(BF16).requires_grad_() for p in fp32]
        x = torch.randn(T, d, device="cuda", dtype=BF16)
        dy = torch.randn(T, d, device="cuda", dtype=BF16)
        res = {w: [] for w in ways}
        grads = {}
        for _ in range(a.rounds):
            for w in ways:
                t, held, peak, g = measure(w, bf16 if w == ways[0] else fp32, x, dy, K, a.warmup_ms, a.time_ms)
                res[w].append((t, held, peak))
                grads[w] = g
        for w in ways:
            v = res[w]
            print(f"{name} (T={T} d={d} n={n} E={E} K={K}) x {layers} layer(s), {w}: step ms per round "
                  f"{', '.join(f'{t:.3f}' for t, _, _ in v)}; "
                  f"held forward->backward {max(h for _, h, _ in v):.0f} MiB; "
                  f"peak over baseline {max(p for _, _, p in v):.0f} MiB")
        # How far the bf16-rounded gradients of the old way are from the float32 ones of the new (relative
        # Frobenius): the rounding the new way no longer applies.
        for i, pname in enumerate(("router_weight", "w1", "w2")):
            if grads[ways[2]] is None or layers > 1:
                break
            new, old = grads[ways[2]][i].double(), grads[ways[1]][i].double()
            print(f"{name} grad {pname}: dtype now {grads[ways[2]][i].dtype}, before {grads[ways[1]][i].dtype}; "
                  f"|before - now| / |now| = {((old - new).norm() / new.norm()).item():.2e}")
        del fp32, bf16, x, dy, grads
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
