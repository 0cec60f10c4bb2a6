"""What the PyTorch path adds on top of the C++ layer (target T14): the autograd kernel's per-call costs, and
python -m machmoe.benchmark.overhead's arguments and report (CPU; the GPU run is in test_overhead_gpu.py)."""
import json
from collections import Counter

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import machmoe
from machmoe.benchmark import configs, overhead

# ---- the module path itself --------------------------------------------------------------------------------------


def _step_ops(m, x, go, loss=None):
    """aten/machmoe operators run by one forward + backward of the module (after a warm-up step)."""
    def step():
        m.zero_grad(set_to_none=True)
        x.grad = None
        o = m(x)
        (o.output if loss is None else loss(o)).backward(go if loss is None else None)
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return Counter(e.name for e in prof.events() if e.name.startswith(("aten::", "machmoe::")))


FILLS_AND_COPIES = {"aten::zeros", "aten::zeros_like", "aten::zero_", "aten::fill_", "aten::full", "aten::copy_",
                    "aten::clone", "aten::to", "aten::_to_copy", "aten::contiguous", "aten::add_", "aten::add"}


def test_module_step_runs_no_fill_or_copy_besides_the_layer():
    """The gradients of the outputs the loss does not use (router logits, counts, the saved buffer) reach the
    backward as None: autograd.Function's default would zero-fill each of them, `saved` (H included) every step."""
    torch.manual_seed(0)
    m = machmoe.MoE(64, 32, 8, 2)
    x = torch.randn(16, 64, requires_grad=True)
    ops = _step_ops(m, x, torch.randn(16, 64))
    assert ops["machmoe::layer_forward"] == 1 and ops["machmoe::layer_backward"] == 1
    assert not FILLS_AND_COPIES & set(ops), ops
    # Outputs, workspaces and gradients: 5 in the forward (out, logits, counts, saved, workspace), 8 in the
    # backward (grad_x, router, w1, w2 gradients, workspace, three empty placeholders); nothing else.
    assert ops["aten::empty"] == 13, ops
    assert "aten::reshape" not in ops and "aten::view" not in ops, ops  # a 2-D input is passed as it is


def test_logits_only_loss_gets_a_zero_output_gradient():
    """With grads no longer materialised, a loss on the logits alone reaches the backward with grad_out None; the
    output's gradient is then zero (one zeros_like), and the router still gets its gradient."""
    torch.manual_seed(1)
    m = machmoe.MoE(64, 32, 8, 2, aux_loss_coef=0.1)
    x = torch.randn(16, 64, requires_grad=True)
    o = m(x)
    o.aux_loss.backward()
    assert m.router_weight.grad is not None and m.router_weight.grad.abs().sum() > 0
    assert torch.count_nonzero(m.w1.grad) == 0 and torch.count_nonzero(m.w2.grad) == 0  # no output gradient
    assert x.grad is not None


def test_autograd_kernel_does_not_fill_defaults_per_call(monkeypatch):
    """torch.library.register_autograd's generic kernel calls torch._library.utils.fill_defaults on every forward
    (70-200 us of host time for this schema); ours is C++ (bindings/torch/layer_autograd.cpp) and receives every
    argument from the dispatcher."""
    import torch._library.utils as lib_utils

    def forbidden(*args, **kwargs):
        raise AssertionError("fill_defaults called per forward")

    monkeypatch.setattr(lib_utils, "fill_defaults", forbidden)
    m = machmoe.MoE(64, 32, 8, 2, bias=True)
    x = torch.randn(16, 64, requires_grad=True)
    m(x).output.sum().backward()
    assert m.w1.grad is not None and m.b1.grad is not None and x.grad is not None


def test_dropped_default_arguments_reach_the_autograd_node():
    """The dispatcher drops trailing arguments equal to their defaults (the into_* buffers); accumulation into a
    buffer passed explicitly still works, and one left out gives an ordinary gradient."""
    torch.manual_seed(2)
    m = machmoe.MoE(64, 32, 8, 2, accumulate_into_main_grad=True)
    x = torch.randn(16, 64, requires_grad=True)
    m(x).output.sum().backward()
    grads = m.main_grads()
    assert all(torch.count_nonzero(g) > 0 for g in grads.values())
    assert m.w1.grad is None


def test_time_layer_refuses_cpu_tensors():
    m = machmoe.MoE(64, 32, 8, 2)
    x, go = torch.randn(16, 64), torch.randn(16, 64)
    with pytest.raises(ValueError, match="'x'.*CUDA tensor"):
        torch.ops.machmoe.time_layer(x, m.router_weight.detach(), m.w1.detach(), m.w2.detach(), go, 2, 0, 0, 0, 0, 0,
                                     128, 0, 0, 1, True)


# ---- python -m machmoe.benchmark.overhead: arguments ------------------------------------------------------------


def test_parse_defaults_are_the_twelve_main_configurations_both_modes():
    a = overhead.parse([])
    assert [c.name for c in a.config_list] == configs.GROUPS["main"] and len(a.config_list) == 12
    assert a.mode_list == ["isolated", "queued"] and a.target == overhead.TARGET
    assert (a.warmup, a.iters, a.rounds) == (5, 20, 2)


def test_parse_shapes_configs_and_modes():
    a = overhead.parse(["--shape", "4096,512,256,16,4"])
    assert [(c.T, c.d, c.n, c.E, c.K) for c in a.config_list] == [(4096, 512, 256, 16, 4)]
    a = overhead.parse(["--configs", "7B-256", "--shape", "64,32,16,4,2", "--modes", "queued"])
    assert [c.name for c in a.config_list] == ["7B-256", "custom-64-32-16-4-2"] and a.mode_list == ["queued"]
    assert overhead.parse(["--modes", "both"]).mode_list == ["isolated", "queued"]
    # argparse's prefix of --configs counts as naming the configurations too (it was dropped beside --shape)
    for argv in (["--config", "7B-256"], ["--config=7B-256"], ["--conf", "7B-256"]):
        a = overhead.parse(argv + ["--shape", "64,32,16,4,2"])
        assert [c.name for c in a.config_list] == ["7B-256", "custom-64-32-16-4-2"], argv


@pytest.mark.parametrize("argv", [["--shape", "1,2,3"], ["--shape", "64,32,16,4,8"], ["--iters", "0"],
                                  ["--warmup", "-1"], ["--iters", "x"]])
def test_parse_rejects_bad_values_with_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        overhead.parse(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("argv,match", [(["--configs", "9B-1"], "unknown configuration"),
                                        (["--modes", "fast"], "unknown mode"), (["--target", "0"], "ratio > 0")])
def test_parse_rejects_unknown_names(argv, match):
    with pytest.raises(ValueError, match=match):
        overhead.parse(argv)


def test_main_reports_usage_errors_with_status_2(capsys):
    assert overhead.main(["--configs", "nope"]) == overhead.EXIT_USAGE
    assert "unknown configuration" in capsys.readouterr().err


# ---- report ---------------------------------------------------------------------------------------------------------


def _entry(name, cpp_f, mod_f, cpp_s, mod_s):
    r = {"cpp": {"forward_ms": cpp_f, "fwdbwd_ms": cpp_s},
         "module": {"forward_ms": mod_f, "fwdbwd_ms": mod_s, "host_forward_ms": 0.05}, "samples": 4,
         "ratio": {"forward": mod_f / cpp_f, "fwdbwd": mod_s / cpp_s}}
    return {"config": {"name": name}, "status": "ok", "results": {"isolated": r, "queued": dict(r)}}


def _doc(entries, target=1.03):
    return {"device": {"name": "GPU"}, "versions": {"torch": "x"}, "date": "today", "command": "cmd",
            "settings": {"dtype": "bf16", "iters": 4, "rounds": 1, "warmup": 1}, "configs": entries,
            "verdict": overhead.verdict(entries, target)}


def test_verdict_and_markdown_flag_isolated_ratios_over_the_target():
    entries = [_entry("7B-256", 1.0, 1.02, 3.0, 3.0), _entry("120B-2048", 10.0, 10.5, 35.0, 35.7),
               {"config": {"name": "30B-256"}, "status": "out_of_memory", "error": "OOM"}]
    v = overhead.verdict(entries, 1.03)
    assert v["over_target"] == ["120B-2048 forward 1.050"] and v["failed"] == ["30B-256: OOM"] and not v["met"]
    md = overhead.markdown(_doc(entries))
    assert "| 7B-256 | isolated | 1.000 | 1.020 | 1.020 | 3.000 | 3.000 | 1.000 | 0.050 |" in md
    assert "| 120B-2048 | isolated | 10.000 | 10.500 | 1.050 ⚠ | 35.000 | 35.700 | 1.020 | 0.050 |" in md
    assert "| 120B-2048 | queued | 10.000 | 10.500 | 1.050 |" in md  # queued rows are not the criterion
    assert "T14 (isolated ratios <= 1.03): not met: 120B-2048 forward 1.050; 30B-256: OOM" in md
    ok = [_entry("7B-256", 1.0, 1.02, 3.0, 3.0)]
    assert overhead.verdict(ok, 1.03)["met"] and "T14 (isolated ratios <= 1.03): met" in overhead.markdown(_doc(ok))


def test_a_run_without_the_isolated_mode_is_not_judged():
    """T14 is the isolated ratios: a run of the queued mode alone (--modes queued) meets nothing, and says so."""
    entry = _entry("7B-256", 1.0, 1.5, 3.0, 4.5)
    del entry["results"]["isolated"]
    v = overhead.verdict([entry], 1.03)
    assert not v["judged"] and not v["met"] and not v["over_target"]
    assert "T14 (isolated ratios <= 1.03): not judged (no isolated mode measured)" in overhead.markdown(_doc([entry]))


def test_a_failed_machmoe_bench_cross_check_fails_the_verdict():
    """--machmoe-bench's cross-check is part of the run: a binary that failed makes the exit status 1 (failed), not 0
    or the over-target status, and the report says which configuration's check failed."""
    entry = _entry("7B-256", 1.0, 1.0, 3.0, 3.0)
    entry["machmoe_bench"] = {"status": "failed", "error": "exit status 2: unknown option"}
    v = overhead.verdict([entry], 1.03)
    assert v["failed"] == ["7B-256: machmoe-bench exit status 2: unknown option"] and not v["met"]
    assert "not met: 7B-256: machmoe-bench exit status 2" in overhead.markdown(_doc([entry]))
    entry["machmoe_bench"] = {"status": "ok", "forward_ms": 1.0, "backward_ms": 2.0, "fwdbwd_ms": 3.0}
    assert overhead.verdict([entry], 1.03)["met"]


def test_run_machmoe_bench_reports_a_binary_that_fails():
    """A binary that exits nonzero (here `false`) or writes no JSON comes back as a failed cross-check with its exit
    status, not as an exception."""
    r = overhead.run_machmoe_bench("false", configs.custom("tiny", 16, 64, 32, 8, 2), 1, 1)
    assert r["status"] == "failed" and r["error"].startswith("exit status 1")


def test_profile_difference_lists_what_only_one_side_ran():
    module = {"gemm": 3, "Memset (Device)": 2, "topk": 1}
    cpp = {"gemm": 3, "Memset (Device)": 1, "gather": 1}
    assert overhead.count_diff(module, cpp) == {"Memset (Device)": 1, "gather": -1, "topk": 1}
    assert overhead.count_diff(cpp, cpp) == {}
    doc = _doc([_entry("7B-256", 1.0, 1.0, 3.0, 3.0)])
    doc["profile"] = {"config": "7B-256", "module": {"gpu": module, "api": {}}, "cpp": {"gpu": cpp, "api": {}},
                      "diff": {"gpu": overhead.count_diff(module, cpp), "api": {}}}
    md = overhead.markdown(doc)
    assert "* GPU activities: Memset (Device): +1, gather: -1, topk: +1" in md
    assert "* CUDA API calls: identical" in md


# ---- python -m machmoe.benchmark.overhead --host-only --------------------------------------------------------------


def test_parse_host_only_and_its_shape(capsys):
    a = overhead.parse(["--host-only"])
    assert a.host_only and a.host_shape == (0, 8, 8, 4, 2)
    assert overhead.parse(["--host-only", "--host-shape", "3,16,8,4,1"]).host_shape == (3, 16, 8, 4, 1)
    for bad in ("1,2,3", "-1,8,8,4,2", "0,8,8,4,5"):
        with pytest.raises(SystemExit):
            overhead.parse(["--host-shape", bad])
    assert "error:" in capsys.readouterr().err


def test_host_latency_rows():
    rows = overhead.host_latency((2, 8, 8, 4, 2), reps=2, rounds=2)
    assert list(rows) == [name for name, _ in overhead.HOST_ROWS]
    for r in rows.values():
        assert 0 < r["min_us"] <= r["median_us"] and r["what"]


def test_main_host_only_runs_without_a_gpu_and_writes_json(tmp_path, capsys):
    out = tmp_path / "host.json"
    assert overhead.main(["--host-only", "--iters", "1", "--rounds", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["settings"]["shape"] == [0, 8, 8, 4, 2] and set(doc["host"]) == {n for n, _ in overhead.HOST_ROWS}
    text = capsys.readouterr().out
    assert "| module_forward | MoE.forward" in text and "JSON" in text


@pytest.mark.parametrize("extra, flag", [
    (["--configs", "7B-256"], "--configs"), (["--config=7B-256"], "--configs"),
    (["--shape", "64,32,16,4,2"], "--shape"), (["--warmup", "5"], "--warmup"), (["--modes", "queued"], "--modes"),
    (["--target", "1.1"], "--target"), (["--machmoe-bench", "build/bin/machmoe-bench"], "--machmoe-bench"),
    (["--layers"], "--layers"), (["--profile"], "--profile")])
def test_host_only_refuses_the_options_it_would_ignore(extra, flag, capsys):
    with pytest.raises(SystemExit) as e:
        overhead.parse(["--host-only", *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--host-only times the host path on --host-shape only: {flag} " in err


def test_host_shape_needs_host_only_and_host_only_keeps_what_it_uses(capsys):
    with pytest.raises(SystemExit) as e:
        overhead.parse(["--host-shape", "3,16,8,4,1"])
    assert e.value.code == 2 and "--host-shape is the shape of --host-only" in capsys.readouterr().err
    a = overhead.parse(["--host-only", "--iters", "2", "--rounds", "3", "--seed", "1", "--json", "x.json"])
    assert (a.iters, a.rounds, a.seed, a.json) == (2, 3, 1, "x.json")


def test_host_only_help_says_iters_and_rounds_are_multiplied(capsys):
    with pytest.raises(SystemExit):
        overhead.parse(["--help"])
    assert "10 x --iters" in " ".join(capsys.readouterr().out.split())


def test_a_failed_configuration_exits_1_not_over_target(tmp_path, capsys, monkeypatch):
    # No GPU here: the CUDA calls main makes are stood in for, and every configuration fails in Case.
    class Props:
        name, major, minor = "fake GPU", 9, 0

    def broken(*args):
        raise RuntimeError("boom: no such kernel")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(overhead, "Case", broken)
    out = tmp_path / "o.json"
    assert overhead.main(["--configs", "7B-256", "--json", str(out)]) == overhead.EXIT_FAILED == 1
    doc = json.loads(out.read_text())
    assert doc["configs"][0]["status"] == "failed" and "boom" in doc["configs"][0]["error"]
    assert doc["verdict"]["failed"] and not doc["verdict"]["over_target"]
    assert "exit status: 0 ok; 1 a configuration or its --machmoe-bench check failed" in \
        overhead.parser().format_help().replace("\n", " ")


# ---- the order in which measure() times the two sides ---------------------------------------------------------------

class _RecordingCase:
    """Stands in for overhead.Case: records (side, warmup, iters) per call and returns per-side constant times."""

    def __init__(self):
        self.calls = []

    def cpp(self, warmup, iters, isolated):
        self.calls.append(("cpp", warmup, iters))
        return torch.tensor([[1.0, 3.0]] * iters, dtype=torch.float64)

    def module_times(self, warmup, iters, isolated):
        self.calls.append(("module", warmup, iters))
        return {"forward": [1.5] * iters, "fwdbwd": [3.3] * iters, "host_forward": [0.2] * iters}


def test_isolated_alternates_the_sides_every_repetition():
    case = _RecordingCase()
    r = overhead.measure(case, warmup=2, iters=3, rounds=2, mode="isolated")
    # A warm-up of each side, then rounds x iters single repetitions, the first side swapped every time.
    assert case.calls[:2] == [("cpp", 2, 1), ("module", 2, 1)]
    sides = [c[0] for c in case.calls[2:]]
    assert sides == ["cpp", "module", "module", "cpp"] * 3
    assert all(c[1:] == (0, 1) for c in case.calls[2:])
    assert r["samples"] == 6  # the warm-up's repetitions are not kept
    assert r["ratio"]["forward"] == pytest.approx(1.5)
    assert r["ratio"]["fwdbwd"] == pytest.approx(1.1)


def test_queued_times_a_block_per_side_and_round():
    case = _RecordingCase()
    r = overhead.measure(case, warmup=2, iters=3, rounds=2, mode="queued")
    assert case.calls == [("cpp", 2, 3), ("module", 2, 3), ("module", 2, 3), ("cpp", 2, 3)]
    assert r["samples"] == 6


# ---- --layers: each layer of the module path's forward against the C++ layer's -------------------------------------

def test_parse_layers_flag():
    assert overhead.parse([]).layers is False
    assert overhead.parse(["--layers", "--configs", "7B-256"]).layers is True


class _LayersCase:
    """Stands in for overhead.Case in measure_layers: a small CPU module, and a log of what ran in which order."""

    def __init__(self):
        torch.manual_seed(3)
        self.module = machmoe.MoE(16, 8, 4, 2)
        self.x = torch.randn(6, 16, requires_grad=True)
        self.log = []

    def refill(self):
        self.log.append("refill")

    def module_step(self):
        self.log.append("step")

    def cpp(self, warmup, iters, isolated):
        assert (warmup, iters, isolated) == (0, 1, True)
        self.log.append("cpp")
        return torch.tensor([[2.0, 5.0]], dtype=torch.float64)


def test_measure_layers_times_each_layer_after_the_same_refill_and_backward():
    case = _LayersCase()
    outputs = []

    def timer(fn):
        case.log.append("time")
        outputs.append(fn())  # each layer's call runs (the CPU operator on a small shape)
        return 2.5

    hidden_calls = []

    def hidden_timer(fn):
        case.log.append("hidden")
        hidden_calls.append(fn())
        return 2.25, len(hidden_calls) % 2 == 0  # every other repetition not covered

    r = overhead.measure_layers(case, iters=2, timer=timer, hidden_timer=hidden_timer)
    layer = ["refill", "time", "step", "refill", "hidden", "step"]
    one_pass = ["cpp"] + layer * len(overhead.LAYER_ROWS)
    # A warm-up pass, then one pass per repetition, the order reversed every other time; each layer timed isolated and
    # then with its latency hidden, each after its own refill and followed by a backward.
    assert case.log == one_pass + one_pass + layer * len(overhead.LAYER_ROWS) + ["cpp"]
    assert list(r["rows"]) == ["cpp", *overhead.LAYER_ROWS] and r["iters"] == 2
    assert r["rows"]["cpp"] == {"forward_ms": 2.0, "ratio": 1.0}
    for n in overhead.LAYER_ROWS:
        row = r["rows"][n]
        assert row["forward_ms"] == 2.5 and row["ratio"] == 1.25 and row["hidden_ms"] == 2.25
        assert row["host_wait_us"] == pytest.approx(250.0) and row["covered"] == 0.5  # one of the two repetitions
    assert r["sleep_ms"] is None  # a timer that does not say its sleep: the table names none
    assert sum(r["rows"][n]["covered"] for n in overhead.LAYER_ROWS) * 2 == len(overhead.LAYER_ROWS)
    # Every layer returned the layer's output: the operator's four tensors below the functional API, (out, logits,
    # counts) from it, MoEOutput from the module; the same output everywhere, hidden or not.
    n = len(overhead.LAYER_ROWS)
    below, functional, module = outputs[0], outputs[3], outputs[4]
    assert len(outputs) == 3 * n and len(hidden_calls) == 3 * n and len(below) == 4 and len(functional) == 3
    torch.testing.assert_close(below[0], functional[0].detach())
    torch.testing.assert_close(module.output.detach(), functional[0].detach())
    torch.testing.assert_close(hidden_calls[4].output.detach(), functional[0].detach())


def test_layers_markdown_gives_each_row_its_step_from_the_row_above():
    hidden = {"hidden_ms": 0.98, "host_wait_us": 22.0, "covered": 1.0}
    layers = {"config": "7B-256", "iters": 40, "sleep_ms": 1.0, "rows": {
        "cpp": {"forward_ms": 1.0, "ratio": 1.0},
        "op_below_autograd": {"forward_ms": 1.002, "ratio": 1.002, **hidden},
        "module_forward": {"forward_ms": 1.05, "ratio": 1.05, **dict(hidden, host_wait_us=70.0, covered=0.75)}}}
    text = "\n".join(overhead.layers_markdown(layers))
    assert "(7B-256; median of 40" in text and "a 1-ms sleep kernel" in text
    assert "| cpp | the C++ layer" in text and "| 1.0000 | 1.000 |  | – | – | – |" in text
    assert "| op_below_autograd |" in text and "| 1.0020 | 1.002 | +2.0 | 0.9800 | 22.0 | 100% |" in text
    assert "| module_forward | MoE.forward" in text and "| +48.0 | 0.9800 | 70.0 | 75% |" in text
    doc = {"device": {"name": "x"}, "versions": {"torch": "t"}, "settings": {"dtype": "bf16", "iters": 1, "rounds": 1,
           "warmup": 0}, "date": "d", "command": "c", "configs": [], "verdict": overhead.verdict([], 1.03),
           "layers": layers}
    assert "Isolated forward of each layer" in overhead.markdown(doc)
    assert "(a sleep kernel queued" in "\n".join(overhead.layers_markdown(dict(layers, sleep_ms=None)))
