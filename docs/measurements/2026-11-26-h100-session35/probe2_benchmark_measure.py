# Session 35 probe 2: the Python benchmark's own measure() on 120B (2048,64,4), then its step instrumented.
import statistics, torch
from machmoe.benchmark import configs as C, impls as I, runner as R
cfg = [c for c in C.MAIN if c.name == "120B-2048"][0]
s = R.Settings(impls=["machmoe"])
dev = s.torch_device
weights = I.Weights(cfg, s.torch_dtype, dev, s.seed)
x, go = I.make_inputs(cfg, s.torch_dtype, dev, s.seed)
impl = I.build("machmoe", weights, cfg)
for rnd in range(2):
    res = R.measure(impl, x, go, cfg, s, weights.values())
    print("measure():", {k: round(res[k], 3) for k in ("forward_ms", "backward_ms", "fwdbwd_ms")}, flush=True)
xr = x.detach().clone().requires_grad_()
def ev():
    e = torch.cuda.Event(enable_timing=True); e.record(); return e
for variant in ("benchmark step", "step, x without grad", "step, grads kept"):
    ts = []
    for i in range(13):
        e0 = ev()
        if variant != "step, grads kept" or i == 0:
            impl.zero_grad()
        xr.grad = None
        state = [p.grad is None for p in weights.values().values()]
        inp = xr if variant != "step, x without grad" else x
        o = impl.forward(inp).output
        e1 = ev()
        o.backward(go)
        e2 = ev(); e2.synchronize()
        if i >= 3: ts.append((e0.elapsed_time(e2), e0.elapsed_time(e1), e1.elapsed_time(e2)))
    print(f"{variant:24s} total/fwd/bwd", [round(statistics.median(c), 3) for c in zip(*ts)], "grads None at start:", state, flush=True)
st = torch.cuda.memory_stats()
print("allocator: device allocs", st["num_device_alloc"], "frees", st["num_device_free"], "retries", st["num_alloc_retries"],
      "reserved GiB", round(torch.cuda.memory_reserved() / 2**30, 2))
