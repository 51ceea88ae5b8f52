"""Operator calls per decode step, by attention backend and number of running sequences.

The proxy, measurable on CPU, for kernel launches on a GPU: ``torch.profiler`` counts the
operator calls of one engine step in which every running sequence decodes one token. The flex
backend (the CUDA one) and the sdpa backend (the CPU one) in bf16, where it attends the decode
rows of similar length together, must issue the same number at 16 and at 64 sequences (within
5%); the sdpa backend in float32 makes one call per sequence, and its count grows.

    python -m benchmarks.attention_ops                      # 16 and 64 sequences, both backends
    python -m benchmarks.attention_ops --seqs 8 32 128 --backends flex
"""

from __future__ import annotations

import argparse
import random

import torch
from torch.profiler import ProfilerActivity, profile

from core.llms.demo import build
from engine import Engine, SamplingParams

PROMPT_LEN = 40


def decode_step_ops(
    path: str, backend: str, num_seqs: int, prompt_len: int = PROMPT_LEN, dtype: str = "float32"
) -> int:
    """Operator calls of one engine step in which all ``num_seqs`` sequences decode."""
    blocks_per_seq = -(-(prompt_len + 8) // 16)
    engine = Engine(
        path,
        attention_backend=backend,
        dtype=dtype,
        max_num_seqs=num_seqs,
        num_kv_blocks=num_seqs * blocks_per_seq,
        max_num_batched_tokens=max(2048, num_seqs * prompt_len),
        enable_prefix_caching=False,
    )
    rng = random.Random(num_seqs)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(
            str(i), [rng.randrange(3, engine.vocab_size) for _ in range(prompt_len)], params
        )
    engine.step()  # every prompt in one step
    engine.step()  # a first decode step, unmeasured (lazy initialisation)
    running = engine.scheduler.running
    if len(running) != num_seqs or any(s.num_computed_tokens != len(s) - 1 for s in running):
        raise RuntimeError("the measured step is not a decode step of every sequence")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    return len(prof.events())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-tiny", help="a demo model name (core.llms.demo)")
    ap.add_argument("--seqs", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--backends", nargs="+", default=["flex", "sdpa"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = str(build(args.model))
    print(f"operator calls per decode step ({args.model}, prompts of {PROMPT_LEN} tokens)")
    for backend in args.backends:
        counts = [decode_step_ops(path, backend, n) for n in args.seqs]
        row = "  ".join(f"{n} seqs: {c}" for n, c in zip(args.seqs, counts, strict=True))
        print(f"{backend:5s} {row}  largest/smallest: {counts[-1] / counts[0]:.3f}")


if __name__ == "__main__":
    main()
