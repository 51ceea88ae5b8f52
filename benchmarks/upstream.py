"""Does the dispatcher earn its place? One workload against an OpenAI-compatible server, side by
side in one run:

    python -m benchmarks.upstream                       # a local transformers serve (SmolLM2)
    python -m benchmarks.upstream --base-url http://gpu-1:8000/v1 --model meta-llama/Llama-3.1-8B-Instruct

1. **Fixed concurrency**: the workload's chat requests sent with 1, 2, 4 … 64 in flight (a
   sweep the benchmark runs itself); output tokens/s of each (``usage.completion_tokens`` over
   the wall time), measured on the first ``4 x concurrency`` requests (at least 8).
2. **All at once**: every request sent at the same time.
3. **batchd**: the same requests as one batch through a running batchd (API, control worker,
   a dispatch worker, beat, on a fresh Postgres database and a private Redis) whose upstream
   model is the server, not told any concurrency: output tokens/s over the batch's dispatch
   (``in_progress_at`` to ``finalizing_at``) and over create-to-completed. On a shared machine
   the load drifts, so batchd and the best fixed concurrency (the whole workload at the
   sweep's best level) run in alternation, ``--rounds`` times; each round's ratio and their
   median are printed, and all at once is run in the same rounds.
4. **Live traffic**: a client sending one small streamed chat request every ``--live-every``
   seconds, its time to first token (p50, p99): alone; beside the batch sent all at once;
   beside the batch through batchd unguarded; beside it with the live-traffic guard
   (``ttft_p99_ms``, by default 1.5x the p99 alone), and the guarded batch's throughput.

Loopback by default: the server, batchd and every client run on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from cli.perf.service import wait_for
from cli.perf.workload import chat_bodies
from core.launch import QUIET, dispatch_worker_command
from testkit.service.stack import BENCH_API_KEY, Run
from testkit.upstream_server import UpstreamServer

PLAIN = "fleet"
GUARDED = "fleet-live"


# -- clients


async def _send_all(
    base_url: str, bodies: list[dict[str, Any]], concurrency: int, headers: dict[str, str]
) -> dict[str, float]:
    """Send ``bodies`` with ``concurrency`` in flight; output tokens/s over the wall time."""
    gate = asyncio.Semaphore(concurrency)
    tokens = 0
    failed = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=1800, limits=limits, trust_env=False) as client:

        async def one(body: dict[str, Any]) -> None:
            nonlocal tokens, failed
            async with gate:
                r = await client.post(base_url + "/chat/completions", json=body, headers=headers)
            if r.status_code != 200:
                failed += 1
                return
            tokens += int(r.json().get("usage", {}).get("completion_tokens") or 0)

        started = time.monotonic()
        await asyncio.gather(*(one(b) for b in bodies))
        wall = time.monotonic() - started
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "failed": failed}


class LiveClient:
    """Interactive users: one small streamed chat request every ``every`` seconds, each timed
    to its first content chunk, in a thread of its own until :meth:`stop`."""

    def __init__(self, base_url: str, model: str, every: float, headers: dict[str, str]):
        self.base_url, self.model, self.every, self.headers = base_url, model, every, headers
        self.ttfts: list[float] = []
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> LiveClient:
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(600)
        return summarise(self.ttfts, self.failed)

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
            tasks = []
            i = 0
            while not self._stop.is_set():
                tasks.append(asyncio.ensure_future(self._one(client, i)))
                i += 1
                await asyncio.sleep(self.every)
            await asyncio.gather(*tasks)

    async def _one(self, client: httpx.AsyncClient, i: int) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"}],
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
        }
        started = time.monotonic()
        try:
            async with client.stream(
                "POST", self.base_url + "/chat/completions", json=body, headers=self.headers
            ) as r:
                if r.status_code != 200:
                    self.failed += 1
                    return
                async for line in r.aiter_lines():
                    data = line.removeprefix("data:").strip()
                    if not line.startswith("data:") or data in ("", "[DONE]"):
                        continue
                    choices = json.loads(data).get("choices") or [{}]
                    if (choices[0].get("delta") or {}).get("content"):
                        self.ttfts.append(time.monotonic() - started)
                        return
        except httpx.HTTPError:
            self.failed += 1


def summarise(ttfts: list[float], failed: int = 0) -> dict[str, Any]:
    if not ttfts:
        return {"n": 0, "failed": failed}
    ordered = sorted(ttfts)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"n": len(ordered), "failed": failed, "p50_ms": 1000 * statistics.median(ordered),
            "p99_ms": 1000 * p99}  # fmt: skip


# -- batchd


class Batchd:
    """A running batchd whose upstream models are the server: ``fleet`` unguarded and
    ``fleet-live`` with the live-traffic guard at ``ttft_p99_ms``."""

    def __init__(
        self, run: Run, base_url: str, model: str, ttft_p99_ms: float, key_env: str | None
    ):
        key = f"&key_env={key_env}" if key_env else ""
        # One tenant: its prefix-cache salt would be the same on every line, so none is added
        # (a strict server such as transformers serve refuses vLLM's cache_salt).
        spec = f"upstream:{base_url}?model={model}{key}&cache_salt_field=none"
        env = run.env(
            BATCHD_MODELS=json.dumps(
                {PLAIN: spec, GUARDED: f"{spec}&ttft_p99_ms={ttft_p99_ms:.0f}"}
            ),
            BATCHD_WORKER_SHARD_CONCURRENCY="4",
        )
        self.stack = run.stack(env)
        self.stack.start_roles(["api", "control", "beat"])
        dispatch = dispatch_worker_command([PLAIN, GUARDED], 4, "dispatch@bench", extra=QUIET)
        self.stack.start("dispatch", dispatch, env)
        self.stack.wait_ready()
        wait_for(lambda: "ready." in self.stack.log("dispatch"), 120, "the dispatch worker",
                 self.stack.logs)  # fmt: skip
        self.http = httpx.Client(
            base_url=self.stack.base_url.removesuffix("/v1"),
            headers={"Authorization": f"Bearer {BENCH_API_KEY}"},
            timeout=60,
        )

    def run_batch(self, model: str, bodies: list[dict[str, Any]]) -> dict[str, Any]:
        lines = [
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": dict(body, model=model)}
            for i, body in enumerate(bodies)
        ]  # fmt: skip
        data = "".join(json.dumps(line) + "\n" for line in lines).encode()
        uploaded = self.http.post("/v1/files", data={"purpose": "batch"},
                                  files={"file": ("in.jsonl", data)}).json()  # fmt: skip
        started = time.monotonic()
        batch = self.http.post("/v1/batches", json={"input_file_id": uploaded["id"],
                               "endpoint": "/v1/chat/completions", "completion_window": "24h"}).json()  # fmt: skip
        while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(0.5)
            batch = self.http.get(f"/v1/batches/{batch['id']}").json()
        wall = time.monotonic() - started
        tokens = int((batch.get("usage") or {}).get("output_tokens") or 0)
        span = max(1, (batch.get("finalizing_at") or 0) - (batch.get("in_progress_at") or 0))
        return {
            "status": batch["status"],
            "failed": batch["request_counts"]["failed"],
            "tokens": tokens,
            "seconds": wall,
            "tokens_per_s": tokens / span,
            "tokens_per_s_create_to_completed": tokens / wall,
        }


# -- the run


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.upstream", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--base-url", help="an OpenAI-compatible server (default: a local transformers serve)"
    )
    ap.add_argument("--model", help="the name to send (with --base-url)")
    ap.add_argument("--key-env", help="the environment variable holding the server's key")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    ap.add_argument("--live-every", type=float, default=1.0, help="seconds between live requests")
    ap.add_argument("--live-alone-s", type=float, default=30.0)
    ap.add_argument("--ttft-objective-ms", type=float, default=0.0,
                    help="the guard's TTFT p99 objective (default 1.5x the p99 alone)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=2, help="the local server's threads")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of batchd and fixed")
    ap.add_argument("--no-batchd", action="store_true", help="the sweep and all-at-once only")
    ap.add_argument("--no-live", action="store_true", help="skip the live-traffic part")
    ap.add_argument("--json", help="write the figures here too")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="batchd-upstream-"))
    with UpstreamServer(work, threads=a.threads) if not a.base_url else _Given(a) as server:
        report = run(a, server.base_url, server.model, work)
    print_report(report)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


class _Given:
    def __init__(self, a: argparse.Namespace) -> None:
        self.base_url, self.model = a.base_url.rstrip("/"), a.model

    def __enter__(self) -> _Given:
        if not self.model:
            raise SystemExit("--model is needed with --base-url")
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def run(a: argparse.Namespace, base_url: str, model: str, work: Path) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {os.environ[a.key_env]}"} if a.key_env else {}
    bodies = chat_bodies(a.requests, a.max_tokens, seed=1, model=model)
    for body in bodies:
        body["temperature"] = 0
    report: dict[str, Any] = {
        "base_url": base_url, "model": model, "requests": a.requests, "max_tokens": a.max_tokens,
        "load_before": os.getloadavg(), "sweep": {},
    }  # fmt: skip
    asyncio.run(_send_all(base_url, bodies[:4], 4, headers))  # warm the server up
    for c in (int(x) for x in a.concurrency.split(",")):
        # A level's steady throughput needs a few rounds of its concurrency, not the whole
        # workload (one at a time it would take most of the run).
        sample = bodies[: max(8, 4 * c)]
        report["sweep"][c] = result = asyncio.run(_send_all(base_url, sample, c, headers))
        print(
            f"fixed concurrency {c:4d}: {result['tokens_per_s']:8.1f} output tokens/s", flush=True
        )
    report["all_at_once"] = asyncio.run(_send_all(base_url, bodies, len(bodies), headers))
    print(f"all at once: {report['all_at_once']['tokens_per_s']:.1f} output tokens/s", flush=True)
    best_c = max(report["sweep"], key=lambda c: report["sweep"][c]["tokens_per_s"])
    report["best_fixed"] = {"concurrency": best_c, **report["sweep"][best_c]}
    if a.no_batchd and a.no_live:
        return report
    live: dict[str, Any] = {}
    report["live"] = live
    if not a.no_live:
        client = LiveClient(base_url, model, a.live_every, headers).start()
        time.sleep(a.live_alone_s)
        live["alone"] = client.stop()
        print(f"live alone: {live['alone']}", flush=True)
        client = LiveClient(base_url, model, a.live_every, headers).start()
        report["all_at_once_beside_live"] = asyncio.run(
            _send_all(base_url, bodies, len(bodies), headers)
        )
        live["beside_all_at_once"] = client.stop()
        print(f"live beside all at once: {live['beside_all_at_once']}", flush=True)
    if a.no_batchd:
        return report
    alone_p99 = live.get("alone", {}).get("p99_ms") or 1000.0
    objective = a.ttft_objective_ms or 1.5 * alone_p99
    report["ttft_objective_ms"] = objective
    (work / "batchd").mkdir(exist_ok=True)
    with Run(work / "batchd") as service:
        batchd = Batchd(service, base_url, model, objective, a.key_env)
        rounds = report["rounds"] = []
        for _ in range(max(1, a.rounds)):
            fixed = asyncio.run(_send_all(base_url, bodies, best_c, headers))
            ours = batchd.run_batch(PLAIN, bodies)
            flood = asyncio.run(_send_all(base_url, bodies, len(bodies), headers))
            rounds.append({"fixed": fixed, "batchd": ours, "all_at_once": flood,
                           "ratio": ours["tokens_per_s"] / fixed["tokens_per_s"],
                           "vs_all_at_once": ours["tokens_per_s"] / flood["tokens_per_s"]})  # fmt: skip
            print(f"round: fixed {best_c} {fixed['tokens_per_s']:.1f}, batchd "
                  f"{ours['tokens_per_s']:.1f}, all at once {flood['tokens_per_s']:.1f} tokens/s",
                  flush=True)  # fmt: skip
        report["batchd"] = rounds[-1]["batchd"]
        report["ratio_median"] = statistics.median(r["ratio"] for r in rounds)
        report["vs_all_at_once_median"] = statistics.median(r["vs_all_at_once"] for r in rounds)
        if not a.no_live:
            client = LiveClient(base_url, model, a.live_every, headers).start()
            report["batchd_beside_live"] = batchd.run_batch(PLAIN, bodies)
            live["beside_batchd_unguarded"] = client.stop()
            print(f"live beside batchd unguarded: {live['beside_batchd_unguarded']}", flush=True)
            client = LiveClient(base_url, model, a.live_every, headers).start()
            report["batchd_guarded"] = batchd.run_batch(GUARDED, bodies)
            live["beside_batchd_guarded"] = client.stop()
            print(f"live beside batchd guarded: {live['beside_batchd_guarded']}", flush=True)
    report["load_after"] = os.getloadavg()
    return report


def print_report(r: dict[str, Any]) -> None:
    out = sys.stdout
    best = r["best_fixed"]
    print(f"\nupstream {r['base_url']} ({r['model']}), {r['requests']} chat requests, "
          f"max_tokens {r['max_tokens']}, load {r['load_before'][0]:.1f}", file=out)  # fmt: skip
    print(f"{'in flight':>12} {'tokens/s':>10}", file=out)
    for c, res in r["sweep"].items():
        print(f"{c:>12} {res['tokens_per_s']:10.1f}", file=out)
    print(f"{'all at once':>12} {r['all_at_once']['tokens_per_s']:10.1f}", file=out)
    if "rounds" in r:
        print(f"\nalternating rounds (the whole workload each; best fixed = {best['concurrency']} "
              "in flight):", file=out)  # fmt: skip
        print(f"{'round':>6} {'fixed':>8} {'batchd':>8} {'all-at-once':>12} {'batchd/fixed':>13} "
              f"{'batchd/all':>11} {'batchd create->done':>20}", file=out)  # fmt: skip
        for i, rd in enumerate(r["rounds"], 1):
            print(f"{i:>6} {rd['fixed']['tokens_per_s']:8.1f} {rd['batchd']['tokens_per_s']:8.1f} "
                  f"{rd['all_at_once']['tokens_per_s']:12.1f} {rd['ratio']:13.2f} "
                  f"{rd['vs_all_at_once']:11.2f} "
                  f"{rd['batchd']['tokens_per_s_create_to_completed']:20.1f}", file=out)  # fmt: skip
        print(f"median batchd / best fixed: {r['ratio_median']:.2f}; batchd / all at once: "
              f"{r['vs_all_at_once_median']:.2f}", file=out)  # fmt: skip
    live = r.get("live") or {}
    if live:
        print("\nlive traffic, time to first token:", file=out)
        for name, s in live.items():
            if s.get("n"):
                print(f"  {name:>26}: p50 {s['p50_ms']:7.0f} ms  p99 {s['p99_ms']:7.0f} ms  "
                      f"({s['n']} requests)", file=out)  # fmt: skip
        if "beside_batchd_guarded" in live and live.get("alone", {}).get("n"):
            ratio = live["beside_batchd_guarded"]["p99_ms"] / live["alone"]["p99_ms"]
            print(f"  guarded p99 = {ratio:.2f}x alone (objective {r['ttft_objective_ms']:.0f} ms);"
                  f" the guarded batch: {r['batchd_guarded']['tokens_per_s']:.1f} output tokens/s",
                  file=out)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
