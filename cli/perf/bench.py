"""``batchd bench``: the service measured as production runs it.

Jobs (batches) arrive over time (Poisson or a schedule file), each with a tenant and a
priority, their requests from a real JSONL file or named length distributions
(``cli.perf.workload``). Each job runs in its own client thread (upload, create, poll,
download); a sampler reads the model workers' ``engine_stats`` and every service process's
memory, and the workers hand over per-request timings at the end. Every distribution is
reported with n, mean, p50, p90, p99 and max: the metrics in docs/measuring.md.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cli.perf.service import Ticker, WorkerProbe, memory_kb
from cli.perf.workload import (
    COMPLETIONS_URL,
    DEFAULT_INPUT_LEN,
    DEFAULT_OUTPUT_LEN,
    LengthDist,
    completion_lines,
    iter_request_bodies,
    sampled_lines,
    synthetic_workload,
)
from cli.procfs import children

TERMINAL = {"completed", "failed", "expired", "cancelled"}
_NO_LIMIT = 1 << 30  # a synthetic job's lengths are not clamped to a context
DISTRIBUTIONS = (
    "ttft_s",
    "itl_s",
    "request_e2e_s",
    "job_e2e_s",
    "batch_queue_s",
    "shard_queue_s",
    "input_tok_s",
    "output_tok_s",
    "engine_occupancy",
)


# --------------------------------------------------------------------------- statistics


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summary(values: list[float]) -> dict[str, Any]:
    v = sorted(x for x in values if x is not None and not math.isnan(x))
    if not v:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {
        "n": len(v),
        "mean": sum(v) / len(v),
        "p50": percentile(v, 0.50),
        "p90": percentile(v, 0.90),
        "p99": percentile(v, 0.99),
        "max": v[-1],
    }


# --------------------------------------------------------------------------- workload


@dataclass
class Job:
    index: int
    at: float  # seconds after the start
    tenant: str
    priority: str
    lines: list[dict[str, Any]]

    @property
    def endpoint(self) -> str:
        return self.lines[0].get("url", COMPLETIONS_URL)


def _weighted(spec: str) -> list[tuple[str, float]]:
    """``a:3,b:1`` (or ``a,b``, equal weights)."""
    out = []
    for part in spec.split(","):
        if part.strip():
            name, _, weight = part.strip().partition(":")
            out.append((name, float(weight) if weight else 1.0))
    if not out:
        raise ValueError(f"empty list {spec!r}")
    return out


def _pick(rng: random.Random, choices: list[tuple[str, float]]) -> str:
    return rng.choices([c for c, _ in choices], weights=[w for _, w in choices])[0]


# (rng, n, custom_id prefix) -> n request lines of one job
LineMaker = Callable[[random.Random, int, str], list[dict[str, Any]]]


def job_lines(
    model: str,
    *,
    workload: Path | None = None,
    input_len: str = DEFAULT_INPUT_LEN,
    output_len: str = DEFAULT_OUTPUT_LEN,
    vocab: tuple[int, int] = (100, 1000),
) -> tuple[LineMaker, str]:
    """How a job's request lines are made, and that in a few words: drawn from a real batch
    file's lines, or ``/v1/completions`` lines of a synthetic workload (token-id prompts from
    ``vocab``, lengths from the two distributions)."""
    if workload is not None:
        rows = iter_request_bodies(workload)
        return (lambda rng, n, prefix: sampled_lines(rows, rng, n, model, prefix)), str(workload)
    inputs, outputs = LengthDist.parse(input_len), LengthDist.parse(output_len)

    def synthetic(rng: random.Random, n: int, prefix: str) -> list[dict[str, Any]]:
        drawn = synthetic_workload(
            num_requests=n,
            input_len=inputs,
            output_len=outputs,
            vocab=range(*vocab),
            max_model_len=_NO_LIMIT,
            seed=rng.getrandbits(32),
        )
        return completion_lines(drawn, model, prefix)

    return synthetic, f"input {input_len}, output {output_len}"


def poisson_jobs(
    make_lines: LineMaker,
    *,
    jobs: int,
    rate: float,
    requests: str,
    tenants: str,
    priorities: str,
    seed: int,
) -> list[Job]:
    rng = random.Random(seed)
    sizes = LengthDist.parse(requests)
    tenant_w, prio_w = _weighted(tenants), _weighted(priorities)
    t = 0.0
    out = []
    for i in range(jobs):
        if i:
            t += rng.expovariate(rate) if rate > 0 else 0.0
        n = sizes.sample(rng)
        out.append(
            Job(i, t, _pick(rng, tenant_w), _pick(rng, prio_w), make_lines(rng, n, f"job{i}-"))
        )
    return out


def schedule_jobs(make_lines: LineMaker, path: Path, *, seed: int) -> list[Job]:
    """A JSONL schedule: one job a line, ``{"at": seconds, "requests": n, "tenant": …,
    "priority": …}`` (tenant ``default``, priority ``normal`` unless given)."""
    rng = random.Random(seed)
    out = []
    for i, row in enumerate(iter_request_bodies(path)):
        try:
            at, n = float(row["at"]), int(row["requests"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: line {i + 1} needs 'at' (seconds) and 'requests'") from None
        tenant, priority = str(row.get("tenant", "default")), str(row.get("priority", "normal"))
        out.append(Job(i, at, tenant, priority, make_lines(rng, n, f"job{i}-")))
    return sorted(out, key=lambda j: j.at)


# --------------------------------------------------------------------------- running


@dataclass
class JobRun:
    job: Job
    arrival: float = 0.0  # time.time() the upload started
    created: float | None = None
    ended: float | None = None
    downloaded: float | None = None
    batch_id: str | None = None
    status: str = "not started"
    rejected: str | None = None  # why the API refused it (status code and code)
    request_counts: dict[str, int] = field(default_factory=dict)
    usage: dict[str, int] = field(default_factory=dict)
    output_lines: int = 0
    error_codes: Counter = field(default_factory=Counter)
    error: str | None = None


def run_job(client_for: Any, run: JobRun, root: Path, start: float, poll_s: float) -> None:
    from cli.client import APIError, ClientError

    job = run.job
    delay = start + job.at - time.time()
    if delay > 0:
        time.sleep(delay)
    path = root / f"job{job.index}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in job.lines))
    client = client_for(job.tenant)
    run.arrival = time.time()
    try:
        uploaded = client.upload_file(path)
        batch = client.create_batch(
            uploaded["id"], endpoint=job.endpoint, completion_window="24h",
            priority=job.priority, metadata={"bench_job": str(job.index)},
        )  # fmt: skip
        run.created = time.time()
        run.batch_id = batch["id"]
        while batch["status"] not in TERMINAL:
            time.sleep(poll_s)
            batch = client.get_batch(batch["id"])
        run.ended = time.time()
        run.status = batch["status"]
        run.request_counts = dict(batch.get("request_counts") or {})
        run.usage = dict(batch.get("usage") or {})
        if run.status == "failed":
            errors = (batch.get("errors") or {}).get("data") or []
            codes = {e.get("code") for e in errors}
            run.rejected = f"validation failed: {', '.join(sorted(c or '?' for c in codes))}"
        for key, counter in (("output_file_id", None), ("error_file_id", run.error_codes)):
            if batch.get(key):
                dest = root / f"job{job.index}.{key}.jsonl"
                client.download_file(batch[key], dest)
                for line in dest.read_text().splitlines():
                    if not line.strip():
                        continue
                    if counter is None:
                        run.output_lines += 1
                    else:
                        record = json.loads(line)
                        error = record.get("error") or (
                            ((record.get("response") or {}).get("body") or {}).get("error") or {}
                        )
                        counter[error.get("code") or "unknown"] += 1
        run.downloaded = time.time()
    except APIError as exc:
        run.status = "rejected"
        run.rejected = f"HTTP {exc.status_code} {exc.code or ''}".strip()
        run.ended = run.downloaded = time.time()
    except ClientError as exc:
        run.status = "error"
        run.error = exc.message
        run.ended = run.downloaded = time.time()


@dataclass
class Sample:
    t: float
    workers: dict[str, Any]
    rss_kb: dict[str, int]


class ServiceSampler:
    """Samples the service while a bench runs: the model workers' ``engine_stats`` and the RSS
    of every service process (and its children), at ``interval``."""

    def __init__(self, probe: WorkerProbe | None, pids: dict[str, int], interval: float):
        self.probe = probe
        self.pids = dict(pids)
        self.interval = interval
        self.samples: list[Sample] = []
        self.peak_kb: dict[str, int] = {}
        self.unanswered = 0
        self._ticker = Ticker(self.sample, interval, name="batchd-bench-sampler")

    def read_memory(self) -> dict[str, int]:
        rss: dict[str, int] = {}
        for name, pid in self.pids.items():
            total = 0
            for p in [pid, *children(pid)]:
                mem = memory_kb(p)
                if mem is not None:
                    total += mem[0]
                    key = name if p == pid else f"{name}.child"
                    self.peak_kb[key] = max(self.peak_kb.get(key, 0), mem[1])
            if total:
                rss[name] = total
        return rss

    def sample(self) -> None:
        workers: dict[str, Any] = {}
        if self.probe is not None:
            try:
                workers = self.probe.engine_stats()
            except Exception:
                workers = {}
            if not workers:
                self.unanswered += 1
            for name, answer in workers.items():  # a model worker found on this machine
                pid = answer.get("pid")
                known = name in self.pids or pid in self.pids.values()
                if isinstance(pid, int) and not known and memory_kb(pid):
                    self.pids[name] = pid
        self.samples.append(Sample(time.time(), workers, self.read_memory()))

    def start(self) -> None:
        self._ticker.start()

    def stop(self) -> None:
        self._ticker.stop(30)


# --------------------------------------------------------------------------- the report


def _engine_series(samples: list[Sample]) -> dict[str, list[tuple[float, float]]]:
    """Per sampling interval with work, summed over the engines: input and output tokens/s
    and occupancy, as (time, value)."""
    out: dict[str, list[tuple[float, float]]] = {
        "input_tok_s": [],
        "output_tok_s": [],
        "engine_occupancy": [],
    }
    for prev, cur in zip(samples, samples[1:], strict=False):
        prompt = output = seq_steps = steps = capacity = 0.0
        busy = False
        for worker, answer in cur.workers.items():
            before = prev.workers.get(worker)
            if before is None:
                continue
            dt = (answer.get("time") or 0) - (before.get("time") or 0)
            for model, s in (answer.get("models") or {}).items():
                b = (before.get("models") or {}).get(model)
                if not b or "num_steps" not in s or "num_steps" not in b or dt <= 0:
                    continue
                d_steps = s["num_steps"] - b["num_steps"]
                if d_steps <= 0:
                    continue
                busy = True
                prompt += (s["total_prompt_tokens"] - b["total_prompt_tokens"]) / dt
                output += (s["total_output_tokens"] - b["total_output_tokens"]) / dt
                seq_steps += s["total_running_seq_steps"] - b["total_running_seq_steps"]
                steps += d_steps
                capacity += d_steps * s.get("max_num_seqs", 1)
        if busy:
            out["input_tok_s"].append((cur.t, prompt))
            out["output_tok_s"].append((cur.t, output))
            out["engine_occupancy"].append((cur.t, seq_steps / capacity if capacity else 0.0))
    return out


def report(
    runs: list[JobRun],
    timings: list[dict[str, Any]],
    sampler: ServiceSampler,
    *,
    start: float,
    end: float,
    settings: dict[str, Any],
) -> dict[str, Any]:
    by_batch = {r.batch_id: r for r in runs if r.batch_id}
    ttft, itl, req_e2e = [], [], []
    first_by_batch: dict[str, float] = {}
    first_by_shard: dict[tuple[str, int], float] = {}
    for rec in timings:
        run = by_batch.get(rec["batch_id"])
        if run is None:
            continue
        sub, first, fin = rec.get("submitted"), rec.get("first_token"), rec.get("finished")
        if sub is not None and first is not None:
            ttft.append(first - sub)
        if first is not None and fin is not None and rec["output_tokens"] > 1:
            itl.append((fin - first) / (rec["output_tokens"] - 1))
        if fin is not None:
            req_e2e.append(fin - run.arrival)
        if sub is not None:
            b = rec["batch_id"]
            first_by_batch[b] = min(first_by_batch.get(b, sub), sub)
            key = (b, rec["shard"])
            first_by_shard[key] = min(first_by_shard.get(key, sub), sub)
    batch_queue = [
        t - created for b, t in first_by_batch.items() if (created := by_batch[b].created)
    ]
    shard_queue = [
        t - created for (b, _), t in first_by_shard.items() if (created := by_batch[b].created)
    ]
    job_e2e = [r.downloaded - r.arrival for r in runs if r.downloaded and r.status in TERMINAL]
    series = _engine_series(sampler.samples)
    distributions = {
        "ttft_s": summary(ttft),
        "itl_s": summary(itl),
        "request_e2e_s": summary(req_e2e),
        "job_e2e_s": summary(job_e2e),
        "batch_queue_s": summary(batch_queue),
        "shard_queue_s": summary(shard_queue),
        **{name: summary([v for _, v in values]) for name, values in series.items()},
    }
    rss_names = sorted({n for s in sampler.samples for n in s.rss_kb})
    rss = {
        name: summary([s.rss_kb[name] / 1024 for s in sampler.samples if name in s.rss_kb])
        for name in rss_names
    }
    submitted = sum(len(r.job.lines) for r in runs)
    rejected_jobs = [r for r in runs if r.rejected]
    error_codes: Counter = Counter()
    for r in runs:
        error_codes.update(r.error_codes)
    completed = sum(r.output_lines for r in runs)
    failed = sum(r.error_codes.total() for r in runs)
    rejected = sum(len(r.job.lines) for r in rejected_jobs)
    input_tokens = sum(int(r.usage.get("input_tokens", 0)) for r in runs)
    output_tokens = sum(int(r.usage.get("output_tokens", 0)) for r in runs)
    wall = max(end - start, 1e-9)
    return {
        "settings": settings,
        "wall_s": wall,
        "distributions": distributions,
        "rss_mb": rss,
        "peak_rss_mb": {k: v / 1024 for k, v in sorted(sampler.peak_kb.items())},
        "counts": {
            "jobs": {
                "submitted": len(runs),
                "completed": sum(1 for r in runs if r.status == "completed"),
                "rejected": len(rejected_jobs),
                "other": dict(
                    Counter(r.status for r in runs if r.status != "completed" and not r.rejected)
                ),
            },
            "requests": {
                "submitted": submitted,
                "completed": completed,
                "failed": failed,
                "rejected": rejected,
                "unaccounted": submitted - completed - failed - rejected,
                "error_codes": dict(error_codes),
            },
            "timing_records": sum(1 for t in timings if t["batch_id"] in by_batch),
            "engine_samples": len(sampler.samples),
            "engine_samples_unanswered": sampler.unanswered,
        },
        "totals": {
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "input_tok_s": input_tokens / wall,
            "output_tok_s": output_tokens / wall,
        },
        "jobs": [
            {
                "index": r.job.index,
                "at": r.job.at,
                "tenant": r.job.tenant,
                "priority": r.job.priority,
                "requests": len(r.job.lines),
                "batch_id": r.batch_id,
                "status": r.status,
                "rejected": r.rejected,
                "error": r.error,
                "e2e_s": (r.downloaded - r.arrival) if r.downloaded else None,
                "request_counts": r.request_counts,
            }
            for r in runs
        ],
        "series": {name: [[t - start, v] for t, v in values] for name, values in series.items()},
        "rss_series_mb": {
            name: [
                [s.t - start, s.rss_kb[name] / 1024] for s in sampler.samples if name in s.rss_kb
            ]
            for name in rss_names
        },
        "latency_samples": {"ttft_s": ttft, "itl_s": itl, "request_e2e_s": req_e2e},
    }


def run_workload(
    jobs: list[Job],
    *,
    base_url: str,
    keys: dict[str, str],
    probe: WorkerProbe | None,
    pids: dict[str, int],
    work: Path,
    interval: float = 0.5,
    poll_s: float = 0.5,
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from cli.client import BatchdClient

    clients: dict[str, BatchdClient] = {}
    lock = threading.Lock()

    def client_for(tenant: str) -> BatchdClient:
        with lock:
            if tenant not in clients:
                key = keys.get(tenant) or keys.get("*")
                clients[tenant] = BatchdClient(base_url, key, timeout=120)
            return clients[tenant]

    runs = [JobRun(job) for job in jobs]
    sampler = ServiceSampler(probe, pids, interval)
    sampler.start()
    start = time.time()
    threads = [
        threading.Thread(target=run_job, args=(client_for, r, work, start, poll_s), daemon=True)
        for r in runs
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end = time.time()
    time.sleep(interval)  # one more sample after the last job
    sampler.stop()
    batch_ids = [r.batch_id for r in runs if r.batch_id]
    timings = probe.request_timings(batch_ids) if probe is not None and batch_ids else []
    for c in clients.values():
        c.close()
    return report(runs, timings, sampler, start=start, end=end, settings=settings or {})
