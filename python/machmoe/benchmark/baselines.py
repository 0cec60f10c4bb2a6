"""The PyTorch baselines the benchmark runs beside machmoe, written here (no third-party code): what a user runs
today without machmoe.

* GroupedMMMoE: the torchtitan recipe on torch._grouped_mm: router GEMM, top-K, softmax over the K selected logits,
  sort the (token, expert) pairs by expert, pad each expert's rows to the grouped GEMM's alignment (torchtitan's
  generate_permute_indices), grouped GEMM up, SwiGLU, grouped GEMM down, weight by the scores and scatter-add the
  pairs back to their tokens (index_add_, fp32 accumulation). No host synchronisation.
* LoopMoE: the plain per-expert loop (Hugging Face style): the pairs sorted by expert, one host read of the counts
  to split them, one linear-SwiGLU-linear per expert, index_add_ back to the tokens.

Both hold machmoe.MoE's parameters in its layout (router_weight (E, d), w1 (E, 2n, d) with interleaved gate/up rows:
gate = rows 0::2, up = rows 1::2, w2 (E, d, n)) and compute the same function as machmoe's default layer (top-K,
score softmax_topk, SwiGLU, no bias): `from_machmoe(moe)` takes a module's weights (shared, not copied, by default).

cublas_bound(): docs/TARGETS.md's cuBLAS bound as benchmarks/gpu_bench.cu measures it, with torch.bmm (cuBLAS
strided-batched GEMMs) instead of cublasGemmStridedBatchedEx.
"""
import math
import statistics
import time
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def route_topk(x: Tensor, router_weight: Tensor, top_k: int) -> Tuple[Tensor, Tensor, Tensor]:
    """logits (T, E) = x W_r^T in the data type, the top-K experts (T, K) by torch.topk, their scores (T, K) fp32:
    softmax over the K selected logits (machmoe's score 'softmax_topk')."""
    logits = x @ router_weight.t()
    top, idx = torch.topk(logits.float(), top_k, dim=-1)
    return logits, idx, torch.softmax(top, dim=-1)


def _swiglu_interleaved(h: Tensor) -> Tensor:
    return F.silu(h[:, 0::2]) * h[:, 1::2]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (torch._grouped_mm's CPU backward refuses
    expanded gradients)."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


class _Base(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *, device=None,
                 dtype=None):
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        kw = dict(device=device, dtype=dtype)
        self.router_weight = nn.Parameter(torch.empty(num_experts, hidden_size, **kw))
        self.w1 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **kw))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **kw))
        if self.w1.device.type != "meta":
            with torch.no_grad():  # machmoe.MoE's initialisation
                self.router_weight.normal_(0.0, 1.0 / math.sqrt(hidden_size))
                self.w1.normal_(0.0, 1.0 / math.sqrt(hidden_size))
                self.w2.normal_(0.0, 1.0 / math.sqrt(intermediate_size))

    @classmethod
    def from_machmoe(cls, moe, share: bool = True):
        """The same layer as a machmoe.MoE (SwiGLU, interleaved w1, top-K, softmax_topk, no bias): its parameters
        themselves (share=True: gradients land in the same .grad) or copies."""
        if moe.activation != "swiglu" or moe.weight_layout != "interleaved" or moe.b1 is not None or \
                moe.routing != "topk" or moe.score not in ("softmax_topk", "topk_softmax_renorm"):
            raise ValueError("the baselines implement machmoe's default layer only: SwiGLU, interleaved w1, no bias, "
                             "top-K routing, softmax over the selected logits")
        m = cls(moe.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k, device="meta",
                dtype=moe.w1.dtype)
        for name in ("router_weight", "w1", "w2"):
            p = getattr(moe, name)
            setattr(m, name, p if share else nn.Parameter(p.detach().clone()))
        return m

    def forward(self, x: Tensor):
        """x (T, d) -> (out (T, d), router_logits (T, E), selected experts (T, K))."""
        raise NotImplementedError


class GroupedMMMoE(_Base):
    """The torch._grouped_mm MoE (torchtitan's recipe); see the module docstring."""

    def forward(self, x: Tensor):
        T, d = x.shape
        E, K = self.num_experts, self.top_k
        logits, idx, scores = route_topk(x, self.router_weight, K)
        flat = idx.reshape(-1)
        order = torch.sort(flat, stable=True).indices                     # pairs grouped by expert
        expert_sorted = flat.index_select(0, order)
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))                               # no host sync (bincount would sync)
        # Each expert's rows padded to the alignment the grouped GEMM wants (16 bytes of rows): static bound.
        align = max(1, 16 // x.element_size())
        padded = torch.div(counts + align - 1, align, rounding_mode="floor") * align
        rows = T * K + E * (align - 1)
        start_sorted = counts.cumsum(0) - counts
        start_padded = padded.cumsum(0) - padded
        j = torch.arange(T * K, device=x.device) - start_sorted.index_select(0, expert_sorted)
        slot = start_padded.index_select(0, expert_sorted) + j           # padded row of each sorted pair
        offs = padded.cumsum(0).to(torch.int32)
        token_sorted = torch.div(order, K, rounding_mode="floor")
        xs = x.new_zeros(rows, d).index_copy(0, slot, x.index_select(0, token_sorted))
        h = _ContiguousGrad.apply(torch._grouped_mm(xs, self.w1.transpose(-2, -1), offs=offs))
        a = _swiglu_interleaved(h)
        y = _ContiguousGrad.apply(torch._grouped_mm(a, self.w2.transpose(-2, -1), offs=offs))
        y_pairs = y.index_select(0, slot)
        s = scores.reshape(-1).index_select(0, order)
        out = torch.zeros(T, d, dtype=torch.float32, device=x.device).index_add_(
            0, token_sorted, y_pairs.float() * s.unsqueeze(1))
        return out.to(x.dtype), logits, idx


class LoopMoE(_Base):
    """The plain per-expert loop MoE; see the module docstring."""

    def forward(self, x: Tensor):
        T, d = x.shape
        K = self.top_k
        logits, idx, scores = route_topk(x, self.router_weight, K)
        flat = idx.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat)).tolist()                      # the host synchronisation
        token_sorted = torch.div(order, K, rounding_mode="floor")
        xs = x.index_select(0, token_sorted).split(counts)
        ys = []
        for e, xe in enumerate(xs):
            if xe.shape[0] == 0:
                continue
            ys.append(_swiglu_interleaved(xe @ self.w1[e].t()) @ self.w2[e].t())
        y = torch.cat(ys) if ys else x.new_zeros(0, d)
        s = scores.reshape(-1).index_select(0, order)
        out = torch.zeros(T, d, dtype=torch.float32, device=x.device).index_add_(
            0, token_sorted, y.float() * s.unsqueeze(1))
        return out.to(x.dtype), logits, idx


# ---- the cuBLAS bound (docs/TARGETS.md; benchmarks/gpu_bench.cu) ------------------------------------------------

def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int, warmup_ms: float = 0.0,
            min_ms: float = 0.0) -> float:
    """Median time of fn() in ms: CUDA events on the current stream on a GPU, perf_counter on the CPU.

    On a GPU, after `warmup` calls the untimed calls go on until `warmup_ms` have passed, and the timed calls number
    at least `iters` and last at least `min_ms` (each call waited for): a board at its power cap lowers its clock
    within a second of sustained load and keeps swinging it (an H100: 1200-1530 MHz under these GEMMs), so figures
    taken from an idle board, or over a few calls, catch another clock than a training loop runs at
    (docs/BENCHMARKS.md, session 42; machmoe-bench's --warmup-ms and --time-ms)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        t0 = time.perf_counter()
        while (time.perf_counter() - t0) * 1e3 < warmup_ms:
            fn()
            torch.cuda.current_stream(device).synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        while len(times) < iters or (time.perf_counter() - t0) * 1e3 < min_ms:
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: Optional[int] = None, warmup_ms: float = 0.0,
                   min_ms: float = 0.0) -> float:
    """Device-to-device copy bandwidth in bytes/s, bytes read + written (1 GiB on a GPU, as machmoe-bench)."""
    nbytes = nbytes or ((1 << 30) if device.type == "cuda" else (64 << 20))
    a = torch.full((nbytes,), 1, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a), device, 2, 10, warmup_ms, min_ms)
    del a, b
    return 2.0 * nbytes / (ms * 1e-3)


def batched_gemm_ms(E: int, M: int, N: int, Kd: int, dtype: torch.dtype, device: torch.device,
                    warmup: int = 2, iters: int = 10, warmup_ms: float = 0.0, min_ms: float = 0.0) -> float:
    """Time of E row-major (M x Kd)(Kd x N) products as one strided-batched GEMM (torch.bmm -> cuBLAS)."""
    a = torch.randn(E, M, Kd, device=device, dtype=dtype)
    b = torch.randn(E, Kd, N, device=device, dtype=dtype)
    c = torch.empty(E, M, N, device=device, dtype=dtype)
    ms = time_ms(lambda: torch.bmm(a, b, out=c), device, warmup, iters, warmup_ms, min_ms)
    del a, b, c
    return ms


def cublas_bound(T: int, d: int, n: int, E: int, K: int, dtype: torch.dtype, device: torch.device,
                 copy_bw: float, warmup: int = 2, iters: int = 10, warmup_ms: float = 0.0,
                 min_ms: float = 0.0) -> Dict[str, float]:
    """Idealised layer times (ms): every expert GEMM at cuBLAS speed with perfectly balanced routing
    (T_e = TK / E rows per expert), plus the aggregations' (TK d + T d) elements of the dtype (2 bytes each for bf16)
    at the copy bandwidth, nothing else (SwiGLU)."""
    Te, r = max(1, T * K // E), 2 * n
    itemsize = torch.empty((), dtype=dtype).element_size()
    agg = itemsize * (T * K * d + T * d) / copy_bw * 1e3
    g = lambda M, N, Kd: batched_gemm_ms(E, M, N, Kd, dtype, device, warmup, iters, warmup_ms, min_ms)  # noqa: E731
    up, down = g(Te, r, d), g(Te, d, n)
    da, dw2, dxe, dw1 = g(Te, n, d), g(d, n, Te), g(Te, d, r), g(r, d, Te)
    return {"forward_ms": up + down + agg, "backward_ms": da + dw2 + dxe + dw1 + agg,
            "fwdbwd_ms": up + down + da + dw2 + dxe + dw1 + 2 * agg, "aggregation_ms": agg,
            "up_ms": up, "down_ms": down, "dA_ms": da, "dW2_ms": dw2, "dX_ms": dxe, "dW1_ms": dw1}
