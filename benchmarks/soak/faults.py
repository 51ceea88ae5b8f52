"""The soak's faults: when each comes (:func:`fault_plan`), and the thread that injects them."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from testkit.service.soak_checks import Window
from testkit.service.soak_stack import Clock, Stack

if TYPE_CHECKING:
    from benchmarks.soak.options import Options


FAULTS = ("kill-model", "redis-cut", "kill-control", "pg-cut", "api-restart", "kill-dispatch",
          "upstream-cut")  # fmt: skip
UPSTREAM_FAULTS = ("kill-dispatch", "upstream-cut")
OUTAGES = ("redis-cut", "pg-cut")


@dataclass
class FaultEvent:
    kind: str
    planned_t: float
    start: float
    end: float
    detail: str


def fault_plan(opts: Options) -> list[tuple[float, str]]:
    """``(t, kind)``: ``opts.faults`` in order, once per round, spread evenly over the run
    after ``opts.fault_start``."""
    if not opts.faults:
        return []
    rounds = opts.fault_rounds or max(1, round(opts.duration / 600))
    span = (opts.duration - opts.fault_start) / rounds
    k = len(opts.faults)
    return [
        (opts.fault_start + r * span + span * (i + 0.5) / k, kind)
        for r in range(rounds)
        for i, kind in enumerate(opts.faults)
    ]


class Faults:
    """Injects ``plan`` (``(t, kind)``, t on ``clock``) in one thread, one fault at a time."""

    def __init__(self, opts: Options, plan: list[tuple[float, str]], stack: Stack,
                 proxies: dict[str, Any], clock: Clock):  # fmt: skip
        self.opts = opts
        self.stack = stack
        self.proxies = proxies
        self.clock = clock
        self.events: list[FaultEvent] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.plan = plan
        self.thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def windows(self) -> list[Window]:
        return [Window(e.kind, e.start, e.end) for e in self.events]

    def _run(self) -> None:
        for planned, kind in self.plan:
            if self.stop.wait(max(0.0, planned - self.clock())):
                return
            start = self.clock()
            try:
                detail = self._inject(kind)
            except Exception as error:
                detail = f"failed: {type(error).__name__}: {str(error)[:2000]}"
                self.errors.append(f"{kind} at {start:.0f}s: {detail}")
            self.events.append(FaultEvent(kind, planned, start, self.clock(), detail))
            print(f"[{start:7.1f}s] {kind}: {detail}", flush=True)

    def _inject(self, kind: str) -> str:
        opts = self.opts
        if kind in ("redis-cut", "pg-cut", "upstream-cut"):
            proxy = self.proxies[kind.removesuffix("-cut")]
            refused = proxy.refused
            proxy.cut()
            time.sleep(opts.outage_s)
            proxy.resume()
            return f"{opts.outage_s:g} s cut, {proxy.refused - refused} connections refused"
        name = {
            "kill-model": f"model-{opts.model_workers}",
            "kill-control": "control",
            "kill-dispatch": "dispatch-1",
            "api-restart": "api",
        }[kind]
        sig = signal.SIGTERM if kind == "api-restart" else signal.SIGKILL
        pid = self.stack.procs[name].pid
        took = self.stack.restart(name, sig, delay_s=opts.restart_delay_s, ready_timeout=300)
        return f"{name} (pid {pid}) {signal.Signals(sig).name}, ready again after {took:.1f} s"
