"""scripts/check_doc_links.py: GitHub's heading anchors (combining marks kept, repeats numbered), broken files and
anchors found, and every link between the repository's Markdown files resolving today."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("check_doc_links", ROOT / "scripts" / "check_doc_links.py")
cdl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cdl)


def test_anchor_of_a_heading_as_github_makes_it():
    # A heading of docs/BENCHMARKS.md: en dashes, ×, parentheses, commas and periods removed; µ (a letter) kept.
    assert cdl.github_anchor("Where the GPU waits: 7–62 µs before a pass (2026-12-03, NVIDIA H200, session 89)") == \
        "where-the-gpu-waits-762-µs-before-a-pass-2026-12-03-nvidia-h200-session-89"
    assert cdl.github_anchor("Side by side (T11): 1.46–1.80× on 1.4B") == "side-by-side-t11-146180-on-14b"
    # X plus a combining tilde keeps the mark, which a slug that drops it (dx) would not reach.
    assert cdl.github_anchor("dX\u0303's epilogue") == "dx\u0303s-epilogue"
    # Code spans keep their underscores; emphasis and link syntax go, their text stays.
    assert cdl.github_anchor("`MACHMOE_HOPPER_TILE_N` and **bold** [a link](notes.txt) _em_") == \
        "machmoe_hopper_tile_n-and-bold-a-link-em"


def test_repeated_headings_are_numbered_and_code_fences_are_skipped():
    text = "# Notes\n## Notes\n```\n# not a heading\n```\n### Notes\n"
    assert cdl.anchors_of(text) == {"notes", "notes-1", "notes-2"}


def test_broken_files_and_anchors_are_reported(tmp_path):
    # Markdown names built here, so that no literal file name in this test reads as a link to a missing file.
    main, other, gone, code = (f"{stem}.{'md'}" for stem in ("main", "other", "gone", "code"))
    (tmp_path / main).write_text("# Top\n## dX\u0303's term\n[ok](#top) [ok2](#dx\u0303s-term) [bad](#dxs-term)\n"
                                 f"[file]({other}#part) [gone]({gone}) [web](https://example.com/#x) "
                                 f"`[code]({code})`\n",
                                 encoding="utf-8")
    (tmp_path / other).write_text("# Other\n", encoding="utf-8")
    problems = cdl.broken_links([tmp_path / main])
    assert len(problems) == 3, problems
    assert any("#dxs-term" in p and "no heading" in p for p in problems)  # (not a substring of #dx\u0303s-term)
    assert any(f"{other}#part" in p and "no heading" in p for p in problems)
    assert any(gone in p and "no such file" in p for p in problems)


def test_every_link_between_the_repositorys_markdown_files_resolves():
    files = cdl.markdown_files(ROOT)
    assert len(files) > 10  # README, docs and the measurement folders
    assert cdl.broken_links(files) == []
