"""The docs hold to the code: one code map that names every package and room, and no path or
module named in a doc that the tree does not have.

``docs/structure.md`` is the one code map; the other docs link to it. A module, file or folder
a doc names in backticks (``worker/shards/run.py``, ``core.llms.demo``) must exist, unless the
same doc says which commit to ``git show`` it from (a retired benchmark)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
STRUCTURE = REPO / "docs" / "structure.md"
#: Top-level packages whose rooms (sub-packages) the code map must name, one level down.
ROOMED = ("api", "core", "worker", "engine", "cli")
#: What a path or dotted module name in a doc may start with to be checked.
TOP = ("api", "core", "worker", "engine", "cli", "benchmarks", "tests", "migrations", "deploy",
       "scripts", "docs", "examples", "testkit")  # fmt: skip

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+)`")
PATH = re.compile(rf"^(?:{'|'.join(TOP)})/[\w./-]*$")
DOTTED = re.compile(rf"^(?:{'|'.join(TOP)})(?:\.\w+)+$")
RETIRED = re.compile(r"git show\s+[0-9a-f]{7,40}:([\w./-]+)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+)$", re.M)


def spans(doc: Path) -> list[str]:
    """The inline code of a doc, fenced blocks left out (they hold commands and output)."""
    return SPAN.findall(FENCE.sub("", doc.read_text()))


def rooms() -> list[str]:
    """``api/``, ``cli/`` and every package one level inside the roomed packages."""
    found = []
    for top in ROOMED:
        found.append(f"{top}/")
        found += sorted(
            f"{top}/{d.name}/"
            for d in (REPO / top).iterdir()
            if d.is_dir() and (d / "__init__.py").exists()
        )
    return found


def test_the_code_map_names_every_package_and_room() -> None:
    text = STRUCTURE.read_text()
    named = set(SPAN.findall(text))
    missing = [room for room in rooms() if room not in named]
    assert not missing, f"docs/structure.md's code map does not name {missing}"


def test_rooms_are_found() -> None:
    """The check above sees the rooms it is meant to (a renamed tree would empty it)."""
    found = rooms()
    for room in ("api/routes/", "core/database/", "worker/shards/", "engine/cpu/", "cli/run/"):
        assert room in found


def _exists(name: str) -> bool:
    if PATH.match(name):
        return (REPO / name.rstrip("/")).exists()
    parts = name.split(".")
    for n in range(len(parts), 1, -1):  # the longest prefix that is a module
        base = REPO.joinpath(*parts[:n])
        source = (
            base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        )
        if source.exists():  # the rest, if any, an attribute its source names
            return n == len(parts) or re.search(rf"\b{parts[n]}\b", source.read_text()) is not None
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_paths_and_modules_named_in_a_doc_exist(doc: Path) -> None:
    retired = set(RETIRED.findall(doc.read_text()))
    named = {s for s in spans(doc) if PATH.match(s) or DOTTED.match(s)}
    missing = sorted(s for s in named if s not in retired and not _exists(s))
    assert not missing, f"{doc.relative_to(REPO)} names what the tree does not have: {missing}"


def anchors(doc: Path) -> set[str]:
    """The anchors of a doc's headings, as GitHub makes them (a repeated one gets ``-1``...)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for title in HEADING.findall(FENCE.sub("", doc.read_text())):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = seen[slug] = seen.get(slug, -1) + 1
        found.add(f"{slug}-{n}" if n else slug)
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_of_a_doc_lead_to_files_and_headings(doc: Path) -> None:
    broken = []
    for target in LINK.findall(doc.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = doc if not path else doc.parent / path
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
            broken.append(target)
    assert not broken, f"{doc.relative_to(REPO)} links to what is not there: {broken}"


def test_the_checks_catch_a_stale_name(tmp_path: Path) -> None:
    """A path or module that is not there is caught; one a doc retires with its commit is not."""
    assert _exists("worker/shards/run.py") and _exists("core.llms.demo")
    assert _exists("worker.host_contract.Host") and _exists("testkit/")
    assert not _exists("worker/shards/gone.py") and not _exists("core.llms.gone")
    doc = tmp_path / "x.md"
    doc.write_text("`benchmarks/old.py`, retired: `git show f68f9fd:benchmarks/old.py`\n")
    assert RETIRED.findall(doc.read_text()) == ["benchmarks/old.py"]
    doc.write_text("# Title\n## `core/eta`: projected\n## Again\n## Again\n```\n# not one\n```\n")
    assert anchors(doc) == {"title", "coreeta-projected", "again", "again-1"}
