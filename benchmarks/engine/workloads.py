"""What the benchmark runs: the systems it compares and its named workloads."""

from __future__ import annotations

SYSTEMS = ("engine", "static", "generate_batch")
# Named workloads: (number of requests, prompt lengths, output lengths). The default is a
# batch-inference job that generates more than it reads (output lengths with a long tail);
# "prompt-heavy" reads 3.5x more tokens than it writes, so prefill, which costs every system
# the same on a compute-bound CPU, bounds output tok/s there.
WORKLOADS = {
    "generation-heavy": (96, "uniform:16:256", "lognormal:128:1.0"),
    "prompt-heavy": (64, "uniform:32:384", "lognormal:64:0.8"),
    # Long documents in, short answers out (summaries, extraction): prefill bound throughout.
    "long-context": (32, "uniform:1000:2000", "lognormal:96:0.6"),
}
DEFAULT_WORKLOAD = "generation-heavy"
# Real chat prompts (cli.perf.workload.chat_bodies) through the model's chat template, each
# answered with exactly --output-len tokens (default 64); 64 requests unless --num-requests.
CHAT_WORKLOAD = "chat"
CHAT_DEFAULTS = (64, "fixed:64")
DEFAULT_NUM_REQUESTS, DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN = WORKLOADS[DEFAULT_WORKLOAD]
# The prefix-caching comparison is about prefill, so its default workload has long shared
# prompts and short outputs.
PREFIX_DEFAULT_INPUT_LEN = "uniform:384:768"
PREFIX_DEFAULT_OUTPUT_LEN = "uniform:8:32"
PREFIX_DEFAULT_SHARED_FRAC = 0.8
