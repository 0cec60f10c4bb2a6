"""Measures every implementation on every configuration: times (CUDA events, median), TFLOP/s, allocator memory,
the float64 agreement check; one failure (out of memory, a crash, a peer that dies) is recorded and the run goes on."""
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import torch

from . import impls as I
from . import reference
from .baselines import copy_bandwidth, cublas_bound, time_ms
from .configs import Config
from .report import TIMES


@dataclass
class Settings:
    device: str = "cuda"
    dtype: str = "bf16"
    warmup: int = 3
    iters: int = 10
    warmup_ms: float = 0.0  # GPU: untimed calls for at least this long before each timing (baselines.time_ms)
    time_ms: float = 0.0    # GPU: timed calls for at least this long (and at least `iters` of them)
    check_tokens: int = 4096
    seed: int = 0
    impls: List[str] = field(default_factory=lambda: list(I.IN_PROCESS) + [I.BOUND])
    peers: List[str] = field(default_factory=list)
    peer_timeout: float = 1800.0

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


def model_flops(pairs: int, cfg: Config) -> Dict[str, float]:
    """docs/TARGETS.md (GLU): forward 6 TK n d, backward 12 TK n d, over the pairs really routed."""
    unit = float(pairs) * cfg.n * cfg.d
    return {"forward": 6 * unit, "backward": 12 * unit, "fwdbwd": 18 * unit}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _error(e: BaseException) -> dict:
    oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return {"status": "out_of_memory" if oom else "failed", "error": f"{type(e).__name__}: {first}"[:500],
            "traceback": traceback.format_exc()[-4000:]}


def check_tokens(cfg: Config, count: int, device: torch.device, seed: int) -> torch.Tensor:
    """The sorted sample S of tokens the float64 check covers (all tokens when count >= T)."""
    if count <= 0 or count >= cfg.T:
        return torch.arange(cfg.T, device=device)
    g = torch.Generator().manual_seed(seed + 17)
    return torch.sort(torch.randperm(cfg.T, generator=g)[:count]).values.to(device)


def measure(impl: "I.Impl", x: torch.Tensor, go: torch.Tensor, cfg: Config, s: Settings,
            weights: Dict[str, torch.Tensor]) -> dict:
    """One implementation on one configuration: first call, times, memory, agreement."""
    dev = x.device
    xr = x.detach().clone().requires_grad_()
    res: dict = {"status": "ok", "kind": impl.kind, "routing": impl.routing}

    def fwd():
        return impl.forward(xr)

    def step():
        impl.zero_grad()
        xr.grad = None
        fwd().output.backward(go)

    # First call (JIT compilation, autotuning, lazy initialisation) timed apart from the steady state.
    _sync(dev)
    t0 = time.perf_counter()
    impl.zero_grad()
    first = fwd()
    first.output.backward(go)
    _sync(dev)
    res["first_call_s"] = time.perf_counter() - t0
    counts = first.counts
    res["pairs"] = int(counts.sum()) if counts is not None else cfg.T * cfg.K
    del first

    res["forward_ms"] = time_ms(fwd, dev, s.warmup, s.iters, s.warmup_ms, s.time_ms)
    # Backward alone: a fresh forward before each timed backward (outside the timing); warm-up and window as
    # time_ms's, counted in forward + backward steps.
    for _ in range(s.warmup):
        step()
    t0 = time.perf_counter()
    while dev.type == "cuda" and (time.perf_counter() - t0) * 1e3 < s.warmup_ms:
        step()
        _sync(dev)
    times = []
    t0 = time.perf_counter()
    while len(times) < s.iters or (dev.type == "cuda" and (time.perf_counter() - t0) * 1e3 < s.time_ms):
        impl.zero_grad()
        xr.grad = None
        o = fwd().output
        _sync(dev)
        times.append(time_ms(lambda: o.backward(go), dev, 0, 1))
        del o
    res["backward_ms"] = statistics.median(times)  # (as time_ms's, for the forward and the step)
    res["fwdbwd_ms"] = time_ms(step, dev, s.warmup, s.iters, s.warmup_ms, s.time_ms)
    flops = model_flops(res["pairs"], cfg)
    for k in ("forward", "backward", "fwdbwd"):
        res[f"{k}_tflops"] = flops[k] / (res[f"{k}_ms"] * 1e9)

    # Memory (the PyTorch allocator): activation = what the forward leaves allocated for the backward, the output
    # excluded and the input X counted once (docs/TARGETS.md); peak = highest allocation over forward + backward
    # above what was allocated before (inputs and parameters; the gradients it allocates are counted).
    if dev.type == "cuda":
        impl.zero_grad()
        xr.grad = None
        _free(dev)
        _sync(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        # Only the output is held here: the router logits the forward returns are dropped first, so that they count
        # only where the implementation keeps them for its backward (docs/TARGETS.md: the output excluded).
        out = fwd().output
        _sync(dev)
        retained = torch.cuda.memory_allocated(dev) - base
        out_bytes = out.numel() * out.element_size()
        out.backward(go)
        _sync(dev)
        res["forward_retained_bytes"] = retained
        res["activation_bytes"] = retained - out_bytes + x.numel() * x.element_size()
        res["peak_bytes"] = torch.cuda.max_memory_allocated(dev) - base
        del out
    else:
        res["forward_retained_bytes"] = res["activation_bytes"] = res["peak_bytes"] = None

    # Agreement with the float64 reference on a sample of tokens.
    S = check_tokens(cfg, s.check_tokens, dev, s.seed)
    go_s = torch.zeros_like(go)
    go_s[S] = go[S]
    impl.zero_grad()
    xr.grad = None
    f = fwd()
    f.output.backward(go_s)
    logits = f.logits if f.logits is not None else impl.logits_for_check(xr.detach())
    res["agreement"] = reference.check(xr.detach(), xr.grad, go_s, S, weights, f.output, logits, impl.grads(),
                                       K=cfg.K, routing=impl.routing, tile=cfg.tile, selection=f.selection,
                                       counts=f.counts)
    del f
    impl.zero_grad()
    return res


def _versions() -> dict:
    import platform
    v = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import machmoe
        v["machmoe"] = machmoe.__version__
    except Exception as e:  # pragma: no cover - reported, not fatal
        v["machmoe"] = f"import failed: {e}"
    from importlib import metadata
    for dist in ("sonic-moe", "scattermoe", "megablocks", "quack-kernels", "nvidia-cutlass-dsl"):
        try:
            v[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return v


def device_info(s: Settings) -> dict:
    dev = s.torch_device
    info = {"type": dev.type}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(name=p.name, capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
                    memory_bytes=p.total_memory)
    else:
        import platform
        info.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info


def run_config(cfg: Config, s: Settings, progress=None, copy_bw: Optional[float] = None) -> dict:
    dev, dtype = s.torch_device, s.torch_dtype
    entry = {"config": cfg.as_dict(), "status": "ok", "results": {}}
    try:
        weights = I.Weights(cfg, dtype, dev, s.seed)
        x, go = I.make_inputs(cfg, dtype, dev, s.seed)
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        entry.update(_error(e))
        _free(dev)
        return entry
    for name in s.impls:
        if progress:
            progress.step(f"{cfg.name}: {name}")
        if name == I.BOUND:
            try:
                bw = copy_bw or copy_bandwidth(dev, None, s.warmup_ms, s.time_ms)
                b = cublas_bound(cfg.T, cfg.d, cfg.n, cfg.E, cfg.K, dtype, dev, bw, s.warmup, s.iters, s.warmup_ms,
                                 s.time_ms)
                b["copy_bandwidth_GBps"] = bw * 1e-9  # per row: an --append run measures its own
                flops = model_flops(cfg.T * cfg.K, cfg)
                b.update({f"{k}_tflops": flops[k] / (b[f"{k}_ms"] * 1e9) for k in ("forward", "backward", "fwdbwd")})
                entry["results"][name] = {"status": "ok", "kind": "bound", **b}
            except BaseException as e:
                if isinstance(e, KeyboardInterrupt):
                    raise
                entry["results"][name] = _error(e)
            _free(dev)
            continue
        impl = None
        try:
            impl = I.build(name, weights, cfg)
            entry["results"][name] = measure(impl, x, go, cfg, s, weights.values())
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            entry["results"][name] = _error(e)
        finally:
            if impl is not None:
                impl.close()
            del impl
            weights.zero_grad(set_to_none=True)
            _free(dev)
    del weights, x, go
    _free(dev)
    for peer in s.peers:
        if progress:
            progress.step(f"{cfg.name}: {peer} (subprocess)")
        entry["results"][peer] = run_peer(peer, cfg, s)
    return entry


def merge_rounds(entries: List[dict]) -> dict:
    """One configuration's entry from several rounds of run_config (each round runs every implementation and peer
    once, so a slow phase of the GPU's clock, e.g. at its power cap, falls on every implementation instead of on the
    one that happened to run then): each time the median over the rounds, the per-round times under "rounds", and
    the rest (memory, agreement, first call) from the first round. An implementation that failed in any round keeps
    that round's failure."""
    merged = copy.deepcopy(entries[0])
    if len(entries) == 1 or merged.get("status") != "ok":
        return merged
    for name, r in merged["results"].items():
        # A round whose configuration failed as a whole (e.g. out of memory making the weights) has no rows: its
        # failure stands for every implementation's row.
        rounds = [e["results"].get(name) or {"status": e.get("status", "failed"), "kind": r.get("kind"),
                                             "error": e.get("error", "no result in this round")} for e in entries]
        failed = next((x for x in rounds if x.get("status") != "ok"), None)
        if failed is not None:
            merged["results"][name] = copy.deepcopy(failed)
            continue
        per_round = {}
        for k in TIMES:
            values = [x.get(f"{k}_ms") for x in rounds]
            if any(v is None for v in values):
                continue
            per_round[f"{k}_ms"] = values
            median = statistics.median(values)
            if r.get(f"{k}_tflops") is not None and r[f"{k}_ms"]:
                r[f"{k}_tflops"] *= r[f"{k}_ms"] / median  # the same FLOPs over the median time
            r[f"{k}_ms"] = median
        r["rounds"] = per_round
    return merged


def run_peer(peer: str, cfg: Config, s: Settings) -> dict:
    """A peer in its own process (a crash or a hang costs only its row)."""
    import tempfile
    if torch.device(s.device).type != "cuda":
        return {"status": "skipped", "kind": "peer", "error": "peers run on CUDA only"}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "machmoe.benchmark.peers", "--peer", peer, "--config",
               json.dumps(cfg.as_dict()), "--settings", json.dumps(asdict(s)), "--out", out]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=s.peer_timeout)
        except subprocess.TimeoutExpired:
            return {"status": "failed", "kind": "peer", "error": f"timed out after {s.peer_timeout:.0f} s"}
        if os.path.exists(out):
            with open(out) as f:
                return json.load(f)
        tail = (p.stderr or p.stdout or "").strip().splitlines()[-5:]
        return {"status": "failed", "kind": "peer", "error": f"exit status {p.returncode}: " + " | ".join(tail)[-800:]}
