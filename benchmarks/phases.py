"""Where a system's time goes: a per-step trace summarised by phase.

Where a system's time goes: a per-step trace, recorded from outside the system, summarised
by phase.

A step is classed by what it computes: "prefill" when most of its tokens are prompt tokens
(prefill chunks), "decode" when most are decode tokens (one per running sequence), and "tail"
for the steps at the end of the run after which fewer than a quarter of ``max_num_seqs``
sequences ever run again (the batch has drained and the device is underfed, whatever the
step computes). For each phase: steps, seconds and share of the run, CPU seconds of the
thread running the steps (steadier than wall time on a shared machine), mean running sequences,
prefill and decode tokens per second of step time, and the same two rates per second of
model forward only: the ceiling the step would reach if scheduling, input packing, sampling
and bookkeeping cost nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PHASES = ("prefill", "decode", "tail")


@dataclass(slots=True)
class Step:
    prefill_tokens: int
    decode_tokens: int
    running: int
    step_s: float = 0.0
    forward_s: float = 0.0
    cpu_s: float = 0.0  # CPU time of the thread running the step: steady on a loaded machine


@dataclass
class StepTrace:
    """Steps in order. A recorder calls :meth:`begin` when a step's work is known (its
    scheduled tokens), :meth:`forward` around the model forward, and :meth:`end` when the
    step is over; :meth:`close` ends the last step at the end of the timed run."""

    sync: Callable[[], None] = lambda: None  # a device sync, so forward times are real
    steps: list[Step] = field(default_factory=list)
    _t0: float | None = None
    _cpu0: float = 0.0
    _thread: int = 0
    _enabled: bool = False

    def start(self) -> None:
        self.steps.clear()
        self._enabled = True

    def begin(self, prefill_tokens: int, decode_tokens: int, running: int) -> None:
        if not self._enabled:
            return
        if self._t0 is not None and self.steps:  # a system without an end hook
            self.end()
        self._t0, self._cpu0 = time.perf_counter(), time.thread_time()
        self._thread = threading.get_ident()
        self.steps.append(Step(prefill_tokens, decode_tokens, running))

    def timed_forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not self._enabled or not self.steps:
            return fn(*args, **kwargs)
        self.sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.sync()
        self.steps[-1].forward_s += time.perf_counter() - t0
        return out

    def end(self) -> None:
        if self._enabled and self._t0 is not None and self.steps:
            self.steps[-1].step_s = time.perf_counter() - self._t0
            if threading.get_ident() == self._thread:  # else the step's thread is not this one
                self.steps[-1].cpu_s = time.thread_time() - self._cpu0
            self._t0 = None

    def close(self) -> None:
        self.end()
        self._enabled = False


def summarise(steps: list[Step], max_num_seqs: int) -> dict[str, Any]:
    """Per-phase figures (see the module docstring) and the whole run's."""
    quarter = max_num_seqs / 4
    tail_from = len(steps)
    while tail_from > 0 and steps[tail_from - 1].running < quarter:
        tail_from -= 1
    groups: dict[str, list[Step]] = {name: [] for name in PHASES}
    for i, s in enumerate(steps):
        if i >= tail_from:
            groups["tail"].append(s)
        elif s.prefill_tokens >= s.decode_tokens:
            groups["prefill"].append(s)
        else:
            groups["decode"].append(s)
    total_s = sum(s.step_s for s in steps)
    out: dict[str, Any] = {"phases": {}, "total_step_s": total_s, "num_steps": len(steps)}
    for name, group in [*groups.items(), ("all", steps)]:
        step_s = sum(s.step_s for s in group)
        fwd_s = sum(s.forward_s for s in group)
        cpu_s = sum(s.cpu_s for s in group)
        pre = sum(s.prefill_tokens for s in group)
        dec = sum(s.decode_tokens for s in group)
        figures = {
            "steps": len(group),
            "time_s": step_s,
            "time_share": step_s / total_s if total_s else 0.0,
            "mean_running": sum(s.running for s in group) / len(group) if group else 0.0,
            "prefill_tokens": pre,
            "decode_tokens": dec,
            "prefill_tok_s": pre / step_s if step_s else 0.0,
            "decode_tok_s": dec / step_s if step_s else 0.0,
            "forward_s": fwd_s,
            "cpu_s": cpu_s,
            "prefill_tok_per_cpu_s": pre / cpu_s if cpu_s else 0.0,
            "decode_tok_per_cpu_s": dec / cpu_s if cpu_s else 0.0,
            "forward_prefill_tok_s": pre / fwd_s if fwd_s else 0.0,
            "forward_decode_tok_s": dec / fwd_s if fwd_s else 0.0,
            "outside_forward_frac": 1.0 - fwd_s / step_s if step_s else 0.0,
        }
        if name == "all":
            out["all"] = figures
        else:
            out["phases"][name] = figures
    return out


def print_profile(console: Any, name: str, profile: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"{name}: where the time goes (forward-only rates are the ceiling)")
    cols = (
        "phase",
        "steps",
        "time s",
        "share",
        "cpu s",
        "mean seqs",
        "prefill tok/s",
        "decode tok/s",
        "fwd prefill tok/s",
        "fwd decode tok/s",
        "outside fwd",
    )
    for col in cols:
        table.add_column(col, justify="left" if col == "phase" else "right")
    for phase, f in [*profile["phases"].items(), ("all", profile["all"])]:
        table.add_row(
            phase,
            str(f["steps"]),
            f"{f['time_s']:.2f}",
            f"{f['time_share']:.0%}",
            f"{f['cpu_s']:.2f}",
            f"{f['mean_running']:.1f}",
            f"{f['prefill_tok_s']:,.0f}",
            f"{f['decode_tok_s']:,.0f}",
            f"{f['forward_prefill_tok_s']:,.0f}",
            f"{f['forward_decode_tok_s']:,.0f}",
            f"{f['outside_forward_frac']:.0%}",
        )
    console.print(table)


def device_sync(device: Any) -> Callable[[], None]:
    """A sync for ``device`` (forward times on an asynchronous device are launch times
    otherwise); a no-op on CPU."""
    import torch

    if getattr(device, "type", str(device)).startswith("cuda"):
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def trace_engine(engine: Any, trace: StepTrace) -> None:
    """Record ``engine``'s steps by wrapping, from outside, its scheduler's output (what each
    step computes), its runner's forward and its step."""
    scheduler, runner = engine.scheduler, engine.runner
    schedule, forward, step = scheduler.schedule, runner.forward, engine.step

    def traced_schedule() -> Any:
        scheduled = schedule()
        decode = sum(
            1 for seq, n in scheduled if n == 1 and seq.num_computed_tokens == len(seq) - 1
        )
        total = sum(n for _, n in scheduled)
        if scheduled:
            trace.begin(total - decode, decode, len(scheduled))
        return scheduled

    def traced_forward(*args: Any, **kwargs: Any) -> Any:
        return trace.timed_forward(forward, *args, **kwargs)

    def traced_step() -> Any:
        try:
            return step()
        finally:
            trace.end()

    scheduler.schedule = traced_schedule
    runner.forward = traced_forward
    engine.step = traced_step


def trace_continuous_batching(batch_processor: Any, trace: StepTrace) -> None:
    """Record the steps of transformers' continuous batching the same way: its scheduler's
    batch (each request's query length), and ``compute_batch`` (forward and sampling) as the
    forward. Its loop has no end-of-step hook, so a step lasts until the next one begins."""
    scheduler, runner = batch_processor.scheduler, batch_processor.model_runner
    schedule_batch, compute_batch = scheduler.schedule_batch, runner.compute_batch

    def traced_schedule_batch(*args: Any, **kwargs: Any) -> Any:
        result = schedule_batch(*args, **kwargs)
        states = result[0]
        if states:
            decode = sum(1 for s in states if s.query_length == 1)
            total = sum(s.query_length for s in states)
            trace.begin(total - decode, decode, len(states))
        return result

    def traced_compute_batch(*args: Any, **kwargs: Any) -> Any:
        return trace.timed_forward(compute_batch, *args, **kwargs)

    scheduler.schedule_batch = traced_schedule_batch
    runner.compute_batch = traced_compute_batch
