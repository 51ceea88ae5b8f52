"""``batchd tune``: the engine's operating point for a model, a workload and a KV memory budget.

The engine runs alone (no service). Each point of the sweep (``max_num_seqs``,
``max_num_batched_tokens``, ``block_size``) is one engine kept backlogged with the workload,
measured after a warm-up over a window from the engine's own counters; the adaptive search or a
grid picks the points, the best are measured again in turn and pooled, and the best point that
is not KV-bound wins. The search, the clock and the saturation marks: docs/measuring.md.
"""

from __future__ import annotations

import gc
import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cli.perf.workload import Workload

COMPUTE_GAIN = 0.10  # a doubling of the batch that adds less than this: compute saturated
TOKEN_BUDGETS = (256, 512, 1024, 2048, 4096, 8192)


@dataclass
class Point:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    seconds: float = 0.0  # the measured window, by ``clock``
    wall_s: float = 0.0
    steps: int = 0
    output_tokens: int = 0
    model_tokens: int = 0  # tokens run through the model (prompt chunks, decodes, recomputes)
    prompt_tokens: int = 0  # prompt tokens admitted
    finished: int = 0
    mean_running: float = 0.0
    mean_step_ms: float = 0.0
    preemptions: int = 0
    kv_blocks: int = 0
    kv_peak_used: float = 0.0  # the highest fraction of KV blocks in use in a step
    kv_bound: bool = False
    runs: int = 0  # measurements pooled into these figures (``Bench.confirm`` adds more)
    error: str | None = None

    @property
    def key(self) -> tuple[int, int, int]:
        return self.max_num_seqs, self.max_num_batched_tokens, self.block_size

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def total_tok_s(self) -> float:
        return self.model_tokens / self.seconds if self.seconds > 0 else 0.0

    def value(self, objective: str) -> float:
        return self.total_tok_s if objective == "total" else self.output_tok_s

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "output_tok_s": self.output_tok_s, "total_tok_s": self.total_tok_s}


@dataclass
class TuneResult:
    points: list[Point]
    chosen: Point | None
    options: dict[str, Any]  # the engine options to write (base options + the chosen point)
    saturation: dict[str, Any]
    clock: str
    objective: str
    wall_s: float
    settings: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "chosen": self.chosen.as_dict() if self.chosen else None,
            "engine_options": self.options,
            "saturation": self.saturation,
            "clock": self.clock,
            "objective": self.objective,
            "wall_s": self.wall_s,
            "settings": self.settings,
            "points": [p.as_dict() for p in self.points],
        }


def resolve_clock(clock: str, device: str) -> str:
    if clock != "auto":
        return clock
    import torch

    return "cpu" if device == "cpu" and torch.get_num_threads() == 1 else "wall"


class Bench:
    """Measures points on one model and workload (see the module docstring)."""

    def __init__(
        self,
        model_dir: str,
        shapes: Workload,
        base_options: dict[str, Any],
        *,
        warmup_s: float = 60.0,
        measure_s: float = 3.0,
        min_steps: int = 8,
        max_measure_s: float = 60.0,
        clock: str = "auto",
        log: Callable[[str], None] = lambda _m: None,
    ):
        self.max_measure_s = max_measure_s
        self.model_dir = model_dir
        self.shapes = shapes
        self.base = dict(base_options)
        self.warmup_s = warmup_s
        self.measure_s = measure_s
        self.min_steps = min_steps
        self.clock_name = clock
        self.log = log
        self.device = ""
        self.points: dict[tuple[int, int, int], Point] = {}
        self._next = 0
        self.order = spread_order(
            [len(p) + n for p, n in zip(shapes.prompts, shapes.max_tokens, strict=True)]
        )

    def _now(self) -> float:
        return time.process_time() if self.clock_name == "cpu" else time.perf_counter()

    def measure(self, max_num_seqs: int, max_num_batched_tokens: int, block_size: int) -> Point:
        key = (max_num_seqs, max_num_batched_tokens, block_size)
        if key in self.points:
            return self.points[key]
        point = Point(*key)
        try:
            self._run(point)
        except Exception as exc:  # an option the engine refuses (a budget below one sequence)
            point.error = f"{type(exc).__name__}: {exc}"
        gc.collect()
        self.points[key] = point
        self.log(_describe(point))
        return point

    def confirm(self, point: Point) -> Point:
        """Measure ``point`` once more and pool the windows (tokens and time summed): the
        best of many noisy single measurements is flattered by its own noise."""
        again = Point(*point.key)
        try:
            self._run(again)
        except Exception as exc:
            point.error = f"{type(exc).__name__}: {exc}"
            return point
        gc.collect()
        n = point.steps + again.steps
        for name in ("seconds", "wall_s", "output_tokens", "model_tokens", "prompt_tokens",
                     "finished", "preemptions", "runs"):  # fmt: skip
            setattr(point, name, getattr(point, name) + getattr(again, name))
        point.mean_running = (
            point.mean_running * point.steps + again.mean_running * again.steps
        ) / max(n, 1)
        point.steps = n
        point.mean_step_ms = 1000 * point.seconds / max(n, 1)
        point.kv_peak_used = max(point.kv_peak_used, again.kv_peak_used)
        point.kv_bound = point.kv_bound or again.kv_bound
        self.log(_describe(point) + f" (pooled over {point.runs} runs)")
        return point

    def _run(self, point: Point) -> None:
        from engine import Engine, SamplingParams

        options = {
            **self.base,
            "max_num_seqs": point.max_num_seqs,
            "max_num_batched_tokens": point.max_num_batched_tokens,
            "block_size": point.block_size,
        }
        engine = Engine(self.model_dir, **options)
        if not self.device:
            self.device = engine.runner.device.type
            self.clock_name = resolve_clock(self.clock_name, self.device)
        limit = engine.max_model_len
        bm = engine.block_manager
        point.kv_blocks = bm.num_blocks
        shapes = self.shapes
        finished = 0

        def feed() -> None:
            while len(engine.scheduler.waiting) < point.max_num_seqs:
                i = self.order[self._next % len(shapes)]
                self._next += 1
                prompt = shapes.prompts[i][: limit - 1]
                out = max(1, min(shapes.max_tokens[i], limit - len(prompt)))
                params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
                engine.add_request(f"t{self._next}", prompt, params)

        def step() -> None:
            nonlocal finished
            feed()
            finished += len(engine.step())

        # Warm-up: until half as many requests have finished as can run at once, so the
        # running batch holds requests of every age, as in steady state.
        started = time.perf_counter()
        while finished < max(1, point.max_num_seqs // 2) or engine.stats().num_steps < 3:
            step()
            if time.perf_counter() - started > self.warmup_s:
                break
        before = engine.stats()
        done0 = finished
        peak = 0
        t0, w0 = self._now(), time.perf_counter()
        while True:
            step()
            peak = max(peak, bm.num_used_blocks)
            elapsed = time.perf_counter() - w0
            if elapsed > self.max_measure_s or (
                elapsed >= self.measure_s
                and engine.stats().num_steps - before.num_steps >= self.min_steps
                and finished - done0 >= max(16, point.max_num_seqs // 2)
            ):
                break
        point.runs = 1
        point.seconds = self._now() - t0
        point.wall_s = time.perf_counter() - w0
        after = engine.stats()
        steps = after.num_steps - before.num_steps
        point.steps = steps
        point.output_tokens = after.total_output_tokens - before.total_output_tokens
        point.model_tokens = after.total_scheduled_tokens - before.total_scheduled_tokens
        point.prompt_tokens = after.total_prompt_tokens - before.total_prompt_tokens
        point.finished = finished - done0
        point.mean_running = (after.total_running_seq_steps - before.total_running_seq_steps) / (
            steps or 1
        )
        point.mean_step_ms = 1000 * point.seconds / steps  # by the same clock as throughput
        point.preemptions = after.num_preemptions - before.num_preemptions
        point.kv_peak_used = peak / bm.num_blocks if bm.num_blocks else 0.0
        point.kv_bound = point.preemptions > 0 or (
            point.kv_peak_used >= 0.9 and point.mean_running < 0.95 * point.max_num_seqs
        )


def spread_order(sizes: list[int]) -> list[int]:
    """The indices of ``sizes`` in an order where any run of consecutive ones is spread over
    the whole distribution (the k-th pick is at quantile frac(k * golden ratio)), so a short
    window admits a mix of requests close to the workload's own."""
    by_size = sorted(range(len(sizes)), key=lambda i: sizes[i])
    phi = (math.sqrt(5) - 1) / 2
    ranks = sorted(range(len(sizes)), key=lambda k: (k * phi) % 1.0)
    order = [0] * len(sizes)
    for rank, k in enumerate(ranks):
        order[k] = by_size[rank]
    return order


def _describe(p: Point) -> str:
    if p.error:
        return (
            f"  seqs {p.max_num_seqs:>4} tokens {p.max_num_batched_tokens:>5} block "
            f"{p.block_size:>3}: {p.error}"
        )
    return (
        f"  seqs {p.max_num_seqs:>4} tokens {p.max_num_batched_tokens:>5} block {p.block_size:>3}:"
        f" running {p.mean_running:6.1f}, step {p.mean_step_ms:7.1f} ms, "
        f"{p.output_tok_s:7.1f} out tok/s, {p.total_tok_s:7.1f} tok/s, KV peak "
        f"{100 * p.kv_peak_used:3.0f}%, {p.preemptions} preemptions"
        f"{' (KV-bound)' if p.kv_bound else ''}"
    )


def _pow2_up_to(cap: int) -> list[int]:
    out, n = [], 1
    while n <= cap:
        out.append(n)
        n *= 2
    return out


def best(points: Iterable[Point], objective: str, max_step_ms: float | None = None) -> Point | None:
    """The highest throughput among the points that ran (within ``max_step_ms``), leaving out
    KV-bound ones while any other ran: a point that preempts recomputes work, and its
    throughput swings with the mix of requests it happens to evict."""
    ok = [
        p
        for p in points
        if p.error is None
        and p.steps > 0
        and (max_step_ms is None or p.mean_step_ms <= max_step_ms)
    ]
    ok = [p for p in ok if not p.kv_bound] or ok
    return max(ok, key=lambda p: p.value(objective), default=None)


def adaptive(
    bench: Bench,
    *,
    base_tokens: int,
    block_sizes: list[int],
    max_seqs: int,
    token_budgets: Iterable[int],
    objective: str,
    max_step_ms: float | None,
) -> None:
    block = block_sizes[0]
    # 1. max_num_seqs, doubling.
    curve: list[Point] = []
    falls = flat = 0
    for seqs in _pow2_up_to(max_seqs):
        p = bench.measure(seqs, base_tokens, block)
        if p.error:
            break
        if curve:
            top = best(curve, objective)
            falls = falls + 1 if top and p.value(objective) < top.value(objective) else 0
            gain = p.value(objective) / max(curve[-1].value(objective), 1e-9) - 1
            flat = flat + 1 if gain < COMPUTE_GAIN else 0
            stalled = p.mean_running < 1.1 * curve[-1].mean_running
            curve.append(p)
            if (p.kv_bound and stalled) or falls >= 2 or flat >= 2:
                break
        else:
            curve.append(p)
    top = best(curve, objective, max_step_ms) or best(curve, objective)
    if top is None:
        return
    # 2. The geometric midpoints around the best.
    for seqs in (round(top.max_num_seqs / math.sqrt(2)), round(top.max_num_seqs * math.sqrt(2))):
        if 1 <= seqs <= max_seqs:
            bench.measure(seqs, base_tokens, block)
    top = best(bench.points.values(), objective, max_step_ms) or top
    # 3. The token budget at that max_num_seqs: halve and double, then go on in the
    # direction that gained while it gains.
    budgets = sorted(set(token_budgets) | {base_tokens})
    at = budgets.index(base_tokens)
    seqs = top.max_num_seqs
    for direction in (-1, 1):
        i, last = at + direction, top
        while 0 <= i < len(budgets):
            p = bench.measure(seqs, budgets[i], block)
            if p.error or p.value(objective) <= last.value(objective):
                break
            last, i = p, i + direction
    top = best(bench.points.values(), objective, max_step_ms) or top
    # 4. Other block sizes at the best point.
    for other in block_sizes[1:]:
        bench.measure(top.max_num_seqs, top.max_num_batched_tokens, other)


def grid(bench: Bench, seqs: list[int], tokens: list[int], block_sizes: list[int]) -> None:
    for block in block_sizes:
        for t in tokens:
            for s in seqs:
                bench.measure(s, t, block)


def saturation(points: list[Point], objective: str, tokens: int, block: int) -> dict[str, Any]:
    """Where KV memory and compute saturate along the ``max_num_seqs`` curve at one token
    budget and block size (see the module docstring)."""
    curve = sorted(
        (
            p
            for p in points
            if p.error is None
            and p.steps
            and p.max_num_batched_tokens == tokens
            and p.block_size == block
        ),
        key=lambda p: p.max_num_seqs,
    )
    kv = next((p for p in curve if p.kv_bound), None)
    compute = None
    for p in curve:
        if p.kv_bound:
            break
        later = [q for q in curve if q.mean_running >= 1.9 * p.mean_running and not q.kv_bound]
        if later and later[0].value(objective) < (1 + COMPUTE_GAIN) * p.value(objective):
            compute = p
            break
    return {
        "max_num_batched_tokens": tokens,
        "block_size": block,
        "kv_memory": None
        if kv is None
        else {"max_num_seqs": kv.max_num_seqs, "running": kv.mean_running},
        "compute": None
        if compute is None
        else {"max_num_seqs": compute.max_num_seqs, "running": compute.mean_running},
    }


def plot(result: TuneResult, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sat = result.saturation
    objective = result.objective
    label = "output tokens/s" if objective == "output" else "tokens/s (prompt + output)"
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7.5), sharex=True)
    groups: dict[tuple[int, int], list[Point]] = {}
    for p in result.points:
        if p.error is None and p.steps:
            groups.setdefault((p.max_num_batched_tokens, p.block_size), []).append(p)
    main = (sat["max_num_batched_tokens"], sat["block_size"])
    for (tokens, block), pts in sorted(groups.items()):
        pts.sort(key=lambda p: p.mean_running)
        xs = [p.mean_running for p in pts]
        style = "o-" if (tokens, block) == main else "x:"
        name = f"max_num_batched_tokens {tokens}" + (f", block {block}" if block != 16 else "")
        ax1.plot(xs, [p.value(objective) for p in pts], style, label=name, alpha=0.9)
        ax2.plot(xs, [p.mean_step_ms for p in pts], style, label=name, alpha=0.9)
    chosen = result.chosen
    if chosen is not None:
        ax1.plot(
            [chosen.mean_running], [chosen.value(objective)], "r*", markersize=16,
            label=f"chosen: max_num_seqs {chosen.max_num_seqs}, "
            f"max_num_batched_tokens {chosen.max_num_batched_tokens}",
        )  # fmt: skip
    for name, color in (("kv_memory", "tab:red"), ("compute", "tab:green")):
        mark = sat.get(name)
        if mark:
            text = "KV memory saturates" if name == "kv_memory" else "compute saturates"
            for ax in (ax1, ax2):
                ax.axvline(mark["running"], color=color, linestyle="--", alpha=0.7)
            ax1.annotate(
                f"{text}\n(max_num_seqs {mark['max_num_seqs']})",
                (mark["running"], ax1.get_ylim()[0]),
                xytext=(4, 8), textcoords="offset points", color=color, fontsize=8,
            )  # fmt: skip
    ax1.set_xscale("log", base=2)
    ax1.set_ylabel(label)
    ax2.set_ylabel("mean step time (ms)")
    ax2.set_xlabel("running batch size (mean sequences per step)")
    ax1.set_title(title, fontsize=10)
    ax1.grid(True, alpha=0.3)
    ax2.grid(True, alpha=0.3)
    ax1.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(
    model_dir: str,
    shapes: Workload,
    base_options: dict[str, Any],
    *,
    seqs: list[int] | None = None,
    tokens: list[int] | None = None,
    block_sizes: list[int] | None = None,
    max_seqs: int = 256,
    objective: str = "output",
    max_step_ms: float | None = None,
    warmup_s: float = 60.0,
    measure_s: float = 3.0,
    min_steps: int = 8,
    clock: str = "auto",
    confirm: int = 3,
    confirm_runs: int = 3,
    log: Callable[[str], None] = lambda _m: None,
) -> TuneResult:
    start = time.perf_counter()
    base = {
        k: v
        for k, v in base_options.items()
        if k not in ("max_num_seqs", "max_num_batched_tokens", "block_size")
    }
    base_tokens = int(base_options.get("max_num_batched_tokens", 2048))
    blocks = block_sizes or [int(base_options.get("block_size", 16))]
    bench = Bench(
        model_dir, shapes, base, warmup_s=warmup_s, measure_s=measure_s, min_steps=min_steps,
        clock=clock, log=log,
    )  # fmt: skip
    if seqs or tokens:
        grid(bench, seqs or _pow2_up_to(max_seqs), tokens or [base_tokens], blocks)
    else:
        budgets = [t for t in TOKEN_BUDGETS if t != base_tokens]
        adaptive(
            bench, base_tokens=base_tokens, block_sizes=blocks, max_seqs=max_seqs,
            token_budgets=budgets, objective=objective, max_step_ms=max_step_ms,
        )  # fmt: skip
    points = list(bench.points.values())
    eligible = [p for p in points if p.error is None and p.steps]
    if max_step_ms is not None:
        eligible = [p for p in eligible if p.mean_step_ms <= max_step_ms] or eligible
    eligible = [p for p in eligible if not p.kv_bound] or eligible
    top = sorted(eligible, key=lambda p: p.value(objective), reverse=True)[:confirm]
    if len(top) > 1:
        times = "again" if confirm_runs == 1 else f"{confirm_runs} more times, in turn"
        log(f"measuring the {len(top)} best points {times}:")
        for _ in range(confirm_runs):
            for p in top:
                bench.confirm(p)
    chosen = best(points, objective, max_step_ms)
    options = dict(base)
    if chosen is not None:
        options.update(
            max_num_seqs=chosen.max_num_seqs,
            max_num_batched_tokens=chosen.max_num_batched_tokens,
            block_size=chosen.block_size,
        )
    curve_tokens = chosen.max_num_batched_tokens if chosen else base_tokens
    curve_block = chosen.block_size if chosen else blocks[0]
    if seqs is None and tokens is None:
        curve_tokens = base_tokens  # the doubling curve ran at the base budget
        if chosen is not None and chosen.block_size != curve_block:
            curve_block = blocks[0]
    return TuneResult(
        points=points,
        chosen=chosen,
        options=options,
        saturation=saturation(points, objective, curve_tokens, curve_block),
        clock=bench.clock_name,
        objective=objective,
        wall_s=time.perf_counter() - start,
        settings={
            "model": model_dir,
            "workload": shapes.source,
            "requests": len(shapes),
            "mean_prompt_tokens": shapes.mean_prompt,
            "mean_output_tokens": shapes.mean_output,
            "base_options": base,
            "device": bench.device,
            "warmup_s": warmup_s,
            "measure_s": measure_s,
            "min_steps": min_steps,
            "max_step_ms": max_step_ms,
            "confirm": confirm,
        },
    )


def write(result: TuneResult, out_dir: Path, options_path: Path, title: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    options_path.parent.mkdir(parents=True, exist_ok=True)
    options_path.write_text(json.dumps(result.options, indent=2) + "\n")
    report = out_dir / "tune.json"
    report.write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    png = out_dir / "tune.png"
    plot(result, png, title)
    return {"options": options_path, "report": report, "plot": png}
