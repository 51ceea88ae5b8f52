"""Does ``torch.compile`` speed up the model forward on CPU? Eager vs compiled, side by side.

Two forwards are timed at the same shapes in one run:

- ``bare``: transformers' own forward (SDPA attention, no cache) over ``[seqs, prompt]`` tokens;
- ``engine``: the engine's packed decode step (paged attention, CPU backend) of ``seqs``
  sequences, the forward the engine runs most.

Each prints eager ms, compiled ms (after warm-up; compile time printed apart) and the ratio
eager / compiled (> 1: compile wins); then the compiled engine forward's first call on the next
decode step, whose shapes differ (what a compiled forward would pay inside a running engine).

    python -m benchmarks.compile_cpu --model llama-25m --threads 1
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch

from core.llms.demo import build
from engine import Engine, SamplingParams


def _time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1000


def _compare(
    name: str, eager: Callable[[], object], compiled: Callable[[], object], repeats: int
) -> None:
    t0 = time.perf_counter()
    try:
        compiled()
    except Exception as exc:  # a forward dynamo cannot compile is a result too
        print(f"{name:7s} compile failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        return
    compile_s = time.perf_counter() - t0
    e = _time(eager, repeats)
    c = _time(compiled, repeats)
    print(
        f"{name:7s} eager {e:8.2f} ms  compiled {c:8.2f} ms  eager/compiled {e / c:5.2f}  (compile {compile_s:.1f} s)"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-25m")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = str(build(args.model))
    rng = random.Random(0)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    ids = torch.tensor(
        [[rng.randrange(3, 2048) for _ in range(args.prompt)] for _ in range(args.seqs)]
    )
    compiled_model = torch.compile(model.model)
    with torch.inference_mode():
        print(
            f"{args.model}, {args.seqs} sequences, prompts of {args.prompt} tokens, {args.threads} thread(s)"
        )
        _compare(
            "bare",
            lambda: model.model(input_ids=ids, use_cache=False),
            lambda: compiled_model(input_ids=ids, use_cache=False),
            args.repeats,
        )

        engine = Engine(
            path,
            attention_backend="sdpa",
            max_num_seqs=args.seqs,
            enable_prefix_caching=False,
            max_num_batched_tokens=max(2048, args.seqs * args.prompt),
        )
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        for i, row in enumerate(ids.tolist()):
            engine.add_request(str(i), row, params)
        engine.step()
        runner = engine.runner
        batch = runner.prepare(engine.scheduler.schedule())
        base = runner.base
        compiled_base = torch.compile(base, dynamic=False)

        def run(module: torch.nn.Module) -> object:
            return module(
                input_ids=batch.input_ids.unsqueeze(0),
                position_ids=batch.positions.unsqueeze(0),
                use_cache=False,
                batchd_ctx=batch.ctx,
            )

        _compare("engine", lambda: run(base), lambda: run(compiled_base), args.repeats)

        # The engine's next step has other context lengths (and, as sequences come and go,
        # another number of them): the compiled forward's first call on it.
        engine.step()
        batch = runner.prepare(engine.scheduler.schedule())
        t0 = time.perf_counter()
        run(compiled_base)
        print(
            f"engine  the next decode step, compiled: first call {time.perf_counter() - t0:.1f} s "
            f"(eager {_time(lambda: run(base), 1):.2f} ms)"
        )


if __name__ == "__main__":
    main()
