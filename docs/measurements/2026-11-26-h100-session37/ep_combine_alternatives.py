# The EP combine's elementwise steps, alternatives timed on 7B (256,128,8) shapes; equality against the current form.
import torch
torch.manual_seed(0)
T, K, d = 24576, 8, 1536
dev = "cuda"
y = torch.randn(T * K, d, device=dev).to(torch.bfloat16)
s = torch.rand(T * K, device=dev)
g = torch.randn(T, d, device=dev).to(torch.bfloat16)
def t(f, reps=20):
    for _ in range(3): f()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(reps): f()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / reps
# forward: out = sum_k s*y (fp32), rounded to bf16
fA = lambda: torch.mul(y, s.unsqueeze(1)).view(T, K, d).sum(1).to(torch.bfloat16)
fB = lambda: (y.float() * s.unsqueeze(1)).view(T, K, d).sum(1).to(torch.bfloat16)
fC = lambda: torch.bmm(s.view(T, 1, K), y.view(T, K, d).float()).view(T, d).to(torch.bfloat16)
def fD():
    yf = y.view(T, K, d).float()
    yf.mul_(s.view(T, K, 1))
    return yf.sum(1).to(torch.bfloat16)
fE = lambda: torch.einsum("tk,tkd->td", s.view(T, K), y.view(T, K, d).float()).to(torch.bfloat16)
ref = fA()
for name, f in [("fwd A mul+sum (current)", fA), ("fwd B float()*s+sum", fB), ("fwd C bmm fp32", fC), ("fwd D float, mul_, sum", fD), ("fwd E einsum fp32", fE)]:
    o = f()
    print(f"{name}: {t(f):.3f} ms, equal to current: {torch.equal(o, ref)}, max diff {(o.float()-ref.float()).abs().max().item():.3e}", flush=True)
# backward grad_y = bf16(s * g[t]) and grad_score = <g[t], y_p>
def bA():
    out = torch.empty_like(y)
    torch.mul(g.view(T, 1, d), s.view(T, K, 1), out=out.view(T, K, d))
    return out
bB = lambda: (g.float().view(T, 1, d) * s.view(T, K, 1)).to(torch.bfloat16).view(T * K, d)
bC = lambda: torch.bmm(s.view(T, K, 1), g.float().view(T, 1, d)).to(torch.bfloat16).view(T * K, d)
def bD():
    out = torch.empty_like(y)
    torch.mul(g.view(T, 1, d).expand(T, K, d).contiguous(), s.view(T, K, 1), out=out.view(T, K, d))
    return out
bE = lambda: torch.mul(g.float().view(T, 1, d), s.view(T, K, 1)).to(torch.bfloat16).view(T * K, d)
refb = bA()
for name, f in [("bwd grad_y A mul out= (current)", bA), ("bwd B float bcast then cast", bB), ("bwd C bmm fp32 k=1", bC), ("bwd D expand.contiguous then mul", bD), ("bwd E", bE)]:
    o = f()
    print(f"{name}: {t(f):.3f} ms, equal to current: {torch.equal(o, refb)}", flush=True)
sA = lambda: torch.bmm(y.view(T, K, d), g.view(T, d, 1), out_dtype=torch.float32)
sB = lambda: (y.view(T, K, d).float() * g.float().view(T, 1, d)).sum(-1)
print(f"score A bmm out_dtype: {t(sA):.3f} ms; B float mul sum: {t(sB):.3f} ms; max diff {(sA().view(T,K)-sB()).abs().max().item():.3e}")
gi = torch.randperm(T * K, device=dev)
print(f"index_select of the rows: {t(lambda: y.index_select(0, gi)):.3f} ms; copy of the rows: {t(lambda: y.clone()):.3f} ms")
