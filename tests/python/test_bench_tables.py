"""scripts/bench_tables.py (markdown tables from machmoe-bench's JSON) on sessions 61's and 63's H200 runs of every main
configuration, whose tables docs/BENCHMARKS.md quotes, and on a JSON object of an older format (no stage sums)."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "scripts" / "bench_tables.py")
bt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bt)

SESSION61 = ROOT / "docs" / "measurements" / "2026-11-29-h200-session61"
SESSION63 = ROOT / "docs" / "measurements" / "2026-11-29-h200-session63"
MIB = bt.MIB


def rows(table):
    return {line.split(" | ")[0][2:]: line for line in table.splitlines()[2:]}


def test_stages_table_of_session61():
    runs = bt.load(SESSION61 / "callC_all_preact.json")
    table = bt.stages_table(runs)
    header = table.splitlines()[0]
    assert header.count("|") == table.splitlines()[1].count("|")
    r = rows(table)
    assert len(r) == 12
    assert r["30B (1024,64,4)"].startswith(
        "| 30B (1024,64,4) | 5.965 (0.914) | 12.225 (0.867) | 1.001 · 1.015 (9) | 3.638 (0.91) | 1.884 (0.97) | "
        "2.209 (0.77) | 3.649 (0.95) | 3.911 (0.87) | 1.950 (0.88) |")
    assert "| 0.482 (0.51) |" in r["1.4B (256,128,8)"] and r["1.4B (256,128,8)"].endswith("| 0.088 |")


def test_compare_gives_t7_of_session61():
    base = bt.load(SESSION61 / "callC_all_preact.json")
    other = bt.load(SESSION61 / "callC_all_input_only.json")
    r = rows(bt.compare_table(base, other))
    assert len(r) == 12
    assert r["30B (1024,64,4)"] == ("| 30B (1024,64,4) | 5.965 + 12.225 = 18.190 | 5.860 + 15.861 = 21.721 | "
                                    "1.194 |")
    assert r["1.4B (256,128,8)"].endswith("| 1.138 |")
    assert max(float(line.split(" | ")[-1].rstrip(" |")) for line in r.values()) == 1.197


def test_passes_table_of_session63():
    default = bt.load(SESSION63 / "callF_all_preact_1.json")
    recompute = bt.load(SESSION63 / "callF_all_input_only_1.json")
    table = bt.passes_table(default, recompute)
    assert table.splitlines()[0].count("|") == table.splitlines()[1].count("|") == 8
    r = rows(table)
    assert len(r) == 12
    assert r["120B (2048,64,4)"] == ("| 120B (2048,64,4) | 11.684 (0.909) | 24.255 (0.859) | 35.939 | 42.666 (1.187) | "
                                     "1282.0 / 1284 · 258.0 / 260 | 9764 · 8740 |")
    assert r["1.4B (1024,32,2)"].endswith("| 3.026 (1.172) | 381.3 / 382 · 61.3 / 60 | 1348 · 1026 |")
    alone = bt.passes_table(default)
    assert alone.splitlines()[0].count("|") == alone.splitlines()[1].count("|") == 7
    assert rows(alone)["7B (256,128,8)"] == "| 7B (256,128,8) | 1.248 (0.853) | 2.297 (0.811) | 3.544 | 267.0 / 268 | 1564 |"
    # A row the recompute file lacks keeps its own columns.
    assert rows(bt.passes_table(default[:1], []))["1.4B (256,128,8)"].endswith("| - | 385.0 / 386 · - | 1516 · - |")


def test_older_json_and_other_sizes():
    run = {"config": "7B-256 (sizes overridden)", "T": 16384, "d": 4096, "n": 1024, "E": 256, "K": 4,
           "forward_ms": 2.0, "backward_ms": 4.0, "efficiency_forward": 0.9, "efficiency_backward": 0.8,
           "stage_runs": 3, "stages_ms": {"forward/router_gemm": 0.1, "forward/up_projection": 1.0,
                                          "backward/dh_kernel": 2.0, "backward/dw1": 1.0},
           "cublas_stage_ms": {"forward/up_projection": 0.9}}
    line = bt.stages_table([run]).splitlines()[2]
    # Sums added up here: forward 1.1 of 2.0, backward 3.0 of 4.0; dH without a cuBLAS time prints alone.
    assert line.startswith("| (16384,4096,1024,256,4) | 2.000 (0.900) | 4.000 (0.800) | 0.550 · 0.750 (3) | "
                           "1.000 (0.90) | - | 2.000 | - | 1.000 | - | 0.100 |")
    other = dict(run, forward_ms=2.5, backward_ms=5.5)
    assert bt.compare_table([run], [other]).splitlines()[2].endswith("| 1.333 |")
    assert bt.compare_table([run], [dict(other, K=8)]).count("\n") == 1  # other sizes: no row


def test_runs_of_other_options_are_not_paired():
    # Before: runs were matched by sizes, activation, dtypes and accumulation only, so a --routing token_rounding or
    # --bias both run was compared with a default one as if alike.
    run = {"config": "7B-256", "T": 24576, "d": 1536, "n": 256, "E": 128, "K": 8, "activation": "swiglu",
           "swiglu_alpha": 1.702, "swiglu_limit": 7, "bias": "none", "layout": "interleaved", "score": "softmax_topk",
           "routing": "topk", "rounding": "nearest", "tile": 128, "cache": "preact", "dx_chunks": 0, "y_chunks": 0,
           "dtype": "bf16", "grad_dtype": "bf16", "accumulate_grads": False, "forward_ms": 1.0, "backward_ms": 2.0,
           "efficiency_forward": 0.9, "efficiency_backward": 0.8, "activation_bytes_accounted": MIB,
           "activation_bytes_measured": MIB, "peak_bytes": 4 * MIB}
    # The cache mode is what compare and passes set against each other: still paired.
    recompute = dict(run, cache="input_only", forward_ms=1.5, backward_ms=3.0)
    assert bt.compare_table([run], [recompute]).splitlines()[2].endswith("| 1.500 |")
    assert "(1.500)" in bt.passes_table([run], [recompute]).splitlines()[2]
    for option, value in (("routing", "token_rounding"), ("bias", "both"), ("score", "topk_softmax"),
                          ("layout", "concatenated"), ("tile", 64), ("rounding", "up"), ("dx_chunks", 2),
                          ("y_chunks", 4), ("swiglu_alpha", 1.5), ("swiglu_limit", "inf")):
        other = dict(recompute, **{option: value})
        line = bt.compare_table([run], [other]).splitlines()[2]
        assert line == (f"| 7B (256,128,8) | 1.000 + 2.000 = 3.000 | - | not compared, options differ (base / other): "
                        f"{option} {run[option]} / {value} |"), line
        assert bt.passes_table([run], [other]).splitlines()[2].endswith("| - | 1.0 / 1 · - | 4 · - |"), option
    # An older JSON, which does not record the routing, is not taken for a known one.
    old = {k: v for k, v in recompute.items() if k not in ("routing", "bias")}
    assert bt.compare_table([run], [old]).splitlines()[2].endswith(
        "options differ (base / other): bias none / not recorded, routing topk / not recorded |")

