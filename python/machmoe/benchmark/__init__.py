"""machmoe.benchmark: `python -m machmoe.benchmark` compares machmoe with the MoE layers users run today (a
torch._grouped_mm MoE, a per-expert loop, installed peers) and with the cuBLAS bound, on the same weights; see
cli.py and docs/BENCHMARKS.md ("How to reproduce")."""
from .baselines import GroupedMMMoE, LoopMoE, cublas_bound
from .cli import main
from .configs import ALL as CONFIGS, Config, select

__all__ = ["main", "GroupedMMMoE", "LoopMoE", "cublas_bound", "CONFIGS", "Config", "select"]
