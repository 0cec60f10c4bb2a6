#!/usr/bin/env python3
"""Checks the links between the repository's Markdown files: every relative link names a file or folder that exists,
and every #anchor names a heading of its target as GitHub renders it.

    python3 scripts/check_doc_links.py          # every tracked .md file; exit status 1 and one line a broken link

GitHub's anchor of a heading: its text (inline code, emphasis and link syntax dropped) lower-cased, every character
removed but letters, combining marks, decimal and letter numbers, connector punctuation, hyphens and spaces, the
spaces turned into hyphens, and "-1", "-2", ... appended to repeats. Combining marks stay: "dX̃" (X and U+0303) is
"dx̃", not "dx" — the mistake this check was written after (two links of docs/BENCHMARKS.md, session 90).
"""
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Dict, Iterable, List, Set

ROOT = Path(__file__).resolve().parents[1]
_SKIP_DIRS = {"third_party", "build", ".venv", ".git", "node_modules"}


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading's text (without its leading #'s), before de-duplication."""
    parts = re.split(r"(`[^`]*`)", heading.strip())  # code spans kept verbatim, emphasis dropped elsewhere
    for i, part in enumerate(parts):
        if part.startswith("`") and part.endswith("`") and len(part) >= 2:
            parts[i] = part[1:-1]
        else:
            part = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", part)
            part = re.sub(r"<[^>]+>", "", part).replace("**", "").replace("__", "")
            parts[i] = re.sub(r"(?<!\w)[*_]|[*_](?!\w)", "", part)  # one-character emphasis markers, not a_b
    text = "".join(parts)
    kept = []
    for ch in text.lower():
        cat = unicodedata.category(ch)
        if cat[0] in "LM" or cat in ("Nd", "Nl", "Pc") or ch in "- ":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def _lines_outside_fences(markdown: str) -> Iterable[str]:
    """The lines of a Markdown text that are not inside fenced code (``` or ~~~), the fence lines left out."""
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            yield line


def anchors_of(markdown: str) -> Set[str]:
    """Every heading anchor of a Markdown text (ATX headings outside fenced code), repeats numbered as GitHub does."""
    seen: Dict[str, int] = {}
    out: Set[str] = set()
    for line in _lines_outside_fences(markdown):
        m = re.match(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = github_anchor(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def markdown_files(root: Path) -> List[Path]:
    """The tracked .md files (git ls-files), or without git every .md file outside build and vendored folders."""
    try:
        names = subprocess.run(["git", "ls-files", "-z", "--", "*.md"], cwd=root, capture_output=True, check=True,
                               text=True).stdout.split("\0")
        return sorted(root / n for n in names if n)
    except (OSError, subprocess.CalledProcessError):
        return sorted(p for p in root.rglob("*.md") if not _SKIP_DIRS.intersection(p.relative_to(root).parts))


def _links(markdown: str) -> Iterable[str]:
    """The link targets of a Markdown text, outside fenced code and inline code spans."""
    for line in _lines_outside_fences(markdown):
        yield from re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line))


def broken_links(files: Iterable[Path]) -> List[str]:
    """One line per broken relative link or anchor: 'file: link (why)'."""
    problems: List[str] = []
    anchors: Dict[Path, Set[str]] = {}
    for f in files:
        for link in _links(f.read_text(encoding="utf-8")):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", link):  # http:, https:, mailto:
                continue
            path, _, anchor = link.partition("#")
            target = (f.parent / path).resolve() if path else f.resolve()
            where = os.path.relpath(f, ROOT)
            if not target.exists():
                problems.append(f"{where}: {link} (no such file)")
            elif anchor and target.suffix == ".md":
                if target not in anchors:
                    anchors[target] = anchors_of(target.read_text(encoding="utf-8"))
                if anchor not in anchors[target]:
                    problems.append(f"{where}: {link} (no heading with that anchor in {os.path.relpath(target, ROOT)})")
    return problems


def main() -> int:
    files = markdown_files(ROOT)
    problems = broken_links(files)
    for p in problems:
        print(p)
    print(f"check_doc_links: {len(files)} Markdown files, {len(problems)} broken links")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
