"""scripts/gpu_check.sh's configuration helpers (profile, detail and t8 take BENCH_CONFIGS as machmoe-bench's names or
as T:d:n:E:K rows): the benchmark arguments and the file name of each form, run from the script's own text."""
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _helpers(*calls: str) -> str:
    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    found = re.search(r"^config_args\(\) \{.*?^config_file\(\) \{[^\n]*\n", text, re.S | re.M)
    assert found, "gpu_check.sh defines config_args and config_file"
    script = found.group(0) + "\n".join(calls)
    return subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True).stdout


def test_rows_and_names_give_benchmark_arguments_and_file_names():
    out = _helpers("config_args 16384:1536:256:512:8", "config_args 7B-256",
                   "config_file 16384:1536:256:512:8", "config_file 7B-256").splitlines()
    assert out == ["--T 16384 --d 1536 --n 256 --E 512 --K 8", "--config 7B-256", "16384x1536x256x512x8", "7B-256"]
