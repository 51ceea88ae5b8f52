"""One system's run of the peer benchmark (:mod:`benchmarks.peer`), in a fresh process.

    python benchmarks/peer_child.py engine|openvino MODEL_DIR REQUESTS.json OUT.json THREADS \
        [PRECISION [KV]]

``PRECISION`` is ``fp32`` (the default) or ``bf16``: the engine's dtype, OpenVINO's inference
precision. ``KV`` is OpenVINO's KV-cache precision: ``same`` (the default: as ``PRECISION``,
so both systems hold the same state) or ``u8`` (OpenVINO's own default).

``REQUESTS.json`` holds ``{"prompts": [[ids...], ...], "max_tokens": [n, ...]}``. Every request
is greedy, ignores EOS and produces exactly its ``max_tokens`` tokens. ``OUT.json`` gets the
output token ids, the timed region's wall and CPU seconds, and the process's peak RSS.

Only the standard library is imported at the top: the ``openvino`` system runs in the peer's
own virtualenv, which holds neither this project nor its dependencies (the script is run by
path, not as a module, for that reason). Each system loads its model and runs a two-request
warm-up before the timed region.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def cache_gib(prompts: list[list[int]], max_tokens: list[int]) -> int:
    """The KV cache both systems get, in GiB: room for every request's whole sequence at once
    (an f32 cache holds 2 x layers x kv_heads x head_dim x 4 bytes a token; 64 KiB a token is
    a bound for the models here)."""
    kv_tokens = sum(len(p) + n for p, n in zip(prompts, max_tokens, strict=True))
    return max(1, -(-kv_tokens * 65536 // 2**30))


def run_engine(
    model_dir: str, prompts: list[list[int]], max_tokens: list[int], precision: str
) -> list[list[int]]:
    from engine import Engine, SamplingParams

    kv_bytes = cache_gib(prompts, max_tokens) * 2**30
    engine = Engine(model_dir, dtype=DTYPES[precision], kv_cache_memory=kv_bytes)

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def drain() -> dict[str, list[int]]:
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        return done

    for i in range(2):
        engine.add_request(f"warmup-{i}", prompts[i % len(prompts)][:16], params(4))
    drain()

    def work() -> dict[str, list[int]]:
        for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
            engine.add_request(f"r{i}", prompt, params(n))
        return drain()

    return _timed(work, lambda done: [done[f"r{i}"] for i in range(len(prompts))])


def run_openvino(
    model_dir: str,
    prompts: list[list[int]],
    max_tokens: list[int],
    threads: int,
    precision: str,
    kv: str,
) -> list[list[int]]:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    sched = ov_genai.SchedulerConfig()
    sched.cache_size = cache_gib(prompts, max_tokens)  # GiB, as the engine gets
    infer = ov.Type.f32 if precision == "fp32" else ov.Type.bf16
    sched.enable_prefix_caching = True
    sched.dynamic_split_fuse = True
    sched.max_num_batched_tokens = 256
    sched.max_num_seqs = 256
    properties = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": infer}
    if kv == "same":
        properties["KV_CACHE_PRECISION"] = infer
    elif kv != "u8":
        raise SystemExit(f"unknown KV precision {kv!r}: same or u8")
    pipe = ov_genai.ContinuousBatchingPipeline(model_dir, sched, "CPU", properties)

    def config(n: int) -> ov_genai.GenerationConfig:
        cfg = ov_genai.GenerationConfig()
        cfg.max_new_tokens = n
        cfg.min_new_tokens = n
        cfg.ignore_eos = True
        cfg.do_sample = False
        return cfg

    def tensor(ids: list[int]) -> ov.Tensor:
        return ov.Tensor(np.asarray([ids], dtype=np.int64))

    pipe.generate([tensor(p[:16]) for p in prompts[:2]], [config(4) for _ in prompts[:2]])
    return _timed(
        lambda: pipe.generate([tensor(p) for p in prompts], [config(n) for n in max_tokens]),
        lambda results: [list(r.m_generation_ids[0]) for r in results],
    )


_FIGURES: dict[str, float] = {}


def _timed(work, collect):  # type: ignore[no-untyped-def]
    cpu0, start = time.process_time(), time.perf_counter()
    result = work()
    _FIGURES["wall_s"] = time.perf_counter() - start
    _FIGURES["cpu_s"] = time.process_time() - cpu0
    return collect(result)


def main(argv: list[str]) -> None:
    # Run by path, the script's own folder leads sys.path, and benchmarks/engine.py would
    # shadow the engine package.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    system, model_dir, requests_path, out_path, threads, *rest = argv
    precision = rest[0] if rest else "fp32"
    kv = rest[1] if len(rest) > 1 else "same"
    if precision not in DTYPES:
        raise SystemExit(f"unknown precision {precision!r}: {' or '.join(DTYPES)}")
    with open(requests_path) as fh:
        requests = json.load(fh)
    prompts, max_tokens = requests["prompts"], requests["max_tokens"]
    if system == "engine":
        import torch

        torch.set_num_threads(int(threads))
        tokens = run_engine(model_dir, prompts, max_tokens, precision)
    elif system == "openvino":
        tokens = run_openvino(model_dir, prompts, max_tokens, int(threads), precision, kv)
    else:
        raise SystemExit(f"unknown system {system!r}")
    figures = dict(_FIGURES)
    figures["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    figures["load_avg"] = os.getloadavg()[0]
    with open(out_path, "w") as fh:
        json.dump({"figures": figures, "token_ids": tokens}, fh)


if __name__ == "__main__":
    main(sys.argv[1:])
