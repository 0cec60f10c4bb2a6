"""python -m machmoe.benchmark.overhead: what the PyTorch module adds on top of the C++ layer (target T14,
docs/TARGETS.md), both measured in one process on the same weights.

For each configuration, `machmoe.MoE` (forward, and forward + backward through autograd) and the C++ layer itself
(`torch.ops.machmoe.time_layer`: machmoe::forward / machmoe::backward on buffers allocated once, CUDA events in
C++, no autograd and no Python, the method of machmoe-bench) are timed with CUDA events, median over warmed-up
repetitions, with x and the upstream gradient drawn fresh (in place, outside the timed region) before every
repetition. Two modes:

* isolated (the T14 figure, machmoe-bench's method): the stream is synchronised before each timed region, so the
  host's latency before the first kernel (Python, the dispatcher, autograd, validation) counts;
* queued: the host queues every repetition ahead, so only GPU work counts (extra kernels, memsets, copies).

Isolated, the two sides alternate repetition by repetition (which goes first swapped every time), so that the drift
of an idle GPU's clocks falls on both; queued, they alternate in rounds of `--iters` repetitions each.
`--machmoe-bench PATH` also runs the C++ benchmark binary per configuration in a subprocess as a cross-check of the
in-process C++ timing. `--layers` times the isolated forward of each layer of the module path (the operator below
autograd, without grad, with autograd, the functional API, the module) against the C++ layer's, for the first
configuration, every repetition after the same refill and backward, so that consecutive rows differ by one layer's
latency; and each layer again with a sleep kernel queued ahead of it, so that its host latency is hidden: what is left
is GPU time, and the difference is what the GPU waited for the host. `--profile`
lists the kernels and CUDA API calls of one repetition of each side (torch.profiler) and their difference, which
is where an extra launch, memset or copy of the module shows up.
"""
import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Dict, List, Optional

import torch

from . import configs as C

TARGET = 1.03  # T14: the module within 3 % of the C++ layer, forward and forward + backward
MODES = ("isolated", "queued")
PASSES = ("forward", "fwdbwd")
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_OVER_TARGET = 4
# What --host-only does not use (it times one CPU shape, --host-shape): refused beside it rather than ignored.
NOT_HOST_ONLY = ("configs", "shape", "warmup", "modes", "target", "machmoe_bench", "layers", "profile")


# ---- arguments --------------------------------------------------------------------------------------------------

def _shape(text: str) -> C.Config:
    try:
        T, d, n, E, K = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected T,d,n,E,K (five integers), got {text!r}") from None
    if min(T, d, n, E, K) < 1 or K > E:
        raise argparse.ArgumentTypeError(f"expected positive sizes with K <= E, got {text!r}")
    return C.custom(f"custom-{T}-{d}-{n}-{E}-{K}", T, d, n, E, K)


def int_at_least(low: int):
    """An argparse type: an integer >= low, with a message naming the bound."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {v}")
        return v
    return parse


def _host_shape(text: str):
    try:
        T, d, n, E, K = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected T,d,n,E,K (five integers), got {text!r}") from None
    if T < 0 or min(d, n, E, K) < 1 or K > E:
        raise argparse.ArgumentTypeError(f"expected T >= 0, positive d, n, E, K and K <= E, got {text!r}")
    return T, d, n, E, K


_positive = int_at_least(1)
_nonnegative = int_at_least(0)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m machmoe.benchmark.overhead", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"exit status: 0 ok; {EXIT_FAILED} a configuration or its --machmoe-bench check failed (its row "
               f"says why; this wins over {EXIT_OVER_TARGET}); {EXIT_USAGE} usage error; {EXIT_OVER_TARGET} some "
               f"isolated ratio above --target")
    p.add_argument("--configs", default="main",
                   help="comma-separated configuration names or groups (default: the 12 main configurations)")
    p.add_argument("--shape", type=_shape, action="append", default=[], metavar="T,d,n,E,K",
                   help="an extra configuration by its sizes (repeatable); with --shape only, --configs is ignored "
                        "unless given explicitly")
    p.add_argument("--warmup", type=_nonnegative, default=5, help="untimed repetitions per round (default 5)")
    p.add_argument("--iters", type=_positive, default=20, help="timed repetitions per round (default 20)")
    p.add_argument("--rounds", type=_positive, default=2,
                   help="rounds (default 2): isolated, rounds x iters repetitions of each side, one of each in turn; "
                        "queued, each round times a block of iters per side, alternating which goes first")
    p.add_argument("--modes", default="isolated,queued", help="isolated, queued or both (default both)")
    p.add_argument("--target", type=float, default=TARGET, help=f"ratio the isolated figures must not exceed "
                   f"(default {TARGET})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="machmoe-overhead.json", help="where the JSON goes")
    p.add_argument("--machmoe-bench", default=None, metavar="PATH",
                   help="also run this machmoe-bench binary per configuration (subprocess) as a cross-check")
    p.add_argument("--host-only", action="store_true",
                   help="measure only the host time of the module path on CPU tensors (no GPU needed): tiny "
                        "shapes (--host-shape), so the CPU reference's arithmetic is negligible and what remains is "
                        "Python, the dispatcher, autograd and the binding, per call; there, each round times 10 x "
                        "--iters calls and there are 10 x --rounds rounds (default 200 calls x 20 rounds); the "
                        "options of the GPU run (--configs, --shape, --warmup, --modes, --target, --machmoe-bench, "
                        "--layers, --profile) are refused beside it")
    p.add_argument("--host-shape", type=_host_shape, default=(0, 8, 8, 4, 2), metavar="T,d,n,E,K",
                   help="the --host-only shape (default 0,8,8,4,2: no tokens); only with --host-only")
    p.add_argument("--layers", action="store_true",
                   help="also time each layer of the module path's forward isolated (operator below autograd, "
                        "without grad, with autograd, functional API, module) against the C++ layer's, for the "
                        "first configuration, rounds x iters repetitions each; and each layer again with a sleep "
                        "kernel queued ahead of it (its host latency hidden: GPU time only)")
    p.add_argument("--profile", action="store_true",
                   help="also list the kernels and CUDA API calls of one repetition of each side (torch.profiler) "
                        "for the first configuration, and their difference")
    return p


def _given(argv: List[str]) -> set:
    """The destinations of the options argv names (argparse's prefixes, e.g. --config for --configs, included)."""
    q = parser()
    for action in q._actions:
        action.default = argparse.SUPPRESS
    return set(vars(q.parse_args(argv)))


def parse(argv: List[str]):
    """The options, with the configurations resolved (ValueError for an unknown name or mode)."""
    p = parser()
    a = p.parse_args(argv)
    given = _given(argv)
    if a.host_only:
        ignored = ["--" + k.replace("_", "-") for k in NOT_HOST_ONLY if k in given]
        if ignored:
            p.error(f"--host-only times the host path on --host-shape only: {', '.join(ignored)} would be ignored")
    elif "host_shape" in given:
        p.error("--host-shape is the shape of --host-only: without it, it would be ignored")
    cfgs = C.select(a.configs) if ("configs" in given or not a.shape) else []
    a.config_list = cfgs + list(a.shape)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if modes == ["both"]:
        modes = list(MODES)
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode(s) {bad or modes}; known: {', '.join(MODES)} (or both)")
    a.mode_list = [m for m in MODES if m in modes]
    if not a.target > 0:
        raise ValueError(f"--target: expected a ratio > 0, got {a.target}")
    return a


# ---- measurement --------------------------------------------------------------------------------------------------

def _median(xs: List[float]) -> float:
    return statistics.median(xs)


def operator_codes(m) -> tuple:
    """The integer arguments of machmoe's layer operators (top_k and the option codes) for module m's options."""
    from machmoe._options import ACTIVATIONS, ACTIVATION_MEMORY, ROUNDINGS, ROUTINGS, SCORES, WEIGHT_LAYOUTS
    return (m.top_k, ACTIVATIONS[m.activation], WEIGHT_LAYOUTS[m.weight_layout], SCORES[m.score],
            ROUTINGS[m.routing], ROUNDINGS[m.rounding], m.tile, ACTIVATION_MEMORY[m.activation_memory])


class Case:
    """One configuration's module, inputs and the C++ layer's arguments, on one device."""

    def __init__(self, cfg: C.Config, device: torch.device, dtype: torch.dtype, seed: int):
        import machmoe
        torch.manual_seed(seed)
        self.cfg = cfg
        self.module = machmoe.MoE(cfg.d, cfg.n, cfg.E, cfg.K, device=device, dtype=dtype)
        m = self.module
        self.x = torch.empty(cfg.T, cfg.d, device=device, dtype=dtype).requires_grad_()
        self.go = torch.empty(cfg.T, cfg.d, device=device, dtype=dtype)
        # The C++ side writes fresh values into these in place (and the module side into x and go).
        self.cx = torch.empty_like(self.go)
        self.cgo = torch.empty_like(self.go)
        self.codes = operator_codes(m)

    def refill(self) -> None:
        with torch.no_grad():
            self.x.normal_()
            self.go.normal_()
        self.module.zero_grad(set_to_none=True)  # AccumulateGrad then takes the new gradients without a copy
        self.x.grad = None

    def module_forward(self) -> None:
        self.module(self.x)

    def module_step(self) -> None:
        self.module(self.x).output.backward(self.go)

    def cpp(self, warmup: int, iters: int, isolated: bool) -> torch.Tensor:
        m = self.module
        with torch.no_grad():
            return torch.ops.machmoe.time_layer(self.cx, m.router_weight.detach(), m.w1.detach(), m.w2.detach(),
                                                self.cgo, *self.codes, warmup, iters, isolated)

    def module_times(self, warmup: int, iters: int, isolated: bool) -> Dict[str, List[float]]:
        """Module times per repetition (ms): forward, forward + backward; and the host time of one forward call
        (perf_counter around the Python call: what the host spends before it returns)."""
        events = []
        host = []
        for i in range(-warmup, iters):
            self.refill()
            e = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if i >= 0 else None
            if isolated:
                torch.cuda.current_stream().synchronize()
            if e:
                e[0].record()
            t0 = time.perf_counter()
            self.module_forward()
            t1 = time.perf_counter()
            if e:
                e[1].record()
            if isolated:
                torch.cuda.current_stream().synchronize()
            if e:
                e[2].record()
            self.module_step()
            if e:
                e[3].record()
                events.append(e)
                host.append((t1 - t0) * 1e3)
        torch.cuda.current_stream().synchronize()
        return {"forward": [e[0].elapsed_time(e[1]) for e in events],
                "fwdbwd": [e[2].elapsed_time(e[3]) for e in events], "host_forward": host}


def measure(case: Case, warmup: int, iters: int, rounds: int, mode: str) -> dict:
    isolated = mode == "isolated"
    mod: Dict[str, List[float]] = {"forward": [], "fwdbwd": [], "host_forward": []}
    cpp: Dict[str, List[float]] = {"forward": [], "fwdbwd": []}

    def run(side: str, w: int, n: int) -> None:
        if side == "cpp":
            t = case.cpp(w, n, isolated)
            cpp["forward"] += t[:, 0].tolist()
            cpp["fwdbwd"] += t[:, 1].tolist()
        else:
            for k, v in case.module_times(w, n, isolated).items():
                mod[k] += v

    if isolated:
        # One repetition of each side in turn (the order swapped every repetition): an isolated repetition starts
        # from an idle GPU, whose clocks drift over seconds; blocks of repetitions per side put that drift between
        # the two sides (two back-to-back blocks of the same module forward measured 7 % apart on an H100).
        case.cpp(warmup, 1, isolated)  # warm-up (its one timed repetition is not kept)
        case.module_times(warmup, 1, isolated)
        for r in range(rounds * iters):
            for side in (("cpp", "module") if r % 2 == 0 else ("module", "cpp")):
                run(side, 0, 1)
    else:
        # Queued: each side's repetitions are queued back to back (a block per side and round).
        for r in range(rounds):
            for side in (("cpp", "module") if r % 2 == 0 else ("module", "cpp")):
                run(side, warmup, iters)
    res = {"cpp": {f"{k}_ms": _median(v) for k, v in cpp.items()},
           "module": {f"{k}_ms": _median(v) for k, v in mod.items()}, "samples": len(cpp["forward"])}
    res["ratio"] = {k: res["module"][f"{k}_ms"] / res["cpp"][f"{k}_ms"] for k in PASSES}
    return res


def _isolated_forward_ms(fn) -> float:
    """GPU time of one call of fn between two events, the stream synchronised before and after (host latency counts)."""
    stream = torch.cuda.current_stream()
    stream.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    out = fn()
    e1.record()
    stream.synchronize()
    del out
    return e0.elapsed_time(e1)


SLEEP_MS = 1.0  # the busy GPU ahead of a hidden-latency repetition: longer than any host path measured (<= 0.6 ms)


def _sleep_cycles(ms: float) -> int:
    """torch.cuda._sleep's argument (GPU clock cycles) for about `ms` milliseconds, from timed sleeps queued behind a
    first one: the first launch of the sleep kernel in a process loads its module (lazy loading), and an idle GPU
    takes the launch's host latency too; either, inside the timed interval, made the calibrated sleep a fraction of
    `ms` (session 59: every --layers repetition uncovered). The median of three probes, each while the GPU is busy."""
    stream = torch.cuda.current_stream()
    probe = 200_000
    times = []
    for _ in range(3):
        stream.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(probe)  # keeps the GPU busy while the timed one is queued
        e0.record()
        torch.cuda._sleep(probe)
        e1.record()
        stream.synchronize()
        times.append(e0.elapsed_time(e1))
    return max(1, int(probe * ms / max(_median(times), 1e-3)))


def hidden_latency_timer(sleep_ms: float = SLEEP_MS):
    """A timer for measure_layers whose call starts while the GPU is busy: after the synchronize, a sleep kernel of
    about `sleep_ms` is queued, then an event, the call, an event. The host's work before the call's first kernel runs
    while the sleep does, so the time between the events is the GPU's: the call's kernels and any wait for a launch
    after the sleep has ended. Returns (ms, covered): covered is whether the sleep was still running when the call
    returned, i.e. every launch of the call was queued behind it (False: the figure may still hold host latency)."""
    cycles = None

    def timer(fn):
        nonlocal cycles
        if cycles is None:
            cycles = _sleep_cycles(sleep_ms)
        stream = torch.cuda.current_stream()
        stream.synchronize()
        e1, e2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        e1.record()
        out = fn()
        covered = not e1.query()
        e2.record()
        stream.synchronize()
        del out
        return e1.elapsed_time(e2), covered

    timer.sleep_ms = sleep_ms  # what measure_layers reports
    return timer


def measure_layers(case, iters: int, timer=_isolated_forward_ms, hidden_timer=None) -> dict:
    """The isolated forward of each LAYER_ROWS layer and of the C++ layer ("cpp"), one repetition of each in turn
    (the order reversed every repetition), medians; and each layer's forward again with the host's latency hidden
    (hidden_timer, default hidden_latency_timer(): a sleep kernel queued ahead of the call), whose difference from the
    isolated figure is the time the GPU waited for the host before and between the layer's kernels. Every timed
    forward follows the same state: the C++ layer's repetition refills its inputs after the previous repetition's
    backward; a layer's is refilled the same way, and an untimed forward + backward of the module follows it, so that
    the next starts after a backward too. (Timed right after another forward, with nothing refilled, the module's
    forward measured 1.03 and 0.99 of the C++ layer's on 1.4B-256 and 7B-256, against 1.09-1.10 after a backward: an
    H200, session 57. With the latency hidden every layer took less GPU time than the C++ layer's isolated forward:
    session 58.)"""
    fns = forward_layers(case.module, case.x)
    rows = ("cpp",) + LAYER_ROWS
    if hidden_timer is None:
        hidden_timer = hidden_latency_timer()

    def run(name: str, t) -> object:
        if name == "cpp":
            return float(case.cpp(0, 1, True)[0, 0])
        case.refill()
        r = t(fns[name])
        case.module_step()
        return r

    for name in rows:  # warm-up
        run(name, timer)
        if name != "cpp":
            run(name, hidden_timer)
    times: Dict[str, List[float]] = {name: [] for name in rows}
    hidden: Dict[str, List[float]] = {name: [] for name in LAYER_ROWS}
    covered: Dict[str, int] = {name: 0 for name in LAYER_ROWS}
    for r in range(iters):
        for name in (rows if r % 2 == 0 else rows[::-1]):
            times[name].append(run(name, timer))
            if name != "cpp":
                ms, ok = run(name, hidden_timer)
                hidden[name].append(ms)
                covered[name] += bool(ok)
    cpp = _median(times["cpp"])
    out = {"iters": iters, "sleep_ms": getattr(hidden_timer, "sleep_ms", None), "rows": {}}
    for name in rows:
        row = {"forward_ms": _median(times[name]), "ratio": _median(times[name]) / cpp}
        if name != "cpp":
            row["hidden_ms"] = _median(hidden[name])
            row["host_wait_us"] = (row["forward_ms"] - row["hidden_ms"]) * 1e3
            row["covered"] = covered[name] / iters
        out["rows"][name] = row
    return out


def layers_markdown(layers: dict) -> List[str]:
    """The --layers table: each layer's isolated forward, its ratio to the C++ layer's, the step from the row above,
    and the same forward with the host's latency hidden (GPU time only) with the difference, the GPU's wait for the
    host."""
    what = dict(HOST_ROWS)
    what["cpp"] = "the C++ layer (time_layer: machmoe::forward on buffers allocated once)"
    sleep = layers.get("sleep_ms")
    sleep_text = f"a {sleep:g}-ms sleep kernel" if sleep else "a sleep kernel"
    lines = [f"Isolated forward of each layer of the module path ({layers['config']}; median of {layers['iters']}; "
             "each after a refill and a backward), and the same forward with the host's latency hidden "
             f"({sleep_text} queued ahead of the call: GPU time only; 'covered' is the share of repetitions "
             "whose every launch was queued while the sleep ran):", "",
             "| layer | what | forward ms | ratio to C++ | step from the row above, us | latency hidden, ms | "
             "GPU waiting for the host, us | covered |", "|---|---|---|---|---|---|---|---|"]
    prev = None
    for name, r in layers["rows"].items():
        step = "" if prev is None else f"{(r['forward_ms'] - prev) * 1e3:+.1f}"
        if "hidden_ms" in r:
            rest = f"{r['hidden_ms']:.4f} | {r['host_wait_us']:.1f} | {r['covered']:.0%}"
        else:
            rest = "– | – | –"
        lines.append(f"| {name} | {what.get(name, '')} | {r['forward_ms']:.4f} | {r['ratio']:.3f} | {step} | {rest} |")
        prev = r["forward_ms"]
    return lines


def run_machmoe_bench(path: str, cfg: C.Config, warmup: int, iters: int) -> dict:
    """machmoe-bench on the same configuration (its own weights, a fixed x; forward and backward timed apart)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        cmd = [path, "--T", str(cfg.T), "--d", str(cfg.d), "--n", str(cfg.n), "--E", str(cfg.E), "--K", str(cfg.K),
               "--warmup", str(warmup), "--iters", str(iters), "--json", out]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0 or not os.path.exists(out):
            tail = " | ".join((p.stderr or p.stdout or "").strip().splitlines()[-3:])
            return {"status": "failed", "error": f"exit status {p.returncode}: {tail}"[-600:]}
        with open(out) as f:
            doc = json.load(f)
    r = doc[0] if isinstance(doc, list) else doc
    return {"status": "ok", "forward_ms": r["forward_ms"], "backward_ms": r["backward_ms"],
            "fwdbwd_ms": r["forward_ms"] + r["backward_ms"]}


# ---- host only: the module path's host time per call, on the CPU ----------------------------------------------

# What each row runs, one layer of the module path added per row (so consecutive rows differ by one layer).
HOST_ROWS = (
    ("op_below_autograd", "layer_forward below autograd: argument conversion, dispatcher, binding, C++ layer"),
    ("op_no_grad", "layer_forward without grad: + the Autograd kernel passing through"),
    ("op_autograd", "layer_forward with grad: + the autograd node (C++: saved tensors, options)"),
    ("functional", "machmoe.moe: + the functional API's checks"),
    ("module_forward", "MoE.forward: + the module (T14's host time before the first kernel)"),
    ("module_forward_main_grad", "MoE.forward with accumulate_into_main_grad=True"),
    ("module_step", "MoE forward + backward (gradients reset to None first)"),
)


# The forward-only rows of HOST_ROWS, which --layers times on the GPU.
LAYER_ROWS = ("op_below_autograd", "op_no_grad", "op_autograd", "functional", "module_forward")


def forward_layers(m, x) -> Dict[str, object]:
    """A call of each LAYER_ROWS layer of module m's forward on x (each returns what its layer returns)."""
    from machmoe import functional as F
    xd = x.detach()
    rw, w1, w2 = m.router_weight, m.w1, m.w2
    codes = operator_codes(m)
    op = torch.ops.machmoe.layer_forward.default

    def below_autograd():
        with torch.no_grad(), torch._C._AutoDispatchBelowAutograd():
            return op(xd, rw, w1, None, w2, None, None, None, None, *codes)

    def no_grad():
        with torch.no_grad():
            return op(xd, rw, w1, None, w2, None, None, None, None, *codes)

    return {"op_below_autograd": below_autograd, "op_no_grad": no_grad,
            "op_autograd": lambda: op(x, rw, w1, None, w2, None, None, None, None, *codes),
            "functional": lambda: F.moe(x, rw, w1, w2, top_k=m.top_k, activation=m.activation, score=m.score,
                                        routing=m.routing, rounding=m.rounding, tile=m.tile,
                                        weight_layout=m.weight_layout, activation_memory=m.activation_memory),
            "module_forward": lambda: m(x)}


def host_latency(shape, reps: int, rounds: int, seed: int = 0) -> Dict[str, dict]:
    """Host time per call (us) of each HOST_ROWS entry on CPU fp32 tensors of `shape` (T, d, n, E, K): min and
    median over `rounds` rounds of `reps` calls, after a warm-up round. The garbage collector is paused inside a
    round (its pauses would land on whichever call triggers them)."""
    import gc
    import machmoe
    T, d, n, E, K = shape
    torch.manual_seed(seed)
    m = machmoe.MoE(d, n, E, K)
    acc = machmoe.MoE(d, n, E, K, accumulate_into_main_grad=True)
    acc.main_grads()
    x = torch.randn(T, d, requires_grad=True)
    go = torch.randn(T, d)

    def step():
        for p in m.parameters():
            p.grad = None
        x.grad = None
        m(x).output.backward(go)

    fns = dict(forward_layers(m, x), module_forward_main_grad=lambda: acc(x), module_step=step)
    out = {}
    for name, what in HOST_ROWS:
        fn = fns[name]
        for _ in range(reps):
            fn()
        per_call = []
        for _ in range(rounds):
            gc.collect()
            gc.disable()
            try:
                t0 = time.perf_counter_ns()
                for _ in range(reps):
                    fn()
                per_call.append((time.perf_counter_ns() - t0) / reps / 1e3)
            finally:
                gc.enable()
        out[name] = {"what": what, "min_us": min(per_call), "median_us": _median(per_call)}
    return out


def host_markdown(doc: dict) -> str:
    T, d, n, E, K = doc["settings"]["shape"]
    lines = [f"Host time per call on the CPU (fp32, T={T} d={d} n={n} E={E} K={K}; {doc['settings']['rounds']} "
             f"rounds of {doc['settings']['reps']} calls; torch {doc['versions']['torch']}; {doc['date']}).",
             f"Command: `{doc['command']}`", "", "| row | what | min us | median us |", "|---|---|---|---|"]
    for name, r in doc["host"].items():
        lines.append(f"| {name} | {r['what']} | {r['min_us']:.1f} | {r['median_us']:.1f} |")
    return "\n".join(lines)


def main_host_only(a, argv: List[str]) -> int:
    import machmoe  # noqa: F401  (loads the operators)
    torch.set_num_threads(1)  # (the CPU reference's thread pool would only add wake-ups at these sizes)
    reps, rounds = max(a.iters, 1) * 10, max(a.rounds, 1) * 10
    doc = {"schema": 1, "command": "python -m machmoe.benchmark.overhead " + " ".join(shlex.quote(x) for x in argv),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": {"name": "cpu"}, "versions": _versions(),
           "settings": {"shape": list(a.host_shape), "reps": reps, "rounds": rounds, "seed": a.seed},
           "host": host_latency(a.host_shape, reps, rounds, a.seed)}
    with open(a.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(host_markdown(doc))
    print(f"\nmachmoe.benchmark.overhead: JSON {a.json}")
    return 0


# ---- profile: kernels and CUDA API calls of one repetition --------------------------------------------------------

# CUDA runtime/driver calls worth counting: launches, memory traffic the host asks for, allocation, waits.
API_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaMemsetAsync",
             "cudaMemset2DAsync", "cudaMemcpyAsync", "cudaMemcpy2DAsync", "cudaMalloc", "cudaFree",
             "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profile_counts(fn) -> dict:
    """Runs fn() once under torch.profiler and counts its GPU activities (kernels, memsets, memcpys) by name and its
    CUDA API calls by name."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    gpu, api = Counter(), Counter()
    gpu_us: Counter = Counter()
    for e in prof.events():
        dev_type = str(getattr(e, "device_type", ""))
        if dev_type.endswith("CUDA"):
            gpu[e.name] += 1
            gpu_us[e.name] += e.time_range.elapsed_us()
        elif e.name in API_CALLS:
            api[e.name] += 1
    return {"gpu": dict(gpu), "gpu_us": {k: float(v) for k, v in gpu_us.items()}, "api": dict(api)}


def profile_case(case: Case) -> dict:
    """One repetition of each side, as measure() runs it: fresh inputs, a forward, a forward + backward."""
    case.refill()
    case.module_forward()
    case.module_step()
    case.cpp(0, 1, True)  # warm: first-call work (cuBLAS heuristics, descriptors) is not what is compared

    def module_rep():
        case.refill()
        case.module_forward()
        case.module_step()

    return {"module": profile_counts(module_rep), "cpp": profile_counts(lambda: case.cpp(0, 1, False))}


def count_diff(module: Dict[str, int], cpp: Dict[str, int]) -> Dict[str, int]:
    """name -> module count - C++ count, for every name whose counts differ."""
    return {k: module.get(k, 0) - cpp.get(k, 0) for k in sorted(set(module) | set(cpp))
            if module.get(k, 0) != cpp.get(k, 0)}


# ---- report ---------------------------------------------------------------------------------------------------------

def verdict(entries: List[dict], target: float) -> dict:
    """Isolated ratios above the target (the T14 criterion), as 'config pass ratio' lines, and what failed: a
    configuration, or its machmoe-bench cross-check."""
    over = []
    for e in entries:
        r = e.get("results", {}).get("isolated")
        if e.get("status") != "ok" or not r:
            continue
        for k in PASSES:
            if r["ratio"][k] > target:
                over.append(f"{e['config']['name']} {k} {r['ratio'][k]:.3f}")
    failed = [f"{e['config']['name']}: {e.get('error')}" for e in entries if e.get("status") != "ok"]
    # A --machmoe-bench cross-check that did not run fails the run too (exit status 1), as a configuration does.
    failed += [f"{e['config']['name']}: machmoe-bench {e['machmoe_bench'].get('error')}" for e in entries
               if e.get("machmoe_bench") and e["machmoe_bench"].get("status") != "ok"]
    # T14 is judged on the isolated mode only: a run without it (--modes queued) meets nothing.
    judged = any(e.get("status") == "ok" and e.get("results", {}).get("isolated") for e in entries)
    return {"target": target, "over_target": over, "failed": failed, "judged": judged,
            "met": judged and not over and not failed}


def markdown(doc: dict) -> str:
    lines = [f"Device: {doc['device'].get('name')}; torch {doc['versions'].get('torch')}; {doc['settings']['dtype']}; "
             f"median of {doc['settings']['iters']} x {doc['settings']['rounds']} repetitions after "
             f"{doc['settings']['warmup']} warm-up per round; {doc['date']}.", f"Command: `{doc['command']}`", "",
             "| config | mode | C++ fwd ms | MoE fwd ms | fwd ratio | C++ fwd+bwd ms | MoE fwd+bwd ms | fwd+bwd ratio "
             "| MoE host fwd ms |", "|---|---|---|---|---|---|---|---|---|"]
    target = doc["verdict"]["target"]
    for e in doc["configs"]:
        name = e["config"]["name"]
        if e.get("status") != "ok":
            lines.append(f"| {name} | failed: {e.get('error')} | | | | | | | |")
            continue
        for mode, r in e["results"].items():
            mark = lambda k: " ⚠" if mode == "isolated" and r["ratio"][k] > target else ""  # noqa: E731
            lines.append(f"| {name} | {mode} | {r['cpp']['forward_ms']:.3f} | {r['module']['forward_ms']:.3f} | "
                         f"{r['ratio']['forward']:.3f}{mark('forward')} | {r['cpp']['fwdbwd_ms']:.3f} | "
                         f"{r['module']['fwdbwd_ms']:.3f} | {r['ratio']['fwdbwd']:.3f}{mark('fwdbwd')} | "
                         f"{r['module']['host_forward_ms']:.3f} |")
        b = e.get("machmoe_bench")
        if b:
            lines.append(f"| {name} | machmoe-bench | " + (
                f"{b['forward_ms']:.3f} | | | {b['fwdbwd_ms']:.3f} | | | |" if b["status"] == "ok"
                else f"{b['error']} | | | | | | |"))
    v = doc["verdict"]
    if v["over_target"] or v["failed"]:
        status = "not met: " + "; ".join(v["over_target"] + v["failed"])
    else:
        status = "met" if v["met"] else "not judged (no isolated mode measured)"
    lines += ["", f"T14 (isolated ratios <= {target}): {status}"]
    if doc.get("layers"):
        lines += [""] + layers_markdown(doc["layers"])
    prof = doc.get("profile")
    if prof:
        lines += ["", f"Profile of one repetition ({prof['config']}: fresh inputs, a forward, a forward + backward), "
                      "module minus C++ (counts):"]
        for what in ("gpu", "api"):
            diff = prof["diff"][what]
            lines.append(f"* {'GPU activities' if what == 'gpu' else 'CUDA API calls'}: " +
                         (", ".join(f"{k}: {v:+d}" for k, v in diff.items()) if diff else "identical"))
        lines.append("* GPU activities of the module's repetition: " + ", ".join(
            f"{k} x{v}" for k, v in sorted(prof["module"]["gpu"].items(), key=lambda kv: -kv[1])))
    return "\n".join(lines)


def _versions() -> dict:
    import platform
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        a = parse(argv)
    except ValueError as e:
        print(f"machmoe.benchmark.overhead: {e}", file=sys.stderr)
        return EXIT_USAGE
    if a.host_only:
        return main_host_only(a, argv)
    if not torch.cuda.is_available():
        print("machmoe.benchmark.overhead: needs a CUDA device (it times the GPU layer)", file=sys.stderr)
        return EXIT_USAGE
    import machmoe  # noqa: F401  (loads the operators)
    device, dtype = torch.device("cuda"), torch.bfloat16
    props = torch.cuda.get_device_properties(device)
    doc = {"schema": 1, "command": "python -m machmoe.benchmark.overhead " + " ".join(shlex.quote(x) for x in argv),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": {"name": props.name, "capability": f"{props.major}.{props.minor}"}, "versions": _versions(),
           "settings": {"dtype": "bf16", "warmup": a.warmup, "iters": a.iters, "rounds": a.rounds,
                        "modes": a.mode_list, "seed": a.seed},
           "definitions": {
               "cpp": "torch.ops.machmoe.time_layer: machmoe::forward/backward on buffers allocated once, CUDA events "
                      "recorded in C++ (machmoe-bench's method), same weights and inputs as the module",
               "module": "machmoe.MoE(d, n, E, K) defaults; forward = module(x); fwdbwd = module(x).output.backward("
                         "go) with x.requires_grad and .grad reset to None before each repetition",
               "isolated": "stream synchronised before each timed region: host latency counts (T14's figure)",
               "queued": "repetitions queued by the host ahead of the GPU: GPU work only",
               "ratio": "module ms / C++ ms", "host_forward_ms": "perf_counter around the module's forward call"},
           "configs": []}
    for i, cfg in enumerate(a.config_list):
        print(f"[{i + 1}/{len(a.config_list)}] {cfg.name} (T={cfg.T} d={cfg.d} n={cfg.n} E={cfg.E} K={cfg.K})",
              file=sys.stderr, flush=True)
        entry = {"config": cfg.as_dict(), "status": "ok", "results": {}}
        case = None
        try:
            case = Case(cfg, device, dtype, a.seed)
            for mode in a.mode_list:
                entry["results"][mode] = measure(case, a.warmup, a.iters, a.rounds, mode)
            if a.layers and "layers" not in doc:
                doc["layers"] = dict(measure_layers(case, a.iters * a.rounds), config=cfg.name)
            if a.profile and "profile" not in doc:
                prof = profile_case(case)
                prof["config"] = cfg.name
                prof["diff"] = {k: count_diff(prof["module"][k], prof["cpp"][k]) for k in ("gpu", "api")}
                doc["profile"] = prof
        except torch.OutOfMemoryError as e:
            entry.update(status="out_of_memory", error=str(e).splitlines()[0][:300])
        except Exception as e:  # recorded in its row (machmoe's ValueError for an unsupported shape, a CUDA error)
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            entry.update(status="failed", error=f"{type(e).__name__}: {first}")
        finally:
            del case
            torch.cuda.empty_cache()
        if a.machmoe_bench:
            entry["machmoe_bench"] = run_machmoe_bench(a.machmoe_bench, cfg, a.warmup, a.iters)
        doc["configs"].append(entry)
        doc["verdict"] = verdict(doc["configs"], a.target)
        with open(a.json, "w") as f:  # after every configuration: a crash loses at most the one in flight
            json.dump(doc, f, indent=1)
    doc["verdict"] = verdict(doc["configs"], a.target)
    with open(a.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(markdown(doc))
    print(f"\nmachmoe.benchmark.overhead: JSON {a.json}")
    if doc["verdict"]["failed"]:
        return EXIT_FAILED
    return 0 if doc["verdict"]["met"] or not doc["verdict"]["judged"] else EXIT_OVER_TARGET


if __name__ == "__main__":
    sys.exit(main())
