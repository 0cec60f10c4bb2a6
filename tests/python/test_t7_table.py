"""scripts/t7_table.py (T7's tables, `scripts/gpu_check.sh t7`) on machmoe-bench output: synthetic runs, and the raw
files of session 82's H200 measurement, whose tables docs/BENCHMARKS.md quotes."""
import importlib.util
import lzma
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("t7_table", ROOT / "scripts" / "t7_table.py")
t7 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(t7)

SESSION82 = ROOT / "docs" / "measurements" / "2026-12-02-session82"


def bench_block(name, cache, fwd, bwd, activation, peak, overridden=False):
    sizes = " (sizes overridden)" if overridden else ""
    return "\n".join([
        f"config {name}{sizes} (T=16384 d=4096 n=1024 E=256 K=4 activation=swiglu bias=none layout=interleaved "
        f"score=softmax_topk routing=topk cache={cache}, bf16)",
        "  pass               ms    TFLOP/s cuBLAS bound efficiency",
        f"  forward         {fwd:.3f}      500.0        1.000      0.900",
        f"  backward        {bwd:.3f}      500.0        1.000      0.900",
        "    backward/dh_kernel                   0.500 ms    300.0 TFLOP/s   cuBLAS 0.400 ms = 0.80 of it",
        f"  activation memory: accounted {activation - 1:.1f} MiB, measured {activation:.1f} MiB; peak {peak:.1f} MiB "
        "(100.0 MiB above inputs, parameters, outputs and gradients)"])


def test_pairs_the_modes_per_configuration():
    text = "\n".join([
        "machmoe-bench 0.1.0, backend: gpu (bf16)",
        bench_block("7B-256", "preact", 1.0, 2.0, 400.0, 1500.0, overridden=True),
        bench_block("7B-256", "input_only", 0.9, 2.7, 80.0, 1200.0, overridden=True),
        bench_block("1.4B-256", "input_only", 1.0, 2.0, 60.0, 1000.0),  # no default-mode run: no row
    ])
    table = t7.table(t7.runs(text)).splitlines()
    assert len(table) == 3  # header, rule, one row
    assert table[2] == ("| (16384,4096,1024,256,4) | 1.000 + 2.000 = 3.000 | 0.900 + 2.700 = 3.600 | 1.200 | 400 / 80 | "
                        "1500 / 1200 |")


def test_pairs_table_takes_a_b_b_a():
    runs = [("preact", 10.0), ("input_only", 12.1), ("input_only", 11.9), ("preact", 10.0)]
    text = "\n".join(bench_block("120B-2048", cache, ms / 2, ms / 2, 100.0, 100.0) for cache, ms in runs)
    text += "\n" + bench_block("30B-1024", "preact", 1.0, 1.0, 1.0, 1.0)  # one run: no row
    table = t7.pairs_table(t7.runs(text)).splitlines()
    assert table[2:] == ["| 120B-2048 | 10.000, 10.000 | 12.100, 11.900 | 1.210, 1.190 | 1.200 |"]


def test_session82_tables():
    def raw(name):
        return lzma.open(SESSION82 / name, "rt", encoding="utf-8").read()
    rows = t7.table(t7.runs(raw("callE_t7_raw.txt.xz"))).splitlines()
    assert rows == (SESSION82 / "callE_t7_table.md").read_text(encoding="utf-8").splitlines()
    assert len(rows) == 14 and "| 1.188 | 1284 / 260 | 9830 / 8806 |" in rows[-1]
    pairs = t7.pairs_table(t7.runs(raw("callE_t7_in_turn_raw.txt.xz"))).splitlines()
    assert pairs == (SESSION82 / "callE_t7_in_turn_table.md").read_text(encoding="utf-8").splitlines()
    assert pairs[2].startswith("| 120B-2048 |") and pairs[2].endswith("| 1.201, 1.204 | 1.203 |")
