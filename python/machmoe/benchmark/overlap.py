"""python -m machmoe.benchmark.overlap: what the SM margin (machmoe.set_sm_margin) buys a schedule that runs other
kernels beside the layer, such as an expert-parallel all-to-all overlapped with the experts, on one GPU.

The expert GEMMs run persistent grids, one CTA on every SM for the whole GEMM; a kernel launched meanwhile on another
stream waits for an SM. This tool stands a copy kernel in for the other stream's work (NCCL's all-to-all kernels
copy rows too; a group of one process would not run them on SMs at all) and, per configuration and margin, times
with CUDA events (median over at least --time-ms of repetitions each):

* layer: one training step of `machmoe.MoE` (forward + backward, bf16, fresh upstream gradient) alone;
* side: the side stream's work alone: --side-mb MB copied in --side-chunks copy kernels back to back;
* both: the two launched together (the side stream waits for an event recorded just before the step, then queues
  its copies), from that event to the later of the two ends; and "side done", from that event to the side's end.

"both / (layer + side)" is 1 where the two ran one after the other and max(layer, side) / (layer + side) where they
overlapped perfectly. Results of the step do not depend on the margin (the GPU tests check it bitwise). The margin 0
row is the library's default.
"""
import argparse
import json
import statistics
import sys
from typing import List, Tuple

import torch

from . import configs as C
from .overhead import int_at_least


def _margins(text: str) -> List[int]:
    values = [int_at_least(0)(v) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected one or more integers >= 0, got {text!r}")
    return values


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m machmoe.benchmark.overlap",
                                description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--configs", default="7B-256,30B-256",
                   help="configurations (names or groups of machmoe.benchmark.configs; default 7B-256,30B-256)")
    p.add_argument("--margins", type=_margins, default=[0, 8, 16, 32], help="SM margins to run (default 0,8,16,32)")
    p.add_argument("--side-mb", type=int_at_least(1), default=512,
                   help="MB the side stream copies per step (default 512)")
    p.add_argument("--side-chunks", type=int_at_least(1), default=8,
                   help="copy kernels the side stream's MB are split into (default 8)")
    p.add_argument("--time-ms", type=int_at_least(1), default=500, help="least ms of timed repetitions per figure")
    p.add_argument("--warmup-ms", type=int_at_least(1), default=300, help="least ms of untimed repetitions first")
    p.add_argument("--json", help="also write the rows as JSON to this path")
    return p


def _medians(run, warmup_ms: float, time_ms: float) -> Tuple[float, ...]:
    """run() returns (milliseconds of the call, other figures...), measured with events: the median of each over the
    calls of at least time_ms, after at least warmup_ms of untimed calls."""
    spent = 0.0
    while spent < warmup_ms:
        spent += run()[0]
    timed: List[Tuple[float, ...]] = []
    while sum(t[0] for t in timed) < time_ms or len(timed) < 5:
        timed.append(run())
    return tuple(statistics.median(column) for column in zip(*timed))


def measure(cfg: C.Config, margins: List[int], side_mb: int, side_chunks: int, warmup_ms: float,
            time_ms: float) -> List[dict]:
    import machmoe
    dev = torch.device("cuda")
    torch.manual_seed(0)
    moe = machmoe.MoE(cfg.d, cfg.n, cfg.E, cfg.K, device=dev, dtype=torch.bfloat16)
    x = torch.randn(cfg.T, cfg.d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(cfg.T, cfg.d, device=dev, dtype=torch.bfloat16)
    chunk = side_mb * 2 ** 20 // side_chunks // 2  # bf16 elements a copy
    src = torch.randn(side_chunks, chunk, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()

    def step():
        moe.zero_grad(set_to_none=True)
        x.grad = None
        moe(x).output.backward(grad)

    def copies():
        for i in range(side_chunks):
            dst[i].copy_(src[i])

    def timed(work_main, work_side) -> Tuple[float, float]:
        """(ms from an event just before the work to the later end, ms to the side stream's end)."""
        start, end_main, end_side = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        main.synchronize()
        start.record(main)
        if work_main:
            work_main()
        end_main.record(main)
        side.wait_event(start)
        with torch.cuda.stream(side):
            if work_side:
                work_side()
        end_side.record(side)
        torch.cuda.synchronize()
        side_done = start.elapsed_time(end_side)
        return max(start.elapsed_time(end_main), side_done), side_done

    rows = []
    before = machmoe.sm_margin()
    try:
        for margin in margins:
            machmoe.set_sm_margin(margin)
            layer = _medians(lambda: timed(step, None), warmup_ms, time_ms)[0]
            side_alone = _medians(lambda: timed(None, copies), warmup_ms, time_ms)[0]
            both, side_done = _medians(lambda: timed(step, copies), warmup_ms, time_ms)
            rows.append({"config": cfg.name, "sm_margin": margin, "layer_ms": layer, "side_ms": side_alone,
                         "both_ms": both, "side_done_ms": side_done, "overlap_ratio": both / (layer + side_alone),
                         "side_mb": side_mb, "side_chunks": side_chunks})
            r = rows[-1]
            print(f"{cfg.name:>10} margin {margin:>3}: layer {layer:8.3f}  side {side_alone:7.3f}  both {both:8.3f} "
                  f"(side done {r['side_done_ms']:8.3f})  both / (layer + side) {r['overlap_ratio']:.3f}", flush=True)
    finally:
        machmoe.set_sm_margin(before)
    return rows


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        cfgs = C.select(args.configs)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: python -m machmoe.benchmark.overlap needs a CUDA GPU (it times GPU streams)", file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"gpu: {torch.cuda.get_device_name(0)} ({sms} SMs); side stream: {args.side_mb} MB in {args.side_chunks} "
          f"copies; ms, median over at least {args.time_ms} ms of repetitions", flush=True)
    rows = []
    for cfg in cfgs:
        rows.extend(measure(cfg, args.margins, args.side_mb, args.side_chunks, args.warmup_ms, args.time_ms))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "sms": sms, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
