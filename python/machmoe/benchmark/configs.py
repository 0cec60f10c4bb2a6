"""The benchmark's configurations: docs/TARGETS.md's 12 main configurations (named as machmoe-bench names them,
benchmarks/cli_options.cpp), both token-rounding sweeps, the odd-shape rows (gpt-oss, d = n = 2880, with the nearest
multiple-of-128 shape beside them for target T13), and tiny CPU configurations."""
from dataclasses import asdict, dataclass
from typing import Dict, List, Sequence


@dataclass(frozen=True)
class Config:
    name: str
    T: int
    d: int
    n: int
    E: int
    K: int
    group: str          # main | tr_sweep_1536 | tr_sweep_4096 | odd | cpu
    family: str = ""    # rows compared with each other in plots: the model size of a granularity sweep
    tile: int = 128     # token-rounding tile (machmoe token rounding only)

    @property
    def pairs(self) -> int:
        return self.T * self.K

    def as_dict(self) -> dict:
        return asdict(self)


def _main() -> List[Config]:
    rows = []
    for family, T, d, shapes in (("1.4B", 40960, 768, ((256, 128, 8), (512, 64, 4), (1024, 32, 2))),
                                 ("7B", 24576, 1536, ((256, 128, 8), (512, 64, 4), (1024, 32, 2))),
                                 ("30B", 32768, 4096, ((256, 256, 16), (512, 128, 8), (1024, 64, 4))),
                                 ("120B", 32768, 4096, ((512, 256, 16), (1024, 128, 8), (2048, 64, 4)))):
        for n, E, K in shapes:
            rows.append(Config(f"{family}-{n}", T, d, n, E, K, "main", family))
    return rows


def _sweeps() -> List[Config]:
    rows = []
    # Iso-FLOPs: E grows while T, n, K stay fixed (docs/TARGETS.md).
    for E in (64, 128, 256, 512):
        rows.append(Config(f"TR1536-E{E}", 16384, 1536, 256, E, 8, "tr_sweep_1536", "TR1536"))
    for E in (32, 64, 128, 256):
        rows.append(Config(f"TR4096-E{E}", 16384, 4096, 1024, E, 4, "tr_sweep_4096", "TR4096"))
    return rows


def _odd() -> List[Config]:
    # gpt-oss experts (d = n = 2880: not a multiple of 128), 20b (32 experts) and 120b (128 experts), top-4, and the
    # nearest larger multiple of 128 (2944) for target T13's comparison.
    rows = []
    for model, E in (("gptoss20b", 32), ("gptoss120b", 128)):
        for size in (2880, 2944):
            rows.append(Config(f"{model}-{size}", 16384, size, size, E, 4, "odd", model))
    return rows


def _cpu() -> List[Config]:
    # Tiny shapes for the CPU reference (and the CPU test): a granularity pair and a token-rounding tile of 16.
    return [Config("cpu-tiny-32", 256, 64, 32, 8, 2, "cpu", "cpu-tiny", tile=16),
            Config("cpu-tiny-16", 256, 64, 16, 16, 4, "cpu", "cpu-tiny", tile=16)]


MAIN = _main()
SWEEPS = _sweeps()
ODD = _odd()
CPU = _cpu()
ALL: Dict[str, Config] = {c.name: c for c in MAIN + SWEEPS + ODD + CPU}
DEFAULT = [c.name for c in MAIN + SWEEPS + ODD]
QUICK_GPU = ["7B-256", "TR1536-E128"]
QUICK_CPU = [c.name for c in CPU]
GROUPS = {"main": [c.name for c in MAIN], "sweeps": [c.name for c in SWEEPS], "odd": [c.name for c in ODD],
          "cpu": QUICK_CPU, "all": DEFAULT}


def select(spec: str = "", *, quick: bool = False, device: str = "cuda") -> List[Config]:
    """Configurations from a comma-separated list of names or group names (main, sweeps, odd, cpu, all); empty:
    the default set (--quick: a small subset; on the CPU the tiny configurations)."""
    if not spec:
        names: Sequence[str] = (QUICK_CPU if device == "cpu" else QUICK_GPU) if quick else \
            (QUICK_CPU if device == "cpu" else DEFAULT)
    else:
        names = []
        for item in (s.strip() for s in spec.split(",")):
            if not item:
                continue
            if item in GROUPS:
                names.extend(GROUPS[item])
            elif item in ALL:
                names.append(item)
            else:
                raise ValueError(f"unknown configuration {item!r}; known: {', '.join(ALL)}; "
                                 f"groups: {', '.join(GROUPS)}")
    seen, out = set(), []
    for n in names:
        if n not in seen:
            seen.add(n)
            out.append(ALL[n])
    return out


def custom(name: str, T: int, d: int, n: int, E: int, K: int, tile: int = 128) -> Config:
    return Config(name, T, d, n, E, K, "custom", name, tile)
