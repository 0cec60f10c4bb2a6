# Session 35 probe: why the module's timed forward+backward exceeds forward + backward timed apart on 120B (2048,64,4).
import sys, time, statistics, math, torch, machmoe
T, d, n, E, K = (int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "32768,4096,2048,64,4").split(","))
iters = 10
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(1)
m = machmoe.MoE(d, n, E, K, device=dev, dtype=torch.bfloat16)
with torch.no_grad():
    m.router_weight.copy_(torch.randn(E, d, device=dev, generator=g) / math.sqrt(d))
    m.w1.copy_(torch.randn(m.w1.shape, device=dev, generator=g) / math.sqrt(d))
    m.w2.copy_(torch.randn(m.w2.shape, device=dev, generator=g) / math.sqrt(n))
x = torch.randn(T, d, device=dev, generator=g).bfloat16().requires_grad_()
go = torch.randn(T, d, device=dev, generator=g).bfloat16()
params = [m.router_weight, m.w1, m.w2]

def zero(none=True):
    for p in params:
        if none: p.grad = None
        elif p.grad is not None: p.grad.zero_()
    x.grad = None

def ev():
    e = torch.cuda.Event(enable_timing=True); e.record(); return e

def stats():
    s = torch.cuda.memory_stats()
    return s.get("num_device_alloc", 0), s.get("num_device_free", 0), s.get("num_alloc_retries", 0)

def run(label, body, reps=iters, warm=3):
    for _ in range(warm): body()
    torch.cuda.synchronize()
    a0 = stats(); ts = []
    for _ in range(reps):
        r = body(); torch.cuda.synchronize(); ts.append(r)
    a1 = stats()
    cols = list(zip(*ts)) if isinstance(ts[0], tuple) else [ts]
    print(f"{label:44s}", " ".join(f"{statistics.median(c):8.3f}" for c in cols),
          f"  device alloc/free/retries +{a1[0]-a0[0]}/+{a1[1]-a0[1]}/+{a1[2]-a0[2]}", flush=True)

def fwd_only():
    zero(); e0 = ev(); o = m(x).output; e1 = ev(); e1.synchronize(); return e0.elapsed_time(e1)

def bwd_only():
    zero(); o = m(x).output; torch.cuda.synchronize(); e0 = ev(); o.backward(go); e1 = ev(); e1.synchronize()
    return e0.elapsed_time(e1)

def step(none=True):
    def b():
        e0 = ev(); zero(none); o = m(x).output; e1 = ev(); o.backward(go); e2 = ev(); e2.synchronize()
        return e0.elapsed_time(e2), e0.elapsed_time(e1), e1.elapsed_time(e2)
    return b

def step_sync():
    e0 = ev(); zero(); o = m(x).output; e1 = ev(); torch.cuda.synchronize(); e1b = ev(); o.backward(go); e2 = ev(); e2.synchronize()
    return e0.elapsed_time(e2), e0.elapsed_time(e1), e1b.elapsed_time(e2)

def step_host():
    zero(); torch.cuda.synchronize(); t0 = time.perf_counter(); o = m(x).output; t1 = time.perf_counter(); o.backward(go); t2 = time.perf_counter()
    torch.cuda.synchronize(); t3 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t0) * 1e3

print(f"T={T} d={d} n={n} E={E} K={K}", torch.cuda.get_device_name())
for rnd in range(2):
    run("forward", fwd_only)
    run("backward after a synchronised forward", bwd_only)
    run("fwd+bwd (total, fwd part, bwd part)", step(True))
    run("fwd+bwd, grads zeroed not freed", step(False))
    run("fwd, sync, bwd (total, fwd, bwd)", step_sync)
    run("host ms: fwd enqueue, bwd enqueue, to done", step_host)
