"""The ``batchd tune`` and ``batchd bench`` commands (see :mod:`cli.perf.tune`, ``.bench``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from cli.exit_codes import ExitCode
from cli.perf.workload import DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN


def say(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def resolve_model(model: str | None) -> tuple[str, str]:
    """(a label, the local directory) of ``model``: a served name (``BATCHD_MODELS``), a demo
    preset (``demo:<preset>``) or a directory; default, the first served model."""
    from core.llms import specs
    from core.settings import get_settings

    served = get_settings().models
    if model is None:
        model = next(iter(served))
    spec = served.get(model, model)
    path = specs.spec_dir(spec)
    if path is None:
        from core.llms.demo import build

        path = build(spec.split(":", 1)[1])
    if not Path(path).is_dir():
        raise typer.BadParameter(f"no model directory {path}", param_hint="--model")
    return model, str(path)


def _ints(text: str | None, name: str) -> list[int] | None:
    if not text:
        return None
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected integers separated by commas, got {text!r}",
                                 param_hint=name) from None  # fmt: skip
    if not values or min(values) < 1:
        raise typer.BadParameter("expected integers >= 1", param_hint=name)
    return values


def _budget(value: int | float | None) -> str:
    if value is None:
        return "default"
    return f"{value:g} of free memory" if isinstance(value, float) else f"{value / 2**20:g} MiB"


def _usage_error(exc: ValueError) -> typer.Exit:
    say(f"error: {exc}")
    return typer.Exit(int(ExitCode.USAGE))


def _engine_options(text: str | None) -> dict:
    """``--engine-options``; without it, ``BATCHD_ENGINE_OPTIONS``."""
    from core.settings import get_settings

    if text is not None:
        return _json_object(text, "--engine-options")
    return dict(get_settings().engine_options)


def _json_object(text: str | None, name: str) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise typer.BadParameter(f"not JSON: {exc}", param_hint=name) from None
    if not isinstance(value, dict):
        raise typer.BadParameter("expected a JSON object", param_hint=name)
    return value


# The options both commands take, with one meaning: where the request shapes come from.
WorkloadOpt = Annotated[
    Path | None,
    typer.Option(
        exists=True,
        dir_okay=False,
        help="A JSONL batch file whose requests give the request shapes (prompt and output "
        "lengths).",
    ),
]
InputLenOpt = Annotated[
    str,
    typer.Option(
        help="Without --workload: prompt lengths in tokens (fixed:N, uniform:LO:HI, "
        "lognormal:MEAN:SIGMA)…"
    ),
]
OutputLenOpt = Annotated[str, typer.Option(help="…and output lengths.")]
SeedOpt = Annotated[int, typer.Option(help="Seed of the workload.")]
EngineOptionsOpt = Annotated[
    str | None,
    typer.Option(
        help="Engine options as JSON (device, dtype, max_model_len …); default "
        "BATCHD_ENGINE_OPTIONS."
    ),
]
ThreadsOpt = Annotated[
    int | None, typer.Option(min=1, help="torch threads per engine process (1 on a shared CPU).")
]


TUNE_HELP = """Find the engine's operating point for a model, a workload and a KV memory budget.

Sweeps max_num_seqs, max_num_batched_tokens (and block size, with --block-sizes) with the
engine alone, kept backlogged with the workload's request shapes; writes the chosen point as
an engine-options JSON for BATCHD_ENGINE_OPTIONS, a report (tune.json) and the curve of
throughput and step time against the running batch size (tune.png). On a shared CPU pass
--threads 1. Example:

  batchd tune --model demo:llama-25m --workload requests.jsonl --kv-memory 256MiB \\
      --threads 1 -o engine-options.json
  export BATCHD_ENGINE_OPTIONS="$(cat engine-options.json)"
"""


def tune(
    model: Annotated[
        str | None,
        typer.Option(
            help="A served model name, demo:<preset> or a model directory "
            "(default: the first of BATCHD_MODELS)."
        ),
    ] = None,  # fmt: skip
    workload: WorkloadOpt = None,
    requests: Annotated[
        int, typer.Option(min=1, help="Without --workload: this many synthetic requests.")
    ] = 256,
    input_len: InputLenOpt = DEFAULT_INPUT_LEN,
    output_len: OutputLenOpt = DEFAULT_OUTPUT_LEN,
    kv_memory: Annotated[
        str | None,
        typer.Option(
            help="KV cache budget: bytes (256MiB, 2GiB) or a fraction of free memory "
            "(0.85); default: the engine options' kv_cache_memory."
        ),
    ] = None,  # fmt: skip
    engine_options: EngineOptionsOpt = None,
    max_num_seqs: Annotated[
        str | None, typer.Option(help="A grid instead of the search: these max_num_seqs…")
    ] = None,
    max_num_batched_tokens: Annotated[
        str | None, typer.Option(help="…and these max_num_batched_tokens (comma-separated).")
    ] = None,
    block_sizes: Annotated[
        str | None,
        typer.Option(
            help="Block sizes to try (comma-separated; default: the base one, and "
            "16 and 32 on a GPU)."
        ),
    ] = None,
    max_seqs: Annotated[int, typer.Option(min=1, help="The search's largest max_num_seqs.")] = 256,
    objective: Annotated[
        str,
        typer.Option(help="output (output tokens/s) or total (all tokens through the model/s)."),
    ] = "output",
    max_step_ms: Annotated[
        float | None,
        typer.Option(
            help="Choose only points whose mean step (inter-token latency) is at most this many ms."
        ),
    ] = None,  # fmt: skip
    warmup: Annotated[float, typer.Option(help="Warm-up seconds per point, at most.")] = 60.0,
    measure: Annotated[float, typer.Option(help="Measured seconds per point, at least.")] = 3.0,
    min_steps: Annotated[int, typer.Option(min=1, help="Measured steps per point, at least.")] = 8,
    clock: Annotated[
        str, typer.Option(help="auto (CPU time on a 1-thread CPU engine, else wall), cpu, wall.")
    ] = "auto",
    confirm: Annotated[
        int, typer.Option(min=0, help="Measure this many best points again before choosing.")
    ] = 3,
    confirm_runs: Annotated[
        int, typer.Option(min=1, help="…this many more times each, in turn, windows pooled.")
    ] = 3,
    threads: ThreadsOpt = None,
    seed: SeedOpt = 0,
    output: Annotated[
        Path, typer.Option("-o", "--output", help="Where the chosen engine options go.")
    ] = Path("engine-options.json"),
    report_dir: Annotated[
        Path | None,
        typer.Option(help="Where tune.json and tune.png go (default: beside --output)."),
    ] = None,
) -> None:
    from cli.perf import tune as tuning
    from cli.perf.workload import (
        LengthDist,
        jsonl_workload,
        synthetic_workload,
        usable_token_ids,
    )
    from cli.run.command import _memory_size

    if objective not in ("output", "total"):
        raise typer.BadParameter("output or total", param_hint="--objective")
    if clock not in ("auto", "cpu", "wall"):
        raise typer.BadParameter("auto, cpu or wall", param_hint="--clock")
    seqs = _ints(max_num_seqs, "--max-num-seqs")
    tokens = _ints(max_num_batched_tokens, "--max-num-batched-tokens")
    blocks = _ints(block_sizes, "--block-sizes")
    base = _engine_options(engine_options)
    for host_only in ("max_pending", "engine_backlog", "group_window"):
        base.pop(host_only, None)
    if kv_memory is not None:
        try:
            base["kv_cache_memory"] = _memory_size(kv_memory)
        except ValueError:
            raise typer.BadParameter(
                f"not a size: {kv_memory!r}", param_hint="--kv-memory"
            ) from None
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    device = str(base.get("device", "auto"))
    if blocks is None and (
        device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    ):
        # On a GPU the attention reads K/V in place through the block table, so the block
        # size sets its memory access granularity; on the CPU each sequence's K/V is gathered
        # whole and the block size barely matters.
        first = int(base.get("block_size", 16))
        blocks = [first, *(b for b in (16, 32) if b != first)]
    label, model_dir = resolve_model(model)

    from transformers import AutoConfig

    from engine.text.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    given_len = base.get("max_model_len")
    limit = int(given_len) if given_len else int(getattr(config, "max_position_embeddings", 2048))
    try:
        if workload is not None:
            shapes = jsonl_workload(workload, tok, max_model_len=limit)
        else:
            vocab = usable_token_ids(tok, int(getattr(config, "vocab_size", len(tok))))
            shapes = synthetic_workload(
                num_requests=requests, input_len=LengthDist.parse(input_len),
                output_len=LengthDist.parse(output_len), vocab=vocab, max_model_len=limit,
                seed=seed,
            )  # fmt: skip
    except ValueError as exc:
        raise _usage_error(exc) from None
    say(
        f"tuning {label} ({model_dir}) on {shapes.source}: {len(shapes)} requests, mean prompt "
        f"{shapes.mean_prompt:.0f} tokens, mean output {shapes.mean_output:.0f} tokens; base "
        f"options {json.dumps(base)}"
    )
    result = tuning.run(
        model_dir, shapes, base, seqs=seqs, tokens=tokens, block_sizes=blocks,
        max_seqs=max_seqs, objective=objective, max_step_ms=max_step_ms, warmup_s=warmup,
        measure_s=measure, min_steps=min_steps, clock=clock, confirm=confirm,
        confirm_runs=confirm_runs, log=say,
    )  # fmt: skip
    if result.chosen is None:
        say("error: no point ran; see the errors above")
        raise typer.Exit(int(ExitCode.ERROR))
    title = (
        f"{label}: {len(shapes)} requests (prompt {shapes.mean_prompt:.0f}, output "
        f"{shapes.mean_output:.0f} tokens mean), KV budget {_budget(base.get('kv_cache_memory'))}"
        f", {result.settings['device']}, {result.clock} time"
    )
    paths = tuning.write(result, report_dir or output.parent, output, title)
    c = result.chosen
    sat = result.saturation
    say(
        f"chosen: max_num_seqs {c.max_num_seqs}, max_num_batched_tokens "
        f"{c.max_num_batched_tokens}, block_size {c.block_size}: {c.value(objective):.1f} "
        f"{'output ' if objective == 'output' else ''}tok/s, running {c.mean_running:.1f}, step "
        f"{c.mean_step_ms:.1f} ms ({len(result.points)} points in {result.wall_s:.0f}s, "
        f"{result.clock} time)"
    )
    for name in ("kv_memory", "compute"):
        mark = sat.get(name)
        say(
            f"{name.replace('_', ' ')} saturates: "
            + (
                f"at max_num_seqs {mark['max_num_seqs']} (running {mark['running']:.1f})"
                if mark
                else "not within the sweep"
            )
        )
    say(f"wrote {paths['options']}, {paths['report']}, {paths['plot']}")


BENCH_HELP = """Measure the service under a workload: jobs arriving over time, tenants, priorities.

Drives a running service (--url, keys with --api-key / --tenant-key; --broker-url reaches its
workers for engine stats and per-request timings) or starts an embedded one (the API, a
control worker and a model worker on --database-url, default a SQLite file, and --broker-url,
a Redis database of its own). Jobs arrive as a Poisson process (--jobs, --rate) or by a
schedule (--schedule, JSONL lines {"at", "requests", "tenant", "priority"}); request shapes
come from a JSONL batch file (--workload) or from length distributions. Writes bench.json,
latency.png and timeline.png to --out and prints the table: TTFT, inter-token latency,
end-to-end time per request and per job, queue time per batch and per shard, input and output
tokens/s, engine occupancy (p50/p90/p99), RSS per process, and the requests rejected. Example:

  batchd bench --model demo:llama-25m --broker-url redis://127.0.0.1:6379/9 --jobs 8 \\
      --rate 0.5 --requests-per-job uniform:10:40 --tenants a:3,b:1 \\
      --priorities normal:3,high:1 --out bench/
"""


def bench(
    out: Annotated[Path, typer.Option(help="Directory for bench.json and the plots.")] = Path(
        "bench"
    ),
    url: Annotated[
        str | None, typer.Option(help="A running service's base URL (default: start one here).")
    ] = None,
    api_key: Annotated[
        str | None, typer.Option(help="Its key for tenants without --tenant-key.")
    ] = None,
    tenant_key: Annotated[
        list[str] | None, typer.Option(help="TENANT=KEY, once per tenant of a running service.")
    ] = None,
    broker_url: Annotated[
        str | None,
        typer.Option(
            help="Redis broker: the embedded service's (required then), or a running "
            "service's, to read engine stats and request timings."
        ),
    ] = None,  # fmt: skip
    database_url: Annotated[
        str | None, typer.Option(help="Embedded: its database (default: SQLite in --out).")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="The served model the requests name (default: the first of BATCHD_MODELS; "
            "with --url, the service's first generation model). Embedded, also demo:<preset>, "
            "served as batchd-demo: the random demo model, where speed matters more than words."
        ),
    ] = None,  # fmt: skip
    engine_options: EngineOptionsOpt = None,
    shard_requests: Annotated[
        int | None, typer.Option(min=1, help="Embedded: BATCHD_SHARD_MAX_REQUESTS.")
    ] = None,
    threads: ThreadsOpt = None,
    workload: WorkloadOpt = None,
    input_len: InputLenOpt = DEFAULT_INPUT_LEN,
    output_len: OutputLenOpt = DEFAULT_OUTPUT_LEN,
    jobs: Annotated[int, typer.Option(min=1, help="Jobs (batches) arriving…")] = 8,
    rate: Annotated[
        float, typer.Option(min=0.0, help="…as a Poisson process, jobs/s (0: all at once).")
    ] = 0.5,
    requests_per_job: Annotated[
        str, typer.Option(help="Requests per job (a distribution).")
    ] = "uniform:10:40",
    schedule: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="Jobs from a JSONL schedule instead."),
    ] = None,
    tenants: Annotated[str, typer.Option(help="Tenants with weights, a:3,b:1.")] = "default",
    priorities: Annotated[
        str, typer.Option(help="Priorities with weights, normal:3,high:1.")
    ] = "normal",
    seed: SeedOpt = 0,
    interval: Annotated[
        float, typer.Option(help="Seconds between engine and memory samples.")
    ] = 0.5,
    poll: Annotated[float, typer.Option(help="Seconds between batch status polls.")] = 0.5,
) -> None:
    import tempfile

    from cli.perf import bench as benching
    from cli.perf import bench_output
    from cli.perf.service import EmbeddedService, WorkerProbe
    from core.settings import get_settings

    settings = get_settings()
    served = dict(settings.models)
    if url is not None and model is None:
        key = api_key or next((k.partition("=")[2] for k in tenant_key or ()), None)
        model = _served_model(url, key)
    name = model or next(iter(served))
    if url is None and name not in served and name.startswith("demo:"):
        from core.settings import DEMO_MODEL_NAME

        served, name = {DEMO_MODEL_NAME: name}, DEMO_MODEL_NAME  # a demo preset, as batchd-demo
    if url is None and name not in served:
        raise typer.BadParameter(
            f"{name!r} is not served (BATCHD_MODELS: {', '.join(served)})", param_hint="--model"
        )
    try:
        make_lines, source = benching.job_lines(
            name, workload=workload, input_len=input_len, output_len=output_len
        )
        if schedule is not None:
            job_list = benching.schedule_jobs(make_lines, schedule, seed=seed)
        else:
            job_list = benching.poisson_jobs(
                make_lines, jobs=jobs, rate=rate, requests=requests_per_job, tenants=tenants,
                priorities=priorities, seed=seed,
            )  # fmt: skip
    except ValueError as exc:
        raise _usage_error(exc) from None
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-", dir=out))
    service = None
    probe = None
    try:
        if url is None:
            if not broker_url or not broker_url.startswith(("redis://", "rediss://")):
                say("error: the embedded service needs --broker-url redis://HOST:PORT/DB, a Redis "
                    "database of its own (engine stats and timings travel over it)")  # fmt: skip
                raise typer.Exit(int(ExitCode.USAGE))
            options = _engine_options(engine_options)
            overrides = {"BATCHD_RATE_LIMIT_PER_MINUTE": "0"}
            if shard_requests:
                overrides["BATCHD_SHARD_MAX_REQUESTS"] = str(shard_requests)
            if threads:
                overrides["OMP_NUM_THREADS"] = str(threads)
            db = database_url or f"sqlite:///{(work / 'bench.db').resolve()}"
            say(f"starting an embedded service in {work} (model {name}: {served.get(name)}) …")
            service = EmbeddedService(
                work, db, broker_url, {name: served[name]}, options, overrides,
                shard_concurrency=settings.worker_shard_concurrency,
            ).launch(sorted({j.tenant for j in job_list}))  # fmt: skip
            base_url, keys = service.base_url, dict(service.keys)
            probe = WorkerProbe(broker_url, [service.worker_name])
            pids = service.pids()
        else:
            base_url = url
            keys = {"*": api_key} if api_key else {}
            for item in tenant_key or ():
                tenant, sep, key = item.partition("=")
                if not sep:
                    raise typer.BadParameter("TENANT=KEY", param_hint="--tenant-key")
                keys[tenant] = key
            probe = WorkerProbe(broker_url) if broker_url else None
            pids = {}
        n_requests = sum(len(j.lines) for j in job_list)
        say(f"running {len(job_list)} jobs, {n_requests} requests ({source}) …")
        data = benching.run_workload(
            job_list, base_url=base_url, keys=keys, probe=probe, pids=pids, work=work,
            interval=interval, poll_s=poll,
            settings={
                "service": url or "embedded", "model": name, "workload": source,
                "jobs": len(job_list), "requests": n_requests,
                "arrival": f"schedule {schedule}" if schedule else f"poisson {rate}/s",
                "tenants": tenants, "priorities": priorities, "seed": seed,
            },
        )  # fmt: skip
        if service is not None:
            service.check_alive()
    finally:
        if probe is not None:
            probe.close()
        if service is not None:
            service.stop()
    report_path = out / "bench.json"
    report_path.write_text(json.dumps(data, indent=2) + "\n")
    title = f"batchd bench: {len(job_list)} jobs, {n_requests} requests, {source}"
    pngs = bench_output.plots(data, out, title)
    typer.echo(bench_output.table(data))
    say(f"wrote {report_path}, {', '.join(str(p) for p in pngs)}")
    job_counts = data["counts"]["jobs"]
    if not job_counts["completed"]:
        # Nothing was measured: a pipeline that runs the benchmark must not read it as a pass.
        say(
            f"error: none of the {job_counts['submitted']} jobs completed "
            f"({job_counts['rejected']} rejected; see {report_path})"
        )
        raise typer.Exit(int(ExitCode.ERROR))


def _served_model(url: str, api_key: str | None) -> str:
    """The running service's first generation model (its ``/v1/models``), which the requests
    name when ``--model`` does not: this machine's ``BATCHD_MODELS`` says nothing of it."""
    from cli.client import BatchdClient, ClientError

    try:
        with BatchdClient(url, api_key) as client:
            models = client.list_models()
    except ClientError as exc:
        say(f"error: cannot list the models of {url} (give --model): {exc.message}")
        raise typer.Exit(int(ExitCode.USAGE)) from None
    for m in models:
        if "/v1/completions" in (m.get("endpoints") or ()):
            return str(m["id"])
    if not models:
        say(f"error: {url} serves no model")
        raise typer.Exit(int(ExitCode.USAGE))
    return str(models[0]["id"])


def _unwrap(text: str) -> str:
    """Paragraphs on one line each (the help formatter wraps them); indented lines (the
    examples) as they are."""
    out: list[str] = []
    for line in text.strip().splitlines():
        if line and not line.startswith(" ") and out and out[-1] and not out[-1].startswith(" "):
            out[-1] += " " + line
        else:
            out.append(line)
    return "\n".join(out)


def register(app: typer.Typer) -> None:
    app.command(name="tune", help=_unwrap(TUNE_HELP))(tune)
    app.command(name="bench", help=_unwrap(BENCH_HELP))(bench)
