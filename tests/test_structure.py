"""The structure the packages promise, read from their source: priority is defined once (in
``core.priority``), who runs next once (in ``engine.host.order``), the engine is a leaf, and
the engine core imports nothing from the host (``engine.host``). A scan of the syntax trees,
so it fails on the commit that breaks the rule, whatever the code path."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

from core.priority import Priority, PriorityName
from engine.core.urgent import is_urgent
from engine.host.order import NORMAL, aged_tier

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "core", "worker", "engine", "cli", "migrations")
NAMES = {"high", "normal", "low"}
PRIORITY_HOME = Path("core/priority.py")
ORDER_HOME = Path("engine/host/order.py")
# The places that choose who runs next (the upstream dispatcher through the fair queue).
ORDER_USERS = (Path("engine/host/fair_queue.py"), Path("worker/shards/release.py"))
ORDER_RULES = {"aged_tier", "due", "deadline_key", "share_key", "flow_key"}


def _sources(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _imported(tree: ast.Module) -> list[str]:
    """Every module an import statement names, at any depth (function-level imports too)."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return names


def _priority_definitions(tree: ast.Module) -> list[int]:
    """Lines of what spells out two or more of the priority names side by side: a dict keyed
    by them (``{"high": 0, ...}``), a tuple, list or set of them (``Literal["high", ...]``,
    ``("low", "normal", "high")``), a class whose body assigns them (an enum)."""
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            items: list[ast.AST | None] = list(node.keys)
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            items = list(node.elts)
        elif isinstance(node, ast.ClassDef):
            items = [stmt.value for stmt in node.body if isinstance(stmt, ast.Assign)]
        else:
            continue
        found = {
            item.value
            for item in items
            if isinstance(item, ast.Constant) and isinstance(item.value, str)
        }
        if len(found & NAMES) >= 2:
            hits.append(node.lineno)
    return hits


def test_priority_is_defined_once_in_core_priority() -> None:
    elsewhere = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in _sources(*PACKAGES)
        if path.relative_to(ROOT) != PRIORITY_HOME
        for line in _priority_definitions(_tree(path))
    ]
    assert elsewhere == [], (
        "priority names spelled out outside core/priority.py (use core.priority.Priority): "
        + ", ".join(elsewhere)
    )
    assert _priority_definitions(_tree(ROOT / PRIORITY_HOME)), "the scan no longer sees it"


def test_who_runs_next_is_written_once_in_engine_host_order() -> None:
    """The tier, aging, deadline and token-share rules are defined in ``engine.host.order``
    only; the places that choose take the whole order from it (``flow_key``), and none keeps
    a scheme of its own (such as the deficit round robin the fair queue once ran)."""
    elsewhere = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
        for path in _sources(*PACKAGES)
        if path.relative_to(ROOT) != ORDER_HOME
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in ORDER_RULES
    ]
    assert elsewhere == []
    for path in ORDER_USERS:
        taken = {
            alias.name
            for node in ast.walk(_tree(ROOT / path))
            if isinstance(node, ast.ImportFrom) and node.module == "engine.host.order"
            for alias in node.names
        }
        assert {"flow_key", "share_key"} <= taken, f"{path} does not use engine.host.order"
        assert "deficit" not in (ROOT / path).read_text(encoding="utf-8").lower(), path
    dispatcher = _imported(_tree(ROOT / "worker/upstream/dispatcher.py"))
    assert "engine.host.fair_queue" in dispatcher


def test_the_engine_core_imports_nothing_from_the_host() -> None:
    reaching = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _sources("engine/core", "engine/sim")
        for name in _imported(_tree(path))
        if name == "engine.host" or name.startswith("engine.host.")
    ]
    assert reaching == []


def test_the_engine_is_a_leaf() -> None:
    above = ("api", "core", "worker", "cli", "migrations")
    reaching = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _sources("engine")
        for name in _imported(_tree(path))
        if name.split(".")[0] in above
    ]
    assert reaching == []


def test_benchmarks_are_imported_by_nothing_they_measure() -> None:
    """The arrows point one way: ``benchmarks`` uses ``cli.perf`` and the tests' harness,
    never the reverse (nor does the service), so either can change without the benchmarks."""
    reaching = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _sources(*PACKAGES, "tests/harness", "tests/helpers")
        for name in _imported(_tree(path))
        if name.split(".")[0] == "benchmarks"
    ]
    assert reaching == []


def test_the_scans_see_what_they_look_for() -> None:
    """The scans themselves: a second definition and a reach into the host are caught."""
    second = ast.parse('RANK = {"high": 0, "normal": 1, "low": 2}\nP = Literal["high", "low"]')
    assert _priority_definitions(second) == [1, 2]
    assert _imported(ast.parse("def f():\n    from engine.host.policy import x")) == [
        "engine.host.policy"
    ]


def test_the_service_priorities_agree_with_the_engines_numbers() -> None:
    """``core`` and the engine cannot import each other, so each states the convention; these
    are the points where they must meet."""
    assert tuple(Priority) == get_args(PriorityName)
    assert Priority.NORMAL.engine == NORMAL
    assert is_urgent(Priority.HIGH.engine)
    assert not is_urgent(Priority.NORMAL.engine) and not is_urgent(Priority.LOW.engine)
    assert sorted(Priority, key=lambda p: p.engine) == list(Priority)
    # A low batch that waited ages into normal, and no further.
    assert aged_tier(Priority.LOW.engine, 0.0, 100.0, 1.0) == Priority.NORMAL.engine
    assert aged_tier(Priority.NORMAL.engine, 0.0, 100.0, 1.0) == Priority.NORMAL.engine


def test_no_two_test_modules_share_a_name() -> None:
    """The test folders are not packages: pytest imports each module by its base name, so two
    files of one name (``tests/e2e/test_x.py`` and ``tests/worker/test_x.py``) fail to collect
    together, though each passes alone."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(ROOT)} and {path.relative_to(ROOT)}")
        seen.setdefault(path.name, path)
    assert not clashes, clashes
