# EP = 1 profile of ExpertParallelMoE against machmoe.MoE, 7B-256: step times and the kernel table of one step.
import os, sys, time
os.environ.setdefault("NCCL_NVLS_ENABLE", "0"); os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29533")
import torch, torch.distributed as dist
sys.path.insert(0, "python")
import machmoe
from machmoe.parallel import ExpertParallelMoE
dist.init_process_group("nccl", rank=0, world_size=1)
cfg = os.environ.get("CFG", "7B-256")
T, d, n, E, K = {"7B-256": (24576, 1536, 256, 128, 8), "1.4B-512": (40960, 768, 512, 64, 4), "30B-256": (32768, 4096, 256, 256, 16)}[cfg]
dev = torch.device("cuda", 0)
torch.manual_seed(0)
m = machmoe.MoE(d, n, E, K, device=dev, dtype=torch.bfloat16)
ep = ExpertParallelMoE.from_moe(m)
x = torch.randn(T, d, device=dev, dtype=torch.bfloat16).requires_grad_()
go = torch.randn(T, d, device=dev, dtype=torch.bfloat16)
def step(mod):
    for p in mod.parameters(): p.grad = None
    x.grad = None
    mod(x).output.backward(go)
def timeit(mod, reps=10):
    for _ in range(3): step(mod)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); step(mod); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]
print(f"{cfg}: machmoe.MoE step {timeit(m):.3f} ms, ExpertParallelMoE (EP=1) step {timeit(ep):.3f} ms", flush=True)
print(f"{cfg}: machmoe.MoE step {timeit(m):.3f} ms, ExpertParallelMoE (EP=1) step {timeit(ep):.3f} ms", flush=True)
if os.environ.get("PROF", "1") == "1":
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(2): step(ep)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))
dist.destroy_process_group()
