# Session 35 probe 3: kernel tables of the benchmark's fwd+bwd step (inside measure()) against a hand-written step.
import statistics, torch
from torch.profiler import profile, ProfilerActivity
from machmoe.benchmark import configs as C, impls as I, runner as R
cfg = [c for c in C.MAIN if c.name == "120B-2048"][0]
s = R.Settings(impls=["machmoe"], iters=5, warmup=2)
dev = s.torch_device
weights = I.Weights(cfg, s.torch_dtype, dev, s.seed)
x, go = I.make_inputs(cfg, s.torch_dtype, dev, s.seed)
impl = I.build("machmoe", weights, cfg)

def table(label, fn, n=2):
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    print(f"==== {label}: {n} calls")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))

orig = R.time_ms
def patched(fn, device, warmup, iters):
    r = orig(fn, device, warmup, iters)
    if fn.__name__ == "step":
        print("measure() step ms", round(r, 3))
        table("measure() step", fn)
    return r
R.time_ms = patched
res = R.measure(impl, x, go, cfg, s, weights.values())
print({k: round(res[k], 3) for k in ("forward_ms", "backward_ms", "fwdbwd_ms")})
xr = x.detach().clone().requires_grad_()
def mine():
    impl.zero_grad(); xr.grad = None
    o = impl.forward(xr).output
    o.backward(go)
table("hand-written step", mine)
