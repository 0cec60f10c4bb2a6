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


LINE_CSV = "\n".join([
    '"File Path","/src/gpu/hopper/mainloop_varlen_m.cuh"',
    '"Function Name","persistent_kernel"',
    '"Line No","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"',
    '"149","src_row[i] = p.gather[c.row0 + r];","300","290"',
    '"150","","0","0"',
    '"File Path","/usr/local/cuda/include/crt/sm_20_intrinsics.hpp"',
    '"Line No","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"',
    '"151","return __nv_cvta_generic_to_shared_impl(p);","1,200","1,100"',
    '"0x7f00","SYNCS.PHASECHK.TRANS64.TRYWAIT P0","5","5"',
])


def test_by_line_ranks_source_lines_across_files(tmp_path, capsys):
    text = hot.line_hotspots(LINE_CSV, top=5)
    lines = text.splitlines()
    assert "sm_20_intrinsics.hpp:151" in lines[1] and "80.0%" in lines[1]  # 1200 of 1500, separator read
    assert "mainloop_varlen_m.cuh:149" in lines[2]
    assert ":150" not in text                                              # no samples: not listed
    assert "0x7f00" not in text                                            # a SASS row is not a source line
    assert lines[-1].split()[0] == "1500"
    path = tmp_path / "cuda.csv"
    path.write_text(LINE_CSV)
    assert hot.main([str(path), "--by-line", "--top", "1"]) == 0
    assert "sm_20_intrinsics.hpp:151" in capsys.readouterr().out


BARRIER_CSV = "\n".join([
    HEADER,
    '"0x10","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R5+UR6+0x38000], R2","40","40","0","40"',
    '"0x20","ISETP.NE.AND P2, PT, R1, RZ, PT","7","7","0","0"',
    '"0x30","@!P0  BRA 0x100","500","480","0","0"',
    '"0x40","HGMMA.64x256x16.F32.BF16 R24, gdesc[UR4], R24","300","200","0","0"',
    '"0x50","SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR29+0x38020], R2","10","10","0","10"',
    '"0x60","@!P1  BRA 0x200","150","150","0","0"',
    '"0x70","@!P0  BRA 0x300","99","99","0","0"',   # another predicate's branch: not this wait's retry
    '"0x200","SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR29+0x38020], R2","20","20","0","20"',
])


def test_barrier_waits_add_each_trywait_and_its_retry_branch():
    text = hot.barrier_waits(hot.tables(BARRIER_CSV)[0], top=5)
    lines = text.splitlines()
    assert "[R5+UR6+0x38000]" in lines[1] and lines[1].split()[0] == "540"   # 40 + 500, not the ISETP
    assert "[UR29+0x38020]" in lines[2] and lines[2].split()[0] == "180"     # 10 + 150 + 20, not the @!P0 BRA
    assert lines[-1].split()[0] == "1126"
    assert "48.0%" in lines[1]


def test_barrier_waits_from_the_command_line(tmp_path, capsys):
    path = tmp_path / "sass.csv"
    path.write_text(BARRIER_CSV)
    assert hot.main([str(path), "--barriers"]) == 0
    assert "[UR29+0x38020]" in capsys.readouterr().out
