"""The table and the two plots (latency.png, timeline.png) of ``batchd bench``'s report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

UNITS = {
    "ttft_s": ("TTFT", "s"),
    "itl_s": ("inter-token latency", "s"),
    "request_e2e_s": ("request e2e (job arrival → finished)", "s"),
    "job_e2e_s": ("job e2e (upload → downloaded)", "s"),
    "batch_queue_s": ("queue per batch (created → first run)", "s"),
    "shard_queue_s": ("queue per shard (created → first run)", "s"),
    "input_tok_s": ("input tokens/s (engines)", ""),
    "output_tok_s": ("output tokens/s (engines)", ""),
    "engine_occupancy": ("engine occupancy", ""),
}


def table(data: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = [f"{'metric':44} {'n':>6} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9} {'max':>9}"]
    rows = [(UNITS[k][0] + (f" ({UNITS[k][1]})" if UNITS[k][1] else ""), v)
            for k, v in data["distributions"].items()]  # fmt: skip
    rows += [(f"RSS {name} (MB)", v) for name, v in data["rss_mb"].items()]
    for label, s in rows:
        lines.append(
            f"{label:44} {s['n']:>6} "
            + " ".join(f"{fmt(s[k]):>9}" for k in ("mean", "p50", "p90", "p99", "max"))
        )
    c = data["counts"]
    jobs, req = c["jobs"], c["requests"]
    peak = ", ".join(f"{k} {v:.0f}" for k, v in data["peak_rss_mb"].items())
    lines += [
        f"peak RSS (MB): {peak}",
        f"jobs: {jobs['submitted']} submitted, {jobs['completed']} completed, "
        f"{jobs['rejected']} rejected, other {jobs['other'] or 'none'}",
        f"requests: {req['submitted']} submitted, {req['completed']} completed, "
        f"{req['failed']} failed {req['error_codes'] or ''}, {req['rejected']} rejected, "
        f"{req['unaccounted']} unaccounted",
        f"totals over {data['wall_s']:.1f}s: {data['totals']['input_tokens']} input tokens "
        f"({data['totals']['input_tok_s']:.1f}/s), {data['totals']['output_tokens']} output "
        f"tokens ({data['totals']['output_tok_s']:.1f}/s)",
    ]
    return "\n".join(lines)


def plots(data: dict[str, Any], out_dir: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, values in data["latency_samples"].items():
        v = sorted(values)
        if v:
            axes[0].plot(v, [(i + 1) / len(v) for i in range(len(v))], label=UNITS[name][0])
    axes[0].set_xscale("log")
    axes[0].set_xlabel("seconds")
    axes[0].set_ylabel("fraction of requests")
    axes[0].set_title("per-request latency (CDF)")
    _legend(axes[0])
    axes[0].grid(True, alpha=0.3)
    d = data["distributions"]
    names = ["job_e2e_s", "batch_queue_s", "shard_queue_s"]
    xs = range(len(names))
    for q, offset in (("p50", -0.25), ("p90", 0.0), ("p99", 0.25)):
        axes[1].bar([x + offset for x in xs], [d[n][q] or 0 for n in names], 0.25, label=q)
    axes[1].set_xticks(list(xs), ["job e2e", "queue/batch", "queue/shard"])
    axes[1].set_ylabel("seconds")
    axes[1].set_title("jobs and queues")
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    paths.append(out_dir / "latency.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for name in ("input_tok_s", "output_tok_s"):
        pts = data["series"][name]
        axes[0].plot([t for t, _ in pts], [v for _, v in pts], ".-", label=UNITS[name][0])
    axes[0].set_ylabel("tokens/s")
    _legend(axes[0])
    pts = data["series"]["engine_occupancy"]
    axes[1].plot([t for t, _ in pts], [v for _, v in pts], ".-")
    axes[1].set_ylabel("engine occupancy")
    axes[1].set_ylim(0, 1.05)
    for name, pts in data["rss_series_mb"].items():
        axes[2].plot([t for t, _ in pts], [v for _, v in pts], label=name)
    axes[2].set_ylabel("RSS (MB)")
    axes[2].set_xlabel("seconds since the first job")
    _legend(axes[2])
    for job in data["jobs"]:
        axes[0].axvline(job["at"], color="grey", alpha=0.2)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    paths.append(out_dir / "timeline.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def _legend(ax: Any) -> None:
    """A legend where something was drawn (a run with no samples draws nothing to label)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
