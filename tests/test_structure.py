"""The structure the packages promise, read from their source: priority is defined once (in
``core.batches.priority``), who runs next once (in ``engine.host.order``), the engine is a leaf, and
the engine core imports nothing from the host (``engine.host``), and the rooms of ``worker``,
``core`` and ``engine`` import one another one way only (``WORKER_ROOMS``, ``CORE_ROOMS``,
``ENGINE_ROOMS``). A scan of the syntax trees, so it fails on the commit that breaks the rule,
whatever the code path."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

from core.batches.priority import Priority, PriorityName
from engine.core.urgent import is_urgent
from engine.host.order import NORMAL, aged_tier

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "core", "worker", "engine", "cli", "migrations")
NAMES = {"high", "normal", "low"}
PRIORITY_HOME = Path("core/batches/priority.py")
ORDER_HOME = Path("engine/host/order.py")
# The places that choose who runs next (the upstream dispatcher through the fair queue).
ORDER_USERS = (Path("engine/host/fair_queue.py"), Path("worker/shards/release.py"))
ORDER_RULES = {"aged_tier", "due", "deadline_key", "share_key", "flow_key"}
# The rooms of ``worker`` (each subpackage, each module beside them), from the lowest to the
# highest: a room's modules import only the rooms below it (docs/worker.md says what each holds).
WORKER_ROOMS = (
    "host_contract",  # what the shard code asks of a host: the Host protocol
    "handler",  # what a handler promises a shard's run: the Handler protocol, the outcomes
    "infra",  # the Celery app, the engines of the process, the helpers every room shares
    "events",  # a batch's webhook event, sent when it ends
    "upstream",  # the dispatcher to an upstream server, and its handler
    "shards",  # a shard's run: task, attempt, handlers, checkpoints, reclaim, release
    "validation",  # the one pass over a batch's input that creates its shards
    "batches",  # the control tasks, finalize, the webhook delivery, retention
    "__main__",  # ``python -m worker``
)
# The imports inside a function that reach a room above their own, each with why it waits.
LATE_IMPORTS = {
    ("worker/infra/runtime.py", "worker.upstream.dispatcher"): (
        "a host's code is imported where the host starts, as the engine's is"
    ),
}


# The rooms of ``core``, lowest first (each subpackage, each module beside them): a room
# imports only rooms before it, at any depth (imports inside functions too), with no
# exception. The configuration stands low, since the database, the models and the broker read it; what a process tells about itself stands over
# the database its gauges read; the broker over what ``/readyz`` checks; the launcher last.
CORE_ROOMS = (
    "version",  # the package's version
    "security",  # where the service may send its own requests; redaction
    "settings",  # the one configuration
    "batches",  # what a batch is: ids, priority, windows, shards, prefix plans, retries
    "batchfile",  # the batch file format
    "llms",  # the served models: specs, demo models, GGUF, generation records
    "storage",  # object storage
    "database",  # tables, sessions, state machines, the results log
    "eta",  # projected completion times
    "observability",  # logs, request ids, metrics, traces
    "broker",  # task and queue names, request and reply, readiness
    "launch",  # every process's command line
)

# The engine's rooms, lowest first: a room imports only rooms before it, at any depth
# (imports inside functions too). The compiled kernels, the thread governor and the text
# helpers at the bottom; the attention backends over the kernels; the CPU forward over both;
# the step loop over all of them; the host, embeddings, the simulated engine and the offline
# LLM over the step loop; the package's public names last.
ENGINE_ROOMS = (
    "text",  # tokenizers, chat prompts, stop strings, grammars
    "threads",  # the intra-op team that follows free cores
    "cpu",  # the compiled kernels, their loader and ABI, the GEMM choice
    "attention",  # paged attention and its CPU and CUDA backends
    "forward",  # fused projections and the lean Llama forward
    "lora",  # LoRA adapters: reading and checking them, the resident set, per-row deltas
    "core",  # the step: config, sequences, blocks, scheduler, runner, sampler
    "host",  # who runs next: the thread-safe host and its fair queue
    "embedding",  # embedding models
    "sim",  # the simulated engine
    "llm",  # the offline LLM
    "__init__",  # the package's public names
)


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


def _worker_imports(path: Path, tree: ast.Module) -> list[tuple[int, str, bool]]:
    return _package_imports(path, tree, "worker")


def _package_imports(path: Path, tree: ast.Module, top: str) -> list[tuple[int, str, bool]]:
    """``(line, module, in a function)`` for each module of package ``top`` that an import
    statement of the file at ``path`` names: ``from worker import events`` names
    ``worker.events``, a relative import the module it resolves to. An import in a class body
    or under ``if TYPE_CHECKING:`` is at module level."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    found: list[tuple[int, str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = list(package[: len(package) - child.level + 1]) if child.level else []
                module = ".".join([*base, *(child.module or "").split(".")]).strip(".")
                names = [module]
                if module == top or child.module is None:
                    names = [f"{module}.{alias.name}" for alias in child.names]
            found.extend(
                (child.lineno, name, in_function)
                for name in names
                if name.split(".")[0] == top and "." in name
            )
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(tree, False)
    return found


def _worker_room(path: Path) -> str:
    """The room of a file of ``worker``: its subpackage, or its own name beside them."""
    inside = path.relative_to(ROOT / "worker")
    return inside.parts[0] if len(inside.parts) > 1 else inside.stem


def _upward_imports(path: Path, tree: ast.Module) -> list[tuple[str, str, bool]]:
    """Each import of the file at ``path`` (in ``worker``) that names a room above its own, or
    one not in ``WORKER_ROOMS``, as ``(where and what, the module, in a function)``;
    ``worker/__init__.py`` stands below every room."""
    relative = path.relative_to(ROOT).as_posix()
    own = _worker_room(path)
    rank = -1 if own == "__init__" else WORKER_ROOMS.index(own)
    upward = []
    for line, module, in_function in _worker_imports(path, tree):
        room = module.split(".")[1]
        if room == own or (room in WORKER_ROOMS and WORKER_ROOMS.index(room) < rank):
            continue
        where = "above" if room in WORKER_ROOMS else "not in WORKER_ROOMS, so not below"
        upward.append(
            (f"{relative}:{line} imports {module} ({room} is {where} {own})", module, in_function)
        )
    return upward


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
        f"priority names spelled out outside {PRIORITY_HOME.as_posix()} (use its Priority): "
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
    """The arrows point one way: ``benchmarks`` uses ``cli.perf`` and ``testkit``,
    never the reverse (nor does the service), so either can change without the benchmarks."""
    reaching = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _sources(*PACKAGES, "testkit")
        for name in _imported(_tree(path))
        if name.split(".")[0] == "benchmarks"
    ]
    assert reaching == []


def test_every_room_of_the_worker_has_its_place_in_the_order() -> None:
    """A new room is placed in ``WORKER_ROOMS`` when it is made: where it stands says which
    rooms it may use."""
    rooms = {_worker_room(path) for path in _sources("worker")} - {"__init__"}
    assert sorted(rooms - set(WORKER_ROOMS)) == [], "place each new room in WORKER_ROOMS"
    assert sorted(set(WORKER_ROOMS) - rooms) == [], "a room in WORKER_ROOMS is gone"
    assert len(set(WORKER_ROOMS)) == len(WORKER_ROOMS)


def test_the_rooms_of_the_worker_import_only_the_rooms_below_them() -> None:
    """Imports between ``worker``'s rooms point one way, down ``WORKER_ROOMS``, so no two rooms
    import each other, round however many others. What two rooms share lives in a room below
    both (the handler contract below ``shards`` and ``upstream``, a batch's webhook event below
    ``validation`` and ``batches``), not in one of them. An import inside a function is held to
    the same order unless ``LATE_IMPORTS`` names it and says why."""
    upward = [
        (path.relative_to(ROOT).as_posix(), *found)
        for path in _sources("worker")
        for found in _upward_imports(path, _tree(path))
    ]
    at_module_level = [what for _, what, _, in_function in upward if not in_function]
    assert at_module_level == [], "move what both rooms use into a room below them"
    late = {(path, module): what for path, what, module, in_function in upward if in_function}
    unnamed = [what for key, what in late.items() if key not in LATE_IMPORTS]
    assert unnamed == [], "an import in a function reaches up: move it down, or say why"
    assert sorted(set(LATE_IMPORTS) - set(late)) == [], "LATE_IMPORTS names an import gone"


def test_the_rooms_of_the_engine_import_only_the_rooms_below_them() -> None:
    """Imports between the engine's rooms point one way, down ``ENGINE_ROOMS``, inside
    functions too: what two rooms share lives below both (a sequence's detokenizing in the
    core, not in ``text``; the CUDA graphs of the step in the core, not in ``attention``)."""
    rooms = set()
    upward = []
    for path in _sources("engine"):
        inside = path.relative_to(ROOT / "engine")
        own = inside.parts[0] if len(inside.parts) > 1 else inside.stem
        rooms.add(own)
        rank = ENGINE_ROOMS.index(own) if own in ENGINE_ROOMS else -1
        for line, module, _ in _package_imports(path, _tree(path), "engine"):
            room = module.split(".")[1]
            if room != own and (room not in ENGINE_ROOMS or ENGINE_ROOMS.index(room) > rank):
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert sorted(rooms ^ set(ENGINE_ROOMS)) == [], "place each room of engine in ENGINE_ROOMS"
    assert upward == [], "move what both rooms use into a room below them"


def test_the_rooms_of_core_import_only_the_rooms_below_them() -> None:
    """Imports between ``core``'s rooms point one way, down ``CORE_ROOMS``, inside functions
    too: what two rooms share lives below both."""
    rooms = set()
    upward: dict[tuple[str, str], str] = {}
    for path in _sources("core"):
        inside = path.relative_to(ROOT / "core")
        own = inside.parts[0] if len(inside.parts) > 1 else inside.stem
        rooms.add(own)
        rank = CORE_ROOMS.index(own) if own in CORE_ROOMS else -1
        relative = path.relative_to(ROOT).as_posix()
        for line, module, _ in _package_imports(path, _tree(path), "core"):
            room = module.split(".")[1]
            if room != own and (room not in CORE_ROOMS or CORE_ROOMS.index(room) > rank):
                upward[(relative, module)] = f"{relative}:{line} imports {module}"
    rooms -= {"__init__"}
    assert sorted(rooms ^ set(CORE_ROOMS)) == [], "place each room of core in CORE_ROOMS"
    assert list(upward.values()) == [], "move what both rooms use into a room below them"


def test_the_scans_see_what_they_look_for() -> None:
    """The scans themselves: a second definition, a reach into the host and a room of the worker
    that imports one above it are caught, at module level and in a function."""
    second = ast.parse('RANK = {"high": 0, "normal": 1, "low": 2}\nP = Literal["high", "low"]')
    assert _priority_definitions(second) == [1, 2]
    assert _imported(ast.parse("def f():\n    from engine.host.policy import x")) == [
        "engine.host.policy"
    ]
    validation = ROOT / "worker/validation/example.py"
    source = (
        "from worker.batches.webhooks import notify\n"  # above: caught
        "from worker import batches, events, shards\n"  # batches caught, events and shards below
        "from . import task\n"  # its own room
        "from ..batches import tasks\n"  # above, relatively: caught
        "if TYPE_CHECKING:\n    import worker.batches.finalize\n"  # module level: caught
        "def f():\n    from worker.batches import retention\n"  # in a function: caught as such
    )
    found = [
        (what.split()[0], module, late)
        for what, module, late in _upward_imports(validation, ast.parse(source))
    ]
    assert found == [
        ("worker/validation/example.py:1", "worker.batches.webhooks", False),
        ("worker/validation/example.py:2", "worker.batches", False),
        ("worker/validation/example.py:4", "worker.batches", False),
        ("worker/validation/example.py:6", "worker.batches.finalize", False),
        ("worker/validation/example.py:8", "worker.batches", True),
    ]
    package = ROOT / "worker/__init__.py"  # below every room
    assert [
        module
        for _, module, _ in _upward_imports(package, ast.parse("import worker.host_contract"))
    ] == ["worker.host_contract"]


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


# The test modules at the top of a package's test folder: those about the whole package. Every
# other test sits in the folder of the room it is about (``tests/worker/shards/``, named as
# ``worker/shards/``), so a room's tests are found where its code is.
WHOLE_PACKAGE_TESTS = {
    "worker": {
        "test_rooms.py",  # every room imports without torch
        "test_worker_init.py",  # what a worker process imports before its tasks run
        "test_tools_batch.py",  # tools through validation, a shard's run and finalize
    },
    "engine": {
        "test_bench.py",  # the engine benchmark end to end
        "test_bounded_state.py",  # every queue and index of the engine and its host drains
        "test_engine_gate.py",  # the gate the tests hold an engine with
        "test_greedy_equivalence.py",  # the oracle under every scheduling regime
        "test_smollm2.py",  # the engine on the default chat model
    },
}


def test_the_tests_of_a_package_mirror_its_rooms() -> None:
    """``tests/worker`` and ``tests/engine`` hold at their top only the modules about the whole
    package (``WHOLE_PACKAGE_TESTS``) and their ``conftest.py``; each folder below is one of
    the package's rooms."""
    for package, whole in WHOLE_PACKAGE_TESTS.items():
        folder = ROOT / "tests" / package
        top = {p.name for p in folder.glob("*.py")} - {"conftest.py"}
        assert sorted(top - whole) == [], f"move into the folder of its room in {folder}"
        assert sorted(whole - top) == [], "WHOLE_PACKAGE_TESTS names a module gone"
        rooms = {p.name for p in (ROOT / package).iterdir() if (p / "__init__.py").is_file()}
        folders = {p.name for p in folder.iterdir() if p.is_dir() and p.name != "__pycache__"}
        assert sorted(folders - rooms) == [], f"a folder of {folder} names no room of {package}"


def test_nothing_outside_the_tests_imports_them() -> None:
    """``benchmarks`` and ``testkit`` share what they need through ``testkit``, never by
    importing a test module (nor does the service)."""
    reaching = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _sources(*PACKAGES, "benchmarks", "testkit")
        for name in _imported(_tree(path))
        if name.split(".")[0] == "tests"
    ]
    assert reaching == []
