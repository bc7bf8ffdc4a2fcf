"""The docs say what the code does: every config field in the configuration table with
its default, every page linked from the README, every relative link alive."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

from raypipe import PipelineConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))


def table_defaults(text: str) -> dict[str, str]:
    """``{field: default}`` of the rows ``| `field` | `default` | meaning |``."""
    rows = re.findall(r"^\|\s*`([a-z_]+)`\s*\|\s*`([^`]*)`\s*\|", text, flags=re.MULTILINE)
    return dict(rows)


def test_the_configuration_table_matches_the_code():
    table = table_defaults((ROOT / "docs" / "configuration.md").read_text())
    fields = {f.name: f for f in dataclasses.fields(PipelineConfig)}
    assert set(table) == set(fields), (
        f"missing from the table: {sorted(set(fields) - set(table))}; "
        f"not fields: {sorted(set(table) - set(fields))}"
    )
    for name, f in fields.items():
        if f.default is not dataclasses.MISSING:
            assert table[name] == repr(f.default), (name, table[name], repr(f.default))


def test_the_table_reader_sees_a_wrong_default():
    assert table_defaults("| `batch_size` | `32` | rows |\n") == {"batch_size": "32"}


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    assert DOCS, "no docs pages"
    unlinked = [p.name for p in DOCS if f"docs/{p.name}" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


@pytest.mark.parametrize("page", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(page):
    dead = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (page.parent / target).exists():
            dead.append(target)
    assert not dead, f"{page.name} links to missing files: {dead}"


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of ``page``'s headings (outside code blocks): lower case,
    punctuation but ``-`` and ``_`` dropped, spaces as ``-``, a repeat numbered."""
    seen: dict[str, int] = {}
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    for title in re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


@pytest.mark.parametrize("page", [ROOT / "README.md", *DOCS, ROOT / "benchmarks" / "RESULTS.md"],
                         ids=lambda p: p.name)  # fmt: skip
def test_links_to_a_heading_find_it(page):
    """A link to ``page.md#heading`` whose heading changed lands at the top of the page
    (five links into RESULTS.md's 3,000 lines did, after a date joined a heading)."""
    dead = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
        if "://" in target or not (target or page.name).endswith(".md"):
            continue
        if anchor not in anchors(page.parent / target if target else page):
            dead.append(f"{target}#{anchor}")
    assert not dead, f"{page.name} links to headings that are not there: {dead}"


def test_anchors_are_githubs():
    page = ROOT / "benchmarks" / "RESULTS.md"
    assert "the-default-path-plain-ray-tasks-on-the-h200-2026-11-26" in anchors(page)
    assert "with-dali-beside-it" not in anchors(page)  # a shell comment in a code block


def layout_block(text: str) -> str:
    """The package's part of the code block under a ``## Layout`` heading (up to ``jobs/``)."""
    match = re.search(r"^## Layout\n+```\n(.*?)^jobs/", text, flags=re.MULTILINE | re.DOTALL)
    assert match, "no ## Layout code block with the package and jobs/"
    return match.group(1)


def test_the_layout_sections_match_the_tree():
    package = ROOT / "raypipe"
    folders = sorted(p.name for p in package.iterdir() if (p / "__init__.py").is_file())
    readme = layout_block((ROOT / "README.md").read_text())
    design = layout_block((ROOT / "docs" / "design.md").read_text())
    for block, where in ((readme, "README.md"), (design, "docs/design.md")):
        missing = [f for f in folders if f"{f}/" not in block]
        assert not missing, f"{where}'s layout lacks the folders {missing}"
        gone = sorted(set(re.findall(r"\b([a-z]+)/", block)) - set(folders) - OUTSIDE)
        assert not gone, f"{where}'s layout names folders raypipe does not have: {gone}"
    modules = [p for p in package.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    undocumented = sorted(
        str(p.relative_to(package)) for p in modules if not re.search(rf"\b{p.stem}\b", design)
    )
    assert not undocumented, f"modules docs/design.md's layout does not name: {undocumented}"


OUTSIDE = {"raypipe", "samples", "cache"}  # the package itself; preprocess/samples/, cache/


def test_pointers_to_a_section_from_code_and_configs_find_it():
    """``README "Running at scale"`` in a comment or a docstring (what ``help()`` shows)
    names a heading of the README, or ``docs/page.md`` "Title" one of that page: three
    pointed at README sections that had moved to docs/ pages."""
    files = []
    for top, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("build", "demo-data")]
        files += [Path(top, n) for n in names if n.endswith((".py", ".yaml", ".sh"))]
    files.remove(Path(__file__).resolve())
    titles = {
        page: {t.strip() for t in re.findall(r"^#{1,6} (.+)$", page.read_text(), re.MULTILINE)}
        for page in [ROOT / "README.md", *DOCS]
    }  # fmt: skip
    dead = []
    for path in files:
        text = re.sub(r"\n\s*#\s*", " ", path.read_text())  # a comment's lines as one
        for page, title in re.findall(r"(README|docs/[\w-]+\.md) \"([^\"]+)\"", text):
            target = ROOT / ("README.md" if page == "README" else page)
            if title not in titles.get(target, ()):
                dead.append(f'{path.relative_to(ROOT)}: {page} "{title}"')
    assert files and not dead, dead
