"""The expert-parallel layer (machmoe.parallel.ExpertParallelMoE, a group of one process over NCCL) with float32
parameters under torch.autocast("cuda", dtype=torch.bfloat16): its experts' weights now passed to the operator as
master weights (GroupedExperts.forward, as machmoe.MoE passes its own since session 103) against the way it took
them before (bf16 casts in the autograd graph, saved for the backward, bf16 gradients cast back to float32), and
against bf16 parameters. The old way is reproduced in the same build by making GroupedExperts' autocast call cast
every weight again (parallel._under_autocast without master weights). One training step (forward + backward,
gradients set to None first): CUDA-event median over at least --time-ms of steps after --warmup-ms untimed, the
three in turn, --rounds rounds; the allocator's memory held from the forward to the backward (allocated after the
forward minus before) and the step's peak over what was allocated before it."""
import argparse
import copy
import statistics

import torch
import torch.distributed as dist

from machmoe import functional, parallel

CONFIGS = {"7B-256": (24576, 1536, 256, 128, 8), "30B-256": (32768, 4096, 1024, 256, 16)}  # T, d, n, E, K
BF16 = torch.bfloat16
WAYS = ("bf16 parameters", "before: casts in the graph", "now: master weights")
MASTER = parallel._under_autocast


def old_cast(x, *tensors, master=False):
    return functional._under_autocast(x, *tensors)


def run(way, layer, x):
    parallel._under_autocast = old_cast if way == WAYS[1] else MASTER
    with torch.autocast("cuda", dtype=BF16, enabled=way != WAYS[0]):
        return layer(x).output


def measure(way, layer, x, dy, warmup_ms, time_ms):
    def step():
        layer.zero_grad(set_to_none=True)
        run(way, layer, x).backward(dy)

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
    layer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = run(way, layer, x)
    torch.cuda.synchronize()
    held = (torch.cuda.memory_allocated() - base) / 2**20
    out.backward(dy)
    del out
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    small = sum(p.numel() for p in layer.parameters()) < 2**29  # (30B's copies would not fit beside the rest)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()} if way != WAYS[0] and small else None
    layer.zero_grad(set_to_none=True)
    return statistics.median(run_for(time_ms, True)), held, peak, grads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="7B-256,30B-256")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup-ms", type=float, default=300)
    ap.add_argument("--time-ms", type=float, default=300)
    ap.add_argument("--alternate", action="store_true",
                    help="the ways in reverse order every other round (call 1 ran them in one order)")
    a = ap.parse_args()
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    print(torch.cuda.get_device_name(), torch.__version__, "ExpertParallelMoE, EP = 1 (NCCL), default mode")
    for name in a.configs.split(","):
        T, d, n, E, K = CONFIGS[name]
        torch.manual_seed(0)
        fp32 = parallel.ExpertParallelMoE(d, n, E, K, device="cuda", dtype=torch.float32)
        bf16 = copy.deepcopy(fp32).to(BF16)
        x = torch.randn(T, d, device="cuda", dtype=BF16)
        dy = torch.randn(T, d, device="cuda", dtype=BF16)
        res = {w: [] for w in WAYS}
        grads = {}
        for r in range(a.rounds):
            for w in (WAYS[::-1] if a.alternate and r % 2 else WAYS):
                t, held, peak, g = measure(w, bf16 if w == WAYS[0] else fp32, x, dy, a.warmup_ms, a.time_ms)
                res[w].append((t, held, peak))
                if g is not None:
                    grads[w] = g
        for w in WAYS:
            v = res[w]
            print(f"{name} (T={T} d={d} n={n} E={E} K={K}), {w}: step ms per round "
                  f"{', '.join(f'{t:.3f}' for t, _, _ in v)}; "
                  f"held forward->backward {max(h for _, h, _ in v):.0f} MiB; "
                  f"peak over baseline {max(p for _, _, p in v):.0f} MiB")
        for pname, new in grads.get(WAYS[2], {}).items():
            old = grads[WAYS[1]][pname]
            rel = ((old.double() - new.double()).norm() / new.double().norm()).item()
            print(f"{name} grad {pname}: dtype {new.dtype} (before {old.dtype}); |before - now| / |now| = {rel:.2e}")
        del fp32, bf16, x, dy, grads
        torch.cuda.empty_cache()
    parallel._under_autocast = MASTER
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
