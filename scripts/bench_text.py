"""machmoe-bench's text output, block by block: what scripts/t7_table.py, scripts/t8_table.py and scripts/stage_diff.py
read from it."""
import lzma
import re

PASS = re.compile(r"^\s+(forward|backward)\s+([\d.]+)\s")


def read_text(path):
    """A file of the benchmark's output, as text; a `.xz` file (as the measurements folders keep them) decompressed."""
    if str(path).endswith(".xz"):
        with lzma.open(path, "rt", encoding="utf-8", errors="replace") as f:
            return f.read()
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def config_runs(text, option, values, read_line=None):
    """One dict per `config ...` block of `text`, in order: its name (the configuration's, or '(T,d,n,E,K)' where the
    sizes were given on the command line), `option`'s value on the config line (one of `values`; blocks with another
    are skipped), and its forward and backward ms. read_line(line, run), if given, reads every other line of the block
    into run. Blocks without both passes are dropped."""
    config = re.compile(r"^config (\S+)( \(sizes overridden\))? \(T=(\d+) d=(\d+) n=(\d+) E=(\d+) K=(\d+) .*"
                        rf"{option}=({'|'.join(map(re.escape, values))})\b")
    out = []
    cur = None
    for line in text.splitlines():
        m = config.match(line)
        if m:
            name = m.group(1)
            if m.group(2):  # sizes given on the command line: name the row by them
                name = "({},{},{},{},{})".format(*m.group(3, 4, 5, 6, 7))
            cur = {"name": name, option: m.group(8)}
            out.append(cur)
            continue
        if line.startswith("config "):  # a block of another option value: none of its lines belong to cur
            cur = None
        if cur is None:
            continue
        m = PASS.match(line)
        if m and m.group(1) not in cur:
            cur[m.group(1)] = float(m.group(2))
            continue
        if read_line is not None:
            read_line(line, cur)
    return [r for r in out if "forward" in r and "backward" in r]
