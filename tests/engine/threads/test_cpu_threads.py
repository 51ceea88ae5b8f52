"""CpuThreads: the engine's intra-op team follows the cores other processes leave free."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from engine.threads import governor as cpu_threads
from engine.threads.governor import TICKS_PER_S, CpuThreads, _busy_ticks

STAT = """cpu  900 0 100 5000 10 0 0 0 0 0
cpu0 100 5 20 1000 3 1 2 4 0 0
cpu1 200 0 30 2000 7 0 0 0 0 0
cpu2 50 0 0 3000 0 0 0 0 0 0
intr 1 2 3
"""


def test_busy_ticks_counts_the_given_cpus_less_idle_and_iowait(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    assert _busy_ticks(frozenset({0}), str(stat), count_nice=True) == 100 + 5 + 20 + 1 + 2 + 4
    assert _busy_ticks(frozenset({0, 1}), str(stat), count_nice=True) == 132 + 230
    # Niced processes leave a core to an engine of normal priority: their ticks are not busy.
    assert _busy_ticks(frozenset({0}), str(stat)) == 100 + 20 + 1 + 2 + 4
    assert _busy_ticks(frozenset({7}), str(stat)) == 0
    assert _busy_ticks(frozenset({0}), str(tmp_path / "missing")) is None


def test_others_are_the_busy_cores_less_the_engines_own_share() -> None:
    ct = CpuThreads(max_threads=2)
    ct.cpus = frozenset({0, 1})
    ct.threads = 2
    assert ct.others(10.0, 1.0, 1.0, 0) is None  # the first sample only sets the baseline
    # One second: both cores fully busy; the stepping thread ran 0.5 s on a team of 2, the
    # process 1.2 s: the engine's share is 1.0 core, the rest of the machine holds 1.0.
    assert ct.others(11.0, 1.5, 2.2, 2 * TICKS_PER_S) == pytest.approx(1.0)
    # The process's own CPU caps the engine's share (a team that was mostly waiting).
    assert ct.others(12.0, 2.5, 2.8, 4 * TICKS_PER_S) == pytest.approx(1.4)
    assert [ct.target(o) for o in (0.0, 0.4, 0.6, 1.0, 1.9, 5.0)] == [2, 2, 1, 1, 1, 1]
    wide = CpuThreads(max_threads=3)
    wide.cpus = frozenset(range(8))
    assert [wide.target(o) for o in (0.0, 5.0, 6.4, 7.0)] == [3, 3, 2, 1]


def test_the_team_shrinks_while_others_hold_a_core_and_grows_back(monkeypatch) -> None:
    """poll() on the stepping thread sets torch's team on that thread: 2 while the machine is
    idle, 1 while another process holds a core, 2 again once it stops."""
    clock = {"wall": 100.0, "thread": 0.0, "process": 0.0, "busy": 0}
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(cpu_threads.time, "thread_time", lambda: clock["thread"])
    monkeypatch.setattr(cpu_threads.time, "process_time", lambda: clock["process"])
    monkeypatch.setattr(cpu_threads, "_busy_ticks", lambda cpus, **kw: clock["busy"])
    seen: list[int] = []

    def tick(engine_s: float, other_cores: float) -> None:
        """One interval: the engine's thread runs ``engine_s`` on its team, others hold
        ``other_cores``; then the stepping thread polls."""
        team = ct.threads
        clock["wall"] += 1.0
        clock["thread"] += engine_s
        clock["process"] += engine_s * team
        clock["busy"] += round((engine_s * team + other_cores) * TICKS_PER_S)
        ct.poll()
        seen.append(torch.get_num_threads())

    def stepping_thread() -> None:
        ct.poll()  # the baseline sample sets the starting team on this thread
        seen.append(torch.get_num_threads())
        for engine_s, others in [(0.9, 0.1), (0.9, 1.0), (0.9, 0.95), (0.9, 0.2), (0.9, 0.0)]:
            tick(engine_s, others)

    before = torch.get_num_threads()
    ct = CpuThreads(max_threads=2)
    ct.cpus = frozenset({0, 1})
    ct.enabled = True
    try:
        worker = threading.Thread(target=stepping_thread)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(before)
    assert seen == [2, 2, 1, 1, 2, 2], seen
    assert ct.changes == 2


def test_an_engine_adapts_on_a_cpu_unless_told_not_to(tmp_path: Path) -> None:
    """The library adapts as the worker does: two threads on cores that others hold spin at
    every barrier (a run beside other work was 8x slower), whoever drives the engine."""
    from core.llms.demo import build
    from engine import Engine

    model = build("llama-tiny")
    assert isinstance(Engine(str(model), num_kv_blocks=16).cpu_threads, CpuThreads)
    assert Engine(str(model), num_kv_blocks=16, adapt_cpu_threads=False).cpu_threads is None
    with pytest.raises(ValueError, match="adapt_cpu_threads must be true or false"):
        Engine(str(model), adapt_cpu_threads="yes")


def test_a_niced_engine_counts_niced_neighbours(monkeypatch) -> None:
    """An engine of normal priority leaves niced processes out of the busy cores (the scheduler
    hands it their cores); a niced engine meets them on equal terms and counts them."""
    seen: list[bool] = []

    def busy(cpus, path="/proc/stat", count_nice=False):  # type: ignore[no-untyped-def]
        seen.append(count_nice)
        return 0

    monkeypatch.setattr(cpu_threads, "_busy_ticks", busy)
    for niced in (False, True):
        monkeypatch.setattr(cpu_threads, "_niced", lambda niced=niced: niced)
        ct = CpuThreads(max_threads=2, interval_s=0.0)
        ct.poll()
        assert ct.count_nice is niced and seen[-1] is niced
