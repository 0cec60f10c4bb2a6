"""The implementations the benchmark runs in its own process, behind one small interface, all on the same weights:
machmoe (default, recompute mode, token rounding) and the two PyTorch baselines of baselines.py."""
import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch
from torch import Tensor, nn

from .baselines import GroupedMMMoE, LoopMoE
from .configs import Config

MACHMOE = ("machmoe", "machmoe-recompute", "machmoe-token-rounding")
BASELINES = ("torch-grouped-mm", "torch-loop")
BOUND = "cublas-bound"
IN_PROCESS = MACHMOE + BASELINES


@dataclass
class Forward:
    output: Tensor
    logits: Optional[Tensor]              # (T, E) values the routing used; None: ask logits_for_check()
    selection: Optional[Tensor] = None    # (T, K) chosen experts, when the implementation reports them
    counts: Optional[Tensor] = None       # (E,) pairs per expert, when reported


class Weights(nn.Module):
    """One layer's parameters in machmoe.MoE's layout, shared by every in-process implementation."""

    def __init__(self, cfg: Config, dtype: torch.dtype, device: torch.device, seed: int):
        super().__init__()
        w = make_weights(cfg, dtype, device, seed)
        self.router_weight, self.w1, self.w2 = (nn.Parameter(w[k]) for k in ("router_weight", "w1", "w2"))

    def values(self) -> Dict[str, Tensor]:
        return {"router_weight": self.router_weight, "w1": self.w1, "w2": self.w2}


def _generator(device: torch.device, seed: int, salt: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + salt)


def make_weights(cfg: Config, dtype: torch.dtype, device: torch.device, seed: int) -> Dict[str, Tensor]:
    """docs/TARGETS.md's magnitudes: weights ~ N(0, 1/fan_in), drawn on the device from seeded generators (the same
    values in every process on the same device, which is how peer subprocesses get the same weights)."""
    g = lambda salt: _generator(device, seed, salt)  # noqa: E731
    rw = torch.randn(cfg.E, cfg.d, generator=g(2), device=device, dtype=torch.float32) / math.sqrt(cfg.d)
    w1 = torch.randn(cfg.E, 2 * cfg.n, cfg.d, generator=g(3), device=device, dtype=torch.float32) / math.sqrt(cfg.d)
    w2 = torch.randn(cfg.E, cfg.d, cfg.n, generator=g(4), device=device, dtype=torch.float32) / math.sqrt(cfg.n)
    return {"router_weight": rw.to(dtype), "w1": w1.to(dtype), "w2": w2.to(dtype)}


def make_inputs(cfg: Config, dtype: torch.dtype, device: torch.device, seed: int):
    """x ~ N(0, 1) (T, d) and an upstream gradient ~ N(0, 1), fresh on the device (never zeros)."""
    x = torch.randn(cfg.T, cfg.d, generator=_generator(device, seed, 1), device=device, dtype=torch.float32)
    go = torch.randn(cfg.T, cfg.d, generator=_generator(device, seed, 7), device=device, dtype=torch.float32)
    return x.to(dtype), go.to(dtype)


class Impl:
    """What the runner needs from an implementation."""
    name = "?"
    kind = "?"          # machmoe | baseline | peer
    routing = "topk"

    def forward(self, x: Tensor) -> Forward:
        raise NotImplementedError

    def grads(self) -> Dict[str, Optional[Tensor]]:
        """Gradients of router_weight, w1, w2 in machmoe's layout."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def logits_for_check(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass


class MachmoeImpl(Impl):
    kind = "machmoe"

    def __init__(self, name: str, weights: Weights, cfg: Config):
        import machmoe
        opts = {"machmoe": {}, "machmoe-recompute": {"activation_memory": "input_only"},
                "machmoe-token-rounding": {"routing": "token_rounding", "rounding": "nearest", "tile": cfg.tile}}[name]
        self.name, self.routing, self.tile = name, opts.get("routing", "topk"), cfg.tile
        m = machmoe.MoE(cfg.d, cfg.n, cfg.E, cfg.K, device="meta", dtype=weights.w1.dtype, **opts)
        for p in ("router_weight", "w1", "w2"):  # the shared parameters themselves: no copy
            setattr(m, p, getattr(weights, p))
        self.module, self.weights = m, weights

    def forward(self, x):
        o = self.module(x)
        return Forward(o.output, o.router_logits, None, o.expert_counts)

    def grads(self):
        return {k: v.grad for k, v in self.weights.values().items()}

    def zero_grad(self):
        self.weights.zero_grad(set_to_none=True)


class BaselineImpl(Impl):
    kind = "baseline"

    def __init__(self, name: str, weights: Weights, cfg: Config):
        cls = {"torch-grouped-mm": GroupedMMMoE, "torch-loop": LoopMoE}[name]
        m = cls(cfg.d, cfg.n, cfg.E, cfg.K, device="meta", dtype=weights.w1.dtype)
        for p in ("router_weight", "w1", "w2"):
            setattr(m, p, getattr(weights, p))
        self.name, self.module, self.weights = name, m, weights

    def forward(self, x):
        out, logits, idx = self.module(x)
        return Forward(out, logits, idx, None)

    def grads(self):
        return {k: v.grad for k, v in self.weights.values().items()}

    def zero_grad(self):
        self.weights.zero_grad(set_to_none=True)


def build(name: str, weights: Weights, cfg: Config) -> Impl:
    if name in MACHMOE:
        return MachmoeImpl(name, weights, cfg)
    if name in BASELINES:
        return BaselineImpl(name, weights, cfg)
    raise ValueError(f"unknown implementation {name!r}")
