# Session 35 probe 4: per-repetition times of the benchmark's fwd+bwd step on 120B (2048,64,4), with the output
# freed after each step (as measure() does) and kept alive until the next one, clocks sampled alongside.
import time, torch
from machmoe.benchmark import configs as C, impls as I, runner as R
cfg = [c for c in C.MAIN if c.name == "120B-2048"][0]
s = R.Settings(impls=["machmoe"])
dev = s.torch_device
weights = I.Weights(cfg, s.torch_dtype, dev, s.seed)
x, go = I.make_inputs(cfg, s.torch_dtype, dev, s.seed)
impl = I.build("machmoe", weights, cfg)
xr = x.detach().clone().requires_grad_()
keep = []
def step():
    impl.zero_grad(); xr.grad = None
    impl.forward(xr).output.backward(go)
def step_keep():
    impl.zero_grad(); xr.grad = None
    o = impl.forward(xr).output
    o.backward(go)
    keep[:] = [o]
def fwd_only():
    impl.zero_grad(); xr.grad = None
    impl.forward(xr)
def per_iter(label, fn, warm=3, iters=20):
    for _ in range(warm): fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(iters):
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    keep.clear()
    print(f"{time.strftime('%H:%M:%S')} {label:28s} median {sorted(ts)[len(ts)//2]:7.3f}  " + " ".join(f"{t:.1f}" for t in ts), flush=True)
for rnd in range(2):
    per_iter("fwd+bwd, output freed", step)
    per_iter("fwd+bwd, output kept", step_keep)
    per_iter("forward only", fwd_only)
