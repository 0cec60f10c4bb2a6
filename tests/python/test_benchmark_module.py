"""python -m machmoe.benchmark (python/machmoe/benchmark/): the CPU path end to end on tiny configurations (runner,
JSON, Markdown, plots or their announced skip, exit statuses), the baselines against the machmoe CPU layer, the
float64 check, the configuration table; and (marked gpu) the --quick run on CUDA."""
import json
import os
import re
import statistics
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import machmoe
from machmoe.benchmark import baselines, cli, configs, reference
from machmoe.benchmark.baselines import GroupedMMMoE, LoopMoE

ROOT = Path(__file__).resolve().parents[2]
IMPLS = ["machmoe", "machmoe-recompute", "machmoe-token-rounding", "torch-grouped-mm", "torch-loop", "cublas-bound"]


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def run_module(args, timeout=600):
    """The benchmark as a user runs it: a new interpreter, `python -m machmoe.benchmark`."""
    env = dict(os.environ)
    if env.get("MACHMOE_IN_TREE") == "1":  # the checkout's sources, as conftest.py arranges for this process
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python")] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, "-m", "machmoe.benchmark", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_cpu_quick_end_to_end(tmp_path):
    p = run_module(["--device", "cpu", "--quick", "--iters", "1", "--warmup", "0", "--out-dir", str(tmp_path)])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["device"]["type"] == "cpu" and doc["settings"]["dtype"] == "fp32"
    # No power cap to reach on the CPU: no time-based warm-up or window there.
    assert doc["settings"]["warmup_ms"] == 0 and doc["settings"]["time_ms"] == 0
    assert [e["config"]["name"] for e in doc["configs"]] == configs.QUICK_CPU
    # stderr is not a terminal here: one timestamped line per step (a batch log), the last one saying it finished
    steps = re.findall(r"^\[(\d+)/(\d+) \+\d+ s\] (\S+): ([^;\s]+)", p.stderr, re.M)
    assert [(c, i) for _, _, c, i in steps] == [(c, i) for c in configs.QUICK_CPU for i in IMPLS], p.stderr[-3000:]
    assert [int(k) for k, _, _, _ in steps] == list(range(1, len(steps) + 1))
    assert {int(n) for _, n, _, _ in steps} == {len(steps)}
    assert re.search(r"^\[done \+\d+ s\] \S+: cublas-bound took [\d.]+ s$", p.stderr, re.M), p.stderr[-3000:]
    for entry in doc["configs"]:
        assert entry["status"] == "ok"
        assert list(entry["results"]) == IMPLS
        for name, r in entry["results"].items():
            assert r["status"] == "ok", (entry["config"]["name"], name, r)
            for key in ("forward_ms", "backward_ms", "fwdbwd_ms", "forward_tflops", "backward_tflops"):
                assert r[key] > 0, (name, key)
            if name == "cublas-bound":
                continue
            assert r["first_call_s"] > 0 and r["pairs"] > 0
            assert r["activation_bytes"] is None and r["peak_bytes"] is None  # allocator figures: CUDA only
            a = r["agreement"]
            assert a["ok"] and a["max"] < 1e-5, (name, a)  # fp32 against float64
            assert set(a["errors"]) == {"output", "grad_x", "grad_router_weight", "grad_w1", "grad_w2"}
            if name.startswith("machmoe"):
                assert a["routing_matches_counts"] is True
                assert set(r["speedup_over"]) == set(IMPLS) - {name}
        c = entry["config"]
        assert entry["results"]["torch-loop"]["pairs"] == c["T"] * c["K"]
    assert doc["verdict"] == {"machmoe_agreement_failures": [], "machmoe_failures": [], "other_failures": []}
    md = (tmp_path / "results.md").read_text()
    assert "| config |" in md and "cpu-tiny-32" in md and "torch-grouped-mm" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        # Not silent: the JSON and the output both say that the plots were skipped and why.
        assert "matplotlib" in doc["plots"]["skipped"]
        assert "plots skipped" in p.stdout and "matplotlib" in p.stdout
        assert not list(tmp_path.glob("*.png"))
    else:
        names = doc["plots"]["files"]  # relative to the JSON's folder
        assert set(names) >= {"tflops.png", "token_rounding.png"} and all("/" not in f for f in names), names
        for f in names:
            assert (tmp_path / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert str(tmp_path / f) in p.stdout


@pytest.mark.parametrize("cls", [GroupedMMMoE, LoopMoE])
def test_baselines_match_machmoe_cpu_layer(cls):
    torch.manual_seed(0)
    m = machmoe.MoE(64, 32, 8, 2, dtype=torch.float32)
    b = cls.from_machmoe(m, share=False)
    assert all(torch.equal(getattr(b, k), getattr(m, k)) for k in ("router_weight", "w1", "w2"))
    x = torch.randn(200, 64)
    xm, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    om = m(xm)
    ob, logits, idx = b(xb)
    assert rel(logits, om.router_logits) < 1e-6  # the same router GEMM up to fp32 summation order
    assert torch.equal(torch.bincount(idx.reshape(-1), minlength=8).int(), om.expert_counts)
    assert rel(ob, om.output) < 1e-5
    go = torch.randn_like(ob)
    om.output.backward(go)
    ob.backward(go)
    for name in ("router_weight", "w1", "w2"):
        assert rel(getattr(b, name).grad, getattr(m, name).grad) < 1e-5, name
    assert rel(xb.grad, xm.grad) < 1e-5
    # Shared weights: the same Parameter objects.
    assert cls.from_machmoe(m).w1 is m.w1


def test_baselines_refuse_other_layers():
    with pytest.raises(ValueError, match="default layer"):
        GroupedMMMoE.from_machmoe(machmoe.MoE(64, 32, 8, 2, activation="geglu"))


def test_reference_check_passes_exact_and_flags_wrong_gradients():
    torch.manual_seed(1)
    m = machmoe.MoE(32, 16, 4, 2, dtype=torch.float64)
    x = torch.randn(50, 32, dtype=torch.float64, requires_grad=True)
    S = torch.tensor([0, 3, 7, 20, 49])
    go = torch.zeros(50, 32, dtype=torch.float64)
    go[S] = torch.randn(5, 32, dtype=torch.float64)
    o = m(x)
    o.output.backward(go)
    weights = {k: getattr(m, k) for k in ("router_weight", "w1", "w2")}
    grads = {k: v.grad for k, v in weights.items()}
    r = reference.check(x.detach(), x.grad, go, S, weights, o.output, o.router_logits, grads, K=2,
                        counts=o.expert_counts)
    assert r["ok"] and r["max"] < 1e-12 and r["routing_matches_counts"], r
    bad = dict(grads, w1=grads["w1"] * 1.05)
    r = reference.check(x.detach(), x.grad, go, S, weights, o.output, o.router_logits, bad, K=2)
    assert not r["ok"] and 0.04 < r["errors"]["grad_w1"] < 0.06 and r["errors"]["grad_w2"] < 1e-12
    # A NaN anywhere fails (max() steps over a NaN that is not first; output comes first, so test the others).
    for name in ("w1", "w2", "router_weight"):
        nan = dict(grads, **{name: torch.full_like(grads[name], float("nan"))})
        r = reference.check(x.detach(), x.grad, go, S, weights, o.output, o.router_logits, nan, K=2)
        assert not r["ok"] and r["max"] == float("inf"), (name, r)
    r = reference.check(x.detach(), torch.full_like(x.grad, float("nan")), go, S, weights, o.output,
                        o.router_logits, grads, K=2)
    assert not r["ok"] and r["max"] == float("inf"), r


def _main(args, capsys):
    rc = cli.main(["--device", "cpu", "--iters", "1", "--warmup", "0", "--no-progress", *args])
    return rc, capsys.readouterr()


def test_machmoe_beyond_t10_fails_loudly(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(reference, "T10", 0.0)  # nothing can pass: the failure path
    rc, out = _main(["--configs", "cpu-tiny-32", "--impls", "machmoe,torch-loop", "--no-plots",
                     "--out-dir", str(tmp_path)], capsys)
    assert rc == cli.EXIT_T10
    assert "FAILED: machmoe disagrees with the float64 reference beyond T10" in out.err
    assert "cpu-tiny-32/machmoe" in out.err and "torch-loop" not in out.err  # only machmoe is held to it
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["verdict"]["machmoe_agreement_failures"]


def test_a_failing_baseline_is_reported_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    def boom(self, x):
        raise RuntimeError("boom: baseline crashed")
    monkeypatch.setattr(GroupedMMMoE, "forward", boom)
    rc, out = _main(["--configs", "cpu-tiny-32,cpu-tiny-16", "--impls", "machmoe,torch-grouped-mm,torch-loop",
                     "--no-plots", "--out-dir", str(tmp_path)], capsys)
    assert rc == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert len(doc["configs"]) == 2
    for e in doc["configs"]:
        r = e["results"]
        assert r["torch-grouped-mm"]["status"] == "failed" and "boom" in r["torch-grouped-mm"]["error"]
        assert r["machmoe"]["status"] == "ok" and r["torch-loop"]["status"] == "ok"
        assert "torch-grouped-mm" not in r["machmoe"]["speedup_over"]
    assert len(doc["verdict"]["other_failures"]) == 2
    assert "(not fatal)" in out.err and "failed: RuntimeError: boom" in (tmp_path / "results.md").read_text()


def test_usage_errors(capsys):
    assert cli.main(["--device", "cpu", "--configs", "7B-999"]) == cli.EXIT_USAGE
    assert "unknown configuration '7B-999'" in capsys.readouterr().err
    assert cli.main(["--device", "cpu", "--impls", "nope"]) == cli.EXIT_USAGE
    assert cli.main(["--device", "cpu", "--dtype", "bf16"]) == cli.EXIT_USAGE
    for flag, v in (("--warmup-ms", "-1"), ("--time-ms", "nan"), ("--time-ms", "inf")):
        assert cli.main(["--device", "cpu", flag, v]) == cli.EXIT_USAGE
        assert f"{flag} must be a finite number >= 0" in capsys.readouterr().err


def test_configuration_table():
    # The 12 main configurations carry machmoe-bench's names and sizes (benchmarks/cli_options.cpp).
    cpp = (ROOT / "benchmarks" / "cli_options.cpp").read_text()
    named = {m[0]: tuple(int(v) for v in m[1:]) for m in
             re.findall(r'\{"([0-9.]+B-\d+)", (\d+), (\d+), (\d+), (\d+), (\d+), ""\}', cpp)}
    assert len(named) == 12
    assert {c.name: (c.T, c.d, c.n, c.E, c.K) for c in configs.MAIN} == named
    assert len(configs.DEFAULT) == 12 + 8 + 4
    tr = [c for c in configs.SWEEPS]
    assert {(c.T, c.d, c.n, c.K) for c in tr} == {(16384, 1536, 256, 8), (16384, 4096, 1024, 4)}
    assert sorted(c.E for c in tr if c.d == 1536) == [64, 128, 256, 512]
    assert sorted(c.E for c in tr if c.d == 4096) == [32, 64, 128, 256]
    assert {c.d for c in configs.ODD} == {2880, 2944} and all(c.d == c.n for c in configs.ODD)
    assert [c.name for c in configs.select("7B-256,sweeps")][:2] == ["7B-256", "TR1536-E64"]
    assert [c.name for c in configs.select("", quick=True, device="cuda")] == configs.QUICK_GPU
    with pytest.raises(ValueError):
        configs.select("nope")


def test_cublas_bound_follows_the_cpp_definition(monkeypatch):
    calls = []
    monkeypatch.setattr(baselines, "batched_gemm_ms", lambda E, M, N, K, *a: calls.append((E, M, N, K)) or 1.0)
    b = baselines.cublas_bound(T=64, d=16, n=8, E=4, K=2, dtype=torch.float32, device=torch.device("cpu"),
                               copy_bw=1e9)
    Te, r = 64 * 2 // 4, 16
    assert calls == [(4, Te, r, 16), (4, Te, 16, 8), (4, Te, 8, 16), (4, 16, 8, Te), (4, Te, 16, r), (4, r, 16, Te)]
    agg = 4 * (64 * 2 * 16 + 64 * 16) / 1e9 * 1e3  # the aggregations' elements at 4 bytes each (fp32)
    assert b["forward_ms"] == pytest.approx(2 + agg) and b["backward_ms"] == pytest.approx(4 + agg)
    b16 = baselines.cublas_bound(T=64, d=16, n=8, E=4, K=2, dtype=torch.bfloat16, device=torch.device("cpu"),
                                 copy_bw=1e9)
    assert b16["aggregation_ms"] == pytest.approx(agg / 2)  # bf16: the C++ benchmark's 2 TK d + 2 T d bytes


def test_timed_window_on_the_gpu_path(monkeypatch):
    # time_ms on a GPU: untimed calls until warmup_ms, then timed calls until both iters and min_ms are reached.
    # Simulated on the CPU: a device that says "cuda", events that time a fixed 2 ms, a clock that a call advances.
    clock = {"t": 0.0}

    class Event:
        def __init__(self, enable_timing=True):
            self.at = None

        def record(self):
            self.at = clock["t"]

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 2.0

    class Stream:
        def synchronize(self):
            pass

    calls = []

    def fn():
        calls.append(clock["t"])
        clock["t"] += 0.002  # 2 ms per call

    monkeypatch.setattr(baselines.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(baselines.torch.cuda, "Event", Event)
    monkeypatch.setattr(baselines.torch.cuda, "current_stream", lambda device=None: Stream())
    dev = types.SimpleNamespace(type="cuda")
    assert baselines.time_ms(fn, dev, 3, 5, warmup_ms=100.0, min_ms=50.0) == 2.0
    # 3 counted warm-up calls, 50 more for the 100 ms warm-up, then 25 timed ones (the 50 ms window beats 5 calls)
    assert len(calls) == 3 + 50 + 25
    calls.clear()
    assert baselines.time_ms(fn, dev, 0, 5, warmup_ms=0.0, min_ms=0.0) == 2.0
    assert len(calls) == 5  # without the windows: the counts alone


@pytest.mark.gpu
def test_gpu_quick_run(tmp_path):
    if not torch.cuda.is_available():
        pytest.fail("GPU test run on a machine without a CUDA device")
    p = run_module(["--quick", "--out-dir", str(tmp_path), "--no-progress"], timeout=3000)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["device"]["type"] == "cuda" and doc["settings"]["dtype"] == "bf16"
    assert doc["device"]["copy_bandwidth_GBps"] > 100
    assert [e["config"]["name"] for e in doc["configs"]] == configs.QUICK_GPU
    for e in doc["configs"]:
        res = e["results"]
        assert list(res)[:6] == IMPLS
        for name in IMPLS:
            r = res[name]
            assert r["status"] == "ok", (name, r)
            assert r["forward_ms"] > 0 and r["backward_ms"] > 0 and r["fwdbwd_ms"] > 0 and r["forward_tflops"] > 0
            if name == "cublas-bound":
                continue
            assert r["activation_bytes"] > 0 and r["peak_bytes"] >= r["forward_retained_bytes"] > 0
            assert r["agreement"]["errors"]["output"] < 1e-2
        for name in ("machmoe", "machmoe-recompute", "machmoe-token-rounding"):
            assert res[name]["agreement"]["ok"], (name, res[name]["agreement"])
            assert set(res[name]["speedup_over"]) >= {"torch-grouped-mm", "torch-loop", "cublas-bound"}
            assert 0 < res[name]["efficiency"]["forward"] < 2
        # Recompute mode keeps less for the backward than the default (docs/TARGETS.md T7).
        assert res["machmoe-recompute"]["activation_bytes"] < res["machmoe"]["activation_bytes"]
    assert doc["verdict"]["machmoe_agreement_failures"] == [] and doc["verdict"]["machmoe_failures"] == []


def test_append_continues_a_split_run(tmp_path):
    """--append keeps the configurations already in the JSON, runs only the missing ones, and reports over all of
    them; other settings are refused (a long GPU run is split over several invocations this way)."""
    common = ["--device", "cpu", "--iters", "1", "--warmup", "0", "--out-dir", str(tmp_path), "--no-progress"]
    first, second = configs.QUICK_CPU[0], configs.QUICK_CPU[1]
    p = run_module(["--configs", first, *common])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    before = json.loads((tmp_path / "results.json").read_text())
    p = run_module(["--configs", f"{first},{second}", "--append", *common])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"already in {tmp_path / 'results.json'}: {first}" in p.stdout
    doc = json.loads((tmp_path / "results.json").read_text())
    assert [e["config"]["name"] for e in doc["configs"]] == [first, second]
    assert doc["configs"][0] == before["configs"][0]  # kept as it was, not re-run
    assert len(doc["appended"]) == 1 and doc["date"] == before["date"]
    md = (tmp_path / "results.md").read_text()
    assert first in md and second in md
    p = run_module(["--configs", second, "--append", "--dtype", "fp64", *common])
    assert p.returncode == 2 and "other settings" in p.stderr and "dtype" in p.stderr
    # Rows measured with other software would be relabelled with this run's versions: refused too.
    doc["versions"]["torch"] = "0.0.1"
    (tmp_path / "results.json").write_text(json.dumps(doc))
    p = run_module(["--configs", second, "--append", *common])
    assert p.returncode == 2 and "other versions (torch '0.0.1'" in p.stderr


def test_append_reads_back_an_infinite_error(tmp_path):
    """write_json stores an infinite error as "inf" and a NaN as null; --append reads them back, and the verdict and
    the tables still report them (a machmoe row beyond T10: exit status 3, not a traceback)."""
    common = ["--device", "cpu", "--iters", "1", "--warmup", "0", "--out-dir", str(tmp_path), "--no-progress",
              "--impls", "machmoe,torch-loop", "--no-plots"]
    first, second = configs.QUICK_CPU[0], configs.QUICK_CPU[1]
    assert run_module(["--configs", first, *common]).returncode == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    for name in ("machmoe", "torch-loop"):
        agreement = doc["configs"][0]["results"][name]["agreement"]
        key = next(iter(agreement["errors"]))
        agreement.update(ok=False, max="inf")
        agreement["errors"][key] = "inf"
        agreement["errors"]["extra"] = None
    (tmp_path / "results.json").write_text(json.dumps(doc))
    p = run_module(["--configs", f"{first},{second}", "--append", *common])
    assert p.returncode == cli.EXIT_T10, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"{first}/machmoe: " in p.stderr and " inf" in p.stderr and "extra nan" in p.stderr
    md = (tmp_path / "results.md").read_text()
    assert "| inf |" in md and second in md


def test_progress_lines_for_batch_logs():
    """Off a terminal the progress display writes one flushed line per step (what, since when, how long the previous
    step took), so a log of a run stopped by a time limit still shows where the time went; disabled, it writes
    nothing."""
    import io
    from machmoe.benchmark.progress import Progress
    out = io.StringIO()
    p = Progress(3, stream=out)
    assert p.backend == "plain"
    for what in ("a: machmoe", "a: sonicmoe (subprocess)", "b: machmoe"):
        p.step(what)
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 4, lines
    assert re.fullmatch(r"\[1/3 \+\d+ s\] a: machmoe", lines[0])
    assert re.fullmatch(r"\[2/3 \+\d+ s\] a: sonicmoe \(subprocess\); previous step [\d.]+ s", lines[1])
    assert re.fullmatch(r"\[3/3 \+\d+ s\] b: machmoe; previous step [\d.]+ s", lines[2])
    assert re.fullmatch(r"\[done \+\d+ s\] b: machmoe took [\d.]+ s", lines[3])
    quiet = io.StringIO()
    q = Progress(2, enabled=False, stream=quiet)
    q.step("a: machmoe")
    q.close()
    assert quiet.getvalue() == "" and q.backend == "off"


def test_rounds_report_the_median_round(tmp_path):
    """--rounds R runs every implementation R times in turn per configuration; each time is the median over the
    rounds, the rounds' times are in the JSON, and the report says so. Bad counts are usage errors."""
    common = ["--device", "cpu", "--iters", "1", "--warmup", "0", "--out-dir", str(tmp_path), "--no-progress",
              "--no-plots", "--configs", configs.QUICK_CPU[0], "--impls", "machmoe,torch-loop"]
    p = run_module([*common, "--rounds", "3"])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["settings"]["rounds"] == 3
    for name, r in doc["configs"][0]["results"].items():
        assert r["status"] == "ok", (name, r)
        for k in ("forward", "backward", "fwdbwd"):
            values = r["rounds"][f"{k}_ms"]
            assert len(values) == 3 and all(v > 0 for v in values), (name, k, values)
            assert r[f"{k}_ms"] == sorted(values)[1], (name, k)
        # The same model FLOPs as one round's, over the median time.
        flops = 6.0 * r["pairs"] * doc["configs"][0]["config"]["n"] * doc["configs"][0]["config"]["d"]
        assert r["forward_tflops"] == pytest.approx(flops / (r["forward_ms"] * 1e9)), name
    m = doc["configs"][0]["results"]["machmoe"]
    assert m["speedup_over"]["torch-loop"]["fwdbwd"] == pytest.approx(
        doc["configs"][0]["results"]["torch-loop"]["fwdbwd_ms"] / m["fwdbwd_ms"])
    assert "median of 3 rounds" in (tmp_path / "results.md").read_text()
    p = run_module([*common, "--rounds", "0"])
    assert p.returncode == cli.EXIT_USAGE and "--rounds must be at least 1, got 0" in p.stderr


def test_merge_rounds_keeps_a_failure():
    from machmoe.benchmark.runner import merge_rounds
    ok = lambda ms: {"status": "ok", "forward_ms": ms, "backward_ms": 2 * ms, "fwdbwd_ms": 3 * ms,  # noqa: E731
                     "forward_tflops": 10.0 / ms, "backward_tflops": 5.0 / ms, "fwdbwd_tflops": 10.0 / (3 * ms)}
    rounds = [{"status": "ok", "results": {"a": ok(1.0), "b": ok(2.0)}},
              {"status": "ok", "results": {"a": ok(3.0), "b": {"status": "failed", "error": "boom"}}},
              {"status": "ok", "results": {"a": ok(2.0), "b": ok(2.0)}}]
    m = merge_rounds(rounds)
    assert m["results"]["b"] == {"status": "failed", "error": "boom"}
    a = m["results"]["a"]
    assert a["forward_ms"] == 2.0 and a["fwdbwd_ms"] == 6.0 and a["rounds"]["forward_ms"] == [1.0, 3.0, 2.0]
    assert a["forward_tflops"] == pytest.approx(5.0)  # 10 FLOP-units over the median 2 ms
    assert rounds[0]["results"]["a"]["forward_ms"] == 1.0  # the rounds themselves are left as they were
    # A later round whose configuration failed as a whole (no rows) fails every row with its error.
    whole = [{"status": "ok", "results": {"a": ok(1.0)}},
             {"status": "out_of_memory", "error": "OutOfMemoryError: weights", "results": {}}]
    m = merge_rounds(whole)
    assert m["results"]["a"]["status"] == "out_of_memory" and "weights" in m["results"]["a"]["error"]


def test_speedups_per_round_and_their_range_in_the_report():
    """With rounds, each round's ratio of the two times (the two ran in turn in it) is kept beside the median's, and
    the report's speed-up column gives their range: a median speed-up whose rounds straddle a target says so."""
    from machmoe.benchmark.report import add_speedups, markdown

    def row(fwdbwd_rounds):  # as runner.merge_rounds leaves a row: the median, and each round's time
        return {"status": "ok", "forward_ms": 1.0, "backward_ms": 2.0, "fwdbwd_ms": statistics.median(fwdbwd_rounds),
                "rounds": {"forward_ms": [1.0] * len(fwdbwd_rounds), "backward_ms": [2.0] * len(fwdbwd_rounds),
                           "fwdbwd_ms": list(fwdbwd_rounds)}}
    entry = {"config": {"name": "x", "T": 8, "d": 16, "n": 16, "E": 4, "K": 2}, "status": "ok",
             "results": {"machmoe": row([3.325, 3.323]), "sonicmoe": row([4.331, 5.391]),
                         "one-round": {"status": "ok", "forward_ms": 2.0, "backward_ms": 4.0, "fwdbwd_ms": 6.0}}}
    add_speedups(entry)
    m = entry["results"]["machmoe"]
    assert m["speedup_over"]["sonicmoe"]["fwdbwd"] == pytest.approx(4.861 / 3.324)
    assert m["speedup_rounds"]["sonicmoe"]["fwdbwd"] == pytest.approx([4.331 / 3.325, 5.391 / 3.323])
    assert m["speedup_rounds"]["sonicmoe"]["forward"] == pytest.approx([1.0, 1.0])
    assert "one-round" not in m["speedup_rounds"]  # no rounds of its own: only the median's ratio
    assert m["speedup_over"]["one-round"]["fwdbwd"] == pytest.approx(6.0 / 3.324)
    doc = {"device": {"name": "GPU", "type": "cuda"}, "versions": {}, "command": "c", "date": "d",
           "settings": {"dtype": "bf16", "iters": 10, "warmup": 3, "rounds": 2}, "configs": [entry]}
    text = markdown(doc)
    assert "| 1.46× (rounds 1.30–1.62) |" in text
    assert "| 1.81× |" in text  # the row without rounds: the median's ratio alone
    assert "median of 2 rounds" in text
    assert "median of at least 10 timed repetitions after at least 3 untimed" in text
    doc["settings"].update(warmup_ms=300.0, time_ms=1000.0)
    assert "the untimed ones lasting at least 300 ms and the timed ones 1000 ms" in markdown(doc)


@pytest.mark.parametrize("args, message", [
    (["--iters", "0"], "--iters must be at least 1, got 0"),
    (["--warmup", "-5"], "--warmup must be at least 0, got -5"),
    (["--check-tokens", "-3"], "--check-tokens must be at least 0, got -3"),
    (["--impls", ""], "--impls '' names no implementation"),
    (["--impls", ","], "--impls ',' names no implementation"),
    (["--configs", ","], "--configs ',' names no configuration"),
    (["--peers", ""], "--peers '' names no peer"),
    (["--device", "foo"], "--device: expected cuda, cuda:N or cpu, got 'foo'"),
    (["--device", "meta"], "--device: expected cuda, cuda:N or cpu, got 'meta'")])
def test_bad_counts_and_empty_lists_are_usage_errors(args, message, tmp_path, capsys):
    argv = ["--device", "cpu", "--configs", "cpu-tiny-32", "--impls", "torch-loop", "--no-plots", "--no-progress",
            "--out-dir", str(tmp_path), *args]
    assert cli.main(argv) == cli.EXIT_USAGE
    assert message in capsys.readouterr().err


def test_output_paths_are_checked_before_the_run(tmp_path, capsys):
    base = ["--device", "cpu", "--configs", "cpu-tiny-32", "--impls", "torch-loop", "--no-plots", "--no-progress"]
    rc = cli.main([*base, "--out-dir", str(tmp_path), "--markdown", str(tmp_path / "missing" / "tables")])
    assert rc == cli.EXIT_USAGE
    assert "--markdown" in capsys.readouterr().err and not (tmp_path / "results.json").exists()  # nothing ran
    (tmp_path / "file").write_text("")
    assert cli.main([*base, "--json", str(tmp_path / "file" / "r.json")]) == cli.EXIT_USAGE
    assert "cannot create the output directory" in capsys.readouterr().err
    assert cli.main([*base, "--json", str(tmp_path)]) == cli.EXIT_USAGE  # a directory, not a file
    assert "is a directory" in capsys.readouterr().err


def test_a_cpu_device_with_an_index_is_the_cpu(tmp_path, capsys):
    # cpu:0 is the CPU: its dtypes (fp32 by default, no bf16) and its configurations.
    base = ["--device", "cpu:0", "--configs", "cpu-tiny-32", "--impls", "torch-loop", "--no-plots", "--no-progress",
            "--iters", "1", "--warmup", "0", "--out-dir", str(tmp_path)]
    assert cli.main([*base, "--dtype", "bf16"]) == cli.EXIT_USAGE
    assert "on the CPU the dtype is fp32 or fp64" in capsys.readouterr().err
    assert cli.main(base) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["settings"]["dtype"] == "fp32" and doc["device"]["type"] == "cpu"
