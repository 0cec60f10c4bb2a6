"""python -m machmoe.parallel_benchmark on the CPU (gloo), end to end as a user launches it: torchrun with 2
processes and a plain `python -m` (EP = 1) whose JSON is then the baseline of the scaling efficiency. The figures
themselves mean nothing on a CPU; the test checks the launch paths, the JSON and that every field is filled."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["tiny-64", "tiny-128"]


def _env():
    env = dict(os.environ)
    if env.get("MACHMOE_IN_TREE") == "1":  # the checkout's sources, as conftest.py arranges for this process
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python")] + [p for p in [env.get("PYTHONPATH")] if p])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd, timeout=300):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p


def _check(doc, ep_size, configs=TINY):
    assert doc["benchmark"] == "machmoe.parallel_benchmark" and doc["ep_size"] == ep_size
    assert doc["environment"]["backend"] == "gloo" and doc["settings"]["dtype"] == "fp32"
    assert [e["config"]["name"] for e in doc["configs"]] == configs
    for e in doc["configs"]:
        assert e["status"] == "ok", e
        c = e["config"]
        assert e["ep_size"] == ep_size and e["tokens_per_gpu"] == c["T"] and e["experts_per_gpu"] == c["E"] // ep_size
        assert e["step_ms"] > 0 and len(e["step_ms_per_rank"]) == ep_size and e["tokens_per_s_per_gpu"] > 0
        a = e["all_to_all"]
        assert a["instrumented_step_ms"] > 0, a
        if ep_size == 1:  # a group of one exchanges nothing
            assert a["in_layer_ms"] == a["alone_ms"] == a["exchanges_per_step"] == 0, a
            assert a["alone_algbw_GBps"] is None, a
        else:
            for key in ("in_layer_ms", "alone_ms", "alone_algbw_GBps"):
                assert a[key] > 0, (key, a)
            assert 0 < a["in_layer_share"] < 1, a
            assert a["exchanges_per_step"] > 0 and a["bytes_sent_per_gpu"] > a["bytes_leaving_per_gpu"] > 0, a
            assert a["alone_leaving_GBps"] > 0, a
        r = e["received_pairs"]
        assert r["mean"] == r["balanced"] == c["T"] * c["K"] and r["min"] <= r["mean"] <= r["max"]
        rows = e["received_rows"]
        if ep_size == 1:  # nothing is received
            assert rows is None, rows
        elif e["capacity"] is None:  # one row per token and rank: at most one per pair, at least one per token
            assert c["T"] <= rows["mean"] <= c["T"] * c["K"] and rows["min"] <= rows["mean"] <= rows["max"], rows
        else:  # one row per sent pair: every pair when nothing is dropped
            assert e["dropped_rows"] != 0 or (rows["min"], rows["max"]) == (r["min"], r["max"]), (rows, r)
    return doc


def test_torchrun_two_processes_with_an_ep1_baseline(tmp_path):
    ep1, ep2 = tmp_path / "ep1.json", tmp_path / "ep2.json"
    common = ["--device", "cpu", "--tiny", "--warmup", "1", "--iters", "2"]
    p = _run([sys.executable, "-m", "machmoe.parallel_benchmark", *common, "--json", str(ep1)])
    doc1 = _check(json.loads(ep1.read_text()), 1)
    assert all(e["scaling_efficiency"] == 1.0 for e in doc1["configs"])
    assert "tiny-64 (T=256/GPU" in p.stdout and "no all-to-all (a group of one sends nothing)" in p.stdout
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
          "machmoe.parallel_benchmark", *common, "--baseline", str(ep1), "--json", str(ep2)])
    doc2 = _check(json.loads(ep2.read_text()), 2)
    for e, b in zip(doc2["configs"], doc1["configs"]):
        assert e["baseline_tokens_per_s_per_gpu"] == b["tokens_per_s_per_gpu"]
        assert e["scaling_efficiency"] == pytest.approx(e["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"])


def test_capacity_mode_and_refusals(tmp_path):
    out = tmp_path / "cap.json"
    _run([sys.executable, "-m", "machmoe.parallel_benchmark", "--device", "cpu", "--configs", "tiny-64",
          "--warmup", "0", "--iters", "1", "--capacity-factor", "2", "--json", str(out)])
    e = _check(json.loads(out.read_text()), 1, ["tiny-64"])["configs"][0]
    assert e["capacity"] == 2 * 256 * 2 and e["dropped_rows"] == 0
    out2 = tmp_path / "cap2.json"
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
          "machmoe.parallel_benchmark", "--device", "cpu", "--configs", "tiny-64", "--warmup", "0", "--iters", "1",
          "--capacity-factor", "2", "--json", str(out2)])
    e2 = _check(json.loads(out2.read_text()), 2, ["tiny-64"])["configs"][0]
    assert e2["capacity"] == 2 * 256 * 2 // 2 and e2["dropped_rows"] == 0
    assert e2["all_to_all"]["exchanges_per_step"] == 5  # counts, rows out and back, and their two gradients
    p = subprocess.run([sys.executable, "-m", "machmoe.parallel_benchmark", "--device", "cpu", "--configs", "7B-999"],
                       capture_output=True, text=True, timeout=120, env=_env())
    assert p.returncode != 0 and "unknown configuration '7B-999'" in p.stderr
    not_ep1 = tmp_path / "ep2.json"
    not_ep1.write_text(json.dumps({"ep_size": 2, "configs": []}))
    p = subprocess.run([sys.executable, "-m", "machmoe.parallel_benchmark", "--device", "cpu", "--configs", "tiny-64",
                        "--baseline", str(not_ep1)], capture_output=True, text=True, timeout=120, env=_env())
    assert p.returncode != 0 and "expected an EP = 1 run of this benchmark" in p.stderr


@pytest.mark.parametrize("args, message", [
    (["--iters", "0"], "--iters: expected at least 1"),
    (["--warmup", "-1"], "--warmup: expected 0 or more"),
    (["--tokens", "0"], "--tokens: expected at least 1 token"),
    (["--device", "cpu", "--dtype", "bf16"], "--dtype: expected fp32 or fp64 with --device cpu"),
])
def test_bad_counts_and_cpu_dtypes_are_refused_at_parse_time(args, message, capsys):
    from machmoe import parallel_benchmark as PB
    with pytest.raises(SystemExit) as e:
        PB.parse_args(["--device", "cpu", "--tiny", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--capacity-factor", "-5"], "--capacity-factor: expected a finite number above 0"),
    (["--capacity-factor", "0"], "--capacity-factor: expected a finite number above 0"),
    (["--capacity-factor", "nan"], "--capacity-factor: expected a finite number above 0"),
    (["--timeout", "0"], "--timeout: expected a finite number of seconds above 0"),
    (["--timeout", "-1"], "--timeout: expected a finite number of seconds above 0"),
    (["--configs", "tiny-64"], "--tiny picks the tiny configurations; with --configs name them there"),
])
def test_bad_capacity_timeout_and_tiny_with_configs_are_refused(args, message, capsys):
    from machmoe import parallel_benchmark as PB
    with pytest.raises(SystemExit) as e:
        PB.parse_args(["--device", "cpu", "--tiny", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


def _main_with_run_config(run_config_body, out):
    """python -c: PB.main on the tiny configurations (one process, EP = 1, JSON to `out`) with run_config replaced by
    a function of (cfg, args, device) whose body is `run_config_body` (indented lines); returns the finished
    process."""
    script = (
        "import sys\n"
        "import machmoe.parallel_benchmark as PB\n"
        "def run_config(cfg, args, device):\n"
        f"{run_config_body}"
        "PB.run_config = run_config\n"
        f"sys.exit(PB.main(['--device', 'cpu', '--tiny', '--json', {str(out)!r}]))\n")
    env = _env()
    env.pop("RANK", None)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)


def test_a_failed_or_non_finite_configuration_exits_1(tmp_path):
    # One process (EP = 1): a failed configuration is recorded and the run goes on, but the exit status says so.
    out = tmp_path / "failed.json"
    p = _main_with_run_config("    if cfg.name == 'tiny-64':\n"
                              "        raise RuntimeError('boom')\n"
                              "    return {'status': 'non_finite_output'}\n", out)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "2 configuration(s) did not run cleanly: tiny-64, tiny-128" in p.stderr
    doc = json.loads(out.read_text())
    assert [e["status"] for e in doc["configs"]] == ["failed", "non_finite_output"]


def test_a_run_in_which_every_configuration_was_skipped_exits_1(tmp_path):
    # A configuration whose E is not a multiple of the EP size is skipped, which alone is no failure; a run that
    # skipped every configuration measured nothing, and its exit status says so.
    out = tmp_path / "skipped.json"
    p = _main_with_run_config("    return {'status': 'skipped', 'reason': 'E is not a multiple of the EP size'}\n", out)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "no configuration ran at EP = 1" in p.stderr and "nothing was measured" in p.stderr
    assert [e["status"] for e in json.loads(out.read_text())["configs"]] == ["skipped", "skipped"]
