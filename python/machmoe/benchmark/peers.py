"""Other MoE libraries, measured only when they are installed (never vendored), each in its own process
(`python -m machmoe.benchmark.peers`, started by the runner): upstream SonicMoE (`sonicmoe`, PyPI sonic-moe),
ScatterMoE (`scattermoe`) and MegaBlocks (`megablocks`). Each adapter loads the benchmark's weights (machmoe's
layout) into the library's own module and maps its gradients back to machmoe's layout, so the float64 check and the
timings are those of the same layer.

The adapters follow each library's public module as documented by its repository; none of them has been run by this
project yet (none of the libraries is installed on the development machine): the first GPU run must confirm the weight
mappings, which the float64 check does (a wrong mapping shows as an error near 1, reported, not fatal).
"""
import argparse
import importlib.util
import json
import sys
from typing import Dict, List

import torch
import torch.nn.functional as F
from torch import nn

from .impls import Forward, Impl

PEERS = {"sonicmoe": "sonicmoe", "scattermoe": "scattermoe", "megablocks": "megablocks"}  # name -> module


def available() -> List[str]:
    """The peers importable here (found without importing them)."""
    out = []
    for name, module in PEERS.items():
        try:
            if importlib.util.find_spec(module) is not None:
                out.append(name)
        except (ImportError, ValueError):
            pass
    return out


def _gate_up(w1):
    """machmoe's interleaved w1 (E, 2n, d) -> (gate (E, n, d), up (E, n, d))."""
    return w1[:, 0::2], w1[:, 1::2]


def _interleave(g_gate, g_up):
    E, n, d = g_gate.shape
    return torch.stack([g_gate, g_up], dim=2).reshape(E, 2 * n, d)


class _PeerImpl(Impl):
    kind = "peer"

    def __init__(self, weights: Dict[str, torch.Tensor], cfg):
        self.cfg = cfg
        self.router_weight = nn.Parameter(weights["router_weight"].detach().clone())

    def logits_for_check(self, x):
        return x @ self.router_weight.t()


class SonicMoEImpl(_PeerImpl):
    """sonicmoe.MoE (router nn.Linear, c_fc (E, 2n, d) with gate rows 0::2 and up rows 1::2 — machmoe's interleaved
    layout — c_proj (E, d, n)), run through its fused kernel backend as its users run it."""
    name = "sonicmoe"

    def __init__(self, weights, cfg):
        super().__init__(weights, cfg)
        from sonicmoe import KernelBackendMoE, MoE
        from sonicmoe.enums import ActivationType
        w1 = weights["w1"]
        m = MoE(num_experts=cfg.E, num_experts_per_tok=cfg.K, hidden_size=cfg.d, intermediate_size=cfg.n,
                activation_function=ActivationType.SWIGLU, add_bias=False, std=0.02).to(w1.device, w1.dtype)
        with torch.no_grad():
            m.router.weight.copy_(weights["router_weight"])
            m.c_fc.weight.copy_(w1)
            m.c_proj.weight.copy_(weights["w2"])
        m.train()
        self.module, self.backend = m, KernelBackendMoE.sonicmoe
        self.router_weight = m.router.weight

    def forward(self, x):
        out, _aux = self.module(x, kernel_backend_moe=self.backend)
        return Forward(out, None)

    def grads(self):
        m = self.module
        return {"router_weight": m.router.weight.grad, "w1": m.c_fc.weight.grad, "w2": m.c_proj.weight.grad}

    def zero_grad(self):
        self.module.zero_grad(set_to_none=True)


class ScatterMoEImpl(_PeerImpl):
    """scattermoe.mlp.GLUMLP (experts (E, 2n, d): [up; gate] halves, activation(gate) * up; output_experts
    (E, d, n)); the router (top-K of x W_r^T, softmax over the K selected) is written here, as its users write it."""
    name = "scattermoe"

    def __init__(self, weights, cfg):
        super().__init__(weights, cfg)
        from scattermoe.mlp import GLUMLP
        w1 = weights["w1"]
        m = GLUMLP(cfg.d, cfg.n, cfg.E, cfg.K, activation=nn.SiLU()).to(w1.device, w1.dtype)
        gate, up = _gate_up(w1)
        up_gate = torch.cat([up, gate], dim=1)                    # (E, 2n, d)
        with torch.no_grad():
            self._t1 = self._load(m.experts.weight, up_gate)
            self._t2 = self._load(m.output_experts.weight, weights["w2"])
        self.module = m

    @staticmethod
    def _load(param, value):
        """Copies value ((E, out, in)) into param, which some versions store as (E, in, out); returns whether it
        was transposed."""
        if tuple(param.shape) == tuple(value.shape):
            param.copy_(value)
            return False
        param.copy_(value.transpose(1, 2))
        return True

    def forward(self, x):
        logits = x @ self.router_weight.t()
        top, idx = torch.topk(logits.float(), self.cfg.K, dim=-1)
        p = torch.softmax(top, dim=-1).to(x.dtype)
        return Forward(self.module(x, p, idx), logits, idx)

    def grads(self):
        g1, g2 = self.module.experts.weight.grad, self.module.output_experts.weight.grad
        if g1 is not None:
            g1 = g1.transpose(1, 2) if self._t1 else g1
            n = self.cfg.n
            g1 = _interleave(g1[:, n:], g1[:, :n])
        if g2 is not None and self._t2:
            g2 = g2.transpose(1, 2)
        return {"router_weight": self.router_weight.grad, "w1": g1, "w2": g2}

    def zero_grad(self):
        self.module.zero_grad(set_to_none=True)
        self.router_weight.grad = None


class MegaBlocksImpl(_PeerImpl):
    """megablocks.layers.dmoe.dMoE with a GLU MLP (w1 gate, v1 up, w2 down, each (E n, d)), grouped GEMM
    implementation, its learned router with top-K weights renormalised (= softmax over the K selected)."""
    name = "megablocks"

    def __init__(self, weights, cfg):
        super().__init__(weights, cfg)
        from megablocks.layers.arguments import Arguments
        from megablocks.layers.dmoe import dMoE
        w1 = weights["w1"]
        args = Arguments(hidden_size=cfg.d, ffn_hidden_size=cfg.n, moe_num_experts=cfg.E, moe_top_k=cfg.K,
                         mlp_type="glu", mlp_impl="grouped", activation_fn=F.silu, moe_normalize_expert_weights=1,
                         bf16=w1.dtype == torch.bfloat16, fp16=w1.dtype == torch.float16, device=w1.device,
                         return_bias=False, moe_loss_weight=0.0)
        m = dMoE(args).to(w1.device, w1.dtype)
        gate, up = _gate_up(w1)
        E, n, d = cfg.E, cfg.n, cfg.d
        with torch.no_grad():
            m.router.layer.weight.copy_(weights["router_weight"])
            m.experts.mlp.w1.copy_(gate.reshape(E * n, d))
            m.experts.mlp.v1.copy_(up.reshape(E * n, d))
            m.experts.mlp.w2.copy_(weights["w2"].transpose(1, 2).reshape(E * n, d))
        self.module = m
        self.router_weight = m.router.layer.weight

    def forward(self, x):
        out = self.module(x.unsqueeze(1))
        out = out[0] if isinstance(out, tuple) else out
        return Forward(out.squeeze(1), None)

    def grads(self):
        mlp, E, n, d = self.module.experts.mlp, self.cfg.E, self.cfg.n, self.cfg.d
        g1 = None
        if mlp.w1.grad is not None and mlp.v1.grad is not None:
            g1 = _interleave(mlp.w1.grad.reshape(E, n, d), mlp.v1.grad.reshape(E, n, d))
        g2 = mlp.w2.grad.reshape(E, n, d).transpose(1, 2) if mlp.w2.grad is not None else None
        return {"router_weight": self.module.router.layer.weight.grad, "w1": g1, "w2": g2}

    def zero_grad(self):
        self.module.zero_grad(set_to_none=True)


ADAPTERS = {"sonicmoe": SonicMoEImpl, "scattermoe": ScatterMoEImpl, "megablocks": MegaBlocksImpl}


def main(argv=None) -> int:
    """The peer worker: one peer on one configuration; writes its result row as JSON."""
    from .configs import Config
    from .impls import make_inputs, make_weights
    from .runner import Settings, _error, measure
    ap = argparse.ArgumentParser(prog="python -m machmoe.benchmark.peers")
    ap.add_argument("--peer", required=True, choices=sorted(ADAPTERS))
    ap.add_argument("--config", required=True)
    ap.add_argument("--settings", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    cfg = Config(**json.loads(a.config))
    s = Settings(**json.loads(a.settings))
    if s.torch_device.type == "cuda" and s.torch_device.index is not None:
        torch.cuda.set_device(s.torch_device)  # (as the parent's cli: events record on the current device's stream)
    try:
        weights = make_weights(cfg, s.torch_dtype, s.torch_device, s.seed)
        x, go = make_inputs(cfg, s.torch_dtype, s.torch_device, s.seed)
        impl = ADAPTERS[a.peer](weights, cfg)
        res = measure(impl, x, go, cfg, s, weights)
    except BaseException as e:  # recorded in the row; the parent goes on
        res = _error(e)
    res.setdefault("kind", "peer")
    with open(a.out, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
