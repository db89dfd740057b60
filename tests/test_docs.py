"""The documentation's promises that a reader relies on: every relative link in README.md, docs/*.md and
benchmarks/README.md reaches an existing file (and, with #anchor into a markdown file, an existing heading's
GitHub anchor); the README stays a front page (at most 250 lines, no commit hashes, no dates: those belong to
the results log, benchmarks/README.md) and keeps the two commands it promises byte for byte."""
from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250

# the product's promise (the main job) and CI's test command (.ci/run runs the same): changed only on purpose
MAIN_COMMAND = ('pip install torch==2.13.0 && pip install -e ".[eval]" && accelerate launch --config_file '
                'configs/accelerate/cpu.yaml -m longstride.recipes.train recipe=tiny_extend && longstride eval compare '
                'run=outputs/tiny_extend tasks=[niah_single_1] num_samples=10 yarn=[2] yarn_lengths=[8192]')
TEST_COMMAND = 'pip install torch==2.13.0 && pip install -e ".[dev]" && python -m pytest -q -n 2 --dist worksteal'

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target), the text allowing one level of brackets; an optional "title" after the target
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# a commit hash: 7 to 40 hex digits with at least one letter and one digit (so neither a number nor a word)
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
ISO_DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked out."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, CODE_SPAN.sub("CODE", line)))
    return out


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline link and image outside code."""
    return [(n, m.group(1)) for n, line in prose_lines(text) for m in LINK.finditer(line)]


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (link targets and formatting dropped), lowercased, characters
    other than letters, digits, '_', '-' and spaces removed, spaces turned into '-'."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset:
    """Every heading anchor of a markdown file, repeated headings numbered as GitHub numbers them (-1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return frozenset(out)


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of `page` (under `root`) that reaches no file, or no heading of the markdown file it
    names."""
    found = []
    for n, target in links(page.read_text(encoding="utf-8")):
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(root)}:{n}: ({target})"
        if not dest.exists():
            found.append(f"{where} no such file {os.path.relpath(dest, root)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            found.append(f"{where} no heading with anchor #{anchor} in {os.path.relpath(dest, root)}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert page.exists(), page
    broken = broken_links(page)
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_is_a_front_page():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, (f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move "
                                            "reference to docs/ and results to benchmarks/README.md")
    hashes = [f"{n}: {m.group(0)}" for n, line in enumerate(lines, 1) for m in COMMIT.finditer(line)]
    assert not hashes, "commit hashes in README.md (they belong to benchmarks/README.md's results log):\n" + \
        "\n".join(hashes)
    dates = [f"{n}: {m.group(0)}" for n, line in enumerate(lines, 1) for m in ISO_DATE.finditer(line)]
    assert not dates, "dates in README.md (dated results belong to benchmarks/README.md's results log):\n" + \
        "\n".join(dates)


def test_readme_keeps_its_two_commands():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert MAIN_COMMAND in lines, "README.md's main command changed (the product's promise)"
    assert TEST_COMMAND in lines, "README.md's test command changed (.ci/run runs the same)"


# the checker itself: a broken file, a broken anchor and a good anchor, so that a checker that finds nothing fails
def test_the_checker_finds_broken_links(tmp_path):
    (tmp_path / "b.md").write_text("# Attention beyond plain causal\n## The ablation (`python -m x.y`, 2-core)\n"
                                   "## Twice\n## Twice\n```\n# not a heading\n```\n", encoding="utf-8")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#attention-beyond-plain-causal) [ok](b.md#the-ablation-python--m-xy-2-core)\n"
                    "[ok](b.md#twice-1) [ok](https://example.org/x) `[code](nowhere.md)`\n"
                    "[bad](missing.md) ![bad](b.md#not-a-heading) [bad](#nothing-here)\n"
                    "```\n[in a fence](nowhere.md)\n```\n", encoding="utf-8")
    broken = broken_links(page, tmp_path)
    assert len(broken) == 3, broken
    assert "missing.md" in broken[0] and "#not-a-heading" in broken[1] and "#nothing-here" in broken[2]
    assert COMMIT.search("at commit 875551e") and not COMMIT.search("1234567 tokens, a deadbeef")
    assert ISO_DATE.search("measured 2026-11-26") and not ISO_DATE.search("262K tokens")
