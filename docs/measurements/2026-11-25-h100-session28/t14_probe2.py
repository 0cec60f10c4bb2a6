"""Session 28: what makes an isolated module forward slower right after a module forward+backward."""
import gc, statistics, sys, time
import torch
import machmoe
from machmoe.benchmark import configs as C
from machmoe.benchmark.overhead import Case


def ev():
    return torch.cuda.Event(enable_timing=True)


for name in sys.argv[1:] or ["7B-256"]:
    cfg = C.select(name)[0]
    case = Case(cfg, torch.device("cuda"), torch.bfloat16, 0)
    for _ in range(5):
        case.refill(); case.module_forward(); case.module_step()
    case.cpp(3, 1, True)
    torch.cuda.synchronize()

    def fwd(before, reps=25, what="module"):
        f, h = [], []
        for r in range(reps):
            before()
            case.refill()
            torch.cuda.synchronize()
            a, b = ev(), ev()
            a.record(); t0 = time.perf_counter(); case.module_forward(); t1 = time.perf_counter(); b.record()
            torch.cuda.synchronize()
            f.append(a.elapsed_time(b) * 1e3); h.append((t1 - t0) * 1e6)
        return f"{statistics.median(f):7.1f} us (host {statistics.median(h):5.0f})"

    nothing = lambda: None
    step = lambda: case.module_step()
    cpp_step = lambda: case.cpp(0, 1, True)
    def step_gc():
        case.module_step(); gc.collect()
    def step_no_grad_reset():
        case.module(case.x).output.backward(case.go)
    def fwd_no_grad():
        with torch.no_grad():
            case.module(case.x)
    def step_then_matmul():  # a different heavy GPU op between
        case.module_step(); torch.cuda.synchronize()
        z = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(20): z @ z
    print(f"== {name}: C++ time_layer isolated fwd {statistics.median(case.cpp(3, 25, True)[:, 0].tolist()) * 1e3:.1f} us")
    for label, before in (("after nothing", nothing), ("after module step", step), ("after C++ fwd+bwd", cpp_step),
                          ("after module step + gc", step_gc), ("after no_grad fwd", fwd_no_grad),
                          ("after step + 20 big matmuls", step_then_matmul), ("after nothing (again)", nothing),
                          ("after module step (again)", step)):
        print(f"   module fwd {label:30s} {fwd(before)}")
    del case
    torch.cuda.empty_cache()
