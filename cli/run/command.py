"""The ``batchd run`` command."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from cli.exit_codes import ExitCode, exit_codes_help
from core.batchfile.request import CHAT_URL

if TYPE_CHECKING:
    pass
from cli.run.options import ModelLoadError, RunError, RunOptions
from cli.run.runner import Interrupted, run_batch_file, say


def _memory_size(value: str | None) -> int | float | None:
    """``--kv-cache-memory``: a fraction (0.5), bytes (1073741824) or a size (2GiB, 512MB)."""
    if value is None:
        return None
    text = value.strip().lower().removesuffix("b")
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "ki": 1 << 10,
             "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}  # fmt: skip
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * units[suffix])
    if "." in text:
        return float(text)
    return int(text)


RUN_HELP = (
    "Run an OpenAI batch FILE through a local model in this process, no servers."
    "\n\n"
    "Output and error lines have the service's formats, in input order. Input lines that do "
    "not validate (bad JSON, a missing field, a duplicate custom_id, ...) become error-file "
    "lines whose message names the line number, and the run carries on. Only a file with no "
    "valid request at all (say, every url differs from --endpoint), or any invalid line with "
    "--strict, stops the run before the model loads (exit 2). Requests the model cannot run "
    "(a prompt longer than its context) also go to the error file."
    "\n\n"
    "Interrupted (Ctrl-C, SIGTERM, even SIGKILL), the same command resumes from the last "
    "checkpoint: OUT.partial, ERR.partial and OUT.progress.json hold the state until the run "
    "ends. Memory stays bounded whatever the file's size."
)


def run(
    file: Annotated[
        Path, typer.Argument(exists=True, dir_okay=False, readable=True, help="JSONL batch file.")
    ],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output JSONL file.")],
    model: Annotated[
        str,
        typer.Option(
            "--model",
            help="Local Hugging Face model directory, GGUF file, model spec (gguf:FILE, "
            "pkg:MODULE, demo:PRESET) or a name BATCHD_MODELS serves.",
        ),
    ],
    errors: Annotated[
        Path | None,
        typer.Option("--errors", help="Error JSONL file (default: OUT with .errors.jsonl)."),
    ] = None,
    endpoint: Annotated[str, typer.Option(help="Endpoint every request targets.")] = CHAT_URL,
    model_name: Annotated[
        str | None,
        typer.Option(
            help="Model name written in responses; requests naming another model are errors "
            "(default: each request's own body.model, any accepted)."
        ),
    ] = None,
    max_num_seqs: Annotated[
        int | None, typer.Option(min=1, help="Engine: sequences per step.")
    ] = None,
    max_num_batched_tokens: Annotated[
        int | None, typer.Option(min=1, help="Engine: token budget per step.")
    ] = None,
    num_kv_blocks: Annotated[int | None, typer.Option(min=1, help="Engine: KV blocks.")] = None,
    kv_cache_memory: Annotated[
        str | None, typer.Option(help="Engine: KV cache size, a fraction (0.5) or bytes (2GiB).")
    ] = None,
    dtype: Annotated[
        str | None, typer.Option(help="Engine: auto, float32, float16, bfloat16.")
    ] = None,
    device: Annotated[str | None, typer.Option(help="Engine: auto, cpu, cuda, cuda:N.")] = None,
    engine_options: Annotated[
        str | None,
        typer.Option(
            help="Any engine options as JSON, like BATCHD_ENGINE_OPTIONS "
            '(\'{"admission": "fcfs", "max_model_len": 2048}\'); the flags above win.'
        ),
    ] = None,
    checkpoint_every: Annotated[
        int, typer.Option(min=1, help="Checkpoint after this many requests.")
    ] = 256,
    checkpoint_interval: Annotated[
        float, typer.Option(min=0.0, help="…or after this many seconds.")
    ] = 30.0,
    window: Annotated[
        int | None,
        typer.Option(min=1, help="Requests in flight at most (default: 4 x max-num-seqs)."),
    ] = None,
    strict: Annotated[bool, typer.Option(help="Refuse to run if any line is invalid.")] = False,
    restart: Annotated[
        bool, typer.Option(help="Discard the checkpoint of an earlier run and start over.")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print a JSON summary on stdout.")
    ] = False,
) -> None:
    if errors is None:
        stem = output.name.removesuffix(".jsonl")
        errors = output.with_name(f"{stem}.errors.jsonl")
    try:
        kv = _memory_size(kv_cache_memory)
    except ValueError:
        raise typer.BadParameter(
            f"expected a fraction or a size, got {kv_cache_memory!r}",
            param_hint="--kv-cache-memory",
        ) from None
    try:
        extra = json.loads(engine_options) if engine_options else {}
    except ValueError as exc:
        raise typer.BadParameter(f"not JSON: {exc}", param_hint="--engine-options") from None
    if not isinstance(extra, dict):
        raise typer.BadParameter("expected a JSON object", param_hint="--engine-options")
    engine_config = extra | {
        k: v
        for k, v in {
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "num_kv_blocks": num_kv_blocks,
            "kv_cache_memory": kv,
            "dtype": dtype,
            "device": device,
        }.items()
        if v is not None
    }
    options = RunOptions(
        input=file,
        output=output,
        errors=errors,
        model=model,
        endpoint=endpoint,
        model_name=model_name,
        engine_config=engine_config,
        checkpoint_every=checkpoint_every,
        checkpoint_interval_s=checkpoint_interval,
        window=window,
        strict=strict,
    )
    try:
        summary = run_batch_file(options, restart=restart, show_progress=sys.stderr.isatty())
    except RunError as exc:
        say(f"error: {exc}")
        raise typer.Exit(int(ExitCode.USAGE)) from None
    except (Interrupted, KeyboardInterrupt):
        raise typer.Exit(int(ExitCode.INTERRUPTED)) from None
    except (ModelLoadError, OSError) as exc:  # no model, disk full, unreadable file
        say(f"error: {exc}")
        raise typer.Exit(int(ExitCode.ERROR)) from None
    say(
        f"done: {summary.succeeded} succeeded, {summary.failed} failed of {summary.total} "
        f"({summary.resumed_requests} resumed, {summary.computed_requests} computed now) in "
        f"{summary.elapsed_s:.1f}s, {summary.completion_tokens_per_s} completion tok/s; "
        f"{summary.output}, {summary.errors}"
    )
    if as_json:
        sys.stdout.write(json.dumps(asdict(summary)) + "\n")
    raise typer.Exit(int(summary.exit_code))


def register(app: typer.Typer) -> None:
    app.command(name="run", help=RUN_HELP, epilog=exit_codes_help())(run)
