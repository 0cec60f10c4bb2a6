"""Isolated forward GPU time (CUDA events around one call after a synchronize) of each layer of the module path, and
the C++ layer's (time_layer), interleaved repetition by repetition; median over reps. Also host time per call."""
import statistics, sys, time, torch
from machmoe.benchmark import configs as C
from machmoe.benchmark.overhead import Case
from machmoe import functional as F

reps = 40
for name in sys.argv[1:]:
    cfg = C.select(name)[0]
    case = Case(cfg, torch.device("cuda"), torch.bfloat16, 0)
    m = case.module
    x = case.x
    xd = x.detach()
    rw, w1, w2 = m.router_weight, m.w1, m.w2
    op = torch.ops.machmoe.layer_forward.default
    codes = case.codes

    def below():
        with torch.no_grad(), torch._C._AutoDispatchBelowAutograd():
            op(xd, rw, w1, None, w2, None, None, None, None, *codes)

    def nograd():
        with torch.no_grad():
            op(xd, rw, w1, None, w2, None, None, None, None, *codes)

    fns = {"op_below_autograd": below, "op_no_grad": nograd,
           "op_autograd": lambda: op(x, rw, w1, None, w2, None, None, None, None, *codes),
           "functional": lambda: F.moe(x, rw, w1, w2, top_k=cfg.K), "module": lambda: m(x)}
    for f in fns.values():
        for _ in range(3): f()
    case.cpp(3, 1, True)
    gpu = {k: [] for k in fns}; host = {k: [] for k in fns}; cpp = []
    s = torch.cuda.current_stream()
    for r in range(reps):
        t = case.cpp(0, 1, True); cpp.append(float(t[0, 0]))
        for k, f in fns.items():
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.synchronize()
            e0.record()
            h0 = time.perf_counter()
            out = f()
            h1 = time.perf_counter()
            e1.record()
            s.synchronize()
            del out
            gpu[k].append(e0.elapsed_time(e1)); host[k].append((h1 - h0) * 1e3)
    c = statistics.median(cpp)
    print(f"## {name}: C++ isolated forward {c:.4f} ms")
    for k in fns:
        g = statistics.median(gpu[k])
        print(f"  {k:18s} gpu {g:.4f} ms  ratio {g / c:.3f}  host {statistics.median(host[k]):.4f} ms")
