"""What ``benchmarks.eta`` records while its job runs, to show why the projection moves.

What ``benchmarks.eta`` records while its job runs, so that a reader can see the projection's
curve and why it moves: every half second the job's projected completion and progress (by
requests, and by estimated tokens as ``core.eta.store`` reads the shards), each tenant's work
retired so far on the model (its share of the engine), the machine's load, and every result
line the job has committed (read from ``GET /v1/batches/{id}/results`` as it appears, with its
usage). Nothing here imports ``tests``.
"""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy import create_engine, text

# Progress and shares as the projections read them: a shard's estimated tokens prorated by
# its committed requests (``core.eta.store.model_batches``).
_JOB = text(
    """
    SELECT count(*) AS shards,
           count(*) FILTER (WHERE released_at IS NOT NULL) AS released,
           count(*) FILTER (WHERE status = 'done') AS done_shards,
           sum(est_tokens) AS total,
           sum(CASE WHEN num_requests > 0
                    THEN est_tokens::float * done_requests / num_requests ELSE 0 END) AS done,
           sum(CASE WHEN status = 'done' THEN est_tokens ELSE 0 END) AS done_whole,
           sum(done_requests) AS done_requests
    FROM shards WHERE batch_id = :id
    """
)
_TENANTS = text(
    """
    SELECT b.tenant,
           sum(CASE WHEN s.num_requests > 0
                    THEN s.est_tokens::float * s.done_requests / s.num_requests ELSE 0 END),
           sum(CASE WHEN s.released_at IS NOT NULL AND s.status IN ('pending', 'running')
                    THEN s.est_tokens ELSE 0 END),
           sum(b.output_tokens) FILTER (WHERE s.index = 0)
    FROM shards s JOIN batches b ON b.id = s.batch_id
    GROUP BY b.tenant
    """
)
_SHARDS = text(
    """
    SELECT index, start_line, end_line, num_requests, est_tokens, status, attempts,
           released_at, updated_at
    FROM shards WHERE batch_id = :id ORDER BY index
    """
)


def _rel(value: Any, t0: float) -> float | None:
    return None if value is None else round(value.timestamp() - t0, 3)


class Recorder:
    """Samples the job and the model's tenants; ``series`` and ``lines`` are the record."""

    def __init__(self, database_url: str, client: Any, batch_id: str, t0: float):
        self.db = create_engine(database_url, pool_size=1, max_overflow=0)
        self.client, self.batch_id, self.t0 = client, batch_id, t0
        self.series: list[dict[str, Any]] = []
        self.lines: list[list[Any]] = []  # [seen at (s from t0), custom_id, prompt, completion]
        self._after: str | None = None

    def close(self) -> None:
        self.db.dispose()

    def shards(self) -> list[dict[str, Any]]:
        """The job's shards as they ended: lines, estimated tokens, released and last updated
        (seconds from t0)."""
        with self.db.connect() as conn:
            rows = conn.execute(_SHARDS, {"id": self.batch_id}).mappings().all()
        return [
            {**r, "released_at": _rel(r["released_at"], self.t0),
             "updated_at": _rel(r["updated_at"], self.t0)}
            for r in rows
        ]  # fmt: skip

    def sample(self, batch: dict[str, Any], t: float) -> None:
        counts = batch["request_counts"]
        with self.db.connect() as conn:
            job = conn.execute(_JOB, {"id": self.batch_id}).mappings().one()
            tenants = {
                r[0]: {"done_est": float(r[1] or 0), "released_est": int(r[2] or 0),
                       "output_tokens": int(r[3] or 0)}
                for r in conn.execute(_TENANTS)
            }  # fmt: skip
        self._read_results(t)
        predicted = batch.get("estimated_completion_at")
        total = float(job["total"] or 0)
        self.series.append({
            "t": round(t - self.t0, 3),
            "status": batch["status"],
            "progress_requests": (counts["completed"] + counts["failed"]) / max(1, counts["total"]),
            "progress_est": float(job["done"] or 0) / total if total else None,
            "progress_est_whole_shards": float(job["done_whole"] or 0) / total if total else None,
            "predicted_in_s": None if predicted is None else round(float(predicted) - self.t0, 3),
            "shards_released": int(job["released"] or 0),
            "shards_done": int(job["done_shards"] or 0),
            "lines_seen": len(self.lines),
            "tenants": tenants,
            "loadavg_1m": os.getloadavg()[0],
        })  # fmt: skip

    def _read_results(self, t: float) -> None:
        while True:
            params: dict[str, Any] = {"limit": 1000}
            if self._after is not None:
                params["after"] = self._after
            r = self.client.http.get(f"/batches/{self.batch_id}/results", params=params)
            r.raise_for_status()
            page = r.json()
            for line in page["data"]:
                usage = ((line.get("response") or {}).get("body") or {}).get("usage") or {}
                self.lines.append([
                    round(t - self.t0, 3), line.get("custom_id"),
                    usage.get("prompt_tokens"), usage.get("completion_tokens"),
                ])  # fmt: skip
            if page["last_id"] is not None:
                self._after = page["last_id"]
            if not page["has_more"]:
                return


def curve(series: list[dict[str, Any]], actual: float) -> list[dict[str, Any]]:
    """The projection against the actual completion (``actual`` seconds from t0) at every
    sample of the running job that had one."""
    return [
        {"t": x["t"], "progress": round(x["progress_requests"], 4),
         "predicted_minus_actual_s": round(x["predicted_in_s"] - actual, 3),
         "error_of_duration": round((x["predicted_in_s"] - actual) / max(1e-9, actual), 4)}
        for x in series
        if x["status"] == "in_progress" and x["predicted_in_s"] is not None
    ]  # fmt: skip


def phases(series: list[dict[str, Any]], tenant: str, parts: int = 4) -> list[dict[str, Any]]:
    """The job's run cut into ``parts`` equal spans of time: the estimated tokens per second
    the job (``tenant``) and all tenants together retired in each, the job's share of them, and
    the machine's mean 1-minute load: what moves the job's rate."""
    run = [x for x in series if x["status"] == "in_progress"]
    if len(run) < parts + 1:
        return []
    t0, t1 = run[0]["t"], run[-1]["t"]
    out = []
    for k in range(parts):
        lo, hi = t0 + (t1 - t0) * k / parts, t0 + (t1 - t0) * (k + 1) / parts
        inside = [x for x in run if lo <= x["t"] <= hi]
        a, b = inside[0], inside[-1]
        dt = max(1e-9, b["t"] - a["t"])

        def retired(x: dict[str, Any], who: str | None) -> float:
            return sum(v["done_est"] for k, v in x["tenants"].items() if who in (None, k))

        job = (retired(b, tenant) - retired(a, tenant)) / dt
        total = (retired(b, None) - retired(a, None)) / dt
        out.append({
            "from_s": round(lo, 1), "to_s": round(hi, 1),
            "job_tokens_per_s": round(job, 1), "all_tokens_per_s": round(total, 1),
            "job_share": round(job / total, 3) if total > 0 else None,
            "loadavg_1m": round(sum(x["loadavg_1m"] for x in inside) / len(inside), 2),
        })  # fmt: skip
    return out
