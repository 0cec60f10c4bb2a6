"""Session 58: host timestamps (CLOCK_MONOTONIC ns) along the module path's forward, cold (GPU idle, right after a
synchronize that followed a backward, as T14's isolated timing) and warm (GPU busy with a queued sleep), from
.gl/trace.diff's marks: 0 binding entry, 1 after LayerArgs, 2 after the 5 allocations, 3 machmoe::forward entry,
4 forward_cuda entry, 5 before the router GEMM call, 6 after it, 7 binding before return; 9/10 time_layer's
forward call begin/end."""
import ctypes, os, statistics, sys, time, torch
from machmoe.benchmark import configs as C
from machmoe.benchmark.overhead import Case, forward_layers

lib = ctypes.CDLL(os.environ["MACHMOE_TORCH_LIBRARY"])
marks = (ctypes.c_longlong * 16).in_dll(lib, "machmoe_trace_marks")
med = statistics.median
s = torch.cuda.current_stream()
names = ["py->entry", "LayerArgs", "5 allocs", "->forward", "validate", "pre-gemm", "gemm call", "rest+ret", "->py"]

for cfg_name in sys.argv[1:]:
    cfg = C.select(cfg_name)[0]
    case = Case(cfg, torch.device("cuda"), torch.bfloat16, 0)
    fns = forward_layers(case.module, case.x)
    for _ in range(3):
        case.refill(); case.module_step()
    res = {}
    for name in ("op_below_autograd", "functional", "module_forward"):
        for state in ("cold", "warm"):
            rows = []
            for i in range(25):
                case.refill(); s.synchronize(); case.module_step(); s.synchronize()
                if state == "warm":
                    torch.cuda._sleep(2_000_000)
                    fns[name]()  # warm the path once right before
                t0 = time.perf_counter_ns(); out = fns[name](); t1 = time.perf_counter_ns()
                m = list(marks)
                pts = [t0, m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7], t1]
                rows.append([(b - a) / 1e3 for a, b in zip(pts, pts[1:])])
                del out; s.synchronize()
            res[(name, state)] = [med(c) for c in zip(*rows)]
    cpp = []
    for i in range(25):
        case.refill(); case.module_step(); s.synchronize()
        case.cpp(0, 1, True)
        m = list(marks)
        cpp.append([(m[4] - m[9]) / 1e3, (m[5] - m[4]) / 1e3, (m[6] - m[5]) / 1e3, (m[10] - m[6]) / 1e3])
    print(f"##### {cfg_name}: host us between marks, medians of 25 (cold: right after a sync; warm: GPU busy, path just run)")
    print(f"  {'path':18s} {'state':5s} " + " ".join(f"{n:>10s}" for n in names) + "   to gemm   total")
    for (name, state), v in res.items():
        print(f"  {name:18s} {state:5s} " + " ".join(f"{x:10.1f}" for x in v) + f"  {sum(v[:6]):8.1f} {sum(v):7.1f}")
    c = [med(col) for col in zip(*cpp)]
    print(f"  cpp time_layer forward (cold): call->forward_cuda {c[0]:.1f}, pre-gemm {c[1]:.1f}, gemm call {c[2]:.1f}, rest {c[3]:.1f}; to gemm {c[0]+c[1]:.1f}")
    del case, fns; torch.cuda.empty_cache()
