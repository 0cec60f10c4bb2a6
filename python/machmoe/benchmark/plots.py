"""The PNG plots, saved next to the JSON; matplotlib is optional (scripts/setup.sh installs it; `pip install
machmoe[benchmark]`): without it the plot step is skipped with a message, and the JSON records why."""
import os
from typing import Dict, List

MIB = 1024.0 * 1024.0


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False


def _ok(e: dict, impl: str) -> dict:
    r = e.get("results", {}).get(impl)
    return r if r and r.get("status") == "ok" else None


def make_plots(doc: dict, out_dir: str) -> Dict[str, object]:
    """Writes tflops.png, memory.png and token_rounding.png into out_dir; returns {'files': [...]} or
    {'skipped': reason}."""
    if not matplotlib_available():
        return {"skipped": "matplotlib is not installed: plots skipped (install it with `pip install matplotlib` "
                           "or `bash scripts/setup.sh`)"}
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    files: List[str] = []
    configs = [e for e in doc["configs"] if e.get("status") == "ok"]
    impls = []
    for e in configs:
        for k in e["results"]:
            if k not in impls:
                impls.append(k)
    title = f"{doc['device'].get('name')}, {doc['settings']['dtype']}"

    # 1. TFLOP/s per configuration and implementation, forward and backward.
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.1 * len(configs) + 3), 8), sharex=True)
    width = 0.8 / max(1, len(impls))
    for ax, key in zip(axes, ("forward", "backward")):
        for i, impl in enumerate(impls):
            xs, ys = [], []
            for j, e in enumerate(configs):
                r = _ok(e, impl)
                if r and r.get(f"{key}_tflops") is not None:
                    xs.append(j + (i - (len(impls) - 1) / 2) * width)
                    ys.append(r[f"{key}_tflops"])
            ax.bar(xs, ys, width, label=impl)
        ax.set_ylabel(f"{key} TFLOP/s")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_title(f"Model TFLOP/s per configuration ({title})")
    axes[1].set_xticks(range(len(configs)))
    axes[1].set_xticklabels([e["config"]["name"] for e in configs], rotation=45, ha="right")
    axes[0].legend(fontsize=8, ncol=min(4, len(impls)))
    fig.tight_layout()
    files.append(_save(fig, out_dir, "tflops.png", plt))

    # 2. Activation and peak memory across the granularity sweep (configurations of one family side by side).
    families: Dict[str, List[dict]] = {}
    for e in configs:
        families.setdefault(e["config"]["family"] or e["config"]["name"], []).append(e)
    mem_impls = [k for k in impls if any((_ok(e, k) or {}).get("peak_bytes") is not None for e in configs)]
    if mem_impls:
        fig, axes = plt.subplots(1, 2, figsize=(14, 5))
        labels = []
        for fam, rows in families.items():
            labels += [f"{r['config']['name']}\n(n={r['config']['n']},E={r['config']['E']},K={r['config']['K']})"
                       for r in rows]
        for ax, key, what in ((axes[0], "activation_bytes", "activation"), (axes[1], "peak_bytes", "peak")):
            for impl in mem_impls:
                x0 = 0
                for fam, rows in families.items():
                    xs = list(range(x0, x0 + len(rows)))
                    ys = [((_ok(r, impl) or {}).get(key) or float("nan")) / MIB for r in rows]
                    ax.plot(xs, ys, marker="o", label=impl if x0 == 0 else None,
                            color=f"C{mem_impls.index(impl)}")
                    x0 += len(rows)
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
            ax.set_ylabel(f"{what} memory, MiB (allocator)")
            ax.set_title(f"{what.capitalize()} memory across granularity ({title})")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        files.append(_save(fig, out_dir, "memory.png", plt))

    # 3. Token rounding's forward+backward speed-up over top-K (machmoe both ways) across sparsity K/E.
    points: Dict[str, List] = {}
    for e in configs:
        top, tr = _ok(e, "machmoe"), _ok(e, "machmoe-token-rounding")
        if top and tr:
            c = e["config"]
            points.setdefault(c["family"] or c["name"], []).append((c["K"] / c["E"], top["fwdbwd_ms"] / tr["fwdbwd_ms"],
                                                                    c["name"]))
    if points:
        fig, ax = plt.subplots(figsize=(8, 5))
        for fam, pts in points.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=fam)
            for p in pts:
                ax.annotate(p[2], (p[0], p[1]), fontsize=6, textcoords="offset points", xytext=(3, 3))
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sparsity K/E")
        ax.set_ylabel("top-K time / token-rounding time (forward+backward)")
        ax.set_title(f"Token-rounding speed-up across sparsity ({title})")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        files.append(_save(fig, out_dir, "token_rounding.png", plt))
    return {"files": files}


def _save(fig, out_dir: str, name: str, plt) -> str:
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
