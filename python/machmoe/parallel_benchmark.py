"""Expert-parallel benchmark: per-GPU tokens/s of one ExpertParallelMoE layer's forward + backward at the EP size of
the launch (= the world size), the same tokens per GPU at every size; the all-to-all's share of that time; and the
scaling efficiency against an EP = 1 run.

    torchrun --standalone --nproc-per-node 8 -m machmoe.parallel_benchmark --json ep8.json
    torchrun --standalone --nproc-per-node 1 -m machmoe.parallel_benchmark --json ep1.json
    torchrun --standalone --nproc-per-node 8 -m machmoe.parallel_benchmark --baseline ep1.json --json ep8.json
    torchrun --standalone --nproc-per-node 2 -m machmoe.parallel_benchmark --device cpu --tiny   # gloo smoke test

Weak scaling, as the SonicMoE paper's 64-GPU run: every GPU holds T tokens (the configuration's T, docs/TARGETS.md)
and E / ep_size experts, so with balanced routing every GPU does the same expert work at every EP size and the
per-GPU tokens/s at EP = N over that at EP = 1 is the scaling efficiency (1.0: the exchanges cost nothing).

What is timed, per iteration, on every rank: forward + backward of the layer (router, routing, counts exchange, the
split-size host read of the default mode, dispatch all-to-all, local experts on machmoe's kernels, reverse
all-to-all, combine, and all their gradients), with fresh gradients (set to None) and a fixed upstream gradient.
Ranks are aligned by a barrier before each iteration; an iteration's time is the slowest rank's (the step waits for
it); the figure is the median over iterations. CUDA events on the GPU, perf_counter on the CPU.

The all-to-all share, measured two ways:
  * in the layer: a separate pass of the same iterations with every exchange of machmoe.parallel (the counts
    exchange, the dispatch of rows and pair data and the return of rows in forward, their reverses in backward)
    bracketed by events. This includes waiting for a slower partner (load imbalance, skew); the events themselves
    cost a little, so the layer time used for the share is the instrumented pass's own.
  * alone: the exchanges recorded in the last instrumented iteration (same shapes, dtypes and split sizes) run back
    to back without the layer: the transfer cost without the waiting.
At EP = 1 the layer exchanges nothing (a group of one keeps its rows), so both are 0.
Rank 0 writes the JSON (--json) and prints a summary. Exit status 1 when a configuration failed or gave non-finite
output (its entry is in the JSON; one skipped because E is not a multiple of the EP size is not a failure, but a
run in which every configuration was skipped is, since it measured nothing), 2 for a usage error. NCCL runs with
NVLink multicast off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, set here before the process group
exists).
"""
import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Dict, List, Optional

# NVLink multicast stays off (a program using it can take a shared host's GPUs out of service).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from . import parallel as P  # noqa: E402
from .benchmark.configs import ALL, Config  # noqa: E402

FORMAT = 2  # 2: exchange bytes from the recorded exchanges (the default mode sends a row per token and rank)
DEFAULT_CONFIGS = ["7B-256", "30B-256"]
# --tiny (CPU, gloo): small enough for a 2-core CI machine; E divisible by 1, 2, 4 and 8.
TINY = [Config("tiny-64", 256, 64, 32, 8, 2, "cpu", "tiny"), Config("tiny-128", 192, 128, 64, 16, 4, "cpu", "tiny")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m machmoe.parallel_benchmark", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=None,
                   help=f"comma-separated configuration names (machmoe.benchmark's, e.g. 7B-256,30B-256,7B-512); "
                        f"default {','.join(DEFAULT_CONFIGS)}, with --tiny {','.join(c.name for c in TINY)}")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cuda: NCCL; cpu: gloo (smoke tests)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny configurations (for --device cpu); not with --configs (name them there instead)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32", "fp64"], default=None,
                   help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--tokens", type=int, default=None, help="tokens per GPU (default: the configuration's T)")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="capacity mode: C = ceil(factor * T * K / ep_size) rows per rank pair (default: the exact, "
                        "host-synchronising mode)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", default=None, help="an EP = 1 JSON of this benchmark: adds the scaling efficiency")
    p.add_argument("--json", default=None, help="where rank 0 writes the results")
    p.add_argument("--timeout", type=float, default=900.0, help="process-group timeout in seconds (> 0)")
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    # Refused here, on every rank alike, rather than as a failed row later (no median of zero timings; the CPU
    # reference computes in fp32 or fp64 only).
    if args.iters < 1:
        p.error(f"--iters: expected at least 1 timed iteration, got {args.iters}")
    if args.warmup < 0:
        p.error(f"--warmup: expected 0 or more, got {args.warmup}")
    if args.tokens is not None and args.tokens < 1:
        p.error(f"--tokens: expected at least 1 token per rank, got {args.tokens}")
    if args.capacity_factor is not None and not (math.isfinite(args.capacity_factor) and args.capacity_factor > 0):
        p.error(f"--capacity-factor: expected a finite number above 0, got {args.capacity_factor}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        p.error(f"--timeout: expected a finite number of seconds above 0, got {args.timeout}")
    if args.tiny and args.configs is not None:  # --configs would win, and --tiny be ignored
        p.error(f"--tiny picks the tiny configurations; with --configs name them there "
                f"({','.join(c.name for c in TINY)})")
    if args.device == "cpu" and args.dtype not in ("fp32", "fp64"):
        p.error(f"--dtype: expected fp32 or fp64 with --device cpu (the CPU reference), got {args.dtype}")
    return args


def _dtype(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}[name]


def configs_from(args) -> List[Config]:
    known = {**ALL, **{c.name: c for c in TINY}}
    names = [n.strip() for n in args.configs.split(",") if n.strip()] if args.configs else \
        [c.name for c in TINY] if args.tiny else DEFAULT_CONFIGS
    out = []
    for name in names:
        if name not in known:
            raise SystemExit(f"machmoe.parallel_benchmark: unknown configuration {name!r}; known: {', '.join(known)}")
        cfg = known[name]
        if args.tokens:
            cfg = Config(cfg.name, args.tokens, cfg.d, cfg.n, cfg.E, cfg.K, cfg.group, cfg.family, cfg.tile)
        out.append(cfg)
    return out


# ---- timing --------------------------------------------------------------------------------------------------

class _Clock:
    """Elapsed milliseconds between marks: CUDA events on the current stream, or perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def elapsed(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3


class _ExchangeTimer:
    """Brackets every exchange of machmoe.parallel (its module-level _all_to_all: counts, dispatch, combine and
    their backward reverses) with clock marks while active, and records each one's (shape, dtype, output splits,
    input splits), so that the last iteration's exchanges can be replayed alone."""

    def __init__(self, clock: _Clock):
        self.clock, self.marks, self.active = clock, [], False
        self.calls, self.last_calls = [], []
        self._original = P._all_to_all

    def __enter__(self):
        original, timer = self._original, self

        def timed(rows, out_splits, in_splits, group):
            if not timer.active:
                return original(rows, out_splits, in_splits, group)
            a = timer.clock.mark()
            out = original(rows, out_splits, in_splits, group)
            timer.marks.append((a, timer.clock.mark()))
            timer.calls.append((tuple(rows.shape), rows.dtype, out_splits, in_splits))
            return out

        P._all_to_all = timed
        return self

    def __exit__(self, *exc):
        P._all_to_all = self._original

    def take_ms(self) -> float:
        total = sum(self.clock.elapsed(a, b) for a, b in self.marks)
        self.marks = []
        self.last_calls, self.calls = self.calls, []
        return total


def _call_bytes(call, rank: int, world: int):
    """(bytes a rank sends in one recorded exchange, its own share included; the bytes that leave it)."""
    shape, dtype, _, in_splits = call
    rows = shape[0] if shape else 0
    row_bytes = (math.prod(shape[1:]) if len(shape) > 1 else 1) * torch.empty((), dtype=dtype).element_size()
    own = in_splits[rank] if in_splits is not None else rows // world
    return rows * row_bytes, (rows - own) * row_bytes


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_times(fn, device, warmup, iters, clock, timer: Optional[_ExchangeTimer] = None):
    """Per-iteration times (ms) on this rank, ranks aligned by a barrier before each; with a timer, also the
    exchange time of each iteration."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times, exchange = [], []
    for _ in range(iters):
        _sync(device)
        dist.barrier()
        if timer is not None:
            timer.active = True
        a = clock.mark()
        fn()
        b = clock.mark()
        times.append(clock.elapsed(a, b))
        if timer is not None:
            timer.active = False
            exchange.append(timer.take_ms())
    return times, exchange


def _gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _slowest_median(per_rank: List[List[float]]) -> float:
    """Median over iterations of the slowest rank's time."""
    return statistics.median(max(ts) for ts in zip(*per_rank))


# ---- one configuration ---------------------------------------------------------------------------------------

def run_config(cfg: Config, args, device: torch.device) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = _dtype(args.dtype)
    if cfg.E % world:
        return {"status": "skipped", "reason": f"E = {cfg.E} is not a multiple of the EP size {world}"}
    T = cfg.T
    capacity = None
    if args.capacity_factor is not None:
        capacity = max(1, math.ceil(args.capacity_factor * T * cfg.K / world))
    torch.manual_seed(args.seed)  # the same router on every rank; the experts from per-expert generators
    layer = P.ExpertParallelMoE(cfg.d, cfg.n, cfg.E, cfg.K, capacity=capacity, device=device, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(args.seed * 1000 + 17 + rank)  # inputs drawn on the device
    x = torch.randn(T, cfg.d, generator=g, device=device, dtype=dtype).requires_grad_()
    go = torch.randn(T, cfg.d, generator=g, device=device, dtype=dtype)
    last = {}

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = layer(x)
        out.output.backward(go)
        last["out"] = out

    clock = _Clock(device)
    times, _ = _step_times(step, device, args.warmup, args.iters, clock)
    with _ExchangeTimer(clock) as timer:
        times_instr, exchange = _step_times(step, device, 1, args.iters, clock, timer)

    # The exchanges alone: those of the last instrumented iteration, replayed with the same shapes and splits.
    group = dist.group.WORLD
    calls = timer.last_calls
    buffers = [torch.zeros(shape, dtype=dtype_, device=device) for shape, dtype_, _, _ in calls]

    def exchanges():
        for buf, (_, _, out_splits, in_splits) in zip(buffers, calls):
            P._all_to_all(buf, out_splits, in_splits, group)

    # A group of one exchanges nothing (machmoe.parallel skips the collectives): no transfer to time.
    alone = _step_times(exchanges, device, args.warmup, args.iters, clock)[0] if calls else [0.0] * args.iters
    call_bytes = [_call_bytes(c, rank, world) for c in calls]
    sent_bytes, leaving_bytes = sum(b[0] for b in call_bytes), sum(b[1] for b in call_bytes)
    # Rows my experts received in the forward: the first exchange of rows of width d (the dispatch) in the default
    # mode; in capacity mode that exchange is the static blocks, empty slots included, so the plan's count.
    dispatch = next((c for c in calls if len(c[0]) == 2 and c[0][1] == cfg.d and c[1] == dtype), None)
    if dispatch is None:
        received = None
    elif capacity is None:
        received = sum(dispatch[2])
    else:
        received = int(layer.dispatch(x.detach()).tokens_per_expert.sum())
    # Pairs my experts received: every rank's pairs per expert, summed, my experts' share.
    counts = last["out"].expert_counts.to(torch.int64)
    if world > 1:
        dist.all_reduce(counts, group=group)
    El = cfg.E // world
    received_pairs = int(counts[rank * El:(rank + 1) * El].sum())
    dropped = int(last["out"].dropped_rows) if last["out"].dropped_rows is not None else None
    finite = bool(torch.isfinite(last["out"].output).all())
    del buffers

    mine = {"times": times, "times_instr": times_instr, "exchange": exchange, "alone": alone, "received": received,
            "received_pairs": received_pairs, "sent_bytes": sent_bytes, "leaving_bytes": leaving_bytes,
            "exchanges": len(calls), "dropped": dropped, "finite": finite,
            "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    every = _gather(mine)
    if rank != 0:
        return {}
    step_ms = _slowest_median([r["times"] for r in every])
    instr_ms = _slowest_median([r["times_instr"] for r in every])
    exch_ms = statistics.median(statistics.mean(v) for v in zip(*[r["exchange"] for r in every]))
    alone_ms = _slowest_median([r["alone"] for r in every])
    # Bytes each rank sends per forward + backward (every exchange), its own share (a local copy) included, and
    # the bytes that leave it.
    sent_bytes = statistics.mean(r["sent_bytes"] for r in every)
    leaving_bytes = statistics.mean(r["leaving_bytes"] for r in every)
    pairs = T * cfg.K
    rows = [r["received"] for r in every if r["received"] is not None]
    return {
        "status": "ok" if all(r["finite"] for r in every) else "non_finite_output",
        "ep_size": world, "tokens_per_gpu": T, "experts_per_gpu": cfg.E // world, "capacity": capacity,
        "step_ms": step_ms,
        "step_ms_per_rank": [statistics.median(r["times"]) for r in every],
        "tokens_per_s_per_gpu": T / (step_ms * 1e-3),
        "model_tflops_per_gpu": 18.0 * pairs * cfg.n * cfg.d / (step_ms * 1e-3) / 1e12,
        "all_to_all": {
            "in_layer_ms": exch_ms, "instrumented_step_ms": instr_ms, "in_layer_share": exch_ms / instr_ms,
            "alone_ms": alone_ms, "alone_share": alone_ms / step_ms,
            "exchanges_per_step": max(r["exchanges"] for r in every),
            "bytes_sent_per_gpu": sent_bytes, "bytes_leaving_per_gpu": leaving_bytes,
            "alone_algbw_GBps": sent_bytes / (alone_ms * 1e-3) / 1e9 if alone_ms > 0 else None,
            "alone_leaving_GBps": leaving_bytes / (alone_ms * 1e-3) / 1e9 if alone_ms > 0 else None,
        },
        # Rows that reached a rank's experts (one per token and rank in the default mode, one per sent pair in
        # capacity mode; none at EP = 1, where nothing moves) and the pairs they carry (routing imbalance: against
        # T*K).
        "received_rows": {"min": min(rows), "max": max(rows), "mean": statistics.mean(rows)} if rows else None,
        "received_pairs": {"min": min(r["received_pairs"] for r in every),
                           "max": max(r["received_pairs"] for r in every),
                           "mean": statistics.mean(r["received_pairs"] for r in every), "balanced": pairs},
        "dropped_rows": None if capacity is None else sum(r["dropped"] for r in every),
        "peak_bytes_max": max(r["peak_bytes"] for r in every) if device.type == "cuda" else None,
    }


def _baseline(path: Optional[str]) -> Dict[str, dict]:
    if not path:
        return {}
    doc = json.load(open(path))
    if doc.get("ep_size") != 1:
        raise SystemExit(f"--baseline {path}: expected an EP = 1 run of this benchmark, got ep_size "
                         f"{doc.get('ep_size')!r}")
    return {e["config"]["name"]: e for e in doc["configs"] if e.get("status") == "ok"}


def _environment(device: torch.device, args) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
           "backend": dist.get_backend(), "device_type": device.type,
           "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
           "TORCH_SYMM_MEM_DISABLE_MULTICAST": os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST")}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 — informational only
            env["nccl"] = None
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    configs = configs_from(args)
    baseline = _baseline(args.baseline)  # before the process group: a refusal stops every rank alike
    if "RANK" not in os.environ:  # a plain `python -m`: one process, EP = 1
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT") or str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("machmoe.parallel_benchmark: no CUDA device (use --device cpu --tiny for the gloo smoke test)",
                  file=sys.stderr)
            return 2
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=args.timeout), device_id=device)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = []  # rank 0's configurations whose status is not "ok" (skipped ones aside): the exit status is 1
    measured = 0  # rank 0's configurations that ran ("ok"): none at all is a failure too (nothing was measured)
    doc = {"benchmark": "machmoe.parallel_benchmark", "format": FORMAT, "ep_size": world,
           "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "settings": {k: v for k, v in vars(args).items() if k != "json"},
           "environment": _environment(device, args), "configs": []}
    for cfg in configs:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            result = run_config(cfg, args, device)
        except Exception as e:
            oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
            result = {"status": "out_of_memory" if oom else "failed",
                      "error": f"{type(e).__name__}: {str(e).strip()[:500]}"}
            print(f"rank {rank}: {cfg.name} failed: {result['error']}", file=sys.stderr, flush=True)
            if rank == 0:
                doc["configs"].append({"config": cfg.as_dict(), **result})
                _write(doc, args.json)
                failed.append(cfg.name)
            if world > 1:  # the other ranks may wait in a collective for this one: stop (torchrun ends them all)
                raise
            _free(device)
            continue
        if rank == 0:
            entry = {"config": cfg.as_dict(), **result}
            base = baseline.get(cfg.name)
            if base is not None and result.get("status") == "ok":
                entry["scaling_efficiency"] = result["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
                entry["baseline_tokens_per_s_per_gpu"] = base["tokens_per_s_per_gpu"]
                if base.get("tokens_per_gpu") != result["tokens_per_gpu"]:
                    entry["scaling_efficiency_note"] = "the baseline ran another number of tokens per GPU"
            else:
                entry["scaling_efficiency"] = 1.0 if world == 1 and result.get("status") == "ok" else None
            doc["configs"].append(entry)
            _write(doc, args.json)
            _print(entry)
            if result.get("status") not in ("ok", "skipped"):  # skipped: E is not a multiple of the EP size
                failed.append(cfg.name)
            measured += result.get("status") == "ok"
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
    if failed:
        print(f"machmoe.parallel_benchmark: {len(failed)} configuration(s) did not run cleanly: {', '.join(failed)}",
              file=sys.stderr, flush=True)
        return 1
    if rank == 0 and measured == 0:  # every configuration skipped (E not a multiple of the EP size): no figure
        print(f"machmoe.parallel_benchmark: no configuration ran at EP = {world} (every one was skipped: its number of "
              f"experts is not a multiple of the EP size); nothing was measured", file=sys.stderr, flush=True)
        return 1
    return 0


def _free(device):
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _write(doc, path):
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)


def _print(e):
    c = e["config"]
    if e.get("status") != "ok":
        print(f"{c['name']}: {e.get('status')} {e.get('reason', e.get('error', ''))}", flush=True)
        return
    a = e["all_to_all"]
    eff = e.get("scaling_efficiency")
    exchange = "no all-to-all (a group of one sends nothing)" if e["ep_size"] == 1 else (
        f"all-to-all {100 * a['in_layer_share']:.1f}% in the layer ({a['in_layer_ms']:.3f} ms), "
        f"{100 * a['alone_share']:.1f}% alone ({a['alone_ms']:.3f} ms, {a['bytes_sent_per_gpu'] / 1e9:.3f} GB sent "
        f"per GPU, {a['bytes_leaving_per_gpu'] / 1e9:.3f} GB leaving it at {a['alone_leaving_GBps']:.1f} GB/s)")
    print(f"{c['name']} (T={e['tokens_per_gpu']}/GPU d={c['d']} n={c['n']} E={c['E']} K={c['K']}) EP={e['ep_size']}: "
          f"fwd+bwd {e['step_ms']:.3f} ms, {e['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, "
          f"{e['model_tflops_per_gpu']:.1f} TFLOP/s/GPU; {exchange}; scaling efficiency "
          f"{'n/a' if eff is None else f'{eff:.3f}'}", flush=True)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without the interpreter's C++ teardown: after a complete gloo run on a loaded CPU machine, torch 2.11
    # sometimes aborts there ("terminate called without an active exception", no Python frame left; seen about once
    # in 6 runs with the cores busy), which torchrun reports as a failure of a run whose results are all written.
    os._exit(code)
