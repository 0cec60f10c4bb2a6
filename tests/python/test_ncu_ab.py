"""scripts/ncu_ab.py (kernel A/B by ncu's cycle counts) on a synthetic run file: runs split at their '== ncu' lines,
ncu's units row and the program's own output ignored, per-side ranges and the change of the mean against the first
side; side and configuration specifications parsed and refused with a message; `run` alternating the sides with ncu
stubbed out."""
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ncu_ab", ROOT / "scripts" / "ncu_ab.py")
ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab)

HEADER = '"ID","Kernel Name","gpc__cycles_elapsed.max","gpu__time_duration.sum","smsp__inst_executed.sum"'
UNITS = '"","","cycle","nsecond","inst"'


def run_lines(config, side, cycles, inst):
    lines = [f"== ncu {config} {side}", HEADER, UNITS]
    lines += [f'"{i}","k<{i}>","{c:,}","1,000","{n:,}"' for i, (c, n) in enumerate(zip(cycles, inst))]
    return lines


FILE = "\n".join(
    ["machmoe-bench: some output before the first run"]
    + run_lines("7B-256", "old", [4_000_000, 8_000_000], [50_000_000, 100_000_000])
    + run_lines("7B-256", "new", [3_800_000, 7_600_000], [40_000_000, 80_000_000])
    + ["==PROF== Disconnected"]
    + run_lines("7B-256", "new", [3_820_000, 7_640_000], [40_000_000, 80_000_000])
    + run_lines("7B-256", "old", [4_020_000, 8_040_000], [50_000_000, 100_000_000])
)


def test_runs_are_read_in_file_order():
    runs = ab.read_runs(FILE)
    assert [(c, s, len(rows)) for c, s, rows in runs] == [("7B-256", "old", 2), ("7B-256", "new", 2),
                                                         ("7B-256", "new", 2), ("7B-256", "old", 2)]
    assert runs[0][2][1]["gpc__cycles_elapsed.max"] == "8,000,000"


def test_table_ranges_and_change_against_the_first_side(tmp_path, capsys):
    text = ab.table(ab.read_runs(FILE), ["dW2", "dW1"])
    lines = text.splitlines()
    assert lines[0].startswith("| config, launch | old: M cycles") and "new against old" in lines[0]
    assert lines[2] == "| 7B-256, dW2 | 4.000–4.020 (50.0) | 3.800–3.820 (40.0) | -5.0 % |"
    assert lines[3] == "| 7B-256, dW1 | 8.000–8.040 (100.0) | 7.600–7.640 (80.0) | -5.0 % |"
    path = tmp_path / "ab.csv"
    path.write_text(FILE)
    assert ab.main(["table", str(path)]) == 0
    assert "| 7B-256, launch 1 |" in capsys.readouterr().out


def test_side_specifications():
    s = ab.Side("lean:MACHMOE_A=1,MACHMOE_B=x@/tmp/bench_lean")
    assert (s.name, s.env, s.binary) == ("lean", {"MACHMOE_A": "1", "MACHMOE_B": "x"}, "/tmp/bench_lean")
    assert ab.Side("main").binary == ab.DEFAULT_BENCH and ab.Side("main").env == {}
    with pytest.raises(ValueError, match="not VAR=VALUE"):
        ab.Side("bad:NOEQUALS")
    with pytest.raises(ValueError, match="no name"):
        ab.Side(":A=1")


def test_errors_are_reported(tmp_path, capsys):
    empty = tmp_path / "empty.csv"
    empty.write_text("== ncu 7B-256 old\n")
    assert ab.main(["table", str(empty)]) == 1
    assert "no ncu launch rows" in capsys.readouterr().err
    # One side is no comparison: refused before ncu is started.
    assert ab.main(["run", "--kernel", "k", "--configs", "7B-256", "--side", "a", "--out", str(tmp_path / "o")]) == 2
    assert "two sides or more" in capsys.readouterr().err
    assert ab.main(["run", "--kernel", "k", "--configs", "7B-256", "--side", "a", "--side", "b:X",
                    "--out", str(tmp_path / "o")]) == 2
    assert "not VAR=VALUE" in capsys.readouterr().err


def test_configuration_specifications():
    assert ab.config_args("7B-256") == ("7B-256", ["--config", "7B-256"])
    assert ab.config_args("sweep=--T:16384:--d:4096") == ("sweep", ["--T", "16384", "--d", "4096"])
    for bad in ("=--T:1", "sweep="):
        with pytest.raises(ValueError, match="expected NAME or NAME="):
            ab.config_args(bad)


def test_run_alternates_the_sides_and_writes_their_rows(tmp_path, monkeypatch):
    calls = []

    class Done:
        returncode = 0
        stderr = ""

        def __init__(self, cycles):
            self.stdout = "\n".join(["==PROF== Connected", HEADER, UNITS, f'"0","k<0>","{cycles:,}","1","10"'])

    def fake_run(cmd, env, capture_output, text, timeout):
        calls.append((cmd, env.get("MACHMOE_X")))
        return Done(1000 + len(calls))

    monkeypatch.setattr(ab.subprocess, "run", fake_run)
    out = tmp_path / "ab.csv"
    assert ab.main(["run", "--kernel", "Mainloop", "--launches", "1", "--configs", "7B-256,sweep=--T:16:--E:4",
                    "--side", "a", "--side", "b:MACHMOE_X=1@/tmp/bench_b", "--out", str(out), "--", "--cache",
                    "input_only"]) == 0
    binary = lambda cmd: cmd[cmd.index("--metrics") + 2]  # noqa: E731 (ncu's options, then the program)
    assert [(binary(c), e) for c, e in calls] == [("build/bin/machmoe-bench", None), ("/tmp/bench_b", "1"),
                                                  ("/tmp/bench_b", "1"), ("build/bin/machmoe-bench", None)] * 2
    first, sweep = calls[0][0], calls[4][0]
    assert first[:3] == ["ncu", "--clock-control", "none"] and "regex:Mainloop" in first
    assert first[first.index("build/bin/machmoe-bench") + 1 :][:2] == ["--config", "7B-256"]
    assert sweep[sweep.index("build/bin/machmoe-bench") + 1 :][:4] == ["--T", "16", "--E", "4"]
    assert sweep[-2:] == ["--cache", "input_only"]
    runs = ab.read_runs(out.read_text())
    assert [(c, s) for c, s, _ in runs] == [("7B-256", "a"), ("7B-256", "b"), ("7B-256", "b"), ("7B-256", "a"),
                                           ("sweep", "a"), ("sweep", "b"), ("sweep", "b"), ("sweep", "a")]
    assert runs[5][2][0]["gpc__cycles_elapsed.max"] == "1,006"
