"""Session 94 probe: the gather-sum fused into the GEMM's epilogue (MACHMOE_FUSED_GATHER_SUM=1) against the separate
gather-sum kernel. Run once per side (the switch is read once a process): `python3 fused_check.py save FILE`, then
`python3 fused_check.py compare A B` (bitwise: torch.equal on the output and every gradient)."""
import sys

import torch

import machmoe

# (T, d, n, E, K): the 1.4B row's sizes (its Y and dX~ in 3 chunks of tokens), columns not a multiple of 128, T = 1
# with K = E, K = 1, a 7B-sized row.
CASES = [(40960, 768, 256, 128, 8), (3000, 1000, 256, 16, 4), (1, 768, 256, 8, 8), (5000, 1536, 512, 64, 1),
         (24576, 1536, 256, 128, 8)]


def run(case):
    T, d, n, E, K = case
    g = torch.Generator(device="cuda").manual_seed(1234)
    m = machmoe.MoE(d, n, E, K, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for prm in m.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g, device="cuda", dtype=torch.float32).to(prm.dtype)
                      / prm.shape[-1] ** 0.5)
    x = torch.randn(T, d, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16).requires_grad_(True)
    dy = torch.randn(T, d, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    out = m(x)
    out.output.backward(dy)
    res = {"y": out.output.detach().clone(), "dx": x.grad.clone()}
    for name, prm in m.named_parameters():
        res["d" + name] = prm.grad.clone()
    return res


if __name__ == "__main__":
    if sys.argv[1] == "save":
        torch.save({str(c): run(c) for c in CASES}, sys.argv[2])
    else:
        a, b = torch.load(sys.argv[2]), torch.load(sys.argv[3])
        bad = 0
        for c in a:
            for k in a[c]:
                same = torch.equal(a[c][k], b[c][k])
                diff = (a[c][k].float() - b[c][k].float()).abs().max().item()
                print(f"{c} {k}: {'bitwise equal' if same else 'DIFFERENT, max |diff| %g' % diff}")
                bad += not same
        print("all bitwise equal" if bad == 0 else f"{bad} tensors differ")
        sys.exit(1 if bad else 0)
