"""scripts/stage_diff.py (which machmoe-bench stages moved between two sets of runs): synthetic runs, and session 84's
T8 round against session 86's first one, where token rounding's router backward had slowed on the E = 128 rows."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("stage_diff", ROOT / "scripts" / "stage_diff.py")
sd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sd)

MEASUREMENTS = ROOT / "docs" / "measurements"


def block(name, routing, fwd, stages, overridden=False, cache="preact"):
    sizes = " (sizes overridden)" if overridden else ""
    lines = [f"config {name}{sizes} (T=16384 d=1536 n=256 E=512 K=8 activation=swiglu routing={routing} cache={cache}, "
             "bf16)",
             "  pass               ms    TFLOP/s cuBLAS bound efficiency",
             f"  forward         {fwd:.3f}      500.0        1.000      0.900",
             "  backward        2.000      500.0        1.000      0.900",
             "  stages (median of 40 instrumented runs over 300 ms; they add up to 1.000 ms forward, 2.000 ms "
             "backward):"]
    lines += [f"    {s:<36} {ms:.3f} ms" for s, ms in stages.items()]
    lines.append("  activation memory: accounted 1.0 MiB, measured 1.0 MiB; peak 2.0 MiB")
    return "\n".join(lines)


def test_medians_per_configuration_and_options_and_the_thresholds():
    before = sd.stage_times("\n".join([
        block("7B-256", "token_rounding", 1.0, {"forward/token_rounding": 0.116, "backward/router_backward": 0.092},
              overridden=True),
        block("7B-256", "token_rounding", 1.0, {"forward/token_rounding": 0.118, "backward/router_backward": 0.093},
              overridden=True),
        block("7B-256", "token_rounding", 1.0, {"forward/token_rounding": 0.300}, overridden=True, cache="input_only"),
        block("1.4B-256", "topk", 1.0, {"forward/topk_scores": 0.018, "backward/db1": 0.001}),
    ]))
    after = sd.stage_times("\n".join([
        block("7B-256", "token_rounding", 1.2, {"forward/token_rounding": 0.100, "backward/router_backward": 0.091},
              overridden=True),
        block("7B-256", "token_rounding", 1.0, {"forward/token_rounding": 0.200}, overridden=True, cache="input_only"),
        block("1.4B-256", "topk", 1.0, {"forward/topk_scores": 0.019, "backward/db1": 0.002}),
        block("30B-256", "topk", 1.0, {"forward/topk_scores": 0.030}),
    ]))
    key = ("(16384,1536,256,512,8)", "activation=swiglu routing=token_rounding cache=preact")
    assert before[key]["forward/token_rounding"] == [0.116, 0.118]
    assert before[key]["pass/forward"] == [1.0, 1.0]
    rows = {(r[0], r[1], r[2]): r for r in sd.diff(before, after)}
    # the median of two runs (0.117) against one: -14.5 %; the router backward moved 1 us of 92 (under 10 %); the
    # forward pass 1.0 -> 1.2; the recompute mode's run is its own row; db1 doubled but by 1 us (under --min-ms);
    # 30B-256 has no run before.
    assert set(rows) == {(key[0], key[1], "forward/token_rounding"), (key[0], key[1], "pass/forward"),
                         (key[0], "activation=swiglu routing=token_rounding cache=input_only",
                          "forward/token_rounding")}
    assert abs(rows[(key[0], key[1], "forward/token_rounding")][3] - 0.117) < 1e-12
    assert len(sd.diff(before, after, every=True)) == 11  # every stage and pass both sides share: 4 + 3 + 4
    table = sd.table(sd.diff(before, after), shown=sd.varying(list(before) + list(after))).splitlines()
    assert table[2] == ("| (16384,1536,256,512,8) | routing=token_rounding cache=preact | pass/forward | 1.000 (2) | "
                        "1.200 (1) | 1.20 |")


def test_session84_against_session86_finds_the_router_backward_of_the_e128_rows():
    before = sd.stage_times(sd.read_text(MEASUREMENTS / "2026-12-02-session84" / "call2_t8_raw.txt.xz"))
    after = sd.stage_times(sd.read_text(MEASUREMENTS / "2026-12-02-session86" / "call1_t8_raw.txt.xz"))
    assert len(before) == 24 and len(after) == 40  # 12 main rows, and 8 sweep rows after, each in both routings
    rows = sd.diff(before, after)
    assert sorted((r[0], r[2], r[3], r[5]) for r in rows) == [
        ("1.4B-256", "backward/router_backward", 0.044, 0.055),
        ("120B-1024", "backward/router_backward", 0.039, 0.049),
        ("30B-512", "backward/router_backward", 0.040, 0.049),
        ("7B-256", "backward/router_backward", 0.029, 0.037),
    ]
    assert all("routing=token_rounding" in r[1] for r in rows)


def test_session88s_epilogue_term_shows_where_a_long_stage_moved_a_share_of_its_pass():
    # Session 88's router term in dX~'s epilogue (not landed) against session 87's code: dX~ 3.583 -> 3.907 ms on
    # 30B (1024,64,4) is 9 % of the stage (under --min-rel) but 2.7 % of its 11.9 ms backward.
    before = sd.stage_times(sd.read_text(MEASUREMENTS / "2026-12-02-session87" / "call4_t8_raw.txt.xz"))
    after = sd.stage_times(sd.read_text(MEASUREMENTS / "2026-12-03-session88" / "call3_t8_raw.txt.xz"))
    dx = {(r[0], r[3], r[5]) for r in sd.diff(before, after)
          if r[2] == "backward/dx_expanded" and "routing=topk" in r[1]}
    assert ("30B-1024", 3.583, 3.907) in dx and ("120B-1024", 7.287, 7.852) in dx
    assert ("1.4B-256", 0.509, 0.641) in dx  # 26 %: shown by --min-rel as well
    by_rel_only = {(r[0], r[3], r[5]) for r in sd.diff(before, after, min_pass_share=1.0)
                   if r[2] == "backward/dx_expanded" and "routing=topk" in r[1]}
    assert ("30B-1024", 3.583, 3.907) not in by_rel_only and ("1.4B-256", 0.509, 0.641) in by_rel_only
    # a pass itself is measured against --min-rel only (its share of itself would always pass)
    assert all(r[2] != "pass/backward" or abs(r[5] - r[3]) >= 0.10 * r[3] for r in sd.diff(before, after))


def test_the_command_line(capsys, tmp_path):
    one = tmp_path / "one.txt"
    two = tmp_path / "two.txt"
    one.write_text(block("1.4B-256", "topk", 1.0, {"forward/topk_scores": 0.020}))
    two.write_text(block("1.4B-256", "topk", 1.0, {"forward/topk_scores": 0.030}) + "\n" +
                   block("7B-256", "topk", 1.0, {"forward/topk_scores": 0.030}))
    assert sd.main(["--min-rel", "0.6", str(one), "--", str(two)]) == 0  # +50 %: under 60 %
    out = capsys.readouterr().out
    assert "topk_scores" not in out and "only after (configurations with runs on that side alone): 7B-256" in out
    assert sd.main([str(one), "--", str(two)]) == 0
    assert "| 1.4B-256 | - | forward/topk_scores | 0.020 (1) | 0.030 (1) | 1.50 |" in capsys.readouterr().out
    assert sd.main([str(one), str(two)]) == 2  # no '--'
    assert sd.main(["--bogus", str(one), "--", str(two)]) == 2
    assert sd.main(["--min-pass-share", "0.5", "--min-rel", "0.6", str(one), "--", str(two)]) == 0
    assert "topk_scores" not in capsys.readouterr().out  # 0.010 of a 1.0 ms forward: 1 %, under 50 %
