"""The whole service against the engine alone, on the same batch file, side by side in one run.

One seeded JSONL batch (``--requests`` chat requests, greedy, prompt length and ``max_tokens``
drawn from seeded log-normal distributions) is run two ways:

1. **engine alone**, in this process: ``LLM(model, **engine options)`` with the worker's engine
   options, the prompts tokenized by the worker's own conversion (``core.llms.generation``: chat
   template, context checks, ``SamplingParams``), one ``generate()`` call. Wall clock of that
   call; output tokens counted from its outputs.
2. **the service**: a fresh Postgres database, a private Redis, the API (uvicorn), a control
   worker, a model worker (threads pool, ``BATCHD_WORKER_SHARD_CONCURRENCY`` shard threads)
   and beat as subprocesses. Upload with the ``openai`` client, create, poll, download, parse.
   Timed from the upload's start to the output downloaded (end to end), and from the batch
   created to completed; output tokens summed from the results' ``usage``.

Both engines are warmed first (the model worker loads its model at start; the benchmark
waits for ``model … ready`` and runs a small warm-up batch through the service).

Engine occupancy of the service run comes from the model worker's ``engine_stats``
remote-control command (``worker.infra.runtime``), polled every ``--stats-interval`` seconds, and
the batch's shard rows in Postgres. Between two polls the engine's counters give the mean
number of running sequences per engine step exactly (Δ running-sequence-steps / Δ steps).
**Occupancy while backlogged** is Σ Δ running-sequence-steps / (Σ Δ steps × max_num_seqs)
over every poll interval that began, after the engine's first step for the batch, with work
waiting: requests in the engine's waiting queue or the host's queue, or shards of the batch
not yet claimed by a worker. The drain at the end (nothing waits; the last requests finish)
is left out. **Busy** is the fraction of those intervals' wall time the engine spent inside
``step()``; busy × occupancy is a time-weighted occupancy that also counts idle gaps.

    .venv/bin/python -m benchmarks.service                                  # 500 requests, llama-25m
    .venv/bin/python -m benchmarks.service --model-preset llama-tiny --requests 100
    .venv/bin/python -m benchmarks.service --json /tmp/bench.json

Targets: service/engine output throughput ≥ 0.85, occupancy while backlogged ≥ 0.90.
Needs Postgres (``--pg-admin-url``, trust auth) and Redis (a private ``redis-server`` when
installed, else a database index of ``--redis-url``), as the tests do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cli.perf.service import Ticker
from cli.perf.workload import CHAT_URL, LengthDist, chat_bodies, request_line
from testkit.service import stack as bs

ENDPOINT = CHAT_URL
THROUGHPUT_TARGET = 0.85
OCCUPANCY_TARGET = 0.90
# ---------------------------------------------------------------------------------------------
# The workload


def workload(n: int, seed: int, *, prompt_words: str, max_tokens: str) -> list[dict[str, Any]]:
    """``n`` chat request lines of filler words, prompt words and ``max_tokens`` drawn from the
    two length distributions (log-normal by default, so a few requests are several times
    longer than most): ``cli.perf.workload.chat_bodies``."""
    bodies = chat_bodies(
        n,
        LengthDist.parse(max_tokens),
        seed,
        words=LengthDist.parse(prompt_words),
        model=bs.MODEL,
    )
    return [
        request_line(f"req-{i}", {**body, "temperature": 0}, CHAT_URL)
        for i, body in enumerate(bodies)
    ]


def write_jsonl(path: Path, lines: list[dict[str, Any]]) -> None:
    with path.open("w") as fh:
        for line in lines:
            fh.write(json.dumps(line, separators=(",", ":")) + "\n")


# ---------------------------------------------------------------------------------------------
# 1. The engine alone


@dataclass
class EngineRun:
    seconds: float
    requests: int
    output_tokens: int
    errors: int
    occupancy: float  # running sequences / max_num_seqs, averaged over the run's steps
    steps: int
    step_seconds: float  # mean time inside Engine.step()
    tokens_by_id: dict[str, list[int]] = field(repr=False, default_factory=dict)
    runs: list[float] = field(default_factory=list)  # seconds of each run averaged here


def run_engine(path: Path, model_dir: Path, warmup: int) -> EngineRun:
    """The batch file through ``LLM`` in this process, converted exactly as a shard does."""
    from core.batchfile.reader import iter_lines, parse_request
    from core.llms import generation
    from core.settings import get_settings
    from engine import LLM, SamplingParams
    from worker.infra import runtime

    settings = get_settings()
    options = dict(settings.engine_options)
    for key in runtime.HOST_OPTIONS:
        options.pop(key, None)
    llm = LLM(str(model_dir), **options)
    tok = llm.tokenizer
    context = llm.engine.max_model_len
    ids_list, params_list, custom_ids = [], [], []
    errors = 0
    with path.open("rb") as fh:
        for raw in iter_lines(fh, max_line_bytes=settings.max_line_bytes):
            req = parse_request(raw, endpoint=ENDPOINT, served_models=None)
            try:
                ids, params = generation.prepare_request(
                    tok, req, context, len(tok), make_params=SamplingParams
                )
            except ValueError:
                errors += 1
                continue
            ids_list.append(ids)
            params_list.append(params)
            custom_ids.append(req.custom_id)
    if warmup:
        llm.generate(ids_list[:warmup], params_list[:warmup], use_tqdm=False)
    engine = llm.engine
    max_num_seqs = engine.config.max_num_seqs
    before = engine.stats()
    start = time.perf_counter()
    outputs = llm.generate(ids_list, params_list, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = engine.stats()
    steps = after.num_steps - before.num_steps
    seq_steps = after.total_running_seq_steps - before.total_running_seq_steps
    tokens_by_id = {}
    for cid, out in zip(custom_ids, outputs, strict=True):
        if out.error:
            errors += 1
            continue
        tokens_by_id[cid] = [t for c in out.outputs for t in c.token_ids]
    del llm, engine
    return EngineRun(
        seconds=seconds,
        requests=len(tokens_by_id),
        output_tokens=sum(len(t) for t in tokens_by_id.values()),
        errors=errors,
        occupancy=seq_steps / steps / max_num_seqs if steps else 0.0,
        steps=steps,
        step_seconds=(after.total_step_time_s - before.total_step_time_s) / steps if steps else 0.0,
        tokens_by_id=tokens_by_id,
    )


def _mean_runs(a: EngineRun, b: EngineRun) -> EngineRun:
    """One figure from the runs before and after the service (same work, mean time)."""
    print(f"engine alone: {a.seconds:.2f}s before the service, {b.seconds:.2f}s after")
    return EngineRun(
        seconds=(a.seconds + b.seconds) / 2,
        requests=a.requests,
        output_tokens=a.output_tokens,
        errors=a.errors,
        occupancy=a.occupancy,
        steps=a.steps,
        step_seconds=(a.step_seconds + b.step_seconds) / 2,
        tokens_by_id=a.tokens_by_id,
        runs=[a.seconds, b.seconds],
    )


# ---------------------------------------------------------------------------------------------
# 2. The service


@dataclass
class Sample:
    t: float  # when the worker took the snapshot (time.time() on this machine)
    stats: dict[str, Any]  # the model's HostStats.as_dict() (+ max_num_seqs)
    shards: dict[str, int]  # shard status -> count, for the batch


class EngineShardSampler:
    """Polls the model worker's engine stats and the batch's shard rows in a thread."""

    def __init__(self, broker_url: str, database_url: str, interval: float):
        self.probe = bs.EngineStatsProbe(broker_url)
        self.database_url = database_url
        self.interval = interval
        self.batch_id: str | None = None
        self.samples: list[Sample] = []
        self.failures = 0
        self._ticker = Ticker(self._sample, interval, name="bench-sampler")

    def start(self) -> EngineShardSampler:
        self._ticker.start()
        return self

    def stop(self) -> None:
        self._ticker.stop(30)
        self.probe.close()

    def once(self) -> tuple[float, dict[str, Any]] | None:
        answer = self.probe(timeout=3.0)
        stats = None if answer is None else answer.get("models", {}).get(bs.MODEL)
        return None if stats is None else (float(answer["time"]), stats)

    def _shards(self) -> dict[str, int]:
        if self.batch_id is None:
            return {}
        from sqlalchemy import func, select

        from core.database.sessions import session_scope
        from core.database.tables import Shard

        with session_scope(self.database_url) as session:
            rows = session.execute(
                select(Shard.status, func.count())
                .where(Shard.batch_id == self.batch_id)
                .group_by(Shard.status)
            ).all()
        return {status: count for status, count in rows}

    def _sample(self) -> None:
        try:
            shards = self._shards()
            answer = self.once()
        except Exception:
            answer = None
        if answer is None or "error" in answer[1]:
            self.failures += 1
        elif not self.samples or answer[0] > self.samples[-1].t:
            self.samples.append(Sample(answer[0], answer[1], shards))


@dataclass
class ServiceRun:
    e2e_seconds: float  # upload start -> output downloaded
    batch_seconds: float  # created -> completed (as polled)
    upload_seconds: float
    download_seconds: float
    requests: int
    output_tokens: int
    errors: int
    status: str
    shards: int
    tokens_by_id: dict[str, int] = field(repr=False, default_factory=dict)


def run_service(client: Any, path: Path, sampler: EngineShardSampler, poll: float) -> ServiceRun:
    start = time.monotonic()
    batch, upload_done = bs.upload_and_create(client, path, ENDPOINT)
    created = time.monotonic()
    sampler.batch_id = batch.id
    while batch.status not in bs.TERMINAL:
        time.sleep(poll)
        batch = client.batches.retrieve(batch.id)
    completed = time.monotonic()
    text = client.files.content(batch.output_file_id).text if batch.output_file_id else ""
    errors_text = client.files.content(batch.error_file_id).text if batch.error_file_id else ""
    downloaded = time.monotonic()
    tokens = 0
    tokens_by_id: dict[str, int] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        body = record["response"]["body"]
        tokens += int(body["usage"]["completion_tokens"])
        tokens_by_id[record["custom_id"]] = int(body["usage"]["completion_tokens"])
    shards = sum(sampler._shards().values())
    return ServiceRun(
        e2e_seconds=downloaded - start,
        batch_seconds=completed - created,
        upload_seconds=upload_done - start,
        download_seconds=downloaded - completed,
        requests=len(tokens_by_id),
        output_tokens=tokens,
        errors=sum(1 for ln in errors_text.splitlines() if ln.strip()),
        status=batch.status,
        shards=shards,
        tokens_by_id=tokens_by_id,
    )


def occupancy(samples: list[Sample]) -> dict[str, Any]:
    """Occupancy while backlogged, busy fraction, and the whole run's figures (see the
    module docstring for the definitions)."""
    if len(samples) < 2:
        return {"samples": len(samples)}
    base_steps = samples[0].stats["num_steps"]
    max_num_seqs = samples[0].stats["max_num_seqs"]
    steps = seq_steps = 0
    busy = wall = 0.0
    all_steps = all_seq_steps = 0
    all_busy = all_wall = 0.0
    first = last = None
    peak_waiting = peak_pending = 0
    for prev, cur in zip(samples, samples[1:], strict=False):
        d_steps = cur.stats["num_steps"] - prev.stats["num_steps"]
        d_seq = cur.stats["total_running_seq_steps"] - prev.stats["total_running_seq_steps"]
        d_busy = cur.stats["total_step_time_s"] - prev.stats["total_step_time_s"]
        d_wall = cur.t - prev.t
        started = prev.stats["num_steps"] > base_steps
        if started:
            all_steps += d_steps
            all_seq_steps += d_seq
            all_busy += d_busy
            all_wall += d_wall
        waiting = prev.stats["num_waiting"] + prev.stats["pending"]
        backlog = waiting > 0 or prev.shards.get("pending", 0) > 0
        peak_waiting = max(peak_waiting, prev.stats["num_waiting"])
        peak_pending = max(peak_pending, prev.stats["pending"])
        if started and backlog:
            steps += d_steps
            seq_steps += d_seq
            busy += d_busy
            wall += d_wall
            first = prev.t if first is None else first
            last = cur.t
    occ = seq_steps / steps / max_num_seqs if steps else 0.0
    busy_frac = min(1.0, busy / wall) if wall else 0.0
    return {
        "samples": len(samples),
        "max_num_seqs": max_num_seqs,
        "backlogged_s": (last - first) if first is not None else 0.0,
        "backlogged_steps": steps,
        "occupancy_backlogged": occ,
        "busy_backlogged": busy_frac,
        "time_weighted_occupancy_backlogged": occ * busy_frac,
        "occupancy_whole_run": all_seq_steps / all_steps / max_num_seqs if all_steps else 0.0,
        "busy_whole_run": min(1.0, all_busy / all_wall) if all_wall else 0.0,
        "steps_whole_run": all_steps,
        "mean_step_s_whole_run": all_busy / all_steps if all_steps else 0.0,
        "peak_engine_waiting": peak_waiting,
        "peak_host_pending": peak_pending,
        "max_pending": samples[-1].stats.get("max_pending"),
        "max_in_flight": samples[-1].stats.get("max_in_flight"),
    }


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prompt-words", default="lognormal:40:0.7", help="prompt words, a length distribution"
    )
    p.add_argument(
        "--max-tokens", default="lognormal:40:0.7", help="max_tokens, a length distribution"
    )
    p.add_argument("--model-preset", default="llama-25m", help="a demo model preset")
    p.add_argument("--model", help="a local HF model directory (instead of a preset)")
    p.add_argument("--engine-options", default="{}", help="BATCHD_ENGINE_OPTIONS (JSON)")
    p.add_argument("--shard-requests", type=int, default=100, help="BATCHD_SHARD_MAX_REQUESTS")
    p.add_argument("--concurrency", type=int, help="BATCHD_WORKER_SHARD_CONCURRENCY")
    p.add_argument("--stats-interval", type=float, default=0.25, help="engine stats polling s")
    p.add_argument("--poll", type=float, default=0.25, help="batch status polling s")
    p.add_argument("--warmup", type=int, default=8, help="warm-up requests for each side")
    p.add_argument(
        "--engine-after",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine alone again after the service and use the mean of both times",
    )
    p.add_argument("--pg-admin-url", default=bs.PG_ADMIN_URL)
    p.add_argument("--redis-url", default=bs.REDIS_URL, help="without redis-server only")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    return p.parse_args(argv)


@dataclass
class Measured:
    """One run of the benchmark: the engine alone and the service on the same workload."""

    spec: str  # the model
    engine_options: dict[str, Any]
    settings: Any  # core.settings.Settings of the service
    eng: EngineRun
    svc: ServiceRun
    occ: dict[str, Any]  # occupancy()
    stats_unanswered: int

    @property
    def same_counts(self) -> int:
        """Requests with the same number of output tokens both ways (greedy)."""
        return sum(
            1
            for cid, toks in self.eng.tokens_by_id.items()
            if self.svc.tokens_by_id.get(cid) == len(toks)
        )

    @property
    def eng_tps(self) -> float:
        return self.eng.output_tokens / self.eng.seconds

    @property
    def e2e_tps(self) -> float:
        return self.svc.output_tokens / self.svc.e2e_seconds

    @property
    def batch_tps(self) -> float:
        return self.svc.output_tokens / self.svc.batch_seconds


def measure(args: argparse.Namespace) -> Measured:
    """Start the service on a fresh database and broker, run the workload through it and
    through the engine alone; everything started is stopped and removed."""
    spec = str(Path(args.model).resolve()) if args.model else f"demo:{args.model_preset}"
    engine_options = json.loads(args.engine_options)
    overrides = {
        "BATCHD_MODELS": json.dumps({bs.MODEL: spec}),
        "BATCHD_ENGINE_OPTIONS": json.dumps(engine_options),
        "BATCHD_SHARD_MAX_REQUESTS": str(args.shard_requests),
    }
    if args.concurrency:
        overrides["BATCHD_WORKER_SHARD_CONCURRENCY"] = str(args.concurrency)
    work = Path(tempfile.mkdtemp(prefix="batchd-bench-service-"))
    with bs.Run(work, args.pg_admin_url, args.redis_url, keep=args.keep) as run:
        env = run.env(**overrides)
        for key, value in env.items():
            if key.startswith("BATCHD_"):
                os.environ[key] = value
        from core.settings import get_settings

        get_settings.cache_clear()
        settings = get_settings()
        from worker.infra import runtime

        model_dir = runtime.model_dir(bs.MODEL)  # builds a demo model once, before the workers
        lines = workload(
            args.requests,
            args.seed,
            prompt_words=args.prompt_words,
            max_tokens=args.max_tokens,
        )
        path = work / "batch.jsonl"
        write_jsonl(path, lines)
        warm_path = work / "warmup.jsonl"
        write_jsonl(warm_path, lines[: max(1, args.warmup)])

        stack = run.stack(env)
        stack.start_roles(("api", "control", "model", "beat"), settings.worker_shard_concurrency)
        stack.wait_ready()
        client = stack.client(timeout=600)
        sampler = EngineShardSampler(run.broker.url, run.db.url, args.stats_interval)
        if sampler.once() is None:
            raise RuntimeError("the model worker does not answer engine_stats" + stack.logs())
        # Warm the service (first-request costs in every process), then the engine alone.
        warm = run_service(client, warm_path, sampler, args.poll)
        if warm.status != "completed":
            raise RuntimeError(f"the warm-up batch ended {warm.status}" + stack.logs())
        print(f"engine alone: {args.requests} requests …", flush=True)
        eng = run_engine(path, model_dir, args.warmup)
        print(f"service: {args.requests} requests …", flush=True)
        sampler.batch_id = None
        sampler.start()
        svc = run_service(client, path, sampler, args.poll)
        sampler.stop()
        stack.check_alive()
        if args.engine_after:  # the machine's load drifts: bracket the service run
            print(f"engine alone again: {args.requests} requests …", flush=True)
            eng2 = run_engine(path, model_dir, args.warmup)
            eng = _mean_runs(eng, eng2)
        occ = occupancy(sampler.samples)
        return Measured(spec, engine_options, settings, eng, svc, occ, sampler.failures)


def report(args: argparse.Namespace, m: Measured) -> None:
    """Print the engine alone and the service side by side, and the targets."""
    spec, engine_options, settings = m.spec, m.engine_options, m.settings
    eng, svc, occ, same_counts = m.eng, m.svc, m.occ, m.same_counts
    eng_tps, e2e_tps, batch_tps = m.eng_tps, m.e2e_tps, m.batch_tps
    eng_rps, e2e_rps = eng.requests / eng.seconds, svc.requests / svc.e2e_seconds
    ratio, ratio_batch = e2e_tps / eng_tps, batch_tps / eng_tps
    occ_b = occ.get("occupancy_backlogged", 0.0)
    print()
    print(
        f"model {spec}, {args.requests} chat requests (seed {args.seed}), engine options "
        f"{json.dumps(engine_options)}, max_num_seqs {occ.get('max_num_seqs')}, "
        f"{settings.worker_shard_concurrency} shard threads, {svc.shards} shards of ≤"
        f"{args.shard_requests} requests, checkpoint every {settings.checkpoint_every} requests"
        f" or {settings.checkpoint_interval_s:g}s"
    )
    print(f"{'':34} {'seconds':>9} {'out tok':>8} {'tok/s':>8} {'req/s':>7} {'x engine':>9}")
    rows = [
        ("engine alone (LLM.generate)" + (", mean" if eng.runs else ""), eng.seconds, eng.output_tokens, eng_tps, eng_rps, 1.0),
        ("service, upload -> downloaded", svc.e2e_seconds, svc.output_tokens, e2e_tps, e2e_rps,
         ratio),
        ("service, created -> completed", svc.batch_seconds, svc.output_tokens, batch_tps,
         svc.requests / svc.batch_seconds, ratio_batch),
    ]  # fmt: skip
    for label, s, tok, tps, rps, x in rows:
        print(f"{label:34} {s:>9.2f} {tok:>8} {tps:>8.1f} {rps:>7.2f} {x:>9.3f}")
    print(
        f"service: status {svc.status}, {svc.requests} results, {svc.errors} errors, upload "
        f"{svc.upload_seconds:.2f}s, download {svc.download_seconds:.2f}s; engine alone: "
        f"{eng.requests} results, {eng.errors} errors, occupancy {eng.occupancy:.3f} over "
        f"{eng.steps} steps of {eng.step_seconds:.3f}s mean"
    )
    print(
        f"throughput ratio (service end to end / engine alone, output tok/s): {ratio:.3f} "
        f"(target ≥ {THROUGHPUT_TARGET}) {'PASS' if ratio >= THROUGHPUT_TARGET else 'FAIL'}"
    )
    print(
        "occupancy while backlogged (Σ running-seq-steps / (Σ steps × max_num_seqs) over poll "
        "intervals that began with requests waiting in the engine or host queue, or with "
        f"unclaimed shards): {occ_b:.3f} (target ≥ {OCCUPANCY_TARGET}) "
        f"{'PASS' if occ_b >= OCCUPANCY_TARGET else 'FAIL'}"
    )
    if "backlogged_s" in occ:
        print(
            f"  over {occ['backlogged_s']:.1f}s, {occ['backlogged_steps']} steps; engine busy "
            f"{occ['busy_backlogged']:.3f} of that wall time (time-weighted occupancy "
            f"{occ['time_weighted_occupancy_backlogged']:.3f}); whole run from the first step: "
            f"occupancy {occ['occupancy_whole_run']:.3f}, busy {occ['busy_whole_run']:.3f}, "
            f"{occ['steps_whole_run']} steps of {occ['mean_step_s_whole_run']:.3f}s mean; "
            f"peak engine waiting {occ['peak_engine_waiting']}, peak host pending "
            f"{occ['peak_host_pending']} (max_pending {occ['max_pending']}, max_in_flight "
            f"{occ['max_in_flight']}); {occ['samples']} samples, {m.stats_unanswered} unanswered"
        )
    print(
        f"requests with the same number of output tokens both ways (greedy): {same_counts}/"
        f"{len(eng.tokens_by_id)}"
    )


def result(args: argparse.Namespace, m: Measured) -> dict[str, Any]:
    """The run as a JSON-ready dict."""
    eng, svc = m.eng, m.svc
    return {
        "model": m.spec,
        "requests": args.requests,
        "seed": args.seed,
        "engine_options": m.engine_options,
        "shard_max_requests": args.shard_requests,
        "shard_concurrency": m.settings.worker_shard_concurrency,
        "shards": svc.shards,
        "engine": {
            "seconds": eng.seconds,
            "requests": eng.requests,
            "errors": eng.errors,
            "output_tokens": eng.output_tokens,
            "output_tok_s": m.eng_tps,
            "requests_s": eng.requests / eng.seconds,
            "occupancy": eng.occupancy,
            "steps": eng.steps,
            "mean_step_s": eng.step_seconds,
            "runs_s": eng.runs or [eng.seconds],
        },
        "service": {
            "status": svc.status,
            "e2e_seconds": svc.e2e_seconds,
            "batch_seconds": svc.batch_seconds,
            "upload_seconds": svc.upload_seconds,
            "download_seconds": svc.download_seconds,
            "requests": svc.requests,
            "errors": svc.errors,
            "output_tokens": svc.output_tokens,
            "output_tok_s": m.e2e_tps,
            "requests_s": svc.requests / svc.e2e_seconds,
            "batch_output_tok_s": m.batch_tps,
        },
        "throughput_ratio": m.e2e_tps / m.eng_tps,
        "throughput_ratio_created_to_completed": m.batch_tps / m.eng_tps,
        "occupancy": m.occ,
        "stats_unanswered": m.stats_unanswered,
        "same_output_token_counts": m.same_counts,
        "targets": {"throughput_ratio": THROUGHPUT_TARGET, "occupancy": OCCUPANCY_TARGET},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    measured = measure(args)
    report(args, measured)
    if args.json:
        args.json.write_text(json.dumps(result(args, measured), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
