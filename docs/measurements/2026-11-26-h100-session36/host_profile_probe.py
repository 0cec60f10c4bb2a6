"""Session 36: host time of the module forward and backward (7B (256,128,8)), for nsys's CUDA API summary."""
import statistics, sys, time
import torch
from machmoe.benchmark import configs as C
from machmoe.benchmark.overhead import Case

name = sys.argv[1] if len(sys.argv) > 1 else "7B-256"
cfg = C.select(name)[0]
case = Case(cfg, torch.device("cuda"), torch.bfloat16, 0)
m, x = case.module, case.x
for _ in range(10):
    case.refill(); case.module_step()
torch.cuda.synchronize()
fw, st = [], []
torch.cuda.nvtx.range_push("forwards")
for _ in range(100):
    torch.cuda.synchronize()
    t0 = time.perf_counter(); o = m(x); t1 = time.perf_counter()
    fw.append((t1 - t0) * 1e6); del o
torch.cuda.synchronize()
torch.cuda.nvtx.range_pop()
go = torch.randn_like(x)
torch.cuda.nvtx.range_push("steps")
for _ in range(50):
    torch.cuda.synchronize()
    xr = x.detach().requires_grad_()
    m.zero_grad(set_to_none=True)
    t0 = time.perf_counter(); o = m(xr); t1 = time.perf_counter(); o.output.backward(go); t2 = time.perf_counter()
    st.append(((t1 - t0) * 1e6, (t2 - t1) * 1e6)); del o
torch.cuda.synchronize()
torch.cuda.nvtx.range_pop()
print(name, "module forward host us: median", round(statistics.median(fw), 1), "min", round(min(fw), 1))
print(name, "step host us (fwd, bwd call): median", [round(statistics.median(c), 1) for c in zip(*st)])
