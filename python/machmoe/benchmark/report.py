"""Derived figures (speed-ups, the T10 verdict), the JSON document and the Markdown tables."""
import json
import math
from typing import List, Optional

from .impls import MACHMOE

MIB = 1024.0 * 1024.0
TIMES = ("forward", "backward", "fwdbwd")  # the three timings of every row, as "<k>_ms"


def _round_ratios(rb: dict, rm: dict, k: str) -> Optional[List[float]]:
    """b's time / m's time in each round, where both ran the same rounds (--rounds R > 1): the two ran in turn in a
    round, under the same phase of the GPU's clock, so a round's ratio is a fair comparison and their spread says how
    far one run's median speed-up can be trusted."""
    tb = rb.get("rounds", {}).get(f"{k}_ms")
    tm = rm.get("rounds", {}).get(f"{k}_ms")
    if not tb or not tm or len(tb) != len(tm) or len(tm) < 2 or not all(tb) or not all(tm):
        return None
    return [x / y for x, y in zip(tb, tm)]


def add_speedups(entry: dict) -> None:
    """results[m]['speedup_over'][b] = b's time / m's time (forward, backward, forward+backward) for every machmoe
    variant m and every other row b that was measured (> 1: machmoe is faster); with rounds, also
    results[m]['speedup_rounds'][b][k] = that ratio in each round."""
    res = entry["results"]
    for m in MACHMOE:
        rm = res.get(m)
        if not rm or rm.get("status") != "ok":
            continue
        over, per_round = {}, {}
        for b, rb in res.items():
            if b == m or rb.get("status") != "ok":
                continue
            over[b] = {k: rb[f"{k}_ms"] / rm[f"{k}_ms"] for k in TIMES if rb.get(f"{k}_ms") and rm.get(f"{k}_ms")}
            ratios = {k: r for k in TIMES for r in [_round_ratios(rb, rm, k)] if r is not None}
            if ratios:
                per_round[b] = ratios
        rm["speedup_over"] = over
        if per_round:
            rm["speedup_rounds"] = per_round
        bound = res.get("cublas-bound")
        if bound and bound.get("status") == "ok":
            rm["efficiency"] = {k: bound[f"{k}_ms"] / rm[f"{k}_ms"] for k in TIMES}


def verdict(configs: List[dict]) -> dict:
    """machmoe rows beyond T10, machmoe rows that failed, and other rows that failed."""
    bad_agreement, machmoe_failed, others_failed = [], [], []
    for entry in configs:
        name = entry["config"]["name"]
        if entry.get("status") != "ok":
            machmoe_failed.append(f"{name}: {entry.get('error')}")
            continue
        for impl, r in entry["results"].items():
            if r.get("status") not in ("ok", "skipped"):
                (machmoe_failed if impl in MACHMOE else others_failed).append(f"{name}/{impl}: {r.get('error')}")
            elif impl in MACHMOE and r.get("status") == "ok" and not r["agreement"]["ok"]:
                errs = ", ".join(f"{k} {_f(v, '.2e', 'nan')}" for k, v in r["agreement"]["errors"].items())
                bad_agreement.append(f"{name}/{impl}: {errs} (tolerance {r['agreement']['tolerance']:.0e})")
    return {"machmoe_agreement_failures": bad_agreement, "machmoe_failures": machmoe_failed,
            "other_failures": others_failed}


def write_json(doc: dict, path: str) -> None:
    """Strict JSON: a NaN is written as null, an infinity as the string "inf" or "-inf" (read_json reads them back as
    floats)."""
    def clean(o):
        if isinstance(o, float) and not math.isfinite(o):
            return None if math.isnan(o) else ("inf" if o > 0 else "-inf")
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, list):
            return [clean(v) for v in o]
        return o
    with open(path, "w") as f:
        json.dump(clean(doc), f, indent=1)


def read_json(path: str) -> dict:
    """A document write_json wrote, its infinities floats again (its NaNs stay None: the tables print them as –)."""
    def restore(o):
        if isinstance(o, str) and o in ("inf", "-inf"):
            return float(o)
        if isinstance(o, dict):
            return {k: restore(v) for k, v in o.items()}
        if isinstance(o, list):
            return [restore(v) for v in o]
        return o
    with open(path) as f:
        return restore(json.load(f))


def _f(v: Optional[float], fmt: str, none: str = "–") -> str:
    return none if v is None else format(v, fmt)


def _shape(c: dict) -> str:
    return f"{c['name']} ({c['T']},{c['d']},{c['n']},{c['E']},{c['K']})"


def _speedup_text(sp: Optional[float], per_round: Optional[List[float]]) -> str:
    """'1.46×', and with rounds the range of the per-round ratios: '1.46× (rounds 1.30–1.62)'."""
    if not sp:
        return "–"
    text = f"{sp:.2f}×"
    if per_round:
        text += f" (rounds {min(per_round):.2f}–{max(per_round):.2f})"
    return text


def _rounds_text(settings: dict) -> str:
    r = settings.get("rounds", 1)
    return f", median of {r} rounds (every implementation once per round)" if r > 1 else ""


def _timing_text(settings: dict) -> str:
    """How each time was taken: the repetition counts, and on a GPU the windows that extend them."""
    text = f"median of at least {settings['iters']} timed repetitions after at least {settings['warmup']} untimed"
    w, t = settings.get("warmup_ms") or 0, settings.get("time_ms") or 0
    if w or t:
        text += f", the untimed ones lasting at least {w:g} ms and the timed ones {t:g} ms"
    return text


def markdown(doc: dict) -> str:
    """One table per configuration plus a summary of machmoe's forward+backward speed-ups."""
    dev, v = doc["device"], doc["versions"]
    lines = [f"Device: {dev.get('name')} ({dev['type']}); torch {v.get('torch')}, CUDA {v.get('cuda')}, machmoe "
             f"{v.get('machmoe')}; dtype {doc['settings']['dtype']}; {_timing_text(doc['settings'])}"
             + _rounds_text(doc['settings']) + f"; {doc['date']}.",
             f"Command: `{doc['command']}`", ""]
    impls = []
    for e in doc["configs"]:
        for k in e.get("results", {}):
            if k not in impls:
                impls.append(k)
    # Summary: forward+backward ms per configuration and implementation.
    lines.append("| config | " + " | ".join(impls) + " |")
    lines.append("|---|" + "---|" * len(impls))
    for e in doc["configs"]:
        row = [_shape(e["config"])]
        for k in impls:
            r = e.get("results", {}).get(k)
            row.append("–" if r is None else (_f(r.get("fwdbwd_ms"), ".3f") if r.get("status") == "ok"
                                                else r.get("status", "failed")))
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "(forward+backward ms; the cuBLAS bound is an idealised time, docs/TARGETS.md)", ""]
    for e in doc["configs"]:
        c = e["config"]
        lines.append(f"### {_shape(c)}")
        if e.get("status") != "ok":
            lines += [f"failed: {e.get('error')}", ""]
            continue
        lines.append("| implementation | fwd ms | bwd ms | fwd+bwd ms | fwd TFLOP/s | bwd TFLOP/s | activation MiB | "
                     "peak MiB | first call s | max rel. error | machmoe speed-up over it |")
        lines.append("|---|" + "---|" * 10)
        base = e["results"].get("machmoe", {})
        for k, r in e["results"].items():
            if r.get("status") != "ok":
                lines.append(f"| {k} | {r.get('status')}: {str(r.get('error'))[:120]} |" + " |" * 9)
                continue
            act = r.get("activation_bytes")
            peak = r.get("peak_bytes")
            err = r.get("agreement", {}).get("max")
            sp = base.get("speedup_over", {}).get(k, {}).get("fwdbwd") if k != "machmoe" else None
            spread = base.get("speedup_rounds", {}).get(k, {}).get("fwdbwd") if k != "machmoe" else None
            lines.append("| " + " | ".join([
                k, _f(r.get("forward_ms"), ".3f"), _f(r.get("backward_ms"), ".3f"), _f(r.get("fwdbwd_ms"), ".3f"),
                _f(r.get("forward_tflops"), ".4g"), _f(r.get("backward_tflops"), ".4g"),
                _f(act / MIB if act is not None else None, ".0f"), _f(peak / MIB if peak is not None else None, ".0f"),
                _f(r.get("first_call_s"), ".2f"), _f(err, ".1e"), _speedup_text(sp, spread)]) + " |")
        lines.append("")
    return "\n".join(lines)
