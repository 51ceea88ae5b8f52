"""The systems the engine benchmark compares: what each returns, and the transformers ones.

What a system returns (:class:`SystemResult`), and the transformers systems the engine is
compared against, on the same requests and the engine's device and dtype, each set up and
warmed up outside its timed region: ``model.generate`` on padded static batches
(:func:`run_static`) and transformers' own continuous batching over its paged KV cache
(:func:`run_generate_batch`). ``benchmarks.engine`` says what each measures."""

from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

from cli.perf.workload import Workload


@dataclass
class SystemResult:
    name: str
    wall_s: float
    prompt_tokens: int
    output_tokens: int  # useful output tokens (each request's own max_tokens)
    generated_tokens: int  # every token the system decoded, padding rows included
    cpu_s: float = 0.0  # process CPU time (all threads): steadier than wall on a shared machine
    token_ids: list[list[int]] = field(default_factory=list, repr=False)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def total_tok_s(self) -> float:
        total = self.prompt_tokens + self.output_tokens
        return total / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "wall_s": self.wall_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "generated_tokens": self.generated_tokens,
            "output_tok_s": self.output_tok_s,
            "total_tok_s": self.total_tok_s,
            "cpu_s": self.cpu_s,
            "output_tok_per_cpu_s": self.output_tokens / self.cpu_s if self.cpu_s > 0 else 0.0,
            **self.extra,
        }


def _load_hf_model(model_dir: str, dtype: str, device: str, attn: str | None = None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": attn} if attn else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), **kwargs)
    return model.to(device).eval()


def _greedy_config(model: Any, max_new_tokens: int) -> Any:
    config = copy.deepcopy(model.generation_config)
    config.do_sample = False
    config.eos_token_id = None  # ignore EOS: every row decodes max_new_tokens
    config.max_new_tokens = max_new_tokens
    config.min_new_tokens = None
    for name in ("temperature", "top_p", "top_k"):
        setattr(config, name, None)
    return config


def run_static(
    model_dir: str, workload: Workload, batch_size: int, pad_id: int, *, dtype: str, device: str
) -> SystemResult:
    import torch

    from benchmarks.phases import device_sync

    model = _load_hf_model(model_dir, dtype, device)
    sync = device_sync(torch.device(device))

    def run_batch(prompts: list[list[int]], budgets: list[int]) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        config = _greedy_config(model, max(budgets))
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        return [row[width:].tolist() for row in out]

    rng = random.Random(4321)
    run_batch([[rng.randrange(3, 100) for _ in range(8)] for _ in range(2)], [4, 4])  # warm-up

    token_ids: list[list[int]] = []
    generated = 0
    sync()
    cpu0, start = time.process_time(), time.perf_counter()
    for lo in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[lo : lo + batch_size]
        budgets = workload.max_tokens[lo : lo + batch_size]
        rows = run_batch(prompts, budgets)
        generated += sum(len(r) for r in rows)
        token_ids.extend(r[:n] for r, n in zip(rows, budgets, strict=True))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    useful = sum(len(t) for t in token_ids)
    return SystemResult(
        "static",
        wall,
        workload.prompt_tokens,
        useful,
        generated,
        cpu,
        token_ids,
        {"batch_size": batch_size, "device": device, "dtype": dtype},
    )


def run_generate_batch(
    model_dir: str,
    workload: Workload,
    *,
    max_requests: int,
    max_batch_tokens: int,
    dtype: str,
    device: str,
    attn: str = "sdpa",
) -> SystemResult:
    import logging

    import torch
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from benchmarks import phases

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    model = _load_hf_model(model_dir, dtype, device, attn)
    page_size = 256
    pages = [
        math.ceil((len(p) + n) / page_size)
        for p, n in zip(workload.prompts, workload.max_tokens, strict=True)
    ]
    # Room for max_requests of the longest at once, but no more than the whole workload.
    num_blocks = min(max_requests * max(pages), sum(pages)) + 8
    cb_config = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests,
    )
    config = _greedy_config(model, max(workload.max_tokens))
    config.eos_token_id = -1  # the manager's spelling of "no EOS"
    trace = phases.StepTrace(sync=phases.device_sync(torch.device(device)))

    def run(
        manager: Any, prompts: list[list[int]], budgets: list[int], prefix: str
    ) -> list[list[int]]:
        ids = [
            manager.add_request(p, request_id=f"{prefix}-{i}", max_new_tokens=n, eos_token_id=-1)
            for i, (p, n) in enumerate(zip(prompts, budgets, strict=True))
        ]
        results: dict[str, Any] = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"generate_batch {result.request_id}: {result.error}")
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped")
        return [list(results[i].generated_tokens) for i in ids]

    rng = random.Random(4321)
    with torch.inference_mode():
        manager = model.init_continuous_batching(
            generation_config=config, continuous_batching_config=cb_config
        )
        manager.warmup()  # creates the cache and batch processor, captures CUDA graphs
        attn_used = model.config._attn_implementation
        phases.trace_continuous_batching(manager.batch_processor, trace)
        manager.start()
        try:
            run(
                manager,
                [[rng.randrange(3, 100) for _ in range(8)] for _ in range(2)],
                [4, 4],
                "warmup",
            )
            trace.start()
            cpu0, start = time.process_time(), time.perf_counter()
            token_ids = run(manager, workload.prompts, workload.max_tokens, "req")
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
            trace.close()
        finally:
            manager.stop(block=True)
    generated = sum(len(t) for t in token_ids)
    return SystemResult(
        "generate_batch",
        wall,
        workload.prompt_tokens,
        generated,
        generated,
        cpu,
        token_ids,
        {
            "max_requests_per_batch": max_requests,
            "max_batch_tokens": max_batch_tokens,
            "device": device,
            "dtype": dtype,
            "attn_implementation": attn_used,
            "phases": phases.summarise(trace.steps, max_requests),
        },
    )
