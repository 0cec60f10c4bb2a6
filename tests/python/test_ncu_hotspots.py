"""scripts/ncu_hotspots.py (the GPU profiling helper of `scripts/gpu_check.sh detail`) on a synthetic source-page CSV:
one table per launch, instructions ranked by stall samples, the program's own output lines ignored."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ncu_hotspots", ROOT / "scripts" / "ncu_hotspots.py")
hot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hot)

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"stall_long_sb","stall_barrier"')
CSV = "\n".join([
    "==PROF== Connected to process",
    HEADER,
    '"0x10","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2+URZ], R3","900","880","0","850"',
    '"0x20","HGMMA.64x256x16.F32.BF16 R24, gdesc[UR4], R24","100","90","0","0"',
    "machmoe-bench output line",
    '"0x30","LDGSTS.E.BYPASS.128 [R5], desc[UR6][R8.64]","1,300","250","240","0"',
    HEADER,
    '"0x10","NOP","5","5","0","0"',
])


def test_one_table_per_launch_ranked_by_samples(tmp_path):
    found = hot.tables(CSV)
    assert [len(t) for t in found] == [3, 1]
    text = hot.hotspots(found[0], top=2)
    lines = text.splitlines()
    assert "LDGSTS" in lines[1] and "56.5%" in lines[1]   # 1300 of 2300 samples, thousands separator read
    assert "TRYWAIT" in lines[2] and "stall_barrier=850" in lines[2]
    assert "HGMMA" not in text                           # beyond --top
    assert lines[-1].split()[0] == "2300"
    path = tmp_path / "sass.csv"
    path.write_text(CSV)
    assert hot.main([str(path), "--top", "1"]) == 0


def test_a_file_without_tables_is_an_error(tmp_path, capsys):
    path = tmp_path / "empty.csv"
    path.write_text("==ERROR== no kernels were profiled\n")
    assert hot.main([str(path)]) == 1
    assert "no CSV table" in capsys.readouterr().err


def test_a_table_without_the_sampling_column_says_which_columns_it_has():
    rows = hot.tables('"Address","Source"\n"0x0","NOP"')[0]
    assert "columns: Address, Source" in hot.hotspots(rows, top=5)
