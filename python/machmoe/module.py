"""machmoe.MoE: a drop-in Mixture-of-Experts layer."""
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from . import functional as F
from ._options import GLU_ACTIVATIONS, ACTIVATIONS, ACTIVATION_MEMORY, ROUNDINGS, SCORES, WEIGHT_LAYOUTS, code


@dataclass
class MoEOutput:
    output: Tensor                      # same shape as the input
    router_logits: Tensor               # (tokens, experts)
    expert_counts: Tensor               # (experts,) int32, on the device
    aux_loss: Optional[Tensor] = None   # Switch load-balancing loss, when aux_loss_coef > 0 (scaled; 0 for no tokens)
    z_loss: Optional[Tensor] = None     # router z-loss, when z_loss_coef > 0 (scaled; 0 for no tokens)


class MoE(nn.Module):
    """Token-choice MoE layer with gated (or plain) expert MLPs.

    Parameters are plain nn.Parameters (FSDP2's fully_shard shards them like any other): router_weight (E, d),
    w1 (E, 2n | n, d), w2 (E, d, n), and b1 (E, 2n | n), b2 (E, d) when bias=True.
    forward(x) takes (..., hidden_size) and returns MoEOutput. An input with no tokens ((0, d), (B, 0, d), ...) is
    ordinary: an empty output, zero parameter gradients, and aux_loss / z_loss defined as 0 (not NaN).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 activation: str = "swiglu", bias: bool = False, score: str = "softmax_topk",
                 routing: str = "topk", rounding: str = "nearest", tile: int = 128,
                 weight_layout: str = "interleaved", activation_memory: str = "preact",
                 aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, device=None, dtype=None):
        super().__init__()
        for table, value, name in ((ACTIVATIONS, activation, "activation"), (SCORES, score, "score"),
                                   (ROUNDINGS, rounding, "rounding"), (WEIGHT_LAYOUTS, weight_layout, "weight_layout"),
                                   (ACTIVATION_MEMORY, activation_memory, "activation_memory")):
            code(table, value, name)
        if routing not in ("topk", "token_rounding"):
            raise ValueError(f"machmoe: argument 'routing': expected 'topk' or 'token_rounding', got {routing!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"machmoe: argument 'top_k': expected an integer in [1, {num_experts}], got {top_k}")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.activation, self.score, self.routing, self.rounding, self.tile = activation, score, routing, rounding, tile
        self.weight_layout, self.activation_memory = weight_layout, activation_memory
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        rows = 2 * intermediate_size if activation in GLU_ACTIVATIONS else intermediate_size
        kw = dict(device=device, dtype=dtype)
        self.router_weight = nn.Parameter(torch.empty(num_experts, hidden_size, **kw))
        self.w1 = nn.Parameter(torch.empty(num_experts, rows, hidden_size, **kw))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **kw))
        self.b1 = nn.Parameter(torch.empty(num_experts, rows, **kw)) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden_size, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.router_weight.normal_(0.0, 1.0 / math.sqrt(self.hidden_size))
            self.w1.normal_(0.0, 1.0 / math.sqrt(self.hidden_size))
            self.w2.normal_(0.0, 1.0 / math.sqrt(self.intermediate_size))
            if self.b1 is not None:
                self.b1.zero_()
                self.b2.zero_()

    def forward(self, x: Tensor) -> MoEOutput:
        shape = x.shape
        if shape[-1] != self.hidden_size:
            raise ValueError(f"machmoe: argument 'x': expected (..., {self.hidden_size}), got {tuple(shape)}")
        flat = x.reshape(-1, self.hidden_size)
        out, logits, counts = F.moe(flat, self.router_weight, self.w1, self.w2, self.b1, self.b2, top_k=self.top_k,
                                    activation=self.activation, score=self.score, routing=self.routing,
                                    rounding=self.rounding, tile=self.tile, weight_layout=self.weight_layout,
                                    activation_memory=self.activation_memory)
        result = MoEOutput(out.reshape(shape), logits, counts)
        if self.aux_loss_coef > 0:
            result.aux_loss = self.aux_loss_coef * F.load_balancing_loss(logits, counts)
        if self.z_loss_coef > 0:
            result.z_loss = self.z_loss_coef * F.router_z_loss(logits)
        return result

    @torch.no_grad()
    def load_hf_experts(self, gate_proj: Sequence[Tensor] = None, up_proj: Sequence[Tensor] = None,
                        down_proj: Sequence[Tensor] = None, gate_up_proj: Optional[Tensor] = None,
                        router: Optional[Tensor] = None) -> "MoE":
        """Loads expert weights from the usual checkpoint layouts: per-expert gate_proj/up_proj (n, d) and down_proj
        (d, n) lists, or a fused gate_up_proj (E, 2n, d) ([gate; up] rows, or (E, d, 2n) which is transposed), plus
        the router (E, d). Writes into this module's layout (interleaved or concatenated) without keeping copies."""
        if self.activation not in GLU_ACTIVATIONS:
            raise ValueError("machmoe: load_hf_experts expects a gated (GLU) activation")
        n, d, E = self.intermediate_size, self.hidden_size, self.num_experts
        if gate_up_proj is not None:
            g = gate_up_proj if tuple(gate_up_proj.shape) == (E, 2 * n, d) else gate_up_proj.transpose(1, 2)
            if tuple(g.shape) != (E, 2 * n, d):
                raise ValueError(f"machmoe: argument 'gate_up_proj': expected ({E}, {2 * n}, {d}) or "
                                 f"({E}, {d}, {2 * n}), got {tuple(gate_up_proj.shape)}")
            gate, up = g[:, :n], g[:, n:]
        else:
            if gate_proj is None or up_proj is None or len(gate_proj) != E or len(up_proj) != E:
                raise ValueError(f"machmoe: expected {E} gate_proj and up_proj weights, or gate_up_proj")
            gate, up = torch.stack(list(gate_proj)), torch.stack(list(up_proj))
        if self.weight_layout == "interleaved":
            self.w1.view(E, n, 2, d)[:, :, 0].copy_(gate)
            self.w1.view(E, n, 2, d)[:, :, 1].copy_(up)
        else:
            self.w1[:, :n].copy_(gate)
            self.w1[:, n:].copy_(up)
        if down_proj is not None:
            if len(down_proj) != E:
                raise ValueError(f"machmoe: argument 'down_proj': expected {E} weights, got {len(down_proj)}")
            self.w2.copy_(torch.stack(list(down_proj)))
        if router is not None:
            self.router_weight.copy_(router)
        return self
