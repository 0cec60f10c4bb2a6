"""scripts/t8_table.py (T8's table, `scripts/gpu_check.sh t8`) on machmoe-bench output: a synthetic pair of runs, and
the raw files of session 52's H200 measurement, whose table docs/BENCHMARKS.md quotes."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("t8_table", ROOT / "scripts" / "t8_table.py")
t8 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(t8)

SESSION52 = ROOT / "docs" / "measurements" / "2026-11-28-h200-session52"


def bench_block(name, routing, fwd, bwd, stages, overridden=False):
    sizes = " (sizes overridden)" if overridden else ""
    lines = [f"config {name}{sizes} (T=16384 d=4096 n=1024 E=256 K=4 activation=swiglu routing={routing} cache=preact, bf16)",
             "  pass               ms    TFLOP/s cuBLAS bound efficiency",
             f"  forward         {fwd:.3f}      500.0        1.000      0.900",
             f"  backward        {bwd:.3f}      500.0        1.000      0.900",
             "  stages (median of 40 instrumented runs over 1003 ms; they add up to 1.000 ms forward, 1.000 ms "
             "backward):"]
    lines += [f"    forward/{s:<30} {ms:.3f} ms" for s, ms in stages.items()]
    lines.append("    backward/dh_kernel                   0.500 ms    300.0 TFLOP/s   cuBLAS 0.400 ms = 0.80 of it")
    return "\n".join(lines)


def test_pairs_the_routings_and_sums_the_stages():
    text = "\n".join([
        "machmoe-bench 0.1.0, backend: gpu (bf16)",
        bench_block("7B-256", "topk", 4.0, 8.0, {"topk_scores": 0.02, "routing_metadata": 0.02}, overridden=True),
        bench_block("7B-256", "token_rounding", 3.0, 7.0, {"token_rounding": 0.1}, overridden=True),
        bench_block("1.4B-256", "token_rounding", 1.1, 2.0, {"token_rounding": 0.14}),
        bench_block("1.4B-256", "topk", 1.0, 2.0, {"topk_scores": 0.03, "routing_metadata": 0.04}),
        bench_block("1.4B-256", "token_rounding", 1.0, 2.0, {"token_rounding": 0.14}),  # a second round without
    ])                                                                                   # its top-K: no row
    table = t8.table(t8.runs(text)).splitlines()
    assert len(table) == 4  # header, rule, two rows
    assert table[2].startswith("| (16384,4096,1024,256,4) | 3.000 + 7.000 = 10.000 | 4.000 + 8.000 = 12.000 | 1.200 |")
    assert table[2].endswith("| faster | 0.100 / 0.040 = 2.50× |")
    assert table[3].startswith("| 1.4B-256 | 1.100 + 2.000 = 3.100 | 1.000 + 2.000 = 3.000 | 0.968 | 3.3 % |")
    assert table[3].endswith("0.140 / 0.070 = 2.00× |")


def test_session52_sweep_row_and_main_rows():
    files = [SESSION52 / f for f in ("t8_main_rows_full.txt", "t8_round2_full.txt", "t8_sweeps_full.txt")]
    text = "\n".join(f.read_text(encoding="utf-8") for f in files)
    rows = {line.split(" | ")[0][2:]: line for line in t8.table(t8.runs(text)).splitlines()[2:]}
    assert len(rows) == 24  # 12 main rows, 3 second rounds, 8 sweep rows, the sweep row's second round
    assert "| 1.217 |" in rows["(16384,4096,1024,256,4), round 2"] and "| 1.222 |" in rows["(16384,4096,1024,256,4)"]
    assert "| 2.1 % | 0.138 / 0.066 = 2.09× |" in rows["1.4B-256"]
    assert "| 2.4 % |" in rows["1.4B-256, round 2"]
    assert "0.224 / 0.063 = 3.56×" in rows["(16384,1536,256,512,8)"]


def test_reads_the_ab_scripts_tab_output():
    """scripts/ab.sh tab keeps only the config, pass and stage lines of each run, under its own
    '== round' headers (session 55's (16384,1536,256,512,8) row)."""
    def run(routing, fwd, bwd, stages):
        lines = [f"== round 1 cfg sw512 new {routing}",
                 "config 7B-256 (sizes overridden) (T=16384 d=1536 n=256 E=512 K=8 activation=swiglu "
                 f"routing={routing} cache=preact, bf16)",
                 f"  forward         {fwd:.3f}      333.1        0.726      0.776",
                 f"  backward        {bwd:.3f}      342.8        1.478      0.814"]
        lines += [f"    forward/{s:<30} {ms:.3f} ms" for s, ms in stages.items()]
        lines.append("    backward/router_backward             0.059 ms")
        return lines
    text = "\n".join(run("token_rounding", 0.935, 1.816, {"token_rounding": 0.126}) +
                     run("topk", 0.991, 1.966, {"topk_scores": 0.030, "routing_metadata": 0.029}))
    table = t8.table(t8.runs(text)).splitlines()
    assert table[2:] == ["| (16384,1536,256,512,8) | 0.935 + 1.816 = 2.751 | 0.991 + 1.966 = 2.957 | 1.075 | faster | "
                         "0.126 / 0.059 = 2.14× |"]


def test_means_table_of_rows_run_in_turn():
    """Runs in turn (token rounding, top-K, top-K, token rounding): each pair's figure and the figure on the means;
    a configuration with one pair gets no row, and without any configuration of two pairs there is no table."""
    blocks = [bench_block("1.4B-256", "token_rounding", 1.0, 2.1, {"token_rounding": 0.09}),
              bench_block("1.4B-256", "topk", 1.0, 2.0, {"topk_scores": 0.03, "routing_metadata": 0.03}),
              bench_block("1.4B-256", "topk", 1.0, 2.0, {"topk_scores": 0.02, "routing_metadata": 0.03}),
              bench_block("1.4B-256", "token_rounding", 1.0, 1.9, {"token_rounding": 0.1}),
              bench_block("7B-256", "token_rounding", 1.0, 2.0, {"token_rounding": 0.1}),
              bench_block("7B-256", "topk", 1.0, 2.0, {"topk_scores": 0.02, "routing_metadata": 0.02})]
    all_runs = t8.runs("\n".join(blocks))
    assert t8.means_table(all_runs).splitlines()[2:] == [
        "| 1.4B-256 | 2 | 3.3 %, faster | faster (3.000 / 3.000) | 1.50–2.00× |"]
    assert t8.means_table(t8.runs("\n".join(blocks[4:]))) is None


def test_means_table_of_session87_in_turn(capsys):
    """Session 87's call 6 (three rows in turn, six pairs each), read from its .xz file as docs/BENCHMARKS.md quotes
    it: 1.4B (256,128,8) 2.3 % slower on the means, one pair of six over 3 %."""
    raw = ROOT / "docs" / "measurements" / "2026-12-02-session87" / "call6_t8_raw.txt.xz"
    assert t8.main([str(raw)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "| 1.4B-256 | 6 | 2.0 %, 1.7 %, 2.2 %, 3.5 %, 2.7 %, 1.5 % | 2.3 % (3.038 / 2.971) | 1.61–1.65× |" in out
    assert "| 7B-512 | 6 | 2.3 %, 0.4 %, 0.4 %, 0.1 %, 1.4 %, 1.5 % | 1.0 % (3.102 / 3.071) | 1.50–1.61× |" in out
    assert ("| (16384,4096,1024,32,4) | 6 | 1.7 %, 1.1 %, 1.2 %, 0.7 %, 1.5 %, faster | 1.0 % (8.999 / 8.908) | "
            "1.77–1.92× |") in out
