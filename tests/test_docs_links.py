"""The documents a newcomer reads hold together: every relative link in README.md and docs/**
resolves to a file of the repository (and, for a `#fragment` into a Markdown file, to one of its
headings), and the README is the front door the guide hangs from (docs/architecture.md, SPEC §29).
No database: these only read files."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUIDE_PAGES = ("command-line", "python-api", "gateway", "sessions", "scaling-out", "console",
               "operations", "benchmarks")
README_MAX_LINES = 300

# [text](target): a target without spaces; images too. Links inside code spans and code blocks
# are not links.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose(text: str) -> str:
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = _CODE_SPAN.sub(lambda m: m.group(0).strip("`"), heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    return [target for target in _LINK.findall(prose(path.read_text()))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: are not ours


def test_every_relative_link_resolves_to_a_file_and_a_heading():
    broken = []
    for doc in documents():
        for target in relative_links(doc):
            file_part, _, fragment = target.partition("#")
            dest = (doc.parent / file_part).resolve() if file_part else doc
            where = f"{doc.relative_to(ROOT)}: {target}"
            if not dest.exists() or not dest.is_relative_to(ROOT):
                broken.append(f"{where} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append(f"{where} (no heading #{fragment})")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_front_door_that_links_every_guide_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    linked = set(relative_links(ROOT / "README.md"))
    for page in GUIDE_PAGES:
        assert (ROOT / "docs" / "guide" / f"{page}.md").exists(), page
        assert f"docs/guide/{page}.md" in linked, page
    for page in (ROOT / "docs" / "guide").glob("*.md"):  # no page a newcomer cannot find
        assert f"docs/guide/{page.name}" in linked, page.name
    assert "docs/architecture.md" in linked


def test_the_checker_sees_a_broken_link(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# Title\n\n[ok](doc.md#title) [gone](missing.md) `[code](missing.md)`\n")
    assert relative_links(doc) == ["doc.md#title", "missing.md"]
    assert anchors(doc) == {"title"}


def test_the_architecture_names_every_package_table_and_lane():
    from runplane.engine.ports import LANES

    text = (ROOT / "docs" / "architecture.md").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.findall(r'^\s*"(runplane\.[\w.]+)",$', pyproject, re.M)
    schema = (ROOT / "engine" / "schema.py").read_text()
    tables = re.findall(r"CREATE TABLE IF NOT EXISTS \{s\}\.(\w+)", schema)
    assert packages and len(tables) >= 19
    missing = [f"package {name}" for name in packages if f"`{name}`" not in text]
    missing += [f"table {name}" for name in tables if f"`{name}`" not in text]
    missing += [f"lane {name}" for name in LANES if f"`{name}`" not in text]
    missing += [f"section {name}" for name in ("Run history", "Shared rate limits", "The console")
                if f"\n## {name}\n" not in text]
    assert not missing, missing
